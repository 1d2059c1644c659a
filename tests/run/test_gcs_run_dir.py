"""``--run_dir gs://BUCKET/…``: the run folder on Cloud Storage, against a local emulator of the
Cloud Storage API on the loopback (``tests/gcs_emulator.py``: ``gcp-storage-emulator``, in memory),
reached by the real clients: gcsfs under ``etils.epath`` (``core.paths``) and tensorstore's gcs
driver under orbax.

The fast tests check the path layer and the run's logs on the bucket; the slow one runs the small
run of ``benchmarks/chaos_resume.py`` into the bucket, preempts it (SIGTERM in RL step 3), resumes
it from the bucket and compares the result with the session's uninterrupted local ``small_run``:
the same metrics (but timing), rollouts, summary (but wall time), parameters and optimizer state.
It is also the suite's SIGTERM-preemption test: a local run folder takes the same code path but
for the path layer, which the fast tests cover.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
import gcs_emulator  # noqa: E402
from chaos_resume import compare_runs, train_command  # noqa: E402
from conftest import SPM_CACHE, one_device_env  # noqa: E402
from fault_train import fault_command  # noqa: E402

BUCKET = "mempo-test"
_MISSING = [m for m in ("gcsfs", "gcp_storage_emulator") if importlib.util.find_spec(m) is None]
if _MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"{', '.join(_MISSING)} not installed under CI=true (requirements-test.txt installs them)")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} "
                                                       "(pip install -r requirements-test.txt)")


@pytest.fixture(scope="module")
def emulator():
    """``(url, env)``: the emulator serving ``BUCKET``, and its client environment, also set in
    this process while the module's tests run."""
    port = gcs_emulator.free_port()
    url = f"http://127.0.0.1:{port}"
    server = gcs_emulator.start(port, BUCKET)
    env = gcs_emulator.emulator_env(url)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import gcsfs  # after the environment: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when imported

        gcsfs.GCSFileSystem.clear_instance_cache()  # an instance reads STORAGE_EMULATOR_HOST when made
        try:
            yield url, env
        finally:
            gcsfs.GCSFileSystem.clear_instance_cache()
            server.stop()


@pytest.fixture
def gs(emulator, request):
    """A fresh ``gs://`` folder of this test in the emulator's bucket."""
    from mempo_jax.core.paths import run_path

    return run_path(f"gs://{BUCKET}/{request.node.name.replace('[', '_').replace(']', '')}")


def test_whole_file_writes_listing_and_copies(gs, tmp_path):
    from mempo_jax.core import paths

    f = gs / "a" / "x.json"
    paths.write_text_atomic(f, '{"k": 1}')
    assert json.loads(f.read_text()) == {"k": 1} and paths.file_size(f) == 8
    assert paths.file_size(gs / "absent") == 0
    local = tmp_path / "tree"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "y.txt").write_text("y")
    (local / "z.txt").write_text("z")
    paths.replace_folder(local, gs / "tree")
    assert not local.exists()
    assert list(paths.iter_files(gs)) == ["a/x.json", "tree/sub/y.txt", "tree/z.txt"]
    copy = paths.local_copy(gs / "tree")
    assert (copy / "sub" / "y.txt").read_text() == "y" and isinstance(copy, pathlib.Path)
    paths.move_folder(gs / "tree", gs / "moved")
    assert list(paths.iter_files(gs)) == ["a/x.json", "moved/sub/y.txt", "moved/z.txt"]


def test_a_folder_in_a_missing_bucket_is_one_line(emulator):
    from mempo_jax.run.resume import check_run_folder

    with pytest.raises(ValueError, match=r"^--run_dir gs://no-such-bucket/run: cannot list bucket gs://no-such-bucket"):
        check_run_folder("gs://no-such-bucket/run")
    check_run_folder(f"gs://{BUCKET}/fresh/run")  # absent folder in an existing bucket: fine


def test_complete_and_partial_steps(gs):
    """On Cloud Storage orbax writes a step under its final name and marks it complete with
    ``commit_success.txt`` last: a step folder without it is a save cut short, never listed, and
    removed when a ``Checkpointer`` prepares the folder."""
    from mempo_jax.core import paths
    from mempo_jax.core.peers import last_complete_checkpoint
    from mempo_jax.run.checkpoint import remove_partial_saves
    from mempo_jax.run.run_folder import checkpoint_steps

    ck = gs / "checkpoints"
    for step in (2, 4, 6):
        paths.write_text_atomic(ck / str(step) / "params" / "manifest.ocdbt", "x")
    for step in (2, 4):
        paths.write_text_atomic(ck / str(step) / paths.COMMIT_FILE, "")
    assert paths.complete_steps(ck) == [2, 4] == checkpoint_steps(gs)
    assert [p.name for p in paths.partial_steps(ck)] == ["6"]
    assert last_complete_checkpoint(str(gs)) == f"{gs}/checkpoints/4"
    assert remove_partial_saves(ck) == ["6"]
    assert not (ck / "6").exists() and paths.complete_steps(ck) == [2, 4]


def test_run_logs_are_staged_and_uploaded_whole(gs):
    """A remote run folder's logs are written locally and uploaded at every durable point
    (``offsets``) and at ``close``; a resume cuts the bucket's copies back to the recorded offsets."""
    from mempo_jax.run.run_logs import RunLogs

    logs = RunLogs(gs, upload_every_s=1e9)
    logs.write(0, "sft", {"sft/loss": 1.0})
    logs.write_rollouts([{"a": 1}])
    first = logs.offsets()
    assert (gs / "metrics.jsonl").read_bytes().count(b"\n") == 1
    assert len((gs / "rollouts.jsonl").read_bytes()) == first["rollouts"]["bytes"]
    logs.write(1, "sft", {"sft/loss": 0.5})
    logs.close()
    assert (gs / "metrics.jsonl").read_bytes().count(b"\n") == 2 and any((gs / "tb").iterdir())
    resumed = RunLogs(gs, first, source="test")
    assert resumed.lines == 1 and (gs / "metrics.jsonl").read_bytes().count(b"\n") == 1
    resumed.close()
    with pytest.raises(ValueError, match="metrics.jsonl holds"):
        RunLogs(gs, {**first, "metrics": {**first["metrics"], "bytes": 10 ** 6}}, source="test")


@pytest.mark.slow
def test_a_run_on_a_bucket_is_preempted_resumed_and_equals_the_local_run(emulator, small_run, tmp_path):
    """The small run into ``gs://…``: SIGTERM in RL step 3 (the step's state saved, exit 0), then
    the same command resumes from the bucket; the end equals the local uninterrupted run."""
    import fsspec

    from mempo_jax.core import paths
    from mempo_jax.run.checkpoint import load_policy, read_checkpoint

    _url, env = emulator
    run = f"gs://{BUCKET}/small"
    cmd = train_command(run, (), SPM_CACHE)
    first = subprocess.run(fault_command({"sigterm_rollout_step": 3}) + cmd[3:], env=one_device_env(**env), cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SIGTERM: saving a checkpoint" in first.stderr and "preempted: checkpoint saved" in first.stderr
    files = set(paths.iter_files(paths.run_path(run)))
    assert {"config.gin", "model_config.json", "tokenizer.model", "metrics.jsonl", "rollouts.jsonl",
            "eval_sft.json", "sft_checkpoint/6/commit_success.txt"} <= files
    assert "summary.json" not in files
    # the rollout of RL step 3 was abandoned; its state (after step 2) is checkpoint 3, the log's 7 + 3 lines
    assert sorted({int(f.split("/")[1]) for f in files if f.startswith("checkpoints/")}) == [2, 3]
    fs, path = fsspec.core.url_to_fs(run)
    fs.get(path + "/checkpoints/", str(tmp_path / "preempted"), recursive=True)
    meta = read_checkpoint(tmp_path / "preempted", 3)[1]["meta"]
    assert meta["data_iterator"] == {"next_index": 3} and meta["metrics"]["lines"] == 7 + 3
    assert len(paths.run_path(run).joinpath("metrics.jsonl").read_text().splitlines()) == 7 + 3
    second = subprocess.run(cmd, env=one_device_env(**env), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming RL after step 3 ({run}/checkpoints/3)" in second.stdout
    files = set(paths.iter_files(paths.run_path(run)))
    assert {"summary.json", "eval_rl.json", "eval_rl_predictions.jsonl", "checkpoints/6/commit_success.txt"} <= files
    assert not [f for f in files if ".tmp" in f or "orbax-checkpoint-tmp" in f]

    local = tmp_path / "small"
    fs.get(path + "/", str(local), recursive=True)
    diff = compare_runs(small_run, local)
    assert diff == {"lost": 0, "duplicated": 0, "changed": 0, "order_ok": True, "params_equal": True,
                    "opt_state_equal": True, "rollouts_equal": True, "summary_equal": True, "final_step": 6}, diff
    # the policy loads from the bucket itself, as mempo-evaluate --run_dir gs://… does
    _tok, _cfg, _graph, params = load_policy(run)
    import jax
    import numpy as np

    stored = read_checkpoint(local / "checkpoints")[1]["params"]
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(stored)))
