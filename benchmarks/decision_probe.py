"""Does a policy decide to answer where its scripted teacher does? A teacher-forced probe of the one
token that chooses a turn's action.

Every scripted turn's ``<think>`` text starts with the name of its action
(``ScriptedAgentConfig.think_search`` / ``think_answer``: " search" or " answer"), and everything
after it follows from that choice. For the first ``--num`` held-out questions of each kind, the
scripted agent's trajectory under the run's own ``ScriptedAgentConfig`` (the SFT target) is
replayed; at each turn, on the policy's context (``RolloutConfig.context_steps``, as the run trains
and evaluates) followed by the turn's output up to that token, the probe reads P(answer word) and
P(search word) from the policy. Reported per kind and turn type (the scripted word: ``answer`` or
``search``): turns, the mean probability of the scripted word, and the share of turns where the
scripted word is the more likely of the two (what a greedy policy would choose). A policy that
keeps searching until its turn budget, with ``search`` chosen at answer turns, shows here as
``answer`` turns with a low P and share.

Run: ``python benchmarks/decision_probe.py --run_dir RUN [--stage sft|rl] [--step N] [--num 12] [--json F]``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

from common import parser, setup_platform, table, tiny_world_run, write_json

TURN_TYPES = ("answer", "search")


def word_id(tokenizer, word: str) -> int:
    """The id of ``" " + word`` (how a scripted turn writes it after ``<think>``).

    Raises:
      ValueError: the word is not one token of ``tokenizer``.
    """
    ids = tokenizer.encode(" " + word)
    if len(ids) != 1:
        raise ValueError(f"decision_probe: ' {word}' is {len(ids)} tokens {ids} in this tokenizer; the probe reads "
                         "one token")
    return int(ids[0])


def decision_position(output_ids: Sequence[int], codec, word_ids: Sequence[int]) -> Optional[int]:
    """Index in ``output_ids`` of the first of ``word_ids`` inside the turn's ``<think>`` block, or
    ``None`` when the turn has no ``<think>`` block or none of the words in it."""
    span = codec.find_span(output_ids, "<think>", "</think>")
    if span is None:
        return None
    for i in range(span[0], span[1]):
        if int(output_ids[i]) in word_ids:
            return i
    return None


def summarize(records: Sequence[tuple[str, str, float, float]]) -> dict:
    """``{kind: {turn_type: {"turns", "p_scripted", "argmax_right"}}}`` of ``(kind, turn_type,
    p_answer, p_search)`` records: the mean probability of the scripted word and the share of turns
    where it beats the other word."""
    out: dict = {}
    for kind, turn_type, p_answer, p_search in records:
        out.setdefault(kind, {}).setdefault(turn_type, []).append((p_answer, p_search))
    res: dict = {}
    for kind, by in out.items():
        for turn_type, ps in by.items():
            ps = np.asarray(ps, np.float64)
            mine, other = (ps[:, 0], ps[:, 1]) if turn_type == "answer" else (ps[:, 1], ps[:, 0])
            res.setdefault(kind, {})[turn_type] = {"turns": int(len(ps)), "p_scripted": float(mine.mean()),
                                                   "argmax_right": float((mine > other).mean())}
    return res


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run_dir", required=True)
    p.add_argument("--stage", default="sft", choices=("sft", "rl"))
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--num", type=int, default=12, help="held-out questions per kind")
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import jax.numpy as jnp

    from mempo_jax.data.scripted_agent import scripted_trajectory
    from mempo_jax.model.forward import make_logits_fn

    run = tiny_world_run(args.run_dir, args.stage, args.step)
    cfg, tok = run.cfg, run.tokenizer
    agent = cfg.sft.agent
    answer_id, search_id = word_id(tok, agent.think_answer), word_id(tok, agent.think_search)
    fn = make_logits_fn(run.graphdef)

    @jax.jit
    def two_probs(params, ids, valid, pos):
        hidden = fn.hidden(params, ids, valid, "none")[:, pos][:, None]
        logp = jax.nn.log_softmax(fn.project(fn.head(params), hidden)[0, 0].astype(jnp.float32))
        return jnp.exp(logp[answer_id]), jnp.exp(logp[search_id])

    offices = {c["name"]: c["offices"] for c in run.world.companies}
    rng = np.random.default_rng(0)
    records, unaligned = [], 0
    for kind in ("single", "bridge", "multi"):
        for q in [q for q in run.world.heldout if q.kind == kind][: args.num]:
            tr = scripted_trajectory(q, offices, run.fmt, run.tool_env, agent, cfg.rl.rollout, rng)
            for t, turn in enumerate(tr.turns):
                i = decision_position(turn.output_ids, run.fmt.codec, (answer_id, search_id))
                if i is None:
                    unaligned += 1
                    continue
                seq = tr.policy_context(cfg.rl.rollout.context_steps, t) + list(turn.output_ids[:i])
                length = 64 * -(-len(seq) // 64)  # one compile per 64-token bucket
                ids = np.zeros((1, length), np.int32)
                ids[0, :len(seq)] = seq
                pa, ps = two_probs(run.params, ids, np.arange(length)[None] < len(seq), len(seq) - 1)
                turn_type = "answer" if int(turn.output_ids[i]) == answer_id else "search"
                records.append((kind, turn_type, float(pa), float(ps)))
    res = summarize(records)
    rows = [[kind, tt, m["turns"], f"{m['p_scripted']:.3f}", f"{m['argmax_right']:.2f}"]
            for kind, by in res.items() for tt, m in sorted(by.items())]
    print(table(f"The action token of {run.description}, scripted turns of {args.num} held-out questions per kind "
                f"(k = {cfg.rl.rollout.context_steps}; {unaligned} turns without the word)",
                ["kind", "scripted", "turns", "P(scripted word)", "more likely of the two"], rows))
    return write_json(args.json, "decision_probe", {"run_dir": args.run_dir, "stage": args.stage, "step": args.step,
                                                    "num": args.num}, {"by_kind": res, "unaligned_turns": unaligned})


if __name__ == "__main__":
    main(sys.argv[1:])
