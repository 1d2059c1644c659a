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
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Bool, Float, Real

from mempo_jax.rl.advantage import memory_advantage, outcome_advantage, scatter_span_values, token_advantages
from mempo_jax.text.protocol import ANSWER, MEM
from mempo_jax.agent.rollout import Engine, RolloutConfig, new_trajectories, place_params, rollout, rollout_metrics
from mempo_jax.agent.tags import TagCodec
from mempo_jax.agent.trajectory import FULL, TrainingRows, Trajectory, Turn, build_training_rows
from mempo_jax.core.batching import bucket_length, length_buckets
from mempo_jax.core.host_memory import release_free_memory
from mempo_jax.rl.group_filter import GROUP_FILTERS, group_share, kept_trajectories, zero_std_group_share
from mempo_jax.rl.interfaces import MemoryScorer, PolicyLearner
from mempo_jax.rl.learner import TRAIN_MIN_LENGTH
from mempo_jax.rl.losses import LossConfig
from mempo_jax.rl.memory_reward import (MEMORY_BASELINES, MEMORY_GROUPINGS, MEMORY_TRAJECTORIES, MemoryRewardConfig,
                                        memory_reward_values)
from mempo_jax.rl.rewards import get_metric, score_trajectories
from mempo_jax.text.stop_strings import byte_offsets
from mempo_jax.core.validation import check


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
      memory_coef: scale of A_M in A = A_T + memory_coef · A_M (1 in the spec; 0 disables).
      loss: PPO loss options.
      rollout: rollout options (``context_steps`` picks full or k-step training).
      precompile: compile every program shape the config can produce (``precompile_rl_step``)
        before the first step, so that no step compiles; off by default (it builds shapes a
        short run may never use).
      memory_reward: how R_M is scored and normalised (``MemoryRewardConfig``; its defaults are
        docs/algorithm.md §3–§4, every other value a named variant).
      old_logprobs: where the PPO "old" log-probs come from: ``"trainer"`` (default; the policy
        recomputes them over the step's rows before the update, one detached packed pass,
        ``policy_old_logprobs``, as verl's ``compute_log_prob``; the sampler's stay in the
        rollout records for ``rollout/logprob_diff/*``) or ``"sampler"`` (the sampler's own; no
        recompute, no ``logprob_diff`` metrics).
      filter_groups: which question groups are trained on (``group_filter.GROUP_FILTERS``):
        ``"none"`` (default, every group) or ``"outcome_std"`` (only groups whose outcome rewards
        differ; the others are dropped before the memory reward, the log-probs and the update, and
        a step in which no group differs updates nothing). One process only.
    """

    steps: int = 40
    questions_per_step: int = 8
    group_size: int = 8
    num_mini_batches: int = 2
    ppo_epochs: int = 1
    outcome_metric: str = "em"
    memory_coef: float = 1.0
    loss: LossConfig = LossConfig()
    rollout: RolloutConfig = RolloutConfig()
    precompile: bool = False
    old_logprobs: str = "trainer"
    memory_reward: MemoryRewardConfig = MemoryRewardConfig()
    filter_groups: str = "none"

    def __post_init__(self):
        check(self, "steps", int, lo=0)
        for name in ("questions_per_step", "group_size", "num_mini_batches", "ppo_epochs"):
            check(self, name, int, lo=1)
        check(self, "outcome_metric", str)
        try:
            get_metric(self.outcome_metric)
        except ValueError as e:
            raise ValueError(f"RLConfig.outcome_metric: {e}") from None
        check(self, "memory_coef", float)
        check(self, "loss", LossConfig)
        check(self, "rollout", RolloutConfig)
        check(self, "precompile", bool)
        check(self, "memory_reward", MemoryRewardConfig)
        check(self, "old_logprobs", str, choices=("trainer", "sampler"))
        check(self, "filter_groups", str, choices=tuple(GROUP_FILTERS.names()))




def training_row_bound(cfg: RLConfig) -> int:
    """Most training rows one step can produce: one per trajectory in full mode, one per turn in
    k-step mode (``questions_per_step · group_size · max_turns``)."""
    per_traj = 1 if cfg.rollout.context_steps == FULL else cfg.rollout.max_turns
    return cfg.questions_per_step * cfg.group_size * per_traj


def mem_turn_bound(cfg: RLConfig) -> int:
    """Most ``<mem>`` turns one step can record: ``questions_per_step · group_size · max_turns``."""
    return cfg.questions_per_step * cfg.group_size * cfg.rollout.max_turns


def training_length_buckets(cfg: RLConfig) -> list[int]:
    """Length buckets of training rows: ``TRAIN_MIN_LENGTH, 2·…, bucket(bound)``.

    The bound: a k-step row is a policy context plus its turn, at most ``max_context_tokens``
    (the rollout's budget check); a full-mode row adds the last tool result
    (``max_observation_tokens + 2``).
    """
    ro = cfg.rollout
    bound = ro.max_context_tokens + (ro.max_observation_tokens + 2 if ro.context_steps == FULL else 0)
    return length_buckets(TRAIN_MIN_LENGTH, bound)


def scoring_length_bound(cfg: RLConfig, allowance: int = 128) -> int:
    """A bound (tokens) on a memory-reward scoring row: ``full_traj[t]`` + answer prefix + Z.

    In full mode ``full_traj[t]`` is a policy context (at most ``max_context_tokens -
    max_new_tokens``); in k-step mode it is the whole history before the last turn,
    ``prompt + (max_turns - 1)·(max_new_tokens + max_observation_tokens + 2)``. ``allowance``
    covers the prompt, the prefix and Z (rows beyond the bound still work: one more compile).
    """
    ro = cfg.rollout
    history = (ro.max_turns - 1) * (ro.max_new_tokens + ro.max_observation_tokens + 2)
    return max(ro.max_context_tokens, history + allowance)


def precompile_rl_step(learner: PolicyLearner, ref_params, engine: Engine, scorer: MemoryScorer, tokenizer,
                       cfg: RLConfig, key: jax.Array) -> dict:
    """Build every program an RL step of ``cfg`` can run, so that steps compile nothing.

    The shapes are functions of the config only: the rollout engine's programs (``engine.warm``,
    dummy tokens, on each process's rollout mesh), scoring ``[scorer.rows_per_call, L]`` for ``L`` in
    ``scorer.length_buckets(scoring_length_bound(cfg))``, and the reference log-probs and the PPO
    update at every ``training_length_buckets(cfg)`` with the ``ppo_plan`` of
    ``training_row_bound(cfg)`` rows (compiled ahead of time, nothing runs).

    Args:
      learner, ref_params, engine, scorer, tokenizer, cfg: as for ``rl_step``.
      key: PRNG key for the dummy sampling calls.

    Returns:
      ``{"sampler": n, "scorer": n, "learner": n, "old_logprobs": n, "advantages": n, "seconds": s}``
      (programs per part, wall time; ``old_logprobs``: the packed pass of the reference and old
      log-probs, absent where packing does not apply and ``learner`` has the padded ones).
    """
    from mempo_jax.agent.rollout import warm_sampler
    from mempo_jax.rl.learner import ppo_plan

    from mempo_jax.core.distributed import process_slice

    t0 = time.perf_counter()
    n_traj = cfg.questions_per_step * cfg.group_size
    mine = process_slice(cfg.questions_per_step)  # this process's questions (its rollout's slots)
    out = {"sampler": warm_sampler(engine, learner.params, cfg.rollout, (mine.stop - mine.start) * cfg.group_size, key)}
    out["scorer"] = scorer.precompile(learner.params, scorer.length_buckets(scoring_length_bound(cfg)))
    plan = ppo_plan(training_row_bound(cfg) * jax.process_count(), cfg.num_mini_batches, learner.micro_batch_rows,
                    training_row_bound(cfg) * jax.process_count())
    calc = learner.packed_logprobs()  # the reference log-probs, and the old ones with old_logprobs = "trainer"
    out["learner"] = learner.precompile(training_length_buckets(cfg), plan.rows, plan.rows // plan.micro, cfg.loss,
                                        logprobs=calc is None)
    if calc is not None:
        out["old_logprobs"] = calc.precompile(learner.params, training_length_buckets(cfg))
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


def answer_ids_of(turn: Turn, codec) -> Optional[list[int]]:
    """The sampled ids inside the first ``<answer> … </answer>`` block of ``turn.output_ids``
    (token-in/token-out, docs/algorithm.md §2: the ids that were sampled are the ids that are scored),
    or ``None`` without a closed, non-empty block.

    The one place that cuts the answer out of a turn's ids. ``codec`` is the policy's
    ``TagCodec``: in ``tokens`` mode the ids strictly between the two tag ids; in ``text`` mode
    the tokens whose bytes lie wholly between the end of ``<answer>`` and the start of
    ``</answer>`` (found on the tokens' byte offsets, never by re-tokenising; a token that
    straddles a tag edge, such as ``>Paris``, holds tag bytes and is left out).
    """
    ids = [int(i) for i in turn.output_ids]
    if codec.mode == "tokens":
        span = codec.find_span(ids, ANSWER[0], ANSWER[1])
        inner = [] if span is None else ids[span[0] + 1 : span[1] - 1]
    else:
        vocab = codec.token_bytes(max(int(codec.tokenizer.vocab_size), max(ids, default=-1) + 1))
        data = b"".join(vocab[i] for i in ids)
        op, cl = (t.encode("utf-8") for t in ANSWER)
        lo = data.find(op)
        hi = -1 if lo < 0 else data.find(cl, lo + len(op))
        if hi < 0:
            return None
        off = byte_offsets(vocab, ids)
        inner = [i for k, i in enumerate(ids) if off[k] >= lo + len(op) and off[k + 1] <= hi and off[k + 1] > off[k]]
    return inner or None


def scored_memory_turns(trajs: Sequence[Trajectory], mem_turn: Sequence[tuple[int, int]],
                        include_malformed: bool, trajectories: np.ndarray | None = None) -> np.ndarray:
    """``[M]`` bool: which recorded ``<mem>`` turns get a memory reward. With
    ``include_malformed`` every one; else only turns without a format error
    (``turn.parsed.error is None``; ``MemoryRewardConfig.include_malformed``). With
    ``trajectories`` (``[N]`` bool over ``trajs``, ``MemoryRewardConfig.trajectories``' selection),
    also only turns of the selected trajectories."""
    keep = np.ones((len(mem_turn),), bool)
    if not include_malformed:
        keep = np.asarray([trajs[i].turns[t].parsed.error is None for i, t in mem_turn], bool).reshape(-1)
    if trajectories is not None:
        keep &= np.asarray([bool(trajectories[i]) for i, _ in mem_turn], bool).reshape(-1)
    return keep


def memory_view(tr: Trajectory, t: int, codec=None) -> Optional[list[int]]:
    """``mem_traj[t]`` as the memory reward scores it: system + question + turn t's
    ``<mem>…</mem>`` block ending exactly at ``</mem>`` (``TagCodec.end_at_close``; in text mode
    the span's last token may hold the next tag's first bytes, e.g. SmolLM2's ``><``, and the view
    would read ``…</mem><<think>`` once the scorer's prefix follows). ``None`` without a block.
    ``codec``: the policy's ``TagCodec`` (``None`` or tokens mode: ``mem_traj[t]`` unchanged).
    Measured on the SmolLM2 recipe's policy (180 views, every one straddling): mean P(gold Z) 0.310
    before, 0.302 after, |Δ log P| 0.086 on average (docs/hf_checkpoints.md)."""
    ids = tr.mem_traj(t)
    if ids is None or codec is None:
        return ids
    return codec.end_at_close(ids, MEM[1])


def memory_contexts(trajs: Sequence[Trajectory], mem_turn: Sequence[tuple[int, int]], tokenizer, answer_source: str,
                    *, codec=None, baseline_steps: int = FULL, hindsight: bool = False):
    """``(full_contexts, mem_contexts, answers)`` for every recorded ``<mem>`` turn.

    ``full_traj[t]`` (``baseline_steps = FULL``, the default; else the k-step policy context of
    turn t, ``Trajectory.policy_context``: ``MemoryRewardConfig.baseline = "input"``) /
    ``mem_traj[t]`` views and Z: the gold answer (default; aliases' first
    entries joined by ``"; "``, encoded with a leading space as rendered in turns) or, with
    ``"generated"``, the sampled ids of the trajectory's final ``<answer>`` block
    (``answer_ids_of`` with ``codec``, the policy's ``TagCodec``; default: ``tokenizer``'s tags
    as single ids), gold when the trajectory gave no answer. Never decoded and re-encoded.
    ``hindsight`` (``MemoryRewardConfig.hindsight``): both views of turn t end with
    ``Trajectory.later_observations(t)``, the tool results of turns t.. (none for the answer turn).

    Raises:
      ValueError: for an unknown ``answer_source``.
    """
    if answer_source not in ("gold", "generated"):
        raise ValueError(f"MemoryRewardConfig.answer must be 'gold' or 'generated', got {answer_source!r}")
    if answer_source == "generated" and codec is None:
        codec = TagCodec(tokenizer, "tokens")
    full, mem, answers = [], [], []
    for tr_i, t in mem_turn:
        tr = trajs[tr_i]
        later = tr.later_observations(t) if hindsight else []
        full.append(tr.policy_context(baseline_steps, t) + later)
        mem.append(memory_view(tr, t, codec) + later)
        z = answer_ids_of(tr.turns[-1], codec) if answer_source == "generated" and tr.answer else None
        answers.append(z if z is not None else gold_answer_ids(tokenizer, tr.golds))
    return full, mem, answers


def gold_answer_ids(tokenizer, golds) -> list[int]:
    """The gold Z of the memory reward (docs/algorithm.md §3): each objective's first alias joined by
    ``"; "``, encoded with a leading space as rendered in turns. ``golds``: one alias tuple per objective."""
    return tokenizer.encode(" " + "; ".join(g[0] for g in golds))


def pad_columns(rows: TrainingRows, min_length: int, pad_id: int) -> TrainingRows:
    """``rows`` right-padded (pad id, invalid, no loss) to at least ``min_length`` columns, so
    short batches share the ``TRAIN_MIN_LENGTH`` bucket instead of compiling 16/32/64."""
    extra = int(min_length) - rows.input_ids.shape[1]
    if extra <= 0:
        return rows
    pad = lambda x, v: np.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    return dataclasses.replace(rows, input_ids=pad(rows.input_ids, pad_id), valid=pad(rows.valid, False),
                               loss_mask=pad(rows.loss_mask, 0.0), old_logprobs=pad(rows.old_logprobs, 0.0))


def detached_logprobs(learner: PolicyLearner, params, rows: TrainingRows) -> Float[np.ndarray, "rows length"]:
    """``[R, L]`` float32 per-token log-probs of ``params`` over the step's rows (no gradient),
    at the learner's temperature (``Learner.detached_logprobs``: one packed pass where it applies,
    else the padded ``learner.logprobs``). The reference and the PPO "old" log-probs both come from here."""
    return learner.detached_logprobs(params, rows.input_ids, rows.valid)


def policy_old_logprobs(learner, rows: TrainingRows) -> tuple[Float[np.ndarray, "rows length"], dict[str, float]]:
    """The PPO "old" log-probs recomputed by the policy before the update, and the sampler/trainer gap.

    One detached pass of ``learner.params`` (the policy that sampled the step) over the
    training rows, packed (``Learner.packed_logprobs``; the padded ``learner.logprobs`` where
    packing does not apply), at the learner's temperature: verl's ``compute_log_prob`` before
    ``update_policy``. In float32 it agrees with the sampler to ~1e-5; in bfloat16 the
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


def mem_group_count(cfg: RLConfig) -> int:
    """The number of R_M segments of a step (``MemoryRewardConfig.group``'s grouping of no turns):
    questions, times ``max_turns`` with ``group = "turn"``."""
    none = np.zeros((0,), np.int32)
    return MEMORY_GROUPINGS.get(cfg.memory_reward.group)(none, none, cfg.questions_per_step, cfg.rollout.max_turns)[1]


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


def rl_step(learner: PolicyLearner, ref_params, engine: Engine, scorer: MemoryScorer, questions, fmt, tool_env,
            cfg: RLConfig, key: jax.Array,
            rng: np.random.Generator, traj_offset: int = 0,
            progress: Optional[Callable[[int, int], None]] = None) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one MemPO step on ``questions`` and update ``learner`` in place.

    Args:
      learner: the policy (``interfaces.PolicyLearner``: a ``Learner``), updated in place.
      ref_params: frozen reference-policy parameters.
      engine: the rollout engine (``agent.rollout.Engine``).
      scorer: the memory-reward scorer (``interfaces.MemoryScorer``: a ``MemoryRewardScorer``).
      questions: items with ``id``, ``question``, ``golds``.
      fmt, tool_env: the agent format (``AgentFormat``: tokenizer, tags, prompt) and host tools.
      cfg: RL options.
      key: PRNG key of this step.
      rng: numpy generator (mini-batch shuffles).
      traj_offset: global index of this process's first trajectory (``rollout.rollout``).
      progress: the rollout's ``progress`` callback (the trainer's fault hooks).

    Returns:
      ``(metrics, trajectories)``; metric names follow verl where one exists
      (``timing/weight_sync_s``: the policy's parameters placed on the rollout mesh,
      ``rollout_mesh.weight_sync``).
    """
    timings = {}
    built = learner.precompile_once(cfg, lambda: precompile_rl_step(learner, ref_params, engine, scorer, fmt.tokenizer,
                                                                    cfg, key)) if cfg.precompile else None
    if built is not None:
        timings["timing/precompile_s"] = built["seconds"]
    t_sync = time.perf_counter()
    params = jax.block_until_ready(place_params(engine, learner.params))
    timings["timing/weight_sync_s"] = time.perf_counter() - t_sync
    t0 = time.perf_counter()
    tokenizer = fmt.tokenizer
    trajs = new_trajectories(fmt, questions, cfg.group_size)
    rollout(engine, params, trajs, fmt, tool_env, cfg.rollout, key, progress, traj_offset)
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
    full, mem, answers = memory_contexts(trajs, [mt for mt, k in zip(rows.mem_turn, scored) if k], tokenizer,
                                         mr.answer, codec=fmt.codec, hindsight=mr.hindsight,
                                         baseline_steps=MEMORY_BASELINES.get(mr.baseline)(cfg.rollout.context_steps))
    mem_out = scorer(learner.params, full, mem, answers)
    r_mem = np.zeros((len(rows.mem_turn),), np.float32)
    r_mem[scored] = memory_reward_values(mem_out, mr.scale)
    ref_logp = detached_logprobs(learner, ref_params, rows)
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
