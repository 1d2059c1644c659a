"""One MemPO RL step: rollout → rewards → memory reward → advantages → PPO update.

ARCHITECTURE.md's data flow, in order:

1. rollout: ``group_size`` trajectories per question, multi-turn with host tools;
2. outcome reward R_T per trajectory (EM or F1 vs gold, MEMPO_SPEC §3);
3. memory reward R_M per ``<mem>`` turn: ONE detached call over the stacked
   ``[full_traj; mem_traj]`` batch with the answer Z repeated twice (MEMPO_SPEC §3);
4. reference log-probs (frozen reference policy) for the KL term;
5. advantages: A_T per question group, A_M pooled over every turn of every trajectory of the
   group and written on the ``<mem>`` tokens, A = A_T + A_M on generated tokens (MEMPO_SPEC §4);
6. PPO update (clipped ratio, dual clip, low_var_kl, token-mean; MEMPO_SPEC §5).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mempo_jax.advantage import memory_advantage, outcome_advantage, scatter_span_values, token_advantages
from mempo_jax.agent.rollout import RolloutConfig, new_trajectories, rollout, rollout_metrics
from mempo_jax.agent.trajectory import Trajectory, build_training_rows
from mempo_jax.losses import LossConfig
from mempo_jax.rewards import outcome_reward


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Options of the MemPO RL stage.

    Attributes:
      steps: RL steps (one rollout + one PPO epoch each).
      questions_per_step: questions sampled per step (each gives a group).
      group_size: trajectories per question (n; reference 16).
      num_mini_batches: optimizer steps per RL step.
      ppo_epochs: passes over the step's rows.
      outcome_metric: ``"em"`` or ``"f1"``.
      memory_answer: ``"gold"`` or ``"generated"`` — the Z scored by the memory reward.
      memory_coef: scale of A_M in A = A_T + memory_coef · A_M (1 in the spec; 0 disables).
      loss: PPO loss options.
      rollout: rollout options (``context_steps`` picks full or k-step training).
    """

    steps: int = 40
    questions_per_step: int = 8
    group_size: int = 8
    num_mini_batches: int = 2
    ppo_epochs: int = 1
    outcome_metric: str = "em"
    memory_answer: str = "gold"
    memory_coef: float = 1.0
    loss: LossConfig = LossConfig()
    rollout: RolloutConfig = RolloutConfig()


def memory_contexts(trajs: Sequence[Trajectory], mem_turn: Sequence[tuple[int, int]], tokenizer, answer_source: str):
    """``(full_contexts, mem_contexts, answers)`` for every recorded ``<mem>`` turn.

    ``full_traj[t]`` / ``mem_traj[t]`` views and Z = the gold answer (default) or the trajectory's
    generated answer (gold when it gave none), encoded with a leading space as rendered in turns.

    Raises:
      ValueError: for an unknown ``answer_source``.
    """
    if answer_source not in ("gold", "generated"):
        raise ValueError(f"memory_answer must be 'gold' or 'generated', got {answer_source!r}")
    full, mem, answers = [], [], []
    for tr_i, t in mem_turn:
        tr = trajs[tr_i]
        full.append(tr.full_traj(t))
        mem.append(tr.mem_traj(t))
        gold = "; ".join(g[0] for g in tr.golds)
        text = tr.answer if (answer_source == "generated" and tr.answer) else gold
        answers.append(tokenizer.encode(" " + text))
    return full, mem, answers


def score_trajectories(trajs: Sequence[Trajectory], metric: str) -> np.ndarray:
    """Outcome rewards ``[num_traj]`` float32: 0 when no answer was given (MEMPO_SPEC §3)."""
    return np.asarray([outcome_reward(tr.answer, tr.golds, metric) for tr in trajs], np.float32)


def compute_advantages(trajs, rows, rewards: np.ndarray, r_mem: np.ndarray, num_groups: int, memory_coef: float):
    """Token advantages ``[rows, seq]`` and their parts (MEMPO_SPEC §4)."""
    group_ids = np.asarray([tr.group_id for tr in trajs], np.int32)
    a_t = outcome_advantage(jnp.asarray(rewards), jnp.asarray(group_ids), num_groups)
    m = len(rows.mem_turn)
    if m:
        mem_groups = np.asarray([trajs[i].group_id for i, _ in rows.mem_turn], np.int32)
        a_m = memory_advantage(jnp.asarray(r_mem, jnp.float32), jnp.asarray(mem_groups), num_groups, jnp.ones((m,), bool))
        mem_tok = scatter_span_values(memory_coef * a_m, jnp.asarray(rows.mem_rows), jnp.asarray(rows.mem_starts),
                                      jnp.asarray(rows.mem_ends), jnp.ones((m,), bool), rows.input_ids.shape)
    else:
        a_m = jnp.zeros((0,), jnp.float32)
        mem_tok = jnp.zeros(rows.input_ids.shape, jnp.float32)
    adv = token_advantages(a_t[jnp.asarray(rows.traj_index)], mem_tok, jnp.asarray(rows.loss_mask))
    return np.asarray(adv), np.asarray(a_t), np.asarray(a_m)


def rl_step(learner, ref_params, sample_fn, scorer, questions, tokenizer, tool_env, cfg: RLConfig,
            key: jax.Array, rng: np.random.Generator) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one MemPO step on ``questions`` and update ``learner`` in place.

    Args:
      learner: a ``Learner`` (policy params + optimizer).
      ref_params: frozen reference-policy parameters.
      sample_fn: the sampler adapter (see ``rollout.rollout``).
      scorer: a ``MemoryRewardScorer``.
      questions: items with ``id``, ``question``, ``golds``.
      tokenizer, tool_env: the project tokenizer and host tools.
      cfg: RL options.
      key: PRNG key of this step.
      rng: numpy generator (mini-batch shuffles).

    Returns:
      ``(metrics, trajectories)``; metric names follow verl where one exists.
    """
    timings = {}
    t0 = time.perf_counter()
    trajs = new_trajectories(tokenizer, questions, cfg.group_size)
    rollout(sample_fn, learner.params, trajs, tokenizer, tool_env, cfg.rollout, key)
    timings["timing/rollout_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    rewards = score_trajectories(trajs, cfg.outcome_metric)
    rows = build_training_rows(trajs, cfg.rollout.context_steps, tokenizer.pad_id)
    full, mem, answers = memory_contexts(trajs, rows.mem_turn, tokenizer, cfg.memory_answer)
    mem_out = scorer(learner.params, full, mem, answers)
    ref_logp = learner.logprobs(ref_params, rows.input_ids, rows.valid)
    adv, a_t, a_m = compute_advantages(trajs, rows, rewards, mem_out.r_mem, len(questions), cfg.memory_coef)
    timings["timing/scoring_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    batch = {
        "input_ids": rows.input_ids, "valid": rows.valid, "loss_mask": rows.loss_mask,
        "old_logprobs": rows.old_logprobs, "ref_logprobs": ref_logp.astype(np.float32),
        "advantages": adv.astype(np.float32),
    }
    upd: dict[str, list[float]] = {}
    for _ in range(cfg.ppo_epochs):
        for k, v in learner.ppo_update(batch, cfg.loss, cfg.num_mini_batches, rng).items():
            upd.setdefault(k, []).append(v)
    timings["timing/update_s"] = time.perf_counter() - t2

    em = score_trajectories(trajs, "em")
    metrics = {
        "critic/score/mean": float(rewards.mean()),
        "critic/em/mean": float(em.mean()),
        "critic/advantages/mean": float(a_t.mean()) if a_t.size else 0.0,
        "mem/reward/mean": float(mem_out.r_mem.mean()) if len(mem_out.r_mem) else 0.0,
        "mem/p_full/mean": float(mem_out.p_full.mean()) if len(mem_out.p_full) else 0.0,
        "mem/p_mem/mean": float(mem_out.p_mem.mean()) if len(mem_out.p_mem) else 0.0,
        "mem/advantage/std": float(a_m.std()) if a_m.size else 0.0,
        "mem/turns": float(len(rows.mem_turn)),
        "train/rows": float(rows.input_ids.shape[0]),
        "train/seq_len": float(rows.input_ids.shape[1]),
    }
    metrics.update({k: float(np.mean(v)) for k, v in upd.items()})
    metrics.update(rollout_metrics(trajs))
    metrics.update(timings)
    return metrics, trajs
