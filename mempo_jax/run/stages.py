"""The stages of the main job, each a function of the ``RunContext`` (``mempo_jax.run.context``).

``commands.train.run`` calls them in order: ``zero_shot_stage`` (``EvalConfig.zero_shot``), ``sft_stage``,
``evaluate_stage("sft")``, ``rl_stage``, ``evaluate_stage("rl")``, ``summarize``. Each stage
resumes from what the context restored, saves its checkpoints through the context's
checkpointers and acts on a SIGTERM at its step boundaries (``RunContext.pre``). The context is
set up once (frozen); what the stages change is its ``RunProgress`` (saved steps, the RL step).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from mempo_jax.core import distributed
from mempo_jax.core.host_memory import release_free_memory
from mempo_jax.agent.trajectory import mode_name, parse_context_steps
from mempo_jax.core.paths import write_json_atomic, write_text_atomic
from mempo_jax.run.metrics import format_eval_table, paired_gains
from mempo_jax.rl.interfaces import RLCluster
from mempo_jax.rl.step import rl_step
from mempo_jax.run.preemption import Preempted
from mempo_jax.run.faults import FaultCounter, check_sft_step
from mempo_jax.run.resume import EVAL_BASE_FILE, EVAL_RL_FILE, EVAL_SFT_FILE, PREDICTIONS_FILE
from mempo_jax.run.context import COPY_STREAM, REPLAY_STREAM, READER_STREAM, RL_STREAM, RLCheckpoint, RunContext, read_json_or_none
from mempo_jax.data.messages import conversation_trajectory
from mempo_jax.data.scripted_agent import scripted_conversation
from mempo_jax.rl.sft import copy_rows, iterate_sft_batches, reader_rows, sft_rows, with_copy_warmup
from mempo_jax.run.evaluation import evaluate_policy, is_kind_metric, kind_metrics, prediction_records
from mempo_jax.run.experiment import entity_token_ids


# ---- evaluation -----------------------------------------------------------------------------
def heldout(ctx: RunContext) -> tuple[list, list]:
    """``(held-out questions evaluated, this process's share)``.

    Raises:
      ValueError: fewer questions than processes (names ``EvalConfig.num_questions``).
    """
    held = ctx.exp.heldout_questions[: ctx.cfg.eval.num_questions or None]
    if ctx.multi and len(held) < jax.process_count():
        raise ValueError(f"EvalConfig.num_questions: {len(held)} held-out questions cannot be split over "
                         f"{jax.process_count()} processes")
    return held, held[distributed.process_slice(len(held))] if ctx.multi else held


def _evaluate(ctx: RunContext, stage: str, learner) -> tuple[dict, dict, dict, list]:
    """The policy of ``learner`` on the held-out questions in every ``EvalConfig.context_modes`` mode.

    Returns ``(metrics by mode, per-question EM by mode, per-question F1 by mode, prediction
    records)``: the records (``run.evaluation.prediction_records``) of every process's questions,
    mode by mode, in the single-process order."""

    cfg, exp, engine = ctx.cfg, ctx.exp, ctx.exp.policy.engine
    held, held_mine = heldout(ctx)
    first = distributed.process_slice(len(held)).start if ctx.multi else 0
    params = engine.place(learner.params)  # onto the rollout mesh, once (a collective)
    rollout_cfg = cfg.rl.rollout
    if cfg.eval.num_slots:
        rollout_cfg = dataclasses.replace(rollout_cfg, num_slots=cfg.eval.num_slots)
    out, per_q, per_f1, records = {}, {}, {}, []
    for mode in (parse_context_steps(m) for m in cfg.eval.context_modes):
        release_free_memory()  # what the stage before left as free heap: not under this mode's KV cache
        bar = tqdm(total=len(held_mine), desc=f"eval {stage} {mode_name(mode)}", leave=False, disable=not ctx.primary)
        res = evaluate_policy(engine, params, held_mine, exp.policy.fmt, exp.heldout_tool_env, rollout_cfg,
                              mode, cfg.eval.temperature, ctx.eval_key, progress=lambda n: bar.update(n - bar.n),
                              first=first)
        bar.close()
        metrics = {k: v for k, v in res.metrics.items() if not is_kind_metric(k)}  # redone on all questions
        mine = prediction_records(held_mine, res, mode_name(mode), cfg.dataset)
        if ctx.multi:  # every process's questions, in the single-process order (collectives)
            ctx.sync.barrier()  # the rollouts ran outside the lockstep wrappers
            mine = gather_records(mine, ctx.sync)
            means = distributed.mean_metrics({k: v for k, v in metrics.items() if k != "n"},
                                             weight=float(len(held_mine)), sync=ctx.sync)
            metrics = {k: (len(held) if k == "n" else means[k]) for k in metrics}
        records += mine
        # per-question EM / F1 from the records: float64 as scored, on every process count (a gather
        # of the float values themselves would round them to float32)
        em = np.asarray([r["em"] for r in mine], np.float64)
        f1 = np.asarray([r["f1"] for r in mine], np.float64)
        metrics.update(kind_metrics(held, em, f1))  # "eval/<kind>/em", /f1, /n
        out[mode_name(mode)], per_q[mode_name(mode)], per_f1[mode_name(mode)] = metrics, em, f1
        ctx.logs.write(learner.state.step, f"eval_{stage}_{mode_name(mode)}", metrics)
        ctx.say(f"[mempo] eval {stage} {mode_name(mode)}: EM {metrics['em']:.3f} F1 {metrics['f1']:.3f} "
                f"TT {metrics['tt']:.0f} PT {metrics['pt']:.0f}", flush=True)
    return out, per_q, per_f1, records


_EVAL_FILES = {"base": (EVAL_BASE_FILE, "base_step"), "sft": (EVAL_SFT_FILE, "sft_step"),
               "rl": (EVAL_RL_FILE, "rl_step")}


def evaluate_stage(ctx: RunContext, stage: str, learner, stored, ckpt, step: int):
    """The stage's evaluation, or its stored result; stored (``eval_<stage>.json``) after the
    stage's checkpoint ``ckpt`` is complete, and after ``eval_<stage>_predictions.jsonl`` (each
    held-out question's answer in each mode, ``run.evaluation.prediction_record``).

    Returns:
      ``(metrics by mode, {"em": {mode: [questions]}, "f1": {mode: [questions]}})``.
    """
    name, step_key = _EVAL_FILES[stage]
    if stored:
        return stored["evals"], {key: {k: np.asarray(v, np.float64) for k, v in stored.get(f"per_question_{key}", {}).items()}
                                 for key in ("em", "f1")}
    with ctx.interruptible():
        out, per_q, per_f1, records = _evaluate(ctx, stage, learner)
    release_free_memory()  # the evaluation's KV cache and weights: not kept as free heap under the next stage
    if ckpt is not None:
        ckpt.wait()
    per = {"em": {k: np.asarray(v, np.float64) for k, v in per_q.items()},
           "f1": {k: np.asarray(v, np.float64) for k, v in per_f1.items()}}
    if ctx.primary:
        write_text_atomic(ctx.run_dir / PREDICTIONS_FILE.format(stage=stage),
                          "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        write_json_atomic(ctx.run_dir / name, {step_key: step, "evals": out,
                                               **{f"per_question_{key}": {k: v.tolist() for k, v in d.items()}
                                                  for key, d in per.items()},
                                               **ctx.meta(f"eval_{stage}", step, learner)})
    return out, per


def zero_shot_stage(ctx: RunContext, learner, evals: dict, per_q: dict) -> None:
    """``EvalConfig.zero_shot``: the initial policy (a checkpoint before any training), evaluated
    once into ``evals["base"]`` / ``per_q["base"]`` (skipped, with a note, in a resumed run
    folder that lacks its file)."""
    if not ctx.cfg.eval.zero_shot:
        return
    point = ctx.point
    stored = read_json_or_none(ctx.run_dir / EVAL_BASE_FILE)
    if stored or point.fresh or (point.sft_step is None and point.rl_step is None):
        evals["base"], per_q["base"] = evaluate_stage(ctx, "base", learner, stored, None, 0)
    else:
        ctx.say(f"[mempo] EvalConfig.zero_shot: no {EVAL_BASE_FILE} in this resumed run folder; "
                "the initial policy is gone, so the zero-shot evaluation is skipped", flush=True)


# ---- SFT ------------------------------------------------------------------------------------
def copy_rows_warning(cfg) -> str | None:
    """The warning line for an SFT of a pretrained checkpoint that trains synthetic copy rows, else None.

    Copy rows (``SFTConfig.copy_fraction``) and copy-only warm-up steps (``copy_warmup_fraction``)
    are random entity tokens for a model trained from scratch; on a pretrained checkpoint they
    lower SFT EM (docs/log/2026-12.md, the SmolLM2 recipe). A gin that includes
    ``configs/tiny_world.gin`` inherits them.

    Args:
      cfg: an ``ExperimentConfig``.
    Returns:
      One line naming the checkpoint, both bindings and how many rows / steps they give, or None
      (no checkpoint, no SFT steps, or neither kind of copy row).
    """
    sft = cfg.sft
    if not cfg.model.checkpoint or sft.steps == 0 or (sft.copy_fraction == 0 and sft.copy_warmup_steps == 0):
        return None
    return (f"[mempo] warning: the SFT of checkpoint {cfg.model.checkpoint} trains synthetic copy rows "
            f"(SFTConfig.copy_fraction = {sft.copy_fraction} per agent row, SFTConfig.copy_warmup_fraction = "
            f"{sft.copy_warmup_fraction}: {sft.copy_warmup_steps} of {sft.steps} steps copy-only), which are for models "
            "trained from scratch (an included configs/tiny_world.gin sets them); bind both to 0.0 to train without")


def _sft_batches(ctx: RunContext, sft_file, rng: np.random.Generator):
    """The SFT batch iterator: a messages file or the scripted agent's conversations → rows
    (plus copy rows), batched; the same rows on every process (one generator)."""

    cfg, exp, tok, fmt = ctx.cfg, ctx.exp, ctx.exp.policy.tokenizer, ctx.exp.policy.fmt
    context_steps = cfg.rl.rollout.context_steps  # the context mode RL trains in
    convs = sft_file or [scripted_conversation(q, exp.offices, exp.tool_env, cfg.sft.agent, rng)
                         for q in tqdm(exp.train_questions, desc="scripted agent", leave=False,
                                       disable=not ctx.primary)]
    trajs = [conversation_trajectory(c, fmt, cfg.rl.rollout.max_observation_tokens, context_steps) for c in convs]
    full_trajs = None
    if not sft_file and cfg.sft.agent.full_rows != "same":  # replays for the whole-history rows, own stream
        recall = cfg.sft.agent.full_rows == "recall"
        agent = cfg.sft.agent if recall else dataclasses.replace(cfg.sft.agent, lazy_prob=0.0)
        rng_r = np.random.default_rng([cfg.seed, REPLAY_STREAM])
        full_trajs = [conversation_trajectory(scripted_conversation(q, exp.offices, exp.tool_env, agent, rng_r,
                                                                    recall=recall),
                                              fmt, cfg.rl.rollout.max_observation_tokens, context_steps)
                      for q in exp.train_questions]
    rows = sft_rows(trajs, context_steps, cfg.sft.full_fraction, tok.pad_id, rng, full_trajs)
    if cfg.sft.reader_fraction > 0:  # own stream: the choice of whole-history rows is unchanged
        rows += reader_rows(trajs, tok, fmt.codec, exp.scorer.answer_prefix, exp.scorer.full_prefix,
                            cfg.sft.reader_fraction,
                            np.random.default_rng([cfg.seed, READER_STREAM]), full_trajs)
    if sft_file:
        ctx.say(f"[mempo] SFT on {len(trajs)} conversations of {cfg.sft.data_path} ({len(rows)} rows)", flush=True)
    if warning := copy_rows_warning(cfg):
        ctx.say(warning, flush=True)
    pool = entity_token_ids(tok, exp.documents, cfg.sft.copy_pool)
    rows += copy_rows(pool, int(cfg.sft.copy_fraction * len(rows)), tok.bos_id, rng)
    # int32 / float32 arrays, not lists of Python numbers: the same batches in a third of the memory
    # (tens of thousands of rows with several training worlds), held through the SFT stage
    rows = [(np.asarray(ids, np.int32), np.asarray(mask, np.float32)) for ids, mask in rows]
    batches = iterate_sft_batches(rows, cfg.sft.batch_rows, tok.pad_id, rng)
    return with_copy_warmup(batches, pool, cfg.sft.copy_warmup_steps, cfg.sft.batch_rows, tok.pad_id, tok.bos_id,
                            np.random.default_rng([cfg.seed, COPY_STREAM]))  # own stream: the rows' draws are kept


def sft_stage(ctx: RunContext, learner, sft_file, stack) -> None:
    """Cold-start SFT of ``learner`` (or its restored result), checkpointed to ``sft_checkpoint/``.

    Raises:
      NumericalFault: a non-finite SFT step. Preempted: a SIGTERM (the state is saved first).
    """
    cfg, point, ck = ctx.cfg, ctx.point, ctx.cfg.checkpoint
    if point.sft_done:  # its parameters and step (no optimizer state was restored)
        learner.state = ctx.sft_state[0].replace(opt_state=learner.state.opt_state)
        return
    start = 0
    if ctx.sft_state is not None:
        learner.state, start = ctx.sft_state[0], point.sft_step
    batches = iter(())
    if cfg.sft.steps > 0:
        with ctx.interruptible():
            batches = _sft_batches(ctx, sft_file, np.random.default_rng(cfg.seed))
            for _ in range(start):  # replay the data order up to the checkpoint
                next(batches)
    bar = stack.enter_context(tqdm(total=cfg.sft.steps, initial=start, desc="SFT", disable=not ctx.primary))
    mine = distributed.process_slice(cfg.sft.batch_rows) if ctx.multi else slice(None)
    for step in range(start, cfg.sft.steps):
        m = learner.sft_step({k: v[mine] for k, v in next(batches).items()})
        bar.update(1)
        bar.set_postfix(loss=f"{m['sft/loss']:.3f}")
        ctx.logs.write(step, "sft", m)
        saved = ctx.progress.sft_saved
        check_sft_step(step, m, f"{ctx.sft_ckpt.directory}/{saved}" if saved is not None else "none")
        ctx.agree_on_preemption()
        done = step + 1 == cfg.sft.steps
        if done or (step + 1) % ck.every_steps == 0 or ctx.pre.requested:
            ctx.save(ctx.sft_ckpt, step + 1, learner, ctx.meta("sft", step + 1, learner, final=done))
            ctx.progress.sft_saved = step + 1
        ctx.pre.check()
    bar.close()
    if cfg.sft.steps == 0:
        ctx.save(ctx.sft_ckpt, 0, learner, ctx.meta("sft", 0, learner, final=True))


# ---- RL -------------------------------------------------------------------------------------
# Metrics of an RL step that are not means over the process's trajectories: means over its
# ``<mem>`` turns, means over its turns, totals, maxima (``global_rl_metrics``).
_PER_MEM_TURN = ("mem/reward/mean", "mem/p_full/mean", "mem/p_mem/mean", "mem/advantage/std")
_PER_TURN = ("format_fail/rate",)
_TOTALS = ("mem/turns", "train/rows", "train/tokens")
_MAXIMA = ("train/seq_len",)


def global_rl_metrics(m: dict, trajs, sync) -> dict:
    """Every process's RL-step metrics combined into the step's (a collective; identity on one process).

    PPO metrics (``actor/*``) are already global. Means over trajectories are weighted by each
    process's trajectories, ``_PER_MEM_TURN`` by its ``<mem>`` turns (exact for the means;
    ``mem/advantage/std`` becomes a weighted mean of the processes' stds), ``format_fail/rate`` by
    its turns; ``mem/turns``, ``train/rows`` and ``train/tokens`` are summed, ``train/seq_len`` is the maximum.
    """
    if not sync.multiprocess:
        return m
    out = distributed.mean_metrics(m, weight=float(len(trajs)), sync=sync)  # checks that the names agree
    mem = {k: m[k] for k in _PER_MEM_TURN if k in m}
    out.update(distributed.mean_metrics(mem, weight=float(m.get("mem/turns", 0.0)))
               if m.get("mem/turns") is not None else {})
    turns = float(sum(len(tr.turns) for tr in trajs))
    out.update(distributed.mean_metrics({k: m[k] for k in _PER_TURN if k in m}, weight=turns))
    keys = [k for k in _TOTALS + _MAXIMA if k in m]
    table = distributed.allgather(np.asarray([m[k] for k in keys], np.float32))
    for i, k in enumerate(keys):
        out[k] = float(table[:, i].sum() if k in _TOTALS else table[:, i].max())
    return {k: out[k] for k in m}  # the single-process key order


def gather_records(records: list, sync) -> list:
    """Every process's records, concatenated in process order (a collective on several processes).

    Args:
      records: JSON-serialisable values (``json.dumps``-able dicts).
      sync: the run's ``HostSync``.

    Returns:
      On one process ``records`` itself; on several, JSON round-tripped copies (tuples become lists).
    """
    if not sync.multiprocess:
        return records
    blobs = distributed.gather_lists([list(json.dumps(r).encode("utf-8")) for r in records])
    return [json.loads(bytes(b).decode("utf-8")) for b in blobs]


def global_rollout_records(records: list, n: int, sync) -> list:
    """The first ``n`` rollout records of the step over every process (a collective): each process
    sends its first ``n``, concatenated in process order, so ``rollouts.jsonl`` holds the records a
    single process would have written."""
    return gather_records(records[:n], sync)[:n]


def trajectory_record(tr, tokenizer, group_offset: int = 0) -> dict:
    """One ``rollouts.jsonl`` record of a trajectory (its turns decoded)."""
    return {
        "question_id": tr.question_id, "group": tr.group_id + group_offset, "golds": tr.golds, "answer": tr.answer,
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


class _RLRun:
    """The RL stage's state between steps: the learner, the question order, the fault counter.

    The learner's ``before_update`` hook commits the step (a SIGTERM no longer abandons it) and
    applies the test fault hooks; ``FaultHooks.before_sample`` runs once per rollout cycle of either
    engine (``_progress``, the ``progress`` callback of ``Engine.rollout``).
    """

    def __init__(self, ctx: RunContext, params):
        import grain

        cfg = ctx.cfg
        self.ctx = ctx
        self.learner = ctx.new_learner(params, ctx.rl_opt, temperature=cfg.rl.rollout.temperature,
                                       micro_batch_rows=cfg.execution.micro_batch_rows,
                                       logprob_chunk_rows=cfg.execution.logprob_chunk_rows,
                                       before_update=self._before_update)
        self.order = iter(grain.MapDataset.range(len(ctx.exp.train_questions)).shuffle(seed=cfg.rl_seed).repeat()
                          .batch(cfg.rl.questions_per_step))
        self.faults = FaultCounter(cfg.checkpoint.max_consecutive_nonfinite, cfg.rl.num_mini_batches * cfg.rl.ppo_epochs)
        self.start = 0
        if ctx.rl_state is not None:
            self.learner.state, meta = ctx.rl_state
            record = RLCheckpoint.from_meta(meta, ctx.point.rl_step, ctx.rl_key, cfg.rl_seed, ctx.point.source)
            self.start = record.step
            self.order.set_state(record.data_iterator)
            self.faults.load(record.faults)

    def _progress(self, turn: int, rows: int) -> None:
        """The rollout's ``progress`` callback: the test fault hooks, once per rollout cycle."""
        self.ctx.hooks.before_sample(self.ctx.progress.rl_step, self.ctx.pre)

    def _before_update(self, rows):
        self.ctx.pre.commit()  # the step's state changes from here: finish it
        return self.ctx.hooks.update_rows(self.ctx.progress.rl_step, rows)

    def record(self) -> RLCheckpoint:
        """What a checkpoint saved now would hold."""
        return RLCheckpoint(self.ctx.progress.rl_step, _plain(self.order.get_state()), self.ctx.logs.offsets(),
                            self.faults.state())

    def save(self, record: RLCheckpoint) -> None:
        """Save the policy, optimizer state and ``record`` as RL checkpoint ``record.step``."""
        ctx = self.ctx
        ctx.save(ctx.rl_ckpt, record.step, self.learner,
                 record.meta(ctx.meta("rl", record.step, self.learner), ctx.rl_key, ctx.cfg.rl_seed))
        ctx.progress.rl_saved = record.step

    def step(self, ref_params, step: int):
        """Roll out, score and update on RL step ``step``'s questions (a SIGTERM before the update
        abandons the step: its state is unchanged, and saved). Returns ``(metrics, trajectories,
        first group)``."""
        ctx, cfg = self.ctx, self.ctx.cfg
        ctx.progress.rl_step = step
        before = self.record()
        try:
            with ctx.interruptible():
                qs = [ctx.exp.train_questions[int(i)] for i in next(self.order)]
                first = 0
                if ctx.multi:  # this process's questions: its rollouts, tool calls and parsing
                    mine = distributed.process_slice(len(qs))
                    qs, first = qs[mine], mine.start
                policy = ctx.exp.policy
                cluster = RLCluster(self.learner, ref_params, policy.engine, ctx.scorer, policy.fmt, ctx.exp.tool_env)
                m, trajs = rl_step(cluster, qs, cfg.rl, jax.random.fold_in(ctx.rl_key, step),
                                   np.random.default_rng([cfg.rl_seed, RL_STREAM, step]),
                                   traj_offset=first * cfg.rl.group_size, progress=self._progress)
        except Preempted:
            if ctx.progress.rl_saved != step:
                self.save(before)
            raise
        return m, trajs, first

    def log(self, step: int, m: dict, trajs, first: int, bar) -> dict:
        """Combine, count faults, log and show the step's metrics; returns them."""
        ctx = self.ctx
        m = global_rl_metrics(m, trajs, ctx.sync)
        m.update(self.faults.observe(step, m))
        if self.faults.streak and ctx.primary:
            print(f"[mempo] RL step {step}: non-finite loss or gradients, update skipped "
                  f"({self.faults.streak}/{self.faults.max_consecutive} in a row)", file=sys.stderr, flush=True)
        ctx.logs.write(step, "rl", m)
        n, tok = ctx.cfg.log_rollouts, ctx.exp.policy.tokenizer
        ctx.logs.write_rollouts(global_rollout_records(
            [{"step": step, **trajectory_record(tr, tok, first)} for tr in trajs[:n]], n, ctx.sync))
        bar.update(1)
        bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", em=f"{m['critic/em/mean']:.3f}",
                        mem=f"{m['mem/reward/mean']:+.3f}", turns=f"{m['num_turns/mean']:.1f}")
        return m


def rl_stage(ctx: RunContext, params, ref_params, stack):
    """MemPO RL from ``params`` (or the restored RL checkpoint) against the frozen ``ref_params``,
    checkpointed to ``checkpoints/``. Returns the RL learner.

    Raises:
      NumericalFault: ``CheckpointConfig.max_consecutive_nonfinite`` faulty steps in a row.
      Preempted: a SIGTERM (the state is saved first).
    """
    cfg, ck = ctx.cfg, ctx.cfg.checkpoint
    run = _RLRun(ctx, params)
    bar = stack.enter_context(tqdm(total=cfg.rl.steps, initial=run.start, desc="MemPO RL", disable=not ctx.primary))
    for step in range(run.start, cfg.rl.steps):
        m, trajs, first = run.step(ref_params, step)
        run.log(step, m, trajs, first, bar)
        if run.faults.exceeded:
            last = f"{ctx.rl_ckpt.directory}/{ctx.progress.rl_saved}" if ctx.progress.rl_saved is not None else \
                f"{ctx.sft_ckpt.directory}/{cfg.sft.steps} (SFT; no RL checkpoint yet)"
            raise run.faults.error(last)
        ctx.agree_on_preemption()
        ctx.progress.rl_step = step + 1
        if step + 1 == cfg.rl.steps or ctx.pre.requested or ((step + 1) % ck.every_steps == 0 and not run.faults.streak):
            run.save(run.record())
        ctx.pre.check()
    bar.close()
    if ctx.progress.rl_saved != cfg.rl.steps:  # RLConfig.steps = 0
        ctx.progress.rl_step = cfg.rl.steps
        run.save(run.record())
    return run.learner


# ---- summary --------------------------------------------------------------------------------
def summarize(ctx: RunContext, evals: dict, per_q: dict, exported) -> dict:
    """``summary.json``: the evaluations, the paired EM / F1 gains with bootstrap 95 % CIs (k = 1
    EM gain of RL over SFT first), wall time and sizes; written by process 0."""
    cfg = ctx.cfg
    k1 = mode_name(parse_context_steps(cfg.eval.context_modes[0]))
    gains = {f"{after}_vs_{before}": paired_gains(per_q[after], per_q[before], cfg.eval.bootstrap_samples, cfg.seed)
             for before, after in (("base", "sft"), ("sft", "rl")) if before in per_q}
    gain_mean, lo, hi = gains["rl_vs_sft"][k1]["em"]
    summary: dict[str, Any] = {
        "eval": evals, "em_gain": gain_mean, "em_gain_ci95": [lo, hi], "em_gain_mode": k1, "gains": gains,
        "wall_s": time.time() - ctx.t_start, "params": ctx.exp.policy.model_cfg.num_params(), "dataset": cfg.dataset,
        "heldout_questions": len(heldout(ctx)[0]), "hf_export": exported,
    }
    if ctx.primary:
        write_json_atomic(ctx.run_dir / "summary.json", summary)
    return summary


def print_summary(ctx: RunContext, summary: dict) -> None:
    """The before/after table, every gain with its CI, and the headline EM gain (process 0)."""
    ctx.say("\n" + format_eval_table(summary["eval"]))
    for name, by_mode in summary["gains"].items():
        for mode, g in by_mode.items():
            ctx.say(f"[mempo] {mode} gain {name.replace('_vs_', ' - ').upper()}: EM {g['em'][0]:+.3f} "
                    f"[{g['em'][1]:+.3f}, {g['em'][2]:+.3f}]  F1 {g['f1'][0]:+.3f} [{g['f1'][1]:+.3f}, {g['f1'][2]:+.3f}]",
                    flush=True)
    ctx.say(f"\n[mempo] {summary['em_gain_mode']} EM gain RL - SFT: {summary['em_gain']:+.3f}  95% CI "
            f"[{summary['em_gain_ci95'][0]:+.3f}, {summary['em_gain_ci95'][1]:+.3f}]  "
            f"wall {summary['wall_s'] / 60:.1f} min  -> {ctx.run_dir / 'summary.json'}", flush=True)
