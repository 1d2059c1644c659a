"""Model configuration for the Qwen2 / Llama decoder family, with shape presets.

One frozen ``ModelConfig`` with classmethod presets (tunix style). Preset values are copied from
the ``config.json`` of each Hugging Face checkpoint (Qwen/Qwen2.5-*, meta-llama/Llama-3.x-*).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# Llama 3.x rope scaling ("rope_type": "llama3"), from the checkpoints' config.json.
_LLAMA32_ROPE = (
    ("factor", 32.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)
_LLAMA31_ROPE = (
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Qwen2 / Llama style decoder (HF ``Qwen2Config`` / ``LlamaConfig``).

    Attributes:
      vocab_size: rows of the token embedding (and the LM head).
      embed_dim: model width D (HF ``hidden_size``).
      num_layers: decoder blocks (HF ``num_hidden_layers``).
      num_heads: query heads H.
      num_kv_heads: key/value heads K (grouped-query attention); ``num_heads % num_kv_heads == 0``.
      head_dim: width of one head (HF ``head_dim``, default ``hidden_size // num_attention_heads``).
      mlp_dim: SwiGLU hidden width (HF ``intermediate_size``).
      rope_theta: RoPE base.
      rms_norm_eps: epsilon inside RMSNorm.
      qkv_bias: biases on the q/k/v projections (Qwen2: True, Llama: False).
      tie_embeddings: LM head shares the embedding matrix.
      rope_scaling: Llama-3 rope scaling as sorted ``(key, value)`` pairs with keys ``factor``,
        ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; or None.
      dtype: activation dtype name ("float32", "bfloat16"); logits are always float32.
      param_dtype: parameter dtype name.
      initializer_range: std of the normal init of every weight matrix (HF ``initializer_range``;
        0.02 as in Qwen2/Llama, where D ≥ 896). Narrow models train faster from scratch with
        about ``1 / sqrt(embed_dim)``: with 0.02 at D = 128, attention starts uniform and the copy
        circuits form only after a long plateau.

    Raises:
      ValueError: from ``__post_init__`` when a field is out of range, naming the field.
    """

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"ModelConfig.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.initializer_range > 0:
            raise ValueError(f"ModelConfig.initializer_range must be > 0, got {self.initializer_range}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            try:
                jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"ModelConfig.{name} is not a dtype name: {value!r}") from e
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            if sorted(scaling) != sorted(_ROPE_SCALING_KEYS):
                raise ValueError(
                    f"ModelConfig.rope_scaling needs exactly the keys {_ROPE_SCALING_KEYS}, got {sorted(scaling)}"
                )
            if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ValueError("ModelConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")
            # Canonical, hashable form: sorted pairs.
            object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def activation_dtype(self) -> jnp.dtype:
        """``jnp.dtype`` of activations."""
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        """``jnp.dtype`` of parameters."""
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Analytic parameter count (embedding, blocks, final norm, untied LM head)."""
        d, h, k, hd, f = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
        attn = d * h * hd + 2 * d * k * hd + h * hd * d
        if self.qkv_bias:
            attn += h * hd + 2 * k * hd
        per_layer = attn + 3 * d * f + 2 * d
        total = self.vocab_size * d + self.num_layers * per_layer + d
        if not self.tie_embeddings:
            total += d * self.vocab_size
        return total

    # ----------------------------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, vocab_size: int, **overrides) -> "ModelConfig":
        """A ~1 M-parameter test model (plus ``vocab_size * 128`` embedding parameters)."""
        kw = dict(
            vocab_size=vocab_size, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, mlp_dim=384, rope_theta=10000.0, rms_norm_eps=1e-6,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def qwen2_5_0_5b(cls) -> "ModelConfig":
        """Qwen/Qwen2.5-0.5B(-Instruct) shapes (≈ 494 M parameters)."""
        return cls(vocab_size=151936, embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
                   head_dim=64, mlp_dim=4864, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   qkv_bias=True, tie_embeddings=True)

    @classmethod
    def qwen2_5_1_5b(cls) -> "ModelConfig":
        """Qwen/Qwen2.5-1.5B(-Instruct) shapes (≈ 1.54 B parameters)."""
        return cls(vocab_size=151936, embed_dim=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                   head_dim=128, mlp_dim=8960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   qkv_bias=True, tie_embeddings=True)

    @classmethod
    def qwen2_5_3b(cls) -> "ModelConfig":
        """Qwen/Qwen2.5-3B(-Instruct) shapes (≈ 3.09 B parameters)."""
        return cls(vocab_size=151936, embed_dim=2048, num_layers=36, num_heads=16, num_kv_heads=2,
                   head_dim=128, mlp_dim=11008, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   qkv_bias=True, tie_embeddings=True)

    @classmethod
    def qwen2_5_7b(cls) -> "ModelConfig":
        """Qwen/Qwen2.5-7B(-Instruct) shapes (≈ 7.62 B parameters, untied head)."""
        return cls(vocab_size=152064, embed_dim=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                   head_dim=128, mlp_dim=18944, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   qkv_bias=True, tie_embeddings=False)

    @classmethod
    def llama3_2_1b(cls) -> "ModelConfig":
        """meta-llama/Llama-3.2-1B shapes (≈ 1.24 B parameters)."""
        return cls(vocab_size=128256, embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                   head_dim=64, mlp_dim=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                   qkv_bias=False, tie_embeddings=True, rope_scaling=_LLAMA32_ROPE)

    @classmethod
    def llama3_2_3b(cls) -> "ModelConfig":
        """meta-llama/Llama-3.2-3B shapes (≈ 3.21 B parameters)."""
        return cls(vocab_size=128256, embed_dim=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                   head_dim=128, mlp_dim=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                   qkv_bias=False, tie_embeddings=True, rope_scaling=_LLAMA32_ROPE)

    @classmethod
    def llama3_1_8b(cls) -> "ModelConfig":
        """meta-llama/Llama-3.1-8B shapes (≈ 8.03 B parameters, untied head)."""
        return cls(vocab_size=128256, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, mlp_dim=14336, rope_theta=500000.0, rms_norm_eps=1e-5,
                   qkv_bias=False, tie_embeddings=False, rope_scaling=_LLAMA31_ROPE)


PRESETS = {
    "qwen2_5_0_5b": ModelConfig.qwen2_5_0_5b,
    "qwen2_5_1_5b": ModelConfig.qwen2_5_1_5b,
    "qwen2_5_3b": ModelConfig.qwen2_5_3b,
    "qwen2_5_7b": ModelConfig.qwen2_5_7b,
    "llama3_2_1b": ModelConfig.llama3_2_1b,
    "llama3_2_3b": ModelConfig.llama3_2_3b,
    "llama3_1_8b": ModelConfig.llama3_1_8b,
}
