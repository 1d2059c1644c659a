"""Multi-turn rollout: batched sampling on device, tools on the host (docs/algorithm.md §2).

Every turn, the contexts of all unfinished trajectories are left-padded into one static-shape
batch (power-of-two buckets for rows and length), sampled in one jitted call, parsed on the host,
and answered by the tool environment in one batched call. The sampled ids, their log-probs, the
``<mem>`` span (found on the ids) and the encoded tool result are appended to each trajectory;
``full_traj[t]`` / ``mem_traj[t]`` are views of that record (see ``trajectory.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from mempo_jax.agent.format import PLAIN_SYSTEM_PROMPT as SYSTEM_PROMPT, AgentFormat
from mempo_jax.text.protocol import ALL_TAG_PIECES
from mempo_jax.agent.trajectory import FULL, Trajectory, parse_context_steps
from mempo_jax.core.batching import bucket_length, pad_sequences
from mempo_jax.core.validation import check, require
from mempo_jax.agent.turns import apply_tools, close_episodes, encode_observation, make_turn  # noqa: F401  (the turn helpers of both engines)

MIN_PROMPT_BUCKET = 128  # smallest prompt-length bucket of a sampling batch (tokens)
SampleFn = Callable[..., object]
ENGINES = ("legacy", "cached")  # values of RolloutConfig.engine


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
      min_rows_bucket: the smallest row bucket of a sampling batch (fewer compiled shapes); with the
        cached engine, the slot count is ``bucket_length(trajectories, min_rows_bucket)``.
      engine: ``"legacy"`` — every turn re-prefills every context (one ``sample_fn`` call per turn);
        ``"cached"`` — the KV cache kept across turns and stopped rows refilled
        (``mempo_jax.agent.engine``; needs a ``sample_fn`` with a ``.sampler``, a ``Sampler``).
      num_slots: cached engine: cache slots (0 = one per trajectory, bucketed as above); fewer
        slots than trajectories queue the rest until a slot frees.
      decode_chunk: cached engine: decode steps between two host cycles (refills, tools).
      prefill_chunk: cached engine: the length of a prefill row (tokens, a power of two): what a
        turn appends to a slot is cut into rows of this length, up to one row per slot in a call.
    """

    max_turns: int = 6
    max_new_tokens: int = 48
    max_context_tokens: int = 1024
    max_observation_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    context_steps: int | str = 1
    min_rows_bucket: int = 64
    engine: str = "cached"
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
        require(self.engine in ENGINES, f"RolloutConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        require(self.prefill_chunk & (self.prefill_chunk - 1) == 0,
                f"RolloutConfig.prefill_chunk = {self.prefill_chunk} must be a power of two")
        check(self, "temperature", float, lo=0.0)
        check(self, "top_p", float, gt=0.0, hi=1.0)
        require(self.max_new_tokens < self.max_context_tokens,
                f"RolloutConfig.max_new_tokens = {self.max_new_tokens} must be < RolloutConfig.max_context_tokens = "
                f"{self.max_context_tokens} (no turn would fit the context budget)")


def build_prompt(fmt: AgentFormat, question: str) -> list[int]:
    """The prompt ids of a question: ``fmt.prompt_ids`` (system prompt + question, templated)."""
    return fmt.prompt_ids(question)


def rollout(
    sample_fn: SampleFn,
    params,
    trajs: list[Trajectory],
    fmt: AgentFormat,
    tool_env,
    cfg: RolloutConfig,
    key: jax.Array,
    progress: Optional[Callable[[int, int], None]] = None,
    traj_offset: int = 0,
) -> list[Trajectory]:
    """Run fresh trajectories (prompt only) to the end of their episodes, in place.

    Args:
      sample_fn: ``(params, prompt_ids [B,P] int32 left-padded, prompt_mask [B,P] bool, key,
        max_new_tokens, temperature, top_p) -> SampleOutput`` with ``tokens``, ``logprobs``,
        ``lengths``, ``stopped`` (``[B, N]`` / ``[B]``).
      params: the policy parameters.
      trajs: trajectories holding only ``prompt_ids`` (the n copies of each question share a group id).
      fmt: the agent format (tokenizer, tag codec, prompt template).
      tool_env: host tools with ``execute_batch(list[ParsedTurn]) -> list[ToolResult]``.
      cfg: rollout options.
      key: PRNG key; turn t uses ``fold_in(key, t)``.
      progress: optional callback ``(turn, active_rows)``.
      traj_offset: global index of ``trajs[0]`` (a process's first trajectory): the cached engine
        draws trajectory i's keys as trajectory ``traj_offset + i``.

    Returns:
      The same trajectories, finished.

    Raises:
      ValueError: ``cfg.engine == "cached"`` with a ``sample_fn`` that has no ``.sampler``.
    """
    if cfg.engine == "cached":
        from mempo_jax.agent.engine import rollout_cached

        return rollout_cached(_slot_sampler(sample_fn), params, trajs, fmt, tool_env, cfg, key, progress, traj_offset)
    for t in range(cfg.max_turns):
        active = [tr for tr in trajs if not tr.done]
        if not active:
            break
        contexts = []
        runnable = []
        for tr in active:
            ctx = tr.policy_context(cfg.context_steps)
            if len(ctx) + cfg.max_new_tokens > cfg.max_context_tokens:
                tr.done, tr.end_reason = True, "budget"
                continue
            contexts.append(ctx)
            runnable.append(tr)
        if not runnable:
            break
        if progress is not None:
            progress(t, len(runnable))
        # Few static shapes: rows and length buckets have large minimums, so a whole evaluation
        # or RL run compiles the sampler only a handful of times.
        rows = bucket_length(len(contexts), cfg.min_rows_bucket)
        length = bucket_length(max(len(c) for c in contexts), MIN_PROMPT_BUCKET)
        padded = contexts + [contexts[0][:1]] * (rows - len(contexts))
        ids, mask = pad_sequences(padded, fmt.tokenizer.pad_id, length, side="left")
        out = sample_fn(params, ids, mask, jax.random.fold_in(key, t), cfg.max_new_tokens, cfg.temperature, cfg.top_p)
        tokens, logprobs, lengths, stopped = jax.device_get((out.tokens, out.logprobs, out.lengths, out.stopped))
        turns = []
        for i, (tr, ctx) in enumerate(zip(runnable, contexts)):
            n = int(lengths[i])
            turn = make_turn(fmt, tokens[i, :n], logprobs[i, :n], bool(stopped[i]))
            turn.context_len = len(ctx)
            turns.append(turn)
        apply_tools(fmt, tool_env, runnable, turns, cfg)
    return close_episodes(trajs)


def place_params(sample_fn, params):
    """The policy's parameters on the rollout's (host-local) mesh: ``SlotSampler.place`` of
    ``sample_fn``'s sampler (a collective when ``params`` span processes: every process calls it at
    the same point, once per step); ``params`` themselves for a ``sample_fn`` without a sampler."""
    if getattr(sample_fn, "sampler", None) is None:
        return params
    return _slot_sampler(sample_fn).place(params)


def _slot_sampler(sample_fn):
    """The ``SlotSampler`` behind ``sample_fn.sampler`` (the cached engine's device programs)."""
    sampler = getattr(sample_fn, "sampler", None)
    if sampler is None or not hasattr(sampler, "slot_sampler"):
        raise ValueError("RolloutConfig.engine = 'cached' needs a sample_fn whose .sampler is a mempo_jax.agent.sampler."
                         "Sampler (experiment.make_sample_fn); set RolloutConfig.engine = 'legacy' for this one")
    return sampler.slot_sampler()


def sampler_shapes(cfg: RolloutConfig, num_trajectories: int) -> list[tuple[int, int]]:
    """Every ``(rows, prompt length)`` a ``rollout`` of ``num_trajectories`` can sample with.

    Rows are ``bucket_length(active, min_rows_bucket)`` for ``1 <= active <= num_trajectories``;
    prompt lengths are ``bucket_length(longest context, MIN_PROMPT_BUCKET)`` with the longest
    context at most ``max_context_tokens - max_new_tokens`` (the budget check). Both sets depend on
    the config only, so ``warm_sampler`` can compile all of them before the first step.
    """
    rows = sorted({bucket_length(n, cfg.min_rows_bucket) for n in range(1, max(num_trajectories, 1) + 1)})
    top = bucket_length(max(cfg.max_context_tokens - cfg.max_new_tokens, 1), MIN_PROMPT_BUCKET)
    lengths = [MIN_PROMPT_BUCKET]
    while lengths[-1] < top:
        lengths.append(lengths[-1] * 2)
    return [(r, n) for r in rows for n in lengths]


def warm_sampler(sample_fn: SampleFn, params, pad_id: int, cfg: RolloutConfig, num_trajectories: int,
                 key: jax.Array) -> int:
    """Run ``sample_fn`` once at every shape of ``sampler_shapes`` (dummy one-token prompts), so
    that a later ``rollout`` compiles nothing.

    Every program runs on the sampler's (host-local) mesh; with several processes each warms its own.

    With ``cfg.engine == "cached"`` it compiles the cached engine's programs instead
    (``engine.warm_engine``).

    Returns:
      The number of shapes run (each ran ``max_new_tokens`` decode steps at most).
    """
    if cfg.engine == "cached":
        from mempo_jax.agent.engine import warm_engine

        return warm_engine(_slot_sampler(sample_fn), params, cfg, num_trajectories, key)
    shapes = sampler_shapes(cfg, num_trajectories)
    for rows, length in shapes:
        ids = np.full((rows, length), pad_id, np.int32)
        mask = np.zeros((rows, length), bool)
        ids[:, -1], mask[:, -1] = max(pad_id, 0) + 1, True
        out = sample_fn(params, ids, mask, key, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
        jax.block_until_ready(out.tokens)
    return len(shapes)


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
    "ALL_TAG_PIECES", "AgentFormat", "FULL", "MIN_PROMPT_BUCKET", "RolloutConfig", "SYSTEM_PROMPT", "apply_tools", "build_prompt",
    "encode_observation", "make_turn", "new_trajectories", "place_params", "rollout", "rollout_metrics", "sampler_shapes",
    "warm_sampler",
]
