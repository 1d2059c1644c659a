"""LoRA against full fine-tuning on SmolLM2-135M-Instruct: seconds per training step and peak RSS.

One gradient step of the recipe's learner (``Learner.sft_step``: forward, backward and AdamW over
a batch of ``--rows`` rows of ``--length`` tokens in micro-batches of
``ExecutionConfig.micro_batch_rows``, the layers rematerialised as the recipe binds) on the
converted checkpoint, once with the adapters of ``configs/smollm2_hotpotqa_lora.gin`` (rank 16 on
every projection, the base frozen) and once with every parameter trained (``LoraConfig.rank =
0``). The RL update runs the same forward and backward over its packed rows, so the ratio is the
update's. Each mode runs in a process of its own (``--mode``), so its peak RSS
(``ru_maxrss``: weights, optimizer state, XLA's buffers) is its own; the first step compiles
and is not timed, the next ``--steps`` are. Tokens are random ids: the cost does not depend on
them.

``--against BINDING`` (repeatable, a gin binding such as
``ExecutionConfig.logit_chunk_tokens=64``) runs each mode a second time with those bindings and
prints the second run over the first: what a memory binding costs in seconds per step and gives
in peak RSS, side by side on the same rows.

Run: ``python benchmarks/bench_lora_step.py [--checkpoint DIR] [--rows 8] [--length 512]
[--steps 2] [--modes lora full] [--against BINDING ...] [--json out.json]`` (``--small``: 2 rows of
64 tokens, one step).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from common import REPO, add_binding_arms, child_figures, parser, setup_platform, smollm2_checkpoint, table, write_json

MODES = ("lora", "full")


def _one_mode(mode: str, checkpoint: str, rows: int, length: int, steps: int, bindings=()) -> dict:
    """Build the recipe's learner in ``mode`` (with the gin ``bindings`` on top) and time ``steps``
    SFT steps after a compiling one."""
    import jax
    import numpy as np

    from mempo_jax.config_loader import load_config
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.model.adapters import add_adapters
    from mempo_jax.model.lora import split_trainable
    from mempo_jax.rl.learner import Learner, make_optimizer
    from mempo_jax.run.experiment import load_checkpoint_policy

    params = [f'ModelOptions.checkpoint="{checkpoint}"']
    if mode == "full":
        params += ["LoraConfig.rank=0"]
    params += list(bindings)
    cfg = load_config([str(REPO / "configs" / "smollm2_hotpotqa_lora.gin")], params)
    model_cfg, graphdef, weights, _ = load_checkpoint_policy(cfg.model)
    if cfg.lora.enabled:
        model_cfg, graphdef, weights = add_adapters(model_cfg, weights, cfg.lora, cfg.seed)
    ex = cfg.execution
    logits_fn = make_logits_fn(graphdef, **ex.forward_options)
    learner = Learner(logits_fn, weights, make_optimizer(cfg.sft.optim), micro_batch_rows=ex.micro_batch_rows)
    trainable = split_trainable(weights)[0]
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, model_cfg.vocab_size, (rows, length)).astype(np.int32),
             "valid": np.ones((rows, length), bool), "loss_mask": np.ones((rows, length), np.float32)}
    t0 = time.perf_counter()
    learner.sft_step(batch)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        learner.sft_step(batch)
        jax.block_until_ready(learner.params)
        times.append(time.perf_counter() - t0)
    return {"mode": mode, "trained_params": int(sum(x.size for x in jax.tree.leaves(trainable))),
            "first_step_s": first, "step_s": float(np.median(times)), "steps_s": times,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    add_binding_arms(p, "gin binding of a second run of each mode, reported over the first (repeatable)")
    p.add_argument("--rows", type=int, default=8, help="rows per step (default 8: the recipe's micro-batch)")
    p.add_argument("--length", type=int, default=512, help="tokens per row (default 512: the recipe's packed rows)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode after the compiling one")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (default: both)")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    setup_platform(a.device)
    if a.small:
        a.rows, a.length, a.steps = 2, 64, 1
    a.checkpoint = smollm2_checkpoint(a.checkpoint)
    if a.mode:  # the child: one mode, its figures as the last stdout line
        print(json.dumps(_one_mode(a.mode, a.checkpoint, a.rows, a.length, a.steps, a.binding)))
        return 0
    arms = [(m, m, ()) for m in a.modes] + [(f"{m} + bindings", m, a.against) for m in a.modes if a.against]
    args = ["--checkpoint", a.checkpoint, "--rows", str(a.rows), "--length", str(a.length), "--steps", str(a.steps),
            "--device", a.device]
    results = {name: child_figures(__file__, ["--mode", mode, *args], bindings) for name, mode, bindings in arms}
    keys = ("trained_params", "first_step_s", "step_s", "peak_rss_gib")
    rows = [[m] + [r[k] for k in keys] for m, r in results.items()]
    pairs = [("lora", "full")] if {"lora", "full"} <= set(results) else []
    pairs += [(f"{m} + bindings", m) for m in a.modes if a.against]
    rows += [[f"{x} / {y}"] + [results[x][k] / results[y][k] for k in keys] for x, y in pairs]
    title = f"LoRA vs full fine-tuning, SmolLM2-135M-Instruct, {a.rows} rows x {a.length} tokens per step"
    if a.against:
        title += f"; bindings: {' '.join(a.against)}"
    print(table(title, ["mode", "trained params", "first step s (compile)", "step s", "peak RSS GiB"], rows))
    write_json(a.json, "lora_step", {"rows": a.rows, "length": a.length, "steps": a.steps,
                                      "checkpoint": a.checkpoint, "against": a.against}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
