"""The model's arrays on a device mesh: parameters created in their shardings, the KV cache's shardings.

The model side of ``mempo_jax.core.sharding`` (which knows meshes and logical-axis rules, not the
model): this module imports both, so ``sharding`` never imports ``model`` (no import cycle).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from mempo_jax.model.attention_mask import CACHE_AXES
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import KVCache
from mempo_jax.model.forward import abstract_model, create_model, split_model
from mempo_jax.core.sharding import DEFAULT_RULES, Rules, logical_to_sharding, param_shardings


def init_sharded_params(cfg: ModelConfig, seed: int, mesh: Mesh,
                        rules: Rules = DEFAULT_RULES) -> tuple[nnx.GraphDef, nnx.State]:
    """Initialise a ``Decoder`` with every parameter created directly in its sharding
    (one jitted init with ``out_shardings``; no full copy on one device).

    Args:
      cfg: ``ModelConfig``.
      seed: params RNG seed (the values of ``create_model(cfg, seed)`` up to float rounding).
      mesh, rules: the device mesh and its logical → mesh axis rules.

    Returns:
      ``(graphdef, params)`` as ``split_model``.
    """
    graphdef, abstract = split_model(abstract_model(cfg))
    shardings = param_shardings(abstract, mesh, rules)
    params = jax.jit(lambda: split_model(create_model(cfg, seed))[1], out_shardings=shardings)()
    return graphdef, params


def cache_shardings(cfg: ModelConfig, batch: int, size: int, mesh: Mesh | AbstractMesh, rules: Rules = DEFAULT_RULES) -> KVCache:
    """Shardings of ``init_cache(cfg, batch, size)``: ``KVCache`` of two ``NamedSharding``.

    Cache arrays are ``[layers, batch, kv_heads, size, head_dim]`` (heads-major) with logical axes
    ``CACHE_AXES``: rows over the ``batch`` rule (data × fsdp), kv heads over ``tensor`` when
    they divide (else replicated, as the ``k``/``v`` projections).
    """
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim)
    sharding = logical_to_sharding(CACHE_AXES, mesh, rules, shape)
    return KVCache(sharding, sharding)


def init_params(cfg: ModelConfig, seed: int, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> tuple[nnx.GraphDef, nnx.State]:
    """A fresh ``Decoder``'s ``(graphdef, params)`` on ``mesh``, placed by ``param_shardings``.

    On a one-device mesh the model is built by ``create_model`` (op by op, the values every run
    and test of this project has used) and put on the device; on a larger mesh every parameter
    is created in its shard (``init_sharded_params``: no full copy on one device; the same
    values up to float rounding, since XLA fuses the initialisers' arithmetic).
    """
    if mesh.devices.size > 1:
        return init_sharded_params(cfg, seed, mesh, rules)
    graphdef, params = split_model(create_model(cfg, seed))
    return graphdef, jax.device_put(params, param_shardings(params, mesh, rules))
