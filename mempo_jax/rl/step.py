"""One MemPO RL step: rollout → rewards → memory reward → advantages → PPO update.

The data flow of docs/algorithm.md §2–§5, in order:

1. rollout: ``group_size`` trajectories per question, multi-turn with host tools;
2. outcome reward R_T per trajectory (EM or F1 vs gold, docs/algorithm.md §3);
3. memory reward R_M per ``<mem>`` turn: ONE detached call over the stacked
   ``[full_traj; mem_traj]`` batch with the answer Z repeated twice (docs/algorithm.md §3);
4. reference log-probs (frozen reference policy) for the KL term;
5. advantages: A_T per question group, A_M pooled over every turn of every trajectory of the
   group and written on the ``<mem>`` tokens, A = A_T + A_M on generated tokens (docs/algorithm.md §4);
6. PPO update (clipped ratio, dual clip, low_var_kl, token-mean; docs/algorithm.md §5).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Bool, Float, Real

from mempo_jax.agent.rollout import new_trajectories, rollout_metrics
from mempo_jax.agent.trajectory import TrainingRows, Trajectory, build_training_rows
from mempo_jax.core.batching import bucket_length
from mempo_jax.core.distributed import process_slice
from mempo_jax.core.host_memory import release_free_memory
from mempo_jax.rl.advantage import memory_advantage, outcome_advantage, scatter_span_values, token_advantages
from mempo_jax.rl.bounds import (mem_group_count, mem_turn_bound, scoring_length_bound, training_length_buckets,
                                 training_row_bound)
from mempo_jax.rl.config import RLConfig
from mempo_jax.rl.group_filter import group_share, kept_trajectories, zero_std_group_share
from mempo_jax.rl.interfaces import RLCluster
from mempo_jax.rl.learner import TRAIN_MIN_LENGTH, Learner, ppo_plan
from mempo_jax.rl.memory_reward import (MEMORY_BASELINES, MEMORY_GROUPINGS, MEMORY_TRAJECTORIES, MemoryRewardOutput,
                                        memory_reward_values)
from mempo_jax.rl.memory_views import memory_contexts, scored_memory_turns
from mempo_jax.rl.rewards import score_trajectories


def precompile_rl_step(cluster: RLCluster, cfg: RLConfig, key: jax.Array) -> dict:
    """Build every program an RL step of ``cfg`` can run, so that steps compile nothing.

    The shapes are functions of the config only (``rl.bounds``): the rollout engine's programs
    (``engine.warm``, dummy tokens, on each process's rollout mesh), scoring
    ``[scorer.rows_per_call, L]`` for ``L`` in ``scorer.length_buckets(scoring_length_bound(cfg))``,
    and the reference log-probs and the PPO update at every ``training_length_buckets(cfg)`` with
    the ``ppo_plan`` of ``training_row_bound(cfg)`` rows (compiled ahead of time, nothing runs).

    Args:
      cluster, cfg: as for ``rl_step``.
      key: PRNG key for the dummy sampling calls.

    Returns:
      ``{"sampler": n, "scorer": n, "learner": n, "old_logprobs": n, "advantages": n, "seconds": s}``
      (programs per part, wall time; ``old_logprobs``: the packed pass of the reference and old
      log-probs).
    """
    learner, engine, scorer = cluster.learner, cluster.engine, cluster.scorer
    t0 = time.perf_counter()
    n_traj = cfg.questions_per_step * cfg.group_size
    mine = process_slice(cfg.questions_per_step)  # this process's questions (its rollout's slots)
    out = {"sampler": engine.warm(learner.params, cfg.rollout, (mine.stop - mine.start) * cfg.group_size, key)}
    out["scorer"] = (scorer.precompile(learner.params, scorer.length_buckets(scoring_length_bound(cfg)))
                     if cfg.scores_memory else 0)
    plan = ppo_plan(training_row_bound(cfg) * jax.process_count(), cfg.num_mini_batches, learner.micro_batch_rows,
                    training_row_bound(cfg) * jax.process_count())
    tail = learner.steps.tail_rows(plan.micro)
    for length in training_length_buckets(cfg):  # compiled, not run: no buffer is donated
        learner.steps.lower_ppo(learner.state, plan.rows, length, plan.rows // plan.micro, cfg.loss, tail).compile()
    out["learner"] = len(training_length_buckets(cfg))
    # the reference log-probs, and the old ones with old_logprobs = "trainer"
    out["old_logprobs"] = learner.steps.logprobs.precompile(learner.params, training_length_buckets(cfg))
    n, b, mb = n_traj, bucket_length(training_row_bound(cfg), 1), bucket_length(mem_turn_bound(cfg), 1)
    sds = jax.ShapeDtypeStruct
    for length in training_length_buckets(cfg):
        _advantages.lower(sds((n,), jnp.float32), sds((n,), jnp.int32), sds((mb,), jnp.float32), sds((mb,), jnp.int32),
                          sds((mb,), jnp.bool_), sds((mb,), jnp.int32), sds((mb,), jnp.int32), sds((mb,), jnp.int32),
                          sds((b,), jnp.int32), sds((b, length), jnp.float32), sds((), jnp.float32),
                          num_groups=cfg.questions_per_step, memory_norm=cfg.memory_reward.norm,
                          num_mem_groups=mem_group_count(cfg)).compile()
    out["advantages"] = len(training_length_buckets(cfg))
    out["seconds"] = time.perf_counter() - t0
    return out


def pad_columns(rows: TrainingRows, min_length: int, pad_id: int) -> TrainingRows:
    """``rows`` right-padded (pad id, invalid, no loss) to at least ``min_length`` columns, so
    short batches share the ``TRAIN_MIN_LENGTH`` bucket instead of compiling 16/32/64."""
    extra = int(min_length) - rows.input_ids.shape[1]
    if extra <= 0:
        return rows
    pad = lambda x, v: np.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    return dataclasses.replace(rows, input_ids=pad(rows.input_ids, pad_id), valid=pad(rows.valid, False),
                               loss_mask=pad(rows.loss_mask, 0.0), old_logprobs=pad(rows.old_logprobs, 0.0))


def detached_logprobs(learner: Learner, params, rows: TrainingRows) -> Float[np.ndarray, "rows length"]:
    """``[R, L]`` float32 per-token log-probs of ``params`` over the step's rows (no gradient),
    at the learner's temperature (``Learner.detached_logprobs``: one packed pass). The reference
    and the PPO "old" log-probs both come from here."""
    return learner.detached_logprobs(params, rows.input_ids, rows.valid)


def policy_old_logprobs(learner, rows: TrainingRows) -> tuple[Float[np.ndarray, "rows length"], dict[str, float]]:
    """The PPO "old" log-probs recomputed by the policy before the update, and the sampler/trainer gap.

    One detached pass of ``learner.params`` (the policy that sampled the step) over the
    training rows, packed (``TrainSteps.logprobs``), at the learner's temperature: verl's
    ``compute_log_prob`` before ``update_policy``. In float32 it agrees with the sampler to ~1e-5; in bfloat16 the
    cached-decode and full-forward numerics differ, and the clip would act on that noise.

    Args:
      learner: the ``Learner``.
      rows: the step's ``TrainingRows`` (``old_logprobs``: the sampler's).

    Returns:
      ``(old_logprobs [R, L] float32`` — 0 off the loss tokens, ``metrics)`` with
      ``rollout/logprob_diff/mean`` and ``…/max``: mean and max ``|trainer − sampler|`` log-prob
      (nats) over loss tokens.
    """
    lp = detached_logprobs(learner, learner.params, rows)
    on = np.asarray(rows.loss_mask) > 0
    old = np.where(on, lp, 0.0).astype(np.float32)
    gap = np.abs(old - np.asarray(rows.old_logprobs, np.float32))[on]
    return old, {"rollout/logprob_diff/mean": float(gap.mean()) if gap.size else 0.0,
                 "rollout/logprob_diff/max": float(gap.max()) if gap.size else 0.0}


def ppo_old_logprobs(learner, rows: TrainingRows, source: str) -> tuple[np.ndarray, dict[str, float]]:
    """The PPO "old" log-probs ``[R, L]`` and their metrics (``RLConfig.old_logprobs``): ``"trainer"``
    recomputes them (``policy_old_logprobs``; the sampler's stay in ``rows.old_logprobs``),
    ``"sampler"`` uses the sampler's (no metrics)."""
    if source == "trainer":
        return policy_old_logprobs(learner, rows)
    return rows.old_logprobs, {}


def compute_advantages(trajs, rows, rewards: Real[ArrayLike, "trajectories"], r_mem: Real[ArrayLike, "turns"],
                       num_groups: int, memory_coef: float, *, max_rows: int | None = None,
                       max_mem: int | None = None, mem_valid: Bool[ArrayLike, "turns"] | None = None,
                       memory_norm: str = "zscore", memory_group: str = "question", max_turns: int | None = None
                       ) -> tuple[Float[np.ndarray, "rows length"], Float[np.ndarray, "trajectories"],
                                  Float[np.ndarray, "turns"]]:
    """Token advantages ``[rows, seq]`` and their parts (docs/algorithm.md §4).

    One jitted program (``_advantages``). With config bounds ``max_rows`` on the training rows
    (``training_row_bound``) and ``max_mem`` on the ``<mem>`` turns (``mem_turn_bound``), rows
    are padded to ``bucket_length(max_rows)`` and turns to ``bucket_length(max_mem)`` with
    invalid entries, so its shapes depend on the config and the sequence length only; the
    padding is masked out (exactly the unpadded values).

    Args:
      trajs: the step's trajectories (their ``group_id``).
      rows: ``TrainingRows`` of the step.
      rewards: ``[N]`` float32 outcome rewards.
      r_mem: ``[M]`` float32 memory rewards of ``rows.mem_turn``.
      num_groups: questions of the step (static).
      memory_coef: scale of A_M.
      max_rows, max_mem: optional config bounds on rows and on ``<mem>`` turns (a count above
        its bound falls back to the unpadded shape).
      mem_valid: optional ``[M]`` bool, False on turns without a memory reward
        (``scored_memory_turns``): their A_M is 0 and their R_M enters no group statistic.
        Default all True.
      memory_norm: a name in ``advantage.MEMORY_NORMS`` (``MemoryRewardConfig.norm``).
      memory_group: a name in ``memory_reward.MEMORY_GROUPINGS`` (``MemoryRewardConfig.group``):
        ``"question"`` (default): one R_M statistic per question group; ``"turn"``: one per
        (question group, turn index), segment ``group · max_turns + turn``.
      max_turns: ``RolloutConfig.max_turns`` (the ``"turn"`` grouping's T).

    Returns:
      ``(advantages [R, L], a_t [N], a_m [M])`` float32 numpy arrays.
    """
    r, length = rows.input_ids.shape
    m = len(rows.mem_turn)
    rb = bucket_length(max_rows, 1) if max_rows is not None and r <= max_rows else r
    mb = bucket_length(max_mem, 1) if max_mem is not None and m <= max_mem else max(m, 1)
    pad = lambda x, n, v=0: np.pad(np.asarray(x), [(0, n - len(x))] + [(0, 0)] * (np.ndim(x) - 1),  # noqa: E731
                                   constant_values=v)
    keep = np.ones((m,), bool) if mem_valid is None else np.asarray(mem_valid, bool).reshape(-1)
    if keep.shape != (m,):
        raise ValueError(f"mem_valid has {keep.shape[0]} entries for {m} <mem> turns")
    group_ids = np.asarray([tr.group_id for tr in trajs], np.int32)
    mem_groups = np.asarray([trajs[i].group_id for i, _ in rows.mem_turn], np.int32).reshape(-1)
    t_index = np.asarray([t for _, t in rows.mem_turn], np.int32).reshape(-1)
    mem_groups, num_mem_groups = MEMORY_GROUPINGS.get(memory_group)(mem_groups, t_index, int(num_groups), max_turns)
    adv, a_t, a_m = _advantages(
        np.asarray(rewards, np.float32), group_ids, pad(np.asarray(r_mem, np.float32).reshape(-1), mb),
        pad(mem_groups, mb), pad(keep, mb, False), pad(rows.mem_rows.astype(np.int32), mb),
        pad(rows.mem_starts.astype(np.int32), mb), pad(rows.mem_ends.astype(np.int32), mb),
        pad(rows.traj_index.astype(np.int32), rb), pad(rows.loss_mask, rb), np.float32(memory_coef),
        num_groups=int(num_groups), memory_norm=memory_norm, num_mem_groups=num_mem_groups)
    adv, a_t, a_m = jax.device_get((adv, a_t, a_m))
    return np.asarray(adv)[:r], np.asarray(a_t), np.asarray(a_m)[:m]


@functools.partial(jax.jit, static_argnames=("num_groups", "memory_norm", "num_mem_groups"))
def _advantages(rewards, group_ids, r_mem, mem_groups, mem_valid, mem_rows, mem_starts, mem_ends, traj_index,
                loss_mask, memory_coef, *, num_groups, memory_norm, num_mem_groups):
    """``(A [R, L], A_T [N], A_M [M])``: outcome and memory advantages, A_M scattered onto the
    ``<mem>`` spans, ``A = (A_T[row] + coef · A_M) · loss_mask`` (docs/algorithm.md §4)."""
    a_t = outcome_advantage(rewards, group_ids, num_groups)
    a_m = memory_advantage(r_mem, mem_groups, num_mem_groups, mem_valid, memory_norm)
    mem_tok = scatter_span_values(memory_coef * a_m, mem_rows, mem_starts, mem_ends, mem_valid, loss_mask.shape)
    return token_advantages(a_t[traj_index], mem_tok, loss_mask), a_t, a_m


def rl_step(cluster: RLCluster, questions, cfg: RLConfig, key: jax.Array, rng: np.random.Generator,
            traj_offset: int = 0,
            progress: Optional[Callable[[int, int], None]] = None) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one MemPO step on ``questions`` and update ``cluster.learner`` in place.

    Args:
      cluster: the policy learner (updated in place), the reference parameters, the rollout
        engine, the memory-reward scorer, the agent format and the host tools (``RLCluster``).
      questions: items with ``id``, ``question``, ``golds``.
      cfg: RL options.
      key: PRNG key of this step.
      rng: numpy generator (mini-batch shuffles).
      traj_offset: global index of this process's first trajectory (``Engine.rollout``).
      progress: the rollout's ``progress`` callback (the trainer's fault hooks).

    Returns:
      ``(metrics, trajectories)``; metric names follow verl where one exists
      (``timing/weight_sync_s``: the policy's parameters placed on the rollout mesh,
      ``rollout_mesh.weight_sync``).
    """
    learner, engine, scorer, fmt = cluster.learner, cluster.engine, cluster.scorer, cluster.fmt
    timings = {}
    built = learner.precompile_once(cfg, lambda: precompile_rl_step(cluster, cfg, key)) if cfg.precompile else None
    if built is not None:
        timings["timing/precompile_s"] = built["seconds"]
    t_sync = time.perf_counter()
    params = jax.block_until_ready(engine.place(learner.params))
    timings["timing/weight_sync_s"] = time.perf_counter() - t_sync
    t0 = time.perf_counter()
    tokenizer = fmt.tokenizer
    trajs = new_trajectories(fmt, questions, cfg.group_size)
    engine.rollout(params, trajs, fmt, cluster.tool_env, cfg.rollout, key, progress, traj_offset)
    del params  # the rollout's weights (a stacked copy): not held through scoring and the update
    release_free_memory()  # the rollout's KV cache and weights: not kept as free heap under the update
    timings["timing/rollout_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    rewards_all = score_trajectories(trajs, cfg.outcome_metric)
    group_ids = np.array([t.group_id for t in trajs], np.int32)
    kept = kept_trajectories(cfg.filter_groups, rewards_all, group_ids)
    metrics = _rollout_metrics(trajs, rewards_all, group_ids, kept)
    if not kept.any():  # no group to train on (RLConfig.filter_groups): nothing is scored or updated
        metrics.update(timings)
        return metrics, trajs
    sampled, trajs, rewards = trajs, [t for t, k in zip(trajs, kept) if k], rewards_all[kept]
    rows = pad_columns(build_training_rows(trajs, cfg.rollout.context_steps, tokenizer.pad_id), TRAIN_MIN_LENGTH,
                       tokenizer.pad_id)
    mr = cfg.memory_reward
    scored = scored_memory_turns(trajs, rows.mem_turn, mr.include_malformed,
                                 MEMORY_TRAJECTORIES.get(mr.trajectories)(rewards))
    r_mem = np.zeros((len(rows.mem_turn),), np.float32)
    mem_out = MemoryRewardOutput(*(np.zeros((0,), np.float32),) * 3)
    if cfg.scores_memory:  # GRPO (memory_coef = 0): R_M would be multiplied by 0, so it is not scored
        full, mem, answers = memory_contexts(
            trajs, [mt for mt, k in zip(rows.mem_turn, scored) if k], tokenizer, mr.answer, codec=fmt.codec,
            hindsight=mr.hindsight, continuation=scorer.full_prefix,
            baseline_steps=MEMORY_BASELINES.get(mr.baseline)(cfg.rollout.context_steps))
        mem_out = scorer(learner.params, full, mem, answers)
        r_mem[scored] = memory_reward_values(mem_out, mr.scale)
    ref_logp = detached_logprobs(learner, cluster.reference, rows)
    adv, a_t, a_m = compute_advantages(trajs, rows, rewards, r_mem, len(questions), cfg.memory_coef,
                                       max_rows=training_row_bound(cfg), max_mem=mem_turn_bound(cfg),
                                       mem_valid=scored, memory_norm=mr.norm, memory_group=mr.group,
                                       max_turns=cfg.rollout.max_turns)
    timings["timing/scoring_s"] = time.perf_counter() - t1

    t_old = time.perf_counter()
    old_logp, lp_metrics = ppo_old_logprobs(learner, rows, cfg.old_logprobs)
    timings["timing/old_logprobs_s"] = time.perf_counter() - t_old

    t2 = time.perf_counter()
    batch = {
        "input_ids": rows.input_ids, "valid": rows.valid, "loss_mask": rows.loss_mask,
        "old_logprobs": old_logp, "ref_logprobs": ref_logp.astype(np.float32),
        "advantages": adv.astype(np.float32),
    }
    upd = _ppo_epochs(learner, batch, cfg, rng)
    release_free_memory()  # the update's activations: not kept as free heap under the next rollout
    timings["timing/update_s"] = time.perf_counter() - t2

    metrics.update(_update_metrics(rows, mem_out, r_mem, scored, a_t, a_m))
    metrics.update({k: float(np.mean(v)) for k, v in upd.items()})
    metrics.update(lp_metrics)
    metrics.update(timings)
    return metrics, sampled


def _ppo_epochs(learner, batch: dict, cfg: RLConfig, rng: np.random.Generator) -> dict[str, list[float]]:
    """``cfg.ppo_epochs`` passes of ``learner.ppo_update`` over ``batch``; each metric's values, one
    per epoch, in order."""
    upd: dict[str, list[float]] = {}
    for _ in range(cfg.ppo_epochs):
        for k, v in learner.ppo_update(batch, cfg.loss, cfg.num_mini_batches, rng,
                                       max_rows=training_row_bound(cfg)).items():
            upd.setdefault(k, []).append(v)
    return upd


def _rollout_metrics(trajs, rewards: np.ndarray, group_ids: np.ndarray, kept: np.ndarray) -> dict[str, float]:
    """The metrics of every sampled trajectory, before any group filter: outcome rewards
    (``rewards`` ``[n_traj]``), ``critic/score/zero_std_groups`` (the share of groups whose outcome
    rewards are all equal: their outcome advantage is 0, only the memory reward and the KL term
    move them), ``train/kept_groups`` (the share of groups ``kept`` (``[n_traj]`` bool) for
    training, ``RLConfig.filter_groups``), the rollout's own (``rollout_metrics``), and the
    memory-reward and batch-shape metrics at 0 (``_update_metrics`` overwrites them when a group is
    kept), so that every step logs the same names (verl's where one exists)."""
    return {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/zero_std_groups": zero_std_group_share(rewards, group_ids),
        "critic/em/mean": float(score_trajectories(trajs, "em").mean()),
        "critic/advantages/mean": 0.0,
        "train/kept_groups": group_share(kept, group_ids),
        **{k: 0.0 for k in ("mem/reward/mean", "mem/p_full/mean", "mem/p_mem/mean", "mem/advantage/std", "mem/turns",
                            "mem/excluded_malformed", "train/rows", "train/tokens", "train/seq_len")},
        **rollout_metrics(trajs),
    }


def _update_metrics(rows, mem_out, r_mem: np.ndarray, scored: np.ndarray, a_t: np.ndarray,
                    a_m: np.ndarray) -> dict[str, float]:
    """The memory-reward and batch-shape metrics of the trained trajectories: ``mem_out`` the
    scorer's output over the ``scored`` (``[n_mem]`` bool) memory turns, ``r_mem`` ``[n_mem]``
    their R_M in the configured units (``MemoryRewardConfig.scale``: ``mem/reward/mean`` is the
    mean of what the advantages used), ``a_t`` / ``a_m`` the trajectory / memory-turn advantages."""
    return {
        "critic/advantages/mean": float(a_t.mean()) if a_t.size else 0.0,
        "mem/reward/mean": float(r_mem[scored].mean()) if scored.any() else 0.0,
        "mem/p_full/mean": float(mem_out.p_full.mean()) if len(mem_out.p_full) else 0.0,
        "mem/p_mem/mean": float(mem_out.p_mem.mean()) if len(mem_out.p_mem) else 0.0,
        "mem/advantage/std": float(a_m[scored].std()) if scored.any() else 0.0,
        "mem/turns": float(len(rows.mem_turn)),
        "mem/excluded_malformed": float(len(rows.mem_turn) - scored.sum()),
        "train/rows": float(rows.input_ids.shape[0]),
        "train/tokens": float(rows.valid.sum()),  # the rows' real tokens: timing/update_s per token
        "train/seq_len": float(rows.input_ids.shape[1]),
    }
