"""Paired comparison of two held-out evaluations (the ``mempo-compare RUN_A[:STAGE] RUN_B[:STAGE]`` command).

Each side is a run folder of ``python -m mempo_jax.commands.train`` and one of its evaluation stages
(``base``, ``sft`` or ``rl``; default ``rl``): its ``eval_<stage>.json`` holds the per-question EM
and F1 of every evaluated context mode, in held-out order. A side may also be the ``--out``
folder of ``mempo-evaluate`` (``eval_meta.json`` beside ``predictions.jsonl``, or its gzipped
copy): its modes are then ``DATASET/MODE`` (``hotpotqa/k1``), the per-question scores those of its
prediction records. Both sides must have evaluated the same questions (same count; where both wrote ``eval_<stage>_predictions.jsonl``, the same question ids
in the same order). Printed, per mode shared by both and per metric: each side's mean, the paired
difference A − B with its percentile-bootstrap 95 % interval (``run.metrics.paired_gains``, the
statistic ``summary.json`` reports for RL − SFT: the same numbers where ``--samples`` and ``--seed``
equal the run's ``EvalConfig.bootstrap_samples`` and ``ExperimentConfig.seed``, 2000 and 0 by
default) and how many questions A scores above and below B. An evaluation stored without
per-question F1 is compared on EM alone.

Comparing two arms from the same SFT start (MemPO against GRPO, ``RLConfig.memory_coef = 0``):
``mempo-compare runs/mempo runs/grpo``; RL against SFT within one run: ``mempo-compare runs/x:rl
runs/x:sft`` (the ``rl_vs_sft`` entry of its ``summary.json``); two checkpoints evaluated on a
dataset: ``mempo-compare eval/rl eval/sft`` (each ``mempo-evaluate --out eval/… --dataset …``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import pathlib
from typing import Optional, Sequence

import numpy as np

from mempo_jax.run.metrics import paired_gains
from mempo_jax.run.resume import PREDICTIONS_FILE

STAGES = ("base", "sft", "rl")
# Files of a ``mempo-evaluate --out`` folder (``mempo_jax.commands.evaluate``).
EVALUATE_META, EVALUATE_PREDICTIONS = "eval_meta.json", "predictions.jsonl"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One stored evaluation.

    Attributes:
      name: ``RUN_DIR:STAGE`` as given (the column label).
      per_question: ``{"em": {mode: [questions]}, "f1": {mode: [questions]}}`` float64 lists.
      ids: ``{mode: [question ids]}`` from the predictions file, or None where it is absent.
      predictions: that file's path, or None.
      kinds: ``{mode: [question kind]}`` from the predictions file (its records' ``kind``), or None
        where the file or the field is absent.
    """

    name: str
    per_question: dict
    ids: Optional[dict]
    predictions: Optional[pathlib.Path] = None
    kinds: Optional[dict] = None


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


def _per_question(path: pathlib.Path, stored: dict, metric: str) -> Optional[dict]:
    """``{mode: [float]}`` of ``per_question_<metric>``, or None where the field is absent (F1 in
    an evaluation stored before F1 was kept)."""
    values = stored.get(f"per_question_{metric}")
    if values is None:
        return None
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{path}: per_question_{metric} is not a non-empty {{mode: [values]}} object")
    out = {}
    for mode, vs in values.items():
        if not isinstance(vs, list) or not vs:
            raise ValueError(f"{path}: per_question_{metric}[{mode}] is not a non-empty list")
        bad = [v for v in vs if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise ValueError(f"{path}: per_question_{metric}[{mode}] holds {bad[0]!r}, not a finite number")
        out[mode] = [float(v) for v in vs]
    return out


def _stored(preds: pathlib.Path) -> pathlib.Path:
    """``preds``, or its gzipped copy (``…jsonl.gz``, as committed beside a results page) where
    only that exists."""
    gz = preds.with_name(preds.name + ".gz")
    return gz if not preds.is_file() and gz.is_file() else preds


def _read_records(preds: pathlib.Path) -> list[dict]:
    """The JSON records of a predictions file (``.jsonl`` or ``.jsonl.gz``).

    Raises:
      ValueError: the file is unreadable, or a line is not a JSON object (``FILE:LINE``).
    """
    try:
        raw = preds.read_bytes()
        lines = (gzip.decompress(raw) if preds.suffix == ".gz" else raw).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"{preds}: not readable ({e})") from None
    out = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{preds}:{i}: not a prediction record ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{preds}:{i}: not a prediction record (not a JSON object)")
        out.append(rec)
    return out


def _load_evaluate_folder(spec: str, folder: pathlib.Path) -> Evaluation:
    """A ``mempo-evaluate --out`` folder: modes ``DATASET/MODE``, scores from ``predictions.jsonl``.

    Raises:
      ValueError: ``FILE:LINE`` of a record without a finite ``em`` (or ``f1``), ``id``, ``dataset``
        or ``mode``; a file with no record.
    """
    preds = _stored(folder / EVALUATE_PREDICTIONS)
    if not preds.is_file():
        raise ValueError(f"{spec}: no {preds} beside {folder / EVALUATE_META}")
    per: dict = {"em": {}, "f1": {}}
    ids: dict = {}
    kinds: dict = {}
    for i, rec in enumerate(_read_records(preds), 1):
        try:
            mode = f"{rec['dataset']}/{rec['mode']}"
            scores = {m: rec[m] for m in ("em", "f1")}
            ids.setdefault(mode, []).append(rec["id"])
        except KeyError as e:
            raise ValueError(f"{preds}:{i}: no {e.args[0]} field") from None
        for metric, v in scores.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{preds}:{i}: {metric} is {v!r}, not a finite number")
            per[metric].setdefault(mode, []).append(float(v))
        kinds.setdefault(mode, []).append(rec.get("kind"))
    if not ids:
        raise ValueError(f"{preds}: no prediction record")
    if any(k is None for ks in kinds.values() for k in ks):
        kinds = None
    return Evaluation(spec, per, ids, preds, kinds)


def load_evaluation(spec: str) -> Evaluation:
    """The evaluation named by ``spec`` (``parse_side``): a run folder's stage, or a
    ``mempo-evaluate --out`` folder (``eval_meta.json`` in it).

    Raises:
      ValueError: one line naming the missing or unreadable file or field.
    """
    run, stage = parse_side(spec)
    if (run / EVALUATE_META).is_file():
        return _load_evaluate_folder(spec, run)
    path = run / f"eval_{stage}.json"
    if not path.is_file():
        raise ValueError(f"{spec}: no {path} (this stage was not evaluated, or the run has not reached it)")
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{path}: not a JSON object")
    per = {}
    for metric in ("em", "f1"):
        values = _per_question(path, stored, metric)
        if values is None and metric == "em":
            raise ValueError(f"{path}: no per_question_em field")
        if values is not None:
            per[metric] = values
    ids = kinds = None
    preds = _stored(run / PREDICTIONS_FILE.format(stage=stage))
    if preds.is_file():
        ids, kinds = {}, {}
        for i, rec in enumerate(_read_records(preds), 1):
            try:
                ids.setdefault(rec["mode"], []).append(rec["id"])
                kinds.setdefault(rec["mode"], []).append(rec.get("kind"))
            except KeyError as e:
                raise ValueError(f"{preds}:{i}: not a prediction record ({e})") from None
        if any(k is None for ks in kinds.values() for k in ks):
            kinds = None
    return Evaluation(spec, per, ids, preds if ids is not None else None, kinds)


def only_kinds(ev: Evaluation, kinds: Sequence[str]) -> Evaluation:
    """``ev`` restricted to the questions of the given kinds (``run.evaluation.question_kind``, as
    its predictions file records them), in held-out order; the name gains ``[kind+kind]``.

    Raises:
      ValueError: ``ev`` has no predictions file with a ``kind`` per record, or no question of
        those kinds in some mode (one line naming the file and the kinds).
    """
    if ev.kinds is None:
        raise ValueError(f"{ev.name}: --kinds needs the predictions file's kind field "
                         f"({ev.predictions or 'no predictions file'})")
    wanted = set(kinds)
    per: dict = {metric: {} for metric in ev.per_question}
    ids: dict = {}
    for mode, mode_kinds in ev.kinds.items():
        keep = [i for i, k in enumerate(mode_kinds) if k in wanted]
        if not keep:
            raise ValueError(f"{ev.predictions}: no {mode} question of kind {', '.join(sorted(wanted))} "
                             f"(kinds there: {', '.join(sorted(set(mode_kinds)))})")
        for metric, by_mode in ev.per_question.items():
            if mode in by_mode:
                if len(by_mode[mode]) != len(mode_kinds):
                    raise ValueError(f"{ev.predictions}: its {mode} records do not match the "
                                     f"{len(by_mode[mode])} questions of its evaluation file")
                per[metric][mode] = [by_mode[mode][i] for i in keep]
        ids[mode] = [ev.ids[mode][i] for i in keep]
    kept = {mode: [ev.kinds[mode][i] for i in range(len(ev.kinds[mode])) if ev.kinds[mode][i] in wanted]
            for mode in ev.kinds}
    return Evaluation(f"{ev.name}[{'+'.join(sorted(wanted))}]", per, ids, ev.predictions, kept)


def compare(a: Evaluation, b: Evaluation, samples: int = 2000, seed: int = 0) -> dict:
    """``{mode: {metric: {"a", "b", "diff", "lo", "hi", "above", "below", "n"}}}`` for the modes
    both evaluated and the metrics both stored (``above`` / ``below``: questions where A's score
    is higher / lower than B's; ``lo`` / ``hi``: the percentile-bootstrap 95 % interval of
    ``diff`` over ``samples`` resamples drawn with ``seed``).

    Raises:
      ValueError: no mode in common, different question counts, or different question ids (where
        both sides wrote predictions).
    """
    modes = [m for m in a.per_question["em"] if m in b.per_question["em"]]
    if not modes:
        raise ValueError(f"{a.name} ({', '.join(a.per_question['em'])}) and {b.name} "
                         f"({', '.join(b.per_question['em'])}) share no context mode")
    for mode in modes:
        na, nb = len(a.per_question["em"][mode]), len(b.per_question["em"][mode])
        if na != nb:
            raise ValueError(f"{mode}: {a.name} evaluated {na} questions, {b.name} {nb}: not the same held-out set")
        if a.ids is not None and b.ids is not None:
            ia, ib = a.ids.get(mode), b.ids.get(mode)
            if ia is None or ib is None or len(ia) != na or len(ib) != nb:
                side = a if ia is None or len(ia) != na else b
                raise ValueError(f"{side.predictions}: its {mode} ids do not match the {len(side.per_question['em'][mode])} "
                                 f"questions of its evaluation file")
            if ia != ib:
                raise ValueError(f"{mode}: {a.predictions} and {b.predictions} list different questions")
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


def notes(a: Evaluation, b: Evaluation) -> list[str]:
    """What ``compare`` left out: modes evaluated on one side only, and a question-id check not
    made because one side has no predictions file."""
    out = []
    for x, y in ((a, b), (b, a)):
        only = [m for m in x.per_question["em"] if m not in y.per_question["em"]]
        if only:
            out.append(f"{x.name} also evaluated {', '.join(only)} (not compared)")
    if (a.ids is None) != (b.ids is None):
        missing = a if a.ids is None else b
        out.append(f"{missing.name} has no predictions file: question ids not checked (counts only)")
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
