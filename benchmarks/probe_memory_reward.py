"""Does R_M tell a memory that kept what it saw from one that dropped it?

Samples k = 1 episodes of a tiny-world policy on held-out bridge and multi-objective questions
(at the run's sampling temperature, as RL samples them), labels each well-formed memory before the answering turn:

* bridge: ``kept`` when the birth city, shown by an earlier tool result, is in this ``<mem>``
  (whole words, ``diagnose_skills._contains``), ``dropped`` when it is not;
* multi-objective: ``kept`` when every sub-answer an earlier tool result showed is in this
  ``<mem>``, ``dropped`` when one is missing;

and scores every labelled memory with the policy's own ``MemoryRewardScorer`` under the four
views of ``RLConfig``: baseline ``full`` (docs/algorithm.md §3) or ``input`` (the context the memory was
written from), each without and with ``memory_hindsight`` (both views end with the tool results
of turns t..). R_M in probability units (P_mem − P_full, Z = gold). A lever can only teach what
to remember if ``gap = mean R_M(kept) − mean R_M(dropped)`` is clearly above 0 and large
against the spread of R_M within a group. Episodes whose later searches never found Z have R_M
~0 under every view, kept or not, so the gap is also given over the memories whose full view
knows Z (``P_full >= 0.5`` under that view: ``gap | knows``, with their count).

Run: ``python benchmarks/probe_memory_reward.py --run_dir RUN [--stage sft|rl] [--num 60]
[--samples 4] [--json F]`` (RUN: a tiny-world run, e.g. an ablation's ``seed0/sft``).
"""

from __future__ import annotations

import sys

import numpy as np

from common import parser, setup_platform, table, tiny_world_policy, write_json
from diagnose_skills import _contains

VIEWS = (("full", False), ("full", True), ("input", False), ("input", True))


def memory_labels(q, traj, tokenizer) -> list[tuple[int, str]]:
    """``[(turn, "kept" | "dropped")]`` for the well-formed memories of ``traj`` written after a
    tool result showed what ``q`` needs (the birth city for bridge, a sub-answer for multi) and
    before the answering turn (whose memory may rightly replace the city by the answer)."""
    if q.kind == "bridge":
        needed = [[q.hops[0][1][0].removeprefix("born in ")]]
    elif q.kind == "multi":
        needed = [list(g) for g in q.golds]
    else:
        return []
    labels, seen = [], ""
    last = len(traj.turns) - 1 if traj.answer is not None else len(traj.turns)
    for t, turn in enumerate(traj.turns[:last]):
        parsed = turn.parsed  # the rollout's own parse (a turn that hit its budget is malformed)
        shown = [n for n in needed if _contains(seen, n)]
        if shown and parsed.error is None and parsed.mem is not None and traj.mem_traj(t) is not None:
            labels.append((t, "kept" if all(_contains(parsed.mem, n) for n in shown) else "dropped"))
        seen += " " + tokenizer.decode(turn.observation_ids)
    return labels


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run_dir", required=True)
    p.add_argument("--stage", default="sft", choices=("sft", "rl"))
    p.add_argument("--num", type=int, default=60, help="held-out questions per kind")
    p.add_argument("--samples", type=int, default=4, help="sampled episodes per question")
    args = p.parse_args(argv)
    if args.small:
        args.num, args.samples = 4, 2
    setup_platform(args.device)
    import jax

    from mempo_jax.agent.trajectory import FULL
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.rl.memory_reward import MemoryRewardScorer
    from mempo_jax.rl.memory_views import memory_contexts
    from mempo_jax.run.evaluation import evaluate_policy
    from mempo_jax.run.experiment import answer_prefix_ids

    cfg, world, sample_fn, params, fmt, env, rollout, policy = tiny_world_policy(args.run_dir, args.stage)
    tok = fmt.tokenizer
    full_prefix, answer_prefix = answer_prefix_ids(tok, cfg.rl.memory_reward.prefix)
    temperature = cfg.rl.rollout.temperature or 1.0
    scorer = MemoryRewardScorer(make_logits_fn(sample_fn.sampler.graphdef), tok.pad_id, answer_prefix, full_prefix=full_prefix,
                                temperature=temperature)
    results: dict = {}
    lines = []
    for kind in ("bridge", "multi"):
        qs = [q for q in world.heldout if q.kind == kind][: args.num] * args.samples
        res = evaluate_policy(sample_fn, params, qs, fmt, env, rollout, 1, temperature, jax.random.PRNGKey(0))
        labelled = [(i, t, lab) for i, (q, tr) in enumerate(zip(qs, res.trajectories))
                    for t, lab in memory_labels(q, tr, tok)]
        if not labelled:
            print(f"[probe] {kind}: no labelled memories in {len(qs)} episodes", flush=True)
            continue
        is_kept = np.array([lab == "kept" for _, _, lab in labelled])
        results[kind] = {"episodes": len(qs), "em": float(np.mean(res.per_question_em)), "kept": int(is_kept.sum()),
                         "dropped": int((~is_kept).sum())}
        for baseline, hindsight in VIEWS:
            full, mem, answers = memory_contexts(res.trajectories, [(i, t) for i, t, _ in labelled], tok, "gold",
                                                 codec=fmt.codec, baseline_steps=1 if baseline == "input" else FULL,
                                                 hindsight=hindsight, continuation=full_prefix)
            out = scorer(params, full, mem, answers)
            r = np.asarray(out.r_mem, np.float64)
            name = f"{baseline}{'+hindsight' if hindsight else ''}"
            kept = float(r[is_kept].mean()) if is_kept.any() else float("nan")
            dropped = float(r[~is_kept].mean()) if (~is_kept).any() else float("nan")
            knows = np.asarray(out.p_full) >= 0.5
            k_k, k_d = is_kept & knows, ~is_kept & knows
            gap_knows = float(r[k_k].mean() - r[k_d].mean()) if k_k.any() and k_d.any() else float("nan")
            results[kind][name] = {"r_kept": kept, "r_dropped": dropped, "gap": kept - dropped,
                                   "r_std": float(r.std()), "p_mem": float(np.mean(out.p_mem)),
                                   "p_full": float(np.mean(out.p_full)), "gap_knows": gap_knows,
                                   "knows_kept": int(k_k.sum()), "knows_dropped": int(k_d.sum())}
            lines.append([kind, name, f"{kept:+.4f}", f"{dropped:+.4f}", f"{kept - dropped:+.4f}",
                          f"{r.std():.4f}", f"{np.mean(out.p_mem):.4f}", f"{np.mean(out.p_full):.4f}",
                          f"{gap_knows:+.4f} ({k_k.sum()} / {k_d.sum()})"])
            print(f"[probe] {kind} {name}: {results[kind][name]}", flush=True)
    counts = ", ".join("%s: %d kept / %d dropped" % (k, v["kept"], v["dropped"]) for k, v in results.items())
    print(table(f"R_M of kept vs dropped memories, {policy}, k = 1 episodes at temperature {temperature} ({counts})",
                ["kind", "views", "R_M kept", "R_M dropped", "gap", "R_M sd", "P_mem", "P_full",
                 "gap | knows (kept / dropped)"], lines))
    return write_json(args.json, "probe_memory_reward", {"run_dir": args.run_dir, "stage": args.stage,
                                                         "num": args.num, "samples": args.samples}, results)


if __name__ == "__main__":
    main(sys.argv[1:])
