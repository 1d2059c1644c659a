"""What the RL step takes: the policy learner and the memory-reward scorer, as ``Protocol``s, and
``RLCluster``, the one bundle ``rl_step`` is handed.

The rollout engine the step samples with is ``agent.rollout.Engine``. ``rl.learner.Learner``
(and ``run.lockstep.DistributedLearner``), ``rl.memory_reward.MemoryRewardScorer`` (and
``run.lockstep.DistributedScorer``) implement these; tests give scripted stand-ins.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np
from flax import nnx
from jaxtyping import Bool, Float, Int

from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.rollout import Engine
from mempo_jax.rl.losses import LossConfig
from mempo_jax.rl.memory_reward import MemoryRewardOutput
from mempo_jax.rl.packed_logprobs import PackedLogprobs
from mempo_jax.tools.environment import ToolEnvironment

T = TypeVar("T")


@runtime_checkable
class MemoryScorer(Protocol):
    """Scores P(Z | full_traj[t]) and P(Z | mem_traj[t]) of M turns (docs/algorithm.md §3).

    ``full_prefix``: the never-scored ids the scorer places on the full view only, before Z's
    answer prefix (``MemoryRewardConfig.prefix``); the hindsight views put them on both.
    """

    full_prefix: Sequence[int]

    def __call__(self, params: Any, full_contexts: Sequence[Sequence[int]], mem_contexts: Sequence[Sequence[int]],
                 answers: Sequence[Sequence[int]]) -> MemoryRewardOutput:
        """``MemoryRewardOutput`` of ``[M]`` float32 arrays, detached."""

    def length_buckets(self, max_tokens: int) -> list[int]:
        """The length buckets a scoring row of at most ``max_tokens`` tokens can land in."""

    def precompile(self, params: Any, lengths: Sequence[int]) -> int:
        """Compile the scoring programs at ``lengths`` ahead of time; return their count."""


@runtime_checkable
class PolicyLearner(Protocol):
    """The policy's parameters, optimizer state and the passes the RL step runs on them."""

    params: Any
    micro_batch_rows: int

    def detached_logprobs(self, params: Any, input_ids: Int[np.ndarray, "rows length"],
                          valid: Bool[np.ndarray, "rows length"]) -> Float[np.ndarray, "rows length"]:
        """``[R, L]`` float32 per-token log-probs of ``params`` (no gradient), at the sampler's temperature."""

    def packed_logprobs(self) -> PackedLogprobs:
        """The packed log-prob pass of ``detached_logprobs`` (its programs are precompiled apart)."""

    def precompile(self, lengths: Sequence[int], ppo_rows: int, n_micro: int, loss_cfg: LossConfig) -> int:
        """Compile the update at ``lengths`` ahead of time; return the number of programs."""

    def precompile_once(self, key: Any, build: Callable[[], T]) -> T | None:
        """``build()`` unless the last build was for ``key``; ``None`` when skipped."""

    def ppo_update(self, rows: Mapping[str, np.ndarray], loss_cfg: LossConfig, num_mini_batches: int,
                   rng: np.random.Generator, *, max_rows: int | None = None) -> dict[str, float]:
        """One PPO epoch over ``rows``, in place; the epoch's metrics."""


@dataclasses.dataclass(frozen=True)
class RLCluster:
    """Everything an RL step runs on (tunix's ``RLCluster``: the actor, the reference and the rollout).

    Attributes:
      learner: the policy: parameters, optimizer state and the update (``PolicyLearner``).
      reference: the frozen reference policy's parameters (the KL term's).
      engine: the rollout engine (``agent.rollout.Engine``).
      scorer: the memory-reward scorer (``MemoryScorer``).
      fmt: the agent format (tokenizer, tags, prompt).
      tool_env: the host tools.
    """

    learner: PolicyLearner
    reference: nnx.State
    engine: Engine
    scorer: MemoryScorer
    fmt: AgentFormat
    tool_env: ToolEnvironment


__all__ = ["MemoryScorer", "PolicyLearner", "RLCluster"]
