"""``python -m mempo_jax.commands.plan --gin_file=CONFIG [--gin_param B] [--json] [--xla] [--aot
[--topology NAME] [--program NAME]]`` (``mempo-plan``): the memory plan of a recipe on its TPU slice
(``mempo_jax.run.memory_plan``), and the TPU compiler's own figures.

Prints the plan per device and the rollout mesh's (``--json``: both as JSON, in bytes); ``--xla``
also compiles the update, log-prob and scoring programs with abstract parameters on this process's
devices and prints XLA's ``memory_analysis()`` beside the plan's figure. ``--aot`` compiles every
program of a run (``memory_plan.phase_programs``) with the TPU compiler for the recipe's slice
(``TPUConfig.accelerator_type`` → its topology, ``--topology`` to name another), on any host
(``run.aot``; needs libtpu: ``pip install 'mempo-jax[tpu]'``), and prints one row per program:
``memory_analysis()`` per chip, the plan's figure and ratio, the HBM headroom, ``cost_analysis()``
FLOPs and bytes, the attention that ran (a Pallas kernel or XLA) and compile seconds (``--json``:
``{"topology", "programs": [{"name", "compiled", "tpu_bytes", "plan_bytes", "attention", "flops",
"compile_s", ...}]}``).

Exit status: 0 when the plan fits (with ``--aot``: every program compiles and fits the chip's
HBM), 1 when its peak exceeds ``PlanConfig.hbm_fraction`` of the chip's HBM (with ``--aot``: a
program the compiler says does not fit or cannot compile: one ``error:`` line naming it, the
bytes over and the knob to turn), 2 on a config error (one ``error:`` line; libtpu missing too).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from mempo_jax import config_loader
from mempo_jax.commands.cli import command_name
from mempo_jax.core import mesh_config
from mempo_jax.recipes import gin_file_help
from mempo_jax.run.memory_plan import (build_plan, fit_error, format_plan, format_rollout_plan,
                                       format_xla_comparison, plan_dict, rollout_plan, xla_phases)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.plan"), description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=[], help=gin_file_help(None))
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. TPUConfig.accelerator_type=\"v5p-128\"")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of the table")
    p.add_argument("--xla", action="store_true",
                   help="also compile the update, log-prob and scoring programs with abstract parameters on this "
                        "process's devices (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N) and print XLA's "
                        "memory_analysis() per device beside the plan's figure")
    p.add_argument("--aot", action="store_true",
                   help="compile every program of the run with the TPU compiler for the recipe's slice (needs libtpu) "
                        "and print its memory_analysis() / cost_analysis() per program beside the plan")
    p.add_argument("--topology", default=None,
                   help="with --aot: the TPU topology to compile for (e.g. v5e:2x2, v5p:2x2x1; default: "
                        "TPUConfig.accelerator_type's)")
    p.add_argument("--program", action="append", default=[],
                   help="with --aot: compile only this program (repeatable; update, sft, logprobs, scoring, prefill, "
                        "decode, eval_prefill, eval_decode)")
    return p.parse_args(argv)


def _error(e: BaseException) -> str:
    msg = (e.args[0] if e.args and isinstance(e.args[0], str) else str(e)).strip()
    return f"error: {msg.splitlines()[0] if msg else repr(e)}"


def _aot(args, cfg, pod) -> int:
    """``--aot``: the TPU compiler's report; exit status as the module says."""
    from mempo_jax.run import aot

    problem = aot.libtpu_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        report = aot.aot_report(cfg, pod, args.topology, args.program)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        print(_error(e), file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else aot.format_report(report))
    error = aot.fit_error(report)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the plan; returns 0 when it fits, 1 when it does not, 2 on a config error."""
    args = _parse_args(argv)
    try:
        mesh_config.register()
        cfg = config_loader.load_config(args.gin_file, args.gin_param)
        pod = mesh_config.from_gin()
        plan = build_plan(cfg, pod.mesh, pod.tpu, pod.plan)
        rollout = rollout_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    except (ValueError, TypeError, KeyError) as e:
        print(_error(e), file=sys.stderr)
        return 2
    if args.aot:
        if not args.json:
            print(format_plan(plan, ", ".join(args.gin_file)) + "\n" + format_rollout_plan(rollout))
        return _aot(args, cfg, pod)
    if args.json:
        print(json.dumps({**plan_dict(plan), "rollout": rollout}, indent=1))
    else:
        print(format_plan(plan, ", ".join(args.gin_file)) + "\n" + format_rollout_plan(rollout))
    if args.xla:
        print(format_xla_comparison(xla_phases(cfg, pod.mesh, pod.tpu, pod.plan), plan))
    if not plan.fits:
        print(f"error: {fit_error(plan)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
