"""Device mesh and logical-axis sharding rules (MaxText style).

Parameters carry logical axis names (``vocab``, ``embed``, ``heads``, ...) as NNX
``out_sharding`` metadata; a rules table maps each logical name to mesh axes of a
``("data", "fsdp", "tensor")`` mesh. Source: AI-Hypercomputer/maxtext ``logical_axis_rules`` and
``flax.linen.partitioning.logical_to_mesh_axes``. A 1-device mesh is just the smallest mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from types import MappingProxyType
from typing import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("seq", None),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data: int, fsdp: int, tensor: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp", "tensor")`` mesh of ``data * fsdp * tensor`` devices (Auto axis types).

    Args:
      data, fsdp, tensor: axis sizes (>= 1).
      devices: devices to use (the first ``data * fsdp * tensor``); default ``jax.devices()``,
        laid out topology-aware by ``jax.make_mesh`` when all of them are used.

    Raises:
      ValueError: if a size is < 1 or there are too few devices.
    """
    shape = (data, fsdp, tensor)
    if any(int(n) < 1 for n in shape):
        raise ValueError(f"mesh axis sizes must be >= 1, got data={data} fsdp={fsdp} tensor={tensor}")
    need = math.prod(shape)
    available = list(jax.devices() if devices is None else devices)
    if len(available) < need:
        raise ValueError(f"mesh {shape} needs {need} devices, only {len(available)} available")
    auto = (AxisType.Auto,) * 3
    if devices is None and need == len(available):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(available[:need]).reshape(shape), MESH_AXES, axis_types=auto)


def rule_axes(target: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one rule's target: ``None`` → ``()``, ``"fsdp"`` → ``("fsdp",)``, a
    sequence → its tuple."""
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    mesh_shape: Mapping[str, int] = MappingProxyType({}),
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec`` of mesh axes.

    A mesh axis is used at most once (a later dimension that maps to an already used mesh axis
    is replicated). With ``shape``, mesh axes whose size (in ``mesh_shape``; an axis absent from it
    has size 1) does not divide the dimension are dropped (that dimension is replicated over them), so e.g. 2 kv heads on an
    8-way tensor axis stay replicated instead of failing.

    Args:
      logical_axes: one name (or None) per array dimension.
      rules: ``(logical name, mesh axis | tuple of mesh axes | None)`` pairs.
      mesh_shape: mesh axis name -> size (``Mesh.shape``), for the divisibility check.
      shape: the array's shape, or None for no divisibility check.

    Raises:
      ValueError: for a logical name absent from ``rules``, or a shape of the wrong rank.
    """
    table = dict(rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no sharding rule (known: {sorted(table)})")
        target = table[name]
        axes = rule_axes(target)
        kept = []
        for axis in axes:
            if axis in used:
                continue
            if shape is not None:
                size = math.prod(mesh_shape.get(a, 1) for a in kept + [axis])
                if shape[dim] % size != 0:
                    continue
            kept.append(axis)
        used.update(kept)
        spec.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return PartitionSpec(*spec)


def logical_to_sharding(
    logical_axes: Sequence[str | None],
    mesh: Mesh | AbstractMesh,
    rules: Rules = DEFAULT_RULES,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """``NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh.shape, shape))``.

    Raises:
      ValueError: as ``logical_to_spec``.
    """
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh.shape, shape))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(params: nnx.State, mesh: Mesh | AbstractMesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """Shardings of every parameter, from its NNX ``out_sharding`` logical-axis metadata.

    Args:
      params: ``nnx.State`` of ``nnx.Variable`` leaves (concrete arrays or ``ShapeDtypeStruct``
        from ``abstract_model``); a variable without metadata is replicated.
      mesh: the device mesh.
      rules: logical → mesh axis rules.

    Returns:
      The same ``nnx.State`` structure with a ``NamedSharding`` as each variable's value — a
      valid ``jax.device_put`` / ``jax.jit(out_shardings=...)`` tree for ``params``.

    Raises:
      ValueError: for a logical axis without a rule.
    """

    def one(var):
        axes = var.get_metadata().get("out_sharding")
        shape = var.get_value().shape
        if not axes:
            return var.replace(NamedSharding(mesh, PartitionSpec()))
        return var.replace(logical_to_sharding(axes, mesh, rules, shape))

    return jax.tree.map(one, params, is_leaf=_is_variable)


def shard_params(params: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``params`` placed on ``mesh`` by ``param_shardings`` (``jax.device_put``)."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh | AbstractMesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a ``[batch, seq, ...]`` array: batch over the ``batch`` rule's axes
    (data × fsdp by default), the rest replicated. The batch must divide by that product."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


# ------------------------------------------------------------ optimizer state, KV cache, helpers

def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """``NamedSharding(mesh, PartitionSpec())``: a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_shards(mesh: Mesh | AbstractMesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the ``batch`` rule splits rows on ``mesh`` (``data * fsdp`` by default).

    A batch whose row count divides by this number is sharded evenly; ``Learner`` and the
    samplers pad or check row counts against it.
    """
    spec = logical_to_spec(("batch",), rules)
    return int(math.prod(mesh.shape[a] for a in rule_axes(spec[0] if spec else None)))


def opt_state_shardings(optimizer, params, mesh: Mesh | AbstractMesh, rules: Rules = DEFAULT_RULES):
    """Shardings of ``optimizer.init(params)``: every per-parameter leaf (Adam ``mu``/``nu``, …)
    gets its parameter's sharding, every other leaf (step counts, schedule state) is replicated.

    Source: ``optax.tree_map_params`` (optimizer states mirror the parameter tree).

    Args:
      optimizer: an ``optax.GradientTransformation``.
      params: ``nnx.State`` of the parameters (arrays or ``ShapeDtypeStruct``).
      mesh: a ``Mesh`` or ``AbstractMesh``.
      rules: logical → mesh axis rules.

    Returns:
      A pytree with the structure of ``optimizer.init(params)`` whose leaves are ``NamedSharding``.
    """
    import optax

    shardings = param_shardings(params, mesh, rules)
    abstract = jax.eval_shape(optimizer.init, params)
    rep = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, shardings,
                                 transform_non_params=lambda _: rep,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def local_mesh() -> Mesh:
    """The smallest mesh: ``(1, 1, 1)`` over this process's first device (``jax.local_devices()[0]``).

    What every mesh-taking function of the package runs on when it is given no mesh: one device
    is not a separate code path, only the smallest mesh (the programs then declare one-device
    shardings; their values are those of plain ``jax.jit`` on that device).
    """
    return make_mesh(1, 1, 1, devices=jax.local_devices()[:1])


def mesh_or_local(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh:
    """``mesh``, or ``local_mesh()`` when it is ``None`` (the default of every mesh argument)."""
    return local_mesh() if mesh is None else mesh


# ---- activation sharding --------------------------------------------------------------------------
# The (mesh, rules) whose logical axes ``constrain`` pins activations to while a model function is
# traced (``activation_sharding``); ``None``: no constraint (one device, or a caller without a mesh).
_ACTIVATIONS: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("activations", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within the block, ``constrain`` pins arrays to ``logical_to_sharding(axes, mesh, rules)``.

    Enter it inside the function being traced (``model.forward.LogitsFn`` does, in each call), so a
    jitted program and the backward pass of a ``custom_vjp`` traced later see it too. Without it,
    or on a one-device mesh, ``constrain`` returns its input: XLA's sharding propagation alone
    places the activations, which on an fsdp mesh (parameters sharded on ``embed``) can choose to
    gather the rows of every attention output rather than the layer's weights.
    """
    token = _ACTIVATIONS.set(None if mesh is None else (mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def active_mesh() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` of the innermost ``activation_sharding`` block (a one-device mesh
    included), or ``None`` outside one: the mesh a model function is being traced for (its devices
    name the platform the program is compiled for, ``model.attention_kernels.resolve_impl``)."""
    return _ACTIVATIONS.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``x`` pinned to its logical axes under the active ``activation_sharding`` (the MaxText
    activation layout: rows over ``data`` and ``fsdp``, heads / mlp / vocab over ``tensor``, so
    fsdp gathers weights, not activations); ``x`` itself outside one.

    Args:
      x: an array (traced) with ``len(logical_axes)`` dimensions.
      logical_axes: one logical name (or None) per dimension, names of the rules.

    Raises:
      ValueError: as ``logical_to_spec`` (an unknown name, a rank mismatch).
    """
    active = _ACTIVATIONS.get()
    if active is None or active[0].size == 1:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh.shape,
                                                                                   x.shape)))
