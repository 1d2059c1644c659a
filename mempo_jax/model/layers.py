"""Building blocks of the decoder: RMSNorm, RoPE, GQA attention, gated MLP (SwiGLU / GeGLU).

Numerics follow ``modeling_qwen2.py`` / ``modeling_llama.py`` / ``modeling_qwen3.py`` /
``modeling_gemma3.py`` in Hugging Face transformers (rotate-half RoPE, Llama-3 and linear rope
scaling, RMSNorm statistics in float32, Gemma's ``(1 + weight)`` RMSNorm, q/k norms, per-layer
RoPE bases of sliding-window and global layers). Every parameter carries its logical
axis names as NNX ``out_sharding`` metadata (MaxText style); ``mempo_jax.core.sharding`` maps them to
mesh axes. Logical axes used: ``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``norm``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.core.sharding import constrain
from mempo_jax.model.attention import attention
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.init_keys import InitKeys
from mempo_jax.model.lora import adapter_params, lora_delta

EMBED_AXES = ("batch", "seq", "embed")  # the residual stream's logical axes (core.sharding.constrain)



def add_lora(module: nnx.Module, cfg: ModelConfig, kind: str, rngs: InitKeys, n_in: dict[str, int]) -> None:
    """Give ``module`` (``kind`` ``"attn"`` / ``"mlp"``) the adapters ``cfg`` asks for:
    ``{w}_lora_a`` / ``{w}_lora_b`` beside each targeted weight ``w`` (``lora.adapter_params``;
    ``n_in[w]`` = its input axes)."""
    for w in cfg.lora_weights(kind):
        param = getattr(module, w)
        a, b = adapter_params(rngs, param.shape, param.get_metadata()["out_sharding"], n_in[w], cfg.lora_rank)
        setattr(module, f"{w}_lora_a", a)
        setattr(module, f"{w}_lora_b", b)


def project(module: nnx.Module, eq: str, x: Float[Array, "..."], w: str, n_in: int) -> Float[Array, "..."]:
    """``einsum(eq, x, W)`` for weight ``w`` of ``module``, plus its LoRA term when it has one
    (``lora.lora_delta`` with ``scale = lora_alpha / lora_rank``); in ``x.dtype``."""
    y = jnp.einsum(eq, x, getattr(module, w)[...].astype(x.dtype))
    a = getattr(module, f"{w}_lora_a", None)
    if a is None:
        return y
    return y + lora_delta(x, a[...], getattr(module, f"{w}_lora_b")[...], n_in, module.lora_scale)


def logical_param(rngs: InitKeys | None, init, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype) -> nnx.Param:
    """An ``nnx.Param`` initialised by ``init(key, shape, dtype)`` and tagged with logical ``axes``.

    Raises:
      ValueError: if ``len(axes) != len(shape)``.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    key = rngs.params() if rngs is not None else jax.random.key(0)
    return nnx.Param(init(key, shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


# ------------------------------------------------------------------------------------------ RoPE


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    # float32 arithmetic as in transformers' _compute_default_rope_parameters.
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    s = dict(scaling)
    factor = float(s["factor"])
    if len(s) == 1:  # linear scaling: positions divided by the factor
        return (inv_freq / np.float32(factor)).astype(np.float32)
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> Float[np.ndarray, "half_head_dim"]:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 (radians per position).

    ``1 / theta ** (2i / head_dim)``, then the scaling of ``cfg.rope_scaling`` when set: Llama-3
    (long wavelengths (> original_ctx / low_freq_factor) divided by ``factor``, short ones
    (< original_ctx / high_freq_factor) kept, the band between interpolated) or linear (all
    divided by ``factor``). ``local``: the sliding-window layers' frequencies, base
    ``cfg.rope_local_base_freq`` and no scaling (Gemma 3; the global ones without it).
    Source: ``_compute_default_rope_parameters`` / ``_compute_llama3_parameters`` /
    ``_compute_linear_scaling_rope_parameters`` in transformers ``modeling_rope_utils.py``.
    """
    if local and cfg.rope_local_base_freq is not None:
        return _inv_freq_cached(cfg.head_dim, float(cfg.rope_local_base_freq), None)
    return _inv_freq_cached(cfg.head_dim, float(cfg.rope_theta), cfg.rope_scaling)


def apply_rope(x: Float[ArrayLike, "rows length heads head_dim"], positions: Int[ArrayLike, "rows length"],
               inv_freq: Float[ArrayLike, "half_head_dim"]) -> Float[Array, "rows length heads head_dim"]:
    """Rotate ``x`` by position (rotate-half convention of HF ``apply_rotary_pos_emb``).

    Args:
      x: ``[batch, seq, heads, head_dim]`` any float dtype.
      positions: ``[batch, seq]`` int32 absolute positions.
      inv_freq: ``[head_dim // 2]`` float32 from ``rope_inv_freq``.

    Returns:
      ``[batch, seq, heads, head_dim]`` in ``x.dtype``:
      ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x2, x1)``.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,hd/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# --------------------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    """RMSNorm, statistics in float32: ``weight * (x / sqrt(mean(x**2) + eps))`` with the product in
    ``x.dtype`` (HF ``Qwen2RMSNorm``), or with ``offset = 1.0`` ``(1 + weight) * (x / sqrt(…))``
    with the product in float32 and the weight initialised to 0 (HF ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, param_dtype, *, offset: float = 0.0, rngs: InitKeys | None = None):
        self.eps, self.offset = eps, float(offset)
        init = nnx.initializers.zeros if self.offset else nnx.initializers.ones
        self.weight = logical_param(None, init, (dim,), ("norm",), param_dtype)

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """``[..., dim]`` → ``[..., dim]`` in ``x.dtype``."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE (HF ``Qwen2Attention`` / ``LlamaAttention`` /
    ``Qwen3Attention`` / ``Gemma3Attention``).

    Parameters: ``q [embed, heads, head_dim]``, ``k``/``v [embed, kv_heads, head_dim]``,
    optional biases ``[heads|kv_heads, head_dim]``, ``o [heads, head_dim, embed]``, with
    ``cfg.qk_norm`` the RMSNorms ``q_norm`` / ``k_norm`` ``[head_dim]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: InitKeys):
        self.cfg = cfg
        d, h, k, hd, pd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
        init = nnx.initializers.normal(cfg.initializer_range)
        self.q = logical_param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pd)
        self.k = logical_param(rngs, init, (d, k, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.v = logical_param(rngs, init, (d, k, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.o = logical_param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = logical_param(rngs, zeros, (h, hd), ("heads", "head_dim"), pd)
            self.k_bias = logical_param(rngs, zeros, (k, hd), ("kv_heads", "head_dim"), pd)
            self.v_bias = logical_param(rngs, zeros, (k, hd), ("kv_heads", "head_dim"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, offset=cfg.norm_scale_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, offset=cfg.norm_scale_offset)
        self.lora_scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
        add_lora(self, cfg, "attn", rngs, {"q": 1, "k": 1, "v": 1, "o": 2})

    def qkv(self, x: Float[Array, "rows length embed"], positions: Int[Array, "rows length"],
            local: Bool[ArrayLike, ""] | None = None
            ) -> tuple[Float[Array, "rows length heads head_dim"], Float[Array, "rows length kv_heads head_dim"],
                       Float[Array, "rows length kv_heads head_dim"]]:
        """Project, normalise (``cfg.qk_norm``) and rotate.

        Args:
          x: ``[batch, seq, embed]`` activations.
          positions: ``[batch, seq]`` int32.
          local: bool scalar (may be traced): this is a sliding-window layer, whose RoPE base is
            ``cfg.rope_local_base_freq`` (``rope_inv_freq``); None: a global layer.

        Returns:
          ``q [batch, seq, heads, head_dim]``, ``k, v [batch, seq, kv_heads, head_dim]`` (RoPE on q,
          k). With ``cfg.query_pre_attn_scalar`` the queries carry the factor
          ``sqrt(head_dim / query_pre_attn_scalar)``, so the attention's ``head_dim ** -0.5``
          makes the scale ``query_pre_attn_scalar ** -0.5`` (HF ``Gemma3Attention.scaling``).
        """
        dt = x.dtype
        q = project(self, "btd,dhk->bthk", x, "q", 1)
        k = project(self, "btd,dhk->bthk", x, "k", 1)
        v = project(self, "btd,dhk->bthk", x, "v", 1)
        if self.cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(self.cfg)
        if local is not None and self.cfg.rope_local_base_freq is not None:
            inv_freq = jnp.where(local, rope_inv_freq(self.cfg, local=True), inv_freq)
        scalar = self.cfg.query_pre_attn_scalar
        if scalar is not None and scalar != self.cfg.head_dim:
            q = (q.astype(jnp.float32) * jnp.float32(math.sqrt(self.cfg.head_dim / scalar))).astype(dt)
        heads, kv_heads = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
        return (constrain(apply_rope(q, positions, inv_freq), heads), constrain(apply_rope(k, positions, inv_freq), kv_heads),
                constrain(v, kv_heads))

    def attend(self, q: Float[Array, "rows length heads head_dim"], k: Float[Array, "..."], v: Float[Array, "..."],
               attn_mask: Bool[Array, "rows length keys"] | AttentionMask, **cache) -> Float[Array, "rows length embed"]:
        """Masked softmax attention with kv heads shared by ``num_heads // num_kv_heads`` query
        heads, then the output projection.

        Args:
          q: ``[batch, T, heads, head_dim]``.
          k, v: ``[batch, S, kv_heads, head_dim]``, or a whole KV cache with ``layer=`` (see
            ``attention.attention``).
          attn_mask: ``[batch, T, S]`` bool, True where query t may attend to key s, or an
            ``attention_mask.AttentionMask`` (the same relation from O(T + S) integers). A query
            row with no True entry gets garbage output, never NaN.
          **cache: ``layer``, ``rows``, ``kv_bound``, ``block_k``, ``dense_max_len``, ``impl`` of
            ``attention.attention``.

        Returns:
          ``[batch, T, embed]`` in ``q.dtype`` (after the output projection).
        """
        return self.project_out(attention(q, k, v, attn_mask, **cache))

    def project_out(self, out: Float[Array, "rows length heads head_dim"]) -> Float[Array, "rows length embed"]:
        """The output projection (with its adapter): ``[batch, T, heads, head_dim]`` → ``[batch, T, embed]``."""
        return constrain(project(self, "bthk,hkd->btd", out, "o", 2), EMBED_AXES)


class MLP(nnx.Module):
    """Gated feed-forward ``down(act(x @ gate) * (x @ up))``: SwiGLU with ``act = silu`` (HF
    ``Qwen2MLP``), GeGLU with ``act`` the tanh-approximated GELU (``cfg.hidden_act =
    "gelu_pytorch_tanh"``, HF ``Gemma3MLP``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: InitKeys):
        d, f, pd = cfg.embed_dim, cfg.mlp_dim, cfg.weight_dtype
        init = nnx.initializers.normal(cfg.initializer_range)
        self.gate = logical_param(rngs, init, (d, f), ("embed", "mlp"), pd)
        self.up = logical_param(rngs, init, (d, f), ("embed", "mlp"), pd)
        self.down = logical_param(rngs, init, (f, d), ("mlp", "embed"), pd)
        self.act = cfg.hidden_act
        self.lora_scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
        add_lora(self, cfg, "mlp", rngs, {"gate": 1, "up": 1, "down": 1})

    def __call__(self, x: Float[Array, "rows length embed"]) -> Float[Array, "rows length embed"]:
        """``[batch, seq, embed]`` → ``[batch, seq, embed]`` in ``x.dtype``."""
        g = project(self, "btd,df->btf", x, "gate", 1)
        u = project(self, "btd,df->btf", x, "up", 1)
        act = jax.nn.silu(g) if self.act == "silu" else jax.nn.gelu(g, approximate=True)
        h = constrain(act * u, ("batch", "seq", "mlp"))
        return constrain(project(self, "btf,fd->btd", h, "down", 1), EMBED_AXES)
