"""Where a run resumes (docs/resume.md), and the checks of its folder before it starts (the output
folder, free space for its checkpoints). The logs cut back to the point: ``run.run_logs``; numerical
faults and the test-only fault hooks: ``run.faults``.

A run folder is resumed from its newest *durable point*, the newest of:

1. ``eval_rl.json``: the RL evaluation done (only valid with the final RL checkpoint);
2. ``checkpoints/N``: RL step N done (policy params, optimizer state, meta);
3. ``eval_sft.json``: the SFT evaluation done;
4. ``sft_checkpoint/N``: SFT step N done (``N = SFTConfig.steps``: the SFT result, which is also
   the frozen reference policy of RL).

Each records the byte size, CRC-32 and line count of ``metrics.jsonl`` and the byte size and
CRC-32 of ``rollouts.jsonl`` at that point (what the run's ``AppendLog`` writers account for,
never a fresh ``stat`` of a file that may have been deleted); ``run_logs.check_logs`` verifies the files
against them and ``run_logs.RunLogs`` truncates both back to them (lines written after the point are
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
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Mapping, Optional, TypeVar

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.run.checkpoint import CorruptCheckpoint

T = TypeVar("T")

EVAL_SFT_FILE = "eval_sft.json"
EVAL_RL_FILE = "eval_rl.json"
EVAL_BASE_FILE = "eval_base.json"  # EvalConfig.zero_shot: the initial policy, evaluated once
PREDICTIONS_FILE = "eval_{stage}_predictions.jsonl"  # each held-out question's answer, per stage and mode
CORRUPT_DIR = "corrupt_checkpoints"  # where skipped (unreadable) checkpoints are kept


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


__all__ = ["CORRUPT_DIR", "EVAL_BASE_FILE", "EVAL_RL_FILE", "EVAL_SFT_FILE", "PREDICTIONS_FILE", "ResumePoint",
           "check_free_space", "check_output_folder", "check_run_folder", "find_resume_point", "restore_newest"]
