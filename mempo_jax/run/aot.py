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

import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import time

from mempo_jax.run.memory_plan import _memory, build_plan, eval_slots, phase_programs, program_plan_bytes, rollout_plan

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


# The knob to turn per program when the compiler says it does not fit (the one-line error).
KNOBS = {
    "update": "ExecutionConfig.micro_batch_rows, ExecutionConfig.remat or MeshConfig (more fsdp / tensor)",
    "sft": "ExecutionConfig.sft_micro_batch_rows, ExecutionConfig.remat or MeshConfig",
    "logprobs": "ExecutionConfig.logprob_chunk_rows or RolloutConfig.max_context_tokens",
    "scoring": "ExecutionConfig.scoring_chunk_rows or RolloutConfig.max_context_tokens",
    "prefill": "RolloutConfig.num_slots, RolloutConfig.max_context_tokens or MeshConfig.rollout_tensor",
    "decode": "RolloutConfig.num_slots, RolloutConfig.max_context_tokens or MeshConfig.rollout_tensor",
    "eval_prefill": "EvalConfig.num_slots or RolloutConfig.max_context_tokens",
    "eval_decode": "EvalConfig.num_slots or RolloutConfig.max_context_tokens",
}
_OOM = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def uses_kernel(hlo_text: str) -> bool:
    """Whether a compiled TPU program calls a Pallas (Mosaic) kernel: a ``tpu_custom_call`` in its HLO."""
    return "tpu_custom_call" in hlo_text


def _cost(compiled) -> dict:
    """``cost_analysis()``'s ``flops`` and ``bytes accessed`` (the compiler's estimates per device)."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def compile_program(name: str, build, hbm_bytes: int) -> dict:
    """Lower (``build()``) and compile one program for the TPU; never raises for a compile error.

    Returns:
      ``{"name", "compiled", "compile_s"}`` and, compiled: ``"tpu_bytes"`` (per chip: the compiler's
      ``peak_memory_in_bytes``, the figure its out-of-HBM check compares with the HBM, or where a
      compiler reports no peak the sum below), ``"memory"`` (memory_analysis: arguments,
      temporaries, outputs, aliased and ``total`` = arguments + temporaries + outputs − aliased,
      which is above the peak where not every temporary is live with the arguments: the 7B update
      57.1 GiB against a 44.8 GiB peak), ``"peak_bytes"``, ``"attention"``
      (``"kernel"``: a Pallas kernel in the program, else ``"xla"``), ``"flops"``,
      ``"bytes_accessed"``; not compiled: ``"error"`` (the compiler's first line) and, when it ran
      out of HBM, ``"tpu_bytes"`` / ``"hbm_bytes"`` as the compiler names them.
    """

    import jax

    t = time.perf_counter()
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a compile-only executable cannot be loaded back
    try:
        compiled = build().compile()
    except Exception as e:  # the TPU compiler's errors (out of HBM / VMEM, a kernel it cannot lower)
        msg = " ".join(str(e).split())
        row = {"name": name, "compiled": False, "compile_s": round(time.perf_counter() - t, 2), "error": msg[:400]}
        m = _OOM.search(msg)
        if m:
            row["tpu_bytes"] = int(float(m.group(1)) * _UNIT[m.group(2)])
            row["hbm_bytes"] = int(float(m.group(3)) * _UNIT[m.group(4)])
        return row
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    mem = _memory(compiled)
    peak = getattr(compiled.memory_analysis(), "peak_memory_in_bytes", None) or None
    return {"name": name, "compiled": True, "compile_s": round(time.perf_counter() - t, 2),
            "tpu_bytes": peak or mem["total"],
            "memory": mem, "peak_bytes": peak, "attention": "kernel" if uses_kernel(compiled.as_text()) else "xla",
            **_cost(compiled), "hbm_bytes": hbm_bytes}


def aot_report(cfg, pod, topology: str | None = None, only=None) -> dict:
    """Every program of a run of ``cfg`` (``memory_plan.phase_programs``; ``only``: those names)
    compiled for its TPU slice (``pod.tpu``; ``topology`` overrides ``topology_name``), each beside
    the plan's figure.

    Returns:
      ``{"topology", "accelerator_type", "hbm_bytes", "programs": [compile_program row + "plan_bytes"]}``.

    Raises:
      RuntimeError: ``libtpu_problem``, or a topology libtpu cannot build.
      ValueError: as ``phase_programs`` (a mesh that does not match the slice).
    """

    topo = topology or topology_name(pod.tpu)
    devices = slice_devices(topo, pod.tpu.accelerator_type)
    plan = build_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    rollout = rollout_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    slots = eval_slots(cfg, pod.tpu)
    eval_rollout = None
    if slots:
        ro = dataclasses.replace(cfg.rl.rollout, num_slots=slots)
        eval_rollout = rollout_plan(dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, rollout=ro)),
                                    pod.mesh, pod.tpu, pod.plan)
    plans = program_plan_bytes(plan, rollout, eval_rollout)
    programs = phase_programs(cfg, pod.mesh, pod.tpu, pod.plan, devices)
    unknown = sorted(set(only or ()) - set(programs))
    if unknown:
        raise ValueError(f"--program {unknown[0]!r} is not a program of this run: {', '.join(programs)}")
    rows = []
    for name, build in programs.items():
        if only and name not in only:
            continue
        row = compile_program(name, build, pod.tpu.hbm_bytes)
        row["plan_bytes"] = plans.get(name)
        rows.append(row)
    return {"topology": topo, "accelerator_type": pod.tpu.accelerator_type, "chip": pod.tpu.chip.name,
            "hbm_bytes": pod.tpu.hbm_bytes, "programs": rows}


def fits(row: dict) -> bool:
    """A program compiled and its bytes per chip are within the chip's HBM."""
    return row["compiled"] and row["tpu_bytes"] <= row["hbm_bytes"]


def fit_error(report: dict) -> str | None:
    """The one-line error of the first program that did not compile or fit (its bytes over the HBM
    and the knob to turn), or ``None`` when every program fits."""
    for row in report["programs"]:
        if fits(row):
            continue
        name = row["name"]
        if "tpu_bytes" in row:
            over = row["tpu_bytes"] - row["hbm_bytes"]
            return (f"program '{name}' does not fit a {report['chip']} chip of {report['topology']}: "
                    f"{row['tpu_bytes'] / 2**30:.2f} GiB per chip, {over / 2**30:.2f} GiB over its "
                    f"{row['hbm_bytes'] / 2**30:.2f} GiB HBM; lower {KNOBS.get(name, 'its sizes')}")
        return f"program '{name}' does not compile for {report['topology']}: {row['error'][:300]}"
    return None


def format_report(report: dict) -> str:
    """``aot_report`` as a table: GiB per chip (memory_analysis' terms, their sum and the compiler's
    peak, ``tpu_bytes``), plan / peak ratio, headroom under the HBM, TFLOPs and GB accessed
    (``cost_analysis``: the compiler's estimates, each loop body counted once), attention, compile
    seconds."""
    gib = lambda n: f"{n / 2**30:7.2f}" if n is not None else "      -"  # noqa: E731
    lines = [f"TPU compiler ({report['topology']}, {report['accelerator_type']}: "
             f"{report['hbm_bytes'] / 2**30:.2f} GiB HBM per chip), GiB per chip:",
             f"  {'program':<13}{'args':>8}{'temps':>8}{'outs':>8}{'sum':>8}{'peak':>8}{'plan':>8}{'plan/tpu':>9}"
             f"{'headroom':>9}{'TFLOP':>9}{'GB acc.':>9}  {'attention':<9}{'compile s':>10}"]
    for row in report["programs"]:
        plan = row.get("plan_bytes")
        if not row["compiled"]:
            total = row.get("tpu_bytes")
            lines.append(f"  {row['name']:<13}{'':>32}{gib(total) if total else '      ?':>8}{gib(plan):>8}"
                         f"{'':>9}{'':>9}{'':>18}  {'FAILED':<9}{row['compile_s']:>10.1f}   {row['error'][:120]}")
            continue
        m = row["memory"]
        ratio = f"{plan / row['tpu_bytes']:9.2f}" if plan and row["tpu_bytes"] else f"{'-':>9}"
        lines.append(f"  {row['name']:<13}{gib(m['arguments']):>8}{gib(m['temporaries']):>8}{gib(m['outputs']):>8}"
                     f"{gib(m['total']):>8}{gib(row['tpu_bytes']):>8}{gib(plan):>8}{ratio}{gib(row['hbm_bytes'] - row['tpu_bytes']):>9}"
                     f"{row['flops'] / 1e12:9.2f}{row['bytes_accessed'] / 1e9:9.2f}  {row['attention']:<9}"
                     f"{row['compile_s']:>10.1f}")
    return "\n".join(lines)
