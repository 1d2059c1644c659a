"""Section 4: the MemPO RL step on the tiny-world config: wall time split into rollout, scoring
and update, and the XLA compilations of every step.

The experiment is ``configs/tiny_world.gin`` (``build_experiment``) with the step made smaller by
default so the suite fits its time budget (``--questions``, ``--group``; ``--as_configured`` keeps
the file's 8 × 8). The policy is the trained one of ``--run_dir`` (default ``runs/tiny``) when that
folder exists with the same tokenizer, else the random initialisation (then turns rarely close a
``<mem>`` span and the scoring part is small). ``rl_step.precompile_rl_step`` (what
``RLConfig.precompile`` runs in the first step) builds every program shape the config can produce
first, timed apart; compilations are counted
with a ``jax.monitoring`` listener on ``/jax/core/compile/backend_compile_duration``. Target: 0
compilations from the third step on (with the precompile: from the first).

Run: ``python benchmarks/bench_rl_step.py [--json out.json] [--small] [--steps N] [--no_precompile]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sys
import tempfile
import time

from common import REPO, CompileCounter, parser, setup_platform, table, write_json
from mempo_jax.agent.format import AgentFormat

SMALL_WORLD = ("WorldConfig.num_people=60", "WorldConfig.num_companies=20", "WorldConfig.num_cities=16",
               "WorldConfig.num_countries=4", "WorldConfig.num_single=30", "WorldConfig.num_bridge=20",
               "WorldConfig.num_multi=30", "ExperimentConfig.vocab_size=600",
               'ModelOptions.overrides=(("num_layers", 1), ("embed_dim", 32), ("num_heads", 2), ("num_kv_heads", 1), '
               '("head_dim", 16), ("mlp_dim", 64))',
               "RolloutConfig.max_turns=2", "RolloutConfig.max_new_tokens=16", "RolloutConfig.max_context_tokens=256")


def _sha(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def main(argv=None) -> dict:
    """Run RL steps; print the per-step table; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="RL steps timed (default 4; --small 3)")
    p.add_argument("--questions", type=int, default=None, help="questions per step (default 4)")
    p.add_argument("--group", type=int, default=None, help="trajectories per question (default 4)")
    p.add_argument("--as_configured", action="store_true", help="the gin file's questions_per_step x group_size")
    p.add_argument("--no_precompile", action="store_true", help="compile lazily (shows what the buckets cost)")
    p.add_argument("--run_dir", default=str(REPO / "runs" / "tiny"), help="trained run whose policy is used")
    p.add_argument("--gin_param", action="append", default=[], help="extra gin bindings")
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import numpy as np

    counter = CompileCounter()
    from mempo_jax import config_loader
    from mempo_jax.run.experiment import build_experiment
    from mempo_jax.rl.learner import Learner, make_optimizer
    from mempo_jax.rl.interfaces import RLCluster
    from mempo_jax.rl.step import precompile_rl_step, rl_step

    small = args.small
    steps = args.steps or (3 if small else 4)
    binds = list(SMALL_WORLD) if small else []
    if not args.as_configured:
        binds += [f"RLConfig.questions_per_step={args.questions or (2 if small else 4)}",
                  f"RLConfig.group_size={args.group or (2 if small else 4)}",
                  f"RolloutConfig.min_rows_bucket={8 if small else 16}"]
    binds += args.gin_param
    cfg = config_loader.load_config([str(REPO / "configs" / "tiny_world.gin")], binds)
    run_dir = pathlib.Path(args.run_dir)
    cache_ctx = tempfile.TemporaryDirectory()
    cache = run_dir / ".cache" if (run_dir / ".cache").is_dir() and not small else pathlib.Path(cache_ctx.name)
    t0 = time.perf_counter()
    exp = build_experiment(cfg, cache)
    build_s = time.perf_counter() - t0
    policy = "random init"
    params = exp.policy.params
    if not small and (run_dir / "tokenizer.model").is_file() and (run_dir / "checkpoints").is_dir():
        from mempo_jax.run.checkpoint import load_policy

        same_tok = _sha(run_dir / "tokenizer.model") == _sha(exp.policy.tokenizer.model_path) \
            if hasattr(exp.policy.tokenizer, "model_path") else False
        _, model_cfg, _, trained = load_policy(run_dir)
        if model_cfg == exp.policy.model_cfg and (same_tok or exp.policy.tokenizer.vocab_size == model_cfg.vocab_size):
            params, policy = trained, f"trained ({run_dir})"
    learner = Learner(exp.policy.logits_fn, params, make_optimizer(cfg.optim), temperature=cfg.rl.rollout.temperature,
                      micro_batch_rows=32)
    ref_params = jax.tree.map(lambda x: x.copy(), learner.params)
    cluster = RLCluster(learner, ref_params, exp.policy.engine, exp.scorer, exp.policy.fmt, exp.tool_env)
    rl_key = jax.random.PRNGKey(cfg.seed)
    order = np.random.default_rng(cfg.seed).permutation(len(exp.train_questions))
    q = cfg.rl.questions_per_step
    rows = []
    print(f"[bench_rl_step] policy: {policy}; {q} questions x {cfg.rl.group_size} trajectories, "
          f"context_steps {cfg.rl.rollout.context_steps}; compilations while building: {counter.count}", flush=True)
    pre = None
    if not args.no_precompile:  # what RLConfig.precompile does inside the first rl_step, timed apart here
        mark = counter.count
        pre = precompile_rl_step(cluster, cfg.rl, jax.random.PRNGKey(1))
        pre["compilations"] = counter.count - mark
        print(f"[bench_rl_step] precompile: {pre}", flush=True)
    for step in range(steps):
        mark = counter.count
        qs = [exp.train_questions[int(i)] for i in order[step * q : (step + 1) * q]]
        t = time.perf_counter()
        m, _ = rl_step(cluster, qs, cfg.rl, jax.random.fold_in(rl_key, step), np.random.default_rng([cfg.seed, step]))
        wall = time.perf_counter() - t
        row = {"step": step, "wall_s": wall, "rollout_s": m["timing/rollout_s"], "scoring_s": m["timing/scoring_s"],
               "old_logprobs_s": m.get("timing/old_logprobs_s", 0.0), "update_s": m["timing/update_s"],
               "compilations": counter.count - mark, "compiled": sorted(set(counter.since(mark))),
               "train_rows": m["train/rows"], "train_seq_len": m["train/seq_len"], "mem_turns": m["mem/turns"],
               "tokens_tt": m["tokens/tt"], "num_turns": m["num_turns/mean"]}
        rows.append(row)
        print(f"[bench_rl_step] step {step}: {wall:.1f} s, {row['compilations']} compilations "
              f"{row['compiled'][:6]}", flush=True)
    after = [r["compilations"] for r in rows[2:]]
    res = {"steps": rows, "policy": policy, "build_s": build_s, "precompile": pre,
           "compilations_from_step_3": int(sum(after)),
           "target_no_recompile_from_step_3": bool(sum(after) == 0),
           "mean_from_step_3": {k: float(np.mean([r[k] for r in rows[2:]])) if rows[2:] else None
                                for k in ("wall_s", "rollout_s", "scoring_s", "old_logprobs_s", "update_s")}}
    pre_text = "off" if pre is None else f"{pre['seconds']:.1f} s, {pre['compilations']} programs"
    print(table(f"RL step, tiny world ({policy}; {q} x {cfg.rl.group_size} trajectories; precompile {pre_text})",
                ["step", "wall s", "rollout s", "scoring s", "old log-probs s", "update s", "compilations", "rows x len",
                 "mem turns"],
                [[r["step"], r["wall_s"], r["rollout_s"], r["scoring_s"], r["old_logprobs_s"], r["update_s"],
                  r["compilations"], f"{int(r['train_rows'])} x {int(r['train_seq_len'])}", int(r["mem_turns"])]
                 for r in rows]))
    print(f"compilations from the third step on: {res['compilations_from_step_3']} (target 0)")
    config = {"gin": "configs/tiny_world.gin", "bindings": binds, "rl": dataclasses.asdict(cfg.rl),
              "model_params": exp.policy.model_cfg.num_params(), "small": small, "device": args.device}
    cache_ctx.cleanup()
    return write_json(args.json, "rl_step", config, res)


if __name__ == "__main__":
    main(sys.argv[1:])
