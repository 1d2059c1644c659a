"""Section 8: the decode step's attention — the slot cache's blocked attention vs torch SDPA.

One decode step's attention for one layer at batch 64 with SmolLM2-135M's shapes (9 query heads,
3 kv heads, head dim 64), over ``--keys`` visible keys of a slot cache of 1,024 positions:

* ours: ``mempo_jax.model.attention_xla.blocked_attention`` reading layer 5 of a 30-layer
  ``[layers, slots, kv_heads, 1024, head_dim]`` float32 cache (what ``Decoder`` with a cache runs per layer
  and decode step: key blocks of 256 sliced out of the cache, online softmax);
* transformers' kernel: ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on the
  same keys as contiguous ``[64, 3, keys, 64]`` tensors (what a contiguous per-layer cache gives it).

Both outputs are checked equal. The figure bounds the cached engine's decode: at batch 64 a step of
SmolLM2 spends about 100 ms in its weight matmuls (XLA and torch at par) and, per layer, the
attention timed here (x 30 layers).

Run: ``python benchmarks/bench_attention.py [--json out.json] [--small]``.
"""

from __future__ import annotations

import sys

from common import alternate, have_transformers, median, parser, setup_platform, table, write_json


def main(argv=None) -> dict:
    """Time both attentions at each key count; print the table; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--keys", default=None, help="comma-separated visible keys (default 256,512,768)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side (alternating)")
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mempo_jax.model.attention_mask import AttentionMask

    from mempo_jax.model.attention_xla import blocked_attention

    small = args.small
    layers, batch, kvh, heads, hd, size, block = (2, 8, 1, 2, 16, 128, 32) if small else (30, 64, 3, 9, 64, 1024, 256)
    keys = [int(x) for x in (args.keys or ("64,96" if small else "256,512,768")).split(",")]
    rng = np.random.default_rng(0)
    ck = rng.standard_normal((layers, batch, kvh, size, hd), dtype=np.float32)
    cv = rng.standard_normal((layers, batch, kvh, size, hd), dtype=np.float32)
    q = rng.standard_normal((batch, 1, heads, hd), dtype=np.float32)
    ck_j, cv_j, q_j, layer = jnp.asarray(ck), jnp.asarray(cv), jnp.asarray(q), min(5, layers - 1)
    ours_fn = jax.jit(lambda q, k, v, pos, bound: blocked_attention(q, k, v, AttentionMask.cached(pos), layer=jnp.int32(layer),
                                                                    kv_bound=bound, block_k=block))
    torch = None
    if have_transformers():
        import torch
    rows = []
    for n in keys:
        pos = jnp.full((batch, 1), n - 1, jnp.int32)
        got = {}

        def ours():
            got["ours"] = np.asarray(jax.block_until_ready(ours_fn(q_j, ck_j, cv_j, pos, jnp.int32(n))))

        fns = {"ours": ours}
        if torch is not None:
            tq = torch.tensor(q).permute(0, 2, 1, 3)  # [B, heads, 1, hd]
            tk = torch.tensor(ck[layer, :, :, :n]).contiguous()
            tv = torch.tensor(cv[layer, :, :, :n]).contiguous()

            def theirs():
                with torch.no_grad():
                    got["torch"] = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

            fns["torch"] = theirs
        times = alternate(fns, args.repeats)
        row = {"keys": n, "ours_ms": 1e3 * median(times["ours"])}
        if torch is not None:
            row["torch_ms"] = 1e3 * median(times["torch"])
            row["ours_over_torch_time"] = row["ours_ms"] / row["torch_ms"]
            row["max_abs_diff"] = float(np.max(np.abs(got["ours"] - got["torch"].permute(0, 2, 1, 3).numpy())))
        rows.append(row)
        print(f"[bench_attention] {n} keys: ours {row['ours_ms']:.2f} ms"
              + (f", torch SDPA {row['torch_ms']:.2f} ms ({row['ours_over_torch_time']:.2f}x the time)"
                 if torch is not None else ""), flush=True)
    print(table(f"Decode attention, one layer, batch {batch}, {heads} heads / {kvh} kv heads x {hd} (ms)",
                ["keys", "ours ms", "torch SDPA ms", "ours / torch (time)", "max |diff|"],
                [[r["keys"], r["ours_ms"], r.get("torch_ms", "-"), r.get("ours_over_torch_time", "-"),
                  r.get("max_abs_diff", "-")] for r in rows]))
    config = {"layers": layers, "batch": batch, "kv_heads": kvh, "heads": heads, "head_dim": hd, "cache_size": size,
              "block": block, "dtype": "float32", "repeats": args.repeats, "small": small, "device": args.device}
    return write_json(args.json, "decode_attention", config, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
