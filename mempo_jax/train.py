"""The main job: ``python -m mempo_jax.train --run_dir DIR [--gin_file F] [--gin_param B] [--resume]``.

Stages (the default ``configs/tiny_world.gin`` runs all of them on CPU in minutes):

1. build the world (or read real data), the BM25 tools, the tokenizer and the model;
2. cold-start SFT on the scripted agent's trajectories, or on an SFT trajectory file
   (``SFTConfig.data_path``, messages rows; both go through ``data/messages.py``);
3. evaluation of the SFT policy on held-out questions in every context mode;
4. MemPO RL (rollout → outcome + memory rewards → grouped advantages → PPO), with a progress bar,
   ``metrics.jsonl``, TensorBoard events and sample rollouts in ``rollouts.jsonl``;
5. evaluation after RL; the before/after table is printed and written to ``summary.json``
   with the bootstrap 95 % CI of the k = 1 EM gain. A run from a Hugging Face checkpoint
   (``ModelOptions.checkpoint``) then exports the RL policy to ``RUN_DIR/hf_export``
   (``mempo_jax.export``: config, safetensors, tokenizer with its tags and chat template).

Data: the tiny world, or QA files (``ExperimentConfig.train_path`` / ``eval_path`` in any format
``mempo_jax.data.qa_formats`` reads) searched over ``corpus_path`` (local BM25), a
``retriever_url`` (``/retrieve`` server, checked before RUN_DIR is touched) or the files' own
context paragraphs. ``SFTConfig.steps = 0`` starts RL from the initial policy (a checkpoint's),
which is then also the frozen reference.

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

Meshes and several processes (docs/tpu_pod.md). A config that binds ``MeshConfig`` (the pod
recipes) runs sharded: ``mempo_jax.distributed.maybe_initialize`` first joins the processes of a
multi-host job (``$MEMPO_MULTIHOST=1`` on a TPU slice, or ``$MEMPO_COORDINATOR`` /
``$MEMPO_NUM_PROCESSES`` / ``$MEMPO_PROCESS_ID``), the mesh ``(data, fsdp, tensor)`` is built over
every device with ``MeshConfig.rules``, and ``build_experiment`` places the policy, the sampler's
KV cache and the memory-reward scoring batches by those rules; the learners place the optimizer
state and the SFT / log-prob / update batches (``Learner(mesh=...)``), the frozen reference is a
copy of the sharded SFT policy. ``PlanConfig.micro_batch_rows``, ``logprob_chunk_rows`` and
``scoring_chunk_rows`` are the RL micro-batch, reference log-prob chunk and scoring chunk the run
uses, so the memory plan is the run's (their defaults are the single-device values).
With several processes (always on a mesh), each process rolls out, calls the tools for, and
evaluates its contiguous share of a step's questions (``distributed.process_slice``) and feeds its
share of each SFT batch; ``mempo_jax.lockstep`` runs every device program on the global batch.
Process 0 alone writes ``metrics.jsonl``, ``tb/``, ``rollouts.jsonl`` (the step's first records,
gathered from every process), the evaluation files, ``summary.json`` and the run artefacts;
every process calls the orbax checkpoint saves and restores (orbax writes each shard once and
the metadata from process 0).
A SIGTERM on any process is acted on by all at the next step boundary. Without ``MeshConfig``
and on one process nothing changes: plain one-device programs, as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import os
import pathlib
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

DEFAULT_GIN = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_world.gin")
# Independent random streams: PRNG keys fold_in(fold_in(key(seed), stream), step); numpy
# generators default_rng([seed, stream, step]). The SFT data keeps one generator (seeded by the
# seed alone) whose draws are replayed on resume.
_RL_STREAM, _EVAL_STREAM, _DILIGENT_STREAM = 1, 2, 3


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mempo_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", required=True, help="output folder (metrics, summary, checkpoints)")
    p.add_argument("--gin_file", action="append", default=None, help=f"gin config (default {DEFAULT_GIN})")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. RLConfig.steps=10")
    p.add_argument("--cache_dir", default=None, help="tokenizer cache (default RUN_DIR/../.cache or $MEMPO_CACHE)")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in RUN_DIR (a run folder holding one is always resumed)")
    return p.parse_args(argv)


def _trajectory_record(tr, tokenizer, group_offset: int = 0) -> dict:
    return {
        "question_id": tr.question_id, "group": tr.group_id + group_offset, "golds": tr.golds, "answer": tr.answer,
        "end": tr.end_reason,
        "turns": [{"text": tokenizer.decode(t.output_ids), "information": tokenizer.decode(t.observation_ids),
                   "mem_span": t.mem_span, "context_tokens": t.context_len} for t in tr.turns],
    }


def _read_json_or_none(path: pathlib.Path):
    """The JSON object in ``path``, or None when it is absent or unreadable (then it is redone)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _plain(x):
    """JSON-able copy of a grain iterator state (numpy scalars → Python numbers)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


class RunConfig(NamedTuple):
    """What ``load_run_config`` returns.

    Attributes:
      experiment: the validated ``ExperimentConfig``.
      mesh, tpu, plan: the bound ``MeshConfig``, ``TPUConfig`` and ``PlanConfig`` (defaults where
        unbound; ``mempo_jax.mesh_config``).
      sharded: True when the config binds a ``MeshConfig`` field: the run builds a mesh (it also
        does on several processes, with the bound or default ``MeshConfig``).
    """

    experiment: Any
    mesh: Any
    tpu: Any
    plan: Any
    sharded: bool


def load_run_config(gin_files: Sequence[str], gin_params: Sequence[str] = ()) -> RunConfig:
    """Parse a recipe the way ``python -m mempo_jax.train`` does (every ``configs/*.gin`` loads).

    Args:
      gin_files: gin files, parsed in order.
      gin_params: ``--gin_param`` bindings, applied after the files.

    Returns:
      A ``RunConfig``.

    Raises:
      ValueError: one line (``config error: ...``) naming the unknown binding, the bad value or
        the ``MeshConfig`` / ``TPUConfig`` / ``PlanConfig`` field that is out of range.
    """
    import gin

    from mempo_jax import config as config_lib
    from mempo_jax.mesh_config import MeshConfig, PlanConfig, TPUConfig

    cfg = config_lib.load_config(gin_files, gin_params)
    try:  # unbound ones are plain defaults, kept out of the operative config (RUN_DIR/config.gin)
        with gin.config_scope(None):
            pod = [gin.get_configurable(c)() if config_lib.binds_any(c) else c() for c in (MeshConfig, TPUConfig,
                                                                                            PlanConfig)]
    except (ValueError, TypeError) as e:
        raise ValueError(f"config error: {config_lib._one_line_gin_error(e, gin_params)}") from None
    return RunConfig(cfg, *pod, config_lib.mesh_requested())


def make_run_mesh(mesh_cfg):
    """The run's ``("data", "fsdp", "tensor")`` mesh from a ``MeshConfig``.

    Uses every device of every process, except on one process when the three sizes are given
    (no ``-1``) and multiply to fewer devices than there are: then the first ones (a sub-mesh,
    e.g. ``(1, 1, 1)`` on 8 emulated CPU devices).

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      ValueError: one line naming ``MeshConfig`` when the sizes do not fit the devices.
    """
    import math

    sizes = (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    need = math.prod(sizes)
    if -1 not in sizes and need < jax.device_count() and jax.process_count() == 1:
        return mesh_cfg.make(jax.devices()[:need])
    return mesh_cfg.make()


class _NoLogs:
    """The logs of a process other than 0: nothing is written; the offsets stay those of the
    durable point resumed from (only process 0's checkpoint metadata is stored)."""

    def __init__(self, offsets=None):
        self._offsets = {"metrics": dict((offsets or {}).get("metrics") or {"bytes": 0, "lines": 0}),
                         "rollouts": dict((offsets or {}).get("rollouts") or {"bytes": 0})}

    def write(self, *_a, **_kw) -> None:
        """Nothing (process 0 writes)."""

    def write_rollouts(self, *_a, **_kw) -> None:
        """Nothing (process 0 writes)."""

    def offsets(self) -> dict:
        """The offsets of the resumed point."""
        return {k: dict(v) for k, v in self._offsets.items()}

    def close(self) -> None:
        """Nothing to close."""


# Metrics of an RL step that are not means over the process's trajectories: means over its
# ``<mem>`` turns, means over its turns, totals, maxima (``_global_rl_metrics``).
_PER_MEM_TURN = ("mem/reward/mean", "mem/p_full/mean", "mem/p_mem/mean", "mem/advantage/std")
_PER_TURN = ("format_fail/rate",)
_TOTALS = ("mem/turns", "train/rows")
_MAXIMA = ("train/seq_len",)


def _global_rl_metrics(m: dict, trajs, sync) -> dict:
    """Every process's RL-step metrics combined into the step's (a collective; identity on one process).

    PPO metrics (``actor/*``) are already global. Means over trajectories are weighted by each
    process's trajectories, ``_PER_MEM_TURN`` by its ``<mem>`` turns (exact for the means;
    ``mem/advantage/std`` becomes a weighted mean of the processes' stds), ``format_fail/rate`` by
    its turns; ``mem/turns`` and ``train/rows`` are summed, ``train/seq_len`` is the maximum.
    """
    from mempo_jax.distributed import allgather, mean_metrics

    if not sync.multiprocess:
        return m
    out = mean_metrics(m, weight=float(len(trajs)), sync=sync)  # checks that the names agree
    mem = {k: m[k] for k in _PER_MEM_TURN if k in m}
    out.update(mean_metrics(mem, weight=float(m.get("mem/turns", 0.0))) if m.get("mem/turns") is not None else {})
    turns = float(sum(len(tr.turns) for tr in trajs))
    out.update(mean_metrics({k: m[k] for k in _PER_TURN if k in m}, weight=turns))
    keys = [k for k in _TOTALS + _MAXIMA if k in m]
    table = allgather(np.asarray([m[k] for k in keys], np.float32))
    for i, k in enumerate(keys):
        out[k] = float(table[:, i].sum() if k in _TOTALS else table[:, i].max())
    return {k: out[k] for k in m}  # the single-process key order


def _global_rollout_records(records: list, n: int, sync) -> list:
    """The first ``n`` rollout records of the step over every process (a collective; identity on
    one process): each process sends its first ``n``, concatenated in process order, so
    ``rollouts.jsonl`` holds the records a single process would have written."""
    import json

    from mempo_jax.distributed import gather_lists

    if not sync.multiprocess:
        return records
    blobs = gather_lists([list(json.dumps(r).encode("utf-8")) for r in records[:n]])
    return [json.loads(bytes(b).decode("utf-8")) for b in blobs][:n]


def _checkpoint_bytes(*trees) -> int:
    """Bytes of the arrays of ``trees`` (arrays or ``jax.ShapeDtypeStruct``): one checkpoint's size."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for t in trees for x in jax.tree.leaves(t)))


def _check_mesh_sizes(cfg, mesh, rules) -> None:
    """Batch sizes that a sharded or multi-process run needs, checked before anything runs.

    Raises:
      ValueError: naming the field: ``SFTConfig.batch_rows`` that does not divide over the mesh's
        batch shards (``MeshConfig.rules`` "batch", data x fsdp by default), or a per-step count
        (``SFTConfig.batch_rows``, ``RLConfig.questions_per_step``) smaller than the process count.
    """
    from mempo_jax.sharding import batch_shards

    shards, procs = batch_shards(mesh, rules), jax.process_count()
    if cfg.sft.steps > 0 and cfg.sft.batch_rows % shards:
        raise ValueError(f"SFTConfig.batch_rows = {cfg.sft.batch_rows} does not divide over the {shards} batch shards "
                         f"of the mesh {dict(mesh.shape)} (MeshConfig.rules 'batch')")
    for name, value in (("SFTConfig.batch_rows", cfg.sft.batch_rows if cfg.sft.steps > 0 else procs),
                        ("RLConfig.questions_per_step", cfg.rl.questions_per_step if cfg.rl.steps > 0 else procs)):
        if value < procs:
            raise ValueError(f"{name} = {value} cannot be split over {procs} processes (each needs at least one)")


def _check_processes_agree(point, tokenizer, num_train: int, num_heldout: int) -> None:
    """Every process sees the same run folder state, data and tokenizer (a collective; it is also
    the barrier before process 0 changes the run folder).

    Raises:
      ValueError: one line naming what differs (put ``--run_dir`` and ``--cache_dir`` on a file
        system that every process shares).
    """
    import hashlib

    from mempo_jax.distributed import allgather

    probe = tokenizer.encode("<mem> Paris, 1987; acme </mem><search> who founded globex </search>")
    digest = hashlib.sha256(np.asarray([tokenizer.vocab_size, *probe], np.int64).tobytes()).digest()[:8]
    words = np.frombuffer(digest, np.int32)
    mine = np.asarray([-1 if point.sft_step is None else point.sft_step, -1 if point.rl_step is None else point.rl_step,
                       int(bool(point.eval_sft)), int(bool(point.eval_rl)), num_train, num_heldout, *words], np.int32)
    table = allgather(mine)
    names = ("SFT checkpoint", "RL checkpoint", "SFT evaluation file", "RL evaluation file", "training questions",
             "held-out questions", "tokenizer", "tokenizer")
    for col, name in enumerate(names):
        if not (table[:, col] == table[0, col]).all():
            raise ValueError(f"processes disagree on the {name} ({table[:, col].tolist()} by process): put --run_dir "
                             "and --cache_dir on a file system every process shares, with the same data")


def _initialize_distributed() -> bool:
    """``distributed.maybe_initialize()`` once per interpreter (before any JAX device use)."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from mempo_jax.distributed import maybe_initialize

        _DISTRIBUTED = maybe_initialize()
    return _DISTRIBUTED


_DISTRIBUTED = None


def run(args) -> dict:
    """Run every stage, resuming from the newest durable point of ``RUN_DIR``.

    Returns:
      The summary written to ``RUN_DIR/summary.json``.

    Raises:
      ValueError / FileNotFoundError: bad config, data, tokenizer or run folder (one line, raised
        before anything in the run folder changes); also a mesh that does not fit the devices,
        a batch that does not divide over it, or processes that see different run folders.
      Preempted: a SIGTERM arrived; the state is saved (``main`` exits 0).
      NumericalFault: too many non-finite steps; the last good checkpoint is kept (``main`` exits 3).
    """
    _initialize_distributed()  # joins the other processes of a multi-host job, before any JAX use
    from mempo_jax import config as config_lib
    from mempo_jax import distributed, lockstep
    from mempo_jax.agent.trajectory import mode_name, parse_context_steps
    from mempo_jax.checkpoint import Checkpointer, check_run_artifacts, save_run_artifacts
    from mempo_jax.data.messages import conversation_trajectory, read_messages
    from mempo_jax.data.scripted_agent import scripted_conversation
    from mempo_jax.evaluation import evaluate_policy, is_kind_metric, kind_metrics
    from mempo_jax.experiment import build_experiment, check_qa_inputs, entity_token_ids
    from mempo_jax.learner import Learner, make_optimizer
    from mempo_jax.metrics import format_eval_table, paired_gains, write_json_atomic, write_text_atomic
    from mempo_jax.preemption import Preempted, Preemption
    from mempo_jax.resume import (CORRUPT_DIR, EVAL_BASE_FILE, EVAL_RL_FILE, EVAL_SFT_FILE, FaultCounter, FaultHooks,
                                  RunLogs, check_free_space, check_logs, check_run_folder, check_sft_step,
                                  find_resume_point, restore_newest)
    from mempo_jax.rl_step import rl_step
    from mempo_jax.sft import copy_rows, iterate_sft_batches, sft_rows

    t_start = time.time()
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "MEMPO_XLA_CACHE", str(pathlib.Path.home() / ".cache" / "mempo_jax" / "xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("MEMPO_XLA_CACHE_MIN_S", "1.0")))
    run_dir = pathlib.Path(args.run_dir)
    run_cfg = load_run_config(args.gin_file or [DEFAULT_GIN], args.gin_param)
    cfg = run_cfg.experiment
    check_qa_inputs(cfg)  # QA files, corpus, retriever: a bad one stops the run before RUN_DIR changes
    ck, hooks = cfg.checkpoint, FaultHooks.from_env()
    multi, primary = jax.process_count() > 1, distributed.is_primary()
    mesh = rules = None
    if run_cfg.sharded or multi:
        mesh, rules = make_run_mesh(run_cfg.mesh), run_cfg.mesh.rules
        _check_mesh_sizes(cfg, mesh, rules)
    sft_micro = cfg.sft.micro_batch_rows or cfg.sft.batch_rows
    # An SFT trajectory file is read and validated before the run folder changes.
    sft_file = read_messages(cfg.sft.data_path) if cfg.sft.steps > 0 and cfg.sft.data_path else None
    interruptible = contextlib.nullcontext if multi else None  # see preemption below
    say = print if primary else (lambda *a, **k: None)
    check_run_folder(run_dir)  # writable; a fresh one is created only once every check has passed
    stack = contextlib.ExitStack()
    with stack:
        pre = stack.enter_context(Preemption(ck.grace_s))  # exits last: after the saves are complete
        # Several processes: a SIGTERM never abandons work half-way on one process only (the others
        # would wait for it in a collective); every process learns of it at the next step boundary.
        interruptible = interruptible or pre.interruptible

        def agree_on_preemption() -> None:
            if multi and not pre.requested and distributed.allgather(np.asarray([pre.requested], np.int32)).any():
                pre.requested, pre.received_at = True, time.monotonic()

        # Nothing in the run folder changes (a fresh one is not even created) until every check,
        # down to the restore of the checkpoints resumed from, has passed.
        sft_ckpt = Checkpointer(run_dir / "sft_checkpoint", ck.max_to_keep, ck.async_save, prepare=False)
        stack.callback(sft_ckpt.close)
        rl_ckpt = Checkpointer(run_dir / "checkpoints", ck.max_to_keep, ck.async_save, prepare=False)
        stack.callback(rl_ckpt.close)
        if args.resume and not (sft_ckpt.steps() or rl_ckpt.steps()):
            raise FileNotFoundError(f"--resume: no checkpoint under {run_dir / 'sft_checkpoint'} or "
                                    f"{run_dir / 'checkpoints'}")
        cache = args.cache_dir or os.environ.get("MEMPO_CACHE") or str(run_dir / ".cache")

        with interruptible():
            exp = build_experiment(cfg, cache, mesh=mesh, rules=rules,
                                   scoring_chunk_rows=run_cfg.plan.scoring_chunk_rows or None)
        tok = exp.tokenizer
        # Host-side work runs per process on its share; device programs on the global batch.
        sync, sample_fn_all, scorer = lockstep.distribute(exp.sample_fn, exp.scorer, tok.pad_id)
        if not multi:
            sample_fn_all = exp.sample_fn  # one process: the plain objects, as before
            scorer = exp.scorer
        sft_opt, rl_opt = make_optimizer(cfg.sft.optim), make_optimizer(cfg.optim)

        def opt_target(opt):
            """The optimizer state's restore target (with the mesh: its shardings)."""
            abstract = jax.eval_shape(opt.init, exp.params)
            if mesh is None:
                return abstract
            from mempo_jax.sharding import opt_state_shardings

            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                opt_state_shardings(opt, exp.params, mesh, rules))

        def new_learner(params, opt, **kw):
            if multi:
                return lockstep.DistributedLearner(exp.logits_fn, params, opt, mesh=mesh, rules=rules, sync=sync,
                                                   pad_id=tok.pad_id, **kw)
            if mesh is None:
                return Learner(exp.logits_fn, params, opt, **kw)
            return Learner(exp.logits_fn, params, opt, mesh=mesh, rules=rules, **kw)

        key = jax.random.PRNGKey(cfg.seed)
        rl_key, eval_key = jax.random.fold_in(key, _RL_STREAM), jax.random.fold_in(key, _EVAL_STREAM)

        def restore(point):
            """Everything a resume needs, read and checked (a corrupt checkpoint: ``CorruptCheckpoint``)."""
            if multi:
                _check_processes_agree(point, tok, len(exp.train_questions), len(exp.heldout_questions))
            if point.fresh:
                return None, None
            check_run_artifacts(run_dir, tok, exp.model_cfg)
            sft = sft_ckpt.restore(point.sft_step, exp.params, None if point.sft_done else opt_target(sft_opt))
            rl = None
            if point.rl_step is not None:
                rl = rl_ckpt.restore(point.rl_step, exp.params, opt_target(rl_opt))
                if rl[2]["rng"]["step_key"] != jax.random.key_data(jax.random.fold_in(rl_key, point.rl_step)).tolist():
                    raise ValueError(f"{point.source}: the checkpoint's RNG stream is not this config's "
                                     f"(seed {cfg.seed}); use another --run_dir")
            check_logs(run_dir, point.newest(), point.source)
            return sft, rl

        point, (sft_state, rl_state) = restore_newest(
            lambda skip: find_resume_point(run_dir, sft_ckpt, rl_ckpt, cfg.seed, cfg.sft.steps, cfg.rl.steps, skip),
            restore)
        check_free_space(run_dir, _checkpoint_bytes(exp.params, opt_target(rl_opt)))

        # ---- every check has passed: the run folder changes from here on -----------------
        newest = point.newest()
        if primary:
            run_dir.mkdir(parents=True, exist_ok=True)
            for where, why in point.skipped.items():  # kept, out of orbax's way (its step is saved again)
                ckpt = sft_ckpt if pathlib.Path(where).parent == sft_ckpt.directory else rl_ckpt
                kept = ckpt.set_aside(int(pathlib.Path(where).name), run_dir / CORRUPT_DIR)
                print(f"[mempo] skipped checkpoint {where}: {why}; resuming from {point.source}; the skipped "
                      f"one is kept as {kept}", file=sys.stderr, flush=True)
            for name, keep in ((EVAL_SFT_FILE, point.eval_sft), (EVAL_RL_FILE, point.eval_rl)):
                if not keep:
                    (run_dir / name).unlink(missing_ok=True)
            write_text_atomic(run_dir / "config.gin", config_lib.operative_config())
            save_run_artifacts(run_dir, tok, exp.model_cfg)
            logs = RunLogs(run_dir, newest, point.source, warn=lambda msg: tqdm.write(msg, file=sys.stderr))
        else:
            logs = _NoLogs(newest)
        stack.callback(logs.close)
        sync.barrier()  # several processes: process 0 has created the folders, moved skipped checkpoints
        sft_ckpt.prepare()
        rl_ckpt.prepare()
        t_start -= float(newest.get("elapsed_s", 0.0)) if newest else 0.0
        say(f"[mempo] {cfg.dataset}: {len(exp.train_questions)} train / {len(exp.heldout_questions)} held-out "
            f"questions, search {exp.corpus}, vocab {tok.vocab_size}, "
            f"model {exp.model_cfg.num_params() / 1e6:.2f} M params", flush=True)
        if mesh is not None:
            say(f"[mempo] mesh {dict(mesh.shape)} over {mesh.devices.size} devices, {jax.process_count()} "
                f"process(es)", flush=True)
        if not point.fresh:
            say(f"[mempo] {point.describe()}", flush=True)
        train_steps = cfg.rl.rollout.context_steps

        def meta(stage, step, learner, **extra):
            return {"stage": stage, "step": int(step), "updates": int(learner.num_updates), "seed": cfg.seed,
                    "elapsed_s": time.time() - t_start, **logs.offsets(), **extra}

        # ---- 2. cold-start SFT ------------------------------------------------------------
        learner = new_learner(exp.params, sft_opt, micro_batch_rows=sft_micro)
        # ---- evaluation (before SFT when EvalConfig.zero_shot, after SFT, after RL) ----------
        held = exp.heldout_questions[: cfg.eval.num_questions or None]
        if multi and len(held) < jax.process_count():
            raise ValueError(f"EvalConfig.num_questions: {len(held)} held-out questions cannot be split over "
                             f"{jax.process_count()} processes")
        held_mine = held[distributed.process_slice(len(held))] if multi else held
        modes = [parse_context_steps(m) for m in cfg.eval.context_modes]

        def evaluate(stage: str):
            out, per_q, per_f1 = {}, {}, {}
            for mode in modes:
                bar = tqdm(total=len(held_mine), desc=f"eval {stage} {mode_name(mode)}", leave=False,
                           disable=not primary)
                res = evaluate_policy(sample_fn_all, learner.params, held_mine, exp.fmt, exp.tool_env, cfg.rl.rollout,
                                      mode, cfg.eval.temperature, eval_key, progress=lambda n: bar.update(n - bar.n))
                bar.close()
                metrics, em, f1 = res.metrics, res.per_question_em, res.per_question_f1
                metrics = {k: v for k, v in metrics.items() if not is_kind_metric(k)}  # redone on all questions
                if multi:  # every process's questions, in the single-process order (collectives)
                    em = distributed.concat_processes(em, sync).astype(np.float64)
                    f1 = distributed.concat_processes(f1, sync).astype(np.float64)
                    means = distributed.mean_metrics({k: v for k, v in metrics.items() if k != "n"},
                                                     weight=float(len(held_mine)), sync=sync)
                    metrics = {k: (len(held) if k == "n" else means[k]) for k in metrics}
                metrics.update(kind_metrics(held, em, f1))  # "eval/<kind>/em", /f1, /n
                out[mode_name(mode)], per_q[mode_name(mode)], per_f1[mode_name(mode)] = metrics, em, f1
                logs.write(learner.num_updates, f"eval_{stage}_{mode_name(mode)}", metrics)
                say(f"[mempo] eval {stage} {mode_name(mode)}: EM {metrics['em']:.3f} F1 {metrics['f1']:.3f} "
                    f"TT {metrics['tt']:.0f} PT {metrics['pt']:.0f}", flush=True)
            return out, per_q, per_f1

        def evaluate_once(stage: str, stored, ckpt, name: str, step_key: str, step: int):
            """The stage's evaluation, or its stored result; stored after the stage's checkpoint is complete.

            Returns ``(metrics by mode, {"em": {mode: [questions]}, "f1": {mode: [questions]}})``."""
            if stored:
                return stored["evals"], {key: {k: np.asarray(v, np.float64) for k, v in stored.get(f"per_question_{key}", {}).items()}
                                         for key in ("em", "f1")}
            with interruptible():
                out, per_q, per_f1 = evaluate(stage)
            if ckpt is not None:
                ckpt.wait()
            per = {"em": {k: np.asarray(v, np.float64) for k, v in per_q.items()},
                   "f1": {k: np.asarray(v, np.float64) for k, v in per_f1.items()}}
            if primary:
                write_json_atomic(run_dir / name, {step_key: step, "evals": out,
                                                   **{f"per_question_{key}": {k: v.tolist() for k, v in d.items()}
                                                      for key, d in per.items()},
                                                   **meta(f"eval_{stage}", step, learner)})
            return out, per

        evals, per_q = {}, {}
        if cfg.eval.zero_shot:  # the initial policy (a checkpoint before any training), stored once
            stored = _read_json_or_none(run_dir / EVAL_BASE_FILE)
            if stored or point.fresh or (point.sft_step is None and point.rl_step is None):
                evals["base"], per_q["base"] = evaluate_once("base", stored, None, EVAL_BASE_FILE, "base_step", 0)
            else:
                say(f"[mempo] EvalConfig.zero_shot: no {EVAL_BASE_FILE} in this resumed run folder; "
                    "the initial policy is gone, so the zero-shot evaluation is skipped", flush=True)

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
                with interruptible():  # the same rows on every process (one generator); each feeds its share
                    # A messages file, or the scripted agent's conversations: one path to trajectories.
                    convs = sft_file or [scripted_conversation(q, exp.offices, exp.tool_env, cfg.sft.agent, rng)
                                         for q in tqdm(exp.train_questions, desc="scripted agent", leave=False,
                                                       disable=not primary)]
                    trajs = [conversation_trajectory(c, exp.fmt, cfg.rl.rollout.max_observation_tokens, train_steps)
                             for c in convs]
                    full_trajs = None
                    if not sft_file and not cfg.sft.agent.lazy_full_rows:  # diligent replays, own stream
                        diligent = dataclasses.replace(cfg.sft.agent, lazy_prob=0.0)
                        rng_d = np.random.default_rng([cfg.seed, _DILIGENT_STREAM])
                        full_trajs = [conversation_trajectory(scripted_conversation(q, exp.offices, exp.tool_env,
                                                                                    diligent, rng_d),
                                                              exp.fmt, cfg.rl.rollout.max_observation_tokens,
                                                              train_steps) for q in exp.train_questions]
                    rows = sft_rows(trajs, train_steps, cfg.sft.full_fraction, tok.pad_id, rng, full_trajs)
                    if sft_file:
                        say(f"[mempo] SFT on {len(trajs)} conversations of {cfg.sft.data_path} ({len(rows)} rows)",
                            flush=True)
                    rows += copy_rows(entity_token_ids(tok, exp.documents), int(cfg.sft.copy_fraction * len(rows)),
                                      tok.bos_id, rng)
                    batches = iterate_sft_batches(rows, cfg.sft.batch_rows, tok.pad_id, rng)
                    for _ in range(start):  # replay the data order up to the checkpoint
                        next(batches)
            bar = stack.enter_context(tqdm(total=cfg.sft.steps, initial=start, desc="SFT", disable=not primary))
            mine = distributed.process_slice(cfg.sft.batch_rows) if multi else slice(None)
            for step in range(start, cfg.sft.steps):
                batch = next(batches)
                m = learner.sft_step({k: v[mine] for k, v in batch.items()} if multi else batch)
                bar.update(1)
                bar.set_postfix(loss=f"{m['sft/loss']:.3f}")
                logs.write(step, "sft", m)
                check_sft_step(step, m, f"{sft_ckpt.directory}/{sft_saved}" if sft_saved is not None else "none")
                agree_on_preemption()
                done = step + 1 == cfg.sft.steps
                if done or (step + 1) % ck.every_steps == 0 or pre.requested:
                    sft_ckpt.save(step + 1, learner.params, learner.opt_state, meta("sft", step + 1, learner, final=done))
                    sft_saved = step + 1
                pre.check()
            bar.close()
            if cfg.sft.steps == 0:
                sft_ckpt.save(0, learner.params, learner.opt_state, meta("sft", 0, learner, final=True))
        ref_params = jax.tree.map(lambda x: x.copy(), learner.params)  # frozen reference: the SFT result

        evals["sft"], per_q["sft"] = evaluate_once("sft", point.eval_sft, sft_ckpt, EVAL_SFT_FILE, "sft_step",
                                                   cfg.sft.steps)

        # ---- 4. MemPO RL ------------------------------------------------------------------
        learner = new_learner(learner.params, rl_opt, temperature=cfg.rl.rollout.temperature,
                              micro_batch_rows=run_cfg.plan.micro_batch_rows,
                              logprob_chunk_rows=run_cfg.plan.logprob_chunk_rows)
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
        rl_saved = point.rl_step
        current = {"step": start}
        ppo_update, sample_fn = learner.ppo_update, sample_fn_all

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
                return sample_fn_all(*a, **kw)

        def save_rl(step, data_state, offsets, fault_state):
            nonlocal rl_saved
            rl_ckpt.save(step, learner.params, learner.opt_state, {
                **meta("rl", step, learner), **offsets, "data_iterator": data_state, "faults": fault_state,
                "rng": {"seed": cfg.seed, "next_step": step,
                        "step_key": jax.random.key_data(jax.random.fold_in(rl_key, step)).tolist()}})
            rl_saved = step

        bar = stack.enter_context(tqdm(total=cfg.rl.steps, initial=start, desc="MemPO RL", disable=not primary))
        for step in range(start, cfg.rl.steps):
            current["step"] = step
            data_state, offsets, fault_state = _plain(order.get_state()), logs.offsets(), faults.state()
            try:
                with interruptible():  # a SIGTERM here abandons the step: its state is unchanged
                    qs = [exp.train_questions[int(i)] for i in next(order)]
                    first = 0
                    if multi:  # this process's questions: its rollouts, tool calls and parsing
                        mine = distributed.process_slice(len(qs))
                        qs, first = qs[mine], mine.start
                    m, trajs = rl_step(learner, ref_params, sample_fn, scorer, qs, exp.fmt, exp.tool_env, cfg.rl,
                                       jax.random.fold_in(rl_key, step),
                                       np.random.default_rng([cfg.seed, _RL_STREAM, step]))
            except Preempted:
                if rl_saved != step:
                    save_rl(step, data_state, offsets, fault_state)
                raise
            m = _global_rl_metrics(m, trajs, sync)
            m.update(faults.observe(step, m))
            if faults.streak and primary:
                print(f"[mempo] RL step {step}: non-finite loss or gradients, update skipped "
                      f"({faults.streak}/{faults.max_consecutive} in a row)", file=sys.stderr, flush=True)
            logs.write(step, "rl", m)
            logs.write_rollouts(_global_rollout_records(
                [{"step": step, **_trajectory_record(tr, tok, first)} for tr in trajs[: cfg.log_rollouts]],
                cfg.log_rollouts, sync))
            bar.update(1)
            bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", em=f"{m['critic/em/mean']:.3f}",
                            mem=f"{m['mem/reward/mean']:+.3f}", turns=f"{m['num_turns/mean']:.1f}")
            if faults.exceeded:
                last = f"{rl_ckpt.directory}/{rl_saved}" if rl_saved is not None else \
                    f"{sft_ckpt.directory}/{cfg.sft.steps} (SFT; no RL checkpoint yet)"
                raise faults.error(last)
            agree_on_preemption()
            done = step + 1 == cfg.rl.steps
            if done or pre.requested or ((step + 1) % ck.every_steps == 0 and not faults.streak):
                save_rl(step + 1, _plain(order.get_state()), logs.offsets(), faults.state())
            pre.check()
        bar.close()
        if rl_saved != cfg.rl.steps:  # RLConfig.steps = 0
            save_rl(cfg.rl.steps, _plain(order.get_state()), logs.offsets(), faults.state())

        evals["rl"], per_q["rl"] = evaluate_once("rl", point.eval_rl, rl_ckpt, EVAL_RL_FILE, "rl_step", cfg.rl.steps)
        exported = None
        if cfg.model.checkpoint:  # the RL policy as a Hugging Face folder (every process: a collective)
            from mempo_jax.export import EXPORT_DIR, export_policy

            exported = str(export_policy(run_dir / EXPORT_DIR, exp.model_cfg, learner.params, tok,
                                         source=cfg.model.checkpoint))

        # ---- summary ----------------------------------------------------------------------
        k1 = mode_name(modes[0])
        gains = {f"{after}_vs_{before}": paired_gains(per_q[after], per_q[before], cfg.eval.bootstrap_samples, cfg.seed)
                 for before, after in (("base", "sft"), ("sft", "rl")) if before in per_q}
        gain_mean, lo, hi = gains["rl_vs_sft"][k1]["em"]
        summary = {
            "eval": evals, "em_gain": gain_mean, "em_gain_ci95": [lo, hi], "em_gain_mode": k1, "gains": gains,
            "wall_s": time.time() - t_start, "params": exp.model_cfg.num_params(), "dataset": cfg.dataset,
            "heldout_questions": len(held), "hf_export": exported,
        }
        if primary:
            write_json_atomic(run_dir / "summary.json", summary)
    say("\n" + format_eval_table(evals))
    for name, by_mode in summary["gains"].items():
        for mode, g in by_mode.items():
            say(f"[mempo] {mode} gain {name.replace('_vs_', ' - ').upper()}: EM {g['em'][0]:+.3f} "
                f"[{g['em'][1]:+.3f}, {g['em'][2]:+.3f}]  F1 {g['f1'][0]:+.3f} [{g['f1'][1]:+.3f}, {g['f1'][2]:+.3f}]",
                flush=True)
    say(f"\n[mempo] {summary['em_gain_mode']} EM gain RL - SFT: {summary['em_gain']:+.3f}  95% CI "
        f"[{summary['em_gain_ci95'][0]:+.3f}, {summary['em_gain_ci95'][1]:+.3f}]  "
        f"wall {summary['wall_s'] / 60:.1f} min  -> {run_dir / 'summary.json'}", flush=True)
    return summary


def main(argv=None) -> int:
    """CLI entry point.

    Returns:
      0 when done or preempted (checkpoint saved), 2 for a config, data or run-folder error or a
      failed write (disk full, read-only folder; one line on stderr), 3 when non-finite steps
      stopped the run (one line on stderr).
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
    except (ValueError, OSError) as e:  # bad config, data or run folder; a full disk, a read-only folder
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    """The error as one line: an ``OSError`` as ``FILE: reason`` (e.g. ``No space left on device``)."""
    if isinstance(e, OSError) and e.strerror and not isinstance(e, FileNotFoundError):
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror} [errno {e.errno}]"
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
