"""Metrics: per-step JSONL + TensorBoard events, the evaluation table and bootstrap CIs.

Metric names follow verl where one exists (``critic/score/mean``, ``actor/pg_loss``,
``actor/ppo_kl``, ``actor/pg_clipfrac``, ``actor/entropy``, ``response_length/mean``,
``num_turns/mean``) plus MemPO's ``mem/reward/mean``, ``mem/advantage/std``, ``tokens/tt``,
``tokens/pt``.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` (flushed and fsynced, so a kill never
    loses a written line) and mirrors scalars to TensorBoard event files under ``tb/``.

    Args:
      run_dir: the run folder.
      tensorboard: also write TensorBoard events.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(pathlib.Path(run_dir) / "tb"))

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Write ``{"step", "stage", **metrics}``; non-finite values are written as null."""
        clean = {k: (float(v) if np.isfinite(v) else None) for k, v in metrics.items()}
        self._f.write(json.dumps({"step": int(step), "stage": stage, **clean}, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._mirror(step, stage, clean)

    def mirror(self, records: Sequence[Mapping]) -> None:
        """Write records already in ``metrics.jsonl`` (``{"step", "stage", **metrics}``) to
        TensorBoard only: a resumed run rebuilds ``tb/`` from the kept lines of ``metrics.jsonl``."""
        for r in records:
            self._mirror(int(r["step"]), str(r["stage"]),
                         {k: v for k, v in r.items() if k not in ("step", "stage") and isinstance(v, (int, float))})

    def _mirror(self, step: int, stage: str, clean: Mapping[str, Optional[float]]) -> None:
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None:
                    self._tb.add_scalar(f"{stage}/{k}" if stage != "rl" else k, v, step)

    def close(self) -> None:
        """Flush and close both sinks."""
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def bootstrap_ci(values: Sequence[float], samples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean.

    Args:
      values: per-question values (e.g. the paired EM gain RL − SFT of each held-out question).
      samples: bootstrap resamples.
      level: coverage (0.95 → the 2.5th and 97.5th percentiles).
      seed: resampling seed.

    Returns:
      ``(lo, hi)``; ``(nan, nan)`` for an empty input.
    """
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(samples, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


EVAL_KEYS = ("em", "f1", "tt", "pt", "turns", "format_fail")


def paired_gains(after: Mapping[str, Mapping[str, Sequence[float]]], before: Mapping[str, Mapping[str, Sequence[float]]],
                 samples: int = 2000, seed: int = 0) -> dict:
    """Paired per-question gains of one evaluation over another, with bootstrap 95 % CIs.

    Args:
      after, before: ``{"em": {mode: [questions]}, "f1": {mode: [questions]}}`` on the same
        questions in the same order (``evaluate_once`` in ``train.py``).
      samples, seed: as ``bootstrap_ci``.

    Returns:
      ``{mode: {"em": [mean, lo, hi], "f1": [mean, lo, hi]}}`` for the modes both have (a metric
      missing from either side, e.g. F1 of an evaluation stored by an older version, is left out).
    """
    out: dict = {}
    for metric in ("em", "f1"):
        for mode, values in after.get(metric, {}).items():
            if mode not in before.get(metric, {}):
                continue
            gain = np.asarray(values, np.float64) - np.asarray(before[metric][mode], np.float64)
            lo, hi = bootstrap_ci(gain, samples, seed=seed)
            out.setdefault(mode, {})[metric] = [float(gain.mean()) if gain.size else float("nan"), lo, hi]
    return out


def format_eval_table(evals: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """Markdown table: one row per (stage, mode) with EM, F1, TT, PT, turns, format-fail rate."""
    lines = ["| stage | mode | EM | F1 | TT | PT | turns | format fail |", "|---|---|---|---|---|---|---|---|"]
    for stage, modes in evals.items():
        for mode, m in modes.items():
            lines.append(
                f"| {stage} | {mode} | {m['em']:.3f} | {m['f1']:.3f} | {m['tt']:.0f} | {m['pt']:.0f} | "
                f"{m['turns']:.2f} | {m['format_fail']:.3f} |"
            )
    return "\n".join(lines)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All lines of a JSONL file (a trailing partial line, from a kill mid-write, is skipped)."""
    out = []
    p = pathlib.Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def maybe(value: Optional[float]) -> float:
    """``None`` → nan (for reading metrics back)."""
    return float("nan") if value is None else float(value)
