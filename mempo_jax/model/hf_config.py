"""Hugging Face ``config.json`` ⇄ ``ModelConfig`` for Qwen2 and Llama checkpoints.

Source: ``Qwen2Config`` / ``LlamaConfig`` in transformers (v4 keys ``rope_theta`` /
``rope_scaling``; v5 key ``rope_parameters``).
"""

from __future__ import annotations

from typing import Any

from mempo_jax.model.config import ModelConfig

_ARCH = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: unknown, missing or mis-shaped keys, bad config."""


# ------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """``config.json`` dict (Qwen2 or Llama, transformers v4 or v5 keys) → ``ModelConfig``.

    Reads ``rope_theta`` / ``rope_scaling`` (v4) or ``rope_parameters`` (v5); supports rope types
    ``default`` and ``llama3``.

    Raises:
      CheckpointError: naming the field for an unsupported model_type, activation, rope type,
        sliding window, or attention/MLP bias layout.
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCH:
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported (qwen2, llama)")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if model_type == "qwen2" and hf.get("use_sliding_window", False):
        raise CheckpointError("config.json use_sliding_window=true is not supported")
    if model_type == "llama" and (hf.get("attention_bias", False) or hf.get("mlp_bias", False)):
        raise CheckpointError("config.json attention_bias / mlp_bias = true is not supported for llama")
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        rope_scaling = None
    elif rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise CheckpointError(f"config.json rope_scaling lacks {missing}")
        rope_scaling = tuple((k, scaling[k]) for k in keys)
    else:
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported (default, llama3)")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def config_to_hf(cfg: ModelConfig, model_type: str | None = None, extra: dict[str, Any] | None = None) -> dict:
    """``ModelConfig`` → ``config.json`` dict (transformers v4 keys, also read by v5).

    Args:
      cfg: the model config.
      model_type: ``"qwen2"`` or ``"llama"``; default ``qwen2`` when ``cfg.qkv_bias`` else ``llama``.
      extra: keys merged last (e.g. ``bos_token_id``, ``eos_token_id``, ``max_position_embeddings``).

    Raises:
      CheckpointError: if the family cannot express the config (Qwen2 always has q/k/v biases,
        Llama's ``attention_bias`` would also add an o_proj bias we do not have).
    """
    model_type = model_type or ("qwen2" if cfg.qkv_bias else "llama")
    if model_type not in _ARCH:
        raise CheckpointError(f"model_type {model_type!r} is not supported (qwen2, llama)")
    if cfg.qkv_bias != (model_type == "qwen2"):
        raise CheckpointError(f"qkv_bias={cfg.qkv_bias} cannot be exported as model_type {model_type!r}")
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
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else {"rope_type": "llama3", **dict(cfg.rope_scaling)},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.initializer_range,
        "torch_dtype": cfg.param_dtype,
        "max_position_embeddings": 32768 if model_type == "qwen2" else 131072,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False)
    out.update(extra or {})
    return out
