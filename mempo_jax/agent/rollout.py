"""Multi-turn rollout: sampling on device with the cached engine, tools on the host (docs/algorithm.md §2).

``Engine.rollout`` runs fresh trajectories to the end of their episodes on a ``RolloutEngine``
(``mempo_jax.agent.engine``: the KV cache kept across turns, stopped rows refilled). The sampled
ids, their log-probs, the ``<mem>`` span (found on the ids) and the encoded tool result are
appended to each trajectory; ``full_traj[t]`` / ``mem_traj[t]`` are views of that record (see
``trajectory.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from mempo_jax.agent.format import PLAIN_SYSTEM_PROMPT as SYSTEM_PROMPT, AgentFormat
from mempo_jax.text.protocol import ALL_TAG_PIECES
from mempo_jax.agent.trajectory import FULL, Trajectory, parse_context_steps
from mempo_jax.core.validation import check, require
from mempo_jax.agent.turns import apply_tools, make_turn


@runtime_checkable
class Engine(Protocol):
    """What a rollout runs on (``engine.RolloutEngine``; tests give it scripted engines)."""

    def place(self, params):
        """The parameters on the engine's (host-local) mesh."""

    def rollout(self, params, trajs: list, fmt, tool_env, cfg: "RolloutConfig", key: jax.Array,
                progress: Optional[Callable[[int, int], None]] = None, traj_offset: int = 0) -> list:
        """Run fresh trajectories (prompt only, ``new_trajectories``) to the end of their episodes,
        in place; return them. ``params``: placed first (``place``: a collective when they span
        processes). ``tool_env``: the host tools (``tools.environment.ToolEnvironment``:
        ``execute_batch(list[ParsedTurn]) -> list[ToolResult]``). The token at step j of turn u of
        trajectory i draws with a key that is a pure function of (``key``, ``traj_offset + i``, u,
        j), so a trajectory samples the same tokens whatever process runs it; ``progress``:
        optional callback ``(turn, active_rows)``."""

    def warm(self, params, cfg: "RolloutConfig", num_trajectories: int, key: jax.Array) -> int:
        """Compile every program a rollout of ``num_trajectories`` can run (a later rollout
        compiles nothing); return their count."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static options of a rollout.

    Attributes:
      max_turns: an episode ends after this many turns without an answer.
      max_new_tokens: generation budget of one turn (tokens).
      max_context_tokens: an episode ends when the next context would exceed this (the token budget).
      max_observation_tokens: tool results are cut to this many tokens (tags excluded).
      temperature: sampling temperature (0 = greedy).
      top_p: nucleus mass.
      context_steps: ``FULL`` (0) for the whole history, or k ≥ 1 (MemPO inference, k = 1).
      min_rows_bucket: the smallest slot count (fewer compiled shapes): the slot count is
        ``bucket_length(trajectories, min_rows_bucket)``.
      num_slots: cache slots (0 = one per trajectory, bucketed as above); fewer slots than
        trajectories queue the rest until a slot frees.
      decode_chunk: decode steps between two host cycles (refills, tools).
      prefill_chunk: the length of a prefill row (tokens, a power of two): what a turn appends to
        a slot is cut into rows of this length, up to one row per slot in a call.
    """

    max_turns: int = 6
    max_new_tokens: int = 48
    max_context_tokens: int = 1024
    max_observation_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    context_steps: int | str = 1
    min_rows_bucket: int = 64
    num_slots: int = 0
    decode_chunk: int = 16
    prefill_chunk: int = 32

    def __post_init__(self):
        try:
            object.__setattr__(self, "context_steps", parse_context_steps(self.context_steps))
        except (TypeError, ValueError) as e:
            raise ValueError(f"RolloutConfig.{e}") from None
        for name in ("max_turns", "max_new_tokens", "max_context_tokens", "max_observation_tokens", "min_rows_bucket"):
            check(self, name, int, lo=1)
        for name in ("decode_chunk", "prefill_chunk"):
            check(self, name, int, lo=1)
        check(self, "num_slots", int, lo=0)
        require(self.prefill_chunk & (self.prefill_chunk - 1) == 0,
                f"RolloutConfig.prefill_chunk = {self.prefill_chunk} must be a power of two")
        check(self, "temperature", float, lo=0.0)
        check(self, "top_p", float, gt=0.0, hi=1.0)
        require(self.max_new_tokens < self.max_context_tokens,
                f"RolloutConfig.max_new_tokens = {self.max_new_tokens} must be < RolloutConfig.max_context_tokens = "
                f"{self.max_context_tokens} (no turn would fit the context budget)")


def new_trajectories(fmt: AgentFormat, questions: Sequence, group_size: int, group_offset: int = 0) -> list[Trajectory]:
    """``group_size`` fresh trajectories per question; the group id is the question's index in
    ``questions`` (+ ``group_offset``), assigned before the copies are made (docs/algorithm.md §4).

    ``questions`` items need ``id``, ``question`` and ``golds``.
    """
    out = []
    for g, q in enumerate(questions):
        prompt = fmt.prompt_ids(q.question)
        out += [Trajectory(q.id, g + group_offset, tuple(q.golds), list(prompt)) for _ in range(group_size)]
    return out


def rollout_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per-batch episode statistics: turns, tool calls, format failures, TT and PT (means)."""
    if not trajs:
        return {}
    tt_pt = np.array([tr.token_stats() for tr in trajs], dtype=np.float64)
    turns = np.array([len(tr.turns) for tr in trajs], dtype=np.float64)
    fails = np.array([tr.format_failures for tr in trajs], dtype=np.float64)
    return {
        "num_turns/mean": float(turns.mean()),
        "tool_calls/mean": float(np.mean([tr.num_tool_calls for tr in trajs])),
        "format_fail/rate": float(fails.sum() / max(turns.sum(), 1.0)),
        "answered/rate": float(np.mean([tr.answer is not None for tr in trajs])),
        "tokens/tt": float(tt_pt[:, 0].mean()),
        "tokens/pt": float(tt_pt[:, 1].mean()),
        "response_length/mean": float(np.mean([sum(len(t.output_ids) for t in tr.turns) for tr in trajs])),
    }


__all__ = [
    "ALL_TAG_PIECES", "AgentFormat", "Engine", "FULL", "RolloutConfig", "SYSTEM_PROMPT", "apply_tools",
    "make_turn", "new_trajectories", "rollout_metrics",
]
