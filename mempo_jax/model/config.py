"""Model configuration of the decoder families (Qwen2/2.5, Llama 3, Qwen3, Gemma 3 text), with shape presets.

One frozen ``ModelConfig`` with classmethod presets (tunix style). Preset values are copied from
the ``config.json`` of each Hugging Face checkpoint (Qwen/Qwen2.5-*, meta-llama/Llama-3.x-*,
Qwen/Qwen3-*, google/gemma-3-*). The families differ by fields of this config only (q/k norms,
norm style, activation, sliding-window layers, ...): one ``Decoder`` serves them all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from mempo_jax.core.validation import check

# PEFT / Hugging Face module name → (our module, our weight name): the LoRA targets.
LORA_TARGETS = {"q_proj": ("attn", "q"), "k_proj": ("attn", "k"), "v_proj": ("attn", "v"), "o_proj": ("attn", "o"),
                "gate_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"), "down_proj": ("mlp", "down")}

_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # ModelConfig.hidden_act: SwiGLU / GeGLU (tanh approximation)
LAYER_TYPES = ("full_attention", "sliding_attention")  # ModelConfig.layer_types (HF names)

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
    """Shapes and numerics of a pre-norm decoder (HF ``Qwen2Config``, ``LlamaConfig``, ``Qwen3Config``,
    ``Gemma3TextConfig``).

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
      rope_scaling: rope scaling of the global layers as sorted ``(key, value)`` pairs: Llama-3
        scaling (keys ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``), linear scaling (key ``factor`` alone: frequencies
        divided by it; Gemma 3 4B+), or None.
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
      hidden_act: the gated MLP's activation (HF ``hidden_act`` / ``hidden_activation``):
        ``"silu"`` (SwiGLU: Qwen, Llama) or ``"gelu_pytorch_tanh"`` (GeGLU, tanh-approximated GELU: Gemma).
      qk_norm: an RMSNorm over ``head_dim`` on every query and key head before RoPE (HF
        ``q_norm`` / ``k_norm``: Qwen3, Gemma 3).
      norm_scale_offset: RMSNorm scales by ``norm_scale_offset + weight``: 0.0 (Qwen/Llama:
        ``weight * x̂``, the product in the activation dtype) or 1.0 (Gemma: ``(1 + weight) * x̂``,
        the product in float32 and the weight initialised to 0; HF ``Gemma3RMSNorm``).
      post_norms: an RMSNorm on the attention output and on the MLP output before each residual
        add (Gemma 2/3 ``post_attention_layernorm`` / ``post_feedforward_layernorm``).
      scale_embeddings: the embedding rows are multiplied by ``sqrt(embed_dim)`` rounded to the
        activation dtype (HF ``Gemma3TextScaledWordEmbedding``).
      query_pre_attn_scalar: attention scores scale by ``query_pre_attn_scalar ** -0.5``
        (Gemma); None: ``head_dim ** -0.5``.
      sliding_window: keys a sliding-window layer's query sees, its own included (HF
        ``sliding_window``: key s is seen from query t iff ``t - W < s <= t``); None: no local layers.
      layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (HF
        ``layer_types``); None: every layer global.
      rope_local_base_freq: RoPE base of the sliding-window layers (default RoPE, no scaling;
        HF ``rope_local_base_freq``); None: ``rope_theta``.
      final_logit_softcapping: logits become ``c * tanh(logits / c)``; None: no capping.

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
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_scale_offset: float = 0.0
    post_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            check(self, name, int, lo=1)
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
        for name, value in (("dtype", self.dtype), ("param_dtype", self.param_dtype)):
            try:
                jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"ModelConfig.{name} is not a dtype name: {value!r}") from e
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            if sorted(scaling) not in (sorted(_ROPE_SCALING_KEYS), ["factor"]):
                raise ValueError(
                    f"ModelConfig.rope_scaling needs exactly the keys {_ROPE_SCALING_KEYS} (llama3) or 'factor' "
                    f"(linear), got {sorted(scaling)}"
                )
            if len(scaling) > 1 and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ValueError("ModelConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")
            if not scaling["factor"] > 0:
                raise ValueError(f"ModelConfig.rope_scaling: factor must be > 0, got {scaling['factor']}")
            # Canonical, hashable form: sorted pairs.
            object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        self._check_lora()
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        """Validate the fields that tell the families apart (activation, norms, sliding window)."""
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.norm_scale_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_scale_offset must be 0.0 or 1.0, got {self.norm_scale_offset!r}")
        for name, value in (("query_pre_attn_scalar", self.query_pre_attn_scalar),
                            ("rope_local_base_freq", self.rope_local_base_freq),
                            ("final_logit_softcapping", self.final_logit_softcapping)):
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if self.layer_types is not None:
            types = (self.layer_types,) if isinstance(self.layer_types, str) else tuple(self.layer_types)
            if len(types) != self.num_layers or not set(types) <= set(LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types must name one of {LAYER_TYPES} per layer "
                                 f"({self.num_layers}), got {types!r}")
            object.__setattr__(self, "layer_types", types)
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be an int >= 1 or None, got {window!r}")
        if any(self.local_layers) and window is None:
            raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window is None")

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
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: True on a sliding-window (local) layer (``layer_types``; none without)."""
        return tuple(t == "sliding_attention" for t in self.layer_types or ("full_attention",) * self.num_layers)

    @property
    def has_local_layers(self) -> bool:
        """Whether some layer is a sliding-window layer."""
        return any(self.local_layers)

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
        per_layer = attn + 3 * d * f + (4 if self.post_norms else 2) * d + (2 * hd if self.qk_norm else 0)
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
        extra = dict(_FAMILIES[family])
        if family == "gemma3":  # every sixth layer global (HF Gemma3TextConfig's sliding_window_pattern = 6)
            extra.update(layer_types=gemma3_layer_types(layers), sliding_window=_GEMMA3_WINDOW[name])
        return cls(vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=head_dim, mlp_dim=mlp, tie_embeddings=tied, rope_scaling=rope, **extra)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer types: layer i is global iff ``(i + 1) % pattern == 0`` (HF
    ``Gemma3TextConfig``'s default from ``sliding_window_pattern``)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


# Qwen2.5 (Qwen/Qwen2.5-*-Instruct config.json), Llama 3.x (meta-llama config.json), Qwen3
# (Qwen/Qwen3-* config.json) and Gemma 3 (google/gemma-3-*-it config.json, text part) families.
_FAMILIES = {"qwen2.5": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True),
             "llama3": dict(rope_theta=500000.0, rms_norm_eps=1e-5, qkv_bias=False),
             "qwen3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=True),
             "gemma3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=True,
                            hidden_act="gelu_pytorch_tanh", norm_scale_offset=1.0, post_norms=True,
                            scale_embeddings=True, query_pre_attn_scalar=256.0, rope_local_base_freq=10000.0)}
_GEMMA3_WINDOW = {"gemma3_270m": 512, "gemma3_1b": 512, "gemma3_4b": 1024}
# name: (family, vocab, embed, layers, heads, kv heads, head dim, mlp, tied head, rope scaling); parameters
# (num_params): 0.5b ≈ 494 M, 1.5b ≈ 1.54 B, 3b ≈ 3.09 B, 7b ≈ 7.62 B, 3.2-1b ≈ 1.24 B, 3.2-3b ≈ 3.21 B,
# 3.1-8b ≈ 8.03 B, qwen3 0.6b ≈ 596 M, 1.7b ≈ 1.72 B, 4b ≈ 4.02 B, 8b ≈ 8.19 B, gemma3 270m ≈ 268 M,
# 1b ≈ 1.00 B, 4b (text) ≈ 3.88 B.
PRESET_SHAPES = {
    "qwen2_5_0_5b": ("qwen2.5", 151936, 896, 24, 14, 2, 64, 4864, True, None),
    "qwen2_5_1_5b": ("qwen2.5", 151936, 1536, 28, 12, 2, 128, 8960, True, None),
    "qwen2_5_3b": ("qwen2.5", 151936, 2048, 36, 16, 2, 128, 11008, True, None),
    "qwen2_5_7b": ("qwen2.5", 152064, 3584, 28, 28, 4, 128, 18944, False, None),
    "llama3_2_1b": ("llama3", 128256, 2048, 16, 32, 8, 64, 8192, True, _LLAMA32_ROPE),
    "llama3_2_3b": ("llama3", 128256, 3072, 28, 24, 8, 128, 8192, True, _LLAMA32_ROPE),
    "llama3_1_8b": ("llama3", 128256, 4096, 32, 32, 8, 128, 14336, False, _LLAMA31_ROPE),
    "qwen3_0_6b": ("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, True, None),
    "qwen3_1_7b": ("qwen3", 151936, 2048, 28, 16, 8, 128, 6144, True, None),
    "qwen3_4b": ("qwen3", 151936, 2560, 36, 32, 8, 128, 9728, True, None),
    "qwen3_8b": ("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, False, None),
    "gemma3_270m": ("gemma3", 262144, 640, 18, 4, 1, 256, 2048, True, None),
    "gemma3_1b": ("gemma3", 262144, 1152, 26, 4, 1, 256, 6912, True, None),
    "gemma3_4b": ("gemma3", 262208, 2560, 34, 8, 4, 256, 10240, True, (("factor", 8.0),)),
}
for _name in PRESET_SHAPES:  # ModelConfig.qwen2_5_7b() etc.: the gin-selectable presets (ModelOptions.preset)
    setattr(ModelConfig, _name, classmethod(lambda cls, _n=_name: cls.preset(_n)))
PRESETS = {name: getattr(ModelConfig, name) for name in PRESET_SHAPES}
