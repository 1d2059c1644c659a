"""``python -m mempo_jax.commands.train`` on a device mesh and on several processes.

* Every shipped recipe (``configs/*.gin``, the pod ones included) loads through the entry point's
  config path, and a mesh that does not fit the devices is a one-line error (exit status 2).
* The small run of ``benchmarks/chaos_resume.py`` (2 SFT steps, 1 RL step of 2 PPO updates, a 2-question
  evaluation) on a (data=2, fsdp=2, tensor=2) mesh of 8 CPU devices split over two processes
  joined by ``jax.distributed`` on 127.0.0.1 gives the metrics, rollouts, summary and final
  parameters of the same run on a (1,1,1) mesh in one process; only process 0 writes the logs.

The (2,2,2) run covers both the sharded single-program path (policy, reference, optimizer state,
KV cache, scoring and update batches placed by the mesh rules) and the multi-process one
(per-process questions and SFT rows, rollout with the cached engine on each process's own 4
devices, lockstep global programs for scoring and the update, writes by process 0 only), in one
compile. Cheaper XLA CPU passes halve the compile time; both runs use them.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import small_env, train_command  # noqa: E402

from conftest import FAST_XLA, SPM_CACHE, XLA_CACHE, free_port, one_device_flags  # noqa: E402  (the session's caches)
PARAMS = ("SFTConfig.steps=2", "RLConfig.steps=1", "EvalConfig.num_questions=2")
TIMEOUT_S = 420
# Absolute slack for values near zero (``actor/ppo_kl`` is ~1e-8 here and differs by rounding).
ABS_TOL = 1e-6


def _env(devices: int, **extra) -> dict:
    """The small run's environment on ``devices`` CPU devices (1: no emulated device count, the
    flags of every one-device trainer run of the session, whose programs the XLA cache holds)."""
    flags = one_device_flags() if devices == 1 else f"--xla_force_host_platform_device_count={devices} {FAST_XLA}"
    env = small_env(XLA_CACHE, XLA_FLAGS=flags, **extra)
    for k in ("MEMPO_COORDINATOR", "MEMPO_NUM_PROCESSES", "MEMPO_PROCESS_ID", "MEMPO_MULTIHOST"):
        env.pop(k, None)
    env.update(extra)
    return env


def _mesh(data, fsdp, tensor):
    return (f"MeshConfig.data={data}", f"MeshConfig.fsdp={fsdp}", f"MeshConfig.tensor={tensor}")


# ------------------------------------------------------------------------------ config path


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.gin")), ids=lambda p: p.name)
def test_every_shipped_config_loads_through_train(path):
    """``config_loader.load_run_config`` (the trainer's) parses each recipe; pod recipes (they bind ``MeshConfig``) ask for a
    mesh that fits their slice, the others run on one device as before."""
    from mempo_jax import config_loader

    rc = config_loader.load_run_config([str(path)])
    assert rc.experiment.rl.steps >= 0 and rc.experiment.execution.micro_batch_rows >= 1
    pod = "MeshConfig." in path.read_text()
    assert rc.sharded == pod
    # RUN_DIR/config.gin names a mesh only when the recipe does (re-used, it runs the same way)
    assert ("MeshConfig." in config_loader.operative_config()) == pod
    if pod:  # the mesh fits the slice; SFT micro-batches are the plan's update micro-batches
        assert math.prod(rc.mesh.shape(rc.tpu.num_devices)) == rc.tpu.num_devices
        assert rc.experiment.sft_micro_batch_rows == rc.experiment.execution.micro_batch_rows


@pytest.mark.parametrize("binding, message", [
    ("MeshConfig.tensor=3", "MeshConfig (1, -1, 3): 8 devices do not divide by 3"),
    ("MeshConfig.data=0", "MeshConfig sizes must be >= 1"),
    ("MeshConfig.rules=(('batch','pods'),)", "unknown mesh axis 'pods'"),
    ("MeshConfig.fsdp=16", "MeshConfig data=1 fsdp=16 tensor=1 needs 16 devices, have 8"),
])
def test_bad_mesh_is_one_line_and_leaves_no_run_folder(tmp_path, capsys, binding, message):
    from mempo_jax.commands import train

    run = tmp_path / "run"
    assert train.main(["--run_dir", str(run), "--gin_param", binding]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert not run.exists()


def test_sft_batch_must_divide_over_the_mesh(tmp_path, capsys):
    from mempo_jax.commands import train

    argv = ["--run_dir", str(tmp_path / "run"), "--gin_param", "SFTConfig.batch_rows=6", *sum(
        (["--gin_param", b] for b in _mesh(2, 2, 2)), [])]
    assert train.main(argv) == 2
    assert "SFTConfig.batch_rows = 6 does not divide over the 4 batch shards" in capsys.readouterr().err


# ------------------------------------------------------------------------------ runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The small run on a (1,1,1) mesh in one process on one CPU device, and on a
    (2,2,2) mesh over two processes of 4 CPU devices each; the three processes run at once (the
    reference fills the CPU time the two others spend waiting for each other).

    Returns:
      ``(reference run folder, two-process run folder, [process 0 output, process 1 output])``.
    """
    root = tmp_path_factory.mktemp("mesh")
    ref, run = root / "mesh111", root / "mesh222"
    port = free_port()
    launch = [(train_command(ref, PARAMS + _mesh(1, 1, 1), SPM_CACHE), _env(1))]
    launch += [(train_command(run, PARAMS + _mesh(2, 2, 2), SPM_CACHE),
                _env(4, MEMPO_COORDINATOR=f"127.0.0.1:{port}", MEMPO_NUM_PROCESSES="2", MEMPO_PROCESS_ID=str(i)))
               for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for cmd, env in launch]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p, log in zip(("(1,1,1) run", "process 0", "process 1"), procs, logs):
        assert p.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1} over 1 devices, 1 process(es)" in logs[0]
    return ref, run, logs[1:]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _close(a, b, where):
    """``a`` equals ``b``: floats within 1e-4 relative + ``ABS_TOL``, everything else exactly."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= 1e-4 * abs(b) + ABS_TOL, f"{where}: {a} vs {b}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.slow
def test_two_process_2x2x2_mesh_run_equals_the_one_device_mesh_run(runs):
    """Same metric lines (1e-4 relative), rollouts, evaluations and summary (but wall time), and the
    same final SFT and RL parameters (1e-5 relative), written once, by process 0."""
    import jax

    from mempo_jax.run.checkpoint import Checkpointer, read_checkpoint

    ref, run, logs = runs
    assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2} over 8 devices, 2 process(es)" in logs[0]
    assert "[mempo]" not in logs[1]  # process 1 prints nothing of its own
    got, want = _metrics(run), _metrics(ref)
    assert [(r["stage"], r["step"]) for r in got] == [(r["stage"], r["step"]) for r in want]
    assert [r["stage"] for r in got] == ["sft"] * 2 + ["eval_sft_k1"] + ["rl"] + ["eval_rl_k1"]  # once each
    for g, w in zip(got, want):
        _close({k: v for k, v in g.items() if not k.startswith("timing/")},
               {k: v for k, v in w.items() if not k.startswith("timing/")}, f"{w['stage']}@{w['step']}")
    assert (run / "rollouts.jsonl").read_text() == (ref / "rollouts.jsonl").read_text()
    summary, ref_summary = (json.loads((r / "summary.json").read_text()) for r in (run, ref))
    for s in (summary, ref_summary):
        s.pop("wall_s")
    _close(summary, ref_summary, "summary")
    for name in ("eval_sft.json", "eval_rl.json"):
        a, b = (json.loads((r / name).read_text()) for r in (run, ref))
        _close(a["evals"], b["evals"], name)
        assert a["per_question_em"] == b["per_question_em"] and a["per_question_f1"] == b["per_question_f1"]
        predictions = name.replace(".json", "_predictions.jsonl")
        assert (run / predictions).read_text() == (ref / predictions).read_text() != ""
    assert (run / "config.gin").read_text().count("MeshConfig.data = 2") == 1
    for folder in ("sft_checkpoint", "checkpoints"):
        ref_step, theirs = read_checkpoint(ref / folder)
        ckpt = Checkpointer(run / folder, async_save=False)  # saved by two processes: restore onto one device
        try:
            step = ckpt.latest_step()
            params, _, meta = ckpt.restore(step, theirs["params"])
        finally:
            ckpt.close()
        assert step == ref_step == (2 if folder == "sft_checkpoint" else 1)
        # the log offsets are process 0's (bytes may differ by a digit of a float)
        assert meta["metrics"]["lines"] == theirs["meta"]["metrics"]["lines"]
        assert meta["metrics"]["bytes"] == len(b"".join((run / "metrics.jsonl").read_bytes().splitlines(True)[
            : meta["metrics"]["lines"]]))
        a = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
        b = [np.asarray(x, np.float64) for x in jax.tree.leaves(theirs["params"])]
        diff = math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b)))
        norm = math.sqrt(sum(float(np.sum(y ** 2)) for y in b))
        assert diff <= 1e-5 * norm, (folder, diff / norm)
