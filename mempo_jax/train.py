"""The main job: ``python -m mempo_jax.train --run_dir DIR [--gin_file F] [--gin_param B] [--resume]``.

Stages (the default ``configs/tiny_world.gin`` runs all of them on CPU in minutes):

1. build the world (or read real data), the BM25 tools, the tokenizer and the model;
2. cold-start SFT on the scripted agent's trajectories;
3. evaluation of the SFT policy on held-out questions in every context mode;
4. MemPO RL (rollout → outcome + memory rewards → grouped advantages → PPO), with a progress bar,
   ``metrics.jsonl``, TensorBoard events and sample rollouts in ``rollouts.jsonl``;
5. evaluation after RL; the before/after table is printed and written to ``summary.json``
   with the bootstrap 95 % CI of the k = 1 EM gain.

Checkpoints, resume and preemption (docs/resume.md). Orbax checkpoints are saved asynchronously
every ``CheckpointConfig.every_steps`` steps and at the end of each stage: SFT to
``RUN_DIR/sft_checkpoint`` (its final step is the frozen reference policy of RL, restored from
there), RL to ``RUN_DIR/checkpoints`` (policy params, optimizer state, and in the metadata the
grain iterator state, the metric-log offsets, the fault counters and the RNG stream). The stage
evaluations are kept in ``eval_sft.json`` / ``eval_rl.json``. A run folder holding a checkpoint
is resumed from its newest durable point (``--resume`` insists on one); the logs are cut back to
it, and every random draw is a pure function of (seed, stage, step), so the resumed run is the
uninterrupted one, bit for bit on CPU. SIGTERM saves a checkpoint and exits 0 within
``CheckpointConfig.grace_s``. Exit status: 0 done or preempted, 2 bad config or input,
3 numerical faults, 4 grace period exceeded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

DEFAULT_GIN = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_world.gin")
# Independent random streams: PRNG keys fold_in(fold_in(key(seed), stream), step); numpy
# generators default_rng([seed, stream, step]). The SFT data keeps one generator (seeded by the
# seed alone) whose draws are replayed on resume.
_RL_STREAM, _EVAL_STREAM = 1, 2


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mempo_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", required=True, help="output folder (metrics, summary, checkpoints)")
    p.add_argument("--gin_file", action="append", default=None, help=f"gin config (default {DEFAULT_GIN})")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. RLConfig.steps=10")
    p.add_argument("--cache_dir", default=None, help="tokenizer cache (default RUN_DIR/../.cache or $MEMPO_CACHE)")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in RUN_DIR (a run folder holding one is always resumed)")
    return p.parse_args(argv)


def _trajectory_record(tr, tokenizer) -> dict:
    return {
        "question_id": tr.question_id, "group": tr.group_id, "golds": tr.golds, "answer": tr.answer,
        "end": tr.end_reason,
        "turns": [{"text": tokenizer.decode(t.output_ids), "information": tokenizer.decode(t.observation_ids),
                   "mem_span": t.mem_span, "context_tokens": t.context_len} for t in tr.turns],
    }


def _plain(x):
    """JSON-able copy of a grain iterator state (numpy scalars → Python numbers)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def run(args) -> dict:
    """Run every stage, resuming from the newest durable point of ``RUN_DIR``.

    Returns:
      The summary written to ``RUN_DIR/summary.json``.

    Raises:
      ValueError / FileNotFoundError: bad config, data, tokenizer or run folder (one line, raised
        before anything in the run folder changes).
      Preempted: a SIGTERM arrived; the state is saved (``main`` exits 0).
      NumericalFault: too many non-finite steps; the last good checkpoint is kept (``main`` exits 3).
    """
    from mempo_jax import config as config_lib
    from mempo_jax.agent.trajectory import mode_name, parse_context_steps
    from mempo_jax.checkpoint import Checkpointer, check_run_artifacts, save_run_artifacts
    from mempo_jax.data.scripted_agent import scripted_trajectory
    from mempo_jax.evaluation import evaluate_policy
    from mempo_jax.experiment import build_experiment, entity_token_ids
    from mempo_jax.learner import Learner, make_optimizer
    from mempo_jax.metrics import bootstrap_ci, format_eval_table, write_json_atomic
    from mempo_jax.preemption import Preempted, Preemption
    from mempo_jax.resume import (EVAL_RL_FILE, EVAL_SFT_FILE, FaultCounter, FaultHooks, RunLogs, check_sft_step,
                                  find_resume_point)
    from mempo_jax.rl_step import rl_step
    from mempo_jax.sft import copy_rows, iterate_sft_batches, sft_rows

    t_start = time.time()
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "MEMPO_XLA_CACHE", str(pathlib.Path.home() / ".cache" / "mempo_jax" / "xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("MEMPO_XLA_CACHE_MIN_S", "1.0")))
    run_dir = pathlib.Path(args.run_dir)
    cfg = config_lib.load_config(args.gin_file or [DEFAULT_GIN], args.gin_param)
    ck, hooks = cfg.checkpoint, FaultHooks.from_env()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    with stack:
        pre = stack.enter_context(Preemption(ck.grace_s))  # exits last: after the saves are complete
        sft_ckpt = Checkpointer(run_dir / "sft_checkpoint", ck.max_to_keep, ck.async_save)
        stack.callback(sft_ckpt.close)
        rl_ckpt = Checkpointer(run_dir / "checkpoints", ck.max_to_keep, ck.async_save)
        stack.callback(rl_ckpt.close)
        point = find_resume_point(run_dir, sft_ckpt, rl_ckpt, cfg.seed, cfg.sft.steps, cfg.rl.steps)
        if args.resume and point.fresh:
            raise FileNotFoundError(f"--resume: no checkpoint under {run_dir / 'sft_checkpoint'} or "
                                    f"{run_dir / 'checkpoints'}")
        cache = args.cache_dir or os.environ.get("MEMPO_CACHE") or str(run_dir / ".cache")

        with pre.interruptible():
            exp = build_experiment(cfg, cache)
        tok = exp.tokenizer
        sft_opt, rl_opt = make_optimizer(cfg.sft.optim), make_optimizer(cfg.optim)
        # Everything a resume needs is read and checked before the run folder changes.
        sft_state = rl_state = None
        if not point.fresh:
            check_run_artifacts(run_dir, tok, exp.model_cfg)
            sft_state = sft_ckpt.restore(point.sft_step, exp.params,
                                         None if point.sft_done else jax.eval_shape(sft_opt.init, exp.params))
        if point.rl_step is not None:
            rl_state = rl_ckpt.restore(point.rl_step, exp.params, jax.eval_shape(rl_opt.init, exp.params))
        for name, keep in ((EVAL_SFT_FILE, point.eval_sft), (EVAL_RL_FILE, point.eval_rl)):
            if not keep:
                (run_dir / name).unlink(missing_ok=True)
        (run_dir / "config.gin").write_text(config_lib.operative_config(), encoding="utf-8")
        save_run_artifacts(run_dir, tok, exp.model_cfg)
        newest = point.newest()
        logs = RunLogs(run_dir, newest, point.source)
        stack.callback(logs.close)
        t_start -= float(newest.get("elapsed_s", 0.0)) if newest else 0.0
        print(f"[mempo] {cfg.dataset}: {len(exp.train_questions)} train / {len(exp.heldout_questions)} held-out "
              f"questions, {len(exp.documents)} passages, vocab {tok.vocab_size}, "
              f"model {exp.model_cfg.num_params() / 1e6:.2f} M params", flush=True)
        if not point.fresh:
            print(f"[mempo] {point.describe()}", flush=True)
        key = jax.random.PRNGKey(cfg.seed)
        rl_key, eval_key = jax.random.fold_in(key, _RL_STREAM), jax.random.fold_in(key, _EVAL_STREAM)
        train_steps = cfg.rl.rollout.context_steps

        def meta(stage, step, learner, **extra):
            return {"stage": stage, "step": int(step), "updates": int(learner.num_updates), "seed": cfg.seed,
                    "elapsed_s": time.time() - t_start, **logs.offsets(), **extra}

        # ---- 2. cold-start SFT ------------------------------------------------------------
        learner = Learner(exp.logits_fn, exp.params, sft_opt, micro_batch_rows=cfg.sft.batch_rows)
        sft_saved = point.sft_step
        if point.sft_done:
            learner.params, learner.num_updates = sft_state[0], int(sft_state[2]["updates"])
        else:
            start = 0
            if sft_state is not None:
                learner.params, learner.opt_state, m = sft_state
                learner.num_updates, start = int(m["updates"]), point.sft_step
            rng = np.random.default_rng(cfg.seed)
            batches = iter(())
            if cfg.sft.steps > 0:
                with pre.interruptible():
                    scripted = [scripted_trajectory(q, exp.offices, tok, exp.tool_env, cfg.sft.agent, cfg.rl.rollout,
                                                    rng) for q in tqdm(exp.train_questions, desc="scripted agent",
                                                                       leave=False)]
                    rows = sft_rows(scripted, train_steps, cfg.sft.full_fraction, tok.pad_id, rng)
                    rows += copy_rows(entity_token_ids(tok, exp.documents), int(cfg.sft.copy_fraction * len(rows)),
                                      tok.bos_id, rng)
                    batches = iterate_sft_batches(rows, cfg.sft.batch_rows, tok.pad_id, rng)
                    for _ in range(start):  # replay the data order up to the checkpoint
                        next(batches)
            bar = stack.enter_context(tqdm(total=cfg.sft.steps, initial=start, desc="SFT"))
            for step in range(start, cfg.sft.steps):
                m = learner.sft_step(next(batches))
                bar.update(1)
                bar.set_postfix(loss=f"{m['sft/loss']:.3f}")
                logs.write(step, "sft", m)
                check_sft_step(step, m, f"{sft_ckpt.directory}/{sft_saved}" if sft_saved is not None else "none")
                done = step + 1 == cfg.sft.steps
                if done or (step + 1) % ck.every_steps == 0 or pre.requested:
                    sft_ckpt.save(step + 1, learner.params, learner.opt_state, meta("sft", step + 1, learner, final=done))
                    sft_saved = step + 1
                pre.check()
            bar.close()
            if cfg.sft.steps == 0:
                sft_ckpt.save(0, learner.params, learner.opt_state, meta("sft", 0, learner, final=True))
        ref_params = jax.tree.map(lambda x: x.copy(), learner.params)  # frozen reference: the SFT result

        # ---- 3./5. evaluation -------------------------------------------------------------
        held = exp.heldout_questions[: cfg.eval.num_questions or None]
        modes = [parse_context_steps(m) for m in cfg.eval.context_modes]

        def evaluate(stage: str):
            out, per_q = {}, {}
            for mode in modes:
                bar = tqdm(total=len(held), desc=f"eval {stage} {mode_name(mode)}", leave=False)
                res = evaluate_policy(exp.sample_fn, learner.params, held, tok, exp.tool_env, cfg.rl.rollout, mode,
                                      cfg.eval.temperature, eval_key, progress=lambda n: bar.update(n - bar.n))
                bar.close()
                out[mode_name(mode)], per_q[mode_name(mode)] = res.metrics, res.per_question_em
                logs.write(learner.num_updates, f"eval_{stage}_{mode_name(mode)}", res.metrics)
                print(f"[mempo] eval {stage} {mode_name(mode)}: EM {res.metrics['em']:.3f} F1 {res.metrics['f1']:.3f} "
                      f"TT {res.metrics['tt']:.0f} PT {res.metrics['pt']:.0f}", flush=True)
            return out, per_q

        def evaluate_once(stage: str, stored, ckpt, name: str, step_key: str, step: int):
            """The stage's evaluation, or its stored result; stored after the stage's checkpoint is complete."""
            if stored:
                return stored["evals"], {k: np.asarray(v, np.float64) for k, v in stored["per_question_em"].items()}
            with pre.interruptible():
                out, per_q = evaluate(stage)
            ckpt.wait()
            per_q = {k: np.asarray(v, np.float64) for k, v in per_q.items()}
            write_json_atomic(run_dir / name, {step_key: step, "evals": out,
                                               "per_question_em": {k: v.tolist() for k, v in per_q.items()},
                                               **meta(f"eval_{stage}", step, learner)})
            return out, per_q

        evals, per_q = {}, {}
        evals["sft"], per_q["sft"] = evaluate_once("sft", point.eval_sft, sft_ckpt, EVAL_SFT_FILE, "sft_step",
                                                   cfg.sft.steps)

        # ---- 4. MemPO RL ------------------------------------------------------------------
        learner = Learner(exp.logits_fn, learner.params, rl_opt, temperature=cfg.rl.rollout.temperature,
                          micro_batch_rows=32)
        import grain

        order = iter(grain.MapDataset.range(len(exp.train_questions)).shuffle(seed=cfg.seed).repeat()
                     .batch(cfg.rl.questions_per_step))
        faults = FaultCounter(ck.max_consecutive_nonfinite, cfg.rl.num_mini_batches * cfg.rl.ppo_epochs)
        start = 0
        if rl_state is not None:
            learner.params, learner.opt_state, m = rl_state
            learner.num_updates, start = int(m["updates"]), point.rl_step
            order.set_state(m["data_iterator"])
            faults.load(m["faults"])
            if m["rng"]["step_key"] != jax.random.key_data(jax.random.fold_in(rl_key, start)).tolist():
                raise ValueError(f"{point.source}: the checkpoint's RNG stream is not this config's "
                                 f"(seed {cfg.seed}); use another --run_dir")
        rl_saved = point.rl_step
        current = {"step": start}
        ppo_update, sample_fn = learner.ppo_update, exp.sample_fn

        place_batch = learner._place_batch

        def guarded_ppo_update(rows, *a, **kw):  # the step's state changes from here: finish it
            pre.commit()
            if current["step"] not in hooks.nan_grad_steps:
                return ppo_update(rows, *a, **kw)
            # test hook: NaN advantages in every mini-batch (padding rows too), so every update is skipped
            learner._place_batch = lambda b: place_batch(dict(b, advantages=np.full_like(b["advantages"], np.nan)))
            try:
                return ppo_update(rows, *a, **kw)
            finally:
                learner._place_batch = place_batch

        learner.ppo_update = guarded_ppo_update
        if hooks.sigterm_rollout_step is not None:
            def sample_fn(*a, **kw):  # noqa: F811 - test hook: SIGTERM from inside a rollout
                if current["step"] == hooks.sigterm_rollout_step and not pre.requested:
                    import signal

                    os.kill(os.getpid(), signal.SIGTERM)
                return exp.sample_fn(*a, **kw)

        def save_rl(step, data_state, offsets, fault_state):
            nonlocal rl_saved
            rl_ckpt.save(step, learner.params, learner.opt_state, {
                **meta("rl", step, learner), **offsets, "data_iterator": data_state, "faults": fault_state,
                "rng": {"seed": cfg.seed, "next_step": step,
                        "step_key": jax.random.key_data(jax.random.fold_in(rl_key, step)).tolist()}})
            rl_saved = step

        bar = stack.enter_context(tqdm(total=cfg.rl.steps, initial=start, desc="MemPO RL"))
        for step in range(start, cfg.rl.steps):
            current["step"] = step
            data_state, offsets, fault_state = _plain(order.get_state()), logs.offsets(), faults.state()
            try:
                with pre.interruptible():  # a SIGTERM here abandons the step: its state is unchanged
                    qs = [exp.train_questions[int(i)] for i in next(order)]
                    m, trajs = rl_step(learner, ref_params, sample_fn, exp.scorer, qs, tok, exp.tool_env, cfg.rl,
                                       jax.random.fold_in(rl_key, step),
                                       np.random.default_rng([cfg.seed, _RL_STREAM, step]))
            except Preempted:
                if rl_saved != step:
                    save_rl(step, data_state, offsets, fault_state)
                raise
            m.update(faults.observe(step, m))
            if faults.streak:
                print(f"[mempo] RL step {step}: non-finite loss or gradients, update skipped "
                      f"({faults.streak}/{faults.max_consecutive} in a row)", file=sys.stderr, flush=True)
            logs.write(step, "rl", m)
            logs.write_rollouts([{"step": step, **_trajectory_record(tr, tok)} for tr in trajs[: cfg.log_rollouts]])
            bar.update(1)
            bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", em=f"{m['critic/em/mean']:.3f}",
                            mem=f"{m['mem/reward/mean']:+.3f}", turns=f"{m['num_turns/mean']:.1f}")
            if faults.exceeded:
                last = f"{rl_ckpt.directory}/{rl_saved}" if rl_saved is not None else \
                    f"{sft_ckpt.directory}/{cfg.sft.steps} (SFT; no RL checkpoint yet)"
                raise faults.error(last)
            done = step + 1 == cfg.rl.steps
            if done or pre.requested or ((step + 1) % ck.every_steps == 0 and not faults.streak):
                save_rl(step + 1, _plain(order.get_state()), logs.offsets(), faults.state())
            pre.check()
        bar.close()
        if rl_saved != cfg.rl.steps:  # RLConfig.steps = 0
            save_rl(cfg.rl.steps, _plain(order.get_state()), logs.offsets(), faults.state())

        evals["rl"], per_q["rl"] = evaluate_once("rl", point.eval_rl, rl_ckpt, EVAL_RL_FILE, "rl_step", cfg.rl.steps)

        # ---- summary ----------------------------------------------------------------------
        k1 = mode_name(modes[0])
        gain = per_q["rl"][k1] - per_q["sft"][k1]
        lo, hi = bootstrap_ci(gain, cfg.eval.bootstrap_samples, seed=cfg.seed)
        summary = {
            "eval": evals, "em_gain": float(gain.mean()), "em_gain_ci95": [lo, hi], "em_gain_mode": k1,
            "wall_s": time.time() - t_start, "params": exp.model_cfg.num_params(), "dataset": cfg.dataset,
            "heldout_questions": len(held),
        }
        write_json_atomic(run_dir / "summary.json", summary)
    print("\n" + format_eval_table(evals))
    print(f"\n[mempo] {k1} EM gain RL - SFT: {gain.mean():+.3f}  95% CI [{lo:+.3f}, {hi:+.3f}]  "
          f"wall {summary['wall_s'] / 60:.1f} min  -> {run_dir / 'summary.json'}", flush=True)
    return summary


def main(argv=None) -> int:
    """CLI entry point.

    Returns:
      0 when done or preempted (checkpoint saved), 2 for a config, data or run-folder error
      (one line on stderr), 3 when non-finite steps stopped the run (one line on stderr).
    """
    from mempo_jax.preemption import Preempted
    from mempo_jax.resume import NumericalFault

    args = _parse_args(argv)
    try:
        run(args)
    except Preempted:
        print(f"[mempo] preempted: checkpoint saved under {args.run_dir} (or nothing yet to save); run the same "
              "command to resume", file=sys.stderr, flush=True)
        return 0
    except NumericalFault as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
