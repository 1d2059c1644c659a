"""Where a tiny-world policy loses its bridge and multi-objective answers: for
each held-out question of a kind, the skill steps its greedy episode gets right, in k = 1 and full.

Bridge (person P, company C): searched P first; searched C later; wrote P's birth city into a
``<mem>``; answered one of C's office heads (the copy skill); answered the right one (EM).
Multi-objective: share of sub-question subjects searched, share of sub-answers right.
Single: searched the subject, EM.

Memory accounting (what the memory reward can fix, docs/algorithm.md §3: R_M < 0 when a ``<mem>``
lost what the full history holds): ``city_dropped`` (bridge), the birth city was in a tool result
but in no ``<mem>``; ``sub_answers_seen`` / ``sub_answers_dropped`` (multi), the share of
objectives whose gold answer was in a tool result / was in one but is not in the memory of the
episode's last turn (the one that answers). A dropped objective is the only failure a better
memory alone recovers; an objective never seen or kept but answered wrong is not.

Run: ``python benchmarks/diagnose_skills.py --run_dir runs/tiny [--stage sft|rl] [--num 40] [--modes 1,full]
[--json F]``.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from common import parser, setup_platform, table, tiny_world_policy, write_json


def _norm(s):
    return " ".join((s or "").split()).strip().lower()


def _contains(text: str, aliases) -> bool:
    """Whether some alias occurs in ``text`` as whole words, both SQuAD-normalised
    (``rewards.normalize_answer``) after punctuation became spaces (``"Dasroth.</information>"``
    must not read as one word)."""
    from mempo_jax.rl.rewards import normalize_answer

    def words(x):
        return normalize_answer(re.sub(r"[^\w\s]", " ", x))

    hay = f" {words(text)} "
    return any(f" {words(a)} " in hay for a in aliases if words(a))


def episode_skills(q, traj, tokenizer, world) -> dict:
    """The skill steps of one finished episode (see module doc); values in [0, 1]."""
    from mempo_jax.rl.rewards import outcome_reward

    turns = [t.parsed for t in traj.turns]  # the rollout's own parse (a turn that hit its budget is malformed)
    results = [tokenizer.decode(t.observation_ids) for t in traj.turns]
    searches = [_norm(t.argument) for t in turns if t.action == "search"]
    mems = [_norm(t.mem) for t in turns if t.mem is not None]
    em = outcome_reward(traj.answer, traj.golds, "em")
    if q.kind == "bridge":
        person, company = _norm(q.hops[0][0]), _norm(q.hops[1][0])
        city = _norm(q.hops[0][1][0].removeprefix("born in "))
        heads = {_norm(h) for h in {c["name"]: c for c in world.companies}[q.hops[1][0]]["offices"].values()}
        first = searches.index(person) if person in searches else None
        city_seen = any(_contains(r, [city]) for r in results)
        city_kept = any(_contains(m, [city]) for m in mems)
        return {"searched_person_first": float(bool(searches) and searches[0] == person),
                "searched_company_after": float(first is not None and company in searches[first + 1:]),
                "city_in_a_mem": float(city_kept), "city_dropped": float(city_seen and not city_kept),
                "answered_a_head": float(_norm(traj.answer) in heads), "em": em}
    if q.kind == "multi":
        subjects = [_norm(h[0]) for h in q.hops]
        last_mem = next((t.mem for t in reversed(turns) if t.mem is not None), "")
        seen = [any(_contains(r, g) for r in results) for g in q.golds]
        kept = [_contains(last_mem, g) for g in q.golds]
        return {"subjects_searched": float(np.mean([s in searches for s in subjects])),
                "sub_answers_seen": float(np.mean(seen)),
                "sub_answers_dropped": float(np.mean([s and not k for s, k in zip(seen, kept)])), "em": em}
    return {"searched_subject": float(_norm(q.hops[0][0]) in searches), "em": em}


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run_dir", required=True)
    p.add_argument("--stage", default="sft", choices=("sft", "rl"))
    p.add_argument("--num", type=int, default=40, help="held-out questions per kind")
    p.add_argument("--modes", default="1,full", help="context modes, comma-separated (k or full)")
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax

    from mempo_jax.agent.trajectory import mode_name, parse_context_steps
    from mempo_jax.run.evaluation import evaluate_policy

    cfg, world, sample_fn, params, fmt, env, rollout, policy = tiny_world_policy(args.run_dir, args.stage)
    results: dict = {}
    for kind in ("single", "bridge", "multi"):
        qs = [q for q in world.heldout if q.kind == kind][: args.num]
        for mode in [parse_context_steps(m.strip()) for m in args.modes.split(",") if m.strip()]:
            res = evaluate_policy(sample_fn, params, qs, fmt, env, rollout, mode, 0.0, jax.random.PRNGKey(0))
            rows = [episode_skills(q, t, fmt.tokenizer, world) for q, t in zip(qs, res.trajectories)]
            results.setdefault(kind, {})[mode_name(mode)] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            print(f"[diagnose] {kind} {mode_name(mode)}: {results[kind][mode_name(mode)]}", flush=True)
    lines = [[kind, mode, ", ".join(f"{k} {v:.2f}" for k, v in m.items())] for kind, by in results.items()
             for mode, m in by.items()]
    print(table(f"Skill steps of {policy}, {args.num} held-out questions per kind (greedy)",
                ["kind", "mode", "share of episodes"], lines))
    return write_json(args.json, "diagnose_skills", {"run_dir": args.run_dir, "stage": args.stage, "num": args.num,
                                                     "modes": args.modes},
                      results)


if __name__ == "__main__":
    main(sys.argv[1:])
