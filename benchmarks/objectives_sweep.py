"""Scaling with the number of objectives (MEM1's experiment): EM, TT and PT of a trained tiny-world
policy at 1, 2, 4 and 8 objectives per question, in k = 1 memory context and full history.

Questions of K objectives are composed from the world's held-out single-hop questions in its own
multi-objective layout (``world.compose_objectives``: "Answer all: (1) … (K) …", distinct
subjects, so each answer comes from its own search turn); K = 1 is the plain single-hop question.
The policy answers each once, greedy (``evaluation.evaluate_policy``, the run's rollout options
and top-k from its ``config.gin``). ``RolloutConfig.max_turns`` is raised to ``K + 2`` (K searches,
the answer, one spare) and ``max_context_tokens`` to what K + 2 full turns can fill, so the
budget, not the policy, never ends a K = 8 episode early. TT = tokens processed per question (every
turn's context + output), PT = the largest single context + output (docs/algorithm.md §6). Targets:
at 8 objectives PT(k1) <= 0.4 x PT(full) and TT(k1) <= 0.5 x TT(full) at equal or
better EM.

Writes a Markdown table (stdout and ``--out/objectives.md``), a PNG plot (``--out/objectives.png``:
EM, TT, PT against K, one line per mode), every answer (``--out/objectives_predictions.jsonl.gz``:
one ``prediction_record`` per question, K and mode, with ``"objectives": K``) and JSON (``--json``).

Run: ``python benchmarks/objectives_sweep.py --run_dir runs/tiny [--stage rl|sft] [--num 48]
[--objectives 1,2,4,8] [--json sweep.json] [--out DIR]``. ``--small``: a random-initialised
policy of a small world at 1 and 2 objectives, 3 questions each (the smoke test; nothing learned).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import sys
import tempfile
import time

from common import REPO, SMALL_WORLD_PARAMS, TINY_WORLD_GIN, parser, setup_platform, table, tiny_world_policy, write_json

TRAIN_COMMAND = "python -m mempo_jax.commands.train --run_dir runs/tiny"


def budget_for(base, k: int, prompt_tokens: int = 160):
    """The rollout options of a K-objective sweep point: ``max_turns >= K + 2`` and a context budget
    that K + 2 full-history turns (output + tool result + tag overhead) cannot exhaust."""
    turns = max(base.max_turns, k + 2)
    per_turn = base.max_new_tokens + base.max_observation_tokens + 8
    return dataclasses.replace(base, max_turns=turns,
                               max_context_tokens=max(base.max_context_tokens, prompt_tokens + turns * per_turn))


def sweep(sample_fn, params, fmt, env, base, singles, objectives, num: int, modes, temperature: float, key,
          seed: int = 0, progress=print, records: list | None = None) -> dict:
    """``{"K": {mode: metrics + rollout options}}`` over ``objectives`` x ``modes``.

    Args:
      sample_fn, params, fmt, env: the policy and its tools (as ``evaluation.evaluate_policy``).
      base: the run's ``RolloutConfig`` (``budget_for`` adapts it per K).
      singles: held-out single-hop ``world.Question`` s.
      objectives: the K values; num: questions per K; modes: context modes (``1``, ``"full"``).
      temperature: sampling temperature (0: greedy); key: PRNG key (the same for every K and mode).
      seed: composition seed.
      records: when given, receives one prediction record per question, K and mode
        (``evaluation.prediction_record`` plus ``"objectives": K``; dataset ``tiny_world_objectives``).
    """
    from mempo_jax.agent.trajectory import mode_name
    from mempo_jax.data.world import compose_objectives
    from mempo_jax.run.evaluation import evaluate_policy, prediction_records

    out: dict = {}
    for k in objectives:
        qs = compose_objectives(singles, k, num, seed)
        cfg = budget_for(base, k)
        out[str(k)] = {}
        for mode in modes:
            t = time.perf_counter()
            res = evaluate_policy(sample_fn, params, qs, fmt, env, cfg, mode, temperature, key)
            m = {key_: v for key_, v in res.metrics.items() if not key_.startswith("eval/")}
            m.update(wall_s=time.perf_counter() - t, max_turns=cfg.max_turns, max_context_tokens=cfg.max_context_tokens)
            out[str(k)][mode_name(mode)] = m
            if records is not None:
                records += [{**r, "objectives": k} for r in prediction_records(qs, res, mode_name(mode),
                                                                                "tiny_world_objectives")]
            progress(f"[objectives] K={k} {mode_name(mode)}: EM {m['em']:.3f} TT {m['tt']:.0f} PT {m['pt']:.0f} "
                     f"turns {m['turns']:.2f} ({m['wall_s']:.0f} s)")
    return out


def ratios(results: dict) -> dict:
    """Per K: ``{"tt": TT(k1)/TT(full), "pt": PT(k1)/PT(full), "em_delta": EM(k1) - EM(full)}``."""
    out = {}
    for k, modes in results.items():
        if "k1" in modes and "full" in modes:
            a, b = modes["k1"], modes["full"]
            out[k] = {"tt": a["tt"] / b["tt"] if b["tt"] else float("nan"),
                      "pt": a["pt"] / b["pt"] if b["pt"] else float("nan"), "em_delta": a["em"] - b["em"]}
    return out


def write_plot(results: dict, path, title: str = "") -> None:
    """PNG: EM, TT and PT against the number of objectives (log2 axis), one line per context mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mempo_jax.run.eval_report import save_figure

    ks = [int(k) for k in results]
    modes = list(dict.fromkeys(m for r in results.values() for m in r))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, key, label in zip(axes, ("em", "tt", "pt"), ("EM", "TT (tokens / question)", "PT (peak context)")):
        for mode in modes:
            ax.plot(ks, [results[str(k)].get(mode, {}).get(key, float("nan")) for k in ks], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("objectives per question")
        ax.set_title(label)
    axes[0].set_ylim(0, 1.02)
    save_figure(fig, axes[0], path, title)


def _small_policy(cache: str):
    """A random-initialised policy of the smoke test's small world (``--small``)."""
    from mempo_jax.config_loader import load_config
    from mempo_jax.run.experiment import build_experiment

    cfg = load_config([TINY_WORLD_GIN], list(SMALL_WORLD_PARAMS) + ["RolloutConfig.max_new_tokens=12",
                                                                   "RolloutConfig.max_turns=2"])
    exp = build_experiment(cfg, cache)
    from mempo_jax.data.world import build_world

    policy = exp.policy
    return (cfg, build_world(cfg.world), policy.engine, policy.params, policy.fmt, exp.tool_env, cfg.rl.rollout,
            "random init")


def main(argv=None) -> dict:
    """Run the sweep; print the table; write the plot, Markdown and JSON; return the JSON document."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=str(REPO / "runs" / "tiny"), help="a tiny-world run of mempo_jax.commands.train")
    p.add_argument("--stage", default="rl", choices=("rl", "sft"), help="the RL policy or the SFT one")
    p.add_argument("--objectives", default=None, help="comma-separated K values (default 1,2,4,8; --small 1,2)")
    p.add_argument("--num", type=int, default=None, help="questions per K (default 48; --small 3)")
    p.add_argument("--modes", default="1,full", help="context modes (default 1,full)")
    p.add_argument("--seed", type=int, default=0, help="composition and sampling seed")
    p.add_argument("--out", default=None, help="folder for objectives.md / objectives.png (default: --json's folder)")
    args = p.parse_args(argv)
    ks = [int(x) for x in (args.objectives or ("1,2" if args.small else "1,2,4,8")).split(",") if x.strip()]
    num = args.num or (3 if args.small else 48)
    run_dir = pathlib.Path(args.run_dir)
    if not args.small and not (run_dir / "config.gin").is_file():
        line = f"SKIP objectives sweep: no trained run at {run_dir}; make it with: {TRAIN_COMMAND}"
        print(line)
        return write_json(args.json, "objectives_sweep", {"run_dir": str(run_dir)}, {"skipped": line})
    setup_platform(args.device)
    import jax

    from mempo_jax.agent.trajectory import parse_context_steps

    modes = [parse_context_steps(m) for m in args.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        cfg, world, sample_fn, params, fmt, env, base, policy = (_small_policy(tmp) if args.small
                                                                  else tiny_world_policy(run_dir, args.stage))
        singles = [q for q in world.heldout if q.kind == "single"]
        t0 = time.perf_counter()
        records: list = []
        results = sweep(sample_fn, params, fmt, env, base, singles, ks, num, modes, 0.0,
                        jax.random.PRNGKey(args.seed), args.seed, records=records)
    rat = ratios(results)
    rows = [[k, mode, m["n"], m["em"], m["f1"], m["tt"], m["pt"], m["turns"], m["format_fail"]]
            for k, by_mode in results.items() for mode, m in by_mode.items()]
    text = table(f"Objectives sweep: {policy}, {num} questions per K (greedy)",
                 ["K", "mode", "n", "EM", "F1", "TT", "PT", "turns", "format fail"], rows)
    if rat:
        text += "\n\n| K | TT k1/full | PT k1/full | EM k1 - full |\n|---|---|---|---|\n" + "\n".join(
            f"| {k} | {r['tt']:.3f} | {r['pt']:.3f} | {r['em_delta']:+.3f} |" for k, r in rat.items())
    top = str(max(ks))
    target = None
    if top in rat and top == "8":
        r = rat[top]
        target = bool(r["pt"] <= 0.4 and r["tt"] <= 0.5 and r["em_delta"] >= 0)
        text += (f"\n\nAt 8 objectives: PT k1/full {r['pt']:.2f} (target <= 0.4), TT k1/full {r['tt']:.2f} "
                 f"(target <= 0.5), EM k1 - full {r['em_delta']:+.3f} (target >= 0): "
                 f"{'met' if target else 'missed'}")
    print(text, flush=True)
    out_dir = pathlib.Path(args.out) if args.out else (pathlib.Path(args.json).parent if args.json else None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "objectives.md").write_text(text + "\n", encoding="utf-8")
        write_plot(results, out_dir / "objectives.png", policy)
        with gzip.open(out_dir / "objectives_predictions.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        print(f"[objectives] -> {out_dir / 'objectives.md'}, {out_dir / 'objectives.png'}, "
              f"{out_dir / 'objectives_predictions.jsonl.gz'}", flush=True)
    config = {"run_dir": None if args.small else str(run_dir), "stage": args.stage, "policy": policy,
              "objectives": ks, "num": num, "modes": args.modes, "seed": args.seed, "small": args.small,
              "topk": cfg.topk, "wall_s": time.perf_counter() - t0}
    return write_json(args.json, "objectives_sweep", config, {"by_objectives": results, "k1_over_full": rat,
                                                              "target_met_at_8": target})


if __name__ == "__main__":
    main(sys.argv[1:])
