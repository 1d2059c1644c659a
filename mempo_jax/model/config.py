"""Model configuration for the Qwen2 / Llama decoder family, with shape presets.

One frozen ``ModelConfig`` with classmethod presets (tunix style). Preset values are copied from
the ``config.json`` of each Hugging Face checkpoint (Qwen/Qwen2.5-*, meta-llama/Llama-3.x-*).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# PEFT / Hugging Face module name → (our module, our weight name): the LoRA targets.
LORA_TARGETS = {"q_proj": ("attn", "q"), "k_proj": ("attn", "k"), "v_proj": ("attn", "v"), "o_proj": ("attn", "o"),
                "gate_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"), "down_proj": ("mlp", "down")}

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
      lora_rank: rank r of the LoRA adapters (``mempo_jax.model.lora``); 0 = none.
      lora_alpha: LoRA alpha; the adapter output is scaled by ``lora_alpha / lora_rank`` (PEFT's
        ``scaling`` without rsLoRA).
      lora_targets: the projections that get an adapter, by their Hugging Face module names
        (PEFT ``target_modules``): a subset of ``lora.LORA_TARGETS`` (``q_proj``, ``k_proj``,
        ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``).

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
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

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
        self._check_lora()

    def _check_lora(self) -> None:
        """Validate the LoRA fields; ``lora_targets`` becomes a tuple in ``LORA_TARGETS`` order."""
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}")
        if not self.lora_alpha > 0:
            raise ValueError(f"ModelConfig.lora_alpha must be > 0, got {self.lora_alpha!r}")
        targets = (self.lora_targets,) if isinstance(self.lora_targets, str) else tuple(self.lora_targets)
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"ModelConfig.lora_targets: unknown module name(s) {unknown}; known: {list(LORA_TARGETS)}")
        if self.lora_rank and not targets:
            raise ValueError("ModelConfig.lora_targets must name at least one module when lora_rank > 0")
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in targets))

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

    def lora_weights(self, module: str) -> tuple[str, ...]:
        """Our weight names of ``module`` (``"attn"`` / ``"mlp"``) that carry an adapter."""
        return tuple(LORA_TARGETS[t][1] for t in self.lora_targets if LORA_TARGETS[t][0] == module) \
            if self.lora_rank else ()

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_lora_params(self) -> int:
        """Analytic count of the LoRA adapter parameters: ``r · (fan_in + fan_out)`` per targeted
        weight and layer (0 without adapters)."""
        d, h, k, hd, f = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
        io = {"q": (d, h * hd), "k": (d, k * hd), "v": (d, k * hd), "o": (h * hd, d), "gate": (d, f), "up": (d, f),
              "down": (f, d)}
        weights = self.lora_weights("attn") + self.lora_weights("mlp")
        return self.num_layers * self.lora_rank * sum(sum(io[w]) for w in weights)

    def num_params(self) -> int:
        """Analytic parameter count of the base model (embedding, blocks, final norm, untied LM
        head; LoRA adapters not included: ``num_lora_params``)."""
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
    def preset(cls, name: str) -> "ModelConfig":
        """The shapes of a released checkpoint family member (``PRESET_SHAPES``; e.g. ``"qwen2_5_7b"``).

        Raises:
          ValueError: an unknown name (the known ones are listed).
        """
        if name not in PRESET_SHAPES:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESET_SHAPES)}")
        family, vocab, embed, layers, heads, kv_heads, head_dim, mlp, tied, rope = PRESET_SHAPES[name]
        return cls(vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=head_dim, mlp_dim=mlp, tie_embeddings=tied, rope_scaling=rope, **_FAMILIES[family])


# Qwen2.5 (Qwen/Qwen2.5-*-Instruct config.json) and Llama 3.x (meta-llama config.json) families.
_FAMILIES = {"qwen2.5": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True),
             "llama3": dict(rope_theta=500000.0, rms_norm_eps=1e-5, qkv_bias=False)}
# name: (family, vocab, embed, layers, heads, kv heads, head dim, mlp, tied head, rope scaling); parameters
# (num_params): 0.5b ≈ 494 M, 1.5b ≈ 1.54 B, 3b ≈ 3.09 B, 7b ≈ 7.62 B, 3.2-1b ≈ 1.24 B, 3.2-3b ≈ 3.21 B,
# 3.1-8b ≈ 8.03 B.
PRESET_SHAPES = {
    "qwen2_5_0_5b": ("qwen2.5", 151936, 896, 24, 14, 2, 64, 4864, True, None),
    "qwen2_5_1_5b": ("qwen2.5", 151936, 1536, 28, 12, 2, 128, 8960, True, None),
    "qwen2_5_3b": ("qwen2.5", 151936, 2048, 36, 16, 2, 128, 11008, True, None),
    "qwen2_5_7b": ("qwen2.5", 152064, 3584, 28, 28, 4, 128, 18944, False, None),
    "llama3_2_1b": ("llama3", 128256, 2048, 16, 32, 8, 64, 8192, True, _LLAMA32_ROPE),
    "llama3_2_3b": ("llama3", 128256, 3072, 28, 24, 8, 128, 8192, True, _LLAMA32_ROPE),
    "llama3_1_8b": ("llama3", 128256, 4096, 32, 32, 8, 128, 14336, False, _LLAMA31_ROPE),
}
for _name in PRESET_SHAPES:  # ModelConfig.qwen2_5_7b() etc.: the gin-selectable presets (ModelOptions.preset)
    setattr(ModelConfig, _name, classmethod(lambda cls, _n=_name: cls.preset(_n)))
PRESETS = {name: getattr(ModelConfig, name) for name in PRESET_SHAPES}
