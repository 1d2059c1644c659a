"""LoRA adapters on the decoder's projections: their config, parameters, forward term and training split.

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

Whole-model operations (adding adapters to a base model, merging them, the PEFT export) are
``model.adapters``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from mempo_jax.core.validation import check
from mempo_jax.model.config import LORA_TARGETS, ModelConfig
from mempo_jax.model.init_keys import InitKeys

ADAPTER_DTYPE = jnp.float32  # adapters and their optimizer state stay float32 whatever the base dtype


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


__all__ = ["ADAPTER_DTYPE", "LoraConfig", "adapter_params", "has_adapters", "join", "lora_delta", "reference_params",
           "split_trainable", "trainable_part", "with_trainable"]
