"""Section 5: token efficiency of k = 1 memory-context rollouts vs full-history rollouts.

The trained policy of ``--run_dir`` (default ``runs/tiny``, written by ``python -m mempo_jax.commands.train
--run_dir runs/tiny``) is loaded with ``checkpoint.load_policy`` and evaluated as the evaluate CLI
does (``evaluate.make_engine``, ``evaluation.evaluate_policy``, the run's own rollout options
and top-k from its ``config.gin``) on the first ``--limit`` held-out questions of its world, greedy,
in both context modes. TT = tokens processed per question (every turn's context + output,
summed), PT = the largest single context + output (docs/algorithm.md §6). Target: k = 1 TT ≤ 35 % of
full-history TT at equal or better EM (the paper reports −67.58 %). The run's own ``summary.json``
evaluation (all held-out questions) is reported next to it when present.

Without the run folder the script prints one skip line naming the command that makes it.

Run: ``python benchmarks/bench_tokens.py [--run_dir runs/tiny] [--limit 96] [--json out.json]``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from common import REPO, parser, setup_platform, table, write_json
from mempo_jax.agent.format import AgentFormat

TRAIN_COMMAND = "python -m mempo_jax.commands.train --run_dir runs/tiny"


def main(argv=None) -> dict:
    """Evaluate k1 and full on the run's held-out questions; print the table; return the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=str(REPO / "runs" / "tiny"))
    p.add_argument("--limit", type=int, default=None, help="held-out questions (default 96; --small 4)")
    args = p.parse_args(argv)
    run_dir = pathlib.Path(args.run_dir)
    limit = args.limit or (4 if args.small else 96)
    needed = ["tokenizer.model", "model_config.json", "checkpoints"]
    missing = [n for n in needed if not (run_dir / n).exists()]
    if missing:
        line = (f"SKIP token efficiency: no trained run at {run_dir} (missing {', '.join(missing)}); "
                f"make it with: {TRAIN_COMMAND}  (then rerun; or pass --run_dir)")
        print(line)
        return write_json(args.json, "token_efficiency", {"run_dir": str(run_dir)}, {"skipped": line})
    setup_platform(args.device)
    import jax

    from mempo_jax.agent.trajectory import FULL, mode_name
    from mempo_jax.run.checkpoint import load_policy
    from mempo_jax.config_loader import load_config
    from mempo_jax.data.world import build_world
    from mempo_jax.run.run_folder import run_rollout_options
    from mempo_jax.run.experiment import make_engine
    from mempo_jax.run.evaluation import evaluate_policy
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    base, topk, options_from = run_rollout_options(run_dir)
    gin = run_dir / "config.gin"
    try:
        cfg = load_config([str(gin if gin.is_file() else REPO / "configs" / "tiny_world.gin")])
    except ValueError:
        cfg = load_config([str(REPO / "configs" / "tiny_world.gin")])
    if cfg.dataset != "tiny_world":
        line = f"SKIP token efficiency: {run_dir} is a {cfg.dataset!r} run; this section reads tiny-world runs"
        print(line)
        return write_json(args.json, "token_efficiency", {"run_dir": str(run_dir)}, {"skipped": line})
    world = build_world(cfg.world)
    questions = world.heldout[:limit]
    env = search_environment(BM25Index(world.documents), topk=topk)
    tokenizer, model_cfg, graphdef, params = load_policy(run_dir)
    sample_fn = make_engine(graphdef, model_cfg, AgentFormat.plain(tokenizer))
    key = jax.random.PRNGKey(cfg.seed)
    results = {}
    for mode in (1, FULL):
        t = time.perf_counter()
        res = evaluate_policy(sample_fn, params, questions, AgentFormat.plain(tokenizer), env, base, mode, cfg.eval.temperature, key)
        m = dict(res.metrics, wall_s=time.perf_counter() - t)
        results[mode_name(mode)] = m
        print(f"[bench_tokens] {mode_name(mode)}: EM {m['em']:.3f} TT {m['tt']:.1f} PT {m['pt']:.1f} "
              f"turns {m['turns']:.2f} ({m['wall_s']:.0f} s)", flush=True)
    k1, full = results["k1"], results["full"]
    ratio = {"tt": k1["tt"] / full["tt"], "pt": k1["pt"] / full["pt"], "em_delta": k1["em"] - full["em"]}
    stored = None
    if (run_dir / "summary.json").is_file():
        stored = json.loads((run_dir / "summary.json").read_text())["eval"].get("rl")
    rows = [[f"{name} (n={m['n']})", m["em"], m["tt"], m["pt"], m["turns"], m["format_fail"]]
            for name, m in results.items()]
    if stored:
        rows += [[f"{name}, summary.json (n={m['n']})", m["em"], m["tt"], m["pt"], m["turns"], m["format_fail"]]
                 for name, m in stored.items()]
    print(table(f"Token efficiency, {run_dir} (greedy, top-{topk})", ["mode", "EM", "TT", "PT", "turns",
                                                                       "format fail"], rows))
    target = ratio["tt"] <= 0.35 and ratio["em_delta"] >= 0.0
    print(f"k1 / full: TT {ratio['tt']:.1%}, PT {ratio['pt']:.1%}, EM {ratio['em_delta']:+.3f}  "
          f"(target TT <= 35 % at equal or better EM: {'met' if target else 'missed'})")
    out = {"modes": results, "k1_over_full": ratio, "target_met": bool(target), "summary_json_rl": stored}
    config = {"run_dir": str(run_dir), "limit": limit, "topk": topk, "rollout_options_from": options_from,
              "temperature": cfg.eval.temperature, "device": args.device}
    return write_json(args.json, "token_efficiency", config, out)


if __name__ == "__main__":
    main(sys.argv[1:])
