"""Whole-model LoRA operations: fresh adapters on a base model, the merge, the PEFT export.

The adapters themselves (their config, parameters, forward term and training split) are
``model.lora``; these build on the model (``model.forward``).

Layout in Hugging Face / PEFT terms (``peft_state_dict``): ``lora_A.weight [r, in_features] =
A.reshape(in, r).T`` and ``lora_B.weight [out_features, r] = B.reshape(r, out).T`` with the
``in`` / ``out`` axes flattened in our order, which is the HF order (``hf_io``: ``q_proj.weight
[heads·head_dim, embed]`` is ``q.reshape(embed, -1).T``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import numpy as np
from flax import nnx
from jaxtyping import Float

from mempo_jax.core import sharding
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import abstract_model, create_model, split_model
from mempo_jax.model.lora import LoraConfig, join, split_trainable

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def add_adapters(model_cfg: ModelConfig, params, lora: LoraConfig, seed: int, *, mesh=None, rules=None):
    """A base model's parameter state with fresh adapters added.

    Args:
      model_cfg: the base model's config (no adapters).
      params: its parameter state (any placement and dtype).
      lora: the adapters (``lora.enabled``); ``base_dtype`` casts the base.
      seed: the adapters' init seed (``create_model(..., seed)``'s ``lora`` stream).
      mesh, rules: placement (``sharding.param_shardings``; default the local mesh).

    Returns:
      ``(model_cfg, graphdef, params)`` of the adapted model, placed on ``mesh``.
    """
    mesh, rules = sharding.mesh_or_local(mesh), rules or sharding.DEFAULT_RULES
    cfg = lora.model_config(model_cfg)
    graphdef, abstract = split_model(abstract_model(cfg))
    shardings = sharding.param_shardings(abstract, mesh, rules)
    lora_shardings = split_trainable(shardings)[0]
    # Only the adapter leaves are outputs: XLA drops the base weights' random init.
    adapters = jax.jit(lambda: split_trainable(split_model(create_model(cfg, seed))[1])[0],
                       out_shardings=lora_shardings)()
    dtype = cfg.weight_dtype
    base = jax.tree.map(lambda v: v.replace(v.get_value().astype(dtype)), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
    base = jax.device_put(base, split_trainable(shardings)[1])
    return cfg, graphdef, join(adapters, base)


def base_config(model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` without adapters (its LoRA fields at their defaults)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")}
    return model_cfg.replace(**defaults)


def _flat(params) -> dict[tuple, nnx.Variable]:
    return {tuple(getattr(k, "key", k) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}


def adapter_weights(model_cfg: ModelConfig, params):
    """Every adapted weight: yields ``(layer, module, weight, A [in, r], B [r, out])`` as float32
    numpy arrays (in / out axes flattened), in layer order then ``LORA_TARGETS`` order (the
    decoder stores the layers stacked: layer i is index i of each ``[layers, …]`` adapter)."""
    flat = _flat(params)
    stacked = {(module, w): tuple(np.asarray(jax.device_get(flat[("layers", module, f"{w}_lora_{ab}")].get_value()),
                                             np.float32) for ab in "ab")
               for module in ("attn", "mlp") for w in model_cfg.lora_weights(module)}
    for i in range(model_cfg.num_layers):
        for (module, w), (a, b) in stacked.items():
            yield i, module, w, a[i].reshape(-1, a.shape[-1]), b[i].reshape(b.shape[1], -1)


def merge_adapters(model_cfg: ModelConfig, params):
    """The base model with every adapter folded in: ``W + (alpha / r) · A B``, computed in
    float32 and stored in the base's dtype.

    Returns:
      ``(base_config(model_cfg), params without adapters)`` (numpy-backed where merged).
    """
    trainable, frozen = split_trainable(params)
    if frozen is None:
        return model_cfg, params
    scale = np.float32(model_cfg.lora_alpha / model_cfg.lora_rank)
    flat = _flat(frozen)
    merged = {}
    for i, module, w, a, b in adapter_weights(model_cfg, params):
        key = ("layers", module, w)
        if key not in merged:
            merged[key] = np.asarray(jax.device_get(flat[key].get_value())).astype(np.float32)
        merged[key][i] += ((a @ b) * scale).reshape(merged[key].shape[1:])
    for key, value in merged.items():
        flat[key] = flat[key].replace(value.astype(flat[key].get_value().dtype))
    out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(frozen, is_leaf=lambda x: isinstance(x, nnx.Variable)),
                                       [flat[k] for k in _flat(frozen)])
    return base_config(model_cfg), out


_HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def peft_state_dict(model_cfg: ModelConfig, params) -> dict[str, Float[np.ndarray, "_ _"]]:
    """The adapters under PEFT's saved key names: ``base_model.model.model.layers.{i}.{module}.
    lora_A.weight [r, in]`` and ``.lora_B.weight [out, r]`` (float32)."""
    out = {}
    for i, _, w, a, b in adapter_weights(model_cfg, params):
        key = f"base_model.model.model.layers.{i}.{_HF_MODULE[w]}"
        out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.T)
        out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return out


def save_peft_adapter(folder: str | os.PathLike, model_cfg: ModelConfig, params, base_model: str = "") -> list[str]:
    """Write a PEFT LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base checkpoint.

    Only process 0 writes (every process calls: the adapters are gathered).

    Args:
      folder: output folder (created).
      model_cfg: the adapted model's config (``lora_rank > 0``).
      params: its parameter state.
      base_model: the base checkpoint (``base_model_name_or_path``).

    Returns:
      The file names written.

    Raises:
      ValueError: the model has no adapters.
    """
    from safetensors.numpy import save_file

    if not model_cfg.lora_rank:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (ModelConfig.lora_rank = 0)")
    tensors = peft_state_dict(model_cfg, params)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
              "r": model_cfg.lora_rank, "lora_alpha": model_cfg.lora_alpha, "lora_dropout": 0.0,
              "target_modules": list(model_cfg.lora_targets), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None}
    if jax.process_index() != 0:
        return []
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    return [PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE]


__all__ = ["PEFT_CONFIG_FILE", "PEFT_WEIGHTS_FILE", "add_adapters", "adapter_weights", "base_config", "merge_adapters",
           "peft_state_dict", "save_peft_adapter"]
