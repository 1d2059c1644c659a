"""Compile-ahead bounds of an RL step: the most rows, ``<mem>`` turns and tokens a step of an
``RLConfig`` can produce, so its programs' shapes depend on the config only (``rl.step.precompile_rl_step``)."""

from __future__ import annotations

import numpy as np

from mempo_jax.agent.trajectory import FULL
from mempo_jax.core.batching import length_buckets
from mempo_jax.rl.config import RLConfig
from mempo_jax.rl.learner import TRAIN_MIN_LENGTH
from mempo_jax.rl.memory_reward import MEMORY_GROUPINGS


def training_row_bound(cfg: RLConfig) -> int:
    """Most training rows one step can produce: one per trajectory in full mode, one per turn in
    k-step mode (``questions_per_step · group_size · max_turns``)."""
    per_traj = 1 if cfg.rollout.context_steps == FULL else cfg.rollout.max_turns
    return cfg.questions_per_step * cfg.group_size * per_traj


def mem_turn_bound(cfg: RLConfig) -> int:
    """Most ``<mem>`` turns one step can record: ``questions_per_step · group_size · max_turns``."""
    return cfg.questions_per_step * cfg.group_size * cfg.rollout.max_turns


def training_length_buckets(cfg: RLConfig) -> list[int]:
    """Length buckets of training rows: ``TRAIN_MIN_LENGTH, 2·…, bucket(bound)``.

    The bound: a k-step row is a policy context plus its turn, at most ``max_context_tokens``
    (the rollout's budget check); a full-mode row adds the last tool result
    (``max_observation_tokens + 2``).
    """
    ro = cfg.rollout
    bound = ro.max_context_tokens + (ro.max_observation_tokens + 2 if ro.context_steps == FULL else 0)
    return length_buckets(TRAIN_MIN_LENGTH, bound)


def scoring_length_bound(cfg: RLConfig, allowance: int = 128) -> int:
    """A bound (tokens) on a memory-reward scoring row: ``full_traj[t]`` + answer prefix + Z.

    In full mode ``full_traj[t]`` is a policy context (at most ``max_context_tokens -
    max_new_tokens``); in k-step mode it is the whole history before the last turn,
    ``prompt + (max_turns - 1)·(max_new_tokens + max_observation_tokens + 2)``. ``allowance``
    covers the prompt, the prefix and Z (rows beyond the bound still work: one more compile).
    """
    ro = cfg.rollout
    history = (ro.max_turns - 1) * (ro.max_new_tokens + ro.max_observation_tokens + 2)
    return max(ro.max_context_tokens, history + allowance)


def mem_group_count(cfg: RLConfig) -> int:
    """The number of R_M segments of a step (``MemoryRewardConfig.group``'s grouping of no turns):
    questions, times ``max_turns`` with ``group = "turn"``."""
    none = np.zeros((0,), np.int32)
    return MEMORY_GROUPINGS.get(cfg.memory_reward.group)(none, none, cfg.questions_per_step, cfg.rollout.max_turns)[1]


__all__ = ["mem_group_count", "mem_turn_bound", "scoring_length_bound", "training_length_buckets", "training_row_bound"]
