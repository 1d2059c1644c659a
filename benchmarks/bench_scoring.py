"""Section 3: memory-reward scoring, the stacked ``[full; mem]`` single call vs two separate calls
vs transformers forward passes, for the same tokens on the same weights.

M synthetic ``<mem>`` turns: a full-history context (``--full_len`` tokens, varied), a memory
context (``--mem_len`` tokens, varied) and an answer Z (4 tokens). Three ways to get
``P(Z | full)`` and ``P(Z | mem)`` (docs/algorithm.md §3):

* stacked packed: ``MemoryRewardScorer`` with ``chunk_rows = 2M`` — one jitted call over the
  stacked rows packed end to end (segment ids, per-segment positions, LM head on Z's tokens only;
  ``mempo_jax.core.packing``);
* stacked padded: one call over the stacked ``[2M, L]`` batch (``build_scoring_batch``), every
  row padded to the longest (the reference's single ``compute_log_prob``), scored by
  ``token_stats`` and ``answer_likelihood``;
* two calls: the padded program on the ``[M, L_full]`` full rows, then on the ``[M, L_mem]``
  memory rows (each padded to its own length bucket);
* transformers: forward passes of the exported model on the same two padded batches
  (right padding, attention mask), log-softmax, the same length-normalised likelihood.

The probabilities of the three are checked equal (max abs difference reported).

Run: ``python benchmarks/bench_scoring.py [--json out.json] [--small]``.
"""

from __future__ import annotations

import sys
import tempfile

from common import (alternate, bench_model, have_transformers, hf_same_weights, median, param_count, parser,
                    setup_platform, table, write_json)


def main(argv=None) -> dict:
    """Run the scoring comparison; print the table; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=None, help="M, memory turns scored (default 16)")
    p.add_argument("--full_len", type=int, default=None, help="longest full-history context (default 224)")
    p.add_argument("--mem_len", type=int, default=None, help="longest memory context (default 48)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import numpy as np

    from mempo_jax.core.batching import bucket_length
    from mempo_jax.model.forward import make_logits_fn, token_stats
    from mempo_jax.rl.memory_reward import MemoryRewardScorer, answer_likelihood, build_scoring_batch

    small = args.small
    m = args.turns or (4 if small else 16)
    full_len = args.full_len or (24 if small else 224)
    mem_len = args.mem_len or (8 if small else 48)
    cfg, graphdef, params = bench_model(small)
    rng = np.random.default_rng(0)
    full = [rng.integers(3, cfg.vocab_size, int(rng.integers(full_len // 2, full_len + 1))).tolist() for _ in range(m)]
    mem = [rng.integers(3, cfg.vocab_size, int(rng.integers(mem_len // 2, mem_len + 1))).tolist() for _ in range(m)]
    answers = [rng.integers(3, cfg.vocab_size, 4).tolist() for _ in range(m)]
    prefix = [1, 2]
    rows = bucket_length(2 * m, 8)
    fn = make_logits_fn(graphdef)
    likelihoods = jax.jit(lambda p, ids, valid, am: answer_likelihood(token_stats(fn, p, ids, valid=valid,
                                                                                  grad=False)[0], am))
    stacked_b = build_scoring_batch(full, mem, answers, prefix, 0, pad_rows_to_bucket=True, min_rows=8)
    packed = MemoryRewardScorer(make_logits_fn(graphdef), 0, prefix, chunk_rows=rows, min_length=16)
    packed_shapes = []
    call = packed.packed_logprobs
    packed.packed_logprobs = lambda *a: packed_shapes.append(list(a[1].shape)) or call(*a)

    def split_batch(contexts):
        ids, valid, am = build_scoring_batch(contexts, contexts, answers, prefix, 0)
        return ids[:m], valid[:m], am[:m]  # the first half: ``contexts`` rows only, own length bucket

    full_b, mem_b = split_batch(full), split_batch(mem)
    out = {}

    def stacked_packed():
        out["packed"] = packed(params, full, mem, answers)

    def stacked():
        p = np.asarray(jax.device_get(likelihoods(params, *stacked_b)))
        out["stacked"] = (p[:m], p[m : 2 * m])

    def two_calls():
        pf = np.asarray(jax.device_get(likelihoods(params, *full_b)))
        pm = np.asarray(jax.device_get(likelihoods(params, *mem_b)))
        out["two"] = (pf, pm)

    fns = {"stacked_packed": stacked_packed, "stacked": stacked, "two_calls": two_calls}
    tmp = tempfile.TemporaryDirectory()
    if have_transformers():
        import torch

        hf = hf_same_weights(cfg, params, tmp.name)

        def hf_p(batch):
            ids, valid, am = (torch.tensor(np.asarray(x)) for x in batch)
            with torch.no_grad():
                logits = hf(input_ids=ids.long(), attention_mask=valid.long()).logits
            logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids.long()[:, 1:, None])[..., 0]
            mask = am[:, 1:].float()
            mean = (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return torch.where(mask.sum(-1) > 0, mean.exp(), torch.zeros_like(mean)).numpy()

        def theirs():
            out["hf"] = (hf_p(full_b), hf_p(mem_b))

        fns["transformers"] = theirs
    else:
        print("[bench_scoring] torch/transformers not installed: ours only")
    times = alternate(fns, args.repeats)
    tmp.cleanup()
    tokens = int(sum(len(c) + len(prefix) + 4 for c in full + mem))
    res = {"turns": m, "real_tokens": tokens,
           "shapes": {"stacked": list(stacked_b[0].shape),
                      "stacked_packed": packed_shapes[-1], "full": list(full_b[0].shape), "mem": list(mem_b[0].shape)}}
    for k, v in times.items():
        res[f"{k}_s"] = v
        res[f"{k}_tok_s"] = tokens / median(v)
    s_full, s_mem = out["stacked"]
    res["max_abs_diff_two_calls"] = float(max(np.abs(s_full - out["two"][0]).max(), np.abs(s_mem - out["two"][1]).max()))
    if "hf" in out:
        res["max_abs_diff_transformers"] = float(max(np.abs(s_full - out["hf"][0]).max(),
                                                     np.abs(s_mem - out["hf"][1]).max()))
        res["ratio_stacked_vs_transformers"] = median(times["transformers"]) / median(times["stacked"])
    res["ratio_stacked_vs_two_calls"] = median(times["two_calls"]) / median(times["stacked"])
    pk = out["packed"]
    res["max_abs_diff_packed_vs_padded"] = float(max(np.abs(pk.p_full - s_full).max(), np.abs(pk.p_mem - s_mem).max()))
    res["packed_time_over_two_calls"] = median(times["stacked_packed"]) / median(times["two_calls"])
    res["target_packed_le_0_8_of_two_calls"] = bool(res["packed_time_over_two_calls"] <= 0.8)
    base = median(times["stacked_packed"])
    rows_out = [["stacked [full; mem] packed, 1 call", f"{res['shapes']['stacked_packed']}", base,
                 res["stacked_packed_tok_s"], 1.0],
                ["stacked [full; mem] padded, 1 call", f"{res['shapes']['stacked']}", median(times["stacked"]),
                 res["stacked_tok_s"], median(times["stacked"]) / base],
                ["two padded calls (full, mem)", f"{res['shapes']['full']} + {res['shapes']['mem']}",
                 median(times["two_calls"]), res["two_calls_tok_s"], median(times["two_calls"]) / base]]
    if "transformers_s" in res:
        rows_out.append(["transformers forward x2", f"{res['shapes']['full']} + {res['shapes']['mem']}",
                         median(times["transformers"]), res["transformers_tok_s"], median(times["transformers"]) / base])
    print(table(f"Memory-reward scoring, M = {m} turns, {tokens} real tokens ({param_count(params) / 1e6:.1f} M params)",
                ["method", "shapes", "seconds (median)", "real tok/s", "time / packed time"], rows_out))
    print(f"packed / two padded calls: {res['packed_time_over_two_calls']:.2f} (target <= 0.8)")
    print(f"max |P| difference: packed vs padded {res['max_abs_diff_packed_vs_padded']:.2e}, "
          f"two calls {res['max_abs_diff_two_calls']:.2e}"
          + (f", transformers {res['max_abs_diff_transformers']:.2e}" if "max_abs_diff_transformers" in res else ""))
    config = {"params": param_count(params), "full_len": full_len, "mem_len": mem_len, "repeats": args.repeats,
              "small": small, "device": args.device}
    return write_json(args.json, "scoring", config, res)


if __name__ == "__main__":
    main(sys.argv[1:])
