"""What a resumed run needs besides the checkpoints: where to resume, the run's logs cut back to
the checkpoint, the numerical-fault counter, and the test-only fault hooks (docs/resume.md).

A run folder is resumed from its newest *durable point*, the newest of:

1. ``eval_rl.json``: the RL evaluation done (only valid with the final RL checkpoint);
2. ``checkpoints/N``: RL step N done (policy params, optimizer state, meta);
3. ``eval_sft.json``: the SFT evaluation done;
4. ``sft_checkpoint/N``: SFT step N done (``N = SFTConfig.steps``: the SFT result, which is also
   the frozen reference policy of RL).

Each records the byte size and line count of ``metrics.jsonl`` and the byte size of
``rollouts.jsonl`` at that point; ``RunLogs`` truncates both files back to them (lines written
after the point are written again, identically, by the resumed run) and rebuilds ``tb/`` from
the kept metric lines. Nothing is lost and nothing is duplicated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
from typing import Any, Mapping, Optional, Sequence

from mempo_jax.metrics import MetricsWriter, read_jsonl

EVAL_SFT_FILE = "eval_sft.json"
EVAL_RL_FILE = "eval_rl.json"
EVAL_BASE_FILE = "eval_base.json"  # EvalConfig.zero_shot: the initial policy, evaluated once


class NumericalFault(RuntimeError):
    """The run stopped on non-finite losses or gradients (exit status 3)."""


# ---- logs ---------------------------------------------------------------------------------------
class RunLogs:
    """``metrics.jsonl`` (mirrored to ``tb/``) and ``rollouts.jsonl`` of a run, with resume offsets.

    Args:
      run_dir: the run folder.
      offsets: ``{"metrics": {"bytes", "lines"}, "rollouts": {"bytes"}}`` of the durable point
        resumed from, or ``None`` for a fresh run (both files and ``tb/`` are cleared).
      source: the durable point, for error messages (e.g. ``"RUN/checkpoints/4"``).

    Raises:
      ValueError: a log is shorter than the checkpoint recorded, or its line count differs
        (metrics were lost or the file was replaced); names the file and the checkpoint.
    """

    def __init__(self, run_dir: str | os.PathLike, offsets: Optional[Mapping] = None, source: str = ""):
        self.run_dir = pathlib.Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rollouts_path = self.run_dir / "rollouts.jsonl"
        offsets = offsets or {"metrics": {"bytes": 0, "lines": 0}, "rollouts": {"bytes": 0}}
        m_bytes, m_lines = int(offsets["metrics"]["bytes"]), int(offsets["metrics"]["lines"])
        r_bytes = int(offsets["rollouts"]["bytes"])
        kept_lines = truncate_log(self.metrics_path, m_bytes, source).count(b"\n")
        if kept_lines != m_lines:
            raise ValueError(f"{self.metrics_path}: {kept_lines} lines in the first {m_bytes} bytes, "
                             f"but {source} recorded {m_lines}: the file was changed after the checkpoint")
        truncate_log(self.rollouts_path, r_bytes, source)
        shutil.rmtree(self.run_dir / "tb", ignore_errors=True)
        self.writer = MetricsWriter(self.run_dir)
        self.writer.mirror(read_jsonl(self.metrics_path))
        self.lines = m_lines
        self._rollouts = open(self.rollouts_path, "a", encoding="utf-8")

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        """One metrics line (``MetricsWriter.write``: flushed and fsynced)."""
        self.writer.write(step, stage, metrics)
        self.lines += 1

    def write_rollouts(self, records: Sequence[Mapping]) -> None:
        """Append JSON lines to ``rollouts.jsonl``, flushed and fsynced."""
        for r in records:
            self._rollouts.write(json.dumps(r) + "\n")
        self._rollouts.flush()
        os.fsync(self._rollouts.fileno())

    def offsets(self) -> dict:
        """The current offsets, as a durable point records them."""
        return {"metrics": {"bytes": _size(self.metrics_path), "lines": self.lines},
                "rollouts": {"bytes": _size(self.rollouts_path)}}

    def close(self) -> None:
        """Close both files and the TensorBoard writer."""
        self.writer.close()
        self._rollouts.close()


def _size(path: pathlib.Path) -> int:
    return path.stat().st_size if path.exists() else 0


def truncate_log(path: str | os.PathLike, nbytes: int, source: str = "") -> bytes:
    """Cut ``path`` to its first ``nbytes`` bytes (creating it when ``nbytes == 0``); returns them.

    Raises:
      ValueError: the file is shorter than ``nbytes`` (names the file and ``source``).
    """
    path = pathlib.Path(path)
    if nbytes == 0:
        path.write_bytes(b"")
        return b""
    size = _size(path)
    if size < nbytes:
        raise ValueError(f"{path} holds {size} bytes but {source or 'the checkpoint'} recorded {nbytes}: "
                         "logged lines were lost after the checkpoint was written")
    with open(path, "r+b") as f:
        f.truncate(nbytes)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        return f.read()


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
    """

    sft_step: Optional[int] = None
    sft_meta: dict = dataclasses.field(default_factory=dict)
    sft_done: bool = False
    eval_sft: Optional[dict] = None
    rl_step: Optional[int] = None
    rl_meta: dict = dataclasses.field(default_factory=dict)
    eval_rl: Optional[dict] = None
    source: str = ""

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
                      rl_steps: int) -> ResumePoint:
    """Read the durable state of ``run_dir`` and check it against the config.

    Args:
      run_dir: the run folder.
      sft_ckpt, rl_ckpt: ``Checkpointer`` of ``RUN/sft_checkpoint`` and ``RUN/checkpoints``.
      seed, sft_steps, rl_steps: the config's seed and stage lengths.

    Returns:
      A ``ResumePoint``; stale eval files (of another stage end) are ignored.

    Raises:
      ValueError: one line naming the checkpoint or file that does not fit the config (another
        seed or SFT length, RL checkpoints beyond ``rl_steps`` or without the SFT reference) or
        that lacks resume metadata.
    """
    run_dir = pathlib.Path(run_dir)
    p = ResumePoint()
    p.sft_step = sft_ckpt.latest_step()
    if p.sft_step is not None:
        p.sft_meta = _checked_meta(sft_ckpt, p.sft_step, seed)
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
    p.rl_step = rl_ckpt.latest_step()
    if p.rl_step is not None:
        where = f"{rl_ckpt.directory}/{p.rl_step}"
        if not p.sft_done:
            raise ValueError(f"{where}: RL checkpoint without the finished SFT checkpoint (the reference "
                             f"policy) under {sft_ckpt.directory}")
        if p.eval_sft is None:
            raise ValueError(f"{where}: RL checkpoint without {run_dir / EVAL_SFT_FILE} (the SFT evaluation)")
        if p.rl_step > rl_steps:
            raise ValueError(f"{where}: RL checkpoint at step {p.rl_step} beyond RLConfig.steps = {rl_steps}")
        p.rl_meta = _checked_meta(rl_ckpt, p.rl_step, seed)
        p.source = where
        if p.rl_step == rl_steps:
            p.eval_rl = _read_eval(run_dir / EVAL_RL_FILE, "rl_step", p.rl_step)
            if p.eval_rl:
                p.source = str(run_dir / EVAL_RL_FILE)
    return p


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
def _parse_steps(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class FaultHooks:
    """Faults injected by tests, read from the environment (never set them in real runs).

    Attributes:
      nan_grad_steps: ``MEMPO_TEST_NAN_GRAD_STEPS="1,3-5"``: RL steps whose PPO batches get NaN
        advantages, so every update of the step has non-finite gradients.
      sigterm_rollout_step: ``MEMPO_TEST_SIGTERM_ROLLOUT_STEP=2``: the process sends itself
        SIGTERM from inside the first sampler call of RL step 2 (during a rollout).
    """

    nan_grad_steps: frozenset = frozenset()
    sigterm_rollout_step: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "FaultHooks":
        """Parse the variables.

        Raises:
          ValueError: a malformed value (names the variable).
        """
        try:
            nan = _parse_steps(env.get("MEMPO_TEST_NAN_GRAD_STEPS", ""))
            sig = env.get("MEMPO_TEST_SIGTERM_ROLLOUT_STEP", "").strip()
            return cls(nan, int(sig) if sig else None)
        except ValueError:
            raise ValueError("MEMPO_TEST_NAN_GRAD_STEPS must look like '1,3-5' and "
                             "MEMPO_TEST_SIGTERM_ROLLOUT_STEP like '2'") from None


__all__ = ["EVAL_RL_FILE", "EVAL_SFT_FILE", "FaultCounter", "FaultHooks", "NumericalFault", "ResumePoint",
           "RunLogs", "check_sft_step", "find_resume_point", "truncate_log"]
