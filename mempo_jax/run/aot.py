"""Ahead-of-time compilation for a TPU slice on any host: the slice's compile-only devices.

``libtpu`` (``pip install 'mempo-jax[tpu]'``: the version JAX's own ``tpu`` extra pins) holds the
TPU compiler; ``jax.experimental.topologies.get_topology_desc`` builds a slice's devices from it
without any chip (MaxText's ``train_compile.py`` does the same), and ``jax.jit(...).lower(abstract
arguments).compile()`` on a mesh of them runs the real TPU compiler: ``memory_analysis()`` and
``cost_analysis()`` read back, and a program that does not fit the chip's HBM fails at
``compile()``.

``topology_name`` maps ``TPUConfig.accelerator_type`` to the topology (``v5p-8`` → ``v5p:2x2x1``),
``slice_devices`` builds it, ``libtpu_problem`` says why it cannot be built here (``None``: it can).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import os

INSTALL_HINT = "libtpu is not installed: pip install 'mempo-jax[tpu]'"

# Chips of a slice → its topology (Cloud TPU "TPU versions": v5e / v6e slices are 2-D tori of up to
# 16x16 chips, v5p slices 3-D of 4-chip hosts).
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8"}
_TOPOLOGY_CHIP = {"v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}


def topology_name(tpu) -> str:
    """The ``get_topology_desc`` name of a ``TPUConfig``'s slice: ``v5litepod-4`` → ``v5e:2x2``,
    ``v5p-8`` (4 chips) → ``v5p:2x2x1``, ``v5p-64`` → ``v5p:2x4x4``.

    Raises:
      ValueError: a chip count with no topology here (one line naming ``TPUConfig.accelerator_type``).
    """
    chip, n = tpu.chip.name, tpu.num_devices
    grid = (_GRIDS_3D if chip == "v5p" else _GRIDS_2D).get(n)
    if grid is None:
        raise ValueError(f"TPUConfig.accelerator_type={tpu.accelerator_type!r}: no {chip} topology of {n} chips "
                         f"(pass --topology)")
    return f"{_TOPOLOGY_CHIP[chip]}:{grid}"


def accelerator_of(topology: str) -> str:
    """The accelerator type of a topology name (``v5e:2x2`` → ``v5litepod-4``, ``v5p:2x2x1`` → ``v5p-8``)."""
    chip, grid = topology.split(":")
    chips = math.prod(int(n) for n in grid.split("x"))
    return {"v5e": f"v5litepod-{chips}", "v5p": f"v5p-{2 * chips}"}.get(chip, f"{chip}-{chips}")


def _pinned_libtpu() -> str | None:
    """The ``libtpu`` version spec of the installed JAX's ``tpu`` extra (``"==0.0.42.*"``), or None."""
    for req in importlib.metadata.requires("jax") or ():
        name, _, rest = req.partition(";")
        if name.strip().startswith("libtpu") and "tpu" in rest:
            return name.strip()[len("libtpu"):].strip()
    return None


def _matches(version: str, spec: str) -> bool:
    """``version`` against a ``==X`` / ``==X.*`` spec (anything else: True)."""
    if not spec.startswith("==") or "," in spec:
        return True
    want = spec[2:]
    return version.startswith(want[:-1]) if want.endswith(".*") else version == want


def libtpu_problem() -> str | None:
    """Why no TPU topology can be built here (one line), or ``None``: ``libtpu`` missing
    (``INSTALL_HINT``), or a version other than the one the installed JAX's ``tpu`` extra pins
    (its compiler is built for that JAX: another one may fail to load or lower)."""
    if importlib.util.find_spec("libtpu") is None:
        return INSTALL_HINT
    import jax

    have, spec = importlib.metadata.version("libtpu"), _pinned_libtpu()
    if spec and not _matches(have, spec):
        return (f"libtpu {have} is installed but jax {jax.__version__}'s tpu extra pins libtpu{spec}: "
                f"pip install 'jax[tpu]=={jax.__version__}'")
    return None


def _quiet_libtpu_env(accelerator_type: str) -> None:
    """Environment for loading libtpu as a compiler only, on a host without TPU chips: no
    ``/tmp/libtpu_lockfile`` (``ALLOW_MULTIPLE_LIBTPU_LOAD``: two processes may compile at once, and
    a run holding the lock does not stop it), and the slice and worker named so its start-up does
    not print that it could not find them. A host with TPU chips is left alone (there libtpu is
    the runtime too); variables already set win."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


@functools.lru_cache(maxsize=16)
def slice_devices(topology: str, accelerator_type: str = "") -> tuple:
    """The compile-only TPU devices of ``topology`` (``"v5e:2x2"``; ``v5e:1x1`` and ``v6e:1x1``
    with one chip per host), for meshes whose programs are lowered and compiled, never run.

    Raises:
      RuntimeError: ``libtpu_problem()``'s line, or the topology's error from libtpu.
    """
    problem = libtpu_problem()
    if problem:
        raise RuntimeError(problem)
    _quiet_libtpu_env(accelerator_type or accelerator_of(topology))
    from jax.experimental import topologies

    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if topology.endswith(":1x1") else {}
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                            **kwargs)
    except Exception as e:  # libtpu's own error types
        raise RuntimeError(f"TPU topology {topology!r}: {str(e).splitlines()[0]}") from e
    return tuple(desc.devices)
