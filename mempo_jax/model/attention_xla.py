"""The ``"xla"`` attention strategy, on every backend: ``dense_attention`` (scores materialised) for
short rows, ``blocked_attention`` (FlashAttention's online softmax, tile by tile) for long rows and
for every KV-cache read; ``use_blocked`` chooses. The overview: ``model.attention``."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.model.attention_mask import AttentionMask

BLOCK_Q = 256  # query rows per tile (tokens)
BLOCK_K = 256  # key columns per tile (tokens)
_NEG = jnp.finfo(jnp.float32).min  # masked score (as dense_attention: a fully masked row is uniform, never NaN)


def grouped(q: Float[ArrayLike, "rows length heads head_dim"],
             kvh: int) -> Float[ArrayLike, "rows length {kvh} _ head_dim"]:
    """``[B, T, H, hd]`` → ``[B, T, kv_heads, groups, hd]`` (query head j uses kv head j // groups, HF repeat_kv)."""
    b, t, h, hd = q.shape
    return q.reshape(b, t, kvh, h // kvh, hd)


def dense_attention(q: Float[ArrayLike, "rows length heads head_dim"], k: Float[ArrayLike, "rows _ _ head_dim"],
                    v: Float[ArrayLike, "rows _ _ head_dim"], mask: Bool[Array, "rows length keys"] | AttentionMask, *,
                    heads_major: bool = False) -> Float[Array, "rows length heads head_dim"]:
    """Masked softmax attention, scores materialised (HF ``eager_attention_forward`` with GQA).

    Args:
      q: ``[batch, T, heads, head_dim]``.
      k, v: ``[batch, S, kv_heads, head_dim]``, or ``[batch, kv_heads, S, head_dim]`` with ``heads_major``.
      mask: ``[batch, T, S]`` bool or an ``AttentionMask``; a query row with no True entry gets
        uniform weights (garbage, never NaN).
      heads_major: layout of ``k``/``v``.

    Returns:
      ``[batch, T, heads, head_dim]`` in ``q.dtype`` (before the output projection). Scores and
      softmax in float32, the probabilities cast to ``q.dtype`` for the value product.
    """
    b, t, h, hd = q.shape
    kvh = k.shape[1] if heads_major else k.shape[2]
    if isinstance(mask, AttentionMask):
        mask = mask.dense(k.shape[2] if heads_major else k.shape[1])
    kv_spec = "bksh" if heads_major else "bskh"
    qg = grouped(q, kvh)
    scores = jnp.einsum(f"btkgh,{kv_spec}->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgh", probs, v.astype(q.dtype)).reshape(b, t, h, hd)


def _key_block(cache: Float[ArrayLike, "layers slots kv_heads cache head_dim"], layer, rows, start,
               block: int) -> Float[Array, "_ kv_heads {block} head_dim"]:
    """``[B, kv_heads, block, head_dim]``: positions ``[start, start + block)`` of layer ``layer``
    of slots ``rows`` (``None``: every slot) of a ``[layers, slots, kv_heads, S, head_dim]`` cache,
    sliced in place (neither the layer nor the rows' slots are copied first)."""
    _, s, kvh, _, hd = cache.shape
    layer, start = jnp.asarray(layer, jnp.int32), jnp.asarray(start, jnp.int32)
    zero = jnp.int32(0)
    if rows is None:
        return jax.lax.dynamic_slice(cache, (layer, zero, zero, start, zero), (1, s, kvh, block, hd))[0]
    return jax.vmap(lambda r: jax.lax.dynamic_slice(cache, (layer, r, zero, start, zero),
                                                    (1, 1, kvh, block, hd))[0, 0])(rows.astype(jnp.int32))


def blocked_attention(q: Float[ArrayLike, "rows length heads head_dim"], k: Float[ArrayLike, "*cache _ _ head_dim"],
                      v: Float[ArrayLike, "*cache _ _ head_dim"], mask: Bool[Array, "rows length keys"] | AttentionMask, *,
                      heads_major: bool = False, layer: Int[ArrayLike, ""] | None = None,
                      rows: Int[Array, "rows"] | None = None, kv_bound: Int[ArrayLike, ""] | None = None,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Float[Array, "rows length heads head_dim"]:
    """``dense_attention`` computed tile by tile with an online softmax (FlashAttention, Alg. 1).

    Queries are processed ``block_q`` at a time (``lax.map``; each query block rematerialised in
    the backward pass, ``jax.checkpoint``), keys ``block_k`` at a time inside. Per key tile the
    running max ``m``, normaliser ``l`` and weighted sum ``acc`` are rescaled by
    ``exp(m_old − m_new)``; masked entries get probability exactly 0. Peak attention memory is one
    ``[batch, heads, block_q, block_k]`` float32 tile instead of ``[batch, heads, T, S]``.

    Which key tiles are read: with ``kv_bound`` (a traced scalar: no query sees a key at or past
    it) only the first ``ceil(kv_bound / block_k)`` tiles (a ``while`` loop, forward only: the
    decode and prefill of a KV cache, flash-decoding's split-K); without it every tile, a tile
    whose mask is all False for every row being skipped (``lax.cond``; reverse-differentiable).

    Args:
      q: ``[batch, T, heads, head_dim]`` (after RoPE).
      k, v: ``[batch, S, kv_heads, head_dim]``, ``[batch, kv_heads, S, head_dim]`` with
        ``heads_major``, or, with ``layer``, a whole KV cache ``[layers, slots, kv_heads, S,
        head_dim]`` of which query row b reads layer ``layer`` of slot ``rows[b]`` (``rows=None``:
        slot b), each key tile sliced straight out of the cache.
      mask: ``[batch, T, S]`` bool or an ``AttentionMask`` (``kv_valid=None``: every key valid,
        the mask of a KV cache read by position).
      heads_major: layout of ``k``/``v`` (ignored with ``layer``).
      layer: int32 scalar layer of a whole cache; rows: ``[batch]`` int32 slots, with ``layer`` only.
      kv_bound: optional int32 scalar ``> `` every key position any used query sees.
      block_q, block_k: tile sizes (tokens; clipped to T and S). With ``layer``, ``S`` must be a
        multiple of the key tile (the cache is not padded).

    Returns:
      ``[batch, T, heads, head_dim]`` in ``q.dtype``, equal to ``dense_attention`` within float32
      rounding on every query row with at least one True mask entry (a row with none gets 0).

    Raises:
      ValueError: if the mask's shape is not ``[batch, T, S]``, ``heads`` is not a multiple of
        ``kv_heads``, ``rows`` come without ``layer``, or the cache does not match the rows / tile.
    """
    b, t, h, hd = q.shape
    if layer is None:
        if rows is not None:
            raise ValueError("rows needs a whole cache and its layer index")
        if not heads_major:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, kv, S, hd]
        k, v, layer = k[None], v[None], 0
    kvh, s = k.shape[2], k.shape[3]
    if rows is None and k.shape[1] != b:
        raise ValueError(f"{b} query rows but {k.shape[1]} cache slots (pass rows=)")
    if h % kvh:
        raise ValueError(f"heads {h} must be a multiple of kv heads {kvh}")
    mshape = mask.shape if isinstance(mask, AttentionMask) else tuple(mask.shape)
    if mshape[2] is not None and tuple(mshape) != (b, t, s):
        raise ValueError(f"attention mask {tuple(mshape)} must be [batch, T, S] = {(b, t, s)}")
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    if sp != s:
        if k.shape[0] != 1 or rows is not None:
            raise ValueError(f"cache size {s} must be a multiple of the key block {bk}")
        k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, sp - s), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, sp - s), (0, 0)))
    g = h // kvh
    qg = (grouped(q, kvh).astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(hd))).astype(q.dtype)
    qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    if isinstance(mask, AttentionMask):
        mask = mask.pad(tp, sp)
        tile = mask.tile
    else:
        dense = jnp.pad(mask.astype(bool), ((0, 0), (0, tp - t), (0, sp - s)))

        def tile(q0, k0, bq_, bk_):
            return jax.lax.dynamic_slice(dense, (0, q0, k0), (b, bq_, bk_))

    def q_block(qi):
        q0 = qi * bq
        qb = jax.lax.dynamic_slice_in_dim(qg, q0, bq, axis=1)  # [B, bq, kv, g, hd]

        def update(j, carry, mt):
            m, l, acc = carry
            kb = _key_block(k, layer, rows, j * bk, bk).astype(q.dtype)  # [B, kv, bk, hd]
            vb = _key_block(v, layer, rows, j * bk, bk).astype(q.dtype)
            sc = jnp.einsum("btkgh,bksh->bkgts", qb, kb, preferred_element_type=jnp.float32)
            sc = jnp.where(mt[:, None, None], sc, _NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(mt[:, None, None], jnp.exp(sc - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(q.dtype), vb,
                                                     preferred_element_type=jnp.float32)
            return m_new, l, acc

        def k_step(j, carry):
            mt = tile(q0, j * bk, bq, bk)  # [B, bq, bk]
            if kv_bound is not None:  # the trip count already skips the dead tiles
                return update(j, carry, mt)
            return jax.lax.cond(jnp.any(mt), lambda c: update(j, c, mt), lambda c: c, carry)

        init = (jnp.full((b, kvh, g, bq), _NEG, jnp.float32), jnp.zeros((b, kvh, g, bq), jnp.float32),
                jnp.zeros((b, kvh, g, bq, hd), jnp.float32))
        trips = nk if kv_bound is None else jnp.minimum((kv_bound + bk - 1) // bk, nk).astype(jnp.int32)
        _, l, acc = jax.lax.fori_loop(0, trips, k_step, init)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kv, g, bq, hd]
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, bq, h, hd).astype(q.dtype)

    if nq == 1:
        return q_block(jnp.int32(0))[:, :t]
    out = jax.lax.map(jax.checkpoint(q_block, prevent_cse=False), jnp.arange(nq))  # [nq, B, bq, H, hd]
    return jnp.moveaxis(out, 0, 1).reshape(b, tp, h, hd)[:, :t]


# tokens: rows up to this length stay on dense attention (the default of ExecutionConfig.dense_attention_max_len)
BLOCKED_MIN_LEN = 1024


def use_blocked(t: int, s: int, min_len: int = BLOCKED_MIN_LEN) -> bool:
    """Whether ``attend`` takes the blocked path for ``T`` queries over ``S`` keys: when both exceed
    ``min_len`` tokens (default 1,024; ``ExecutionConfig.dense_attention_max_len``). Shorter rows
    (every row of the tiny default, decode steps with T = 1) stay on dense attention: at 512 tokens
    dense is the faster one on CPU (prefill 512: 7.1x transformers dense vs 3.7x blocked,
    ``benchmarks/bench_decode.py``), and the default run keeps its float32 reduction order, hence
    its figures, bit for bit.
    """
    return t > min_len and s > min_len
