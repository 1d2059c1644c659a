"""Section 6: roofline — achieved FLOP/s of the PPO update step and of decode, against this
machine's peak measured by a large ``jnp.dot``.

* Peak: the best of several ``[n, n] @ [n, n]`` float32 products (``2 n³`` FLOPs each).
* Update: one ``TrainSteps.ppo_step`` (forward + backward + AdamW) of the benchmark model on a
  ``[rows, L]`` batch as one micro-batch; FLOPs from XLA's cost analysis of the compiled
  program (cross-checked with the analytic ``3 × forward``).
* Decode: the sampler's per-token step, isolated as ``(t(N2) − t(N1)) / (N2 − N1)`` between two
  greedy generations of N1 and N2 new tokens (the prefill cancels); FLOPs per step analytic:
  ``batch × (2 × matmul params + 2 × D × V + 4 × S × H × head_dim × layers)`` (S = KV-cache
  slots, which the step attends over in full, masked).

Run: ``python benchmarks/bench_roofline.py [--json out.json] [--small]``.
"""

from __future__ import annotations

import sys

from common import bench_model, median, parser, ppo_batch, setup_platform, table, timed, write_json


def matmul_params(cfg) -> int:
    """Parameters that take part in per-token matmuls, LM head excluded (the embedding lookup is free)."""
    d, h, k, hd, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    return cfg.num_layers * (d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * f)


def forward_flops(cfg, rows: int, length: int) -> float:
    """Analytic FLOPs of one ``[rows, length]`` forward pass: matmuls + LM head + full L×L attention."""
    per_token = 2 * matmul_params(cfg) + 2 * cfg.embed_dim * cfg.vocab_size
    attn = 4 * length * length * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return float(rows * (length * per_token + attn))


def main(argv=None) -> dict:
    """Measure peak, update and decode FLOP/s; print the table; return (and write) the JSON."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dot", type=int, default=None, help="n of the peak [n, n] matmul (default 2048)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    setup_platform(args.device)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.rl.losses import LossConfig
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.agent.engine import RolloutEngine

    small = args.small
    n = args.dot or (256 if small else 2048)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    dot = jax.jit(lambda x, y: x @ y)
    dot(a, a).block_until_ready()
    peak_s = min(timed(lambda: dot(a, a).block_until_ready()) for _ in range(max(args.repeats, 3)))
    peak = 2 * n**3 / peak_s

    cfg, graphdef, params = bench_model(small)
    rows, length = (4, 32) if small else (16, 256)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig()), micro_batch_rows=rows)
    rng = np.random.default_rng(0)
    batch = ppo_batch(rows, length, cfg.vocab_size)
    loss = LossConfig()
    compiled = learner.steps.lower_ppo(learner.state, rows, length, 1, loss).compile()
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        xla_flops = float(ca.get("flops", 0.0))
    except Exception:  # noqa: BLE001 - cost analysis is optional per backend
        xla_flops = 0.0
    analytic = 3 * forward_flops(cfg, rows, length)

    def update():
        learner.state, m = learner.steps.ppo_step(learner.state, batch, 1, loss)
        jax.block_until_ready(m)

    update()
    upd_s = median([timed(update) for _ in range(args.repeats)])
    upd_flops = xla_flops if xla_flops > 0 else analytic

    sampler = RolloutEngine(graphdef, cfg, stop_ids=(), pad_id=0)
    b, prompt = (4, 16) if small else (16, 128)
    n1, n2 = (4, 12) if small else (16, 80)
    ids = rng.integers(1, cfg.vocab_size, (b, prompt)).astype(np.int32)
    mask = np.ones((b, prompt), bool)
    gen = {k: (lambda k=k: jax.block_until_ready(sampler(learner.params, ids, mask, jax.random.PRNGKey(0),
                                                         k, 0.0).tokens)) for k in (n1, n2)}
    for f in gen.values():
        f()
    t1 = median([timed(gen[n1]) for _ in range(args.repeats)])
    t2 = median([timed(gen[n2]) for _ in range(args.repeats)])
    step_s = max(t2 - t1, 1e-9) / (n2 - n1)
    slots = prompt + n2
    step_flops = b * (2 * matmul_params(cfg) + 2 * cfg.embed_dim * cfg.vocab_size
                      + 4 * slots * cfg.num_heads * cfg.head_dim * cfg.num_layers)
    weight_bytes = 4 * (matmul_params(cfg) + cfg.embed_dim * cfg.vocab_size)
    res = {
        "peak": {"n": n, "seconds": peak_s, "flop_s": peak},
        "update": {"rows": rows, "length": length, "seconds": upd_s, "flops_xla": xla_flops, "flops_analytic": analytic,
                   "flop_s": upd_flops / upd_s, "fraction_of_peak": upd_flops / upd_s / peak},
        "decode": {"batch": b, "cache_slots": slots, "step_seconds": step_s, "flops_per_step": step_flops,
                   "flop_s": step_flops / step_s, "fraction_of_peak": step_flops / step_s / peak,
                   "weight_bytes_per_step": weight_bytes, "weight_stream_gb_s": weight_bytes / step_s / 1e9,
                   "tokens_per_s": b / step_s},
    }
    print(table(f"Roofline (float32; peak = best [{n},{n}] jnp.dot)",
                ["program", "shape", "GFLOP / call", "seconds / call", "GFLOP/s", "of peak"],
                [["jnp.dot (peak)", f"[{n},{n}]x[{n},{n}]", 2 * n**3 / 1e9, peak_s, peak / 1e9, 1.0],
                 ["PPO update step", f"[{rows},{length}]", upd_flops / 1e9, upd_s, upd_flops / upd_s / 1e9,
                  res["update"]["fraction_of_peak"]],
                 ["decode step", f"[{b},1] over {slots} slots", step_flops / 1e9, step_s, step_flops / step_s / 1e9,
                  res["decode"]["fraction_of_peak"]]]))
    print(f"update FLOPs: XLA cost analysis {xla_flops / 1e9:.2f} G, analytic 3 x forward {analytic / 1e9:.2f} G; "
          f"decode streams {weight_bytes / 1e6:.0f} MB of weights per step ({res['decode']['weight_stream_gb_s']:.1f} GB/s)")
    config = {"params": int(sum(x.size for x in jax.tree.leaves(params))), "small": small, "device": args.device,
              "dtype": "float32"}
    return write_json(args.json, "roofline", config, res)


if __name__ == "__main__":
    main(sys.argv[1:])
