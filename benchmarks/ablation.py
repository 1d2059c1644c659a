"""MemPO against GRPO without the memory reward: one SFT start per seed, then RL
arms with everything else equal, over seeds.

Arms (every other binding equal; the same SFT checkpoint, seed, question order and RL steps):

* ``mempo``     — MemPO: memory reward on (``RLConfig.memory_coef = 1``), k = 1 context;
* ``grpo``      — GRPO: ``RLConfig.memory_coef = 0`` (A = A_T only), k = 1 context;
* ``grpo_full`` — GRPO with the full history (``RolloutConfig.context_steps = "full"``).

Per seed, ``python -m mempo_jax.commands.train`` (its ``main``, in this process) runs the SFT cold start once
(``RLConfig.steps = 0``, folder ``OUT/seed{s}/sft``); each arm's folder starts as a copy of it
without the RL checkpoint and RL evaluation, so the trainer resumes from the finished SFT
checkpoint and its stored evaluation and runs only RL (the frozen reference is that SFT policy),
saving an RL checkpoint every ``--curve_every`` steps. The learning curves are held-out EM of
those checkpoints (the first ``--curve_questions`` held-out questions, greedy, in the arm's
training context mode; step 0 is the SFT policy). The final figures are the trainer's own
evaluation of all held-out questions (``summary.json``: EM, F1, per-kind ``eval/<kind>/em`` and
``/f1``, TT, PT in k1 and full) and ``mem/reward/mean`` of its RL steps (``metrics.jsonl``; the
GRPO arms compute R_M too, it just has no weight).

The test of the paper's claim: the paired difference MemPO − GRPO (both k = 1) in held-out k1 EM
on the bridge and multi-objective questions, pooled over the seeds, with a percentile bootstrap
95 % CI (``metrics.bootstrap_ci``); the target is a mean >= +0.05 with the CI above 0 and the
same sign in every seed.

Writes ``OUT/ablation.md`` (tables), ``OUT/ablation.png`` (curves and per-kind EM) and JSON
(``--json``). Run: ``python benchmarks/ablation.py --json ablation.json [--out runs/ablation]
[--seeds 0,1,2] [--rl_steps N] [--gin_param B ...]`` (the default recipe ``configs/tiny_world.gin``).
``--sft_from DIR`` copies each seed's SFT start from an earlier run's ``DIR/seedS/sft`` instead of
training it: a lever (``--gin_param``, ``--memory_coef``) on the same starts costs the RL arms only.
``--small``: the smoke test's small world and model, 1 seed, a few steps (nothing is learned).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import time

import numpy as np

from common import REPO, SMALL_WORLD_PARAMS, TINY_WORLD_GIN, parser, setup_platform, table, tiny_world_policy, write_json

ARMS = {
    "mempo": ("MemPO (k=1)", ("RLConfig.memory_coef=1.0", "RolloutConfig.context_steps=1"), 1),
    "grpo": ("GRPO, no memory reward (k=1)", ("RLConfig.memory_coef=0.0", "RolloutConfig.context_steps=1"), 1),
    "grpo_full": ("GRPO, full history", ("RLConfig.memory_coef=0.0", 'RolloutConfig.context_steps="full"'), "full"),
}
SMALL_PARAMS = tuple(SMALL_WORLD_PARAMS) + (
    "SFTConfig.steps=4", "SFTConfig.batch_rows=8", "RLConfig.steps=2", "RLConfig.questions_per_step=2",
    "RLConfig.group_size=4", "RolloutConfig.max_turns=2", "RolloutConfig.max_new_tokens=16",
    "EvalConfig.num_questions=6", "EvalConfig.bootstrap_samples=50",
)
ARM_BINDINGS = ("RLConfig.memory_coef", "RolloutConfig.context_steps")  # set per arm (ARMS), not by --gin_param
HARD_KINDS = ("bridge", "multi")  # the kinds whose answers need memory of an earlier turn


def train(run_dir: pathlib.Path, gin_file: str, params, cache: pathlib.Path) -> None:
    """``python -m mempo_jax.commands.train`` (its ``main``) on ``run_dir``; resumes a folder that holds a checkpoint.

    Raises:
      RuntimeError: the trainer returned a non-zero exit status.
    """
    from mempo_jax.commands import train as train_lib

    argv = ["--run_dir", str(run_dir), "--gin_file", gin_file, "--cache_dir", str(cache)]
    for p in params:
        argv += ["--gin_param", p]
    rc = train_lib.main(argv)
    if rc != 0:
        raise RuntimeError(f"python -m mempo_jax.commands.train {' '.join(argv)} exited with status {rc}")


def start_arm(sft_dir: pathlib.Path, arm_dir: pathlib.Path) -> None:
    """A fresh arm folder: the SFT run's folder without its RL checkpoint, RL evaluation and summary
    (the trainer then resumes at the end of SFT). An existing arm folder is kept (it resumes)."""
    _copy_once(sft_dir, arm_dir, shutil.ignore_patterns("checkpoints", "eval_rl.json", "summary.json"))


def _copy_once(src: pathlib.Path, dst: pathlib.Path, ignore=None) -> None:
    """Copy folder ``src`` to ``dst`` unless ``dst`` exists, through ``dst.tmp`` then a rename, so a
    killed copy never leaves a partial ``dst`` (the trainer would resume it)."""
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=ignore)
    tmp.rename(dst)


def copy_sft_start(src: pathlib.Path, sft_dir: pathlib.Path) -> None:
    """``sft_dir`` as a copy of an earlier ablation's finished SFT start ``src`` (``--sft_from``; the
    trainer then resumes it as finished). An existing ``sft_dir`` is kept.

    Raises:
      FileNotFoundError: ``src`` holds no ``sft_checkpoint`` (not a finished SFT start).
    """
    if not sft_dir.exists() and not (src / "sft_checkpoint").is_dir():
        raise FileNotFoundError(f"--sft_from: {src} is not a finished SFT start (no sft_checkpoint/)")
    _copy_once(src, sft_dir)


def rl_metric_mean(run_dir: pathlib.Path, name: str) -> tuple[float, float]:
    """``(mean over RL steps, last RL step)`` of a metric in ``run_dir/metrics.jsonl`` (nan if absent)."""
    from mempo_jax.run.metrics import read_jsonl

    vals = [float("nan") if r.get(name) is None else float(r[name]) for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("stage") == "rl"]
    vals = [v for v in vals if np.isfinite(v)]
    return (float(np.mean(vals)), float(vals[-1])) if vals else (float("nan"), float("nan"))


def curve(run_dir: pathlib.Path, steps, sample_fn, fmt, env, rollout, questions, mode, key) -> dict:
    """``{step: held-out EM}`` of the RL checkpoints ``steps`` of ``run_dir`` (greedy, ``mode``)."""
    from mempo_jax.run.checkpoint import load_policy
    from mempo_jax.run.evaluation import evaluate_policy

    out = {}
    for step in steps:
        params = load_policy(run_dir, step)[3]
        out[int(step)] = float(evaluate_policy(sample_fn, params, questions, fmt, env, rollout, mode, 0.0, key).metrics["em"])
    return out


def paired_difference(a: dict, b: dict, held, kinds, mode: str, samples: int, seed: int = 0) -> dict:
    """Paired per-question difference ``a − b`` of held-out EM (and F1) on questions of ``kinds``,
    pooled over seeds, with a percentile bootstrap 95 % CI (``metrics.bootstrap_ci``).

    Args:
      a, b: ``{seed: {"em": {mode: [questions]}, "f1": {...}}}`` (``eval_rl.json`` per-question values).
      held: the held-out questions in that order (``evaluation.question_kind`` of each).
      kinds: the kinds pooled; mode: the context mode (``"k1"``).
      samples, seed: bootstrap resamples and seed.

    Returns:
      ``{"em": [mean, lo, hi], "f1": [...], "n": pooled questions, "per_seed_em": {seed: mean}}``.
    """
    from mempo_jax.run.evaluation import question_kind
    from mempo_jax.run.metrics import bootstrap_ci

    sel = np.array([question_kind(q) in kinds for q in held])
    out: dict = {"per_seed_em": {}}
    for metric in ("em", "f1"):
        pooled = []
        for s in a:
            d = np.asarray(a[s][metric][mode], np.float64)[sel] - np.asarray(b[s][metric][mode], np.float64)[sel]
            pooled.append(d)
            if metric == "em":
                out["per_seed_em"][str(s)] = float(d.mean()) if d.size else float("nan")
        x = np.concatenate(pooled) if pooled else np.zeros(0)
        lo, hi = bootstrap_ci(x, samples, seed=seed)
        out[metric] = [float(x.mean()) if x.size else float("nan"), lo, hi]
        out["n"] = int(x.size)
    return out


def summarize_arms(per_seed: dict, kinds) -> list[list]:
    """Rows ``[arm, mode, EM, F1, EM/F1 per kind…, TT, PT, mem R]`` as ``mean ± sd`` strings over seeds."""
    def ms(xs):
        xs = [x for x in xs if x is not None and np.isfinite(x)]
        if not xs:
            return "-"
        return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

    rows = []
    for arm, seeds in per_seed.items():
        for stage, mode in (("sft", "k1"), ("sft", "full"), ("rl", "k1"), ("rl", "full")):
            if stage == "sft" and arm != next(iter(per_seed)):
                continue  # the SFT start is shared: one row per mode
            ms_ = [seeds[s]["eval"][stage][mode] for s in seeds]
            name = "SFT start" if stage == "sft" else ARMS[arm][0]
            row = [name, mode, ms([m["em"] for m in ms_]), ms([m["f1"] for m in ms_])]
            for kind in kinds:
                row += [ms([m.get(f"eval/{kind}/em") for m in ms_]), ms([m.get(f"eval/{kind}/f1") for m in ms_])]
            row += [ms([m["tt"] for m in ms_]), ms([m["pt"] for m in ms_])]
            row.append("-" if stage == "sft" else ms([seeds[s]["mem_reward_mean"] for s in seeds]))
            rows.append(row)
    return rows


def write_plot(doc: dict, path, kinds) -> None:
    """PNG: held-out EM against RL step per arm (mean over seeds, thin lines per seed), and the RL
    policies' k1 EM per question kind (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for j, (arm, seeds) in enumerate(doc["arms"].items()):
        color = f"C{j}"
        curves = [seeds[s]["curve"] for s in seeds]
        steps = sorted({int(k) for c in curves for k in c})
        for c in curves:
            ax.plot([int(k) for k in c], list(c.values()), color=color, alpha=0.25, lw=1)
        mean = [np.mean([c[str(t)] if str(t) in c else c.get(t, np.nan) for c in curves]) for t in steps]
        ax.plot(steps, mean, color=color, marker="o", label=f"{ARMS[arm][0]} [{doc['curve_modes'][arm]}]")
        vals = [np.mean([seeds[s]["eval"]["rl"]["k1"].get(f"eval/{k}/em", np.nan) for s in seeds]) for k in kinds]
        width = 0.8 / len(doc["arms"])
        x = np.arange(len(kinds)) + (j - (len(doc["arms"]) - 1) / 2) * width
        bx.bar(x, vals, width, color=color, label=ARMS[arm][0])
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out EM (first {doc['config']['curve_questions']} questions)")
    ax.set_title("learning curves")
    ax.legend(fontsize=7)
    bx.set_xticks(np.arange(len(kinds)), kinds)
    bx.set_ylabel("held-out EM, k1 (after RL)")
    bx.set_title("by question kind")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    """Run the ablation (module doc); print the tables; write Markdown, PNG and JSON; return the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output folder (default runs/ablation; --small runs/ablation_small)")
    p.add_argument("--gin_file", default=TINY_WORLD_GIN, help="the recipe every arm shares")
    p.add_argument("--gin_param", action="append", default=[], help="a binding for every arm (e.g. a lever)")
    p.add_argument("--seeds", default=None, help="comma-separated ExperimentConfig.seed values (default 0,1,2; --small 0)")
    p.add_argument("--rl_steps", type=int, default=None, help="RLConfig.steps of every arm (default: the recipe's)")
    p.add_argument("--memory_coef", type=float, default=1.0,
                   help="RLConfig.memory_coef of the MemPO arm (the coefficient lever; the GRPO arms keep 0)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--sft_from", default=None,
                   help="an earlier ablation's --out: each seed's SFT start is copied from its seedS/sft instead of "
                        "trained (a lever on the same starts; the recipe and --gin_param must match what trained them)")
    p.add_argument("--curve_every", type=int, default=None, help="RL steps between curve points (default 2; --small 1)")
    p.add_argument("--curve_questions", type=int, default=None, help="held-out questions per curve point (default 96; --small 4)")
    p.add_argument("--bootstrap_samples", type=int, default=2000)
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax

    from mempo_jax.agent.trajectory import parse_context_steps, mode_name
    from mempo_jax.run.run_folder import checkpoint_steps
    from mempo_jax.run.evaluation import evaluate_policy, question_kind

    out = pathlib.Path(args.out or REPO / "runs" / ("ablation_small" if args.small else "ablation"))
    seeds = [int(s) for s in (args.seeds or ("0" if args.small else "0,1,2")).split(",") if s.strip()]
    arms = [a for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "mempo" not in arms or "grpo" not in arms:
        raise SystemExit(f"error: --arms must include mempo and grpo and name only {', '.join(ARMS)}; got {args.arms}")
    every = args.curve_every or (1 if args.small else 2)
    n_curve = args.curve_questions or (4 if args.small else 96)
    fixed = [b for b in args.gin_param if b.split("=")[0].strip() in ARM_BINDINGS]
    if fixed:  # an arm's own binding comes last and would silently win over it
        raise SystemExit(f"error: --gin_param {fixed[0]!r} binds what defines an arm ({', '.join(ARM_BINDINGS)}); "
                         "use --memory_coef for the MemPO arm's coefficient")
    arm_params = {a: ARMS[a][1] for a in ARMS}
    arm_params["mempo"] = tuple(f"RLConfig.memory_coef={args.memory_coef}" if b.startswith("RLConfig.memory_coef=")
                                else b for b in ARMS["mempo"][1])
    base = list(SMALL_PARAMS if args.small else ()) + list(args.gin_param)
    if args.rl_steps is not None:
        base.append(f"RLConfig.steps={args.rl_steps}")
    cache = out / "cache"
    t0 = time.time()
    per_seed = {arm: {} for arm in arms}
    per_question = {arm: {} for arm in arms}
    walls: dict = {}
    held = None
    for seed in seeds:
        common_params = base + [f"ExperimentConfig.seed={seed}"]
        sft_dir = out / f"seed{seed}" / "sft"
        t = time.time()
        if args.sft_from:
            copy_sft_start(pathlib.Path(args.sft_from) / f"seed{seed}" / "sft", sft_dir)
        train(sft_dir, args.gin_file, common_params + ["RLConfig.steps=0"], cache)
        walls[f"seed{seed}/sft"] = time.time() - t
        sample_fn = None
        sft_curve: dict = {}
        for arm in arms:
            arm_dir = out / f"seed{seed}" / arm
            start_arm(sft_dir, arm_dir)
            t = time.time()
            train(arm_dir, args.gin_file, common_params + list(arm_params[arm]) +
                  [f"CheckpointConfig.every_steps={every}", "CheckpointConfig.max_to_keep=100000"], cache)
            walls[f"seed{seed}/{arm}/rl"] = time.time() - t
            t = time.time()
            if sample_fn is None:  # one sampler per seed (same model shape and tokenizer in every arm)
                cfg, world, sample_fn, _, fmt, env, rollout, _ = tiny_world_policy(arm_dir, "rl")
                held_all = world.heldout[: cfg.eval.num_questions or None]
                held = held_all if held is None else held
                curve_qs = world.heldout[:n_curve]
                key = jax.random.PRNGKey(0)
            mode = parse_context_steps(ARMS[arm][2])
            if mode_name(mode) not in sft_curve:  # step 0: the SFT policy, in this mode
                from mempo_jax.run.checkpoint import load_policy

                params0 = load_policy(sft_dir, folder="sft_checkpoint")[3]
                sft_curve[mode_name(mode)] = float(evaluate_policy(sample_fn, params0, curve_qs, fmt, env, rollout, mode,
                                                                   0.0, key).metrics["em"])
            steps = checkpoint_steps(arm_dir)  # a preempted step's extra checkpoint is left out of the curve
            last = max(steps, default=0)
            steps = [st for st in steps if st % every == 0 or st == last]
            points = {0: sft_curve[mode_name(mode)], **curve(arm_dir, [s for s in steps if s > 0], sample_fn, fmt, env,
                                                           rollout, curve_qs, mode, key)}
            walls[f"seed{seed}/{arm}/curve"] = time.time() - t
            summary = json.loads((arm_dir / "summary.json").read_text())
            stored = json.loads((arm_dir / "eval_rl.json").read_text())
            mem_mean, mem_last = rl_metric_mean(arm_dir, "mem/reward/mean")
            per_seed[arm][str(seed)] = {"eval": summary["eval"], "curve": {str(k): v for k, v in points.items()},
                                        "mem_reward_mean": mem_mean, "mem_reward_last": mem_last,
                                        "em_gain_rl_vs_sft_k1": summary["gains"]["rl_vs_sft"].get("k1"),
                                        "run_dir": str(arm_dir)}
            per_question[arm][str(seed)] = {"em": stored["per_question_em"], "f1": stored["per_question_f1"]}
            print(f"[ablation] seed {seed} {arm}: k1 EM {summary['eval']['rl']['k1']['em']:.3f} "
                  f"full EM {summary['eval']['rl']['full']['em']:.3f}  curve {points}", flush=True)
    kinds = sorted({question_kind(q) for q in held})
    diff = paired_difference(per_question["mempo"], per_question["grpo"], held, HARD_KINDS, "k1",
                             args.bootstrap_samples)
    diff_all = paired_difference(per_question["mempo"], per_question["grpo"], held, tuple(kinds), "k1",
                                 args.bootstrap_samples)
    by_kind = {k: paired_difference(per_question["mempo"], per_question["grpo"], held, (k,), "k1",
                                    args.bootstrap_samples) for k in HARD_KINDS}
    signs = [v for v in diff["per_seed_em"].values()]
    target = bool(diff["em"][0] >= 0.05 and diff["em"][1] > 0 and all(v > 0 for v in signs))
    header = ["policy", "mode", "EM", "F1"] + [f"{m} {k}" for k in kinds for m in ("EM", "F1")] + ["TT", "PT",
                                                                                                 "mem/reward/mean"]
    text = table(f"Ablation: {len(seeds)} seed(s) {seeds}, held-out questions {len(held)} (mean ± sd over seeds)",
                 header, summarize_arms(per_seed, kinds))
    steps_hdr = sorted({k for a in arms for s in per_seed[a] for k in per_seed[a][s]["curve"]}, key=int)
    curve_rows = [[ARMS[a][0], s, *[f"{per_seed[a][s]['curve'][k]:.3f}" if k in per_seed[a][s]["curve"] else "-"
                                    for k in steps_hdr]] for a in arms for s in per_seed[a]]
    text += "\n\n" + table("Learning curves: held-out EM (first "
                           f"{n_curve} questions) against RL step", ["policy", "seed", *steps_hdr], curve_rows)
    text += (f"\n\nMemPO − GRPO (k1 EM, {'+'.join(HARD_KINDS)}; {diff['n']} paired question-seeds): "
             f"{diff['em'][0]:+.3f} 95% CI [{diff['em'][1]:+.3f}, {diff['em'][2]:+.3f}]; F1 {diff['f1'][0]:+.3f} "
             f"[{diff['f1'][1]:+.3f}, {diff['f1'][2]:+.3f}]; per seed {', '.join(f'{s}: {v:+.3f}' for s, v in diff['per_seed_em'].items())}"
             f"\nMemPO − GRPO (k1 EM, all kinds): {diff_all['em'][0]:+.3f} [{diff_all['em'][1]:+.3f}, {diff_all['em'][2]:+.3f}]"
             + "".join(f"\nMemPO − GRPO (k1 EM, {k}): {d['em'][0]:+.3f} [{d['em'][1]:+.3f}, {d['em'][2]:+.3f}]; per seed "
                       + ", ".join(f"{s}: {v:+.3f}" for s, v in d["per_seed_em"].items()) for k, d in by_kind.items())
             + f"\nTarget (>= +0.05, CI above 0, same sign in every seed): {'met' if target else 'missed'}"
             f"\nWall {(time.time() - t0) / 60:.1f} min")
    print(text, flush=True)
    doc_results = {"arms": per_seed, "mempo_minus_grpo_hard": diff, "mempo_minus_grpo_all": diff_all,
                   "mempo_minus_grpo_by_kind": by_kind,
                   "target_met": target, "kinds": kinds, "curve_modes": {a: mode_name(parse_context_steps(ARMS[a][2]))
                                                                       for a in arms},
                   "wall_s": walls}
    config = {"out": str(out), "gin_file": args.gin_file, "gin_params": base, "seeds": seeds, "arms": arms,
              "arm_params": {a: list(arm_params[a]) for a in arms}, "curve_every": every, "curve_questions": n_curve,
              "heldout_questions": len(held), "small": args.small, "total_wall_s": time.time() - t0}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.md").write_text(text + "\n", encoding="utf-8")
    write_plot({**doc_results, "config": config}, out / "ablation.png", kinds)
    print(f"[ablation] -> {out / 'ablation.md'}, {out / 'ablation.png'}", flush=True)
    return write_json(args.json, "ablation", config, doc_results)


if __name__ == "__main__":
    main(sys.argv[1:])
