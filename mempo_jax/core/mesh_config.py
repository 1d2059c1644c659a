"""Gin-bound settings of a sharded run: the device mesh, the TPU slice, the memory-plan sizes.

A pod recipe binds them next to the ``ExperimentConfig`` bindings, MaxText style::

    MeshConfig.data = 1
    MeshConfig.fsdp = -1          # all remaining devices
    MeshConfig.tensor = 4
    TPUConfig.accelerator_type = "v5p-64"
    TPUConfig.runtime_version = "v2-alpha-tpuv5"
    ExecutionConfig.micro_batch_rows = 32

``register()`` makes the three configurable (call it before ``config_loader.load_config``);
``from_gin()`` returns their bound values. The launch scripts read ``TPUConfig`` lines from the
same file, so the slice that is created is the one the plan was checked against.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import gin

from mempo_jax.core.sharding import DEFAULT_RULES, MESH_AXES, rule_axes
from mempo_jax.core.validation import check
from mempo_jax.core.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ``("data", "fsdp", "tensor")`` mesh and its logical-axis rules.

    Attributes:
      data, fsdp, tensor: axis sizes; exactly one may be ``-1`` ("all remaining devices").
      rules: ``(logical name, mesh axis | tuple of mesh axes | None)`` pairs
        (default ``mempo_jax.core.sharding.DEFAULT_RULES``: batch → data × fsdp, embed → fsdp,
        heads / kv_heads / mlp / vocab → tensor).
      rollout_tensor: devices per model copy on each host's rollout mesh
        (``mempo_jax.core.rollout_mesh``); 0: all of the host's devices where the heads divide.

    Raises:
      ValueError: for a size that is 0 or below -1, more than one -1, or a rule naming an
        unknown mesh axis.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES
    rollout_tensor: int = 0

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if any(not isinstance(s, int) or s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ValueError(f"MeshConfig sizes must be >= 1 with at most one -1, got data={self.data} "
                             f"fsdp={self.fsdp} tensor={self.tensor}")
        if not isinstance(self.rollout_tensor, int) or self.rollout_tensor < 0:
            raise ValueError(f"MeshConfig.rollout_tensor must be an int >= 0, got {self.rollout_tensor!r}")
        rules = tuple((str(name), _axes(target)) for name, target in self.rules)
        for name, target in rules:
            for axis in rule_axes(target):
                if axis not in MESH_AXES:
                    raise ValueError(f"MeshConfig.rules: {name!r} maps to unknown mesh axis {axis!r} "
                                     f"(axes: {MESH_AXES})")
        object.__setattr__(self, "rules", rules)

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` for ``num_devices`` devices, the ``-1`` axis filled in.

        Raises:
          ValueError: if the sizes do not multiply to ``num_devices``.
        """
        sizes = [self.data, self.fsdp, self.tensor]
        if -1 in sizes:
            rest = math.prod(s for s in sizes if s != -1)
            if num_devices % rest:
                raise ValueError(f"MeshConfig {tuple(sizes)}: {num_devices} devices do not divide by {rest}")
            sizes[sizes.index(-1)] = num_devices // rest
        if math.prod(sizes) != num_devices:
            raise ValueError(f"MeshConfig data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]} needs "
                             f"{math.prod(sizes)} devices, have {num_devices}")
        return tuple(sizes)

    def make(self, devices=None):
        """The ``jax.sharding.Mesh`` over ``devices`` (default all of ``jax.devices()``, every process).

        Raises:
          ValueError: as ``shape``.
        """
        import jax

        devices = list(jax.devices() if devices is None else devices)
        return make_mesh(*self.shape(len(devices)), devices=None if len(devices) == jax.device_count() else devices)

    def abstract(self, num_devices: int):
        """A device-less ``jax.sharding.AbstractMesh`` of the target shape (for ``eval_shape`` plans)."""
        from jax.sharding import AbstractMesh, AxisType

        return AbstractMesh(self.shape(num_devices), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _axes(target):
    if target is None or isinstance(target, str):
        return target
    return tuple(target)


class Chip(NamedTuple):
    """One TPU generation: HBM per chip (GiB, 2**30 bytes) and TensorCores counted per chip in
    the accelerator-type name (``v5p-64`` = 64 cores = 32 chips; v5e / v6e names count chips)."""

    name: str
    hbm_gib: float
    cores_per_chip: int


# Cloud TPU documentation, "TPU versions": v5e 16 GiB HBM2 per chip, v5p 95 GiB HBM2e per chip,
# v6e (Trillium) 32 GiB HBM per chip; one JAX device per chip.
CHIPS = {
    "v5e": Chip("v5e", 16.0, 1),
    "v5litepod": Chip("v5e", 16.0, 1),
    "v5p": Chip("v5p", 95.0, 2),
    "v6e": Chip("v6e", 32.0, 1),
}


@dataclasses.dataclass(frozen=True)
class TPUConfig:
    """The Cloud TPU slice a recipe runs on (read by ``launch/*.sh`` and ``mempo_jax.commands.plan``).

    Attributes:
      accelerator_type: gcloud ``--accelerator-type``: ``v5litepod-N`` (alias ``v5e-N``),
        ``v5p-N`` or ``v6e-N``.
      runtime_version: gcloud ``--version`` / ``--runtime-version`` (TPU VM software image).

    Raises:
      ValueError: for an accelerator type this project has no chip data for.
    """

    accelerator_type: str = "v5litepod-8"
    runtime_version: str = "v2-alpha-tpuv5-lite"

    def __post_init__(self):
        self.chip  # validates

    @property
    def chip(self) -> Chip:
        """The ``Chip`` of ``accelerator_type``."""
        m = re.fullmatch(r"(v5e|v5litepod|v5p|v6e)-(\d+)", self.accelerator_type)
        if not m:
            raise ValueError(f"TPUConfig.accelerator_type {self.accelerator_type!r} is not one of "
                             f"v5litepod-N / v5e-N / v5p-N / v6e-N")
        return CHIPS[m.group(1)]

    @property
    def num_devices(self) -> int:
        """JAX devices (chips) of the slice: the name's count divided by cores per chip."""
        count = int(self.accelerator_type.rsplit("-", 1)[1])
        return max(1, count // self.chip.cores_per_chip)

    @property
    def hbm_bytes(self) -> int:
        """HBM per device in bytes."""
        return int(self.chip.hbm_gib * 2**30)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The memory planner's own estimates (``python -m mempo_jax.commands.plan``); the sizes the run uses
    (micro-batch, log-prob and scoring chunk rows) are ``ExperimentConfig.execution``'s.

    Attributes:
      max_prompt_tokens: longest system prompt + question (tokens).
      max_answer_tokens: longest answer Z scored by the memory reward (tokens).
      hbm_fraction: share of HBM the plan may use (the rest is left to XLA and fragmentation).
    """

    max_prompt_tokens: int = 256
    max_answer_tokens: int = 32
    hbm_fraction: float = 0.9

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_answer_tokens"):
            check(self, name, int, lo=1)
        if not 0.0 < self.hbm_fraction <= 1.0:
            raise ValueError(f"PlanConfig.hbm_fraction must be in (0, 1], got {self.hbm_fraction}")


class PodSettings(NamedTuple):
    """What ``from_gin`` returns."""

    mesh: MeshConfig
    tpu: TPUConfig
    plan: PlanConfig


_CONFIGURABLES = (MeshConfig, TPUConfig, PlanConfig)
_registered = False


def register() -> None:
    """Make ``MeshConfig``, ``TPUConfig`` and ``PlanConfig`` gin-configurable (idempotent).

    Call before ``mempo_jax.config_loader.load_config`` parses a file that binds them (gin refuses new
    configurables once a parse has locked the config).
    """
    global _registered
    if not _registered:
        with gin.unlock_config():  # an earlier parse may have locked it
            for cls in _CONFIGURABLES:
                try:
                    gin.external_configurable(cls)
                except ValueError:  # already registered elsewhere (e.g. by config.py)
                    pass
        _registered = True


def from_gin() -> PodSettings:
    """The bound ``MeshConfig``, ``TPUConfig`` and ``PlanConfig`` (defaults where unbound).

    Raises:
      ValueError: as the dataclasses' validation (one line naming the field).
    """
    register()
    with gin.config_scope(None):
        return PodSettings(*(gin.get_configurable(cls)() for cls in _CONFIGURABLES))

