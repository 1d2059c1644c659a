"""A run's logs, ``metrics.jsonl`` (mirrored to ``tb/``) and ``rollouts.jsonl``, kept consistent with
its checkpoints (docs/resume.md): every durable point records each file's byte size, CRC-32 and
line count (``check_logs`` verifies a file against them); a resumed run cuts both back to the point
(``truncate_log``) and writes the lines after it again, identically: nothing lost, nothing twice.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from typing import Callable, Mapping, Optional, Sequence

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.run.metrics import AppendLog, MetricsWriter, read_jsonl

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
