"""Paired comparison of two held-out evaluations: ``mempo-compare RUN_A[:STAGE] RUN_B[:STAGE]``.

Each side is a run folder of ``python -m mempo_jax.train`` and one of its evaluation stages
(``base``, ``sft`` or ``rl``; default ``rl``): its ``eval_<stage>.json`` holds the per-question EM
and F1 of every evaluated context mode, in held-out order. Both sides must have evaluated the same
questions (same count; where both wrote ``eval_<stage>_predictions.jsonl``, the same question ids
in the same order). Printed, per mode shared by both and per metric: each side's mean, the paired
difference A − B with its percentile-bootstrap 95 % interval (``run.metrics.paired_gains``, the
statistic ``summary.json`` reports for RL − SFT) and how many questions A scores above and below B.

Comparing two arms from the same SFT start (MemPO against GRPO, ``RLConfig.memory_coef = 0``):
``mempo-compare runs/mempo runs/grpo``; RL against SFT within one run: ``mempo-compare runs/x:rl
runs/x:sft`` (the ``rl_vs_sft`` entry of its ``summary.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Optional

import numpy as np

from mempo_jax.cli import command_name
from mempo_jax.run.metrics import paired_gains
from mempo_jax.run.resume import PREDICTIONS_FILE

STAGES = ("base", "sft", "rl")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One stored evaluation.

    Attributes:
      name: ``RUN_DIR:STAGE`` as given (the column label).
      per_question: ``{"em": {mode: [questions]}, "f1": {mode: [questions]}}`` float64 lists.
      ids: ``{mode: [question ids]}`` from the predictions file, or None where it is absent.
    """

    name: str
    per_question: dict
    ids: Optional[dict]


def parse_side(spec: str) -> tuple[pathlib.Path, str]:
    """``RUN_DIR[:STAGE]`` → ``(run folder, stage)``; a suffix that is not a stage name stays part
    of the path.

    Raises:
      ValueError: a folder that does not exist (one line naming it).
    """
    path, stage = spec, "rl"
    head, sep, tail = spec.rpartition(":")
    if sep and tail in STAGES:
        path, stage = head, tail
    run = pathlib.Path(path)
    if not run.is_dir():
        raise ValueError(f"{spec}: no run folder {run}")
    return run, stage


def load_evaluation(spec: str) -> Evaluation:
    """The evaluation named by ``spec`` (``parse_side``).

    Raises:
      ValueError: one line naming the missing or unreadable file or field.
    """
    run, stage = parse_side(spec)
    path = run / f"eval_{stage}.json"
    if not path.is_file():
        raise ValueError(f"{spec}: no {path} (this stage was not evaluated, or the run has not reached it)")
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    per = {}
    for metric in ("em", "f1"):
        values = stored.get(f"per_question_{metric}")
        if not isinstance(values, dict) or not values:
            raise ValueError(f"{path}: no per_question_{metric} field")
        per[metric] = {mode: [float(v) for v in vs] for mode, vs in values.items()}
    ids = None
    preds = run / PREDICTIONS_FILE.format(stage=stage)
    if preds.is_file():
        ids = {}
        for i, line in enumerate(preds.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rec = json.loads(line)
                ids.setdefault(rec["mode"], []).append(rec["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{preds}:{i}: not a prediction record ({e})") from None
    return Evaluation(spec, per, ids)


def compare(a: Evaluation, b: Evaluation, samples: int = 2000, seed: int = 0) -> dict:
    """``{mode: {metric: {"a", "b", "diff", "lo", "hi", "above", "below", "n"}}}`` for the modes
    both evaluated (``above`` / ``below``: questions where A's score is higher / lower than B's).

    Raises:
      ValueError: no mode in common, different question counts, or different question ids.
    """
    modes = [m for m in a.per_question["em"] if m in b.per_question["em"]]
    if not modes:
        raise ValueError(f"{a.name} ({', '.join(a.per_question['em'])}) and {b.name} "
                         f"({', '.join(b.per_question['em'])}) share no context mode")
    for mode in modes:
        na, nb = len(a.per_question["em"][mode]), len(b.per_question["em"][mode])
        if na != nb:
            raise ValueError(f"{mode}: {a.name} evaluated {na} questions, {b.name} {nb}: not the same held-out set")
        if a.ids is not None and b.ids is not None and a.ids.get(mode) != b.ids.get(mode):
            raise ValueError(f"{mode}: {a.name} and {b.name} evaluated different questions "
                             f"(ids differ in their {PREDICTIONS_FILE.format(stage='<stage>')})")
    gains = paired_gains(a.per_question, b.per_question, samples, seed)
    out: dict = {}
    for mode in modes:
        for metric, (diff, lo, hi) in gains[mode].items():
            x = np.asarray(a.per_question[metric][mode], np.float64)
            y = np.asarray(b.per_question[metric][mode], np.float64)
            out.setdefault(mode, {})[metric] = {
                "a": float(x.mean()), "b": float(y.mean()), "diff": diff, "lo": lo, "hi": hi,
                "above": int((x > y).sum()), "below": int((x < y).sum()), "n": int(x.size)}
    return out


def format_comparison(a: Evaluation, b: Evaluation, result: dict) -> str:
    """A markdown table of ``compare``'s result."""
    lines = [f"A = {a.name}, B = {b.name}", "",
             "| mode | metric | A | B | A - B [95% CI] | A above / below B | questions |", "|---|---|---|---|---|---|---|"]
    for mode, metrics in result.items():
        for metric, r in metrics.items():
            lines.append(f"| {mode} | {metric} | {r['a']:.3f} | {r['b']:.3f} | {r['diff']:+.3f} [{r['lo']:+.3f}, "
                         f"{r['hi']:+.3f}] | {r['above']} / {r['below']} | {r['n']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.run.compare"), description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="RUN_DIR[:STAGE] (stage base, sft or rl; default rl)")
    p.add_argument("b", help="RUN_DIR[:STAGE] to compare against")
    p.add_argument("--samples", type=int, default=2000, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        a, b = load_evaluation(args.a), load_evaluation(args.b)
        result = compare(a, b, args.samples, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_comparison(a, b, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
