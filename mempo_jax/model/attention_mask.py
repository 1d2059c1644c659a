"""The attention mask every strategy reads (``AttentionMask``: O(T + S) integers, each tile's mask
computed from them) and the layout of a KV cache (``CACHE_AXES``). docs: ``model.attention``."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int

# logical axes of a KV cache ``[layers, slots, kv_heads, size, head_dim]`` (KVCache.k / .v; model.placement)
CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")



class AttentionMask(NamedTuple):
    """A structural attention mask: query t may attend to key s iff

    ``kv_valid[b, s] and s <= q_index[b, t] and (segments are None or q_segments[b, t] == kv_segments[b, s])``
    ``and (window is None or s > q_index[b, t] - window)``.

    Attributes:
      q_index: ``[batch, T]`` int32, the key index (KV-cache position, or column of the same
        sequence) of each query token: causality is ``s <= q_index``.
      kv_valid: ``[batch, S]`` bool, True on keys that hold a real token; ``None``: every key
        (a KV cache read by position, ``AttentionMask.cached``; its ``shape`` then has ``S = None``).
      q_segments: optional ``[batch, T]`` int32 segment id of each query (packed rows).
      kv_segments: optional ``[batch, S]`` int32 segment id of each key.
      window: optional int32 scalar (may be traced) W >= 1: a query sees only the W keys ending at
        its own index (sliding-window attention, HF ``sliding_window_overlay``: ``s > q_index − W``).
        The kernel strategies take no window: a windowed mask runs on ``"xla"``.
    """

    q_index: Int[Array, "rows length"]
    kv_valid: Optional[Bool[Array, "rows keys"]]
    q_segments: Optional[Int[Array, "rows length"]] = None
    kv_segments: Optional[Int[Array, "rows keys"]] = None
    window: Optional[Int[ArrayLike, ""]] = None

    @classmethod
    def causal(cls, valid: Bool[ArrayLike, "rows length"],
               segment_ids: Int[ArrayLike, "rows length"] | None = None) -> "AttentionMask":
        """The mask of a forward pass without a cache over ``valid [batch, L]`` bool (keys are the
        queries themselves: ``q_index = arange(L)``), packed by ``segment_ids [batch, L]`` when given."""
        b, length = valid.shape
        q_index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        return cls(q_index, valid.astype(bool), segment_ids, segment_ids)

    @classmethod
    def cached(cls, positions: Int[ArrayLike, "rows length"]) -> "AttentionMask":
        """The mask of new tokens at KV-cache ``positions [batch, T]`` int32: each attends to the
        cache positions ``<= `` its own (a slot holds one context from position 0)."""
        return cls(positions.astype(jnp.int32), None)

    @property
    def shape(self) -> tuple[int, int, int | None]:
        """``(batch, T, S)``, the shape of the dense mask it stands for (``S = None`` without ``kv_valid``)."""
        s = None if self.kv_valid is None else self.kv_valid.shape[1]
        return (self.q_index.shape[0], self.q_index.shape[1], s)

    def dense(self, s: int | None = None) -> Bool[Array, "rows length keys"]:
        """The ``[batch, T, S]`` bool mask (``s``: the key count when ``kv_valid`` is None)."""
        return self.tile(0, 0, self.q_index.shape[1], self.kv_valid.shape[1] if s is None else s)

    def tile(self, q0, k0, bq: int, bk: int) -> Bool[Array, "rows {bq} {bk}"]:
        """``[batch, bq, bk]`` bool mask of queries ``[q0, q0 + bq)`` and keys ``[k0, k0 + bk)``
        (``q0``, ``k0`` may be traced; the arrays must already cover the ranges)."""
        qi = jax.lax.dynamic_slice_in_dim(self.q_index, q0, bq, axis=1)
        ks = k0 + jnp.arange(bk, dtype=jnp.int32)
        m = ks[None, None, :] <= qi[:, :, None]
        if self.kv_valid is not None:
            m = m & jax.lax.dynamic_slice_in_dim(self.kv_valid, k0, bk, axis=1)[:, None, :]
        if self.q_segments is not None:
            qs = jax.lax.dynamic_slice_in_dim(self.q_segments, q0, bq, axis=1)
            kseg = jax.lax.dynamic_slice_in_dim(self.kv_segments, k0, bk, axis=1)
            m = m & (qs[:, :, None] == kseg[:, None, :])
        if self.window is not None:
            m = m & (ks[None, None, :] > qi[:, :, None] - self.window)
        return m

    def pad(self, t: int, s: int) -> "AttentionMask":
        """Padded to ``t`` queries and ``s`` keys (new keys invalid, new queries at index −1: they see nothing)."""
        def p(x, n, v):
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=v)
        qs = None if self.q_segments is None else p(self.q_segments, t, -1)
        ks = None if self.kv_segments is None else p(self.kv_segments, s, -2)
        kv = None if self.kv_valid is None else p(self.kv_valid, s, False)
        return AttentionMask(p(self.q_index, t, -1), kv, qs, ks, self.window)
