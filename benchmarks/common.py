"""Shared pieces of the benchmark scripts: the benchmark model, the same weights in transformers,
a compilation counter, timing, tables and JSON.

Every script in ``benchmarks/`` prints a table and, with ``--json PATH``, writes its figures as
JSON (``{"section": ..., "machine": {...}, "config": {...}, "results": ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/x.py` from a fresh clone, no install needed
    sys.path.insert(0, str(REPO))

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch (JAX 0.10)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound once by the OS, then released): a loopback
    ``jax.distributed`` coordinator's or a test server's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ arguments


def child_figures(script: str, args: Sequence[str], bindings: Sequence[str] = ()) -> dict:
    """Run ``script`` (a benchmark's own path) as a child process with ``args`` and each gin
    binding as ``--binding B``, so that its peak RSS is its own; return the JSON object it prints
    on its last stdout line. A failing child: its stderr's tail, then ``SystemExit`` with its status."""
    cmd = [sys.executable, script, *args, *[x for b in bindings for x in ("--binding", b)]]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(out.returncode)
    return json.loads(out.stdout.strip().splitlines()[-1])


def add_binding_arms(p: argparse.ArgumentParser, against: str) -> None:
    """The options of a benchmark whose arms run the SmolLM2 recipe's learner in child processes:
    ``--checkpoint``, ``--against BINDING`` (repeatable; ``against`` is its help) and the
    children's hidden ``--binding``."""
    p.add_argument("--checkpoint", default=None, help="converted SmolLM2 folder (default: python -m mempo_jax.commands.smollm2's)")
    p.add_argument("--against", action="append", default=[], metavar="BINDING", help=against)
    p.add_argument("--binding", action="append", default=[], help=argparse.SUPPRESS)


def shared_data() -> pathlib.Path:
    """The shared QA data folder: ``$MEMPO_SHARED_DATA``, else ``../shared/data`` beside the repository
    (where the recipes' relative data paths point)."""
    return pathlib.Path(os.environ.get("MEMPO_SHARED_DATA", REPO.parent / "shared" / "data"))


def smollm2_checkpoint(folder: str | None) -> str:
    """``folder``, or the converted SmolLM2-135M-Instruct folder of ``python -m mempo_jax.commands.smollm2``."""
    if folder is not None:
        return folder
    from mempo_jax.model.smollm2 import default_dir

    return str(default_dir())


def parser(description: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the options every script shares: ``--json PATH``, ``--small``
    (the smallest configuration: the smoke test's), ``--device cpu|gpu``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument("--small", action="store_true", help="smallest configuration (seconds; the smoke test)")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                   help="JAX platform (gpu: untested on this project's machines; bf16 is not switched on)")
    return p


def setup_platform(device: str) -> None:
    """Pin JAX to ``device`` before it is imported (``JAX_PLATFORMS``); one CPU device unless
    ``XLA_FLAGS`` already says otherwise."""
    os.environ["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"


# ---------------------------------------------------------------------------------------- model


def bench_model_config(small: bool = False):
    """The benchmark model: a Qwen2-shaped decoder (q/k/v biases, GQA, tied embeddings, RoPE
    θ = 1e6), random weights; ~20.1 M parameters (``small``: ~0.1 M, for the smoke test).

    Returns:
      A ``mempo_jax.model.config.ModelConfig``.
    """
    from mempo_jax.model.config import ModelConfig

    if small:
        return ModelConfig(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           mlp_dim=128, rope_theta=1e6, qkv_bias=True, tie_embeddings=True)
    return ModelConfig(vocab_size=16384, embed_dim=384, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=64,
                       mlp_dim=1152, rope_theta=1e6, qkv_bias=True, tie_embeddings=True)


def bench_model(small: bool = False, seed: int = 0):
    """``(cfg, graphdef, params)`` of the benchmark model with random weights.

    Biases and norm weights are randomised too (normal 0.02 / uniform [0.8, 1.2]) so that
    every exported tensor matters in the comparison with transformers.
    """
    import jax
    import numpy as np

    from mempo_jax.model.forward import create_model, split_model

    cfg = bench_model_config(small)
    graphdef, params = split_model(create_model(cfg, seed=seed))
    rng = np.random.default_rng(seed)

    def jitter(path, x):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            return (rng.normal(0.0, 0.02, x.shape)).astype(x.dtype)
        if "norm" in name:
            return rng.uniform(0.8, 1.2, x.shape).astype(x.dtype)
        return x

    params = jax.tree_util.tree_map_with_path(jitter, params)
    params = jax.tree.map(lambda x: jax.numpy.asarray(x), params)
    return cfg, graphdef, params


def hf_same_weights(cfg, params, folder: str | os.PathLike):
    """The same weights in transformers: exported with ``mempo_jax.model.hf_io.save_hf_checkpoint``
    and loaded with ``AutoModelForCausalLM.from_pretrained`` (float32, eval mode, CPU torch).

    Raises:
      ImportError: without torch / transformers (``pip install -r requirements-test.txt``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from mempo_jax.model.hf_io import save_hf_checkpoint

    save_hf_checkpoint(folder, cfg, params)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def have_transformers() -> bool:
    """True when torch and transformers import."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


TUNIX_INSTALL = "pip install --no-deps google-tunix==0.1.7 jaxtyping"


def import_tunix():
    """tunix's sampler and Llama3 modules, imported without running ``tunix/__init__.py`` (which
    imports every trainer and their extra dependencies): a bare ``tunix`` package whose
    ``__path__`` is the installed one stands in ``sys.modules`` first.

    Returns:
      ``(tunix.generate.sampler, tunix.models.llama3.model, tunix.models.llama3.params)``.

    Raises:
      ImportError: tunix is not installed (``TUNIX_INSTALL``) or a module it needs is missing.
    """
    import importlib
    import importlib.util
    import types

    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"tunix is not installed ({TUNIX_INSTALL})")
        package = types.ModuleType("tunix")
        package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["tunix"] = package
    return tuple(importlib.import_module(f"tunix.{name}")
                 for name in ("generate.sampler", "models.llama3.model", "models.llama3.params"))


def tunix_same_weights(cfg, params, folder: str | os.PathLike):
    """The same weights in tunix's ``Llama3`` (float32), read from the transformers folder
    ``folder`` (``save_hf_checkpoint`` output or the converted SmolLM2) by tunix's safetensors
    loader. tunix 0.1.7's attention calls ``apply_rope`` without ``ModelConfig.rope_theta`` (its
    default 1e6 whatever the config says); its module's ``apply_rope`` is replaced with one bound
    to ``cfg.rope_theta`` (process-wide).

    Returns:
      ``(model, sampler module)``.

    Raises:
      ImportError: as ``import_tunix``.
      ValueError: ``cfg`` has RoPE scaling or non-zero q/k/v biases (tunix's Llama3 has neither).
    """
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    sampler_lib, model_lib, params_lib = import_tunix()
    if cfg.rope_scaling is not None:
        raise ValueError(f"{folder}: RoPE scaling {cfg.rope_scaling} has no tunix Llama3 equivalent")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if "bias" in jax.tree_util.keystr(path) and np.any(np.asarray(x)):
            raise ValueError(f"{folder}: non-zero {jax.tree_util.keystr(path)}; tunix's Llama3 has no q/k/v biases")
    rope = getattr(model_lib.apply_rope, "func", model_lib.apply_rope)
    model_lib.apply_rope = functools.partial(rope, rope_theta=cfg.rope_theta)
    tcfg = model_lib.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.embed_dim,
                                 hidden_dim=cfg.mlp_dim, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                 num_kv_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta, norm_eps=cfg.rms_norm_eps,
                                 weight_tying=cfg.tie_embeddings)
    model = params_lib.create_model_from_safe_tensors(str(folder), tcfg, dtype=jnp.float32)
    return model, sampler_lib


def ppo_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """A synthetic ``[rows, length]`` PPO batch (random ids, one sequence per row filling it, every
    token trained on, old / reference log-probs −5, normal advantages), packed as
    ``TrainSteps.ppo_step`` takes it (``segment_ids`` 1, ``positions`` 0 … length − 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1, vocab, (rows, length)).astype(np.int32),
            "segment_ids": np.ones((rows, length), np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
            "valid": np.ones((rows, length), bool), "loss_mask": np.ones((rows, length), np.float32),
            "old_logprobs": np.full((rows, length), -5.0, np.float32),
            "ref_logprobs": np.full((rows, length), -5.0, np.float32),
            "advantages": rng.normal(0, 1, (rows, length)).astype(np.float32)}


def param_count(params) -> int:
    """Number of scalars in a parameter pytree."""
    import jax

    return int(sum(x.size for x in jax.tree.leaves(params)))


# --------------------------------------------------------------------------------- compilations


class CompileCounter:
    """Counts XLA backend compilations (``/jax/core/compile/backend_compile_duration`` events from
    ``jax.monitoring``; a program loaded from the persistent cache counts too, as it is a new
    shape for the process). Listeners cannot be removed: make one per process and read deltas.

    Attributes:
      events: ``[(fun_name, seconds)]`` in order.
    """

    def __init__(self):
        import jax

        self.events: list[tuple[str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kw) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.events.append((str(kw.get("fun_name", "?")), float(duration)))

    @property
    def count(self) -> int:
        """Compilations so far."""
        return len(self.events)

    def since(self, mark: int) -> list[str]:
        """Names of the functions compiled after ``count`` was ``mark``."""
        return [name for name, _ in self.events[mark:]]

    def seconds_since(self, mark: int) -> float:
        """Seconds spent compiling after ``count`` was ``mark``."""
        return sum(d for _, d in self.events[mark:])


# --------------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()`` (it must block until its result is ready)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(named: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time several implementations of the same work, interleaved (A B A B …) after ``warmup``
    untimed calls each, so that a change in machine load hits them alike.

    Returns:
      ``{name: [seconds of each timed run]}``.
    """
    for fn in named.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {k: [] for k in named}
    for _ in range(repeats):
        for k, fn in named.items():
            out[k].append(timed(fn))
    return out


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(xs))


# ------------------------------------------------------------------------------ machine, output


def machine_info() -> dict:
    """The machine the figures come from: CPU model, cores, load average, JAX backend, versions."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "cores": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = len(jax.devices())
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import torch
        import transformers

        info["torch"], info["transformers"] = torch.__version__, transformers.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table with a title line; floats with 4 significant digits."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike | None, section: str, config: dict, results: Any) -> dict:
    """``{"section", "machine", "config", "results"}``; written to ``path`` when given."""
    doc = {"section": section, "machine": machine_info(), "config": config, "results": results}
    if path:
        p = pathlib.Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=2, default=float) + "\n", encoding="utf-8")
    return doc


# ------------------------------------------------------------------------- small tiny-world runs

# The smoke tests' tiny world and model (as tests/test_train_e2e.py): gin bindings on
# configs/tiny_world.gin for a run that builds, trains and evaluates in seconds of compute.
SMALL_WORLD_PARAMS = (
    "WorldConfig.num_people=60", "WorldConfig.num_companies=20", "WorldConfig.num_cities=16",
    "WorldConfig.num_countries=4", "WorldConfig.num_single=30", "WorldConfig.num_bridge=20", "WorldConfig.num_multi=30",
    "ExperimentConfig.vocab_size=600",
    'ModelOptions.overrides=(("num_layers", 1), ("embed_dim", 32), ("num_heads", 2), ("num_kv_heads", 1), '
    '("head_dim", 16), ("mlp_dim", 64))',
)
TINY_WORLD_GIN = str(REPO / "configs" / "tiny_world.gin")


class WorldRun(NamedTuple):
    """A tiny-world run folder's policy, world and tools, as the trainer built them.

    Attributes:
      cfg: the run's ``ExperimentConfig`` (from its ``config.gin``).
      world: the generated world (``build_world(cfg.world)``).
      tokenizer, model_cfg, graphdef, params: the checkpoint's policy (``load_policy``).
      fmt: its ``AgentFormat``; tool_env: BM25 over the world's passages at the run's top-k.
      description: ``"RUN (stage @ step)"``, for titles.
    """

    cfg: Any
    world: Any
    tokenizer: Any
    model_cfg: Any
    graphdef: Any
    params: Any
    fmt: Any
    tool_env: Any
    description: str


def tiny_world_run(run_dir, stage: str = "rl", step=None) -> WorldRun:
    """A tiny-world run's policy, world and tools (``WorldRun``).

    Args:
      run_dir: a run folder of ``python -m mempo_jax.commands.train`` (``config.gin``, tokenizer, checkpoints).
      stage: ``"rl"`` (``checkpoints/``) or ``"sft"`` (``sft_checkpoint/``).
      step: checkpoint step (default: the newest).

    Raises:
      ValueError: the run is not a tiny-world run; FileNotFoundError: a missing file or checkpoint.
    """
    from mempo_jax.run.checkpoint import load_policy
    from mempo_jax.config_loader import load_config
    from mempo_jax.data.world import build_world
    from mempo_jax.run.run_folder import run_policy_format
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    run_dir = pathlib.Path(run_dir)
    cfg = load_config([str(run_dir / "config.gin")])
    if cfg.dataset != "tiny_world":
        raise ValueError(f"{run_dir} is a {cfg.dataset!r} run; this script reads tiny-world runs")
    world = build_world(cfg.world)
    tokenizer, model_cfg, graphdef, params = load_policy(run_dir, step, folder="sft_checkpoint" if stage == "sft"
                                                         else "checkpoints")
    fmt = run_policy_format(run_dir, tokenizer)
    env = search_environment(BM25Index(world.documents), topk=cfg.topk)
    return WorldRun(cfg, world, tokenizer, model_cfg, graphdef, params, fmt, env,
                    f"{run_dir} ({stage}{'' if step is None else f' @ {step}'})")


def tiny_world_policy(run_dir, stage: str = "rl", step=None):
    """A tiny-world run's policy and tools, as the trainer evaluates them (``tiny_world_run`` with
    the policy's rollout engine).

    Returns:
      ``(cfg, world, sample_fn, params, fmt, tool_env, rollout_cfg, description)``.

    Raises:
      as ``tiny_world_run``.
    """
    from mempo_jax.run.experiment import make_engine

    r = tiny_world_run(run_dir, stage, step)
    return (r.cfg, r.world, make_engine(r.graphdef, r.model_cfg, r.fmt), r.params, r.fmt, r.tool_env,
            r.cfg.rl.rollout, r.description)
