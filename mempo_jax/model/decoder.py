"""The decoder (Qwen2/2.5, Llama 3, Qwen3, Gemma 3 text) as a Flax NNX module: one forward pass,
with or without a KV cache.

Source: ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Gemma3ForCausalLM``
in Hugging Face transformers (pre-norm blocks: RMSNorm → GQA attention with RoPE → residual,
RMSNorm → gated MLP → residual; final RMSNorm; LM head tied to the embedding or separate). The
families' differences are ``ModelConfig`` fields: q/k norms (Qwen3, Gemma 3), Gemma's
``(1 + weight)`` norms, post-attention / post-MLP norms and √D-scaled embeddings, GeGLU,
sliding-window layers and the final logit soft-cap.

Sliding-window layers (``cfg.layer_types``): the layer scan carries a per-layer flag; a local
layer's mask gets ``AttentionMask.window = cfg.sliding_window`` (in training, scoring, prefill and
decode alike) and its RoPE base ``cfg.rope_local_base_freq``. The KV cache keeps every position
for local layers too (the same slot layout as the global ones, the window applied by the mask):
no ring buffer, so a local layer's cache costs ``size`` positions rather than ``min(size,
window)``, and a decode step's attention over it reads ``position + 1`` keys, not ``window``.
The KV cache is a set of *slots*, one preallocated buffer per
k / v (``[layers, slots, kv_heads, size, head_dim]``, heads-major: a decode step's attention reads
each layer's ``[kv_heads, size, head_dim]`` block of a slot as it lies in memory); a slot holds one
context contiguously from position 0, and new tokens are scattered in at their positions. The
same forward serves training and scoring (no cache), prefill and decode (a cache; the sampler is
``mempo_jax.agent.slot_sampler``). The decoder layers are stored stacked: one ``Block`` whose parameters carry a leading
``[num_layers]`` axis (logical axis ``layers``), and the layer loop is a ``lax.scan`` over them,
rematerialised per layer in a differentiated pass (``remat``). One compiled layer serves every
layer, and no pass copies the weights into a stacked layout (MaxText's scanned layers).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.core.sharding import constrain
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.init_keys import InitKeys
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.attention_xla import BLOCKED_MIN_LEN, BLOCK_K
from mempo_jax.model.layers import EMBED_AXES, MLP, Attention, RMSNorm, logical_param


def stack_layers(blocks) -> nnx.Module:
    """Modules of one structure ``[m_0, …, m_{n-1}]`` → one module of that structure whose
    variables are stacked on a new leading ``[n]`` axis, tagged with the logical axis ``layers``
    (``core.sharding.DEFAULT_RULES``: never sharded). What ``Decoder`` stores as ``layers``.

    Raises:
      ValueError: ``blocks`` is empty.
    """
    if not blocks:
        raise ValueError("stack_layers needs at least one module")
    gdef = nnx.graphdef(blocks[0])

    def stack(*variables):
        axes = variables[0].get_metadata().get("out_sharding")
        value = jnp.stack([v.get_value() for v in variables])
        return variables[0].replace(value, **({"out_sharding": ("layers", *axes)} if axes else {}))

    states = [nnx.state(b) for b in blocks]
    return nnx.merge(gdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


class KVCache(NamedTuple):
    """Keys and values of every layer (after RoPE).

    Attributes:
      k: ``[num_layers, batch, num_kv_heads, size, head_dim]``.
      v: ``[num_layers, batch, num_kv_heads, size, head_dim]``.
    """

    k: Float[Array, "layers slots kv_heads cache head_dim"]
    v: Float[Array, "layers slots kv_heads cache head_dim"]


def init_cache(cfg: ModelConfig, batch: int, size: int, dtype=None) -> KVCache:
    """A zero KV cache of ``batch`` slots of ``size`` positions.

    Args:
      cfg: the model's config.
      batch: slots B.
      size: positions per slot.
      dtype: cache dtype; default the activation dtype ``cfg.dtype``.

    Returns:
      ``KVCache`` with k, v ``[num_layers, batch, num_kv_heads, size, head_dim]`` zeros
      (heads-major, see the module docstring).
    """
    dtype = cfg.activation_dtype if dtype is None else jnp.dtype(dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class _CacheWrite(NamedTuple):
    """Where one forward call's new keys/values go: ``slot``/``pos`` ``[B, T]`` scatter indices
    (out of range: dropped), ``rows`` the slot read by each query row (``None``: row b is slot b),
    ``kv_bound`` and ``block_k`` of ``attention_xla.blocked_attention``."""

    slot: jax.Array
    pos: jax.Array
    rows: jax.Array | None
    kv_bound: jax.Array
    block_k: int


class Block(nnx.Module):
    """One pre-norm decoder layer (HF ``Qwen2DecoderLayer``; with ``cfg.post_norms`` the
    ``Gemma3DecoderLayer``: ``attn_post_norm`` / ``mlp_post_norm`` on each sublayer's output
    before its residual add)."""

    def __init__(self, cfg: ModelConfig, *, rngs: InitKeys):
        d, eps, pd, off = cfg.embed_dim, cfg.rms_norm_eps, cfg.weight_dtype, cfg.norm_scale_offset
        self.window = cfg.sliding_window if cfg.has_local_layers else None
        self.attn_norm = RMSNorm(d, eps, pd, offset=off)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(d, eps, pd, offset=off)
        self.mlp = MLP(cfg, rngs=rngs)
        self.post_norms = bool(cfg.post_norms)
        if self.post_norms:
            self.attn_post_norm = RMSNorm(d, eps, pd, offset=off)
            self.mlp_post_norm = RMSNorm(d, eps, pd, offset=off)

    def __call__(self, x: Float[Array, "rows length embed"], positions: Int[Array, "rows length"],
                 attn_mask: Bool[Array, "rows length keys"] | AttentionMask, cache: KVCache | None = None,
                 layer: Int[ArrayLike, ""] = 0, write: _CacheWrite | None = None,
                 dense_max_len: int = BLOCKED_MIN_LEN, attention_impl: str = "xla",
                 local: Bool[ArrayLike, ""] | None = None) -> tuple[Float[Array, "rows length embed"], KVCache | None]:
        """``x [B,T,D]`` → ``(x [B,T,D], cache)``; with a cache, this layer's k/v of the T new
        tokens are written at ``write`` (slot, position) of cache layer ``layer`` (an int32 scalar,
        traced in the decoder's layer scan) before attention reads the cache. Without
        one, rows longer than ``dense_max_len`` tokens take the blocked attention;
        ``attention_impl`` is ``attention.attention``'s ``impl``. ``local`` (bool scalar, traced
        in the scan): a sliding-window layer (its mask windowed, its RoPE base the local one).

        Raises:
          ValueError: a model with sliding-window layers given a dense bool mask (it needs an
            ``AttentionMask``, whose window is set per layer).
        """
        if self.window is not None and local is not None:
            if not isinstance(attn_mask, AttentionMask):
                raise ValueError("a model with sliding-window layers needs an AttentionMask, not a dense bool mask")
            attn_mask = attn_mask._replace(window=jnp.where(local, jnp.int32(self.window), jnp.int32(2**30)))
        q, k, v = self.attn.qkv(self.attn_norm(x), positions, local)
        if cache is None:
            return self._mlp(x + self._post_attn(self.attn.attend(q, k, v, attn_mask, dense_max_len=dense_max_len,
                                                                  impl=attention_impl))), None
        ck = cache.k.at[layer, write.slot, :, write.pos, :].set(k.astype(cache.k.dtype), mode="drop")
        cv = cache.v.at[layer, write.slot, :, write.pos, :].set(v.astype(cache.v.dtype), mode="drop")
        x = x + self._post_attn(self.attn.attend(q, ck, cv, attn_mask, layer=layer, rows=write.rows,
                                                 kv_bound=write.kv_bound, block_k=write.block_k, impl=attention_impl))
        return self._mlp(x), KVCache(ck, cv)

    def _post_attn(self, y):
        return self.attn_post_norm(y) if self.post_norms else y

    def _mlp(self, x):
        y = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_post_norm(y) if self.post_norms else y)


class Decoder(nnx.Module):
    """Decoder-only LM of the Qwen2 / Llama / Qwen3 / Gemma 3 families.

    Parameters (logical axes): ``embed [vocab, embed]``, ``layers``: one ``Block`` whose
    parameters are ``[layers, …]`` (layer i's weights at index i; ``stack_layers``),
    ``final_norm [embed]``, and when untied ``lm_head [embed, vocab]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: InitKeys):
        self.cfg = cfg
        pd = cfg.weight_dtype
        self.embed = logical_param(rngs, nnx.initializers.normal(cfg.initializer_range), (cfg.vocab_size, cfg.embed_dim),
                                   ("vocab", "embed"), pd)
        # Built layer by layer (each draws its init keys in turn), then stacked.
        self.layers = stack_layers([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, pd, offset=cfg.norm_scale_offset)
        if not cfg.tie_embeddings:
            self.lm_head = logical_param(rngs, nnx.initializers.normal(cfg.initializer_range), (cfg.embed_dim, cfg.vocab_size),
                                         ("embed", "vocab"), pd)

    def __call__(
        self,
        tokens: Int[ArrayLike, "rows length"],
        positions: Int[ArrayLike, "rows length"],
        attn_mask: Bool[Array, "rows length keys"] | AttentionMask | None = None,
        cache: KVCache | None = None,
        *,
        rows: Int[Array, "rows"] | None = None,
        write: Bool[Array, "rows length"] | None = None,
        kv_bound: Int[ArrayLike, ""] | None = None,
        block_k: int = BLOCK_K,
        logits_at: Int[ArrayLike, "rows"] | Int[ArrayLike, "rows positions"] | None = None,
        remat: str = "none",
        dense_max_len: int = BLOCKED_MIN_LEN,
        attention_impl: str = "xla",
    ) -> tuple[Float[Array, "rows _ vocab"], KVCache | None]:
        """Logits of the next token at every input position: the one forward pass of training,
        scoring, prefill and decode.

        Without a cache the keys are the T input tokens themselves and ``attn_mask`` says who sees
        whom. With a cache (the slot layout: slot r holds one context from cache position 0, so a
        token's cache position is its RoPE position) each layer first writes the new tokens'
        keys/values at (slot ``rows[b]``, position ``positions[b, t]``), then every query attends to
        the cache positions ``<= `` its own in its slot (``AttentionMask.cached``), reading only the
        key blocks below ``kv_bound`` (``attention_xla.blocked_attention``).

        Args:
          tokens: ``[B, T]`` int32 ids.
          positions: ``[B, T]`` int32 RoPE positions (= cache positions with a cache).
          attn_mask: without a cache, ``[B, T, T]`` bool (True where query t may attend to key s)
            or an ``attention_mask.AttentionMask`` standing for one (packed rows carry segment ids in
            it); with a cache, ``None``.
          cache: optional ``KVCache`` ``[layers, slots, kv_heads, size, head_dim]``, ``size`` a
            multiple of ``min(block_k, size)``.
          rows: with a cache, ``[B]`` int32 slot of each row (``slots`` or more: a padding row,
            nothing written); ``None``: ``B == slots`` and row b is slot b (no gather of the cache).
          write: with a cache, ``[B, T]`` bool, True where the token's key/value is written
            (default all; padding: False).
          kv_bound: with a cache, int32 scalar ``> `` every position a used query sees (default
            ``max(positions) + 1``).
          block_k: key-block length of the cache attention (tokens).
          logits_at: optional ``[B]`` int32 input positions in ``[0, T)``: the LM head is
            applied to that one position per row only and the logits are ``[B, 1,
            vocab]`` (a prefill that needs the last prompt token's logits only; at batch 64,
            prompt 128 and vocab 16384 the full logits are a 537 MB tensor and 103 GFLOP); or
            ``[B, K]`` positions per row (the answer tokens of packed scoring rows): ``[B, K, vocab]``.
          remat, dense_max_len, attention_impl: the layer loop and the attention paths
            (``hidden_states``).

        Returns:
          ``(logits [B, T, vocab] float32, updated cache or None)``; ``[B, 1, vocab]`` /
          ``[B, K, vocab]`` with ``logits_at``.

        Raises:
          ValueError: on inconsistent shapes, a cache with a mask, or no mask without a cache.
        """
        x, cache = self.hidden_states(tokens, positions, attn_mask, cache, rows=rows, write=write, kv_bound=kv_bound,
                                      block_k=block_k, remat=remat, dense_max_len=dense_max_len,
                                      attention_impl=attention_impl)
        if logits_at is not None:
            at = jnp.asarray(logits_at, jnp.int32)
            if at.ndim not in (1, 2) or at.shape[0] != tokens.shape[0]:
                raise ValueError(f"logits_at {at.shape} must be [batch] = {(tokens.shape[0],)} or [batch, K]")
            at = at[:, None] if at.ndim == 1 else at
            x = jnp.take_along_axis(x, at[:, :, None], axis=1)  # [B, K, D]
        return project_logits(self.head_weight(), x, self.cfg.final_logit_softcapping), cache

    def hidden_states(
        self,
        tokens: Int[ArrayLike, "rows length"],
        positions: Int[ArrayLike, "rows length"],
        attn_mask: Bool[Array, "rows length keys"] | AttentionMask | None = None,
        cache: KVCache | None = None,
        *,
        rows: Int[Array, "rows"] | None = None,
        write: Bool[Array, "rows length"] | None = None,
        kv_bound: Int[ArrayLike, ""] | None = None,
        block_k: int = BLOCK_K,
        remat: str = "none",
        dense_max_len: int = BLOCKED_MIN_LEN,
        attention_impl: str = "xla",
    ) -> tuple[Float[Array, "rows length embed"], KVCache | None]:
        """The final-normed hidden states that the LM head reads (``__call__`` without the head).

        Args:
          tokens, positions, attn_mask, cache, rows, write, kv_bound, block_k: as ``__call__``.
          remat: ``"none"``, ``"full"`` (each decoder layer recomputed in the backward pass from
            its input) or the name of a ``jax.checkpoint_policies`` policy (e.g.
            ``"dots_saveable"``: the layer's matmul outputs kept, the rest recomputed). Applies to
            calls without a cache; it changes the memory and time of a gradient, not values.
          dense_max_len: without a cache, rows up to this many tokens use dense attention, longer
            ones blocked (``attention_xla.use_blocked``; ``ExecutionConfig.dense_attention_max_len``).
            Memory and time, not values (float32 summation order aside).
          attention_impl: ``ExecutionConfig.attention_impl`` (``attention.attention``'s ``impl``:
            ``"xla"``, ``"cudnn"``, ``"pallas"`` or ``"auto"``), with or without a cache.

        Returns:
          ``(hidden [B, T, embed] in the activation dtype, updated cache or None)``.

        Raises:
          ValueError: as ``__call__``, or an unknown ``remat``.
        """
        b, t = tokens.shape
        if positions.shape != (b, t):
            raise ValueError(f"positions {positions.shape} must equal tokens {tokens.shape}")
        if cache is None:
            if attn_mask is None or tuple(attn_mask.shape) != (b, t, t):
                shape = None if attn_mask is None else tuple(attn_mask.shape)
                raise ValueError(f"attn_mask {shape} must be [batch, T, T] = {(b, t, t)} without a cache")
            where = None
        else:
            if attn_mask is not None:
                raise ValueError("with a cache the mask is the cache positions: pass attn_mask=None")
            positions = positions.astype(jnp.int32)
            slots, size = cache.k.shape[1], cache.k.shape[3]
            if rows is None and slots != b:
                raise ValueError(f"{b} rows but {slots} cache slots (pass rows=)")
            write = jnp.ones((b, t), bool) if write is None else write
            slot = jnp.broadcast_to((jnp.arange(b) if rows is None else rows)[:, None], (b, t))
            kv_bound = jnp.max(positions) + 1 if kv_bound is None else kv_bound
            gather = None if rows is None else jnp.clip(rows, 0, slots - 1)
            where = _CacheWrite(slot, jnp.where(write, positions, size), gather, jnp.asarray(kv_bound, jnp.int32),
                                min(int(block_k), size))
            attn_mask = AttentionMask.cached(positions)
        dt = self.cfg.activation_dtype
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if self.cfg.scale_embeddings:  # sqrt(D) rounded to the activation dtype, as HF Gemma3TextScaledWordEmbedding
            x = x * jnp.asarray(self.cfg.embed_dim ** 0.5, jnp.float32).astype(dt)
        x = constrain(x, EMBED_AXES)
        policy = remat_policy(remat)
        gdef, stacked = nnx.split(self.layers)
        local = jnp.asarray(self.cfg.local_layers)  # [layers] bool: sliding-window layers
        if cache is not None:
            # The cache rides in the carry; each layer writes and reads its own index in place.
            def cached_body(carry, xs):
                (h, c), (state, i, loc) = carry, xs
                return nnx.merge(gdef, state)(h, positions, attn_mask, c, i, where,
                                              attention_impl=attention_impl, local=loc), None

            (x, cache), _ = jax.lax.scan(cached_body, (x, cache),
                                         (stacked, jnp.arange(self.cfg.num_layers, dtype=jnp.int32), local))
        else:
            def body(h, xs):
                state, loc = xs
                return nnx.merge(gdef, state)(h, positions, attn_mask, dense_max_len=dense_max_len,
                                              attention_impl=attention_impl, local=loc)[0], None

            if remat != "none":  # the backward pass keeps each layer's input (and what ``policy`` saves)
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            x, _ = jax.lax.scan(body, x, (stacked, local))
        return constrain(self.final_norm(x), EMBED_AXES), cache

    def head_weight(self) -> Float[Array, "embed vocab"]:
        """The LM head ``[embed, vocab]`` in the activation dtype (the transposed embedding when tied)."""
        dt = self.cfg.activation_dtype
        return self.embed[...].astype(dt).T if self.cfg.tie_embeddings else self.lm_head[...].astype(dt)


REMAT_CHOICES = ("none", "full") + tuple(n for n in dir(jax.checkpoint_policies) if n.endswith(("saveable", "dots"))
                                         or n.startswith("checkpoint_dots"))


def remat_policy(remat: str):
    """The ``jax.checkpoint`` policy of a ``remat`` name (``Decoder.hidden_states``): ``None`` for
    ``"none"`` / ``"full"`` (``"full"`` saves nothing but each layer's input).

    Raises:
      ValueError: a name that is neither ``"none"``, ``"full"`` nor in ``REMAT_CHOICES``.
    """
    if remat not in REMAT_CHOICES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_CHOICES)}; got {remat!r}")
    return None if remat in ("none", "full") else getattr(jax.checkpoint_policies, remat)


def project_logits(weight: Float[Array, "embed vocab"], hidden: Float[Array, "rows length embed"],
                   softcap: float | Float[ArrayLike, ""] | None = None) -> Float[Array, "rows length vocab"]:
    """The LM head: ``hidden [B, T, embed] @ weight [embed, vocab]`` → float32 ``[B, T, vocab]``
    (float32 accumulation); with ``softcap`` c, ``c * tanh(logits / c)`` (HF
    ``final_logit_softcapping``, Gemma 2 / 3)."""
    logits = jnp.einsum("btd,dv->btv", hidden, weight, preferred_element_type=jnp.float32).astype(jnp.float32)
    if softcap is not None:
        cap = jnp.asarray(softcap, jnp.float32)
        logits = cap * jnp.tanh(logits / cap)
    return constrain(logits, ("batch", "seq", "vocab"))
