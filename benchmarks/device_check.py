"""One prepared check of a lent accelerator: prints ONE JSON line with every figure.

Sections (each one's figures, or ``{"error": ...}`` where it failed, so one failure loses nothing
else; a section not started before ``--budget_s`` seconds is ``{"skipped": ...}``):

* ``env``: backend, device kind and count, versions, the card's peaks (``PEAKS``; ``null`` for a
  device kind not in the table).
* ``parity``: per-token log-probs of random Qwen2-0.5B-shaped weights (``ModelConfig.qwen2_5_0_5b``;
  ``--smoke``: the benchmark's small model) against transformers on the same device, the model in
  float32 and in bfloat16 (transformers then in bfloat16 too): max and mean absolute difference (nats).
* ``decode``: the slot sampler's greedy decode step (``(t(N2) − t(N1)) / (N2 − N1)``, the prefill
  cancels) at batch 1 / 16 / 64, bfloat16 weights and cache, per ``attention_impl`` (``xla`` and the
  backend's kernel strategy, ``resolve_impl("auto")``): tokens/s and MBU = (weight bytes + KV bytes
  read per step) / step seconds / the card's HBM bandwidth.
* ``prefill``: the forward pass over ``[rows, 2048]`` tokens (no cache) per ``attention_impl``: tokens/s.
* ``update``: one PPO update step (forward + backward + AdamW, ``Learner``) in bfloat16 activations
  at the plan's micro-batch rows and training length: TFLOP/s (analytic ``3 × forward``,
  ``bench_roofline.forward_flops``) and MFU against the card's dense bfloat16 peak; ``memory``: the
  device's ``peak_bytes_in_use`` against ``mempo_jax.run.memory_plan``'s parameters + optimizer state + update
  phase for the same shapes on one device (the check holds no reference copy).
* ``rollout``: ``bench_rollout.py --small``: the multi-turn rollout engine against a transformers
  generate-per-turn loop on this device (tokens/s, ratio).

``--smoke`` runs the same code on the CPU at toy sizes, the kernel strategy through
``attention_kernels.interpret_kernels("gpu")`` (Pallas in interpret mode): the suite runs it
(tests/test_benchmarks.py). Run on a GPU: ``python benchmarks/device_check.py`` (docs/benchmarks.md,
"A lent GPU"); on a TPU VM: docs/tpu_pod.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback

from common import median, ppo_batch, timed

# Card peaks: HBM bytes/s and dense bfloat16 FLOP/s (vendor data sheets, SXM parts).
PEAKS = {"H100": {"hbm_bytes_s": 3.35e12, "bf16_flop_s": 989e12},
         "H200": {"hbm_bytes_s": 4.8e12, "bf16_flop_s": 989e12}}

SIZES = {  # full run / --smoke
    "decode_batches": ((1, 16, 64), (4,)), "decode_prompt": (128, 16), "decode_steps": ((16, 80), (2, 6)),
    "prefill": ((8, 2048), (2, 64)), "parity": ((4, 256), (2, 24)),
}


def peaks(kind: str) -> dict:
    """The ``PEAKS`` entry whose name occurs in the device kind (``"NVIDIA H100 80GB HBM3"``), else nulls."""
    return next((v for k, v in PEAKS.items() if k in kind.upper()), {"hbm_bytes_s": None, "bf16_flop_s": None})


def model(smoke: bool, dtype: str):
    """``(cfg, graphdef, params)``: random Qwen2-0.5B-shaped weights (``ModelConfig.qwen2_5_0_5b``;
    smoke: the small benchmark model, ``common.bench_model_config``), activations in ``dtype``."""
    from common import bench_model_config
    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import create_model, split_model

    cfg = (bench_model_config(small=True) if smoke else ModelConfig.qwen2_5_0_5b()).replace(dtype=dtype)
    return (cfg, *split_model(create_model(cfg, seed=0)))


def section_env(ctx) -> dict:
    import importlib.metadata as md

    import jax

    dev = jax.devices()[0]
    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"backend": jax.default_backend(), "device": dev.device_kind, "devices": jax.device_count(),
            "versions": versions, "peaks": ctx["peaks"], "kernel_impl": ctx["kernel"]}


def section_parity(ctx) -> dict:
    import jax
    import numpy as np
    import torch

    from common import hf_same_weights
    from mempo_jax.model.forward import sequence_logprobs

    rows, length = SIZES["parity"][ctx["i"]]
    out = {}
    tdev = "cuda" if torch.cuda.is_available() and ctx["backend"] == "gpu" else "cpu"
    for dtype, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg, graphdef, params = model(ctx["smoke"], dtype)
        ids = np.random.default_rng(1).integers(1, cfg.vocab_size, (rows, length)).astype(np.int32)
        valid = np.ones((rows, length), bool)
        ours = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(graphdef, params, ids, valid)[0])
        with tempfile.TemporaryDirectory() as d:
            hf = hf_same_weights(cfg, params, d).to(device=tdev, dtype=tdt)
            with torch.no_grad():
                logits = hf(torch.as_tensor(ids, device=tdev)).logits.float()
            ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.as_tensor(ids[:, 1:], device=tdev)[..., None].long())
            ref = ref[..., 0].cpu().numpy()
            del hf
        diff = np.abs(ours[:, 1:] - ref)
        out[dtype] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "rows": rows, "length": length}
    out["torch_device"] = tdev
    return out


def _weight_bytes(params) -> int:
    import jax

    return int(sum(x.size * 2 for x in jax.tree.leaves(params)))  # bfloat16 copy of the rollout


def section_decode(ctx) -> dict:
    import jax
    import numpy as np

    from mempo_jax.agent.slot_sampler import SlotSampler

    cfg, graphdef, params = model(ctx["smoke"], "bfloat16" if not ctx["smoke"] else "float32")
    prompt = SIZES["decode_prompt"][ctx["i"]]
    n1, n2 = SIZES["decode_steps"][ctx["i"]]
    item = 2 if cfg.dtype == "bfloat16" else 4
    out = []
    for b in SIZES["decode_batches"][ctx["i"]]:
        ids = np.random.default_rng(b).integers(1, cfg.vocab_size, (b, prompt)).astype(np.int32)
        mask = np.ones((b, prompt), bool)
        for impl in ctx["impls"]:
            with ctx["interpret"]():
                s = SlotSampler(graphdef, cfg, (), 0, attention_impl=impl,
                                param_dtype="bfloat16" if cfg.dtype == "bfloat16" else None)
                p = s.place(params)
                gen = {n: (lambda n=n: jax.block_until_ready(
                    s.generate(p, ids, mask, jax.random.key(0), n, temperature=0.0).tokens)) for n in (n1, n2)}
                for f in gen.values():
                    f()
                t1, t2 = median([timed(gen[n1]) for _ in range(2)]), median([timed(gen[n2]) for _ in range(2)])
            step = (t2 - t1) / (n2 - n1) if t2 > t1 else None  # None: timing noise above the decode's cost
            ctx_len = prompt + (n1 + n2) / 2
            kv = b * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx_len * item
            moved = _weight_bytes(params) * item / 2 + kv
            bw = ctx["peaks"]["hbm_bytes_s"]
            out.append({"batch": b, "attention_impl": impl, "step_s": step,
                        "tokens_per_s": None if step is None else b / step, "bytes_per_step": moved,
                        "mbu": None if bw is None or step is None else moved / step / bw})
    return {"prompt": prompt, "steps": [n1, n2], "runs": out}


def section_prefill(ctx) -> dict:
    import jax
    import numpy as np

    from mempo_jax.model.forward import make_logits_fn

    cfg, graphdef, params = model(ctx["smoke"], "bfloat16" if not ctx["smoke"] else "float32")
    rows, length = SIZES["prefill"][ctx["i"]]
    ids = np.random.default_rng(2).integers(1, cfg.vocab_size, (rows, length)).astype(np.int32)
    valid = np.ones((rows, length), bool)
    out = []
    for impl in ctx["impls"]:
        with ctx["interpret"]():
            fn = jax.jit(make_logits_fn(graphdef, attention_impl=impl).hidden, static_argnums=3)
            run = lambda: jax.block_until_ready(fn(params, ids, valid, "none"))  # noqa: E731
            run()
            s = median([timed(run) for _ in range(3)])
        out.append({"attention_impl": impl, "rows": rows, "length": length, "seconds": s,
                    "tokens_per_s": rows * length / s})
    return {"runs": out}


def plan_config(smoke: bool):
    """The ``(ExperimentConfig, pod)`` whose plan the update section checks: the check's model on one
    device (``v5p-2``: one chip; its HBM figure is unused), micro-batch rows 8 (smoke: 2)."""
    from mempo_jax import config_loader
    from mempo_jax.core import mesh_config

    preset = ('ModelOptions.preset = "tiny"', 'ModelOptions.overrides = (("dtype", "float32"),)') if smoke else (
        'ModelOptions.preset = "qwen2_5_0_5b"', 'ModelOptions.overrides = (("dtype", "bfloat16"),)')
    bindings = ["ExperimentConfig.model = @ModelOptions()", "ExperimentConfig.rl = @RLConfig()",
                "RLConfig.rollout = @RolloutConfig()", *preset,
                f"RolloutConfig.max_context_tokens = {256 if smoke else 2048}",
                f"ExecutionConfig.micro_batch_rows = {2 if smoke else 8}",
                'TPUConfig.accelerator_type = "v5p-2"', "MeshConfig.fsdp = 1", "MeshConfig.tensor = 1"]
    mesh_config.register()
    return config_loader.load_config([], bindings), mesh_config.from_gin()


def section_update(ctx) -> dict:
    import jax

    from bench_roofline import forward_flops
    from mempo_jax.run import memory_plan as plan_lib
    from mempo_jax.model.forward import create_model, make_logits_fn, split_model
    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.rl.losses import LossConfig

    cfg, pod = plan_config(ctx["smoke"])
    plan = plan_lib.build_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    rows, length = plan.shapes["micro_batch_rows"], plan.shapes["train_len"]
    mcfg = plan_lib.model_config(cfg)
    graphdef, params = split_model(create_model(mcfg, seed=0))
    learner = Learner(make_logits_fn(graphdef, **cfg.execution.forward_options), params,
                      make_optimizer(OptimConfig()), micro_batch_rows=rows)
    batch = ppo_batch(rows, length, mcfg.vocab_size)
    loss = LossConfig()

    def step():
        learner.state, m = learner.steps.ppo_step(learner.state, batch, 1, loss)
        jax.block_until_ready(m)

    step()
    s = median([timed(step) for _ in range(3)])
    flops = 3 * forward_flops(mcfg, rows, length)
    peak = ctx["peaks"]["bf16_flop_s"]
    stats = jax.devices()[0].memory_stats() or {}
    planned = plan.params + plan.opt_state + plan.phases["update"]
    measured = stats.get("peak_bytes_in_use")
    return {"rows": rows, "length": length, "dtype": mcfg.dtype, "seconds": s, "tflop_s": flops / s / 1e12,
            "mfu": None if peak is None else flops / s / peak,
            "memory": {"peak_bytes_in_use": measured, "plan_bytes": planned,
                       "measured_over_plan": None if not measured else measured / planned}}


def section_rollout(ctx) -> dict:
    import bench_rollout

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = ["--small", "--engines", "cached,transformers", "--no_decode", "--modes", "full", "--json", f.name]
        args += ["--device", "gpu"] if ctx["backend"] == "gpu" else []
        if ctx["smoke"]:
            args += ["--turns", "2", "--new", "8", "--questions", "2", "--group", "2"]
        with contextlib.redirect_stdout(sys.stderr):
            bench_rollout.main(args)
        return json.load(open(f.name))["results"]


SECTIONS = {"env": section_env, "parity": section_parity, "decode": section_decode, "prefill": section_prefill,
            "update": section_update, "rollout": section_rollout}


def main(argv=None) -> dict:
    """Run the sections in order; print and return the one JSON object."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the same code on the CPU at toy sizes (seconds)")
    p.add_argument("--budget_s", type=float, default=None,
                   help="start no section after this many seconds (default 420; --smoke: no limit)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    args = p.parse_args(argv)
    import jax

    from mempo_jax.model.attention_kernels import interpret_kernels, resolve_impl

    t0 = time.perf_counter()
    backend = jax.default_backend()
    smoke = args.smoke
    kernel = resolve_impl("auto", "gpu" if smoke else backend)
    ctx = {"smoke": smoke, "i": 1 if smoke else 0, "backend": backend,
           "peaks": peaks(jax.devices()[0].device_kind), "kernel": kernel,
           "impls": ("xla",) if kernel == "xla" else ("xla", kernel),
           "interpret": (lambda: interpret_kernels("gpu")) if smoke else contextlib.nullcontext}
    budget = args.budget_s if args.budget_s is not None else (float("inf") if smoke else 420.0)
    out = {"smoke": smoke}
    for name in args.sections.split(","):
        if time.perf_counter() - t0 > budget:
            out[name] = {"skipped": f"past --budget_s {budget:.0f} s"}
            continue
        t = time.perf_counter()
        try:
            out[name] = SECTIONS[name](ctx)
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            traceback.print_exc(file=sys.stderr)
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        out[name + "_s"] = round(time.perf_counter() - t, 2)
    out["total_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
