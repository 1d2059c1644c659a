"""Options of the MemPO RL stage (``RLConfig``)."""

from __future__ import annotations

import dataclasses

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.core.validation import check
from mempo_jax.rl.group_filter import GROUP_FILTERS
from mempo_jax.rl.losses import LossConfig
from mempo_jax.rl.memory_reward import MemoryRewardConfig
from mempo_jax.rl.rewards import get_metric


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Options of the MemPO RL stage.

    Attributes:
      steps: RL steps (one rollout + one PPO epoch each).
      questions_per_step: questions sampled per step (each gives a group).
      group_size: trajectories per question (n; reference 16).
      num_mini_batches: optimizer steps per RL step.
      ppo_epochs: passes over the step's rows.
      outcome_metric: ``"em"`` or ``"f1"``.
      memory_coef: scale of A_M in A = A_T + memory_coef · A_M (1 in the spec; 0 disables).
      loss: PPO loss options.
      rollout: rollout options (``context_steps`` picks full or k-step training).
      precompile: compile every program shape the config can produce (``precompile_rl_step``)
        before the first step, so that no step compiles; off by default (it builds shapes a
        short run may never use).
      memory_reward: how R_M is scored and normalised (``MemoryRewardConfig``; its defaults are
        docs/algorithm.md §3–§4, every other value a named variant).
      old_logprobs: where the PPO "old" log-probs come from: ``"trainer"`` (default; the policy
        recomputes them over the step's rows before the update, one detached packed pass,
        ``policy_old_logprobs``, as verl's ``compute_log_prob``; the sampler's stay in the
        rollout records for ``rollout/logprob_diff/*``) or ``"sampler"`` (the sampler's own; no
        recompute, no ``logprob_diff`` metrics).
      filter_groups: which question groups are trained on (``group_filter.GROUP_FILTERS``):
        ``"none"`` (default, every group) or ``"outcome_std"`` (only groups whose outcome rewards
        differ; the others are dropped before the memory reward, the log-probs and the update, and
        a step in which no group differs updates nothing). One process only.
      seed: the RL stage's own seed (its rollout keys, question order and PPO shuffles); ``None``
        (default): ``ExperimentConfig.seed``. Arms of one SFT start that differ only in this seed
        share the world, the data split, the SFT policy and the frozen reference.
    """

    steps: int = 40
    questions_per_step: int = 8
    group_size: int = 8
    num_mini_batches: int = 2
    ppo_epochs: int = 1
    outcome_metric: str = "em"
    memory_coef: float = 1.0
    loss: LossConfig = LossConfig()
    rollout: RolloutConfig = RolloutConfig()
    precompile: bool = False
    old_logprobs: str = "trainer"
    memory_reward: MemoryRewardConfig = MemoryRewardConfig()
    filter_groups: str = "none"
    seed: int | None = None

    def __post_init__(self):
        check(self, "steps", int, lo=0)
        for name in ("questions_per_step", "group_size", "num_mini_batches", "ppo_epochs"):
            check(self, name, int, lo=1)
        check(self, "outcome_metric", str)
        try:
            get_metric(self.outcome_metric)
        except ValueError as e:
            raise ValueError(f"RLConfig.outcome_metric: {e}") from None
        check(self, "memory_coef", float)
        check(self, "loss", LossConfig)
        check(self, "rollout", RolloutConfig)
        check(self, "precompile", bool)
        check(self, "memory_reward", MemoryRewardConfig)
        check(self, "old_logprobs", str, choices=("trainer", "sampler"))
        check(self, "filter_groups", str, choices=tuple(GROUP_FILTERS.names()))
        if self.seed is not None:
            check(self, "seed", int, lo=0)

    @property
    def scores_memory(self) -> bool:
        """Whether a step runs the memory-reward pass: when A_M enters the advantage
        (``memory_coef != 0``) or its metrics are asked for (``MemoryRewardConfig.score_when_unused``).
        GRPO (``memory_coef = 0``) skips it by default: its updates do not read R_M."""
        return self.memory_coef != 0.0 or self.memory_reward.score_when_unused


__all__ = ["RLConfig"]
