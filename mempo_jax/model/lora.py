"""LoRA adapters on the decoder's projections: parameters, forward term, training split, merge.

An adapted weight ``W`` (ours: input axes first, e.g. ``q [embed, heads, head_dim]``, ``o [heads,
head_dim, embed]``) gets ``A [*in_axes, r]`` and ``B [r, *out_axes]`` (``nnx.LoRAParam``, named
``{w}_lora_a`` / ``{w}_lora_b`` as qwix names them) and the projection becomes

    y = x · W + (alpha / r) · (x · A) · B

(Hu et al. 2021, "LoRA", eq. 3; PEFT's ``Linear.forward`` with ``scaling = lora_alpha / r``).
``B`` starts at zero, so an adapted model starts as its base, exactly; ``A`` starts as PEFT's
``kaiming_uniform_(a=sqrt(5))``: uniform in ``±1 / sqrt(fan_in)``. The adapters live in the
modules themselves (``ModelConfig.lora_rank`` / ``lora_targets``), so every call that runs a
projection applies them, and
``abstract_model`` / ``param_shardings`` / checkpoints see them as ordinary parameters.

Training: the trainable part of a parameter state is its ``nnx.LoRAParam`` leaves when it has any
(``split_trainable``), else all of it; the frozen base is never donated, differentiated or given
optimizer state, and the reference policy shares it (``reference_params``).

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
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from mempo_jax.core.validation import check
from mempo_jax.model.config import LORA_TARGETS, ModelConfig
from mempo_jax.model.init_keys import InitKeys

ADAPTER_DTYPE = jnp.float32  # adapters and their optimizer state stay float32 whatever the base dtype
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning of the policy (gin: ``LoraConfig.rank = 16`` etc.).

    Attributes:
      rank: adapter rank r; 0 (default) trains every parameter instead.
      alpha: scaling numerator: adapters add ``(alpha / rank) · x A B`` (PEFT ``lora_alpha``).
      target_modules: Hugging Face module names that get adapters (PEFT ``target_modules``),
        any of ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``; default all.
      base_dtype: dtype name the frozen base weights are held in (e.g. ``"bfloat16"``: one
        half-size copy); "" keeps the model's ``param_dtype``. Adapters are float32.

    Raises:
      ValueError: from ``__post_init__`` naming the field out of range.
    """

    rank: int = 0
    alpha: float = 16.0
    target_modules: tuple = tuple(LORA_TARGETS)
    base_dtype: str = ""

    def __post_init__(self):
        check(self, "rank", int, lo=0)
        check(self, "alpha", float, gt=0.0)
        check(self, "base_dtype", str)
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown or (self.rank and not targets):
            raise ValueError(f"LoraConfig.target_modules must name modules of {list(LORA_TARGETS)}, got "
                             f"{list(targets)}")
        object.__setattr__(self, "target_modules", targets)
        if self.base_dtype:
            try:
                jnp.dtype(self.base_dtype)
            except TypeError:
                raise ValueError(f"LoraConfig.base_dtype is not a dtype name: {self.base_dtype!r}") from None

    @property
    def enabled(self) -> bool:
        """True when adapters are trained (``rank > 0``)."""
        return self.rank > 0

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        """``model_cfg`` with these adapters (and ``base_dtype`` as its ``param_dtype``)."""
        if not self.enabled:
            return model_cfg
        return model_cfg.replace(lora_rank=self.rank, lora_alpha=float(self.alpha), lora_targets=self.target_modules,
                                 param_dtype=self.base_dtype or model_cfg.param_dtype)


# ------------------------------------------------------------------------------- the modules' half


def lora_key(rngs: InitKeys) -> jax.Array:
    """The key of the next adapter init: the ``lora`` stream when ``rngs`` has one (``create_model``
    gives it one, so the base weights are drawn as without adapters), else ``params``."""
    return rngs.lora() if "lora" in rngs else rngs.params()


def adapter_params(rngs: InitKeys, shape: tuple[int, ...], axes: tuple, n_in: int, rank: int) -> tuple:
    """``(A, B)`` ``nnx.LoRAParam``s for a weight of ``shape`` whose first ``n_in`` axes are its input.

    ``A [*shape[:n_in], rank]`` uniform in ``±1 / sqrt(prod(shape[:n_in]))``, logical axes
    ``axes[:n_in] + (None,)``; ``B [rank, *shape[n_in:]]`` zeros, axes ``(None,) + axes[n_in:]``;
    both ``ADAPTER_DTYPE``.
    """
    in_shape, out_shape = tuple(shape[:n_in]), tuple(shape[n_in:])
    bound = 1.0 / np.sqrt(float(np.prod(in_shape)))
    a = jax.random.uniform(lora_key(rngs), in_shape + (rank,), ADAPTER_DTYPE, -bound, bound)
    b = jnp.zeros((rank,) + out_shape, ADAPTER_DTYPE)
    return (nnx.LoRAParam(a, out_sharding=tuple(axes[:n_in]) + (None,), eager_sharding=False),
            nnx.LoRAParam(b, out_sharding=(None,) + tuple(axes[n_in:]), eager_sharding=False))


def lora_delta(x: Float[Array, "..."], a: Float[Array, "... rank"], b: Float[Array, "rank ..."], n_in: int,
               scale: float) -> Float[Array, "..."]:
    """``scale · (x · A) · B`` in ``x.dtype``.

    Args:
      x: ``[..., *in_axes]`` activations (the last ``n_in`` axes are contracted).
      a: ``[*in_axes, r]``.
      b: ``[r, *out_axes]``.
      n_in: number of input axes.
      scale: ``alpha / r``.

    Returns:
      ``[..., *out_axes]``.
    """
    dt = x.dtype
    h = jnp.tensordot(x, a.astype(dt), axes=n_in)
    return jnp.tensordot(h, b.astype(dt), axes=1) * jnp.asarray(scale, dt)


# ---------------------------------------------------------------------------- parameter states


def has_adapters(params) -> bool:
    """True when the parameter state holds ``nnx.LoRAParam`` leaves."""
    return any(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split_trainable(params):
    """``(trainable, frozen)`` of a parameter state (or of a tree of the same structure, e.g.
    its shardings): the ``nnx.LoRAParam`` leaves and the rest when it has adapters, else
    ``(params, None)``. Inverse: ``join``."""
    if not has_adapters(params):
        return params, None
    return nnx.split_state(params, nnx.LoRAParam, ...)


def join(trainable, frozen):
    """The parameter state of ``split_trainable``'s two parts."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def trainable_part(params):
    """What is optimized and checkpointed: the adapters, or every parameter without any."""
    return split_trainable(params)[0]


def with_trainable(params, trainable):
    """``params`` with its trainable part replaced by ``trainable`` (a restored checkpoint's)."""
    return join(trainable, split_trainable(params)[1])


def reference_params(params, copy=lambda x: x.copy()):
    """The frozen reference policy of ``params``: ``copy`` of each trainable array (default an
    exact copy), and with adapters the same base arrays (shared, not copied: the base is never
    donated or updated)."""
    trainable, frozen = split_trainable(params)
    return join(jax.tree.map(copy, trainable), frozen)


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
    from mempo_jax.core import sharding
    from mempo_jax.model.forward import abstract_model, create_model, split_model

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


# ------------------------------------------------------------------------------------ PEFT folder

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


__all__ = ["LoraConfig", "add_adapters", "adapter_params", "base_config", "has_adapters", "join", "lora_delta",
           "merge_adapters", "peft_state_dict", "reference_params", "save_peft_adapter", "split_trainable",
           "trainable_part", "with_trainable"]
