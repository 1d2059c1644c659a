"""Functional model calls: the uniform contract used by the trainer, the scorer and the rollout.

Everything here is pure: ``(graphdef, params)`` from ``split_model`` and arrays in, arrays out, so
callers can ``jax.jit`` / ``jax.grad`` them with explicit shardings (tunix-style model contract).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mempo_jax.core.logprobs import token_entropy, token_logprobs
from mempo_jax.model.attention import AttentionMask
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import Decoder


def create_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised ``Decoder`` (normal(0.02) weights, unit norms, zero biases).

    Args:
      cfg: model config.
      seed: integer seed of the ``params`` RNG stream.
    """
    return Decoder(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The ``Decoder`` with ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``; allocates nothing)."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0)))


def split_model(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model)`` → ``(graphdef, params)``; ``params`` is an ``nnx.State`` pytree of
    ``nnx.Param`` leaves carrying their logical-axis metadata. Inverse: ``merge_model``."""
    graphdef, params = nnx.split(model)
    return graphdef, params


def merge_model(graphdef: nnx.GraphDef, params: nnx.State) -> Decoder:
    """``nnx.merge(graphdef, params)`` → ``Decoder``."""
    return nnx.merge(graphdef, params)


def positions_from_mask(valid_mask: jax.Array) -> jax.Array:
    """RoPE positions ``max(cumsum(valid) - 1, 0)``: ``[B, L]`` bool → ``[B, L]`` int32.

    Real tokens are numbered 0, 1, 2, … whatever padding sits left of or between them.
    """
    return jnp.maximum(jnp.cumsum(valid_mask.astype(jnp.int32), axis=-1) - 1, 0).astype(jnp.int32)


def make_logits_fn(graphdef: nnx.GraphDef) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
    """Build ``logits_fn(params, input_ids, valid_mask) -> logits``.

    ``input_ids [B, L]`` int32, ``valid_mask [B, L]`` bool (True on real tokens, left or right
    padding or both) → ``logits [B, L, vocab]`` float32, where ``logits[:, t]`` predicts token
    ``t + 1``. Positions come from ``positions_from_mask`` and the attention mask is
    ``causal & valid[:, None, :]`` (an ``attention.AttentionMask``: long rows run the blocked
    attention, no ``[B, L, L]`` array), so a padded row's real tokens get exactly the logits of
    the unpadded row. Logits at padding positions are meaningless. Not jitted: wrap it yourself.

    The returned function carries ``logits_fn.packed`` (``make_packed_logits_fn(graphdef)``),
    the call over rows packed end to end that the memory-reward scorer uses.
    """

    def logits_fn(params: nnx.State, input_ids: jax.Array, valid_mask: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        valid = valid_mask.astype(bool)
        logits, _ = model(input_ids.astype(jnp.int32), positions_from_mask(valid), AttentionMask.causal(valid))
        return logits

    logits_fn.packed = make_packed_logits_fn(graphdef)
    return logits_fn


def packed_positions(segment_ids: np.ndarray) -> np.ndarray:
    """RoPE positions that restart at 0 at the first token of every segment.

    Args:
      segment_ids: ``[B, L]`` int, the segment of each column (0 = padding); a segment is one
        contiguous run of equal ids.

    Returns:
      ``[B, L]`` int32: ``t − (first column of t's run)`` (padding columns numbered the same way).
    """
    seg = np.asarray(segment_ids)
    b, length = seg.shape
    cols = np.broadcast_to(np.arange(length), (b, length))
    new_run = np.ones((b, length), bool)
    new_run[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts = np.maximum.accumulate(np.where(new_run, cols, 0), axis=1)
    return (cols - starts).astype(np.int32)


def make_packed_logits_fn(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
    """Build ``packed(params, input_ids, segment_ids, positions, logits_at=None) -> logits``, the
    forward pass over sequences packed end to end in each row.

    Args (of the returned function):
      input_ids: ``[B, L]`` int32, several sequences per row, back to back.
      segment_ids: ``[B, L]`` int32, ``k > 0`` on the tokens of the row's k-th sequence, 0 on
        padding. A token attends only to earlier tokens of its own segment (packed attention
        mask; Krell et al. 2021, "Efficient sequence packing without cross-contamination").
      positions: ``[B, L]`` int32 RoPE positions, restarting at 0 per segment (``packed_positions``).
      logits_at: optional ``[B, K]`` int32 columns: logits only there (``Decoder.__call__``).

    Returns:
      ``logits [B, L, vocab]`` (or ``[B, K, vocab]``) float32. Each segment's logits equal
      those of the sequence alone in an unpacked row (float32 rounding aside).
    """

    def packed(params: nnx.State, input_ids: jax.Array, segment_ids: jax.Array, positions: jax.Array,
               logits_at: jax.Array | None = None) -> jax.Array:
        model = nnx.merge(graphdef, params)
        seg = segment_ids.astype(jnp.int32)
        mask = AttentionMask.causal(seg > 0, seg)
        logits, _ = model(input_ids.astype(jnp.int32), positions.astype(jnp.int32), mask, logits_at=logits_at)
        return logits

    return packed


def sequence_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    valid_mask: jax.Array,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probabilities and entropies of ``input_ids`` under the model.

    Args:
      graphdef, params: from ``split_model``.
      input_ids: ``[B, L]`` int32.
      valid_mask: ``[B, L]`` bool.
      temperature: softmax temperature (> 0), the sampler's.

    Returns:
      ``(logp [B, L], entropy [B, L])`` float32 in nats, shift-by-one convention of
      ``mempo_jax.core.logprobs`` (column t scores token t given tokens < t). Both are 0 where token t
      or its predecessor is padding (nothing real predicts it).
    """
    logits = make_logits_fn(graphdef)(params, input_ids, valid_mask)
    logp = token_logprobs(logits, input_ids, temperature)
    ent = token_entropy(logits, temperature)
    valid = valid_mask.astype(bool)
    scored = valid & jnp.concatenate([jnp.zeros_like(valid[:, :1]), valid[:, :-1]], axis=1)
    return jnp.where(scored, logp, 0.0), jnp.where(scored, ent, 0.0)
