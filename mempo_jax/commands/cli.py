"""What the command-line tools share: the name a usage line shows, and the start-up guard against
a TPU probe on a host without TPU chips (``skip_absent_tpu``)."""

from __future__ import annotations

import importlib.util
import os
import sys


def command_name(module: str) -> str:
    """The command as the user ran it, for ``argparse``'s ``prog``: the console script's name
    (``mempo-train``, installed by ``pyproject.toml``) when run as one, else ``python -m module``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("mempo-") else f"python -m {module}"


def skip_absent_tpu() -> None:
    """Sets ``JAX_PLATFORMS=cpu`` when ``libtpu`` is installed, no TPU chip is attached and
    ``JAX_PLATFORMS`` is unset, before JAX starts a backend.

    Why: with ``JAX_PLATFORMS`` unset, JAX initialises every backend it knows; once ``libtpu`` is
    installed (``mempo-jax[tpu]``, or the test requirements, which compile TPU programs on any host)
    that includes loading libtpu, which on a host without chips fails and writes several lines of
    errors to stderr ("could not determine TPU accelerator type", "unexpected worker hostname")
    before JAX falls back to the CPU. Compiling for a TPU topology
    (``jax.experimental.topologies``) needs no TPU backend, so ``cpu`` loses nothing. A host with a
    visible NVIDIA GPU, or any TPU chip (JAX's own PCI check), is left alone, and so is a set
    ``JAX_PLATFORMS``. Subprocesses inherit the variable.
    """
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    try:
        from jax._src import hardware_utils  # JAX's own check, the one its TPU start-up makes
        chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]
        gpu = hardware_utils.has_visible_nvidia_gpu()
    except (ImportError, AttributeError):  # a JAX without them: leave the platforms to JAX
        return
    if chips or gpu:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # already imported: its flag read the environment then
        import jax

        jax.config.update("jax_platforms", "cpu")
