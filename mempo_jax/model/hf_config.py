"""Hugging Face ``config.json`` ⇄ ``ModelConfig`` for Qwen2, Llama, Qwen3 and Gemma 3 (text) checkpoints.

Source: ``Qwen2Config`` / ``LlamaConfig`` / ``Qwen3Config`` / ``Gemma3TextConfig`` in transformers
(v4 keys ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``; v5 key ``rope_parameters``,
per layer type for Gemma 3).
"""

from __future__ import annotations

from typing import Any

from mempo_jax.model.config import ModelConfig, gemma3_layer_types

_ARCH = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "gemma3_text": "Gemma3ForCausalLM"}
# The fields that tell the families apart, as each family's checkpoints have them.
_FAMILY = {
    "qwen2": dict(qkv_bias=True, qk_norm=False, post_norms=False, norm_scale_offset=0.0, hidden_act="silu",
                  scale_embeddings=False),
    "llama": dict(qkv_bias=False, qk_norm=False, post_norms=False, norm_scale_offset=0.0, hidden_act="silu",
                  scale_embeddings=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, post_norms=False, norm_scale_offset=0.0, hidden_act="silu",
                  scale_embeddings=False),
    "gemma3_text": dict(qkv_bias=False, qk_norm=True, post_norms=True, norm_scale_offset=1.0,
                        hidden_act="gelu_pytorch_tanh", scale_embeddings=True),
}
_SUPPORTED = ", ".join(_ARCH)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: unknown, missing or mis-shaped keys, bad config."""


# ------------------------------------------------------------------------------------- config


def _rope(params: dict[str, Any], theta: float, what: str) -> tuple[float, tuple | None]:
    """``(rope_theta, ModelConfig.rope_scaling)`` of one rope parameter dict (v4 ``rope_scaling``
    or v5 ``rope_parameters``; rope types ``default``, ``llama3``, ``linear``).

    Raises:
      CheckpointError: another rope type, or a llama3 dict without its keys (naming ``what``).
    """
    theta = float(params.get("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, (("factor", float(params["factor"])),)
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        if missing:
            raise CheckpointError(f"config.json {what} lacks {missing}")
        return theta, tuple((k, params[k]) for k in keys)
    raise CheckpointError(f"config.json {what} rope_type {rope_type!r} is not supported (default, llama3, linear)")


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """``config.json`` dict (Qwen2, Llama, Qwen3 or Gemma 3 text; transformers v4 or v5 keys) →
    ``ModelConfig``.

    Reads ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` (v4) or ``rope_parameters``
    (v5; Gemma 3's per layer type); supports rope types ``default``, ``llama3`` and ``linear``.
    Gemma 3's layer types come from ``layer_types``, else from ``sliding_window_pattern`` (every
    pattern-th layer global, HF's default 6).

    Raises:
      CheckpointError: naming the field for an unsupported model_type, activation, rope type,
        sliding window, attention soft-cap, or attention/MLP bias layout.
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCH:
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported ({_SUPPORTED})")
    family = _FAMILY[model_type]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or family["hidden_act"]
    if act != family["hidden_act"]:
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported for {model_type} "
                              f"({family['hidden_act']})")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
        raise CheckpointError("config.json use_sliding_window=true is not supported")
    if model_type != "qwen2" and (hf.get("attention_bias", False) or hf.get("mlp_bias", False)):
        raise CheckpointError(f"config.json attention_bias / mlp_bias = true is not supported for {model_type}")
    if hf.get("attn_logit_softcapping") is not None:
        raise CheckpointError("config.json attn_logit_softcapping is not supported (null)")
    if hf.get("use_bidirectional_attention", False):
        raise CheckpointError("config.json use_bidirectional_attention=true is not supported")
    rope = dict(hf.get("rope_parameters") or {})
    gemma = model_type == "gemma3_text"
    if gemma and ("full_attention" in rope or "sliding_attention" in rope):
        theta, scaling = _rope(rope.get("full_attention") or {}, 1000000.0, "rope_parameters.full_attention")
        local_theta, _ = _rope({**(rope.get("sliding_attention") or {}), "rope_type": "default"}, 10000.0,
                               "rope_parameters.sliding_attention")
    else:
        theta, scaling = _rope({**rope, **(hf.get("rope_scaling") or {})},
                               hf.get("rope_theta", 1000000.0 if gemma else 10000.0), "rope_scaling")
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    extra: dict[str, Any] = {}
    if gemma:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = hf.get("layer_types") or gemma3_layer_types(layers, pattern)
        extra = dict(query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                     sliding_window=int(hf.get("sliding_window", 4096)), layer_types=tuple(types),
                     rope_local_base_freq=local_theta, final_logit_softcapping=hf.get("final_logit_softcapping"))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        rope_scaling=scaling,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
        param_dtype=param_dtype,
        **{k: v for k, v in family.items()},
        **extra,
    )


def model_type_of(cfg: ModelConfig) -> str:
    """The ``config.json`` ``model_type`` whose layout ``cfg`` has: ``gemma3_text`` with post
    norms, ``qwen3`` with q/k norms, ``qwen2`` with q/k/v biases, else ``llama``."""
    return ("gemma3_text" if cfg.post_norms else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias
            else "llama")


def config_to_hf(cfg: ModelConfig, model_type: str | None = None, extra: dict[str, Any] | None = None) -> dict:
    """``ModelConfig`` → ``config.json`` dict (transformers v4 keys, also read by v5).

    Args:
      cfg: the model config.
      model_type: ``"qwen2"``, ``"llama"``, ``"qwen3"`` or ``"gemma3_text"``; default
        ``model_type_of(cfg)``.
      extra: keys merged last (e.g. ``bos_token_id``, ``eos_token_id``, ``max_position_embeddings``).

    Raises:
      CheckpointError: if the family cannot express the config (the fields of ``_FAMILY``: Qwen2
        always has q/k/v biases, Llama's ``attention_bias`` would also add an o_proj bias we do
        not have, ...; sliding windows and soft-caps only in Gemma 3).
    """
    model_type = model_type or model_type_of(cfg)
    if model_type not in _ARCH:
        raise CheckpointError(f"model_type {model_type!r} is not supported ({_SUPPORTED})")
    for field, want in _FAMILY[model_type].items():
        if getattr(cfg, field) != want:
            raise CheckpointError(f"{field}={getattr(cfg, field)!r} cannot be exported as model_type {model_type!r}")
    gemma = model_type == "gemma3_text"
    if not gemma and (cfg.has_local_layers or cfg.final_logit_softcapping is not None
                      or cfg.query_pre_attn_scalar not in (None, cfg.head_dim)):
        raise CheckpointError(f"sliding-window layers, logit soft-caps and query_pre_attn_scalar cannot be "
                              f"exported as model_type {model_type!r}")
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "linear" if len(cfg.rope_scaling) == 1 else "llama3", **dict(cfg.rope_scaling)}
    out = {
        "architectures": [_ARCH[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.initializer_range,
        "torch_dtype": cfg.param_dtype,
        "max_position_embeddings": {"qwen2": 32768, "qwen3": 40960}.get(model_type, 131072),
    }
    if model_type in ("llama", "qwen3", "gemma3_text"):
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False)
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False)
    if gemma:
        del out["hidden_act"]
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # HF's field is an int
        out.update(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
                   sliding_window=cfg.sliding_window or 4096, layer_types=_layer_type_names(cfg),
                   rope_local_base_freq=cfg.rope_local_base_freq or cfg.rope_theta,
                   final_logit_softcapping=cfg.final_logit_softcapping, attn_logit_softcapping=None)
    out.update(extra or {})
    return out


def _layer_type_names(cfg: ModelConfig) -> list[str]:
    return ["sliding_attention" if loc else "full_attention" for loc in cfg.local_layers]
