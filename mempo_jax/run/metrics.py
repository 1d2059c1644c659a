"""Metrics: per-step JSONL + TensorBoard events, the evaluation table and bootstrap CIs.

Metric names follow verl where one exists (``critic/score/mean``, ``actor/pg_loss``,
``actor/ppo_kl``, ``actor/pg_clipfrac``, ``actor/entropy``, ``response_length/mean``,
``num_turns/mean``) plus MemPO's ``mem/reward/mean``, ``mem/advantage/std``, ``tokens/tt``,
``tokens/pt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import zlib
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from mempo_jax.core.paths import naming_file, run_path


class LogChanged(ValueError):
    """A log file was changed on disk by someone else during the run (truncated or appended to in
    place), so what it holds is no longer what the run wrote; the run stops (exit status 2)."""


class AppendLog:
    """An append-only log file (JSON lines) that notices when it is deleted, replaced or changed
    on disk while the run writes it.

    Each ``append`` (and ``check``) compares the open handle with the file at ``path``: the same
    device and inode, and the size this writer accounts for. Then:

    * the file was deleted (or renamed away): it is recreated at ``path`` from the open handle,
      which still holds every byte written (nothing is lost), and writing goes on;
    * another file was put at ``path``: that file is kept as ``PATH.replaced`` (``.replaced-1``…)
      and ours is recreated at ``path`` as above;
    * the same file is shorter or longer than written (truncated or appended to by another
      program): ``LogChanged`` (the bytes are gone or foreign; nothing can be recreated).

    Appends are flushed and fsynced. ``size``, ``lines`` and ``crc32`` (of the whole file) are
    those of the bytes this writer knows the file holds, the values a checkpoint records.

    Args:
      path: the file, created when absent; its current content is kept and counted.
      warn: receives the one-line notice of a recreated file (default: stderr).
    """

    def __init__(self, path: str | os.PathLike, warn: Optional[Callable[[str], None]] = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._f = open(self.path, "a+b", buffering=0)  # unbuffered: a failed write leaves nothing pending
        data = self._read_all(os.fstat(self._f.fileno()).st_size)
        self.size, self.lines, self.crc32 = len(data), data.count(b"\n"), zlib.crc32(data)

    def _read_all(self, size: int) -> bytes:
        chunks, pos, fd = [], 0, self._f.fileno()
        while pos < size:
            chunk = os.pread(fd, min(1 << 24, size - pos), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)

    def append(self, text: str) -> None:
        """Append ``text`` (whole lines), after ``check``; flushed and fsynced.

        Raises:
          LogChanged: see the class doc.
          OSError: the write failed (e.g. ``ENOSPC``: disk full).
        """
        self.check()
        data = text.encode("utf-8")
        try:
            with naming_file(self.path):
                view = memoryview(data)
                while view:
                    view = view[self._f.write(view):]
                os.fsync(self._f.fileno())
        except OSError:  # a partial write (disk full): cut it off, so the file holds whole lines only
            with contextlib.suppress(OSError):
                self._f.truncate(self.size)
            raise
        self.size += len(data)
        self.lines += data.count(b"\n")
        self.crc32 = zlib.crc32(data, self.crc32)

    def check(self) -> None:
        """Compare the open file with the one at ``path``; recreate it or raise (class doc)."""
        mine = os.fstat(self._f.fileno())
        try:
            disk = os.stat(self.path)
        except FileNotFoundError:
            disk = None
        if disk is not None and (disk.st_dev, disk.st_ino) == (mine.st_dev, mine.st_ino):
            if disk.st_size != self.size:
                raise LogChanged(f"{self.path}: {disk.st_size} bytes on disk, but this run wrote {self.size}: the file "
                                 "was truncated or appended to by another program during the run; stopped (resume "
                                 "checks it against the last checkpoint)")
            return
        if mine.st_size != self.size:
            raise LogChanged(f"{self.path}: the open file holds {mine.st_size} bytes, but this run wrote {self.size}")
        data = self._read_all(self.size)
        kept = ""
        if disk is not None:  # someone else's file at our path: keep it beside ours
            aside = self.path.with_name(self.path.name + ".replaced")
            n = 0
            while aside.exists():
                n += 1
                aside = self.path.with_name(f"{self.path.name}.replaced-{n}")
            os.replace(self.path, aside)
            kept = f"; the file found there is kept as {aside}"
        tmp = self.path.with_name(self.path.name + ".recreate.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._f.close()
        self._f = open(self.path, "a+b", buffering=0)
        what = "replaced by another file" if disk is not None else "deleted"
        self._warn(f"[mempo] warning: {self.path} was {what} during the run; recreated from the open file "
                   f"({self.lines} lines, {self.size} bytes, nothing lost){kept}")

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def _summary_writer():
    """``tensorboardX.SummaryWriter``, imported without torch when torch is not loaded yet.

    tensorboardX tries ``import torch`` at import time (only to accept torch tensors as values,
    which this package never passes); loading the CPU torch build costs ~3 s of every trainer
    start. A ``None`` entry in ``sys.modules`` makes that optional import fail at once; the entry
    is removed afterwards, so a later ``import torch`` loads it normally.
    """
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block:
            del sys.modules["torch"]
    return SummaryWriter


def tensorboard_tag(stage: str, key: str) -> str:
    """The TensorBoard tag of metric ``key`` of a ``metrics.jsonl`` record of ``stage``, with one
    stage prefix: RL keys as they are (verl's ``actor/…``, ``critic/…``, ``mem/…``); other stages
    prefix the stage, dropping the key's own first part when the stage starts with it:
    ``("sft", "sft/loss") → "sft/loss"``, ``("eval_rl_k1", "eval/bridge/em") → "eval_rl_k1/bridge/em"``,
    ``("eval_rl_k1", "em") → "eval_rl_k1/em"``. The records themselves keep their keys, so an
    older run folder's ``metrics.jsonl`` is mirrored with the same tags on resume."""
    if stage == "rl":
        return key
    head, _, rest = key.partition("/")
    if rest and stage.split("_")[0] == head:
        key = rest
    return f"{stage}/{key}"


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` (an ``AppendLog``: flushed and
    fsynced, so a kill never loses a written line, and recreated if deleted during the run) and
    mirrors scalars to TensorBoard event files under ``tb/``.

    Args:
      run_dir: the run folder.
      tensorboard: also write TensorBoard events.
      warn: receives the notice of a recreated ``metrics.jsonl`` (default: stderr).
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True,
                 warn: Optional[Callable[[str], None]] = None):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.log = AppendLog(self.path, warn)
        self._tb = None
        if tensorboard:
            self._tb = _summary_writer()(str(pathlib.Path(run_dir) / "tb"))

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Write ``{"step", "stage", **metrics}``; non-finite values are written as null.

        Raises:
          LogChanged / OSError: from ``AppendLog.append``.
        """
        clean = {k: (float(v) if np.isfinite(v) else None) for k, v in metrics.items()}
        self.log.append(json.dumps({"step": int(step), "stage": stage, **clean}, sort_keys=True) + "\n")
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
                    self._tb.add_scalar(tensorboard_tag(stage, k), v, step)

    def flush_events(self) -> None:
        """Flush the TensorBoard events written so far to their file (nothing without TensorBoard)."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close both sinks."""
        self.log.close()
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
        questions in the same order (``run.stages.evaluate_stage``'s per-question scores).
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


def kind_columns(rows: Sequence[Mapping[str, float]]) -> tuple[list[str], str, str]:
    """The per-kind EM columns of a Markdown table over metric dicts ``rows``.

    Returns:
      ``(kinds, header, rule)``: every kind any row has (``evaluation.kind_metrics``:
      ``eval/<kind>/em``), sorted; the header cells ``" EM <kind> (n) |"`` (``n``: the rows'
      ``eval/<kind>/n`` when they all agree, else left out) and the matching ``"---|"`` cells.
    """
    kinds = sorted({k[len("eval/"):-len("/em")] for m in rows for k in m if k.startswith("eval/") and k.endswith("/em")})
    counts = {kind: {m[f"eval/{kind}/n"] for m in rows if f"eval/{kind}/n" in m} for kind in kinds}
    header = "".join(f" EM {kind}" + (f" ({next(iter(counts[kind])):.0f})" if len(counts[kind]) == 1 else "") + " |"
                     for kind in kinds)
    return kinds, header, "---|" * len(kinds)


def kind_cells(m: Mapping[str, float], kinds: Sequence[str]) -> str:
    """The per-kind EM cells of one row (``kind_columns``): ``" 0.500 |"`` per kind, ``" - |"`` where
    the row has no such kind."""
    return "".join(f" {m[f'eval/{kind}/em']:.3f} |" if f"eval/{kind}/em" in m else " - |" for kind in kinds)


def _mode_order(mode: str) -> tuple[bool, int]:
    """Sort key of a context mode name: ``k1``, ``k2``, ``k10`` by their k, then ``full``."""
    return mode == "full", int(mode[1:]) if mode[1:].isdigit() else 0


def format_eval_table(evals: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """Markdown table: one row per (stage, mode; within a stage the k-step modes by k, then
    ``full``) with EM, F1, TT, PT, turns, format-fail rate and a column ``EM <kind> (n)`` per
    question kind (``kind_columns``; "-" in a row without that kind)."""
    kinds, head, rule = kind_columns([m for modes in evals.values() for m in modes.values()])
    lines = ["| stage | mode | EM | F1 | TT | PT | turns | format fail |" + head, "|---|---|---|---|---|---|---|---|" + rule]
    for stage, modes in evals.items():
        for mode, m in sorted(modes.items(), key=lambda item: _mode_order(item[0])):
            lines.append(
                f"| {stage} | {mode} | {m['em']:.3f} | {m['f1']:.3f} | {m['tt']:.0f} | {m['pt']:.0f} | "
                f"{m['turns']:.2f} | {m['format_fail']:.3f} |" + kind_cells(m, kinds)
            )
    return "\n".join(lines)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All lines of a JSONL file (a trailing partial line, from a kill mid-write, is skipped)."""
    out = []
    p = run_path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
