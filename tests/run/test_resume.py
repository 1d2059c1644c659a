"""Checkpoints, resume and preemption of ``python -m mempo_jax.commands.train``, on the small run
of ``benchmarks/chaos_resume.py`` (1-layer model, tiny world, 6 SFT + 6 RL steps) in subprocesses.

The uninterrupted run is the session's ``small_run`` (``conftest.py``); every run shares the
session's XLA and tokenizer caches to skip recompiles across processes. A SIGTERM in the
rollout, its checkpoint and the resume from it: ``test_gcs_run_dir.py`` (the same run, its folder on
a Cloud Storage emulator). Runs that need a signal or
a second process are subprocesses; a command that stops at start-up (exit status 2) runs
in-process (``train.main``).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import zlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import SMALL_PARAMS, chaos, compare_runs, count_lines, train_command  # noqa: E402
from conftest import SPM_CACHE, one_device_env  # noqa: E402  (the session's shared caches)
from fault_train import fault_command  # noqa: E402

SFT_STEPS = RL_STEPS = 6
# 6 SFT lines, the SFT evaluation (one mode), 6 RL lines, the RL evaluation
LINES = SFT_STEPS + 1 + RL_STEPS + 1


def _train(run_dir, params=(), faults=None, timeout=600, args=()):
    """The small run as a subprocess; ``faults`` (``{"sigterm_rollout_step": 3}``): through
    ``tests/fault_train.py`` (``train.main(hooks=FaultHooks(...))``)."""
    cmd = train_command(run_dir, params, SPM_CACHE) + list(args)
    if faults:
        cmd = fault_command(faults) + cmd[3:]  # cmd[:3]: python -m mempo_jax.commands.train
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=one_device_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _main_exit_2(capfd, run_dir, params=()):
    """``train.main`` in-process on the small config plus ``params`` (a command that stops at
    start-up needs no process of its own); returns (exit status, what it wrote to stderr)."""
    from mempo_jax.commands import train

    argv = ["--run_dir", str(run_dir), "--cache_dir", str(SPM_CACHE)]
    for p in (*SMALL_PARAMS, *params):
        argv += ["--gin_param", p]
    capfd.readouterr()
    rc = train.main(argv)
    return rc, capfd.readouterr().err


@pytest.fixture
def reference(small_run):
    """The uninterrupted run of the small config (the session's, read-only: tests copy it)."""
    return small_run


def _meta(run, folder, step):
    from mempo_jax.run.checkpoint import read_checkpoint

    return read_checkpoint(run / folder, step)[1]["meta"]


@pytest.mark.slow
def test_uninterrupted_run_leaves_resume_points(reference):
    """every_steps = 2, max_to_keep = 2: the newest two checkpoints per stage, each recording the
    data-iterator position and the exact byte/line offsets of the logs at that step."""
    assert sorted(int(p.name) for p in (reference / "checkpoints").iterdir()) == [4, 6]
    assert sorted(int(p.name) for p in (reference / "sft_checkpoint").iterdir()) == [4, 6]
    lines = (reference / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == LINES
    recs = [json.loads(x) for x in lines]
    assert [r["stage"] for r in recs] == ["sft"] * 6 + ["eval_sft_k1"] + ["rl"] * 6 + ["eval_rl_k1"]
    assert [r["step"] for r in recs if r["stage"] == "rl"] == list(range(6))
    for r in recs[7:13]:
        assert r["faults/skipped_updates"] == 0.0 and r["faults/nonfinite_streak"] == 0.0
        assert r["actor/grad_norm"] > 0.0  # the run really trains during RL (entropy bonus)

    sft = _meta(reference, "sft_checkpoint", 6)
    assert sft["final"] is True and sft["updates"] == 6
    assert sft["metrics"] == {"bytes": sum(map(len, lines[:6])), "lines": 6, "crc32": zlib.crc32(b"".join(lines[:6]))}
    rl4 = _meta(reference, "checkpoints", 4)
    # after RL step index 3: 4 batches drawn, 7 + 4 lines logged, 4 x 2 rollout records
    assert rl4["data_iterator"] == {"next_index": 4}
    assert rl4["metrics"] == {"bytes": sum(map(len, lines[:11])), "lines": 11, "crc32": zlib.crc32(b"".join(lines[:11]))}
    assert rl4["updates"] == 4 * 2  # num_mini_batches = 2
    rollouts = (reference / "rollouts.jsonl").read_bytes().splitlines(keepends=True)
    assert len(rollouts) == 6 * 2 * 2  # min(log_rollouts, 2 questions x 2 samples) per step
    assert rl4["rollouts"] == {"bytes": sum(map(len, rollouts[:16])), "crc32": zlib.crc32(b"".join(rollouts[:16]))}
    assert rl4["rng"]["next_step"] == 4 and len(rl4["rng"]["step_key"]) == 2
    eval_sft = json.loads((reference / "eval_sft.json").read_text())
    assert eval_sft["sft_step"] == 6 and eval_sft["metrics"]["lines"] == 7
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["eval"]["sft"]["k1"] == eval_sft["evals"]["k1"]


@pytest.mark.slow
def test_chaos_three_sigkills_end_bitwise_equal(reference, tmp_path):
    """benchmarks/chaos_resume.py with 3 seeded kills (the script's default is 10)."""
    run = tmp_path / "chaos"
    stats = chaos(run, train_command(run, cache_dir=SPM_CACHE), one_device_env(), kills=3, seed=1,
                  total_lines=LINES, max_delay_s=1.5, timeout_s=600, log=lambda s: None)
    assert stats["kills_delivered"] == 3
    diff = compare_runs(reference, run)
    assert diff["lost"] == 0 and diff["duplicated"] == 0 and diff["changed"] == 0 and diff["order_ok"]
    assert diff["params_equal"] and diff["opt_state_equal"] and diff["rollouts_equal"] and diff["summary_equal"]


@pytest.mark.slow
def test_rerun_of_a_finished_run_changes_nothing(reference, tmp_path):
    run = tmp_path / "done"
    shutil.copytree(reference, run)
    before = (run / "metrics.jsonl").read_bytes(), (run / "rollouts.jsonl").read_bytes()
    proc, _ = _train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming a finished run" in proc.stdout and "| rl | k1 |" in proc.stdout
    assert ((run / "metrics.jsonl").read_bytes(), (run / "rollouts.jsonl").read_bytes()) == before
    assert compare_runs(reference, run)["summary_equal"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "6"]


def test_resume_flag_needs_a_checkpoint(tmp_path, capsys):
    from mempo_jax.commands import train

    rc = train.main(["--run_dir", str(tmp_path / "empty"), "--resume"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2
    assert err[-1].startswith("error: --resume: no checkpoint under") and str(tmp_path / "empty") in err[-1]


# ---- the Preemption object ---------------------------------------------------------------------------
def test_sigterm_in_an_interruptible_region_raises_at_once_elsewhere_waits_for_check():
    import signal

    from mempo_jax.run.preemption import Preempted, Preemption

    before = signal.getsignal(signal.SIGTERM)
    with Preemption(grace_s=60) as pre:
        with pytest.raises(Preempted):
            with pre.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # interrupted long before this ends
                pytest.fail("not interrupted")
    with Preemption(grace_s=60) as pre:
        with pre.interruptible():
            pre.commit()  # the state is being changed: finish the region
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            finished = True
        assert finished and pre.requested
        with pytest.raises(Preempted):
            pre.check()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored, watchdog stopped
    assert pre._watchdog is None


def test_grace_period_watchdog_exits_4(tmp_path):
    """A run that cannot save within grace_s is ended with status 4 (no partial checkpoint counts)."""
    code = ("import os, signal, time, sys; sys.path.insert(0, %r)\n"
            "from mempo_jax.run.preemption import Preemption\n"
            "with Preemption(grace_s=0.5):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n" % str(REPO))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and time.monotonic() - t0 < 20
    assert "not saved within the 0.5 s grace period" in proc.stderr


def test_a_save_killed_midway_is_never_taken_for_a_complete_one(tmp_path):
    """SIGKILL right after an asynchronous save of 64 MB began: the next open sees only the
    complete step and removes the partial folder."""
    from mempo_jax.run.checkpoint import Checkpointer, read_checkpoint

    code = ("import os, signal, sys; sys.path.insert(0, %r)\n"
            "import jax.numpy as jnp\n"
            "from mempo_jax.run.checkpoint import Checkpointer\n"
            "ck = Checkpointer(sys.argv[1], async_save=True)\n"
            "ck.save(1, {'w': jnp.arange(4.0)}, {'c': jnp.zeros((), jnp.int32)}, {'seed': 0})\n"
            "ck.wait()\n"
            "ck.save(2, {'w': jnp.ones((16, 1024, 1024))}, {'c': jnp.zeros((), jnp.int32)}, {'seed': 0})\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n" % str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == -9
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    # Step 2's folder: complete, partial, or not yet created (the kill can land before the
    # background writer makes its temporary folder: seen on a loaded machine).
    assert names[0] == "1" and (names[1:] in (["2"], []) or names[1].startswith("2.orbax-checkpoint-tmp")), names
    ck = Checkpointer(tmp_path / "ck")
    steps = ck.steps()
    ck.close()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [str(s) for s in steps]  # no partial folder left
    if names[1:] != ["2"]:  # the usual case: the kill beat the write (or its start)
        assert steps == [1]
        assert read_checkpoint(tmp_path / "ck")[1]["params"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ---- nothing changes before every check has passed; logs deleted mid-run; corrupt checkpoints ----
def _snapshot(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _one_error(stderr: str) -> str:
    errs = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert len(errs) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errs[0]


@pytest.mark.slow
def test_a_resume_that_fails_changes_nothing(reference, tmp_path, capfd):
    """Raising ``RLConfig.steps`` on a finished run with a bad value elsewhere used to delete
    ``eval_rl.json`` and rewrite ``config.gin`` before failing (after a whole RL step)."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = _snapshot(run)
    rc, err = _main_exit_2(capfd, run, ("RLConfig.steps=8", "RLConfig.group_size=0"))
    assert rc == 2
    assert _one_error(err) == ("error: config error: RLConfig.group_size must be >= 1, got 0 "
                                       "(--gin_param RLConfig.group_size=0)")
    assert _snapshot(run) == before


@pytest.mark.slow
def test_a_log_changed_after_the_checkpoint_is_refused_before_anything_changes(reference, tmp_path, capfd):
    """The resume point's checks (here: ``metrics.jsonl`` has another line count in the part the
    checkpoint recorded) run before the run folder changes; the logs used to be cut back, and
    ``eval_rl.json`` and ``config.gin`` deleted / rewritten, before the check failed."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    data = (run / "metrics.jsonl").read_bytes()
    first = data.index(b"\n")
    space = data.index(b", ", first + 1) + 1
    (run / "metrics.jsonl").write_bytes(data[:space] + b"\n" + data[space + 1:])  # same size, one line more
    before = _snapshot(run)
    rc, err = _main_exit_2(capfd, run, ("RLConfig.steps=8",))
    assert rc == 2
    rl6 = run / "checkpoints" / "6"
    assert _one_error(err).startswith(f"error: {run / 'metrics.jsonl'}: 14 lines in the first ")
    assert f"but {rl6.absolute()} recorded 13: the file was changed after the checkpoint" in err
    assert _snapshot(run) == before


@pytest.mark.slow
def test_logs_deleted_or_replaced_during_a_run_are_recreated(reference, tmp_path):
    """``metrics.jsonl`` deleted during SFT and replaced during RL, ``rollouts.jsonl`` deleted
    during RL: the run used to exit 0 with every later line lost and record ``{"bytes": 0}`` in its
    checkpoints. Now each is recreated from the open file: nothing is lost, the offsets are
    true, the foreign file is kept, and the folder resumes."""
    run = tmp_path / "run"
    proc = subprocess.Popen(train_command(run, (), SPM_CACHE), env=one_device_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = []

    def meddle():
        actions = [("metrics.jsonl", 3, "delete"), ("rollouts.jsonl", 1, "delete"), ("metrics.jsonl", 10, "replace")]
        while actions and proc.poll() is None:
            name, lines, what = actions[0]
            if count_lines(run / name) >= lines:
                if what == "delete":
                    (run / name).unlink()
                else:
                    (run / "foreign").write_text("not the run's\n")
                    os.replace(run / "foreign", run / name)
                done.append(actions.pop(0))
            time.sleep(0.02)

    watcher = threading.Thread(target=meddle)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    watcher.join()
    assert proc.returncode == 0 and len(done) == 3, err[-3000:]
    notes = [x for x in err.splitlines() if "[mempo] warning:" in x]
    assert len(notes) == 3 and all("recreated from the open file" in x and "nothing lost" in x for x in notes), notes
    assert (run / "metrics.jsonl.replaced").read_text() == "not the run's\n"
    diff = compare_runs(reference, run)
    assert diff == {"lost": 0, "duplicated": 0, "changed": 0, "order_ok": True, "params_equal": True,
                    "opt_state_equal": True, "rollouts_equal": True, "summary_equal": True, "final_step": 6}
    metrics, rollouts = (run / "metrics.jsonl").read_bytes(), (run / "rollouts.jsonl").read_bytes()
    meta = _meta(run, "checkpoints", 6)
    assert meta["metrics"] == {"bytes": len(metrics) - len(metrics.splitlines(keepends=True)[-1]), "lines": LINES - 1,
                               "crc32": zlib.crc32(b"".join(metrics.splitlines(keepends=True)[:-1]))}
    assert meta["rollouts"] == {"bytes": len(rollouts), "crc32": zlib.crc32(rollouts)}
    proc2, _ = _train(run)
    assert proc2.returncode == 0 and "resuming a finished run" in proc2.stdout, proc2.stderr[-3000:]


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_in_one_line_and_kept(reference, tmp_path):
    """``checkpoints/6`` without its array manifest used to stop the run ("does not match this
    model: NOT_FOUND…", several KB, and an asyncio "Event loop is closed" traceback) although
    ``checkpoints/4`` was complete. Now the run resumes from 4, says so in one line, keeps 6 under
    ``corrupt_checkpoints/`` and ends bitwise where the uninterrupted run did."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "checkpoints" / "6" / "params" / "manifest.ocdbt").unlink()
    corrupt = _snapshot(run / "checkpoints" / "6")
    proc, _ = _train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    skipped = [x for x in proc.stderr.splitlines() if "skipped checkpoint" in x]
    kept = run / "corrupt_checkpoints" / "checkpoints-6"
    assert len(skipped) == 1 and len(skipped[0]) - 3 * len(str(run.absolute())) < 400, skipped  # not KBs
    assert skipped[0].startswith(f"[mempo] skipped checkpoint {(run / 'checkpoints').absolute()}/6: NOT_FOUND")
    assert skipped[0].endswith(f"resuming from {(run / 'checkpoints').absolute()}/4; the skipped one is kept as {kept}")
    assert "resuming RL after step 4" in proc.stdout
    assert _snapshot(kept) == corrupt  # never deleted
    assert compare_runs(reference, run) == {
        "lost": 0, "duplicated": 0, "changed": 0, "order_ok": True, "params_equal": True, "opt_state_equal": True,
        "rollouts_equal": True, "summary_equal": True, "final_step": 6}
