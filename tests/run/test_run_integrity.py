"""Runs never lose data silently, on real files and real orbax checkpoints:
a log deleted, replaced or changed under a running writer; the offsets a checkpoint records; a
corrupt newest checkpoint passed over for the newest one that restores, and kept."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st


def _lines(n, start=0):
    return "".join(json.dumps({"step": i, "x": i * 0.5}) + "\n" for i in range(start, start + n))


# ---- item 13: the log writers -----------------------------------------------------------------------
def test_a_log_deleted_during_the_run_is_recreated_from_the_open_file(tmp_path):
    from mempo_jax.run.metrics import AppendLog

    notes = []
    log = AppendLog(tmp_path / "m.jsonl", warn=notes.append)
    log.append(_lines(3))
    (tmp_path / "m.jsonl").unlink()
    log.append(_lines(2, 3))
    log.close()
    want = _lines(5).encode()
    assert (tmp_path / "m.jsonl").read_bytes() == want
    assert (log.size, log.lines, log.crc32) == (len(want), 5, zlib.crc32(want))
    assert len(notes) == 1 and "was deleted during the run; recreated from the open file (3 lines" in notes[0]


def test_a_log_replaced_during_the_run_keeps_both_files(tmp_path):
    from mempo_jax.run.metrics import AppendLog

    path = tmp_path / "m.jsonl"
    notes = []
    log = AppendLog(path, warn=notes.append)
    log.append(_lines(2))
    (tmp_path / "other").write_text("someone else's\n")
    os.replace(tmp_path / "other", path)  # e.g. an editor's save, or logrotate's create
    log.check()
    log.append(_lines(1, 2))
    log.close()
    assert path.read_bytes() == _lines(3).encode()
    assert (tmp_path / "m.jsonl.replaced").read_text() == "someone else's\n"
    assert "replaced by another file" in notes[0] and str(tmp_path / "m.jsonl.replaced") in notes[0]


@pytest.mark.parametrize("change", ["truncate", "append"])
def test_a_log_changed_in_place_stops_the_writer(tmp_path, change):
    from mempo_jax.run.metrics import AppendLog, LogChanged

    path = tmp_path / "m.jsonl"
    log = AppendLog(path)
    log.append(_lines(4))
    if change == "truncate":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:
        with open(path, "ab") as f:
            f.write(b'{"foreign": 1}\n')
    with pytest.raises(LogChanged, match=r"this run wrote \d+: the file was truncated or appended to"):
        log.append(_lines(1, 4))
    log.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_names_the_log_and_keeps_whole_lines(tmp_path):
    from mempo_jax.run.metrics import AppendLog

    path = tmp_path / "m.jsonl"
    path.symlink_to("/dev/full")
    log = AppendLog(path)
    with pytest.raises(OSError) as e:
        log.append(_lines(2))
    assert e.value.errno == 28 and e.value.filename == str(path)
    assert (log.size, log.lines) == (0, 0)  # nothing counted that is not on disk
    log.close()


def test_run_logs_record_true_offsets_after_a_deletion(tmp_path):
    """``RunLogs.offsets`` used ``stat`` of the path: after ``metrics.jsonl`` was deleted it recorded
    ``{"bytes": 0, "lines": 6}``, after which the folder could never be resumed."""
    from mempo_jax.run.run_logs import RunLogs, check_logs

    logs = RunLogs(tmp_path, None, warn=lambda m: None)
    for step in range(6):
        logs.write(step, "sft", {"sft/loss": 1.0 / (step + 1)})
    logs.write_rollouts([{"step": 0, "turns": []}])
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "rollouts.jsonl").unlink()
    offsets = logs.offsets()
    logs.close()
    m, r = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "rollouts.jsonl").read_bytes()
    assert m.count(b"\n") == 6 and [json.loads(x)["step"] for x in m.splitlines()] == list(range(6))
    assert offsets == {"metrics": {"bytes": len(m), "lines": 6, "crc32": zlib.crc32(m)},
                       "rollouts": {"bytes": len(r), "crc32": zlib.crc32(r)}}
    check_logs(tmp_path, offsets, "ck")  # the folder resumes


def test_check_logs_finds_a_change_of_the_recorded_part_and_changes_nothing(tmp_path):
    from mempo_jax.run.run_logs import RunLogs, check_logs

    logs = RunLogs(tmp_path, None)
    for step in range(3):
        logs.write(step, "rl", {"x": float(step)})
    offsets = logs.offsets()
    logs.write(3, "rl", {"x": 3.0})  # after the checkpoint: cut back on resume
    logs.close()
    check_logs(tmp_path, offsets, "RUN/checkpoints/3")
    data = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "metrics.jsonl").write_bytes(data.replace(b'"x": 1.0', b'"x": 7.0', 1))  # same size and lines
    changed = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"differ from what RUN/checkpoints/3 recorded \(CRC-32\)"):
        check_logs(tmp_path, offsets, "RUN/checkpoints/3")
    with pytest.raises(ValueError, match=r"differ from what"):
        RunLogs(tmp_path, offsets, "RUN/checkpoints/3")  # checks before it truncates
    assert (tmp_path / "metrics.jsonl").read_bytes() == changed  # nothing cut off
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(ValueError, match=r"holds 0 bytes but RUN/checkpoints/3 recorded \d+: logged lines were lost"):
        check_logs(tmp_path, offsets, "RUN/checkpoints/3")


# ---- item 14: corrupt checkpoints -------------------------------------------------------------------
def _meta(step, final=False):
    return {"stage": "sft", "step": step, "updates": step, "seed": 0, "final": final,
            "metrics": {"bytes": 0, "lines": 0}, "rollouts": {"bytes": 0}}


def _tree(step):
    return ({"w": jnp.arange(64, dtype=jnp.float32) * step, "b": jnp.full((3, 5), step, jnp.bfloat16)},
            {"count": jnp.asarray(step, jnp.int32), "mu": jnp.ones((8,), jnp.float32) / step})


@pytest.fixture
def sft_folder(tmp_path):
    """``RUN/sft_checkpoint`` with complete, non-final SFT checkpoints 2 and 4 (of 6 steps)."""
    from mempo_jax.run.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "run" / "sft_checkpoint", max_to_keep=3, async_save=False)
    for step in (2, 4):
        ck.save(step, *_tree(step), _meta(step))
    ck.close()
    return tmp_path / "run"


def _largest(folder: pathlib.Path) -> pathlib.Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _corrupt(step_dir: pathlib.Path, kind: str) -> None:
    if kind == "flipped_byte":
        f = _largest(step_dir / "params")
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif kind == "zeroed_data":
        f = _largest(step_dir / "params")
        f.write_bytes(bytes(f.stat().st_size))
    elif kind == "truncated_data":
        f = _largest(step_dir / "params")
        f.write_bytes(f.read_bytes()[:20])
    elif kind == "swapped_arrays":  # valid array data of another step: decodes without any error
        other = step_dir.parent / "2" / "params"
        shutil.rmtree(step_dir / "params")
        shutil.copytree(other, step_dir / "params")
    elif kind.startswith("garbled:"):  # e.g. orbax's array metadata (JSON) overwritten
        (step_dir / kind.split(":", 1)[1]).write_bytes(b"\x00\xff not json")
    else:  # a missing file: "params/manifest.ocdbt", "meta/metadata"
        (step_dir / kind).unlink()


def _restore_sft(run):
    from mempo_jax.run.checkpoint import Checkpointer
    from mempo_jax.run.resume import find_resume_point, restore_newest

    sft = Checkpointer(run / "sft_checkpoint", async_save=False, prepare=False)
    rl = Checkpointer(run / "checkpoints", async_save=False, prepare=False)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree(1))
    try:
        return restore_newest(lambda skip: find_resume_point(run, sft, rl, 0, 6, 4, skip),
                              lambda p: sft.restore(p.sft_step, target[0], target[1]))
    finally:
        sft.close()
        rl.close()


@pytest.mark.parametrize("kind", ["flipped_byte", "zeroed_data", "truncated_data", "swapped_arrays",
                                  "params/manifest.ocdbt", "meta/metadata", "garbled:opt_state/_METADATA"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_that_restores(sft_folder, kind):
    _corrupt(sft_folder / "sft_checkpoint" / "4", kind)
    corrupted = {p.relative_to(sft_folder).as_posix(): p.read_bytes() for p in sft_folder.rglob("*") if p.is_file()}
    point, (params, opt_state, meta) = _restore_sft(sft_folder)
    assert point.sft_step == 2 and meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(64, dtype=np.float32) * 2)
    assert int(opt_state["count"]) == 2
    where = str(sft_folder.absolute() / "sft_checkpoint" / "4")
    assert list(point.skipped) == [where]
    reason = point.skipped[where]
    assert "\n" not in reason and len(reason) < 300 and "tensorstore_spec" not in reason
    if kind == "swapped_arrays":
        assert reason == "params['b'] differs from the checksum recorded at save time (damaged array data)"
    if kind == "meta/metadata":
        assert reason.startswith("no readable metadata")
    now = {p.relative_to(sft_folder).as_posix(): p.read_bytes() for p in sft_folder.rglob("*") if p.is_file()}
    assert now == corrupted  # the search changed nothing (the trainer moves it aside, set_aside)


def test_every_checkpoint_corrupt_is_one_line_and_changes_nothing(sft_folder):
    for step in ("2", "4"):
        _corrupt(sft_folder / "sft_checkpoint" / step, "params/manifest.ocdbt")
    with pytest.raises(ValueError) as e:
        _restore_sft(sft_folder)
    msg = str(e.value)
    assert msg.startswith(f"no checkpoint under {sft_folder.absolute() / 'sft_checkpoint'} restores (newest skipped: ")
    assert "\n" not in msg and sorted(p.name for p in (sft_folder / "sft_checkpoint").iterdir()) == ["2", "4"]


def test_set_aside_moves_a_checkpoint_without_deleting_it(sft_folder):
    from mempo_jax.run.checkpoint import Checkpointer

    ck = Checkpointer(sft_folder / "sft_checkpoint", async_save=False, prepare=False)
    files = sorted(p.relative_to(sft_folder / "sft_checkpoint" / "4").as_posix()
                   for p in (sft_folder / "sft_checkpoint" / "4").rglob("*"))
    kept = ck.set_aside(4, sft_folder / "corrupt_checkpoints")
    ck.prepare()
    assert ck.steps() == [2] and kept == sft_folder / "corrupt_checkpoints" / "sft_checkpoint-4"
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*")) == files
    ck.save(4, *_tree(4), _meta(4))  # the step can be saved again
    assert ck.steps() == [2, 4]
    ck.close()


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       dtype=st.sampled_from(["float32", "bfloat16", "int32", "bool", "int8"]), data=st.data())
def test_array_checksums_match_an_independent_numpy_computation(shape, dtype, data):
    """``sum_i bits(x_i) * (2 * 2654435761 * i + 1) mod 2^32``, recomputed in numpy with uint64
    arithmetic over random bit patterns (NaNs and infinities included); flipping any one bit of
    any element (a sign bit too) changes it."""
    import ml_dtypes

    from mempo_jax.run.checkpoint import array_checksums

    n = int(np.prod(shape))
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "bool": np.uint8}.get(dtype, np.dtype(dtype))
    width = {"float32": np.uint32, "bfloat16": np.uint16, "int32": np.uint32, "int8": np.uint8, "bool": np.uint8}[dtype]
    size = np.dtype(width).itemsize
    raw = np.asarray(data.draw(st.lists(st.integers(0, 255), min_size=n * size, max_size=n * size)), np.uint8)
    bits = np.frombuffer(raw.tobytes(), width).copy()
    if dtype == "bool":
        bits %= 2

    def checksum_of(b):
        host = b.astype(bool) if dtype == "bool" else b.view(np_dtype)
        return array_checksums({"a": jnp.asarray(host.reshape(shape))})

    weights = (np.arange(n, dtype=np.uint64) * 2654435761 * 2 + 1) % 2**32
    want = int(((bits.astype(np.uint64) * weights) % 2**32).sum() % 2**32)
    assert checksum_of(bits) == [want]
    if n:
        flipped = bits.copy()
        bit = 0 if dtype == "bool" else data.draw(st.integers(0, 8 * size - 1))
        flipped[data.draw(st.integers(0, n - 1))] ^= width(1 << bit)
        assert checksum_of(flipped) != [want]


def test_a_checkpoint_save_on_a_full_disk_is_one_oserror_and_keeps_the_last_complete_one(tmp_path, capfd):
    """orbax reports a full disk as ``ValueError: RESOURCE_EXHAUSTED … [os_error_code='28']`` from its
    save threads, with tracebacks logged by each; the run got a multi-KB error. Now: one
    ``CheckpointWriteError`` (an ``OSError``, ``ENOSPC``) naming the folder, no traceback."""
    import subprocess

    from mempo_jax.run.checkpoint import Checkpointer, CheckpointWriteError

    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        ck = Checkpointer(mnt / "ck", max_to_keep=10, async_save=True)
        saved = []
        with pytest.raises(CheckpointWriteError) as e:
            for step in range(1, 20):
                ck.save(step, {"w": jnp.arange(30000, dtype=jnp.float32) * step}, {"c": jnp.zeros((), jnp.int32)},
                        {"seed": 0})
                saved.append(step)
            ck.wait()
        assert e.value.errno == 28 and e.value.filename == str((mnt / "ck").absolute())
        assert str(e.value).startswith("[Errno 28] No space left on device (saving a checkpoint)")
        ck.close()
        err = capfd.readouterr().err
        assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-2000:]
        ck = Checkpointer(mnt / "ck", async_save=False)  # the partial save is gone, the complete ones restore
        last = ck.latest_step()
        assert last is not None and last < saved[-1] + 1
        params, _, _ = ck.restore(last, {"w": np.zeros(30000, np.float32)})
        np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(30000, dtype=np.float32) * last)
        ck.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_unretrieved_read_errors_of_a_failed_restore_are_dropped_and_no_others(tmp_path):
    """After checkpoint ``where`` failed to restore, asyncio's "Future exception was never
    retrieved" records that name a file under it are dropped; such records about anything else,
    and every other record, still pass."""
    import logging

    from mempo_jax.run import checkpoint as ck

    where = str(tmp_path / "checkpoints" / "6")
    with pytest.raises(KeyError), ck._quiet_late_reads(where):
        raise KeyError("a failed restore")

    def record(msg, exc=None):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None,
                                 (type(exc), exc, None) if exc is not None else None)

    unretrieved = "Future exception was never retrieved\nfuture: <Future finished exception=ValueError(...)>"
    assert not ck._drop_unretrieved_read_errors(
        record(unretrieved, ValueError(f'NOT_FOUND: at local file "{where}/params/" does not exist')))
    assert ck._drop_unretrieved_read_errors(record(unretrieved, ValueError("NOT_FOUND: /elsewhere/params")))
    # CI, stop 23: orbax's reads are Tasks; asyncio then says "Task exception was never retrieved"
    task = "Task exception was never retrieved\nfuture: <Task finished name='Task-9' exception=ValueError(...)>"
    assert not ck._drop_unretrieved_read_errors(
        record(task, ValueError(f'NOT_FOUND: at local file "{where}/params/" does not exist')))
    assert ck._drop_unretrieved_read_errors(record(task, ValueError("NOT_FOUND: /elsewhere/params")))
    assert ck._drop_unretrieved_read_errors(record(f"Task was destroyed but it is pending: {where}"))


def test_late_read_errors_are_dropped_from_the_start_of_a_restore_and_until_it_succeeds(tmp_path, monkeypatch):
    """tensorstore's late reads may print (``sys.unraisablehook``, object ``None``) before the
    failed restore's ``except`` runs: "Event loop is closed" is dropped while a restore is in
    flight and after one failed, passed on before any restore and after a successful one; other
    unraisable exceptions always pass."""
    import sys
    import types

    from mempo_jax.run import checkpoint as ck

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    monkeypatch.setattr(ck, "_failed_restores", set())
    monkeypatch.setattr(ck, "_late_read_filters_installed", False)  # installed on the recording hook
    monkeypatch.setattr(ck.logging.getLogger("asyncio"), "filters", [])
    closed, other = RuntimeError("Event loop is closed"), RuntimeError("something else")

    def raise_unraisable(e):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=None,
                                                 err_msg=None, object=None))

    raise_unraisable(closed)  # before any restore: passed on
    with ck._quiet_late_reads(str(tmp_path / "checkpoints" / "4")):
        raise_unraisable(closed)  # during the restore: dropped
        raise_unraisable(other)
    raise_unraisable(closed)  # after a successful restore: passed on
    with pytest.raises(OSError), ck._quiet_late_reads(str(tmp_path / "checkpoints" / "6")):
        raise OSError("unreadable")
    raise_unraisable(closed)  # after the failed restore: dropped
    raise_unraisable(other)
    assert seen == ["Event loop is closed", "something else", "Event loop is closed", "something else"]
    assert ck._failed_restores == {str(tmp_path / "checkpoints" / "6"), str((tmp_path / "checkpoints" / "6").resolve())}
