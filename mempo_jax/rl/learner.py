"""The update: a ``TrainState`` pytree, the jitted steps that are pure functions of it
(``TrainSteps``: SFT, PPO, detached log-probs) and ``Learner``, the host loop that feeds them.

Every step is jitted once per (rows, seq) bucket; mini-batches are split into micro-batches that
accumulate gradients with one denominator for the whole mini-batch (docs/algorithm.md §5:
gradient accumulation equals the full-batch gradient; tunix-style (sum, denominator) losses).
One process and several run the same steps; only how a process's rows become the step's rows
differs (``RowPlacement``: ``LocalRows``, ``run.lockstep.LockstepRows``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.typing import ArrayLike
from jaxtyping import Bool, Float, Int

from mempo_jax.core.batching import bucket_length
from mempo_jax.core.packing import pack_token_rows
from mempo_jax.model.forward import LogitsFn, token_stats
from mempo_jax.rl.losses import LossConfig, loss_denominator, mempo_loss
from mempo_jax.core.sharding import (DEFAULT_RULES, batch_shards, logical_to_sharding, mesh_or_local, opt_state_shardings,
                                param_shardings, replicated)
from mempo_jax.core.validation import check
from mempo_jax.model.lora import join, split_trainable
from mempo_jax.rl.packed_logprobs import PackedLogprobs

T = TypeVar("T")
TRAIN_MIN_LENGTH = 128  # smallest length bucket of the RL step's training rows (tokens)

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and global-norm clipping.

    Attributes:
      learning_rate: peak learning rate.
      warmup_steps: linear warm-up length (optimizer steps).
      weight_decay: AdamW decoupled weight decay.
      grad_clip: global gradient-norm clip.
      b1, b2: Adam moments.
      decay_steps: optimizer steps of a cosine decay after the warm-up, from ``learning_rate``
        to ``final_lr_fraction * learning_rate`` (then held); 0 keeps the rate constant.
      final_lr_fraction: the rate at the end of the decay, as a share of the peak.

    Raises:
      ValueError: from ``__post_init__`` for a value out of range (names the field).
    """

    learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.98
    decay_steps: int = 0
    final_lr_fraction: float = 0.1

    def __post_init__(self):
        check(self, "learning_rate", float, lo=0.0)
        for name in ("warmup_steps", "decay_steps"):
            check(self, name, int, lo=0)
        check(self, "weight_decay", float, lo=0.0)
        check(self, "grad_clip", float, gt=0.0)
        for name in ("b1", "b2"):
            check(self, name, float, lo=0.0, lt=1.0)
        check(self, "final_lr_fraction", float, lo=0.0, hi=1.0)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Learning rate per optimizer step: linear warm-up ``lr·(step+1)/warmup`` (the first update
    already moves the parameters), then constant or a cosine decay over ``decay_steps`` to
    ``final_lr_fraction·lr`` (optax ``cosine_decay_schedule``, as tunix / verl ``lr_scheduler``).

    Raises:
      ValueError: for a negative ``warmup_steps`` / ``decay_steps`` or a fraction outside [0, 1].
    """
    if cfg.warmup_steps < 0 or cfg.decay_steps < 0:
        raise ValueError(f"OptimConfig.warmup_steps / decay_steps must be >= 0, got {cfg.warmup_steps}, {cfg.decay_steps}")
    if not 0.0 <= cfg.final_lr_fraction <= 1.0:
        raise ValueError(f"OptimConfig.final_lr_fraction must be in [0, 1], got {cfg.final_lr_fraction}")
    warm = max(cfg.warmup_steps, 1)
    after = (optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, alpha=cfg.final_lr_fraction)
             if cfg.decay_steps else optax.constant_schedule(cfg.learning_rate))
    return optax.join_schedules(
        [optax.linear_schedule(cfg.learning_rate / warm, cfg.learning_rate, warm - 1) if warm > 1
         else optax.constant_schedule(cfg.learning_rate), after],
        [warm],
    )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """optax chain: clip by global norm → AdamW on ``lr_schedule(cfg)``."""
    schedule = lr_schedule(cfg)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


DEFAULT_MICRO_BATCH_ROWS = 32  # ExecutionConfig.micro_batch_rows: the one default of the update micro-batch
DEFAULT_LOGPROB_CHUNK_ROWS = 64  # ExecutionConfig.logprob_chunk_rows


def _split_micro(x: jax.Array, n_micro: int) -> jax.Array:
    return x.reshape((n_micro, x.shape[0] // n_micro) + x.shape[1:])


def fill_whole_micro_batches(batch: Mapping[str, np.ndarray], micro: int, tail: int) -> dict[str, np.ndarray]:
    """``batch``'s rows reordered for an update whose last micro-batch runs ``tail`` rows at a
    time (``TrainSteps.ppo_step``): the rows with loss tokens fill whole micro-batches of ``micro``
    rows from the first, and the rest of them (fewer than ``micro``, or what those micro-batches
    cannot hold) start the last micro-batch; rows without loss tokens fill the gaps. The update
    skips a micro-batch without loss tokens, so it computes the loss rows rounded up to ``micro``
    rows, then to ``tail`` rows, instead of to ``micro`` rows. Rows are independent and the loss
    denominator is the whole batch's, so values do not change (summation order aside).

    Args:
      batch: ``[B, L]`` arrays with ``loss_mask``; ``B`` a multiple of ``micro``.
      micro, tail: rows per micro-batch and per micro-batch of the last one (``tail`` divides
        ``micro``; ``tail >= micro``: no split, ``batch`` is returned as it is).

    Returns:
      The same keys, rows permuted.
    """
    has = np.asarray(batch["loss_mask"]).reshape(len(batch["loss_mask"]), -1).any(axis=1)
    n_big = len(has) // micro - 1
    if tail >= micro or n_big < 0:
        return dict(batch)
    content, empty = np.flatnonzero(has), np.flatnonzero(~has)
    q = min(len(content) // micro, n_big)  # whole micro-batches of loss rows
    gap = (n_big - q) * micro
    order = np.concatenate([content[: q * micro], empty[:gap], content[q * micro :], empty[gap:]])
    return {k: np.asarray(v)[order] for k, v in batch.items()}


@struct.dataclass
class TrainState:
    """What training changes (MaxText's ``TrainState``), a pytree that ``TrainSteps`` maps to the next.

    Attributes:
      trainable: the optimized parameters (an ``nnx.State``): the LoRA adapters of a model with
        adapters (``model.lora.split_trainable``), else every parameter. What a checkpoint stores.
      frozen: the other parameters (the base weights under adapters, ``None`` without): read by
        every step, never updated or donated.
      opt_state: the optimizer state of ``trainable`` (``None`` once freed).
      step: optimizer steps scheduled so far (``Learner.ppo_update`` counts skipped ones too); a
        host ``int``, static pytree data (tree maps over the state touch its arrays only).
    """

    trainable: Any
    frozen: Any
    opt_state: Any
    step: int = struct.field(pytree_node=False, default=0)

    @property
    def params(self):
        """The whole parameter state (``join(trainable, frozen)``)."""
        return join(self.trainable, self.frozen)


SFT_KEYS = ("input_ids", "valid", "loss_mask")  # an SFT batch
PPO_KEYS = SFT_KEYS + ("old_logprobs", "ref_logprobs", "advantages", "segment_ids", "positions")  # a packed PPO batch
_DTYPES = {"input_ids": jnp.int32, "valid": jnp.bool_, "segment_ids": jnp.int32, "positions": jnp.int32}


class TrainSteps:
    """The jitted steps of training, pure functions of a ``TrainState`` (docs/algorithm.md §5).

    ``sft_step`` / ``ppo_step`` map ``(state, batch)`` to ``(state, metrics)``: gradients
    accumulated over micro-batches (``lax.scan``), then one optimizer step of the trainable part
    (its buffers and the optimizer state's are donated; the frozen part never is). ``logprobs``:
    the detached packed log-prob pass. ``lower_sft`` / ``lower_ppo``: a step lowered at abstract
    shapes (``rl.step.precompile_rl_step``, ``run.memory_plan.phase_programs``).

    Args:
      logits_fn: the model (``model.forward.LogitsFn``: its hidden states and LM head, the head
        applied in chunks, ``token_stats``; its own rematerialisation applies to the decoder
        layers of the update and SFT step).
      optimizer: an optax transformation.
      params: the policy parameters (nnx.State) or their ``jax.ShapeDtypeStruct``s (for the shardings).
      temperature: the sampler's temperature, used for every log-prob the trainer computes.
      mesh: the device mesh (default ``sharding.local_mesh()``). Parameters are placed by their
        logical-axis rules, the optimizer state by ``opt_state_shardings``, batches ``[B, L]``
        over the ``batch`` rule, and every step declares these in/out shardings (metrics and
        log-probs come back replicated). Batch rows must divide by ``batch_shards(mesh)``.
      rules: logical → mesh axis rules (``mempo_jax.core.sharding.DEFAULT_RULES``).
      logprob_chunk_rows: most packed rows per call of the detached log-prob pass.
    """

    def __init__(self, logits_fn: LogitsFn, optimizer: optax.GradientTransformation, params, temperature: float = 1.0,
                 *, mesh=None, rules=DEFAULT_RULES, logprob_chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS):
        self.logits_fn, self.optimizer = logits_fn, optimizer
        self.temperature = float(temperature) if temperature > 0 else 1.0
        self.mesh, self.rules = mesh_or_local(mesh), rules
        ps = self.param_shardings = param_shardings(params, self.mesh, rules)
        ts, fs = split_trainable(ps)  # trainable / frozen (None without adapters) shardings
        opt = opt_state_shardings(optimizer, split_trainable(params)[0], self.mesh, rules)
        bs = self.batch_sharding = logical_to_sharding(("batch", None), self.mesh, rules)
        rep = replicated(self.mesh)
        self._init = jax.jit(optimizer.init, in_shardings=(ts,), out_shardings=opt)
        # The programs take (trainable, frozen, opt_state, batch) and return the new trainable part.
        self._sft = jax.jit(self._sft_step_impl, static_argnums=(4,), donate_argnums=(0, 2),
                            in_shardings=(ts, fs, opt, bs), out_shardings=(ts, opt, rep))
        self._ppo = jax.jit(self._ppo_step_impl, static_argnums=(4, 5, 6), donate_argnums=(0, 2),
                            in_shardings=(ts, fs, opt, bs), out_shardings=(ts, opt, rep))
        self.logprobs = PackedLogprobs(logits_fn, self.temperature, rows_per_call=logprob_chunk_rows,
                                       min_rows=batch_shards(self.mesh, rules), min_length=TRAIN_MIN_LENGTH,
                                       param_shardings=ps, batch_sharding=bs)

    def init(self, params) -> TrainState:
        """The state at step 0: ``params`` placed on the mesh and a fresh optimizer state;
        ``jax.ShapeDtypeStruct`` params give an abstract state (with shardings) to lower against."""
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params,
                                  self.param_shardings)
            trainable, frozen = split_trainable(params)
            return TrainState(trainable, frozen, jax.eval_shape(self._init, trainable))
        trainable, frozen = split_trainable(jax.device_put(params, self.param_shardings))
        return TrainState(trainable, frozen, self._init(trainable))

    def place(self, batch: Mapping[str, np.ndarray]) -> dict:
        """``batch`` put on the ``batch`` sharding.

        Raises:
          ValueError: its rows do not divide over the mesh's batch shards.
        """
        rows = next(iter(batch.values())).shape[0]
        shards = batch_shards(self.mesh, self.rules)
        if rows % shards:
            raise ValueError(f"batch of {rows} rows does not divide over {shards} batch shards of the mesh "
                             f"{dict(self.mesh.shape)}")
        return jax.device_put(dict(batch), self.batch_sharding)

    def batch_shapes(self, keys: tuple[str, ...], rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The abstract ``[rows, length]`` batch of ``keys`` (``SFT_KEYS`` / ``PPO_KEYS``), ``batch`` sharding."""
        return {k: jax.ShapeDtypeStruct((int(rows), int(length)), _DTYPES.get(k, jnp.float32),
                                        sharding=self.batch_sharding) for k in keys}

    def tail_rows(self, micro: int) -> int:
        """Rows per micro-batch of an update's last micro-batch, which ``ppo_step`` runs as
        ``micro // tail_rows`` smaller ones (``fill_whole_micro_batches``): the smallest multiple
        of the mesh's batch shards, at least a quarter of ``micro``, that divides ``micro``;
        ``micro`` itself (no split) where there is none."""
        shards = batch_shards(self.mesh, self.rules)
        return next((t for t in range(max(micro // 4, 1), micro) if t % shards == 0 and micro % t == 0), micro)

    def _split_micro_sharded(self, batch, n_micro):
        """``[B, ...]`` → ``[n_micro, B / n_micro, ...]``; the micro-batch rows stay on the
        ``batch`` axes (constraint with the shape-aware rule, so an indivisible micro-batch is
        replicated rather than failing)."""
        micro = jax.tree.map(lambda x: _split_micro(x, n_micro), batch)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, logical_to_sharding((None, "batch") + (None,) * (x.ndim - 2), self.mesh, self.rules, x.shape)), micro)

    # ---- SFT -------------------------------------------------------------------------------
    def _apply(self, program, state: TrainState, batch, *static) -> tuple[TrainState, dict]:
        trainable, opt_state, metrics = program(state.trainable, state.frozen, state.opt_state, batch, *static)
        return state.replace(trainable=trainable, opt_state=opt_state, step=state.step + 1), metrics

    def sft_step(self, state: TrainState, batch: Mapping[str, ArrayLike], n_micro: int) -> tuple[TrainState, dict]:
        """One cross-entropy step on generated tokens (``loss_mask``), token-mean over the batch.

        Args:
          state: the state (its trainable part and optimizer state are consumed).
          batch: ``SFT_KEYS``: ``input_ids [B,L] int32``, ``valid [B,L] bool``, ``loss_mask [B,L]
            float32``; ``B`` a multiple of ``n_micro``.
          n_micro: micro-batches of the gradient accumulation.

        Returns:
          ``(state at step + 1, {"sft/loss", "sft/grad_norm"} as replicated scalars)``.
        """
        return self._apply(self._sft, state, batch, int(n_micro))

    def lower_sft(self, state: TrainState, rows: int, length: int, n_micro: int) -> jax.stages.Lowered:
        """``sft_step``'s program lowered at a ``[rows, length]`` batch (``state`` may be abstract)."""
        batch = self.batch_shapes(SFT_KEYS, rows, length)
        return self._sft.lower(state.trainable, state.frozen, state.opt_state, batch, int(n_micro))

    def _sft_step_impl(self, params, frozen, opt_state, batch, n_micro):
        denom = jnp.maximum(batch["loss_mask"].sum(), 1.0)
        micro = self._split_micro_sharded(batch, n_micro)

        def loss_fn(p, mb):
            logp, _ = token_stats(self.logits_fn, join(p, frozen), mb["input_ids"], valid=mb["valid"])
            return -(logp * mb["loss_mask"]).sum() / denom

        def body(carry, mb):
            loss, grads = carry
            l, g = jax.value_and_grad(loss_fn)(params, mb)
            return (loss + l, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros(()), zeros), micro)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"sft/loss": loss, "sft/grad_norm": optax.tree.norm(grads)}

    # ---- PPO -------------------------------------------------------------------------------
    def ppo_step(self, state: TrainState, batch: Mapping[str, ArrayLike], n_micro: int, loss_cfg: LossConfig,
                 tail_rows: int = 0) -> tuple[TrainState, dict]:
        """One PPO optimizer step (docs/algorithm.md §5: clipped ratio, dual clip, KL, aggregation).

        Args:
          state: the state (its trainable part and optimizer state are consumed).
          batch: ``PPO_KEYS`` ``[B, L]``, rows packed end to end (``packing.pack_token_rows``);
            ``B`` a multiple of ``n_micro``.
          n_micro: micro-batches of ``B / n_micro`` rows; one without loss tokens is skipped at run
            time (it adds exactly zero).
          loss_cfg: the loss options (static).
          tail_rows: with ``0 < tail_rows < B / n_micro`` the last micro-batch runs ``tail_rows``
            rows at a time (``tail_rows``, ``fill_whole_micro_batches``).

        Returns:
          ``(state at step + 1, metrics)``: verl's ``actor/*`` names, token-means over the batch,
          ``actor/grad_norm`` and ``actor/update_skipped`` (1 for a non-finite gradient: then the
          parameters and optimizer state are unchanged, as for a batch without loss tokens).
        """
        return self._apply(self._ppo, state, batch, int(n_micro), loss_cfg, int(tail_rows))

    def lower_ppo(self, state: TrainState, rows: int, length: int, n_micro: int, loss_cfg: LossConfig,
                  tail_rows: int = 0) -> jax.stages.Lowered:
        """``ppo_step``'s program lowered at a ``[rows, length]`` batch (``state`` may be abstract)."""
        batch = self.batch_shapes(PPO_KEYS, rows, length)
        return self._ppo.lower(state.trainable, state.frozen, state.opt_state, batch, int(n_micro), loss_cfg,
                               int(tail_rows))

    def _ppo_step_impl(self, params, frozen, opt_state, batch, n_micro, loss_cfg: LossConfig, tail_rows: int = 0):
        # The packed forward and per-sequence aggregation give each sequence what it gets alone.
        denom = jnp.maximum(loss_denominator(batch["loss_mask"], loss_cfg.loss_agg_mode, batch["segment_ids"]), 1.0)
        rows = batch["input_ids"].shape[0]
        micro_rows = rows // n_micro
        if 0 < tail_rows < micro_rows:
            cut = rows - micro_rows
            parts = [(jax.tree.map(lambda x: x[:cut], batch), n_micro - 1),
                     (jax.tree.map(lambda x: x[cut:], batch), micro_rows // tail_rows)]
        else:
            parts = [(batch, n_micro)]
        parts = [self._split_micro_sharded(part, n) for part, n in parts if n]

        def loss_fn(p, mb):
            seg = mb["segment_ids"]
            logp, ent = token_stats(self.logits_fn, join(p, frozen), mb["input_ids"], valid=mb["valid"],
                                    segment_ids=seg, positions=mb["positions"], temperature=self.temperature,
                                    entropy=True)
            ent = ent if loss_cfg.entropy_coef else jax.lax.stop_gradient(ent)
            total, part_denom, metrics = mempo_loss(logp, mb["old_logprobs"], mb["ref_logprobs"], mb["advantages"],
                                                    mb["loss_mask"], loss_cfg, entropy=ent, segment_ids=seg)
            metrics = dict(metrics, _denominator=part_denom)
            return total / denom, metrics

        def accumulate(carry, mb):
            grads, msum = carry
            (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            return jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, msum, metrics)

        def body(carry, mb):
            return jax.lax.cond(jnp.any(mb["loss_mask"] > 0), accumulate, lambda c, _: c, carry, mb), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        m0 = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], parts[0]))[1])
        carry = (zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m0))
        for micro in parts:
            carry, _ = jax.lax.scan(body, carry, micro)
        grads, msum = carry
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite gradient skips the update (params and optimizer state unchanged); so does a
        # mini-batch without loss tokens (all padding: Adam's momentum would still move params).
        apply = finite & jnp.any(batch["loss_mask"] > 0)
        params = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_params, params)
        opt_state = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new_opt_state, opt_state)
        msum = dict(msum)
        part_total = jnp.maximum(msum.pop("_denominator"), 1.0)
        metrics = {f"actor/{_VERL_NAMES.get(k, k)}": v / part_total for k, v in msum.items()}
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/update_skipped"] = 1.0 - finite.astype(jnp.float32)
        return params, opt_state, metrics


class RowPlacement(Protocol):
    """How this process's rows become the rows of a global step (``Learner``'s strategy):
    ``LocalRows`` on one process, ``run.lockstep.LockstepRows`` on several."""

    def global_rows(self, op: str, rows: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """Every process's ``[R_p, L_p]`` rows for ``op`` (``"update"``, ``"sft"``, ``"logprobs"``),
        concatenated in process order and right-padded to the longest, and the index of this
        process's first row in them (a collective on several processes)."""


class LocalRows:
    """One process: its rows are the step's rows (``RowPlacement``)."""

    def global_rows(self, op: str, rows: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        return dict(rows), 0


class Learner:
    """The host side of training: a ``TrainState``, the ``TrainSteps`` that update it, and the
    loops that feed them (SFT batches, PPO epochs split into mini-batches).

    Args:
      logits_fn, params, optimizer, temperature, mesh, rules, logprob_chunk_rows: as
        ``TrainSteps`` (``params`` placed as ``TrainSteps.init``; ``jax.ShapeDtypeStruct``s give a
        learner that can lower and compile its programs, not run them). With LoRA adapters
        (``nnx.LoRAParam`` leaves, ``model.lora``) only they are trained, the optimizer state
        covers them alone, and the base weights pass through unchanged.
      micro_batch_rows: rows per micro-batch in gradient accumulation.
      before_update: optional ``rows -> rows``, called at the start of every ``ppo_update`` with
        its rows (the trainer's hook: the step's preemption commit and the test fault hooks,
        ``faults.FaultHooks.update_rows``).
      pad_id: the id on padding of packed update rows.
      placement: how this process's rows become the step's rows (default ``LocalRows``; several
        processes: ``run.lockstep.LockstepRows``, after a barrier: construction runs global programs).

    Attributes:
      steps: the ``TrainSteps``; state: the current ``TrainState`` (replaced by every step).
    """

    def __init__(self, logits_fn: LogitsFn, params, optimizer: optax.GradientTransformation, temperature: float = 1.0,
                 micro_batch_rows: int = DEFAULT_MICRO_BATCH_ROWS, *, mesh=None, rules=DEFAULT_RULES,
                 logprob_chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS, before_update=None, pad_id: int = 0,
                 placement: RowPlacement | None = None):
        self.steps = TrainSteps(logits_fn, optimizer, params, temperature, mesh=mesh, rules=rules,
                                logprob_chunk_rows=logprob_chunk_rows)
        self.state = self.steps.init(params)
        self.micro_batch_rows = int(micro_batch_rows)
        self.before_update = before_update
        self.pad_id = int(pad_id)
        self.placement = LocalRows() if placement is None else placement
        self._precompiled_for = None  # precompile_once's last key

    @property
    def params(self):
        """The policy's whole parameter state (``TrainState.params``)."""
        return self.state.params

    def sft_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``TrainSteps.sft_step`` on ``batch`` (``SFT_KEYS [B, L]``, ``B`` a multiple of
        ``micro_batch_rows`` or smaller; the processes' rows gathered); its metrics as floats."""
        batch, _ = self.placement.global_rows("sft", batch)
        b = batch["input_ids"].shape[0]
        n_micro = max(1, b // min(self.micro_batch_rows, b))
        self.state, m = self.steps.sft_step(self.state, self.steps.place(batch), n_micro)
        return {k: float(v) for k, v in jax.device_get(m).items()}

    def ppo_update(self, rows: Mapping[str, np.ndarray], loss_cfg: LossConfig, num_mini_batches: int,
                   rng: np.random.Generator, *, max_rows: int | None = None) -> dict[str, float]:
        """One PPO epoch over ``rows``, split into ``num_mini_batches`` optimizer steps.

        Rows (on several processes every process's, in process order; ``rng`` then in the same
        state on each) are shuffled and split evenly into ``num_mini_batches`` contiguous
        mini-batches (``mini_batch_slices``: sizes differ by at most one, e.g. 130 rows in 2 →
        [65, 65]). Each is packed end to end into the plan's fixed row count (``ppo_plan``,
        ``packing.pack_token_rows``), its rows with loss tokens filling whole micro-batches first
        (``fill_whole_micro_batches``), and run by ``TrainSteps.ppo_step`` unless ``_trains``
        says not (``TrainState.step`` counts it all the same, as an update skipped for a
        non-finite gradient).

        Args:
          rows: ``input_ids [R, L] int32, valid [R, L] bool, loss_mask, old_logprobs,
            ref_logprobs, advantages [R, L] float32`` (right-padded when packed: ``valid`` a
            prefix of each row, no loss token in column 0).
          loss_cfg: clip, dual clip, KL and aggregation options.
          num_mini_batches: optimizer steps per epoch (fewer when a mini-batch is all padding).
          rng: numpy generator for the shuffle.
          max_rows: an upper bound on one process's ``R`` that depends on the config only (e.g.
            ``bounds.training_row_bound``): every mini-batch is then ``[ppo_plan(...).rows, L]``
            whatever ``R`` is, so the update compiles once per length bucket. ``None``: the
            mini-batch rows follow ``R`` (one program per row bucket).

        Returns:
          Metrics averaged over the mini-batches that ran (``actor/pg_loss``, ``actor/ppo_kl``,
          ``actor/pg_clipfrac``, ``actor/kl_loss``, ``actor/entropy``, ``actor/grad_norm``,
          ``actor/update_skipped``, ...), and with ``zero_advantage = "skip"``
          ``actor/zero_advantage_skipped``: the share of the mini-batches not run for it (the
          only key when none ran); ``{}`` when no row has a loss token.

        Raises:
          ValueError: as ``ppo_plan``.
        """
        rows, _ = self.placement.global_rows("update", rows)
        if self.before_update is not None:
            rows = self.before_update(rows)
        n = rows["input_ids"].shape[0]
        order = rng.permutation(n)
        plan = ppo_plan(n, num_mini_batches, self.micro_batch_rows,
                        None if max_rows is None else max_rows * jax.process_count())
        tail = self.steps.tail_rows(plan.micro)
        out: dict[str, list[float]] = {}
        zero_skipped = []
        for start, stop in mini_batch_slices(n, num_mini_batches):
            idx = order[start:stop]
            if not _trains(rows, idx, loss_cfg, zero_skipped):  # a scheduled slot: counted all the same
                self.state = self.state.replace(step=self.state.step + 1)
                continue
            mb = pack_token_rows({k: v[idx] for k, v in rows.items()}, plan.rows, self.pad_id)
            mb = fill_whole_micro_batches(mb, plan.micro, tail)
            self.state, m = self.steps.ppo_step(self.state, self.steps.place(mb), plan.rows // plan.micro, loss_cfg,
                                                tail)
            for k, v in jax.device_get(m).items():
                out.setdefault(k, []).append(float(v))
        metrics = {k: float(np.mean(v)) for k, v in out.items()}
        if zero_skipped:
            metrics["actor/zero_advantage_skipped"] = float(np.mean(zero_skipped))
        return metrics

    def detached_logprobs(self, params, input_ids: Int[np.ndarray, "rows length"],
                          valid: Bool[np.ndarray, "rows length"]) -> Float[np.ndarray, "rows length"]:
        """``[R, L]`` float32 per-token log-probs of ``params`` over ``input_ids [R, L]`` (no
        gradient), at the learner's temperature: one packed pass (``TrainSteps.logprobs``), over
        every process's rows on several processes (this process's returned)."""
        g, start = self.placement.global_rows("logprobs", {"input_ids": input_ids, "valid": valid})
        out = self.steps.logprobs(params, g["input_ids"], g["valid"])
        return out[start : start + input_ids.shape[0], : input_ids.shape[1]]

    def precompile_once(self, key, build: Callable[[], T]) -> T | None:
        """``build()`` when ``key`` (e.g. the ``RLConfig``) differs from the key of the last build
        (or none ran yet), else ``None``: the programs one config needs are built once per learner."""
        if self._precompiled_for == key:
            return None
        out = build()
        self._precompiled_for = key
        return out


def _trains(rows: Mapping[str, np.ndarray], idx: np.ndarray, loss_cfg: LossConfig, zero_skipped: list) -> bool:
    """Whether the mini-batch of rows ``idx`` runs: not without loss tokens (Adam's momentum would
    move the parameters on a zero gradient), nor, with ``loss_cfg.zero_advantage = "skip"``, with
    advantage 0 on every loss token (whether it is, appended to ``zero_skipped``)."""
    loss_tokens = rows["loss_mask"][idx] > 0
    if not np.any(loss_tokens):
        return False
    if loss_cfg.zero_advantage == "skip":
        zero_skipped.append(not np.any(rows["advantages"][idx][loss_tokens]))
        return not zero_skipped[-1]
    return True


def mini_batch_slices(n: int, num_mini_batches: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``num_mini_batches`` contiguous, near-equal parts of ``n`` rows.

    The first ``n mod k`` parts hold ``ceil(n / k)`` rows, the others ``floor(n / k)`` (the
    ``numpy.array_split`` rule; verl's ``DataProto.split`` / ``make_iterator`` uses equal
    mini-batches), so sizes differ by at most one: 130 in 2 → [65, 65], 257 in 2 → [129, 128],
    1,100 in 4 → [275] · 4; with ``n < k`` some parts are empty.

    Raises:
      ValueError: if ``num_mini_batches < 1`` or ``n < 0``.
    """
    if num_mini_batches < 1 or n < 0:
        raise ValueError(f"need num_mini_batches >= 1 and n >= 0, got {num_mini_batches}, {n}")
    base, extra = divmod(int(n), int(num_mini_batches))
    out, start = [], 0
    for i in range(num_mini_batches):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class PPOPlan(NamedTuple):
    """Row layout of one PPO epoch (see ``ppo_plan``).

    Attributes:
      total: ``num_mini_batches · bucket_length(ceil(R / k), floor)`` — the epoch's rows once
        every mini-batch is padded to its natural bucket (``R`` padded as a whole before).
      per_mb: the most real rows of one mini-batch, ``ceil(R / num_mini_batches)``
        (``mini_batch_slices``).
      rows: rows of every ``TrainSteps.ppo_step`` call (``>= per_mb``).
      micro: rows per micro-batch (divides ``rows``).
    """

    total: int
    per_mb: int
    rows: int
    micro: int


def ppo_plan(n: int, num_mini_batches: int, micro_batch_rows: int, max_rows: int | None = None) -> PPOPlan:
    """Mini-batch shapes of a PPO epoch over ``n`` rows.

    Mini-batches hold ``mini_batch_slices(n, k)`` real rows (at most ``per_mb = ceil(n / k)``)
    and are padded to ``rows = bucket_length(ceil(B / k), max(1, max(k, micro_batch_rows) // k))``
    with ``B = max_rows`` when it is given and ``n <= max_rows``, else ``B = n``: the shape of the
    update program depends on the config only when a bound is given. For powers of two ``k`` and
    ``micro_batch_rows`` this equals ``bucket_length(B, max(k, micro)) // k`` (the shapes before
    mini-batches were split evenly).

    Raises:
      ValueError: if ``num_mini_batches`` or ``micro_batch_rows`` is < 1, or ``n`` < 0.
    """
    if num_mini_batches < 1 or micro_batch_rows < 1:
        raise ValueError(f"num_mini_batches and micro_batch_rows must be >= 1, got {num_mini_batches}, "
                         f"{micro_batch_rows}")
    if n < 0:
        raise ValueError(f"the row count must be >= 0, got {n}")
    k = int(num_mini_batches)
    floor = max(1, max(k, micro_batch_rows) // k)
    per_mb = -(-int(n) // k)
    natural = bucket_length(per_mb, floor)
    rows = natural
    if max_rows is not None and n <= max_rows:
        rows = max(natural, bucket_length(-(-int(max_rows) // k), floor))
    micro = min(micro_batch_rows, rows)
    while rows % micro:  # powers of two in practice; stay correct otherwise
        micro -= 1
    return PPOPlan(k * natural, per_mb, rows, micro)


_VERL_NAMES = {"clipfrac": "pg_clipfrac", "clipfrac_lower": "pg_clipfrac_lower", "kl": "kl_loss"}


__all__ = ["Learner", "LocalRows", "OptimConfig", "PPOPlan", "PPO_KEYS", "RowPlacement", "SFT_KEYS", "TrainState",
           "TrainSteps", "fill_whole_micro_batches", "make_optimizer", "mini_batch_slices", "ppo_plan"]
