"""Jitted numeric steps of training: detached log-probs, the SFT step and the PPO update.

The learner owns the policy parameters and the optimizer state. All functions are jitted once
per (rows, seq) bucket; mini-batches are split into micro-batches that accumulate gradients
with one denominator for the whole mini-batch (docs/algorithm.md §5: gradient accumulation equals the
full-batch gradient; tunix-style (sum, denominator) losses).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
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
    time (``Learner._ppo_step``): the rows with loss tokens fill whole micro-batches of ``micro``
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


class Learner:
    """Policy parameters, optimizer state and the jitted steps that use them.

    Args:
      logits_fn: the model (``model.forward.LogitsFn``: its hidden states and LM head, the head
        applied in chunks, ``token_stats``; its own rematerialisation applies to the decoder
        layers of the update and SFT step).
      params: the policy parameters (a pytree; nnx.State), or their ``jax.ShapeDtypeStruct``s
        (nothing allocated: the programs can be lowered and compiled, not run). With LoRA adapters
        (``nnx.LoRAParam`` leaves, ``model.lora``) only they are trained: the SFT and PPO steps
        differentiate, update and donate the adapters alone, the optimizer state covers them
        alone, and the base weights are passed through unchanged (never donated).
      optimizer: an optax transformation.
      temperature: the sampler's temperature, used for every log-prob the trainer computes.
      micro_batch_rows: rows per micro-batch in gradient accumulation.
      logprob_chunk_rows: most packed rows per call of the detached log-prob pass
        (``packed_logprobs``).
      mesh: the device mesh (default ``sharding.local_mesh()``: one device is the smallest mesh).
        ``params`` (an ``nnx.State``) are placed by their logical-axis rules, the optimizer state
        by ``opt_state_shardings``, batches ``[B, L]`` over the ``batch`` rule, and every jitted
        step declares these in/out shardings (metrics and log-probs come back replicated). Batch
        rows must divide by ``batch_shards(mesh)``.
      rules: logical → mesh axis rules (``mempo_jax.core.sharding.DEFAULT_RULES``).
      before_update: optional ``rows -> rows``, called at the start of every ``ppo_update`` with
        its rows (the trainer's hook: the step's preemption commit and the test fault hooks,
        ``faults.FaultHooks.update_rows``).
      pad_id: the id on padding of packed update rows.
    """

    def __init__(self, logits_fn: LogitsFn, params, optimizer: optax.GradientTransformation, temperature: float = 1.0,
                 micro_batch_rows: int = DEFAULT_MICRO_BATCH_ROWS, *, mesh=None, rules=DEFAULT_RULES,
                 logprob_chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS,
                 before_update=None, pad_id: int = 0):
        self.logits_fn = logits_fn
        self.params = params
        self.optimizer = optimizer
        self.temperature = float(temperature) if temperature > 0 else 1.0
        self.micro_batch_rows = int(micro_batch_rows)
        self.logprob_chunk_rows = int(logprob_chunk_rows)
        self.num_updates = 0
        self.before_update = before_update
        self.pad_id = int(pad_id)
        self._packed_logprobs = None  # packed_logprobs(), built on first use
        self._precompiled_for = None  # precompile_once's last key
        self.mesh = mesh = mesh_or_local(mesh)
        self.rules = rules
        ps = self.param_shardings = param_shardings(params, mesh, rules)
        ts, fs = split_trainable(ps)  # trainable / frozen (None without adapters) shardings
        opt = self.opt_shardings = opt_state_shardings(optimizer, split_trainable(params)[0], mesh, rules)
        bs = self.batch_sharding = logical_to_sharding(("batch", None), mesh, rules)
        rep = replicated(mesh)
        init = jax.jit(optimizer.init, in_shardings=(ts,), out_shardings=opt)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):  # compile-only (the plan)
            self.params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, ps)
            self.opt_state = jax.eval_shape(init, split_trainable(self.params)[0])
        else:
            self.params = jax.device_put(params, ps)
            self.opt_state = init(split_trainable(self.params)[0])
        # The steps take (trainable, frozen, opt_state, batch) and return the new trainable part.
        self._sft_step = jax.jit(self._sft_step_impl, static_argnums=(4,), donate_argnums=(0, 2),
                                 in_shardings=(ts, fs, opt, bs), out_shardings=(ts, opt, rep))
        self._ppo_step = jax.jit(self._ppo_step_impl, static_argnums=(4, 5, 6), donate_argnums=(0, 2),
                                 in_shardings=(ts, fs, opt, bs), out_shardings=(ts, opt, rep))

    def _place_batch(self, batch: Mapping[str, np.ndarray]) -> dict:
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

    def _split_micro_sharded(self, batch, n_micro):
        """``[B, ...]`` → ``[n_micro, B / n_micro, ...]``; the micro-batch rows stay on the
        ``batch`` axes (constraint with the shape-aware rule, so an indivisible micro-batch is
        replicated rather than failing)."""
        micro = jax.tree.map(lambda x: _split_micro(x, n_micro), batch)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, logical_to_sharding((None, "batch") + (None,) * (x.ndim - 2), self.mesh, self.rules, x.shape)), micro)

    def precompile(self, lengths, ppo_rows: int, n_micro: int, loss_cfg: LossConfig) -> int:
        """Compile the PPO update program ahead of time (``jit.lower(...).compile()``; nothing
        runs, no buffer is donated) at every length in ``lengths``.

        Args:
          lengths: sequence lengths ``L`` (the training-row length buckets).
          ppo_rows, n_micro: the ``[rows, L]`` mini-batch and its micro-batch count
            (``ppo_plan(...).rows`` and ``rows // micro``).
          loss_cfg: the loss options (a static argument of the PPO program).

        Returns:
          The number of programs built.
        """
        sds = lambda rows, length, dt: jax.ShapeDtypeStruct((rows, int(length)), dt, sharding=self.batch_sharding)  # noqa: E731
        for length in lengths:
            batch = {"input_ids": sds(ppo_rows, length, jnp.int32), "valid": sds(ppo_rows, length, jnp.bool_)}
            batch.update({k: sds(ppo_rows, length, jnp.float32)
                          for k in ("loss_mask", "old_logprobs", "ref_logprobs", "advantages")})
            batch.update({k: sds(ppo_rows, length, jnp.int32) for k in ("segment_ids", "positions")})
            self._ppo_step.lower(*split_trainable(self.params), self.opt_state, batch, int(n_micro), loss_cfg,
                                 self.tail_rows(ppo_rows // int(n_micro))).compile()
        return len(lengths)

    # ---- SFT -------------------------------------------------------------------------------
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

    def sft_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """One cross-entropy step on generated tokens (``loss_mask``), token-mean over the batch.

        Args:
          batch: ``input_ids [B,L] int32``, ``valid [B,L] bool``, ``loss_mask [B,L] float32``;
            ``B`` a multiple of ``micro_batch_rows`` (or smaller than it).
        """
        b = batch["input_ids"].shape[0]
        n_micro = max(1, b // min(self.micro_batch_rows, b))
        trainable, frozen = split_trainable(self.params)
        trainable, self.opt_state, m = self._sft_step(trainable, frozen, self.opt_state, self._place_batch(batch), n_micro)
        self.params = join(trainable, frozen)
        self.num_updates += 1
        return {k: float(v) for k, v in jax.device_get(m).items()}

    # ---- PPO -------------------------------------------------------------------------------
    def tail_rows(self, micro: int) -> int:
        """Rows per micro-batch of an update's last micro-batch, which ``ppo_update`` runs as
        ``micro // tail_rows`` smaller ones (``fill_whole_micro_batches``): the smallest multiple
        of the mesh's batch shards, at least a quarter of ``micro``, that divides ``micro``;
        ``micro`` itself (no split) where there is none."""
        shards = batch_shards(self.mesh, self.rules)
        return next((t for t in range(max(micro // 4, 1), micro) if t % shards == 0 and micro % t == 0), micro)

    def _ppo_step_impl(self, params, frozen, opt_state, batch, n_micro, loss_cfg: LossConfig, tail_rows: int = 0):
        # The batch holds rows packed end to end (``segment_ids`` / ``positions``, ``ppo_update``):
        # the packed forward and per-sequence aggregation give each sequence what it gets alone.
        # With ``0 < tail_rows < rows // n_micro`` the last micro-batch runs tail_rows rows at a time.
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
            # A micro-batch without loss tokens (row padding up to the fixed mini-batch shape)
            # adds exactly zero: it is skipped at run time instead of computed.
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

    def ppo_update(self, rows: Mapping[str, np.ndarray], loss_cfg: LossConfig, num_mini_batches: int,
                   rng: np.random.Generator, *, max_rows: int | None = None) -> dict[str, float]:
        """One PPO epoch over ``rows``, split into ``num_mini_batches`` optimizer steps.

        Rows are shuffled and split evenly into ``num_mini_batches`` contiguous mini-batches of
        the shuffled order (``mini_batch_slices``: sizes differ by at most one, e.g. 130 rows in
        2 → [65, 65], 1,100 in 4 → [275] · 4; this fixes which rows share an update). Each
        mini-batch is then packed end to end into the plan's fixed row count (``ppo_plan``;
        ``packing.pack_token_rows``, same length; the rest all-invalid rows), and split
        into micro-batches of ``micro_batch_rows``, the last of them run ``tail_rows`` rows at a
        time, with the rows that carry loss tokens filling whole micro-batches first
        (``fill_whole_micro_batches``); micro-batches without loss tokens (the padding that
        packing leaves) are skipped inside the program, and a
        mini-batch without loss tokens is not run at all (no optimizer step: Adam's momentum
        would otherwise move the parameters on a zero gradient), nor, with
        ``loss_cfg.zero_advantage = "skip"``, one whose loss tokens all carry advantage 0;
        ``num_updates`` still counts them, as it counts an update skipped for a non-finite
        gradient.

        Args:
          rows: ``input_ids [R, L] int32, valid [R, L] bool, loss_mask, old_logprobs,
            ref_logprobs, advantages [R, L] float32`` (right-padded when packed: ``valid`` a
            prefix of each row, no loss token in column 0).
          loss_cfg: clip, dual clip, KL and aggregation options.
          num_mini_batches: optimizer steps per epoch (fewer when a mini-batch is all padding).
          rng: numpy generator for the shuffle.
          max_rows: an upper bound on ``R`` that depends on the config only (e.g.
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
        if self.before_update is not None:
            rows = self.before_update(rows)
        n = rows["input_ids"].shape[0]
        order = rng.permutation(n)
        plan = ppo_plan(n, num_mini_batches, self.micro_batch_rows, max_rows)
        tail = self.tail_rows(plan.micro)
        out: dict[str, list[float]] = {}
        zero_skipped = []
        for start, stop in mini_batch_slices(n, num_mini_batches):
            idx = order[start:stop]
            loss_tokens = rows["loss_mask"][idx] > 0
            if not np.any(loss_tokens):
                self.num_updates += 1  # counted like a skipped non-finite update: a scheduled slot
                continue
            if loss_cfg.zero_advantage == "skip":
                zero_skipped.append(not np.any(rows["advantages"][idx][loss_tokens]))
                if zero_skipped[-1]:
                    self.num_updates += 1
                    continue
            mb = pack_token_rows({k: v[idx] for k, v in rows.items()}, plan.rows, self.pad_id)
            mb = fill_whole_micro_batches(mb, plan.micro, tail)
            trainable, frozen = split_trainable(self.params)
            trainable, self.opt_state, m = self._ppo_step(trainable, frozen, self.opt_state, self._place_batch(mb),
                                                          plan.rows // plan.micro, loss_cfg, tail)
            self.params = join(trainable, frozen)
            self.num_updates += 1
            for k, v in jax.device_get(m).items():
                out.setdefault(k, []).append(float(v))
        metrics = {k: float(np.mean(v)) for k, v in out.items()}
        if zero_skipped:
            metrics["actor/zero_advantage_skipped"] = float(np.mean(zero_skipped))
        return metrics

    # ---- the RL step's detached passes and its ahead-of-time programs ------------------------
    def on_global_rows(self, fn, params, input_ids: Int[np.ndarray, "rows length"],
                       valid: Bool[np.ndarray, "rows length"]) -> Float[np.ndarray, "rows length"]:
        """``fn(params, input_ids, valid)``: on one process over its own rows
        (``run.lockstep.DistributedLearner`` runs it over every process's rows)."""
        return fn(params, input_ids, valid)

    def packed_logprobs(self) -> PackedLogprobs:
        """This learner's ``PackedLogprobs`` (built on first use and kept)."""
        if self._packed_logprobs is None:
            self._packed_logprobs = PackedLogprobs(
                self.logits_fn, self.temperature, rows_per_call=self.logprob_chunk_rows,
                min_rows=batch_shards(self.mesh, self.rules), min_length=TRAIN_MIN_LENGTH,
                param_shardings=self.param_shardings, batch_sharding=self.batch_sharding)
        return self._packed_logprobs

    def detached_logprobs(self, params, input_ids: Int[np.ndarray, "rows length"],
                          valid: Bool[np.ndarray, "rows length"]) -> Float[np.ndarray, "rows length"]:
        """``[R, L]`` float32 per-token log-probs of ``params`` over ``input_ids [R, L]`` (no
        gradient), at the learner's temperature: one packed pass (``packed_logprobs``), over the
        global rows on several processes."""
        return self.on_global_rows(self.packed_logprobs(), params, input_ids, valid)

    def precompile_once(self, key, build: Callable[[], T]) -> T | None:
        """``build()`` when ``key`` (e.g. the ``RLConfig``) differs from the key of the last build
        (or none ran yet), else ``None``: the programs one config needs are built once per learner."""
        if self._precompiled_for == key:
            return None
        out = build()
        self._precompiled_for = key
        return out


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
      rows: rows of every ``_ppo_step`` call (``>= per_mb``).
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


__all__ = ["Learner", "OptimConfig", "PPOPlan", "fill_whole_micro_batches", "make_optimizer", "mini_batch_slices", "ppo_plan"]
