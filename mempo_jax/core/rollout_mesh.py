"""The rollout's host-local mesh, and the once-per-step weight sync from the training mesh onto it.

Rollout is parallel over questions: each process samples its own share of a step's questions on a
mesh of its own devices, so no program of the rollout spans processes (no collective inside the
decode loop, no process waits for another's longest episode). Only the update, the scoring and
the log-probs run on the global training mesh. Once per step the policy's parameters go from the
training layout to this host's rollout layout: one all-gather over the training mesh (every
device then holds the whole model), after which this process's copies become a mesh-local array
placed by the rollout mesh's rules. Same split as verl's hybrid engine (FSDP training weights
resharded into the inference layout each step) and tunix (rollout on its own mesh, weights synced).

The rollout mesh is ``(data, 1, tensor)`` over the training mesh's devices of this process:
``tensor`` devices split the heads (and the KV cache's kv heads), ``data`` splits the cache slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mempo_jax.core.sharding import make_mesh


def rollout_mesh(mesh: Mesh, num_heads: int, num_kv_heads: int, tensor: int = 0) -> Mesh:
    """The ``(data, 1, tensor)`` rollout mesh over ``mesh``'s devices on this process.

    Args:
      mesh: the training mesh (may span processes).
      num_heads, num_kv_heads: the model's attention heads (tensor must divide both).
      tensor: devices per model copy (``MeshConfig.rollout_tensor``); 0: the most devices of this
        host that divide both head counts (all of them where the heads divide), the rest on ``data``.

    Raises:
      ValueError: one line naming ``MeshConfig.rollout_tensor`` when it does not divide this
        host's devices or the heads.
    """
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    n = len(devices)
    if tensor == 0:
        tensor = max(t for t in range(1, n + 1) if n % t == 0 and num_heads % t == 0 and num_kv_heads % t == 0)
    elif n % tensor or num_heads % tensor or num_kv_heads % tensor:
        raise ValueError(f"MeshConfig.rollout_tensor = {tensor} must divide this host's {n} devices and the model's "
                         f"{num_heads} heads / {num_kv_heads} kv heads")
    return make_mesh(n // tensor, 1, tensor, devices=devices)


def check_fits(param_bytes: int, cache_bytes: int, mesh: Mesh) -> None:
    """Refuse a rollout mesh whose devices cannot hold their share of the model and KV cache.

    Args:
      param_bytes: bytes of the whole model in the rollout's parameter dtype.
      cache_bytes: bytes of the whole rollout KV cache.
      mesh: the rollout mesh (``rollout_mesh``).

    Raises:
      ValueError: one line naming ``MeshConfig.rollout_tensor`` and the bytes, when a device
        reports a memory limit (``memory_stats()['bytes_limit']``; CPU devices report none) below
        its share (the model over ``tensor``, the cache over every device of the mesh).
    """
    device = mesh.devices.flat[0]
    stats = device.memory_stats()  # None on CPU
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return
    need = param_bytes / mesh.shape["tensor"] + cache_bytes / mesh.devices.size
    if need > limit:
        raise ValueError(f"the model does not fit one host's devices for rollout: {need / 2**30:.1f} GiB per device "
                         f"on the rollout mesh {dict(mesh.shape)}, {limit / 2**30:.1f} GiB available; bind a larger "
                         f"MeshConfig.rollout_tensor or fewer RolloutConfig.num_slots")


@functools.lru_cache(maxsize=8)
def _gather(mesh: Mesh):
    """Jitted identity with every output replicated on ``mesh`` (the all-gather of the weight sync)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


def cast_floating(params, dtype):
    """``params`` with every floating leaf not already ``dtype`` cast to it (integer leaves and
    ``dtype=None`` leave them as they are). Jitted where the leaves live, so a parameter sharded
    over several processes is cast in place of its shards."""
    if dtype is None:
        return params
    return _caster(jnp.dtype(dtype))(params)


@functools.lru_cache(maxsize=4)
def _caster(dtype):
    """Jitted ``cast_floating`` to ``dtype`` (outputs keep their inputs' shardings)."""
    return jax.jit(lambda tree: jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x, tree))


def weight_sync(params, shardings, dtype=None):
    """``params`` (any placement, possibly on a mesh spanning processes) placed by ``shardings``
    (a pytree of ``NamedSharding`` on one host-local rollout mesh), cast to ``dtype`` first
    (``cast_floating``; ``None``: as they are), so a bfloat16 rollout copy gathers half the bytes.

    One process: ``jax.device_put`` (no copy where a parameter already sits so). Several processes:
    one all-gather of every parameter over its training mesh (a collective: every process calls
    it, once per step), this process's replicated copies assembled into rollout-mesh arrays (no
    copy), then ``jax.device_put`` onto ``shardings`` (host-local slices).

    Returns:
      The parameters as arrays of the rollout mesh (fully addressable by this process).
    """
    params = cast_floating(params, dtype)
    leaves = jax.tree.leaves(params)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_put(params, shardings)
    full = _gather(leaves[0].sharding.mesh)(params)
    local = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())
    on_host = set(local.mesh.devices.flat)

    def mine(x):
        shards = [s.data for s in x.addressable_shards if s.device in on_host]
        return jax.make_array_from_single_device_arrays(x.shape, local, shards)

    return jax.device_put(jax.tree.map(mine, full), shardings)


__all__ = ["cast_floating", "check_fits", "rollout_mesh", "weight_sync"]
