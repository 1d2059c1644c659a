"""What a resumed run needs besides the checkpoints: where to resume, the run's logs cut back to
the checkpoint, the numerical-fault counter, and the test-only fault hooks (docs/resume.md).

A run folder is resumed from its newest *durable point*, the newest of:

1. ``eval_rl.json``: the RL evaluation done (only valid with the final RL checkpoint);
2. ``checkpoints/N``: RL step N done (policy params, optimizer state, meta);
3. ``eval_sft.json``: the SFT evaluation done;
4. ``sft_checkpoint/N``: SFT step N done (``N = SFTConfig.steps``: the SFT result, which is also
   the frozen reference policy of RL).

Each records the byte size, CRC-32 and line count of ``metrics.jsonl`` and the byte size and
CRC-32 of ``rollouts.jsonl`` at that point (what the run's ``AppendLog`` writers account for,
never a fresh ``stat`` of a file that may have been deleted); ``check_logs`` verifies the files
against them and ``RunLogs`` truncates both back to them (lines written after the point are
written again, identically, by the resumed run) and rebuilds ``tb/`` from the kept metric
lines. Nothing is lost and nothing is duplicated.

A checkpoint that does not restore (``checkpoint.CorruptCheckpoint``: damaged array data, a
missing manifest or metadata file) is skipped: ``restore_newest`` resumes from the newest one
that restores, and the trainer moves the skipped ones to ``RUN/corrupt_checkpoints/`` (never
deleting them) once every check has passed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import numpy as np

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.run.checkpoint import CorruptCheckpoint
from mempo_jax.run.metrics import AppendLog, MetricsWriter, read_jsonl

T = TypeVar("T")

EVAL_SFT_FILE = "eval_sft.json"
EVAL_RL_FILE = "eval_rl.json"
EVAL_BASE_FILE = "eval_base.json"  # EvalConfig.zero_shot: the initial policy, evaluated once
PREDICTIONS_FILE = "eval_{stage}_predictions.jsonl"  # each held-out question's answer, per stage and mode
CORRUPT_DIR = "corrupt_checkpoints"  # where skipped (unreadable) checkpoints are kept


class NumericalFault(RuntimeError):
    """The run stopped on non-finite losses or gradients (exit status 3)."""


# ---- logs ---------------------------------------------------------------------------------------
_FRESH_OFFSETS = {"metrics": {"bytes": 0, "lines": 0}, "rollouts": {"bytes": 0}}


class RunLogs:
    """``metrics.jsonl`` (mirrored to ``tb/``) and ``rollouts.jsonl`` of a run, with resume offsets.

    Both are ``metrics.AppendLog`` writers: a log deleted (or replaced) during the run is
    recreated from the open file, one changed in place stops the run (``LogChanged``).

    A run folder on Cloud Storage (``gs://``, which has no append): both logs and ``tb/`` are
    written to a local staging folder exactly as above and uploaded whole (one atomic object write
    each) at every durable point (``offsets``, so a checkpoint never records more than the bucket
    holds), at ``close`` and after a write when ``upload_every_s`` has passed since the last upload.
    A kill loses at most the lines written since the last upload, all after the last durable point
    (which a resume cuts the logs back to anyway).

    Args:
      run_dir: the run folder (a local path or ``gs://…``).
      offsets: ``{"metrics": {"bytes", "lines", "crc32"}, "rollouts": {"bytes", "crc32"}}`` of
        the durable point resumed from, or ``None`` for a fresh run (both files and ``tb/`` are
        cleared); checked with ``check_logs``, then both files are cut back to them.
      source: the durable point, for error messages (e.g. ``"RUN/checkpoints/4"``).
      warn: receives the one-line notice of a recreated log (default: stderr).
      upload_every_s: a remote run folder's upload interval between durable points.

    Raises:
      ValueError: from ``check_logs`` (before anything is changed).
    """

    def __init__(self, run_dir: str | os.PathLike, offsets: Optional[Mapping] = None, source: str = "",
                 warn: Optional[Callable[[str], None]] = None, upload_every_s: float = 60.0):
        self.run_dir = run_path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rollouts_path = self.run_dir / "rollouts.jsonl"
        offsets = offsets or _FRESH_OFFSETS
        check_logs(self.run_dir, offsets, source)
        kept = {name: truncate_log(self.run_dir / name, int(offsets[key]["bytes"]), source)
                for key, name in (("metrics", "metrics.jsonl"), ("rollouts", "rollouts.jsonl"))}
        paths.rmtree(self.run_dir / "tb")
        self._stage, self._uploaded, self._upload_every_s = None, {}, float(upload_every_s)
        local = self.run_dir
        if paths.is_remote(self.run_dir):  # the logs are written here, then uploaded whole
            self._stage = local = pathlib.Path(tempfile.mkdtemp(prefix="mempo_run_logs_"))
            for name, data in kept.items():
                (local / name).write_bytes(data)
                self._uploaded[name] = len(data)
        self._last_upload = time.monotonic()
        self.writer = MetricsWriter(local, warn=warn)
        self.writer.mirror(read_jsonl(local / "metrics.jsonl"))
        self._rollouts = AppendLog(local / "rollouts.jsonl", warn)

    @property
    def lines(self) -> int:
        """Lines in ``metrics.jsonl``."""
        return self.writer.log.lines

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        """One metrics line (``MetricsWriter.write``: flushed and fsynced)."""
        self.writer.write(step, stage, metrics)
        self._maybe_upload()

    def write_rollouts(self, records: Sequence[Mapping]) -> None:
        """Append JSON lines to ``rollouts.jsonl``, flushed and fsynced."""
        if records:
            self._rollouts.append("".join(json.dumps(r) + "\n" for r in records))
            self._maybe_upload()

    def offsets(self) -> dict:
        """The current offsets, as a durable point records them: what the writers account for,
        after checking both files on disk (``AppendLog.check``: a deleted log is recreated first)
        and, in a remote run folder, uploading them (``upload``).

        Raises:
          LogChanged: a log was changed in place by another program.
          OSError: a remote upload failed.
        """
        m, r = self.writer.log, self._rollouts
        m.check()
        r.check()
        self.upload()
        return {"metrics": {"bytes": m.size, "lines": m.lines, "crc32": m.crc32},
                "rollouts": {"bytes": r.size, "crc32": r.crc32}}

    def upload(self) -> None:
        """A remote run folder: upload each staged file (both logs, ``tb/``) that changed since its
        last upload, whole. Nothing for a local run folder.

        Raises:
          OSError: an upload failed (naming the object).
        """
        if self._stage is None:
            return
        self.writer.flush_events()
        for root, _dirs, files in os.walk(self._stage):
            for name in files:
                local = pathlib.Path(root, name)
                rel = local.relative_to(self._stage).as_posix()
                size = local.stat().st_size
                if self._uploaded.get(rel) != size:
                    paths.upload_file(local, self.run_dir.joinpath(*rel.split("/")))
                    self._uploaded[rel] = size
        self._last_upload = time.monotonic()

    def _maybe_upload(self) -> None:
        if self._stage is not None and time.monotonic() - self._last_upload >= self._upload_every_s:
            self.upload()

    def close(self) -> None:
        """Close both files and the TensorBoard writer; a remote run folder's staged files are
        uploaded and the staging folder removed."""
        self.writer.close()
        self._rollouts.close()
        if self._stage is not None:
            try:
                self.upload()
            finally:
                shutil.rmtree(self._stage, ignore_errors=True)
                self._stage = None


def _head_stats(path: pathlib.Path, nbytes: int) -> tuple[int, int]:
    """``(newlines, crc32)`` of the first ``nbytes`` bytes of ``path`` (read in chunks)."""
    lines, crc, left = 0, 0, nbytes
    with path.open("rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return lines, crc


def check_logs(run_dir: str | os.PathLike, offsets: Optional[Mapping], source: str = "") -> None:
    """Check ``metrics.jsonl`` and ``rollouts.jsonl`` against a durable point's offsets, changing
    nothing: each must be at least as long as recorded, and its first ``bytes`` bytes must have
    the recorded line count and CRC-32 (points written by older versions record no CRC).

    Args:
      run_dir: the run folder.
      offsets: the point's offsets (see ``RunLogs``); ``None`` (a fresh run) checks nothing.
      source: the durable point, for the message.

    Raises:
      ValueError: one line naming the file and the point: the file is shorter than recorded
        (lines were lost: deleted or truncated while no run was writing it) or its recorded part
        was changed.
    """
    if not offsets:
        return
    run_dir = run_path(run_dir)
    for name, rec in (("metrics.jsonl", offsets["metrics"]), ("rollouts.jsonl", offsets["rollouts"])):
        path, nbytes = run_dir / name, int(rec["bytes"])
        size = paths.file_size(path)
        if size < nbytes:
            raise ValueError(f"{path} holds {size} bytes but {source or 'the checkpoint'} recorded {nbytes}: "
                             "logged lines were lost after the checkpoint was written (restore the file, or use "
                             "another --run_dir)")
        if nbytes == 0:
            continue
        lines, crc = _head_stats(path, nbytes)
        if "lines" in rec and lines != int(rec["lines"]):
            raise ValueError(f"{path}: {lines} lines in the first {nbytes} bytes, but {source} recorded "
                             f"{rec['lines']}: the file was changed after the checkpoint")
        if "crc32" in rec and crc != int(rec["crc32"]):
            raise ValueError(f"{path}: the first {nbytes} bytes differ from what {source} recorded (CRC-32): the "
                             "file was changed after the checkpoint")


def truncate_log(path: str | os.PathLike, nbytes: int, source: str = "") -> bytes:
    """Cut ``path`` (local or ``gs://``) to its first ``nbytes`` bytes (creating it when
    ``nbytes == 0``); returns them. Locally the file is truncated in place and fsynced; on Cloud
    Storage the object is rewritten whole.

    Raises:
      ValueError: the file is shorter than ``nbytes`` (names the file and ``source``).
    """
    path = run_path(path)
    if nbytes == 0:
        paths.write_bytes_atomic(path, b"") if paths.is_remote(path) else path.write_bytes(b"")
        return b""
    size = paths.file_size(path)
    if size < nbytes:
        raise ValueError(f"{path} holds {size} bytes but {source or 'the checkpoint'} recorded {nbytes}: "
                         "logged lines were lost after the checkpoint was written")
    if paths.is_remote(path):
        data = path.read_bytes()[:nbytes]
        if size > nbytes:
            paths.write_bytes_atomic(path, data)
        return data
    with open(path, "r+b") as f:
        f.truncate(nbytes)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        return f.read()


# ---- the run folder -----------------------------------------------------------------------------
_RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "config.gin", "tokenizer.model", "model_config.json", "summary.json",
              EVAL_BASE_FILE, EVAL_SFT_FILE, EVAL_RL_FILE, *(PREDICTIONS_FILE.format(stage=s) for s in ("base", "sft", "rl")),
              "sft_checkpoint", "checkpoints", "tb")


def _existing_folder(path: pathlib.Path) -> pathlib.Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_folder(path: str | os.PathLike, flag: str = "--run_dir") -> None:
    """Before any work: ``path`` is a folder this process can write in, or is absent and its
    nearest existing ancestor is one. Nothing is created (the probe is an unnamed temporary file).
    A Cloud Storage folder (``gs://…``): its bucket can be listed and ``path`` is not an object
    (``paths.remote_folder_problem``; write permission shows at the first write).

    Args:
      path: the output folder.
      flag: its command-line name, for the message.

    Raises:
      ValueError: one line naming the folder: an existing file, a read-only file system, no
        write permission.
    """
    import errno

    if paths.is_remote(path):
        problem = paths.remote_folder_problem(run_path(path))
        if problem:
            raise ValueError(f"{flag} {path}: {problem}")
        return
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    folder = _existing_folder(path)
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        why = "read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e))
        raise ValueError(f"{flag} {path}: cannot write in {folder} ({why})") from None


def check_run_folder(run_dir: str | os.PathLike) -> None:
    """``check_output_folder(run_dir)``, and the run's files in it are writable.

    Raises:
      ValueError: one line naming the folder or file.
    """
    check_output_folder(run_dir, "--run_dir")
    if paths.is_remote(run_dir):  # objects have no permission bits of their own
        return
    for name in _RUN_FILES:
        path = pathlib.Path(run_dir) / name
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"--run_dir {run_dir}: {path} is not writable")


def check_free_space(run_dir: str | os.PathLike, checkpoint_bytes: int) -> None:
    """Before a run starts: the file system of ``run_dir`` has room for at least one checkpoint
    (``checkpoint_bytes``: the policy parameters plus the optimizer state) and 1 MB for logs.
    Nothing is checked for a Cloud Storage folder (a bucket has no free-space figure).

    Raises:
      ValueError: one line with the free and needed sizes.
    """
    if paths.is_remote(run_dir):
        return
    folder = _existing_folder(pathlib.Path(run_dir))
    free = shutil.disk_usage(folder).free
    need = int(checkpoint_bytes) + (1 << 20)
    if free < need:
        raise ValueError(f"--run_dir {run_dir}: {free / 2**20:.1f} MB free on its file system ({folder}), but one "
                         f"checkpoint of this model needs {need / 2**20:.1f} MB (parameters + optimizer state + logs); "
                         "free some space or use another --run_dir")


# ---- where to resume ----------------------------------------------------------------------------
@dataclasses.dataclass
class ResumePoint:
    """The durable state of a run folder (see the module doc).

    Attributes:
      sft_step, sft_meta: newest complete SFT checkpoint and its metadata (or None / {}).
      sft_done: that checkpoint is the end of SFT (the reference policy).
      eval_sft: the stored SFT evaluation (``eval_sft.json``) or None.
      rl_step, rl_meta: newest complete RL checkpoint and its metadata (or None / {}).
      eval_rl: the stored final RL evaluation (``eval_rl.json``) or None.
      source: the newest durable point's file or folder (for messages).
      skipped: ``{checkpoint folder: reason}`` of newer checkpoints that do not restore.
    """

    sft_step: Optional[int] = None
    sft_meta: dict = dataclasses.field(default_factory=dict)
    sft_done: bool = False
    eval_sft: Optional[dict] = None
    rl_step: Optional[int] = None
    rl_meta: dict = dataclasses.field(default_factory=dict)
    eval_rl: Optional[dict] = None
    source: str = ""
    skipped: dict = dataclasses.field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        """No durable state: the run starts from scratch."""
        return self.sft_step is None and self.rl_step is None

    def newest(self) -> Optional[Mapping]:
        """The record (checkpoint meta or eval file) of the newest durable point, or None."""
        for rec in (self.eval_rl, self.rl_meta or None, self.eval_sft, self.sft_meta or None):
            if rec:
                return rec
        return None

    def describe(self) -> str:
        """One line for the log: what is resumed."""
        if self.fresh:
            return "fresh run"
        if self.eval_rl:
            return f"resuming a finished run ({self.source})"
        if self.rl_step is not None:
            return f"resuming RL after step {self.rl_step} ({self.source})"
        if self.eval_sft:
            return f"resuming before RL ({self.source})"
        return f"resuming SFT after step {self.sft_step} ({self.source})"


def find_resume_point(run_dir: str | os.PathLike, sft_ckpt, rl_ckpt, seed: int, sft_steps: int,
                      rl_steps: int, skip: Optional[Mapping[str, str]] = None) -> ResumePoint:
    """Read the durable state of ``run_dir`` and check it against the config (reads metadata only).

    Args:
      run_dir: the run folder (local or ``gs://…``).
      sft_ckpt, rl_ckpt: ``Checkpointer`` of ``RUN/sft_checkpoint`` and ``RUN/checkpoints``.
      seed, sft_steps, rl_steps: the config's seed and stage lengths.
      skip: ``{checkpoint folder: reason}`` of checkpoints not to use (they did not restore).

    Returns:
      A ``ResumePoint`` from the newest checkpoint of each folder that is not in ``skip`` and
      whose metadata reads (the others are listed in ``skipped``); stale eval files (of another
      stage end) are ignored.

    Raises:
      ValueError: one line naming the checkpoint or file that does not fit the config (another
        seed or SFT length, RL checkpoints beyond ``rl_steps`` or without the SFT reference) or
        that lacks resume metadata; or when checkpoints exist but none of a folder's reads
        (nothing to resume from: a fresh start would discard the run's logs).
    """
    run_dir = run_path(run_dir)
    p = ResumePoint(skipped=dict(skip or {}))
    p.sft_step, p.sft_meta = _newest_readable(sft_ckpt, seed, p.skipped)
    if p.sft_step is not None:
        p.sft_done = bool(p.sft_meta.get("final"))
        p.source = f"{sft_ckpt.directory}/{p.sft_step}"
        if p.sft_done and p.sft_step != sft_steps:
            raise ValueError(f"{p.source}: SFT finished after {p.sft_step} steps but SFTConfig.steps = "
                             f"{sft_steps}; resume with the same SFT length or use another --run_dir")
        if not p.sft_done and p.sft_step >= sft_steps:
            raise ValueError(f"{p.source}: SFT checkpoint at step {p.sft_step} >= SFTConfig.steps = {sft_steps}")
    if p.sft_done:
        p.eval_sft = _read_eval(run_dir / EVAL_SFT_FILE, "sft_step", p.sft_step)
        if p.eval_sft:
            p.source = str(run_dir / EVAL_SFT_FILE)
    rl_steps_on_disk = rl_ckpt.steps()
    if rl_steps_on_disk and rl_steps_on_disk[-1] > rl_steps:
        raise ValueError(f"{rl_ckpt.directory}/{rl_steps_on_disk[-1]}: RL checkpoint at step {rl_steps_on_disk[-1]} "
                         f"beyond RLConfig.steps = {rl_steps}")
    p.rl_step, p.rl_meta = _newest_readable(rl_ckpt, seed, p.skipped)
    for ckpt, step in ((sft_ckpt, p.sft_step), (rl_ckpt, p.rl_step)):
        if step is None and ckpt.steps():
            where, why = next((w, r) for w, r in p.skipped.items() if w.startswith(f"{ckpt.directory}/"))
            raise ValueError(f"no checkpoint under {ckpt.directory} restores (newest skipped: {where}: {why}); "
                             "nothing was changed; use another --run_dir")
    if p.rl_step is not None:
        where = f"{rl_ckpt.directory}/{p.rl_step}"
        if not p.sft_done:
            bad = [f"{w} ({r})" for w, r in p.skipped.items() if w.startswith(f"{sft_ckpt.directory}/")]
            raise ValueError(f"{where}: RL checkpoint without the finished SFT checkpoint (the reference "
                             f"policy) under {sft_ckpt.directory}" + (f"; skipped: {bad[0]}" if bad else ""))
        if p.eval_sft is None:
            raise ValueError(f"{where}: RL checkpoint without {run_dir / EVAL_SFT_FILE} (the SFT evaluation)")
        p.source = where
        if p.rl_step == rl_steps:
            p.eval_rl = _read_eval(run_dir / EVAL_RL_FILE, "rl_step", p.rl_step)
            if p.eval_rl:
                p.source = str(run_dir / EVAL_RL_FILE)
    return p


def _newest_readable(ckpt, seed: int, skipped: dict) -> tuple[Optional[int], dict]:
    """The newest step of ``ckpt`` not in ``skipped`` whose metadata reads, with its checked
    metadata; unreadable ones are added to ``skipped``. ``(None, {})`` when none."""
    for step in reversed(ckpt.steps()):
        where = f"{ckpt.directory}/{step}"
        if where in skipped:
            continue
        try:
            return step, _checked_meta(ckpt, step, seed)
        except CorruptCheckpoint as e:
            skipped[where] = e.reason
    return None, {}


def restore_newest(find: Callable[[Mapping[str, str]], ResumePoint],
                   restore: Callable[[ResumePoint], T]) -> tuple[ResumePoint, T]:
    """Restore the newest durable point whose checkpoints restore, skipping corrupt ones.

    Args:
      find: ``skip -> ResumePoint`` (``find_resume_point`` with the run's arguments).
      restore: ``ResumePoint -> state``; raises ``CorruptCheckpoint`` for a checkpoint that
        cannot be read (any other error stops the search).

    Returns:
      ``(point, state)``; ``point.skipped`` names every checkpoint passed over, with its reason.

    Raises:
      ValueError: from ``find`` (e.g. every checkpoint of a folder is corrupt) or ``restore``.
    """
    skip: dict = {}
    while True:
        point = find(skip)
        try:
            return point, restore(point)
        except CorruptCheckpoint as e:
            if e.where in point.skipped:  # cannot happen; never loop
                raise
            skip = {**point.skipped, e.where: e.reason}


def _checked_meta(ckpt, step: int, seed: int) -> dict:
    meta = ckpt.restore_meta(step)
    where = f"{ckpt.directory}/{step}"
    if "metrics" not in meta or "rollouts" not in meta:
        raise ValueError(f"{where}: checkpoint has no resume metadata (written by an older version); "
                         "use another --run_dir")
    if int(meta.get("seed", seed)) != int(seed):
        raise ValueError(f"{where}: checkpoint of seed {meta['seed']}, but ExperimentConfig.seed = {seed}")
    return meta


def _read_eval(path: pathlib.Path, key: str, step: Optional[int]) -> Optional[dict]:
    """An eval file whose ``key`` equals ``step``, else None (a stale or torn file is ignored)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get(key) == step and "metrics" in rec else None


# ---- numerical faults ---------------------------------------------------------------------------
def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


class FaultCounter:
    """Counts RL steps with non-finite losses or gradients (their updates are skipped by the
    learner: ``actor/update_skipped``); ``max_consecutive`` such steps in a row stop the run.

    Args:
      max_consecutive: the limit K (``CheckpointConfig.max_consecutive_nonfinite``).
      updates_per_step: optimizer updates per RL step (mini-batches × PPO epochs).
    """

    def __init__(self, max_consecutive: int, updates_per_step: int):
        self.max_consecutive = int(max_consecutive)
        self.updates_per_step = int(updates_per_step)
        self.streak = 0
        self.streak_start = -1
        self.skipped_updates = 0
        self.faulty_steps = 0

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Count RL step ``step``'s metrics; returns the ``faults/*`` metrics to log with them:
        ``faults/skipped_updates`` (run total) and ``faults/nonfinite_streak``."""
        skipped = int(round(float(metrics.get("actor/update_skipped", 0.0) or 0.0) * self.updates_per_step))
        bad = skipped > 0 or not all(_finite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm") if k in metrics)
        if bad:
            self.faulty_steps += 1
            self.skipped_updates += skipped
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
        else:
            self.streak, self.streak_start = 0, -1
        return {"faults/skipped_updates": float(self.skipped_updates), "faults/nonfinite_streak": float(self.streak)}

    @property
    def exceeded(self) -> bool:
        """The streak reached the limit."""
        return self.streak >= self.max_consecutive

    def error(self, last_good: str) -> NumericalFault:
        """The one-line error for an exceeded limit (naming the steps and the last good checkpoint)."""
        end = self.streak_start + self.streak - 1
        return NumericalFault(f"RL steps {self.streak_start}-{end}: {self.streak} consecutive steps with non-finite "
                              f"loss or gradients (updates skipped; limit CheckpointConfig.max_consecutive_nonfinite = "
                              f"{self.max_consecutive}); stopped. Last good checkpoint: {last_good}")

    def state(self) -> dict:
        """JSON-able state for the checkpoint metadata."""
        return {"streak": self.streak, "streak_start": self.streak_start, "skipped_updates": self.skipped_updates,
                "faulty_steps": self.faulty_steps}

    def load(self, state: Mapping) -> None:
        """Restore ``state()``."""
        self.streak = int(state.get("streak", 0))
        self.streak_start = int(state.get("streak_start", -1))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.faulty_steps = int(state.get("faulty_steps", 0))


def check_sft_step(step: int, metrics: Mapping[str, float], last_good: str) -> None:
    """An SFT step with a non-finite loss or gradient norm stops the run (the SFT update is not
    skipped, so the parameters are no longer good).

    Raises:
      NumericalFault: naming the step and the last good checkpoint.
    """
    if not all(_finite(metrics[k]) for k in ("sft/loss", "sft/grad_norm") if k in metrics):
        raise NumericalFault(f"SFT step {step}: non-finite loss or gradients (sft/loss = {metrics.get('sft/loss')}, "
                             f"sft/grad_norm = {metrics.get('sft/grad_norm')}); stopped. Last good checkpoint: "
                             f"{last_good}")


# ---- test-only fault hooks ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FaultHooks:
    """Faults injected by tests, passed to ``commands.train.main(hooks=...)`` (a subprocess test runs
    ``tests/fault_train.py``, which passes them); the product's command line never sets them.
    The trainer calls ``before_sample`` and ``update_rows``.

    Attributes:
      nan_grad_steps: RL steps whose PPO batches get NaN advantages, so every update of the step
        has non-finite gradients.
      sigterm_rollout_step: the process sends itself SIGTERM at the first rollout cycle of this
        RL step (during a rollout, before its first sampling call).
      sigkill_rollout_step: the process sends itself SIGKILL there (a lost process: no handler,
        no save).
      sigkill_update_step: the process sends itself SIGKILL at the start of this RL step's first
        PPO update (while the other processes wait in the update's collectives).
    """

    nan_grad_steps: frozenset = frozenset()
    sigterm_rollout_step: Optional[int] = None
    sigkill_rollout_step: Optional[int] = None
    sigkill_update_step: Optional[int] = None

    def before_sample(self, step: int, preemption) -> None:
        """Called at every rollout cycle of RL step ``step``: at ``sigterm_rollout_step`` the
        process sends itself SIGTERM (once: not while one is pending on ``preemption``); at
        ``sigkill_rollout_step`` SIGKILL."""
        import signal

        if step == self.sigkill_rollout_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.sigterm_rollout_step and not preemption.requested:
            os.kill(os.getpid(), signal.SIGTERM)

    def update_rows(self, step: int, rows: Mapping) -> Mapping:
        """The PPO rows of RL step ``step`` (``Learner.before_update``): at a ``nan_grad_steps``
        step every advantage is NaN, so every update of the step has non-finite gradients; at
        ``sigkill_update_step`` the process sends itself SIGKILL."""
        if step == self.sigkill_update_step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        if step not in self.nan_grad_steps:
            return rows
        return dict(rows, advantages=np.full_like(rows["advantages"], np.nan))


__all__ = ["EVAL_RL_FILE", "EVAL_SFT_FILE", "FaultCounter", "FaultHooks", "NumericalFault", "ResumePoint",
           "RunLogs", "check_logs", "check_sft_step", "find_resume_point", "restore_newest", "truncate_log"]
