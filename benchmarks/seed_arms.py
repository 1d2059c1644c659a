"""Does the memory reward help? RL arms over seeds from one SFT start, scored on a world of unseen entities.

Arms (every other binding the recipe's; the same SFT start, world, data split and reference policy):

* ``grpo``     — GRPO: ``RLConfig.memory_coef = 0`` (A = A_T; the memory-reward pass is skipped);
* ``mempo``    — MemPO with the paper's views (``memory_coef = 1``, ``MemoryRewardConfig.hindsight = False``);
* ``mempo_hs`` — MemPO with hindsight views (``memory_coef = 1``, ``hindsight = True``: both views end with the
  later tool results and the same continuation, docs/algorithm.md §3).

Seeds are RL seeds (``RLConfig.seed``: rollout keys, question order, PPO shuffles). Each arm is its own
process, so arms can run side by side, one per core, and each resumes from its checkpoints:

    python benchmarks/seed_arms.py prepare  --sft RUN --out DIR [--arms A,B] [--seeds 0,1,2]
    python benchmarks/seed_arms.py train    --out DIR --arm A --seed S --gin_file RECIPE [--gin_param B ...]
    python benchmarks/seed_arms.py evaluate --out DIR --arm A --seed S   (or --sft RUN: the SFT start)
    python benchmarks/seed_arms.py report   --out DIR [--json FILE]

``prepare`` copies the finished SFT start ``RUN`` (``python -m mempo_jax.commands.train … --gin_param
RLConfig.steps=0``) to ``DIR/<arm>_s<seed>`` without RL state; ``train`` runs the arm's RL (the trainer's own
held-out evaluation of the training world is ``eval_rl.json`` / ``eval_rl_predictions.jsonl``); ``evaluate``
runs the arm's final policy greedily on the unseen world (``unseen_world``) and writes a ``mempo-evaluate
--out``-style folder ``DIR/<arm>_s<seed>/unseen/`` (``eval_meta.json``, ``predictions.jsonl.gz``, dataset
``unseen``) that ``mempo-compare`` reads; ``report`` applies the decision rule of docs/results.md: "the memory
reward helps" only if the paired bootstrap over seeds × questions (bridge + multi-objective, k1 EM, unseen
world) has its 95 % CI above 0 and at least 2 of 3 seed pairs favour it.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

import numpy as np

from common import parser, setup_platform, tiny_world_run, write_json

ARMS = {
    "grpo": ("GRPO (memory_coef 0)", ("RLConfig.memory_coef=0.0",)),
    "mempo": ("MemPO, paper's views", ("RLConfig.memory_coef=1.0", "MemoryRewardConfig.hindsight=False")),
    "mempo_hs": ("MemPO, hindsight views", ("RLConfig.memory_coef=1.0", "MemoryRewardConfig.hindsight=True")),
}
BASELINE = "grpo"
HARD_KINDS = ("bridge", "multi")
UNSEEN = "unseen"  # the dataset name of the unseen world's prediction records


def arm_dir(out: pathlib.Path, arm: str, seed: int) -> pathlib.Path:
    """``OUT/<arm>_s<seed>``."""
    return out / f"{arm}_s{seed}"


def unseen_world(train_world_cfg, seed: int, num_bridge: int, num_multi: int, num_single: int):
    """The world of unseen entities: ``train_world_cfg``'s sizes with its own ``seed``, names from the
    evaluation share of the name space and none of the training world's names (``build_world``'s
    ``exclude``). Every one of its questions is evaluated (``evaluation_questions``).

    Returns:
      ``(world, questions)``.
    """
    import dataclasses

    from mempo_jax.data.world import build_world, entity_names
    from mempo_jax.run.experiment import evaluation_questions

    train = build_world(train_world_cfg)
    cfg = dataclasses.replace(train_world_cfg, seed=seed, names="eval", num_worlds=1, num_bridge=num_bridge,
                              num_multi=num_multi, num_single=num_single)
    world = build_world(cfg, exclude=entity_names(train))
    return world, evaluation_questions(world)


def prepare(sft: pathlib.Path, out: pathlib.Path, arms, seeds) -> list[pathlib.Path]:
    """Arm folders as copies of the finished SFT start (``ablation.start_arm``; existing ones are kept).

    Raises:
      FileNotFoundError: ``sft`` holds no ``sft_checkpoint/`` or no ``eval_sft.json`` (not finished).
    """
    from ablation import start_arm

    for need in ("sft_checkpoint", "eval_sft.json"):
        if not (sft / need).exists():
            raise FileNotFoundError(f"--sft {sft}: no {need} (not a finished SFT start)")
    made = []
    for arm in arms:
        for seed in seeds:
            start_arm(sft, arm_dir(out, arm, seed))
            made.append(arm_dir(out, arm, seed))
    return made


def train_arm(out: pathlib.Path, arm: str, seed: int, gin_file: str, params) -> None:
    """The arm's RL in ``OUT/<arm>_s<seed>`` (resumes from its checkpoints)."""
    from ablation import train

    run = arm_dir(out, arm, seed)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: run `prepare` first")
    train(run, gin_file, list(params) + list(ARMS[arm][1]) + [f"RLConfig.seed={seed}"], out / "cache")


def evaluate_unseen(run: pathlib.Path, stage: str, dest: pathlib.Path, modes, world_args) -> dict:
    """Greedy evaluation of ``run``'s ``stage`` policy on the unseen world, written to ``dest`` as a
    ``mempo-evaluate --out`` folder (``eval_meta.json`` and ``predictions.jsonl.gz``).

    Returns:
      ``{mode: metrics}`` (``evaluate_policy``'s means and per-kind figures).
    """
    import jax

    from mempo_jax.agent.trajectory import mode_name, parse_context_steps
    from mempo_jax.core.paths import write_bytes_atomic, write_json_atomic
    from mempo_jax.run.evaluation import evaluate_policy, prediction_records
    from mempo_jax.run.experiment import make_engine
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    r = tiny_world_run(run, stage)
    world, questions = unseen_world(r.cfg.world, *world_args)
    env = search_environment(BM25Index(world.documents), topk=r.cfg.topk)
    engine = make_engine(r.graphdef, r.model_cfg, r.fmt)
    records, metrics = [], {}
    for m in modes:
        steps = parse_context_steps(m)
        res = evaluate_policy(engine, r.params, questions, r.fmt, env, r.cfg.rl.rollout, steps, 0.0,
                              jax.random.PRNGKey(0))
        records += prediction_records(questions, res, mode_name(steps), UNSEEN)
        metrics[mode_name(steps)] = {k: float(v) for k, v in res.metrics.items()}
        print(f"[seed_arms] {run} ({stage}) unseen {mode_name(steps)}: EM {res.metrics['em']:.3f}", flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
    write_bytes_atomic(dest / "predictions.jsonl.gz", gzip.compress(body, mtime=0))
    write_json_atomic(dest / "eval_meta.json", {"run_dir": str(run), "stage": stage, "dataset": UNSEEN,
                                                "world": {"seed": world_args[0], "questions": len(questions),
                                                          "passages": len(world.documents)},
                                                "metrics": metrics})
    return metrics


def pooled_difference(a: list, b: list, kinds, mode: str, samples: int) -> dict:
    """Paired ``a − b`` of per-question EM over seeds × questions of ``kinds`` in ``mode``.

    Args:
      a, b: per seed (the same seeds in the same order), ``compare.Evaluation``s of the same questions.
      kinds: the question kinds pooled; mode: e.g. ``"unseen/k1"`` or ``"k1"``.
      samples: bootstrap resamples (``metrics.bootstrap_ci``, seed 0).

    Returns:
      ``{"em": [mean, lo, hi], "n": pooled pairs, "per_seed": [mean per seed], "favour": seeds with a
      positive mean, "won": pairs a > b, "lost": pairs a < b}``.
    """
    from mempo_jax.run.compare import only_kinds
    from mempo_jax.run.metrics import bootstrap_ci

    diffs = []
    for ea, eb in zip(a, b):
        ea, eb = only_kinds(ea, kinds), only_kinds(eb, kinds)
        if ea.ids and eb.ids and ea.ids.get(mode) != eb.ids.get(mode):
            raise ValueError(f"{ea.name} and {eb.name} evaluated different questions in {mode}")
        diffs.append(np.asarray(ea.per_question["em"][mode], np.float64) - np.asarray(eb.per_question["em"][mode],
                                                                                       np.float64))
    x = np.concatenate(diffs) if diffs else np.zeros(0)
    lo, hi = bootstrap_ci(x, samples, seed=0)
    per_seed = [float(d.mean()) if d.size else float("nan") for d in diffs]
    return {"em": [float(x.mean()) if x.size else float("nan"), lo, hi], "n": int(x.size), "per_seed": per_seed,
            "favour": int(sum(v > 0 for v in per_seed)), "won": int((x > 0).sum()), "lost": int((x < 0).sum())}


def decide(diff: dict, seeds: int) -> bool:
    """The pre-stated rule (docs/results.md): the pooled 95 % CI above 0 and at least 2 of 3 seed pairs
    (two thirds of them, rounded up) in favour."""
    return bool(diff["em"][1] > 0 and diff["favour"] >= -(-2 * seeds // 3))


def report(out: pathlib.Path, arms, seeds, samples: int) -> dict:
    """Per-seed and pooled ``arm − grpo`` on the unseen world (``unseen/k1``) and on the training world's
    held-out split (``k1``), bridge + multi-objective and all kinds, with the rule's verdict."""
    from mempo_jax.run.compare import load_evaluation

    doc: dict = {"seeds": seeds, "arms": {}}
    for arm in [a for a in arms if a != BASELINE]:
        entry = {}
        for world, mode, side in ((UNSEEN, "unseen/k1", "unseen"), ("train_heldout", "k1", None)):
            load = (lambda a, s: load_evaluation(str(arm_dir(out, a, s) / side))) if side else \
                (lambda a, s: load_evaluation(f"{arm_dir(out, a, s)}:rl"))
            try:
                mine = [load(arm, s) for s in seeds]
                base = [load(BASELINE, s) for s in seeds]
            except ValueError as e:
                entry[world] = {"missing": str(e)}
                continue
            hard = pooled_difference(mine, base, HARD_KINDS, mode, samples)
            kinds = sorted({k for ev in mine for k in (ev.kinds or {}).get(mode, [])})
            entry[world] = {"hard": hard, "all": pooled_difference(mine, base, tuple(kinds), mode, samples),
                            "helps": decide(hard, len(seeds)) if world == UNSEEN else None}
        doc["arms"][arm] = entry
    for arm, entry in doc["arms"].items():
        for world, e in entry.items():
            if "missing" in e:
                print(f"[seed_arms] {arm} − {BASELINE} ({world}): {e['missing']}")
                continue
            h = e["hard"]
            print(f"[seed_arms] {arm} − {BASELINE} ({world}, bridge + multi, k1 EM): {h['em'][0]:+.3f} "
                  f"[{h['em'][1]:+.3f}, {h['em'][2]:+.3f}], {h['n']} pairs ({h['won']} won, {h['lost']} lost); per "
                  f"seed {', '.join(f'{v:+.3f}' for v in h['per_seed'])}"
                  + (f"; the memory reward {'helps' if e['helps'] else 'does not help'} by the rule"
                     if e["helps"] is not None else ""))
    return doc


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("command", choices=("prepare", "train", "evaluate", "report"))
    p.add_argument("--out", required=True, help="the folder of the arm folders")
    p.add_argument("--sft", default=None, help="the finished SFT start (prepare; evaluate: its SFT policy)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (RLConfig.seed)")
    p.add_argument("--arm", default=None, help="train / evaluate: one arm")
    p.add_argument("--seed", type=int, default=None, help="train / evaluate: one RL seed")
    p.add_argument("--gin_file", default="smollm2_tiny_world", help="train: the recipe")
    p.add_argument("--gin_param", action="append", default=[], help="train: a binding for the arm")
    p.add_argument("--modes", default="1", help="evaluate: comma-separated context modes (1, full)")
    p.add_argument("--unseen_seed", type=int, default=1, help="evaluate: the unseen world's WorldConfig.seed")
    p.add_argument("--unseen_bridge", type=int, default=250)
    p.add_argument("--unseen_multi", type=int, default=250)
    p.add_argument("--unseen_single", type=int, default=100)
    p.add_argument("--bootstrap_samples", type=int, default=2000)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    arms = [a for a in args.arms.split(",") if a.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if any(a not in ARMS for a in arms + ([args.arm] if args.arm else [])):
        p.error(f"arms must be among {', '.join(ARMS)}")
    if args.command == "prepare":
        if not args.sft:
            p.error("prepare needs --sft")
        for d in prepare(pathlib.Path(args.sft), out, arms, seeds):
            print(d)
        return 0
    setup_platform(args.device)
    if args.command == "train":
        if args.arm is None or args.seed is None:
            p.error("train needs --arm and --seed")
        train_arm(out, args.arm, args.seed, args.gin_file, args.gin_param)
        return 0
    if args.command == "evaluate":
        world_args = (args.unseen_seed, args.unseen_bridge, args.unseen_multi, args.unseen_single)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if args.sft:
            evaluate_unseen(pathlib.Path(args.sft), "sft", out / "sft" / "unseen", modes, world_args)
        elif args.arm is None or args.seed is None:
            p.error("evaluate needs --arm and --seed, or --sft")
        else:
            run = arm_dir(out, args.arm, args.seed)
            evaluate_unseen(run, "rl", run / "unseen", modes, world_args)
        return 0
    doc = report(out, arms, seeds, args.bootstrap_samples)
    write_json(args.json, "seed_arms", {"out": str(out), "arms": arms, "seeds": seeds}, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
