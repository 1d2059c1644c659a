"""A lost process ends a two-process run: the survivor exits within 60 s with one line naming the
lost process and the last complete checkpoint, and the relaunched run ends bitwise equal to an
uninterrupted one.

Two CPU processes of 2 emulated devices each, joined on 127.0.0.1, run the small trainer run
(1 SFT step, 2 RL steps, a checkpoint after every step) on a (1, 2, 2) mesh. One process
SIGKILLs itself (``tests/fault_train.py``): process 1 during the rollout of RL step 1, then,
in the relaunched run, process 0 (the coordinator) at the start of RL step 1's update, while
process 1 waits in the update's collectives. A third launch finishes the run. Unit tests of
``core.peers`` cover the watch and the guardian with real pipes, processes and sockets.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import small_env, train_command  # noqa: E402
from fault_train import fault_command  # noqa: E402

from conftest import FAST_XLA, SPM_CACHE, XLA_CACHE, free_port  # noqa: E402

PARAMS = ("SFTConfig.steps=1", "RLConfig.steps=2", "CheckpointConfig.every_steps=1", "CheckpointConfig.max_to_keep=3",
          "EvalConfig.num_questions=2", "MeshConfig.data=1", "MeshConfig.fsdp=2", "MeshConfig.tensor=2",
          "DistributedConfig.peer_timeout_s=10.0")
LIMIT_S = 60.0
RUN_TIMEOUT_S = 900


def _launch(run_dir, faults=None):
    """The two processes of the small run (``faults``: ``{process: {"sigkill_rollout_step": 1}}``);
    their output goes to files beside the run folder (read by ``_finish``)."""
    port = free_port()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(2):
        cmd = train_command(run_dir, PARAMS, SPM_CACHE)
        if faults and i in faults:
            cmd = fault_command(faults[i]) + cmd[3:]  # cmd[:3]: python -m mempo_jax.commands.train
        env = small_env(XLA_CACHE, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_XLA}",
                        MEMPO_COORDINATOR=f"127.0.0.1:{port}", MEMPO_NUM_PROCESSES="2", MEMPO_PROCESS_ID=str(i))
        out, err = (open(run_dir.parent / f"{run_dir.name}.{i}.{kind}", "w") for kind in ("out", "err"))
        with out, err:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True))
        procs[-1].logs = (out.name, err.name)
    return procs


def _finish(procs, victim=None):
    """Wait for both; returns ``(outputs [(stdout, stderr)], seconds from the victim's death to the
    survivor's exit)``."""
    died = survived = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            now = time.monotonic()
            if victim is not None and died is None and procs[victim].poll() is not None:
                died = now
            if victim is not None and survived is None and procs[1 - victim].poll() is not None:
                survived = now
            time.sleep(0.1)
        now = time.monotonic()
        died = died or now
        survived = survived or now
        time.sleep(1.0)  # the guardians' lines follow their processes' ends
        outs = [tuple(pathlib.Path(f).read_text() for f in p.logs) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs, (survived - died if victim is not None else None)


def _errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def _complete(run, folder="checkpoints"):
    return sorted(int(p.name) for p in (run / folder).iterdir() if p.name.isdigit())


def _restore(folder):
    """``(step, params, opt_state, meta)`` of the newest complete checkpoint of ``folder``, restored
    onto this process's first device whatever mesh saved it (targets from orbax's stored shapes;
    ``Checkpointer.restore`` checks every array against the checksums recorded at save time)."""
    import orbax.checkpoint as ocp

    from mempo_jax.run.checkpoint import Checkpointer

    ckpt = Checkpointer(folder, async_save=False, prepare=False)
    try:
        step = ckpt.latest_step()
        targets = [jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                getattr(t, "tree", t))
                   for t in (ocp.StandardCheckpointHandler().metadata(folder / str(step) / item)
                             for item in ("params", "opt_state"))]
        return (step, *ckpt.restore(step, *targets))
    finally:
        ckpt.close()


def _rl_lines(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("lost") / "uninterrupted"
    outs, _ = _finish(_launch(run))
    assert (run / "summary.json").exists(), outs[0][1][-3000:]
    return run


@pytest.mark.slow
def test_a_lost_process_ends_the_run_and_the_relaunch_resumes_bitwise(reference, tmp_path):
    from mempo_jax.core.peers import EXIT_PEER_LOST

    run = tmp_path / "run"
    timings = {}
    for phase, victim, faults in (("rollout", 1, {"sigkill_rollout_step": 1}), ("update", 0, {"sigkill_update_step": 1})):
        procs = _launch(run, {victim: faults})
        outs, seconds = _finish(procs, victim)
        survivor = 1 - victim
        timings[phase] = seconds
        assert procs[victim].returncode == -9
        err = outs[survivor][1]
        lines = [x for x in _errors(err) if f"process {victim} of 2" in x]
        assert len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"error: process {victim} of 2{' (the coordinator)' if victim == 0 else ''} "
                                   "was lost")
        # the newest complete checkpoint (RL step 1's save may still be in flight at the kill: then step 0's)
        folder = "checkpoints" if (run / "checkpoints").is_dir() and _complete(run) else "sft_checkpoint"
        last = _complete(run, folder)[-1]
        assert lines[0].endswith(f"Last complete checkpoint: {run / folder}/{last}; run the same command "
                                 "on every worker to resume")
        assert seconds < LIMIT_S, (phase, seconds)
        if victim == 1:  # the watch in the survivor itself (not JAX, not the guardian) ended it
            assert procs[survivor].returncode == EXIT_PEER_LOST, err[-3000:]
        # no partial save counts as complete: the one named restores, every item of it
        step, _, _, meta = _restore(run / folder)
        assert step == last and meta["step"] == last
    print(f"seconds from the kill to the survivor's exit: {timings}")
    outs, _ = _finish(_launch(run))
    assert f"resuming {'RL' if folder == 'checkpoints' else 'SFT'} after step {last}" in outs[0][0], outs[0][1][-3000:]
    assert _rl_lines(run) == _rl_lines(reference)
    assert (run / "rollouts.jsonl").read_bytes() == (reference / "rollouts.jsonl").read_bytes()
    for folder in ("checkpoints", "sft_checkpoint"):
        got, want = _restore(run / folder), _restore(reference / folder)
        assert got[0] == want[0]
        for a, b in zip(got[1:3], want[1:3]):  # parameters, optimizer state
            a, b = jax.tree.leaves(a), jax.tree.leaves(b)
            assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)), folder
    summary, ref_summary = (json.loads((r / "summary.json").read_text()) for r in (run, reference))
    summary.pop("wall_s"), ref_summary.pop("wall_s")
    assert summary == ref_summary


# ---- the watch and the guardian on their own ------------------------------------------------------


class _Store:
    """A key-value store with the two calls ``PeerWatch`` makes (the coordination client's)."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return sorted((k, v) for k, v in self.values.items() if k.startswith(prefix))


def test_watch_names_a_silent_process_and_ignores_one_that_left(tmp_path):
    from mempo_jax.core.peers import EXIT_PEER_LOST, PeerWatch, last_complete_checkpoint

    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "2")
    store, exits = _Store(), []
    watch = PeerWatch(store, 0, 3, peer_timeout_s=0.3, run_dir=str(tmp_path), interval_s=0.05, guardian=False,
                      exit_fn=exits.append)
    store.values.update({"mempo/peers/1": "1 run", "mempo/peers/2": "1 run"})
    assert watch.poll() is None
    store.values["mempo/peers/2"] = "2 left"  # process 2 finished: never lost
    time.sleep(1.0)  # a gap in this process's own looks: the clocks start again
    assert watch.poll() is None
    found = None
    while found is None:  # looked at every 0.05 s, process 1's counter does not move for 0.3 s
        time.sleep(0.05)
        found = watch.poll()
    lost, why = found
    assert lost == 1 and why == "no heartbeat for 0 s, limit DistributedConfig.peer_timeout_s"
    watch.report(lost, why)
    assert exits == [EXIT_PEER_LOST]
    # a process other than 0 that cannot reach the store has lost process 0
    store.down = True
    other = PeerWatch(store, 1, 2, peer_timeout_s=5.0, interval_s=0.05, guardian=False, exit_fn=exits.append)
    assert other.poll()[0] == 0


def test_settle_returns_once_every_process_left():
    from mempo_jax.core.peers import PeerWatch

    store = _Store()
    watch = PeerWatch(store, 0, 2, peer_timeout_s=5.0, interval_s=0.05, guardian=False,
                      exit_fn=lambda code: pytest.fail("no process was lost"))
    store.values["mempo/peers/1"] = "7 left"
    t = time.monotonic()
    watch.settle()
    assert time.monotonic() - t < 1.0 and store.values["mempo/peers/0"].endswith(" left")


def _guardian(hello, end_with=None):
    proc = subprocess.Popen([sys.executable, "-m", "mempo_jax.core.peers"], cwd=REPO, stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc.communicate(hello + "\n" + (end_with + "\n" if end_with else ""), timeout=30)[1]


def test_guardian_names_the_coordinator_when_its_address_is_gone(tmp_path):
    (tmp_path / "sft_checkpoint" / "2").mkdir(parents=True)
    closed = f"127.0.0.1:{free_port()}"
    err = _guardian(f"hello 1 2 {closed} {tmp_path}")
    assert err.startswith("error: process 0 of 2 (the coordinator) was lost") and err.count("\n") == 1
    assert f"Last complete checkpoint: {tmp_path / 'sft_checkpoint'}/2;" in err
    with socket.socket() as s:  # a coordinator that still answers: this process itself ended abruptly
        s.bind(("127.0.0.1", 0))
        s.listen()
        err = _guardian(f"hello 1 2 127.0.0.1:{s.getsockname()[1]} {tmp_path}")
    assert err.startswith("error: process 1 of 2 ended abruptly")
    assert _guardian(f"hello 1 2 {closed} {tmp_path}", "bye") == ""  # a clean exit: nothing to say
