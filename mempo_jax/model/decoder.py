"""The Qwen2 / Llama decoder as a Flax NNX module, with a static-shape KV cache.

Source: ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` in Hugging Face transformers (pre-norm blocks:
RMSNorm → GQA attention with RoPE → residual, RMSNorm → SwiGLU → residual; final RMSNorm; LM head
tied to the embedding or separate). The cache layout follows the gemma sampler: one preallocated
buffer per k / v, written with ``lax.dynamic_update_slice`` at ``cache_index``. The cache is
heads-major (``[layers, batch, kv_heads, size, head_dim]``): the decode step's attention dots
then read each layer's ``[batch, kv_heads, size, head_dim]`` slice as it lies in memory (with a
slot-major cache XLA CPU transposed every layer's k and v, 2 x 8.4 MB per layer at batch 64 and
256 slots, on every decode step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mempo_jax.model.config import ModelConfig
from mempo_jax.model.layers import MLP, Attention, RMSNorm, logical_param


class KVCache(NamedTuple):
    """Keys and values of every layer (after RoPE).

    Attributes:
      k: ``[num_layers, batch, num_kv_heads, size, head_dim]``.
      v: ``[num_layers, batch, num_kv_heads, size, head_dim]``.
    """

    k: jax.Array
    v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, size: int, dtype=None) -> KVCache:
    """A zero KV cache of ``size`` slots per row.

    Args:
      cfg: the model's config.
      batch: rows B.
      size: slots S (prompt bucket + generation budget).
      dtype: cache dtype; default the activation dtype ``cfg.dtype``.

    Returns:
      ``KVCache`` with k, v ``[num_layers, batch, num_kv_heads, size, head_dim]`` zeros
      (heads-major, see the module docstring).
    """
    dtype = cfg.activation_dtype if dtype is None else jnp.dtype(dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class Block(nnx.Module):
    """One pre-norm decoder layer (HF ``Qwen2DecoderLayer``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, cfg.weight_dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, cfg.weight_dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, attn_mask, cache: KVCache | None, layer: int, cache_index):
        """``x [B,T,D]`` → ``(x [B,T,D], cache)``; with a cache, this layer's k/v of the T new
        tokens are written at slots ``[cache_index, cache_index + T)`` of ``cache.k[layer]``."""
        q, k, v = self.attn.qkv(self.attn_norm(x), positions)
        if cache is not None:
            start = (jnp.int32(layer), jnp.int32(0), jnp.int32(0), cache_index, jnp.int32(0))
            kt = jnp.swapaxes(k, 1, 2)[None].astype(cache.k.dtype)  # [1, B, kv, T, hd]
            vt = jnp.swapaxes(v, 1, 2)[None].astype(cache.v.dtype)
            ck = jax.lax.dynamic_update_slice(cache.k, kt, start)
            cv = jax.lax.dynamic_update_slice(cache.v, vt, start)
            cache = KVCache(ck, cv)
            x = x + self.attn.attend(q, ck[layer], cv[layer], attn_mask, heads_major=True)
        else:
            x = x + self.attn.attend(q, k, v, attn_mask)
        x = x + self.mlp(self.mlp_norm(x))
        return x, cache


class Decoder(nnx.Module):
    """Decoder-only LM of the Qwen2 / Llama family.

    Parameters (logical axes): ``embed [vocab, embed]``, per layer the ``Block`` parameters,
    ``final_norm [embed]``, and when untied ``lm_head [embed, vocab]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.weight_dtype
        self.embed = logical_param(rngs, nnx.initializers.normal(cfg.initializer_range), (cfg.vocab_size, cfg.embed_dim),
                                   ("vocab", "embed"), pd)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, pd)
        if not cfg.tie_embeddings:
            self.lm_head = logical_param(rngs, nnx.initializers.normal(cfg.initializer_range), (cfg.embed_dim, cfg.vocab_size),
                                         ("embed", "vocab"), pd)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attn_mask: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Logits of the next token at every input position.

        Args:
          tokens: ``[B, T]`` int32 ids.
          positions: ``[B, T]`` int32 RoPE positions.
          attn_mask: ``[B, T, S]`` bool, True where query t may attend to key slot s, or an
            ``attention.AttentionMask`` standing for one (no O(T·S) array; packed rows carry
            segment ids in it). Without a cache ``S == T`` (the keys are the T tokens
            themselves); with a cache S is the cache size.
          cache: optional ``KVCache`` of size S; the new keys/values are written at slots
            ``[cache_index, cache_index + T)`` before attention.
          cache_index: int32 scalar, required with ``cache``.
          logits_at: optional ``[B]`` int32 input positions in ``[0, T)``: the final norm and LM
            head are applied to that one position per row only and the logits are ``[B, 1,
            vocab]`` (a prefill that needs the last prompt token's logits only; at batch 64,
            prompt 128 and vocab 16384 the full logits are a 537 MB tensor and 103 GFLOP); or
            ``[B, K]`` positions per row (the answer tokens of packed scoring rows): ``[B, K, vocab]``.

        Returns:
          ``(logits [B, T, vocab] float32, updated cache or None)``; ``[B, 1, vocab]`` /
          ``[B, K, vocab]`` with ``logits_at``.

        Raises:
          ValueError: on inconsistent shapes or a cache without ``cache_index``.
        """
        b, t = tokens.shape
        if positions.shape != (b, t):
            raise ValueError(f"positions {positions.shape} must equal tokens {tokens.shape}")
        s = t if cache is None else cache.k.shape[3]
        if tuple(attn_mask.shape) != (b, t, s):
            raise ValueError(f"attn_mask {attn_mask.shape} must be [batch, T, S] = {(b, t, s)}")
        if cache is not None:
            if cache_index is None:
                raise ValueError("cache_index is required when a cache is given")
            cache_index = jnp.asarray(cache_index, jnp.int32)
        dt = self.cfg.activation_dtype
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        for i, block in enumerate(self.layers):
            x, cache = block(x, positions, attn_mask, cache, i, cache_index)
        if logits_at is not None:
            at = jnp.asarray(logits_at, jnp.int32)
            if at.ndim not in (1, 2) or at.shape[0] != b:
                raise ValueError(f"logits_at {at.shape} must be [batch] = {(b,)} or [batch, K]")
            at = at[:, None] if at.ndim == 1 else at
            x = jnp.take_along_axis(x, at[:, :, None], axis=1)  # [B, K, D]
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32), cache
