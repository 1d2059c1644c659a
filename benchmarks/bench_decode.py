"""Sections 1-2: decode and prefill tokens/s, ours vs transformers on the same weights.

Decode: greedy generation of ``--new`` tokens after a ``--prompt``-token prompt at each batch
size, with a KV cache on both sides: ours is ``mempo_jax.agent.engine.RolloutEngine`` (one jitted prefill +
``lax.while_loop`` decode), theirs is ``transformers`` ``generate(do_sample=False,
use_cache=True, min_new_tokens=max_new_tokens)`` on CPU torch, on the weights exported by
``save_hf_checkpoint``. Tokens/s = batch × new tokens / wall time of the whole call (its prefill
included, on both sides). Runs alternate (ours, theirs, ours, …) after one warm-up call each
(ours compiles there). The first greedy tokens are checked equal.

Prefill: one batch-1 prompt of each ``--prefill`` length: ours is the sampler with one new token
(prefill into the KV cache + one pick), theirs a ``use_cache=True`` forward; tokens/s = length /
wall time.

Run: ``python benchmarks/bench_decode.py [--json out.json] [--small]``.
"""

from __future__ import annotations

import sys
import tempfile

from common import (alternate, bench_model, have_transformers, hf_same_weights, median, param_count, parser,
                    setup_platform, table, write_json)


def main(argv=None) -> dict:
    """Run the decode and prefill comparison; print the tables; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default=None, help="comma-separated decode batch sizes (default 1,16,64)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=None, help="new tokens (default 128)")
    p.add_argument("--prefill", default=None, help="comma-separated prefill lengths (default 512,2048)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side (alternating)")
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import numpy as np

    from mempo_jax.agent.engine import RolloutEngine

    small = args.small
    batches = [int(x) for x in (args.batches or ("1,4" if small else "1,16,64")).split(",")]
    prompt = args.prompt or (16 if small else 128)
    new = args.new or (8 if small else 128)
    prefills = [int(x) for x in (args.prefill or ("32" if small else "512,2048")).split(",")]
    cfg, graphdef, params = bench_model(small)
    sampler = RolloutEngine(graphdef, cfg, stop_ids=(), pad_id=0)
    hf = None
    tmp = tempfile.TemporaryDirectory()
    if have_transformers():
        import torch

        hf = hf_same_weights(cfg, params, tmp.name)
    else:
        print("[bench_decode] torch/transformers not installed: ours only (pip install -r requirements-test.txt)")

    rng = np.random.default_rng(0)
    decode, prefill = [], []
    for b in batches:
        ids = rng.integers(1, cfg.vocab_size, (b, prompt)).astype(np.int32)
        mask = np.ones((b, prompt), bool)
        key = jax.random.PRNGKey(0)
        sc = dict(max_new_tokens=new, temperature=0.0)
        ours_tokens = {}

        def ours():
            out = sampler(params, ids, mask, key, **sc)
            ours_tokens["t"] = np.asarray(jax.block_until_ready(out.tokens))

        fns = {"ours": ours}
        if hf is not None:
            t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
            theirs_tokens = {}

            def theirs():
                with torch.no_grad():
                    out = hf.generate(input_ids=t_ids, attention_mask=t_mask, do_sample=False, use_cache=True,
                                      max_new_tokens=new, min_new_tokens=new)
                theirs_tokens["t"] = out[:, prompt:].numpy()

            fns["transformers"] = theirs
        times = alternate(fns, args.repeats)
        row = {"batch": b, "prompt": prompt, "new_tokens": new,
               "ours_s": times["ours"], "ours_tok_s": b * new / median(times["ours"])}
        if hf is not None:
            row["transformers_s"] = times["transformers"]
            row["transformers_tok_s"] = b * new / median(times["transformers"])
            row["ratio"] = row["ours_tok_s"] / row["transformers_tok_s"]
            # greedy agreement: same first tokens (float32 on both sides; later tokens may flip on ties)
            k = min(8, new)
            row["first_tokens_equal"] = float(np.mean(ours_tokens["t"][:, :k] == theirs_tokens["t"][:, :k]))
        decode.append(row)
        print(f"[bench_decode] batch {b}: ours {row['ours_tok_s']:.1f} tok/s"
              + (f", transformers {row['transformers_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}" if hf else ""),
              flush=True)

    for n in prefills:
        ids = rng.integers(1, cfg.vocab_size, (1, n)).astype(np.int32)
        mask = np.ones((1, n), bool)
        sc = dict(max_new_tokens=1, temperature=0.0)
        fns = {"ours": lambda: jax.block_until_ready(sampler(params, ids, mask, jax.random.PRNGKey(0), **sc).tokens)}
        if hf is not None:
            t_ids = torch.tensor(ids, dtype=torch.long)

            def theirs():
                with torch.no_grad():
                    hf(input_ids=t_ids, use_cache=True)

            fns["transformers"] = theirs
        times = alternate(fns, args.repeats)
        row = {"tokens": n, "ours_s": times["ours"], "ours_tok_s": n / median(times["ours"])}
        if hf is not None:
            row["transformers_s"] = times["transformers"]
            row["transformers_tok_s"] = n / median(times["transformers"])
            row["ratio"] = row["ours_tok_s"] / row["transformers_tok_s"]
        prefill.append(row)
        print(f"[bench_decode] prefill {n}: ours {row['ours_tok_s']:.0f} tok/s"
              + (f", transformers {row['transformers_tok_s']:.0f} tok/s, ratio {row['ratio']:.2f}" if hf else ""),
              flush=True)
    tmp.cleanup()

    print(table(f"Decode, greedy, KV cache ({param_count(params) / 1e6:.1f} M params, prompt {prompt}, "
                f"{new} new tokens; tokens/s = batch x new / wall)",
                ["batch", "ours tok/s", "transformers tok/s", "ours / transformers"],
                [[r["batch"], r["ours_tok_s"], r.get("transformers_tok_s", "-"), r.get("ratio", "-")] for r in decode]))
    print()
    print(table("Prefill, batch 1 (tokens/s = length / wall)", ["tokens", "ours tok/s", "transformers tok/s",
                                                                  "ours / transformers"],
                [[r["tokens"], r["ours_tok_s"], r.get("transformers_tok_s", "-"), r.get("ratio", "-")] for r in prefill]))
    target = next((r for r in decode if r["batch"] == 64 and "ratio" in r), None)
    results = {"decode": decode, "prefill": prefill,
               "target_decode_b64_ratio_ge_3": None if target is None else bool(target["ratio"] >= 3.0)}
    config = {"model": {k: getattr(cfg, k) for k in ("vocab_size", "embed_dim", "num_layers", "num_heads",
                                                      "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias")},
              "params": param_count(params), "dtype": "float32", "repeats": args.repeats, "small": small,
              "device": args.device}
    return write_json(args.json, "decode_prefill", config, results)


if __name__ == "__main__":
    main(sys.argv[1:])
