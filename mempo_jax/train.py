"""The main job: ``python -m mempo_jax.train --run_dir DIR [--gin_file F] [--gin_param B]``.

Stages (the default ``configs/tiny_world.gin`` runs all of them on CPU in minutes):

1. build the world (or read real data), the BM25 tools, the tokenizer and the model;
2. cold-start SFT on the scripted agent's trajectories;
3. evaluation of the SFT policy on held-out questions in every context mode;
4. MemPO RL (rollout → outcome + memory rewards → grouped advantages → PPO), with a progress bar,
   ``metrics.jsonl``, TensorBoard events and sample rollouts in ``rollouts.jsonl``;
5. evaluation after RL; the before/after table is printed and written to ``summary.json``
   with the bootstrap 95 % CI of the k = 1 EM gain; an orbax checkpoint is saved.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

DEFAULT_GIN = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_world.gin")


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mempo_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", required=True, help="output folder (metrics, summary, checkpoints)")
    p.add_argument("--gin_file", action="append", default=None, help=f"gin config (default {DEFAULT_GIN})")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. RLConfig.steps=10")
    p.add_argument("--cache_dir", default=None, help="tokenizer cache (default RUN_DIR/../.cache or $MEMPO_CACHE)")
    return p.parse_args(argv)


def _trajectory_record(tr, tokenizer) -> dict:
    return {
        "question_id": tr.question_id, "group": tr.group_id, "golds": tr.golds, "answer": tr.answer,
        "end": tr.end_reason,
        "turns": [{"text": tokenizer.decode(t.output_ids), "information": tokenizer.decode(t.observation_ids),
                   "mem_span": t.mem_span, "context_tokens": t.context_len} for t in tr.turns],
    }


def run(args) -> dict:
    """Run every stage; returns the summary written to ``RUN_DIR/summary.json``."""
    from mempo_jax import config as config_lib
    from mempo_jax.agent.trajectory import mode_name, parse_context_steps
    from mempo_jax.checkpoint import Checkpointer, save_run_artifacts
    from mempo_jax.data.scripted_agent import scripted_trajectory
    from mempo_jax.evaluation import evaluate_policy
    from mempo_jax.experiment import build_experiment
    from mempo_jax.learner import Learner, make_optimizer
    from mempo_jax.metrics import MetricsWriter, bootstrap_ci, format_eval_table, write_json_atomic
    from mempo_jax.rl_step import rl_step
    from mempo_jax.experiment import entity_token_ids
    from mempo_jax.sft import copy_rows, run_sft, sft_rows

    t_start = time.time()
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "MEMPO_XLA_CACHE", str(pathlib.Path.home() / ".cache" / "mempo_jax" / "xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    run_dir = pathlib.Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_lib.load_config(args.gin_file or [DEFAULT_GIN], args.gin_param)
    (run_dir / "config.gin").write_text(config_lib.operative_config(), encoding="utf-8")
    cache = args.cache_dir or os.environ.get("MEMPO_CACHE") or str(run_dir / ".cache")

    exp = build_experiment(cfg, cache)
    tok = exp.tokenizer
    save_run_artifacts(run_dir, tok, exp.model_cfg)
    print(f"[mempo] {cfg.dataset}: {len(exp.train_questions)} train / {len(exp.heldout_questions)} held-out "
          f"questions, {len(exp.documents)} passages, vocab {tok.vocab_size}, "
          f"model {exp.model_cfg.num_params() / 1e6:.2f} M params", flush=True)
    writer = MetricsWriter(run_dir)
    rng = np.random.default_rng(cfg.seed)
    key = jax.random.PRNGKey(cfg.seed)
    train_steps = cfg.rl.rollout.context_steps

    # ---- 2. cold-start SFT ----------------------------------------------------------------
    learner = Learner(exp.logits_fn, exp.params, make_optimizer(cfg.sft.optim), micro_batch_rows=cfg.sft.batch_rows)
    if cfg.sft.steps > 0:
        scripted = [scripted_trajectory(q, exp.offices, tok, exp.tool_env, cfg.sft.agent, cfg.rl.rollout, rng)
                    for q in tqdm(exp.train_questions, desc="scripted agent", leave=False)]
        rows = sft_rows(scripted, train_steps, cfg.sft.full_fraction, tok.pad_id, rng)
        rows += copy_rows(entity_token_ids(tok, exp.documents), int(cfg.sft.copy_fraction * len(rows)),
                          tok.bos_id, rng)
        bar = tqdm(total=cfg.sft.steps, desc="SFT")

        def on_sft(step, m):
            bar.update(1)
            bar.set_postfix(loss=f"{m['sft/loss']:.3f}")
            writer.write(step, "sft", m)

        run_sft(learner, rows, cfg.sft.steps, cfg.sft.batch_rows, tok.pad_id, rng, on_sft)
        bar.close()

    # ---- 3./5. evaluation -----------------------------------------------------------------
    held = exp.heldout_questions[: cfg.eval.num_questions or None]
    modes = [parse_context_steps(m) for m in cfg.eval.context_modes]
    eval_key = jax.random.fold_in(key, 10_000)

    def evaluate(stage: str):
        out, per_q = {}, {}
        for mode in modes:
            bar = tqdm(total=len(held), desc=f"eval {stage} {mode_name(mode)}", leave=False)
            res = evaluate_policy(exp.sample_fn, learner.params, held, tok, exp.tool_env, cfg.rl.rollout, mode,
                                  cfg.eval.temperature, eval_key, progress=lambda n: bar.update(n - bar.n))
            bar.close()
            out[mode_name(mode)], per_q[mode_name(mode)] = res.metrics, res.per_question_em
            writer.write(learner.num_updates, f"eval_{stage}_{mode_name(mode)}", res.metrics)
            print(f"[mempo] eval {stage} {mode_name(mode)}: EM {res.metrics['em']:.3f} F1 {res.metrics['f1']:.3f} "
                  f"TT {res.metrics['tt']:.0f} PT {res.metrics['pt']:.0f}", flush=True)
        return out, per_q

    evals, per_q = {}, {}
    evals["sft"], per_q["sft"] = evaluate("sft")

    # ---- 4. MemPO RL ----------------------------------------------------------------------
    ref_params = jax.tree.map(lambda x: x.copy(), learner.params)  # frozen reference policy
    learner = Learner(exp.logits_fn, learner.params, make_optimizer(cfg.optim),
                      temperature=cfg.rl.rollout.temperature, micro_batch_rows=32)
    import grain

    order = iter(grain.MapDataset.range(len(exp.train_questions)).shuffle(seed=cfg.seed).repeat()
                 .batch(cfg.rl.questions_per_step))
    rollout_log = open(run_dir / "rollouts.jsonl", "a", encoding="utf-8")
    bar = tqdm(total=cfg.rl.steps, desc="MemPO RL")
    for step in range(cfg.rl.steps):
        qs = [exp.train_questions[int(i)] for i in next(order)]
        m, trajs = rl_step(learner, ref_params, exp.sample_fn, exp.scorer, qs, tok, exp.tool_env, cfg.rl,
                           jax.random.fold_in(key, step), rng)
        writer.write(step, "rl", m)
        for tr in trajs[: cfg.log_rollouts]:
            rollout_log.write(json.dumps({"step": step, **_trajectory_record(tr, tok)}) + "\n")
        rollout_log.flush()
        bar.update(1)
        bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", em=f"{m['critic/em/mean']:.3f}",
                        mem=f"{m['mem/reward/mean']:+.3f}", turns=f"{m['num_turns/mean']:.1f}")
    bar.close()
    rollout_log.close()

    evals["rl"], per_q["rl"] = evaluate("rl")

    # ---- summary and checkpoint -----------------------------------------------------------
    k1 = mode_name(modes[0])
    gain = per_q["rl"][k1] - per_q["sft"][k1]
    lo, hi = bootstrap_ci(gain, cfg.eval.bootstrap_samples, seed=cfg.seed)
    summary = {
        "eval": evals, "em_gain": float(gain.mean()), "em_gain_ci95": [lo, hi], "em_gain_mode": k1,
        "wall_s": time.time() - t_start, "params": exp.model_cfg.num_params(), "dataset": cfg.dataset,
        "heldout_questions": len(held),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    ckpt = Checkpointer(run_dir / "checkpoints")
    ckpt.save(learner.num_updates, learner.params, learner.opt_state,
              {"stage": "rl", "step": cfg.rl.steps, "updates": learner.num_updates, "seed": cfg.seed})
    ckpt.close()
    writer.close()
    print("\n" + format_eval_table(evals))
    print(f"\n[mempo] {k1} EM gain RL - SFT: {gain.mean():+.3f}  95% CI [{lo:+.3f}, {hi:+.3f}]  "
          f"wall {summary['wall_s'] / 60:.1f} min  -> {run_dir / 'summary.json'}", flush=True)
    return summary


def main(argv=None) -> int:
    """CLI entry point; a config or data error prints one line and exits 2."""
    args = _parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
