"""The RL update's seconds per row on SmolLM2-135M-Instruct, with gin bindings side by side.

One PPO epoch of the SmolLM2 recipe's learner (``Learner.ppo_update`` with the recipe's loss,
mini-batches, row bound, micro-batch, rematerialisation, LM-head chunk and attention bindings of
``configs/smollm2_hotpotqa.gin``) over ``--rows`` training rows of ``--length`` columns whose real
lengths follow the recipe's (uniform over 20–80 % of the row, each ending in loss tokens on its
last quarter), so the update packs them end to end as in a run. Tokens are random ids: the cost
does not depend on them. ``--rows_npz FILE`` replays rows saved from a run instead (``input_ids,
valid, loss_mask, old_logprobs, ref_logprobs, advantages [R, L]``).

The first epoch compiles and is not timed; the next ``--epochs`` are, on the same rows and the
same shuffle. Each arm runs in a process of its own, so its peak RSS (``ru_maxrss``: weights,
optimizer state, XLA's buffers) is its own. Page faults per timed epoch (``ru_minflt``) count
the pages the update touches fresh: on CPU, XLA buffers over glibc's mmap threshold (32 MiB at
most, 64 MiB in a thread's arena) are mapped and unmapped on every use, so each use re-faults them
(docs/log/2026-12.md, "Host memory between phases"). ``--against BINDING`` (repeatable, e.g.
``ExecutionConfig.micro_batch_rows=2`` or ``ExecutionConfig.remat="none"``) adds an arm with those
bindings and prints it over the recipe's.

Run: ``python benchmarks/bench_update.py [--checkpoint DIR] [--rows 64] [--length 512] [--epochs 2]
[--against BINDING ...] [--rows_npz FILE] [--json out.json]`` (``--small``: 8 rows of 64 columns,
one epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from common import REPO, add_binding_arms, child_figures, parser, setup_platform, smollm2_checkpoint, table, write_json


def synthetic_rows(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """``rows`` right-padded training rows of ``length`` columns: real lengths uniform over 20–80 %
    of ``length``, loss tokens on the last quarter of each (never column 0), log-probs near a
    sampled policy's, advantages ±1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(int(0.2 * length), int(0.8 * length) + 1, rows)
    cols = np.arange(length)[None]
    valid = cols < lengths[:, None]
    loss = valid & (cols >= np.maximum(lengths - lengths // 4, 1)[:, None])
    f32 = lambda x: np.where(loss, x, 0.0).astype(np.float32)  # noqa: E731
    return {"input_ids": np.where(valid, rng.integers(0, vocab, (rows, length)), 0).astype(np.int32),
            "valid": valid, "loss_mask": f32(1.0), "old_logprobs": f32(rng.normal(-1.0, 0.3, (rows, length))),
            "ref_logprobs": f32(rng.normal(-1.0, 0.3, (rows, length))),
            "advantages": f32(rng.choice([-1.0, 1.0], (rows, 1)) * np.ones((1, length)))}


def _one_arm(checkpoint: str, rows: int, length: int, epochs: int, rows_npz: str | None, bindings=()) -> dict:
    """The recipe's learner (with ``bindings`` on top): one compiling epoch, then ``epochs`` timed."""
    import jax
    import numpy as np

    from mempo_jax.config_loader import load_config
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.rl.learner import Learner, make_optimizer
    from mempo_jax.rl.bounds import training_row_bound
    from mempo_jax.run.experiment import load_checkpoint_policy

    cfg = load_config([str(REPO / "configs" / "smollm2_hotpotqa.gin")],
                      [f'ModelOptions.checkpoint="{checkpoint}"', *bindings])
    model_cfg, graphdef, weights, _ = load_checkpoint_policy(cfg.model)
    ex, rl = cfg.execution, cfg.rl
    learner = Learner(make_logits_fn(graphdef, **ex.forward_options), weights, make_optimizer(cfg.optim),
                      temperature=rl.rollout.temperature, micro_batch_rows=ex.micro_batch_rows)
    batch = dict(np.load(rows_npz)) if rows_npz else synthetic_rows(rows, length, model_cfg.vocab_size)
    n = len(batch["valid"])
    times, faults = [], []
    for epoch in range(epochs + 1):
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        learner.ppo_update(batch, rl.loss, rl.num_mini_batches, np.random.default_rng(0), max_rows=training_row_bound(rl))
        jax.block_until_ready(learner.params)
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    epoch_s = float(np.median(times[1:]))
    return {"rows": n, "tokens": int(np.asarray(batch["valid"]).sum()), "micro_batch_rows": ex.micro_batch_rows,
            "remat": ex.remat, "first_epoch_s": times[0], "epoch_s": epoch_s, "epochs_s": times[1:],
            "s_per_row": epoch_s / n, "page_faults": float(np.median(faults[1:])), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> dict:
    """Run the arms; print the table; return (and with ``--json`` write) the figures."""
    p = parser(__doc__.split("\n\n")[0])
    add_binding_arms(p, "gin binding of a second arm, reported over the recipe's (repeatable)")
    p.add_argument("--rows", type=int, default=64, help="training rows (default 64: one RL step of the recipe)")
    p.add_argument("--length", type=int, default=512, help="columns per row (default 512: the recipe's row bucket)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the compiling one")
    p.add_argument("--rows_npz", default=None, help="replay these rows (an .npz of [R, L] arrays) instead")
    p.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    setup_platform(a.device)
    if a.small:
        a.rows, a.length, a.epochs = 8, 64, 1
    a.checkpoint = smollm2_checkpoint(a.checkpoint)
    if a.arm:  # the child: one arm, its figures as the last stdout line
        print(json.dumps(_one_arm(a.checkpoint, a.rows, a.length, a.epochs, a.rows_npz, a.binding)))
        raise SystemExit(0)
    arms = {"recipe": ()} | ({"bindings": tuple(a.against)} if a.against else {})
    args = ["--arm", "--checkpoint", a.checkpoint, "--rows", str(a.rows), "--length", str(a.length),
            "--epochs", str(a.epochs), "--device", a.device] + (["--rows_npz", os.path.abspath(a.rows_npz)]
                                                                  if a.rows_npz else [])
    results = {name: child_figures(__file__, args, bindings) for name, bindings in arms.items()}
    keys = ("first_epoch_s", "epoch_s", "s_per_row", "page_faults", "peak_rss_gib")
    lines = [[name, r["micro_batch_rows"], r["remat"]] + [r[k] for k in keys] for name, r in results.items()]
    if a.against:
        lines.append(["bindings / recipe", "", ""] + [results["bindings"][k] / results["recipe"][k] for k in keys])
    r = results["recipe"]
    title = (f"PPO update, SmolLM2-135M-Instruct, {r['rows']} rows ({r['tokens']} tokens) x {a.length} columns"
             + (f"; bindings: {' '.join(a.against)}" if a.against else ""))
    print(table(title, ["arm", "micro-batch", "remat", "first epoch s (compile)", "epoch s", "s per row",
                        "page faults / epoch", "peak RSS GiB"], lines))
    return write_json(a.json, "update", {"rows": a.rows, "length": a.length, "epochs": a.epochs,
                                         "rows_npz": a.rows_npz, "checkpoint": a.checkpoint, "against": a.against},
                      results)


if __name__ == "__main__":
    main(sys.argv[1:])
