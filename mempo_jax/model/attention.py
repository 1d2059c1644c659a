"""Attention kernels of the decoder: dense masked softmax, and blocked (flash-style) attention.

``dense_attention`` materialises the ``[batch, kv_heads, groups, T, S]`` float32 scores (HF
``eager_attention_forward``); it is what decode (T = 1) uses. ``blocked_attention`` computes the
same result one ``[block_q, block_k]`` tile at a time with the online-softmax recurrence of
FlashAttention (Dao et al. 2022, "FlashAttention", Algorithm 1; Rabe & Staats 2021, "Self-attention
does not need O(n²) memory"): per query block a running maximum ``m``, normaliser ``l`` and
weighted sum ``acc`` are rescaled by ``exp(m_old − m_new)`` as each key block arrives, so no
``[T, S]`` score tensor exists. Tiles whose mask is all False (above the causal diagonal, another
segment of a packed row, padding) are skipped at run time (``lax.cond``).

Masks come either as a dense ``[batch, T, S]`` bool array (the sampler's cache masks) or as an
``AttentionMask`` — O(T + S) integers from which each tile's mask is computed: causal by index,
key validity, and optional segment ids (packed rows: a query attends only to keys of its own
segment).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

BLOCK_Q = 256  # query rows per tile (tokens)
BLOCK_K = 256  # key columns per tile (tokens)

_NEG = jnp.finfo(jnp.float32).min  # masked score (as dense_attention: a fully masked row is uniform, never NaN)


class AttentionMask(NamedTuple):
    """A structural attention mask: query t may attend to key s iff

    ``kv_valid[b, s] and s <= q_index[b, t] and (segments are None or q_segments[b, t] == kv_segments[b, s])``.

    Attributes:
      q_index: ``[batch, T]`` int32, the key index (cache slot, or column of the same sequence)
        of each query token: causality is ``s <= q_index``.
      kv_valid: ``[batch, S]`` bool, True on keys that hold a real token.
      q_segments: optional ``[batch, T]`` int32 segment id of each query (packed rows).
      kv_segments: optional ``[batch, S]`` int32 segment id of each key.
    """

    q_index: jax.Array
    kv_valid: jax.Array
    q_segments: Optional[jax.Array] = None
    kv_segments: Optional[jax.Array] = None

    @classmethod
    def causal(cls, valid: jax.Array, segment_ids: jax.Array | None = None) -> "AttentionMask":
        """The mask of a forward pass without a cache over ``valid [batch, L]`` bool (keys are the
        queries themselves: ``q_index = arange(L)``), packed by ``segment_ids [batch, L]`` when given."""
        b, length = valid.shape
        q_index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        return cls(q_index, valid.astype(bool), segment_ids, segment_ids)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(batch, T, S)``, the shape of the dense mask it stands for."""
        return (self.q_index.shape[0], self.q_index.shape[1], self.kv_valid.shape[1])

    def dense(self) -> jax.Array:
        """The ``[batch, T, S]`` bool mask (for tests and for ``dense_attention``)."""
        return self.tile(0, 0, self.q_index.shape[1], self.kv_valid.shape[1])

    def tile(self, q0, k0, bq: int, bk: int) -> jax.Array:
        """``[batch, bq, bk]`` bool mask of queries ``[q0, q0 + bq)`` and keys ``[k0, k0 + bk)``
        (``q0``, ``k0`` may be traced; the arrays must already cover the ranges)."""
        qi = jax.lax.dynamic_slice_in_dim(self.q_index, q0, bq, axis=1)
        kv = jax.lax.dynamic_slice_in_dim(self.kv_valid, k0, bk, axis=1)
        ks = k0 + jnp.arange(bk, dtype=jnp.int32)
        m = kv[:, None, :] & (ks[None, None, :] <= qi[:, :, None])
        if self.q_segments is not None:
            qs = jax.lax.dynamic_slice_in_dim(self.q_segments, q0, bq, axis=1)
            kseg = jax.lax.dynamic_slice_in_dim(self.kv_segments, k0, bk, axis=1)
            m = m & (qs[:, :, None] == kseg[:, None, :])
        return m

    def pad(self, t: int, s: int) -> "AttentionMask":
        """Padded to ``t`` queries and ``s`` keys (new keys invalid, new queries at index −1: they see nothing)."""
        def p(x, n, v):
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=v)
        qs = None if self.q_segments is None else p(self.q_segments, t, -1)
        ks = None if self.kv_segments is None else p(self.kv_segments, s, -2)
        return AttentionMask(p(self.q_index, t, -1), p(self.kv_valid, s, False), qs, ks)


def _grouped(q: jax.Array, kvh: int) -> jax.Array:
    """``[B, T, H, hd]`` → ``[B, T, kv_heads, groups, hd]`` (query head j uses kv head j // groups, HF repeat_kv)."""
    b, t, h, hd = q.shape
    return q.reshape(b, t, kvh, h // kvh, hd)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask, *, heads_major: bool = False) -> jax.Array:
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
    if isinstance(mask, AttentionMask):
        mask = mask.dense()
    b, t, h, hd = q.shape
    kvh = k.shape[1] if heads_major else k.shape[2]
    kv_spec = "bksh" if heads_major else "bskh"
    qg = _grouped(q, kvh)
    scores = jnp.einsum(f"btkgh,{kv_spec}->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgh", probs, v.astype(q.dtype)).reshape(b, t, h, hd)


def _online_softmax_tile(carry, qb: jax.Array, kb: jax.Array, vb: jax.Array, mt: jax.Array, scale: jax.Array):
    """One key tile of the online softmax (FlashAttention, Alg. 1, lines 8-11).

    Args:
      carry: ``(m, l, acc)``: running row max and normaliser ``[B, kv, g, bq]`` and unnormalised
        output ``[B, kv, g, bq, hd]``, all float32.
      qb: ``[B, bq, kv, g, hd]`` query block; kb, vb: ``[B, kv, bk, hd]`` key and value tile.
      mt: ``[B, bq, bk]`` bool mask tile; scale: ``1 / sqrt(hd)``.

    Returns:
      the updated ``(m, l, acc)``.
    """
    m, l, acc = carry
    sc = jnp.einsum("btkgh,bksh->bkgts", qb, kb, preferred_element_type=jnp.float32) * scale
    sc = jnp.where(mt[:, None, None], sc, _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    p = jnp.exp(sc - m_new[..., None])
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(qb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, l, acc * corr[..., None] + pv


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask, *, heads_major: bool = False,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> jax.Array:
    """``dense_attention`` computed tile by tile with an online softmax (FlashAttention, Alg. 1).

    Queries are processed ``block_q`` at a time (``lax.scan``; each query block rematerialised in
    the backward pass, ``jax.checkpoint``), keys ``block_k`` at a time inside; a tile whose mask is
    all False for every row of the batch is skipped. Peak attention memory is one
    ``[batch, heads, block_q, block_k]`` float32 tile instead of ``[batch, heads, T, S]``.

    Args:
      q: ``[batch, T, heads, head_dim]``.
      k, v: ``[batch, S, kv_heads, head_dim]``, or ``[batch, kv_heads, S, head_dim]`` with ``heads_major``.
      mask: ``[batch, T, S]`` bool or an ``AttentionMask``.
      heads_major: layout of ``k``/``v``.
      block_q, block_k: tile sizes (tokens; clipped to T and S).

    Returns:
      ``[batch, T, heads, head_dim]`` in ``q.dtype``, equal to ``dense_attention`` within
      float32 rounding on every query row with at least one True mask entry (a row with none
      gets a finite average of the values of the tiles not skipped, or 0).

    Raises:
      ValueError: if the mask's shape is not ``[batch, T, S]``.
    """
    b, t, h, hd = q.shape
    kvh = k.shape[1] if heads_major else k.shape[2]
    s = k.shape[2] if heads_major else k.shape[1]
    mshape = mask.shape if isinstance(mask, AttentionMask) else tuple(mask.shape)
    if tuple(mshape) != (b, t, s):
        raise ValueError(f"attention mask {tuple(mshape)} must be [batch, T, S] = {(b, t, s)}")
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    if not heads_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, kv, S, hd]
    k = jnp.pad(k.astype(q.dtype), ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    v = jnp.pad(v.astype(q.dtype), ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    qg = jnp.pad(_grouped(q, kvh), ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    if isinstance(mask, AttentionMask):
        mask = mask.pad(tp, sp)
        tile = mask.tile
    else:
        dense = jnp.pad(mask.astype(bool), ((0, 0), (0, tp - t), (0, sp - s)))
        def tile(q0, k0, bq_, bk_):
            return jax.lax.dynamic_slice(dense, (0, q0, k0), (b, bq_, bk_))
    scale = jnp.float32(1.0 / math.sqrt(hd))
    g = h // kvh

    def q_block(qi):
        q0 = qi * bq
        qb = jax.lax.dynamic_slice_in_dim(qg, q0, bq, axis=1)  # [B, bq, kv, g, hd]

        def k_step(carry, ki):
            k0 = ki * bk
            mt = tile(q0, k0, bq, bk)  # [B, bq, bk]

            def update(c):
                kb = jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=2)
                vb = jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=2)
                return _online_softmax_tile(c, qb, kb, vb, mt, scale)

            return jax.lax.cond(jnp.any(mt), update, lambda c: c, carry), None

        init = (jnp.full((b, kvh, g, bq), _NEG, jnp.float32), jnp.zeros((b, kvh, g, bq), jnp.float32),
                jnp.zeros((b, kvh, g, bq, hd), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(k_step, init, jnp.arange(nk))
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kv, g, bq, hd]
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, bq, h, hd).astype(q.dtype)

    if nq == 1:
        out = q_block(jnp.int32(0))[None]
    else:
        out = jax.lax.map(jax.checkpoint(q_block, prevent_cse=False), jnp.arange(nq))  # [nq, B, bq, H, hd]
    out = jnp.moveaxis(out, 0, 1).reshape(b, tp, h, hd)
    return out[:, :t]


BLOCKED_MIN_LEN = 1024  # tokens: rows up to this length stay on dense attention


def use_blocked(t: int, s: int, min_len: int = BLOCKED_MIN_LEN) -> bool:
    """Whether ``attend`` takes the blocked path for ``T`` queries over ``S`` keys: when both exceed
    ``min_len`` tokens (1,024). Shorter rows (every row of the tiny default, decode steps with
    T = 1) stay on dense attention: at 512 tokens dense is the faster one on CPU (prefill 512:
    7.1x transformers dense vs 3.7x blocked, ``benchmarks/bench_decode.py``), and the default
    run keeps its float32 reduction order, hence its figures, bit for bit."""
    return t > min_len and s > min_len
