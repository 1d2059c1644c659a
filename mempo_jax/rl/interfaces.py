"""What the RL step takes: the memory-reward scorer as a ``Protocol``, and ``RLCluster``, the one
bundle ``rl_step`` is handed.

The rollout engine the step samples with is ``agent.rollout.Engine``; the policy and its update
are ``rl.learner.Learner`` (on several processes with ``run.lockstep.LockstepRows``).
``rl.memory_reward.MemoryRewardScorer`` (and ``run.lockstep.DistributedScorer``) implement
``MemoryScorer``; tests give scripted stand-ins.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

from flax import nnx

from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.rollout import Engine
from mempo_jax.rl.learner import Learner
from mempo_jax.rl.memory_reward import MemoryRewardOutput
from mempo_jax.tools.environment import ToolEnvironment


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


@dataclasses.dataclass(frozen=True)
class RLCluster:
    """Everything an RL step runs on (tunix's ``RLCluster``: the actor, the reference and the rollout).

    Attributes:
      learner: the policy: its ``TrainState`` and the update (``rl.learner.Learner``).
      reference: the frozen reference policy's parameters (the KL term's).
      engine: the rollout engine (``agent.rollout.Engine``).
      scorer: the memory-reward scorer (``MemoryScorer``).
      fmt: the agent format (tokenizer, tags, prompt).
      tool_env: the host tools.
    """

    learner: Learner
    reference: nnx.State
    engine: Engine
    scorer: MemoryScorer
    fmt: AgentFormat
    tool_env: ToolEnvironment


__all__ = ["MemoryScorer", "RLCluster"]
