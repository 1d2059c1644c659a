"""The decoder over a slot KV cache: blocked attention over live cache blocks only.

A *slot* is one row of a ``KVCache`` (``[layers, slots, kv_heads, size, head_dim]``) that holds one
context contiguously from cache position 0, so a token's cache position is its RoPE position.
``slot_forward`` runs the ``Decoder``'s own modules (its norms, q/k/v/o projections, MLPs, LM
head; numerics of ``decoder.py`` / HF ``Qwen2ForCausalLM``) on new tokens of some slots: it writes
their keys/values at their positions (a scatter; rows or positions out of range are dropped) and
attends with ``blocked_attention``, an online-softmax loop over key blocks that stops after the
last block any query can see (flash-decoding; Dao et al. 2022, "FlashAttention", Algorithm 1, and
the split-K decode of FlashDecoding). Blocks past every row's length are never read.

Used by ``mempo_jax.agent.slot_sampler`` (prefill of new tokens into slots, chunked decode). The
training / scoring forward (``Decoder.__call__``) is not touched.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mempo_jax.model.decoder import Decoder, KVCache


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_bound: jax.Array,
                      block: int, *, layer: jax.Array | int | None = None, rows: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention of queries at absolute positions over a heads-major cache, by key blocks.

    Query ``(b, t)`` attends the keys at cache positions ``<= q_pos[b, t]`` of row b. Key blocks
    ``[j * block, (j + 1) * block)`` are visited for ``j < ceil(kv_bound / block)`` only (a traced
    trip count: the blocks past every query's position cost nothing), with the running max /
    normaliser of the online softmax; the result equals ``softmax(q k^T / sqrt(hd)) v`` over the
    visible keys within float32 rounding.

    Args:
      q: ``[B, T, heads, head_dim]`` (after RoPE).
      k, v: ``[B, kv_heads, size, head_dim]``, ``size`` a multiple of ``block``; or, with ``layer``,
        a whole slot cache ``[layers, S, kv_heads, size, head_dim]`` of which row b reads layer
        ``layer`` of slot ``rows[b]`` (``rows=None``: slot b, ``B == S``). Each key block is sliced
        straight out of the cache (one ``[B, kv_heads, block, head_dim]`` read per block): neither the
        layer nor the rows' slots are copied first (a decode step at batch 64, context 400 on
        SmolLM2 spent 54 % of its time copying ``cache[layer]``).
      q_pos: ``[B, T]`` int32 absolute positions of the queries (every key at a position ``<=``
        it must already be written).
      kv_bound: int32 scalar, ``> max(q_pos)`` over the queries whose output is used.
      block: static key-block length (tokens).
      layer: int32 scalar layer index of a whole cache (``None``: ``k``/``v`` are one layer's rows).
      rows: ``[B]`` int32 slot of each query row in ``[0, S)``, with ``layer`` only.

    Returns:
      ``[B, T, heads, head_dim]`` in ``q.dtype`` (before the output projection). A query with no
      visible key (never the case for ``q_pos >= 0``) gets zeros.

    Raises:
      ValueError: if ``size`` is not a multiple of ``block`` or ``heads`` of ``kv_heads``, or the
        cache does not match the rows.
    """
    b, t, h, hd = q.shape
    if layer is None:
        if rows is not None:
            raise ValueError("rows needs a whole cache and its layer index")
        k, v, layer = k[None], v[None], 0
    kvh, size = k.shape[2], k.shape[3]
    if rows is None and k.shape[1] != b:
        raise ValueError(f"{b} query rows but {k.shape[1]} cache slots (pass rows=)")
    if size % block or h % kvh:
        raise ValueError(f"cache size {size} must be a multiple of block {block}, heads {h} of kv heads {kvh}")
    g = h // kvh
    qg = (q.reshape(b, t, kvh, g, hd).astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(hd))).astype(q.dtype)
    neg = jnp.finfo(jnp.float32).min
    nb = jnp.minimum((kv_bound + block - 1) // block, size // block).astype(jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        kb, vb = _key_block(k, layer, rows, j * block, block).astype(q.dtype), \
            _key_block(v, layer, rows, j * block, block).astype(q.dtype)  # [B, kv, blk, hd]
        s = jnp.einsum("btkgh,bksh->bkgts", qg, kb, preferred_element_type=jnp.float32)
        visible = (j * block + jnp.arange(block))[None, None, :] <= q_pos[:, :, None]  # [B, T, blk]
        s = jnp.where(visible[:, None, None], s, neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(q.dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((b, kvh, g, t), neg, jnp.float32), jnp.zeros((b, kvh, g, t), jnp.float32),
            jnp.zeros((b, kvh, g, t, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, nb, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kv, g, T, hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, hd).astype(q.dtype)


def _key_block(cache: jax.Array, layer, rows, start, block: int) -> jax.Array:
    """``[B, kv_heads, block, head_dim]``: positions ``[start, start + block)`` of layer ``layer``
    of slots ``rows`` (``None``: every slot) of a ``[layers, S, kv_heads, size, head_dim]`` cache."""
    _, s, kvh, _, hd = cache.shape
    layer, start = jnp.asarray(layer, jnp.int32), jnp.asarray(start, jnp.int32)
    zero = jnp.int32(0)
    if rows is None:
        return jax.lax.dynamic_slice(cache, (layer, zero, zero, start, zero), (1, s, kvh, block, hd))[0]
    return jax.vmap(lambda r: jax.lax.dynamic_slice(cache, (layer, r, zero, start, zero),
                                                    (1, 1, kvh, block, hd))[0, 0])(rows.astype(jnp.int32))


def slot_forward(model: Decoder, tokens: jax.Array, positions: jax.Array, cache: KVCache, rows: jax.Array | None,
                 write: jax.Array, kv_bound: jax.Array, logits_at: jax.Array, block: int) -> tuple[jax.Array, KVCache]:
    """New tokens of some slots through the decoder: keys/values written, next-token logits at one position.

    Args:
      model: the ``Decoder`` (``nnx.merge(graphdef, params)``).
      tokens: ``[R, T]`` int32 ids.
      positions: ``[R, T]`` int32 positions (= cache positions) of the tokens.
      cache: ``KVCache`` ``[layers, S, kv_heads, size, head_dim]``.
      rows: ``[R]`` int32 slot of each input row (``S`` or more: a padding row, nothing written),
        or ``None`` when ``R == S`` and row r is slot r (the decode step: no gather of the cache).
      write: ``[R, T]`` bool, True where the token's key/value is written (padding: False).
      kv_bound: int32 scalar, ``> max(positions)`` over the written tokens.
      logits_at: ``[R]`` int32 index in ``[0, T)``: the one position per row whose logits are returned.
      block: key-block length of ``blocked_attention`` (divides ``size``).

    Returns:
      ``(logits [R, vocab] float32, updated cache)``.
    """
    cfg = model.cfg
    r, t = tokens.shape
    size = cache.k.shape[3]
    dt = cfg.activation_dtype
    slot_idx = jnp.broadcast_to((jnp.arange(r) if rows is None else rows)[:, None], (r, t))
    pos_idx = jnp.where(write, positions, size)  # out of range -> dropped by the scatter
    gather = None if rows is None else jnp.clip(rows, 0, cache.k.shape[1] - 1)
    ck, cv = cache.k, cache.v
    x = jnp.take(model.embed[...], tokens, axis=0).astype(dt)
    for i, blk in enumerate(model.layers):
        q, k, v = blk.attn.qkv(blk.attn_norm(x), positions)
        ck = ck.at[i, slot_idx, :, pos_idx, :].set(k.astype(ck.dtype), mode="drop")
        cv = cv.at[i, slot_idx, :, pos_idx, :].set(v.astype(cv.dtype), mode="drop")
        out = blocked_attention(q, ck, cv, positions, kv_bound, block, layer=i, rows=gather)
        x = x + jnp.einsum("bthk,hkd->btd", out, blk.attn.o[...].astype(dt))
        x = x + blk.mlp(blk.mlp_norm(x))
    x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]  # [R, D]
    x = model.final_norm(x)
    head = model.embed[...].astype(dt).T if cfg.tie_embeddings else model.lm_head[...].astype(dt)
    logits = jnp.einsum("bd,dv->bv", x, head, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), KVCache(ck, cv)


__all__ = ["blocked_attention", "slot_forward"]
