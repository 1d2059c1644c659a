"""Grouped advantages: outcome A_T per trajectory, memory A_M per ``<mem>`` span (docs/algorithm.md §4).

Everything here is pure JAX and jittable (``num_groups`` and ``shape`` are static). Group
statistics are segment reductions over question ids (``jax.ops.segment_*``), never Python loops
over groups and never whole-batch statistics: questions of different difficulty must not
interfere. Group ids are assigned per question *before* the n rollout copies are made, e.g.
``group_ids = np.repeat(question_ids, n)``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, Real, Shaped

from mempo_jax.core.registry import Registry


def _group_centred(values, group_ids, num_groups: int, valid):
    """``(v, valid, gid, count, centred)``: the float32 values, the mask, the group id of each entry
    (0 on invalid ones), the valid entries per group ``[G]`` and ``v - mean_g`` over the group's
    valid entries (0 on invalid ones): the centring that ``group_normalize`` and the centred
    memory advantage share."""
    v = jnp.asarray(values, jnp.float32)
    valid = jnp.ones(v.shape, bool) if valid is None else jnp.asarray(valid, bool)
    gid = jnp.where(valid, jnp.asarray(group_ids, jnp.int32), 0)
    w = valid.astype(jnp.float32)
    count = jax.ops.segment_sum(w, gid, num_segments=num_groups)
    mean = jax.ops.segment_sum(v * w, gid, num_segments=num_groups) / jnp.maximum(count, 1.0)
    return v, valid, gid, count, (v - mean[gid]) * w


def group_normalize(
    values: Real[ArrayLike, "entries"],
    group_ids: Int[ArrayLike, "entries"],
    num_groups: int,
    valid: Bool[ArrayLike, "entries"] | None = None,
    eps: float = 1e-6,
) -> Float[Array, "entries"]:
    """Per-group z-score ``(v - mean_g) / (std_g + eps)`` with segment ops (docs/algorithm.md §4, GRPO).

    ``std_g`` is the unbiased standard deviation (divisor ``N_g - 1``) over the group's valid
    entries. Special cases, decided exactly (not through float arithmetic):

    * all valid values of a group equal (``segment_max == segment_min``) → exactly 0.0, even when
      the float mean differs from the values (16 × 0.35);
    * a group with one valid entry → that entry's raw value;
    * invalid entries → 0.0, and they do not enter any statistic.

    Args:
      values: ``[N]`` float rewards (cast to float32).
      group_ids: ``[N]`` int32 group index in ``[0, num_groups)``; ids of invalid entries are
        ignored (ids of valid entries outside the range are a caller bug: their statistics are
        undefined).
      num_groups: static number of groups (segments).
      valid: ``[N]`` bool, default all True.
      eps: added to the std (same units as ``values``).

    Returns:
      ``[N]`` float32 normalised values.
    """
    v, valid, gid, count, centred = _group_centred(values, group_ids, num_groups, valid)
    var = jax.ops.segment_sum(centred * centred, gid, num_segments=num_groups) / jnp.maximum(count - 1.0, 1.0)
    std = jnp.sqrt(var)
    vmax = jax.ops.segment_max(jnp.where(valid, v, -jnp.inf), gid, num_segments=num_groups)
    vmin = jax.ops.segment_min(jnp.where(valid, v, jnp.inf), gid, num_segments=num_groups)

    z = centred / (std[gid] + eps)
    out = jnp.where((vmax == vmin)[gid], 0.0, z)
    out = jnp.where((count == 1.0)[gid], v, out)
    return jnp.where(valid, out, 0.0)


def outcome_advantage(rewards: Real[ArrayLike, "trajectories"], group_ids: Int[ArrayLike, "trajectories"],
                      num_groups: int) -> Float[Array, "trajectories"]:
    """Outcome advantage A_T: GRPO group normalisation of R_T (docs/algorithm.md §4).

    Args:
      rewards: ``[N]`` float outcome rewards, one per trajectory.
      group_ids: ``[N]`` int32 question index of each trajectory.
      num_groups: static number of questions.

    Returns:
      ``[N]`` float32 ``group_normalize(rewards, group_ids, num_groups)``.
    """
    return group_normalize(rewards, group_ids, num_groups)


MEMORY_NORMS: Registry[Callable[..., jax.Array]] = Registry("memory advantage norm")


@MEMORY_NORMS.register("zscore")
def _zscore(mem_rewards, mem_group_ids, num_groups: int, valid) -> jax.Array:
    """``group_normalize``: (R_M − mean_g) / (std_g + eps) (docs/algorithm.md §4)."""
    return group_normalize(mem_rewards, mem_group_ids, num_groups, valid)


@MEMORY_NORMS.register("center")
def _center(mem_rewards, mem_group_ids, num_groups: int, valid) -> jax.Array:
    """``R_M − mean_g`` only, left in R_M's units (the no-std variant of Dr. GRPO, Liu et al. 2025)."""
    _, valid, _, _, centred = _group_centred(mem_rewards, mem_group_ids, num_groups, valid)
    return jnp.where(valid, centred, 0.0)


def memory_advantage(
    mem_rewards: Real[ArrayLike, "turns"],
    mem_group_ids: Int[ArrayLike, "turns"],
    num_groups: int,
    valid: Bool[ArrayLike, "turns"],
    norm: str = "zscore",
) -> Float[Array, "turns"]:
    """Memory advantage A_M per ``<mem>`` turn (docs/algorithm.md §4).

    One mean/std per segment (a question group: pooled over *every turn of every trajectory* of
    that group); each turn's R_M is normalised with it (so turns of one trajectory get different values).

    Args:
      mem_rewards: ``[M]`` float R_M = P_mem − P_full (probability units), one per turn.
      mem_group_ids: ``[M]`` int32 segment of the turn (its question index by default).
      num_groups: static number of segments.
      valid: ``[M]`` bool, False on padding turns.
      norm: a name in ``MEMORY_NORMS``: ``"zscore"`` (the spec: ``group_normalize``) or
        ``"center"`` (``R_M − mean_g`` only, so a group whose R_M differ by noise gets
        advantages of that size rather than ±1; ``MemoryRewardConfig.norm``).

    Returns:
      ``[M]`` float32; 0 on invalid turns.

    Raises:
      ValueError: an unknown ``norm`` (listing the known ones).
    """
    return MEMORY_NORMS.get(norm)(mem_rewards, mem_group_ids, num_groups, valid)


def scatter_span_values(
    values: Real[ArrayLike, "turns"],
    rows: Int[ArrayLike, "turns"],
    starts: Int[ArrayLike, "turns"],
    ends: Int[ArrayLike, "turns"],
    valid: Bool[ArrayLike, "turns"],
    shape: tuple[int, int],
) -> Float[Array, "{shape[0]} {shape[1]}"]:
    """Write ``values[m]`` on tokens ``[starts[m], ends[m])`` of row ``rows[m]``, zero elsewhere.

    Built from an integer difference array (span index ``m + 1`` added at ``start``, subtracted at
    ``end``, cumulative sum along the sequence) then a gather, so outside spans the result is
    exactly 0.0 and inside it is exactly ``values[m]``; cost O(B·T + M).

    Args:
      values: ``[M]`` float values (e.g. ``memory_advantage``).
      rows: ``[M]`` int32 row of each span in ``[0, B)``.
      starts: ``[M]`` int32 first token position (clipped to ``[0, T]``).
      ends: ``[M]`` int32 exclusive end (clipped to ``[0, T]``); ``end <= start`` is an empty span.
      valid: ``[M]`` bool, invalid spans are skipped.
      shape: static ``(B, T)``.

    Returns:
      ``[B, T]`` float32.

    Precondition: valid spans do not overlap (overlaps give wrong values; not checked).
    """
    b, t = shape
    valid = jnp.asarray(valid, bool)
    starts = jnp.clip(jnp.asarray(starts, jnp.int32), 0, t)
    ends = jnp.clip(jnp.asarray(ends, jnp.int32), 0, t)
    nonempty = valid & (ends > starts)
    rows = jnp.where(nonempty, jnp.asarray(rows, jnp.int32), 0)
    span_id = jnp.where(nonempty, jnp.arange(1, values.shape[0] + 1, dtype=jnp.int32), 0)
    diff = jnp.zeros((b, t + 1), jnp.int32)
    diff = diff.at[rows, starts].add(span_id).at[rows, ends].add(-span_id)
    idx = jnp.cumsum(diff, axis=1)[:, :t]
    table = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.asarray(values, jnp.float32)])
    return table[idx]


def token_advantages(
    outcome_adv: Real[ArrayLike, "rows"],
    mem_token_adv: Real[ArrayLike, "rows length"],
    loss_mask: Shaped[ArrayLike, "rows length"],
) -> Float[Array, "rows length"]:
    """Final per-token advantage ``A = (A_T[:, None] + A_M) * loss_mask`` (docs/algorithm.md §4).

    Args:
      outcome_adv: ``[B]`` float A_T per sequence.
      mem_token_adv: ``[B, T]`` float A_M, non-zero only on ``<mem>`` tokens.
      loss_mask: ``[B, T]`` bool/float, 1 on trained (generated) tokens.

    Returns:
      ``[B, T]`` float32.
    """
    a = jnp.asarray(outcome_adv, jnp.float32)[:, None] + jnp.asarray(mem_token_adv, jnp.float32)
    return a * jnp.asarray(loss_mask, jnp.float32)
