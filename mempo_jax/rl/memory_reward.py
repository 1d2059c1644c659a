"""Memory reward R_M = P(Z | mem_traj[t]) − P(Z | full_traj[t]) (docs/algorithm.md §3).

Z is scored after a fixed, never-scored prefix (``answer_prefix``, and ``full_prefix`` on the
full view only): ``MemoryRewardConfig.prefix`` picks it (``experiment.answer_prefix_ids``).

A detached extra forward pass: nothing is generated; the answer Z is re-scored under the full
history snapshot and under the compressed memory view of every ``<mem>`` turn. All 2M contexts
are stacked into one batch ``[full_0 .. full_{M-1}; mem_0 .. mem_{M-1}]`` with Z repeated twice
and scored with one jitted call (reference: one ``compute_log_prob`` over the stacked batch).
Its values enter the advantage as constants (``jax.lax.stop_gradient``).

The stacked rows are *packed* end to end (``mempo_jax.core.packing``: segment ids, per-segment
RoPE positions, attention inside each segment) instead of each being padded to the longest row,
and the LM head runs on Z's tokens only: the P values of the padded layout (``build_scoring_batch``,
``answer_likelihood``; float32 rounding aside) for far fewer computed positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.agent.trajectory import FULL
from mempo_jax.core.registry import Registry
from mempo_jax.core.validation import check
from mempo_jax.core.batching import bucket_length, pad_sequences
from mempo_jax.core.batching import length_buckets as _length_buckets
from mempo_jax.core.logprobs import target_logprobs
from mempo_jax.core.packing import pack, plan_packing
from mempo_jax.model.forward import LogitsFn
from mempo_jax.rl.advantage import MEMORY_NORMS


def answer_likelihood(logp: Float[ArrayLike, "rows length"],
                      answer_mask: Bool[ArrayLike, "rows length"]) -> Float[Array, "rows"]:
    """Length-normalised likelihood ``P(Z | c) = exp(Σ_t logp·m / Σ_t m)`` (docs/algorithm.md §3).

    The geometric mean of Z's token probabilities.

    Args:
      logp: ``[B, L]`` float32 natural-log token probabilities (``token_logprobs`` convention).
      answer_mask: ``[B, L]`` bool, True exactly on Z's tokens.

    Returns:
      ``[B]`` float32 probabilities in [0, 1]; 0.0 for rows without answer tokens.
    """
    m = jnp.asarray(answer_mask, bool)
    n = jnp.sum(m, axis=-1)
    total = jnp.sum(jnp.where(m, jnp.asarray(logp, jnp.float32), 0.0), axis=-1)
    mean = total / jnp.maximum(n, 1).astype(jnp.float32)
    return jnp.where(n > 0, jnp.exp(mean), 0.0)


def build_scoring_batch(
    full_contexts: Sequence[Sequence[int]],
    mem_contexts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    answer_prefix: Sequence[int],
    pad_id: int,
    *,
    pad_rows_to_bucket: bool = False,
    min_rows: int = 1,
    full_prefix: Sequence[int] = (),
) -> tuple[Int[np.ndarray, "rows length"], Bool[np.ndarray, "rows length"], Bool[np.ndarray, "rows length"]]:
    """Stack ``[full_i + full_prefix + prefix + Z_i]`` then ``[mem_i + prefix + Z_i]`` into one padded batch.

    Row ``i < M`` is ``full_contexts[i] + full_prefix + answer_prefix + answers[i]``, row
    ``M + i`` is ``mem_contexts[i] + answer_prefix + answers[i]``; right-padded with ``pad_id`` to
    ``L = bucket_length(longest row)``. With ``pad_rows_to_bucket`` the row count is padded to
    ``bucket_length(2M, min_rows)`` with all-invalid rows (callers drop them from outputs).

    Args:
      full_contexts: M token-id lists, ``full_traj[t]`` snapshots.
      mem_contexts: M token-id lists, ``mem_traj[t]`` views.
      answers: M token-id lists, the answer Z of each turn (may be empty: its P is 0).
      answer_prefix: ids between context and Z (e.g. the ``<answer>`` tag); never scored.
      pad_id: padding id.
      pad_rows_to_bucket: pad the row count to a power of two (jit sees few shapes).
      min_rows: smallest row bucket (a power of two, e.g. the data-parallel device count).
      full_prefix: ids placed on the full view only, before ``answer_prefix`` (e.g. an empty
        ``<mem></mem>``: ``full_traj[t]`` then ends in a closed memory block as ``mem_traj[t]``
        does, so the shared prefix is the policy's own continuation on both views); never scored.

    Returns:
      ``(input_ids [R, L] int32, valid [R, L] bool, answer_mask [R, L] bool)``, ``R = 2M``
      (or its bucket); ``answer_mask`` is True exactly on Z's tokens (not prefix, not padding).

    Raises:
      ValueError: if the three lists differ in length, or a non-empty Z would sit at position 0
        (context and prefix both empty: nothing predicts the first token).
    """
    rows, spans = _stacked_rows(full_contexts, mem_contexts, answers, answer_prefix, full_prefix)
    ids, valid = pad_sequences(rows, pad_id)
    answer_mask = _answer_mask(valid.shape, spans)
    m = len(full_contexts)
    if pad_rows_to_bucket:
        extra = bucket_length(2 * m, minimum=min_rows) - 2 * m
        ids = np.concatenate([ids, np.full((extra, ids.shape[1]), pad_id, np.int32)])
        valid = np.concatenate([valid, np.zeros((extra, ids.shape[1]), bool)])
        answer_mask = np.concatenate([answer_mask, np.zeros((extra, ids.shape[1]), bool)])
    return ids, valid, answer_mask


def _answer_mask(shape: tuple[int, int], spans) -> np.ndarray:
    """``[R, L]`` bool, True on Z's ``[start, end)`` span of each of the first ``len(spans)`` rows."""
    mask = np.zeros(shape, bool)
    for r, (s, e) in enumerate(spans):
        mask[r, s:e] = True
    return mask


def _stacked_rows(full_contexts, mem_contexts, answers, answer_prefix,
                  full_prefix=()) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The 2M rows ``[full_i + full_prefix + prefix + Z_i]`` then ``[mem_i + prefix + Z_i]`` and
    Z's ``[start, end)`` in each (see ``build_scoring_batch``; same errors)."""
    m = len(full_contexts)
    if len(mem_contexts) != m or len(answers) != m:
        raise ValueError(f"need as many contexts as answers: {m} full, {len(mem_contexts)} mem, {len(answers)} answers")
    views = [list(full_prefix) + list(answer_prefix)] * m + [list(answer_prefix)] * m
    rows, spans = [], []
    for (ctx, z), prefix in zip(list(zip(full_contexts, answers)) + list(zip(mem_contexts, answers)), views):
        start = len(ctx) + len(prefix)
        if start == 0 and len(z) > 0:
            raise ValueError("an empty context with an empty answer_prefix leaves Z's first token unscored")
        rows.append(list(ctx) + prefix + list(z))
        spans.append((start, start + len(z)))
    return rows, spans


DEFAULT_CHUNK_ROWS = 64  # rows per scorer call when none is configured
DEFAULT_MIN_LENGTH = 64  # smallest length bucket of a scorer call
ANSWER_FRACTION = 4  # a packed row of L columns scores at most L // 4 answer tokens (the LM head's K)


class MemoryRewardOutput(NamedTuple):
    """Per-turn memory reward (docs/algorithm.md §3); ``[M]`` float32 numpy arrays, probability units."""

    r_mem: Float[np.ndarray, "turns"]  # p_mem − p_full
    p_full: Float[np.ndarray, "turns"]  # P(Z | full_traj[t])
    p_mem: Float[np.ndarray, "turns"]  # P(Z | mem_traj[t])


LOG_FLOOR = 1e-30  # P below this counts as this in the ``"log"`` scale (P = 0: no Z token)

# ---- the memory reward's variants: MemoryRewardConfig names one of each, registered here ------------

MEMORY_REWARD_SCALES: Registry[Callable[[MemoryRewardOutput], np.ndarray]] = Registry("memory reward scale")
MEMORY_BASELINES: Registry[Callable[[int | str], int | str]] = Registry("memory reward baseline")
MEMORY_TRAJECTORIES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("memory reward trajectory selection")
MEMORY_GROUPINGS: Registry[Callable[..., tuple[np.ndarray, int]]] = Registry("memory reward grouping")
MEMORY_ANSWERS = ("gold", "generated")  # the Z scored: MemoryRewardConfig.answer (``memory_views.memory_contexts``)
MEMORY_PREFIXES = ("empty_mem", "think", "none")  # MemoryRewardConfig.prefix (``experiment.answer_prefix_ids``)


@MEMORY_REWARD_SCALES.register("prob")
def _prob_scale(out: MemoryRewardOutput) -> np.ndarray:
    """``P_mem − P_full`` in [−1, 1] (docs/algorithm.md §3)."""
    return np.asarray(out.r_mem, np.float32)


@MEMORY_REWARD_SCALES.register("log")
def _log_scale(out: MemoryRewardOutput) -> np.ndarray:
    """``log P_mem − log P_full``: nats per answer token, ``P`` floored at ``LOG_FLOOR``."""
    lp_mem = np.log(np.maximum(np.asarray(out.p_mem, np.float64), LOG_FLOOR))
    lp_full = np.log(np.maximum(np.asarray(out.p_full, np.float64), LOG_FLOOR))
    return (lp_mem - lp_full).astype(np.float32)


def memory_reward_values(out: MemoryRewardOutput, scale: str = "prob") -> Float[np.ndarray, "turns"]:
    """R_M of each scored turn in the chosen units (``MemoryRewardConfig.scale``).

    ``"prob"`` (docs/algorithm.md §3): ``P_mem − P_full``, in [−1, 1]. ``"log"``: ``log P_mem − log
    P_full``, the difference of the mean per-token log-likelihoods of Z (nats per answer token;
    ``P`` floored at ``LOG_FLOOR``). The two rank a memory that lost what the full history held
    the same way, but a difference of probabilities vanishes whenever Z is still unlikely under
    both views. E.g. a multi-objective memory that drops objective 1's answer before objective 2
    has been searched: half of Z's tokens at 0.9 and half at 0.002 under the full view, all at
    0.002 under the memory, gives P 0.042 against 0.002, R_M −0.040 in probability but −3.05 in
    log — the size of a final-turn drop.

    Args:
      out: the scorer's ``MemoryRewardOutput`` (``[M]`` float32 ``p_full``, ``p_mem``).
      scale: a name in ``MEMORY_REWARD_SCALES`` (``"prob"`` or ``"log"``).

    Returns:
      ``[M]`` float32.

    Raises:
      ValueError: an unknown ``scale`` (listing the known ones).
    """
    return MEMORY_REWARD_SCALES.get(scale)(out)


@MEMORY_BASELINES.register("full")
def _full_baseline(context_steps: int | str) -> int | str:
    """``full_traj[t]``, the whole history (docs/algorithm.md §3)."""
    return FULL


@MEMORY_BASELINES.register("input")
def _input_baseline(context_steps: int | str) -> int | str:
    """The context turn t's memory was written from (``Trajectory.policy_context(context_steps, t)``)."""
    return context_steps


@MEMORY_TRAJECTORIES.register("all")
def _all_trajectories(rewards: np.ndarray) -> np.ndarray:
    """Every trajectory (docs/algorithm.md §3)."""
    return np.ones(np.shape(rewards), bool)


@MEMORY_TRAJECTORIES.register("correct")
def _correct_trajectories(rewards: np.ndarray) -> np.ndarray:
    """Trajectories whose outcome reward is > 0."""
    return np.asarray(rewards) > 0


@MEMORY_GROUPINGS.register("question")
def _question_groups(group_ids: np.ndarray, turn_index: np.ndarray, num_groups: int,
                     max_turns: int | None) -> tuple[np.ndarray, int]:
    """One segment per question: every turn of every trajectory of its group (docs/algorithm.md §4)."""
    return np.asarray(group_ids, np.int32).reshape(-1), int(num_groups)


@MEMORY_GROUPINGS.register("turn")
def _turn_groups(group_ids: np.ndarray, turn_index: np.ndarray, num_groups: int,
                 max_turns: int | None) -> tuple[np.ndarray, int]:
    """One segment per (question, turn index): segment ``group · max_turns + turn``.

    Raises:
      ValueError: ``max_turns`` is None, or a turn index ``>= max_turns``.
    """
    if max_turns is None:
        raise ValueError("the 'turn' memory reward grouping needs max_turns (RolloutConfig.max_turns)")
    t = np.asarray(turn_index, np.int32).reshape(-1)
    if t.size and t.max() >= max_turns:
        raise ValueError(f"a <mem> turn index {int(t.max())} >= max_turns {max_turns}")
    return np.asarray(group_ids, np.int32).reshape(-1) * max_turns + t, int(num_groups) * int(max_turns)


@dataclasses.dataclass(frozen=True)
class MemoryRewardConfig:
    """How the memory reward R_M is scored and turned into A_M (docs/algorithm.md §3–§4).

    The defaults are the algorithm as written; every other value is a variant, chosen by name
    from the registries above.

    Attributes:
      answer: the Z scored (``MEMORY_ANSWERS``): ``"gold"`` (each objective's first alias) or
        ``"generated"`` (the sampled ids of the trajectory's final ``<answer>`` block; gold
        without one).
      prefix: the never-scored ids between a view and Z (``MEMORY_PREFIXES``,
        ``experiment.answer_prefix_ids``): ``"empty_mem"`` (the full view gets an empty
        ``<mem></mem>``), ``"think"`` or ``"none"``.
      include_malformed: also score the ``<mem>`` span of a turn with a format error. ``False``:
        such turns get no R_M / A_M and stay out of the group's statistics (their tokens keep
        A_T); ``mem/excluded_malformed`` counts them.
      trajectories: which trajectories' ``<mem>`` turns are scored (``MEMORY_TRAJECTORIES``):
        ``"all"`` or ``"correct"`` (outcome reward > 0). The others are left out as malformed
        turns are.
      scale: the units of R_M (``MEMORY_REWARD_SCALES``, ``memory_reward_values``): ``"prob"``
        or ``"log"``.
      baseline: the view P_mem is compared with (``MEMORY_BASELINES``): ``"full"``
        (``full_traj[t]``) or ``"input"`` (the context the policy wrote turn t's memory from;
        the same as ``"full"`` in full mode).
      hindsight: append the tool results returned from turn t on
        (``Trajectory.later_observations``) to both views of turn t's memory; both views then end
        with the same tool results and the same never-scored continuation (the empty
        ``<mem></mem>`` of ``prefix``, ``memory_views.memory_contexts``) before Z.
      norm: how R_M becomes A_M within a segment (``advantage.MEMORY_NORMS``): ``"zscore"`` or
        ``"center"`` (mean subtracted only, in R_M's units).
      group: which ``<mem>`` turns share one R_M mean/std (``MEMORY_GROUPINGS``):
        ``"question"`` (every turn of every trajectory of the question's group) or ``"turn"``
        (the group's turns of the same index).
      score_when_unused: run the memory-reward pass even when ``RLConfig.memory_coef = 0``
        (GRPO), for its ``mem/*`` metrics only; the update does not read it. ``False`` (default):
        GRPO skips the pass and logs ``mem/reward/mean``, ``mem/p_full/mean`` and
        ``mem/p_mem/mean`` as 0.

    Raises:
      ValueError: one line naming the field and the known values.
    """

    answer: str = "gold"
    prefix: str = "empty_mem"
    include_malformed: bool = False
    trajectories: str = "all"
    scale: str = "prob"
    baseline: str = "full"
    hindsight: bool = False
    norm: str = "zscore"
    group: str = "question"
    score_when_unused: bool = False

    def __post_init__(self):
        check(self, "answer", str, choices=MEMORY_ANSWERS)
        check(self, "prefix", str, choices=MEMORY_PREFIXES)
        check(self, "include_malformed", bool)
        check(self, "hindsight", bool)
        check(self, "score_when_unused", bool)
        for name, registry in (("trajectories", MEMORY_TRAJECTORIES), ("scale", MEMORY_REWARD_SCALES),
                               ("baseline", MEMORY_BASELINES), ("norm", MEMORY_NORMS), ("group", MEMORY_GROUPINGS)):
            check(self, name, str, choices=tuple(registry.names()))


class MemoryRewardScorer:
    """Scores P(Z | full) and P(Z | mem) for all turns of a batch in one detached jitted call.

    The stacked rows are packed into calls ``[R, L]`` with ``L`` a length bucket
    (``packing.plan_packing``: the cheapest of ``bucket(longest row)`` and its doublings) and
    ``R = bucket_length(packed rows, min_rows) <= rows_per_call``; the LM head runs on
    ``K = L // ANSWER_FRACTION`` columns per row (Z's tokens).

    Args:
      logits_fn: the policy (``model.forward.LogitsFn``).
      pad_id: padding id.
      answer_prefix: ids placed between context and Z on both views (e.g. ``[id("<answer>")]``).
      full_prefix: ids placed on the full view only, before ``answer_prefix`` (see
        ``build_scoring_batch``; ``experiment.answer_prefix_ids`` builds both from
        ``MemoryRewardConfig.prefix``).
      temperature: the sampler's softmax temperature (> 0), as for the trainer's log-probs.
      min_rows: smallest row bucket; use a multiple of the data-parallel device count.
      batch_sharding: optional ``jax.sharding.Sharding`` for the ``[R, L]`` batch arrays.
      param_shardings: optional shardings of ``params`` (e.g. ``mempo_jax.core.sharding.param_shardings``);
        with ``batch_sharding`` (a ``NamedSharding``), the jitted call declares
        ``in_shardings=(param_shardings, batch × 5)`` and a replicated output.
      chunk_rows: most packed rows per device call (a power of two; ``None``:
        ``DEFAULT_CHUNK_ROWS``, raised to ``min_rows`` when smaller): ``rows_per_call``. The
        values do not depend on it (rows are independent); the shapes depend on the config, not
        on M, so the program compiles once per (row bucket, length bucket) (``length_buckets``
        lists the lengths, ``precompile`` builds them ahead of time).
      min_length: smallest length bucket (a power of two).

    Raises:
      ValueError: if ``temperature <= 0``.
    """

    def __init__(
        self,
        logits_fn: LogitsFn,
        pad_id: int,
        answer_prefix: Sequence[int],
        temperature: float = 1.0,
        *,
        min_rows: int = 8,
        batch_sharding: jax.sharding.Sharding | None = None,
        param_shardings: Any = None,
        chunk_rows: int | None = None,
        min_length: int = DEFAULT_MIN_LENGTH,
        full_prefix: Sequence[int] = (),
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if chunk_rows is not None and (chunk_rows < 1 or chunk_rows & (chunk_rows - 1)):
            raise ValueError(f"chunk_rows must be a power of two, got {chunk_rows}")
        self.logits_fn = logits_fn
        self.pad_id = int(pad_id)
        self.answer_prefix = [int(t) for t in answer_prefix]
        self.full_prefix = [int(t) for t in full_prefix]
        self.temperature = float(temperature)
        self.min_rows = int(min_rows)
        self.batch_sharding = batch_sharding
        self.param_shardings = param_shardings
        self.chunk_rows = chunk_rows
        self.min_length = int(min_length)
        self.rows_per_call = bucket_length(DEFAULT_CHUNK_ROWS if chunk_rows is None else chunk_rows,
                                           max(self.min_rows, 1))
        self._length_cap = None  # set by ``precompile``: packed lengths never exceed the compiled ones
        if param_shardings is not None and isinstance(batch_sharding, jax.sharding.NamedSharding):
            rep = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
            bs = batch_sharding
            self.packed_logprobs = jax.jit(self._packed_logprobs, in_shardings=(param_shardings,) + (bs,) * 5,
                                           out_shardings=rep)
        else:
            self.packed_logprobs = jax.jit(self._packed_logprobs)

    def _packed_logprobs(self, params, input_ids, segment_ids, positions, logits_at, targets) -> jax.Array:
        """``(params, ids, segment_ids, positions [R, L], logits_at, targets [R, K]) -> logp [R, K]``
        float32: ``log softmax(logits[logits_at] / T)[targets]``, no grad; the LM head runs on the
        hidden states at ``logits_at`` in ``logit_chunk``-column chunks."""
        params = jax.lax.stop_gradient(params)
        fn = self.logits_fn
        hidden = fn.packed_hidden(params, input_ids, segment_ids, positions, remat="none")
        hidden = jnp.take_along_axis(hidden, logits_at[..., None].astype(jnp.int32), axis=1)  # [R, K, D]
        logp, _ = target_logprobs(hidden, targets, fn.project, fn.head(params), self.temperature, fn.logit_chunk)
        return jax.lax.stop_gradient(logp)

    def _score_packed(self, params, rows, spans) -> np.ndarray:
        """``P [len(rows)]`` float32 of the stacked rows, packed."""
        sizes = [len(r) for r in rows]
        zlens = [e - s for s, e in spans]
        length, calls = plan_packing(sizes, self.min_length, self.rows_per_call, self.min_rows, zlens, ANSWER_FRACTION,
                                     max_doublings=self._doublings(sizes))
        k = length // ANSWER_FRACTION
        starts = np.asarray([a for a, _ in spans], np.int64)
        ends = np.asarray([b for _, b in spans], np.int64)
        total = np.zeros((len(rows),), np.float64)
        for bins in calls:
            r = bucket_length(len(bins), max(self.min_rows, 1))
            pk = pack(rows, bins, length, r, self.pad_id)
            at = np.zeros((r, k), np.int32)
            tgt = np.zeros((r, k), np.int32)
            owner = np.full((r, k), -1, np.int64)
            src = np.maximum(pk.row_of, 0)
            is_answer = (pk.row_of >= 0) & (pk.col_of >= starts[src]) & (pk.col_of < ends[src])  # [R, L]
            for b in range(len(bins)):
                cols = np.flatnonzero(is_answer[b])
                at[b, : len(cols)] = cols - 1  # logits at column c - 1 predict the token at c
                tgt[b, : len(cols)] = pk.input_ids[b, cols]
                owner[b, : len(cols)] = pk.row_of[b, cols]
            batch = (pk.input_ids, pk.segment_ids, pk.positions, at, tgt)
            if self.batch_sharding is not None:
                batch = tuple(jax.device_put(x, self.batch_sharding) for x in batch)
            logp = np.asarray(jax.device_get(self.packed_logprobs(params, *batch)), np.float64)
            keep = owner >= 0
            np.add.at(total, owner[keep], logp[keep])
        n = np.asarray(zlens, np.float64)
        return np.where(n > 0, np.exp(total / np.maximum(n, 1.0)), 0.0).astype(np.float32)

    def _doublings(self, sizes) -> int:
        """How many times ``plan_packing`` may double the packed length (within the compiled lengths)."""
        if self._length_cap is None:
            return 2
        base = bucket_length(max(sizes, default=1), self.min_length)
        d = 0
        while d < 2 and base * 2 ** (d + 1) <= self._length_cap:
            d += 1
        return d

    def __call__(
        self,
        params: Any,
        full_contexts: Sequence[Sequence[int]],
        mem_contexts: Sequence[Sequence[int]],
        answers: Sequence[Sequence[int]],
    ) -> MemoryRewardOutput:
        """R_M for M turns from the stacked ``[full; mem]`` batch, ``rows_per_call`` rows per call.

        Args:
          params: policy parameters (current policy; treated as constants).
          full_contexts, mem_contexts, answers: M token-id lists each (see ``build_scoring_batch``).

        Returns:
          ``MemoryRewardOutput`` of ``[M]`` float32 arrays; empty arrays (no model call) if M = 0.

        Raises:
          ValueError: as ``build_scoring_batch``.
        """
        m = len(full_contexts)
        if m == 0 and len(mem_contexts) == 0 and len(answers) == 0:
            empty = np.zeros((0,), np.float32)
            return MemoryRewardOutput(empty, empty.copy(), empty.copy())
        rows, spans = _stacked_rows(full_contexts, mem_contexts, answers, self.answer_prefix, self.full_prefix)
        if self.param_shardings is not None:
            params = jax.device_put(params, self.param_shardings)
        p = self._score_packed(params, rows, spans)
        p_full, p_mem = p[:m], p[m : 2 * m]
        return MemoryRewardOutput(p_mem - p_full, p_full, p_mem)

    def length_buckets(self, max_tokens: int) -> list[int]:
        """The length buckets a scoring row of at most ``max_tokens`` tokens can land in:
        ``[min_length, 2·min_length, …, bucket_length(max_tokens, min_length)]``."""
        return _length_buckets(self.min_length, max_tokens)

    def precompile(self, params: Any, lengths: Sequence[int]) -> int:
        """Compile the scoring programs at each ``L`` in ``lengths`` ahead of time
        (``jit.lower(...).compile()``; nothing runs). Later calls at these shapes compile nothing.

        ``[R, L]`` for every row bucket ``R`` from ``min_rows`` to ``rows_per_call`` (with
        ``[R, L // ANSWER_FRACTION]`` answer columns); later calls keep to lengths
        ``<= max(lengths)`` unless a single row is longer.

        Args:
          params: the parameters the scorer will be called with (their shardings count).
          lengths: length buckets (e.g. ``length_buckets(bound)``).

        Returns:
          The number of programs built.
        """
        if self.param_shardings is not None:
            params = jax.device_put(params, self.param_shardings)
        kw = {} if self.batch_sharding is None else {"sharding": self.batch_sharding}
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, **kw)  # noqa: E731
        built = 0
        for length in lengths:
            length = int(length)
            r = max(self.min_rows, 1)
            while r <= self.rows_per_call:
                k = length // ANSWER_FRACTION
                self.packed_logprobs.lower(params, *[sds((r, length), jnp.int32)] * 3,
                                           *[sds((r, k), jnp.int32)] * 2).compile()
                built += 1
                r *= 2
        if lengths:
            self._length_cap = max(int(x) for x in lengths)
        return built
