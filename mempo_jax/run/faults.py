"""Numerical faults of a run (non-finite losses or gradients: ``FaultCounter``, ``check_sft_step``,
``NumericalFault``, exit status 3) and the test-only fault hooks (``FaultHooks``: preemption, a
lost process, NaN gradients, injected by tests; docs/resume.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional

import numpy as np

class NumericalFault(RuntimeError):
    """The run stopped on non-finite losses or gradients (exit status 3)."""


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
