"""What every stage of the main job shares: the run context, built and checked once (``open_run``).

``open_run`` does everything before the first stage, in the order that keeps a run folder safe:
config, inputs, mesh and batch sizes are checked, the experiment is built, the newest durable
point is restored and checked, and only then the run folder changes (created, skipped
checkpoints set aside, stale evaluation files removed, ``config.gin`` and the tokenizer / model
artefacts written, logs cut back to the point). The stages (``mempo_jax.run.stages``) then read and
write through the ``RunContext``.

One device path: the run always has a mesh (``(1, 1, 1)`` unless the config binds
``MeshConfig`` or several processes run), rolls out on this process's devices of it
(``core.rollout_mesh``) and always uses the ``lockstep`` wrappers for the global programs, which
are pass-throughs on one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

import jax
import numpy as np
from tqdm.auto import tqdm

from mempo_jax.core import distributed, paths
from mempo_jax.core.paths import RunPath
from mempo_jax.core.host_memory import release_free_memory

from mempo_jax.run import lockstep
from mempo_jax.run.checkpoint import Checkpointer, check_run_artifacts, save_run_artifacts
from mempo_jax.rl.learner import Learner, TrainState, make_optimizer
from mempo_jax.core.mesh_config import MeshConfig
from mempo_jax.core.paths import write_text_atomic
from mempo_jax.run.preemption import Preemption
from mempo_jax.run.faults import FaultHooks
from mempo_jax.run.resume import (CORRUPT_DIR, EVAL_RL_FILE, EVAL_SFT_FILE, check_free_space, check_run_folder,
                                  find_resume_point, restore_newest)
from mempo_jax.run.run_logs import RunLogs, check_logs
from mempo_jax.core.sharding import batch_shards, opt_state_shardings
from mempo_jax.model.lora import split_trainable, trainable_part
from mempo_jax import config_loader
from mempo_jax.run.experiment import build_experiment

if TYPE_CHECKING:
    import optax

    from mempo_jax.config import ExperimentConfig

    from mempo_jax.config_loader import RunConfig
    from mempo_jax.run.experiment import Experiment
    from mempo_jax.run.resume import ResumePoint

    # A restored checkpoint: its ``TrainState`` (the frozen base put back; no optimizer state
    # where none was restored) and its metadata.
    Restored = tuple[TrainState, dict]

# Independent random streams: PRNG keys fold_in(fold_in(key(seed), stream), step); numpy
# generators default_rng([seed, stream, step]). The SFT data keeps one generator (seeded by the
# seed alone) whose draws are replayed on resume.
RL_STREAM, EVAL_STREAM, REPLAY_STREAM, COPY_STREAM, READER_STREAM = 1, 2, 3, 4, 5


def setup_compilation_cache() -> None:
    """JAX's persistent XLA cache: ``$MEMPO_XLA_CACHE`` (default ``~/.cache/mempo_jax/xla``), programs
    that took at least ``$MEMPO_XLA_CACHE_MIN_S`` seconds (default 1) to compile. The trainer and
    the evaluation command both call it."""
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "MEMPO_XLA_CACHE", str(pathlib.Path.home() / ".cache" / "mempo_jax" / "xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("MEMPO_XLA_CACHE_MIN_S", "1.0")))


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
    sizes = (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    need = math.prod(sizes)
    if -1 not in sizes and need < jax.device_count() and jax.process_count() == 1:
        return mesh_cfg.make(jax.devices()[:need])
    return mesh_cfg.make()


class NoLogs:
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


def read_json_or_none(path: pathlib.Path):
    """The JSON object in ``path``, or None when it is absent or unreadable (then it is redone)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rl_rng_record(rl_key, seed: int, step: int) -> dict:
    """The RNG stream an RL checkpoint at ``step`` records (and a resume checks): the seed, the next
    step and that step's key ``fold_in(rl_key, step)`` as key data."""
    return {"seed": seed, "next_step": step, "step_key": jax.random.key_data(jax.random.fold_in(rl_key, step)).tolist()}


@dataclasses.dataclass
class RLCheckpoint:
    """What an RL checkpoint holds besides the policy and optimizer state: the one record that
    ``save`` writes and ``from_meta`` reads back.

    Attributes:
      step: RL steps done.
      data_iterator: the grain iterator state (a JSON-able dict).
      offsets: the metric-log offsets at that point (``RunLogs.offsets``).
      faults: the ``FaultCounter`` state.
      updates: optimizer updates done (``TrainState.step``).
    """

    step: int
    data_iterator: dict
    offsets: dict
    faults: dict
    updates: int = 0

    def meta(self, base: dict, rl_key, seed: int) -> dict:
        """The checkpoint's metadata: ``base`` (``RunContext.meta``) with this record and its RNG stream."""
        return {**base, **self.offsets, "data_iterator": self.data_iterator, "faults": self.faults,
                "rng": rl_rng_record(rl_key, seed, self.step)}

    @classmethod
    def from_meta(cls, meta: dict, step: int, rl_key, seed: int, source: str) -> "RLCheckpoint":
        """The record of a restored checkpoint's metadata.

        Raises:
          ValueError: the checkpoint's RNG stream is not this config's (another seed).
        """
        if meta["rng"]["step_key"] != rl_rng_record(rl_key, seed, step)["step_key"]:
            raise ValueError(f"{source}: the checkpoint's RNG stream is not this config's (seed {seed}); "
                             "use another --run_dir")
        offsets = {k: meta[k] for k in ("metrics", "rollouts") if k in meta}
        return cls(step, meta["data_iterator"], offsets, meta["faults"], int(meta["updates"]))


@dataclasses.dataclass
class RunProgress:
    """What the stages change as the run goes (the one mutable part of a ``RunContext``).

    Attributes:
      sft_saved, rl_saved: the newest saved SFT / RL step (None: none yet).
      rl_step: the RL step running (``cfg.rl.steps`` once RL is done).
    """

    sft_saved: Optional[int] = None
    rl_saved: Optional[int] = None
    rl_step: int = 0


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the stages share, set up once by ``open_run`` (frozen); what the loop changes is
    ``progress``.

    Attributes:
      run_dir, run_cfg: the run folder (``core.paths.run_path``: a ``pathlib.Path``, or an
        ``etils.epath.Path`` for ``gs://…``) and the whole ``RunConfig`` (``cfg``: its ``ExperimentConfig``).
      exp: the ``Experiment``; its ``policy`` holds the device mesh (always one), the
        logical-axis rules and the rollout engine (host-local).
      sync, scorer: the lockstep header exchange and scorer (``lockstep.distribute`` of ``exp.scorer``).
      logs: ``RunLogs`` (process 0) or ``NoLogs``.
      sft_ckpt, rl_ckpt: the two ``Checkpointer``s.
      pre: the ``Preemption`` handler; ``interruptible``: its region (a no-op with several processes).
      point: the ``ResumePoint``; ``sft_state`` / ``rl_state``: the restored checkpoints or None.
      hooks: the test-only ``FaultHooks``; ``t_start``: wall-clock origin (minus resumed time).
      rl_key, eval_key: the RL and evaluation PRNG streams.
      sft_opt, rl_opt: the SFT and RL optimizers.
      progress: the ``RunProgress`` (saved steps, the RL step running).
    """

    run_dir: RunPath
    run_cfg: RunConfig
    exp: Experiment
    sync: lockstep.HostSync
    scorer: lockstep.DistributedScorer
    sft_ckpt: Checkpointer
    rl_ckpt: Checkpointer
    pre: Preemption
    interruptible: Callable
    hooks: FaultHooks
    t_start: float
    rl_key: jax.Array
    eval_key: jax.Array
    sft_opt: optax.GradientTransformation
    rl_opt: optax.GradientTransformation
    logs: RunLogs | NoLogs | None = None
    point: Optional[ResumePoint] = None
    sft_state: Optional[Restored] = None
    rl_state: Optional[Restored] = None
    progress: RunProgress = dataclasses.field(default_factory=RunProgress)

    @property
    def cfg(self) -> ExperimentConfig:
        """The run's ``ExperimentConfig`` (``run_cfg.experiment``, which ``exp`` was built of)."""
        return self.run_cfg.experiment

    @property
    def multi(self) -> bool:
        """Several processes."""
        return jax.process_count() > 1

    @property
    def primary(self) -> bool:
        """Process 0 (the one that writes)."""
        return distributed.is_primary()

    def say(self, *args, **kwargs) -> None:
        """``print`` on process 0."""
        if self.primary:
            print(*args, **kwargs)

    def meta(self, stage: str, step: int, learner, **extra) -> dict:
        """A durable point's metadata: stage, step, updates, seed, elapsed time and log offsets."""
        return {"stage": stage, "step": int(step), "updates": int(learner.state.step), "seed": self.cfg.seed,
                "elapsed_s": time.time() - self.t_start, **self.logs.offsets(), **extra}

    def agree_on_preemption(self) -> None:
        """Several processes: a SIGTERM on any of them is acted on by all (a collective)."""
        pre = self.pre
        if self.multi and not pre.requested and distributed.allgather(np.asarray([pre.requested], np.int32)).any():
            pre.requested, pre.received_at = True, time.monotonic()

    def new_learner(self, params, opt, **kw) -> Learner:
        """A learner of the policy on the run's mesh, its rows gathered in lockstep (after a
        barrier: its construction runs global programs)."""
        policy = self.exp.policy
        self.sync.barrier()
        pad_id = policy.tokenizer.pad_id
        return Learner(policy.logits_fn, params, opt, mesh=policy.mesh, rules=policy.rules, pad_id=pad_id,
                       placement=lockstep.LockstepRows(self.sync, pad_id), **kw)

    def opt_target(self, opt):
        """The optimizer state's restore target, with its shardings on the mesh (the state of the
        trainable part: the LoRA adapters of a LoRA run)."""
        policy = self.exp.policy
        trainable = trainable_part(policy.params)
        abstract = jax.eval_shape(opt.init, trainable)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                            opt_state_shardings(opt, trainable, policy.mesh, policy.rules))

    def save(self, ckpt, step: int, learner, meta: dict) -> None:
        """Save ``learner``'s ``TrainState`` as checkpoint ``step`` of ``ckpt``: its trainable part
        (the adapters of a LoRA run: the base is rebuilt from the config) and optimizer state;
        its step is ``meta["updates"]`` (``RunContext.meta``)."""
        ckpt.save(step, learner.state.trainable, learner.state.opt_state, meta)
        release_free_memory()  # the save's host copies (an asynchronous save's: the previous one's)


def check_mesh_sizes(cfg, mesh, rules) -> None:
    """Batch sizes that the mesh and the processes need, checked before anything runs.

    Raises:
      ValueError: naming the field: ``SFTConfig.batch_rows`` that does not divide over the mesh's
        batch shards (``MeshConfig.rules`` "batch", data x fsdp by default), or a per-step count
        (``SFTConfig.batch_rows``, ``RLConfig.questions_per_step``) smaller than the process count,
        or ``RLConfig.filter_groups`` other than ``"none"`` on several processes (each would
        drop a different number of rows).
    """
    shards, procs = batch_shards(mesh, rules), jax.process_count()
    if cfg.sft.steps > 0 and cfg.sft.batch_rows % shards:
        raise ValueError(f"SFTConfig.batch_rows = {cfg.sft.batch_rows} does not divide over the {shards} batch shards "
                         f"of the mesh {dict(mesh.shape)} (MeshConfig.rules 'batch')")
    for name, value in (("SFTConfig.batch_rows", cfg.sft.batch_rows if cfg.sft.steps > 0 else procs),
                        ("RLConfig.questions_per_step", cfg.rl.questions_per_step if cfg.rl.steps > 0 else procs)):
        if value < procs:
            raise ValueError(f"{name} = {value} cannot be split over {procs} processes (each needs at least one)")
    if cfg.rl.steps > 0 and cfg.rl.filter_groups != "none" and procs > 1:
        raise ValueError(f"RLConfig.filter_groups = {cfg.rl.filter_groups!r} runs on one process, not {procs} "
                         "(set it to 'none')")


def check_processes_agree(point, tokenizer, num_train: int, num_heldout: int) -> None:
    """Every process sees the same run folder state, data and tokenizer (a collective; it is also
    the barrier before process 0 changes the run folder). Nothing on one process.

    Raises:
      ValueError: one line naming what differs (put ``--run_dir`` and ``--cache_dir`` on a file
        system that every process shares).
    """
    if jax.process_count() == 1:
        return
    probe = tokenizer.encode("<mem> Paris, 1987; acme </mem><search> who founded globex </search>")
    digest = hashlib.sha256(np.asarray([tokenizer.vocab_size, *probe], np.int64).tobytes()).digest()[:8]
    words = np.frombuffer(digest, np.int32)
    mine = np.asarray([-1 if point.sft_step is None else point.sft_step, -1 if point.rl_step is None else point.rl_step,
                       int(bool(point.eval_sft)), int(bool(point.eval_rl)), num_train, num_heldout, *words], np.int32)
    table = distributed.allgather(mine)
    names = ("SFT checkpoint", "RL checkpoint", "SFT evaluation file", "RL evaluation file", "training questions",
             "held-out questions", "tokenizer", "tokenizer")
    for col, name in enumerate(names):
        if not (table[:, col] == table[0, col]).all():
            raise ValueError(f"processes disagree on the {name} ({table[:, col].tolist()} by process): put --run_dir "
                             "and --cache_dir on a file system every process shares, with the same data")


def checkpoint_bytes(*trees) -> int:
    """Bytes of the arrays of ``trees`` (arrays or ``jax.ShapeDtypeStruct``): one checkpoint's size."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for t in trees for x in jax.tree.leaves(t)))


def default_cache_dir(run_dir) -> str:
    """The tokenizer cache when neither ``--cache_dir`` nor ``$MEMPO_CACHE`` names one:
    ``RUN_DIR/.cache`` for a local run folder; for a Cloud Storage one (the cache must be local)
    ``~/.cache/mempo_jax/runs/<sha256 of RUN_DIR, 16 hex digits>``."""
    if not paths.is_remote(run_dir):
        return str(run_dir / ".cache")
    digest = hashlib.sha256(str(run_dir).encode("utf-8")).hexdigest()[:16]
    return str(pathlib.Path.home() / ".cache" / "mempo_jax" / "runs" / digest)


def open_run(args, run_cfg, hooks: FaultHooks, stack: contextlib.ExitStack) -> RunContext:
    """Build the run's context: checks, experiment, restore; then the run folder is prepared.

    Args:
      args: the parsed command line (``run_dir``, ``cache_dir``, ``resume``).
      run_cfg: the ``RunConfig`` (``config_loader.load_run_config``), its inputs already checked.
      hooks: test-only fault hooks.
      stack: closes the preemption handler, the checkpointers and the logs (in that reverse order).

    Raises:
      ValueError / FileNotFoundError: as ``commands.train.run`` (before anything in the run folder changes).
    """

    t_start = time.time()
    run_dir, cfg, ck = paths.run_path(args.run_dir), run_cfg.experiment, run_cfg.experiment.checkpoint
    # The smallest mesh unless the config binds MeshConfig or several processes run (then the bound
    # or default MeshConfig over every device).
    mesh_cfg = run_cfg.mesh if run_cfg.sharded or jax.process_count() > 1 else MeshConfig(1, 1, 1)
    mesh, rules = make_run_mesh(mesh_cfg), mesh_cfg.rules
    check_mesh_sizes(cfg, mesh, rules)
    check_run_folder(run_dir)  # writable; a fresh one is created only once every check has passed
    pre = stack.enter_context(Preemption(ck.grace_s))  # exits last: after the saves are complete
    # Several processes: a SIGTERM never abandons work half-way on one process only (the others
    # would wait for it in a collective); every process learns of it at the next step boundary.
    interruptible = contextlib.nullcontext if jax.process_count() > 1 else pre.interruptible
    checkpointers = []
    for name in ("sft_checkpoint", "checkpoints"):  # nothing in the run folder changes yet
        checkpointers.append(Checkpointer(run_dir / name, ck.max_to_keep, ck.async_save, prepare=False))
        stack.callback(checkpointers[-1].close)
    sft_ckpt, rl_ckpt = checkpointers
    if args.resume and not (sft_ckpt.steps() or rl_ckpt.steps()):
        raise FileNotFoundError(f"--resume: no checkpoint under {run_dir / 'sft_checkpoint'} or "
                                f"{run_dir / 'checkpoints'}")
    cache = args.cache_dir or os.environ.get("MEMPO_CACHE") or default_cache_dir(run_dir)
    with interruptible():
        exp = build_experiment(cfg, cache, mesh=mesh, rules=rules,
                               scoring_chunk_rows=cfg.execution.scoring_chunk_rows or None)
    # Rollout runs per process on its share (host-local mesh); scoring and the update on the global batch.
    sync, scorer = lockstep.distribute(exp.scorer)
    key = jax.random.PRNGKey(cfg.seed)
    ctx = RunContext(run_dir, run_cfg, exp, sync, scorer, sft_ckpt, rl_ckpt, pre,
                     interruptible, hooks, t_start, jax.random.fold_in(jax.random.PRNGKey(cfg.rl_seed), RL_STREAM),
                     jax.random.fold_in(key, EVAL_STREAM), make_optimizer(cfg.sft.optim), make_optimizer(cfg.optim))
    point, (sft_state, rl_state) = restore_newest(
        lambda skip: find_resume_point(run_dir, sft_ckpt, rl_ckpt, cfg.seed, cfg.sft.steps, cfg.rl.steps, skip),
        lambda point: _restore(ctx, point))
    ctx = dataclasses.replace(ctx, point=point, sft_state=sft_state, rl_state=rl_state)
    check_free_space(run_dir, checkpoint_bytes(trainable_part(exp.policy.params), ctx.opt_target(ctx.rl_opt)))
    return _prepare_folder(ctx, stack)


def _restore(ctx: RunContext, point):
    """Everything a resume needs, read and checked (a corrupt checkpoint: ``CorruptCheckpoint``).

    Returns ``(sft_state, rl_state)``: ``(TrainState, meta)`` pairs or None."""
    exp, policy = ctx.exp, ctx.exp.policy
    check_processes_agree(point, policy.tokenizer, len(exp.train_questions), len(exp.heldout_questions))
    if point.fresh:
        return None, None
    check_run_artifacts(ctx.run_dir, policy.tokenizer, policy.model_cfg)
    # Checkpoints hold the trainable part (RunContext.save); the frozen base is the one built now.
    target, frozen = split_trainable(policy.params)

    def state(restored):  # Checkpointer.restore's (trainable, opt_state or None, meta)
        trainable, opt_state, meta = restored
        return TrainState(trainable, frozen, opt_state, int(meta["updates"])), meta

    sft = state(ctx.sft_ckpt.restore(point.sft_step, target, None if point.sft_done else ctx.opt_target(ctx.sft_opt)))
    rl = None
    if point.rl_step is not None:
        rl = state(ctx.rl_ckpt.restore(point.rl_step, target, ctx.opt_target(ctx.rl_opt)))
        RLCheckpoint.from_meta(rl[1], point.rl_step, ctx.rl_key, ctx.cfg.rl_seed, point.source)  # checks the RNG stream
    check_logs(ctx.run_dir, point.newest(), point.source)
    return sft, rl


def _prepare_folder(ctx: RunContext, stack: contextlib.ExitStack) -> RunContext:
    """Every check has passed: the run folder changes from here on (process 0 writes). Returns
    ``ctx`` with its logs, the resumed time taken off ``t_start`` and the resumed ``progress``."""

    run_dir, point, exp, policy = ctx.run_dir, ctx.point, ctx.exp, ctx.exp.policy
    newest = point.newest()
    if ctx.primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        for where, why in point.skipped.items():  # kept, out of orbax's way (its step is saved again)
            folder, step = where.rsplit("/", 1)
            ckpt = ctx.sft_ckpt if folder == str(ctx.sft_ckpt.directory) else ctx.rl_ckpt
            kept = ckpt.set_aside(int(step), run_dir / CORRUPT_DIR)
            print(f"[mempo] skipped checkpoint {where}: {why}; resuming from {point.source}; the skipped "
                  f"one is kept as {kept}", file=sys.stderr, flush=True)
        for name, keep in ((EVAL_SFT_FILE, point.eval_sft), (EVAL_RL_FILE, point.eval_rl)):
            if not keep:
                (run_dir / name).unlink(missing_ok=True)
        write_text_atomic(run_dir / "config.gin", config_loader.operative_config())
        save_run_artifacts(run_dir, policy.tokenizer, policy.model_cfg)
        logs = RunLogs(run_dir, newest, point.source, warn=lambda msg: tqdm.write(msg, file=sys.stderr))
    else:
        logs = NoLogs(newest)
    stack.callback(logs.close)
    ctx.sync.barrier()  # several processes: process 0 has created the folders, moved skipped checkpoints
    ctx.sft_ckpt.prepare()
    ctx.rl_ckpt.prepare()
    resumed_s = float(newest.get("elapsed_s", 0.0)) if newest else 0.0
    ctx = dataclasses.replace(ctx, logs=logs, t_start=ctx.t_start - resumed_s,
                              progress=RunProgress(sft_saved=point.sft_step, rl_saved=point.rl_step))
    ctx.say(f"[mempo] {ctx.cfg.dataset}: {len(exp.train_questions)} train / {len(exp.heldout_questions)} held-out "
            f"questions, search {exp.corpus}, vocab {policy.tokenizer.vocab_size}, "
            f"model {policy.model_cfg.num_params() / 1e6:.2f} M params", flush=True)
    if ctx.run_cfg.sharded or ctx.multi:
        mesh = policy.mesh
        ctx.say(f"[mempo] mesh {dict(mesh.shape)} over {mesh.devices.size} devices, {jax.process_count()} "
                f"process(es)", flush=True)
    if not point.fresh:
        ctx.say(f"[mempo] {point.describe()}", flush=True)
    return ctx
