"""Evaluating a policy: one rollout per question, EM/F1/TT/PT/turns/format failures (docs/algorithm.md §6).

TT (total tokens per question) is the sum over turns of the tokens the model processed for that
turn (its context + its output); PT (peak tokens) is the largest such single context. In ``full``
mode TT grows with the square of the turn count; in k = 1 mode each context stays bounded.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from mempo_jax.agent.rollout import RolloutConfig, new_trajectories
from mempo_jax.agent.trajectory import Trajectory, mode_name
from mempo_jax.data.qa_formats import QAExample
from mempo_jax.data.world import Question
from mempo_jax.rl.rewards import score_trajectories


@dataclasses.dataclass
class EvalResult:
    """Means over questions, and the per-question values kept for paired statistics.

    Attributes:
      metrics: ``summarize`` of the trajectories.
      per_question_em, per_question_f1: ``[questions]`` float64, in ``questions`` order.
      trajectories: the finished trajectories.
    """

    metrics: dict
    per_question_em: np.ndarray
    trajectories: list
    per_question_f1: Optional[np.ndarray] = None


def summarize(trajs: Sequence[Trajectory], em: np.ndarray, f1: np.ndarray) -> dict:
    """``{"em", "f1", "tt", "pt", "turns", "format_fail", "n"}`` means over trajectories.

    ``em`` / ``f1`` are the trajectories' scores (``rl.rewards.score_trajectories``).
    ``format_fail`` is the share of episodes with at least one malformed turn or no answer.
    """
    tt_pt = np.array([t.token_stats() for t in trajs], np.float64).reshape(-1, 2)
    fails = np.array([(t.format_failures > 0) or (t.answer is None) for t in trajs], np.float64)
    return {
        "em": float(np.mean(em)), "f1": float(np.mean(f1)),
        "tt": float(tt_pt[:, 0].mean()), "pt": float(tt_pt[:, 1].mean()),
        "turns": float(np.mean([len(t.turns) for t in trajs])),
        "format_fail": float(fails.mean()), "n": len(trajs),
    }


KIND_PREFIX = "eval/"  # per-kind metric names: "eval/<kind>/em", "eval/<kind>/f1", "eval/<kind>/n"


def question_kind(question: Question | QAExample) -> str:
    """The kind a question is reported under: a QA file's own ``type`` field (``Question.qa_type``,
    e.g. HotpotQA ``bridge`` / ``comparison``), else ``Question.kind`` (the tiny world's
    ``single`` / ``bridge`` / ``multi``, or a QA file's format), else ``"all"`` (a blank
    ``Question`` field, or a ``QAExample``, which has neither)."""
    if isinstance(question, Question):
        for value in (question.qa_type, question.kind):
            if value.strip():
                return value.strip()
    return "all"


def kind_metrics(questions: Sequence, em: Sequence[float], f1: Sequence[float]) -> dict:
    """Per-kind means of per-question EM and F1 (docs/algorithm.md §6 reports EM/F1 per dataset; the tiny
    world's datasets are its question kinds).

    Args:
      questions: ``[questions]`` items (``question_kind`` of each), in the order of ``em`` / ``f1``.
      em, f1: ``[questions]`` per-question scores in [0, 1] (a multi-objective question's is its
        mean over objectives, ``rewards.outcome_reward``).

    Returns:
      ``{"eval/<kind>/em": mean, "eval/<kind>/f1": mean, "eval/<kind>/n": count}`` for every kind
      present, kinds in sorted order (floats; ``n`` a float too, so every value logs as a metric).

    Raises:
      ValueError: the three inputs differ in length.
    """
    em, f1 = np.asarray(em, np.float64), np.asarray(f1, np.float64)
    if not len(questions) == len(em) == len(f1):
        raise ValueError(f"kind_metrics: {len(questions)} questions but {len(em)} EM and {len(f1)} F1 values")
    kinds = np.array([question_kind(q) for q in questions], dtype=object)
    out: dict = {}
    for kind in sorted(set(kinds.tolist())):
        sel = kinds == kind
        out[f"{KIND_PREFIX}{kind}/em"] = float(em[sel].mean())
        out[f"{KIND_PREFIX}{kind}/f1"] = float(f1[sel].mean())
        out[f"{KIND_PREFIX}{kind}/n"] = float(sel.sum())
    return out


def is_kind_metric(name: str) -> bool:
    """True for a per-kind metric name of ``kind_metrics``."""
    return name.startswith(KIND_PREFIX)


def prediction_record(question, trajectory, em: float, f1: float, mode: str, dataset: str) -> dict:
    """One line of a predictions file (``predictions.jsonl`` of ``mempo_jax.commands.evaluate``,
    ``eval_<stage>_predictions.jsonl`` of the main job): the question, its golds, the answer given,
    its EM and F1, turns, tool calls, format failures, TT / PT (tokens, as ``summarize``) and how
    the episode ended.

    Args:
      question: an item with ``id``, ``question``, ``golds``.
      trajectory: its finished ``Trajectory``.
      em, f1: its scores as ``evaluate_policy`` computed them (``EvalResult.per_question_em`` /
        ``per_question_f1``; ``rl.rewards.outcome_reward``).
      mode: the context mode's name (``mode_name``).
      dataset: the dataset's name.

    Returns:
      ``{"dataset", "mode", "id", "kind", "question": str, "golds": [[str]], "answer": str | None,
      "em", "f1": float in [0, 1], "turns", "tool_calls", "format_failures", "tt", "pt": int,
      "end": str}`` (JSON-serialisable; ``kind`` is ``question_kind``).
    """
    tt, pt = trajectory.token_stats()
    return {"dataset": dataset, "mode": mode, "id": question.id, "kind": question_kind(question),
            "question": question.question,
            "golds": [list(g) for g in question.golds], "answer": trajectory.answer,
            "em": float(em), "f1": float(f1),
            "turns": len(trajectory.turns), "tool_calls": trajectory.num_tool_calls,
            "format_failures": trajectory.format_failures, "tt": tt, "pt": pt, "end": trajectory.end_reason}


def evaluate_policy(engine, params, questions: Sequence, fmt, tool_env, base: RolloutConfig,
                    context_steps: int, temperature: float, key: jax.Array, chunk: int = 128,
                    progress: Optional[Callable[[int], None]] = None, first: int = 0) -> EvalResult:
    """Run the policy once on each question in one context mode.

    Args:
      engine, params, fmt, tool_env: as for ``Engine.rollout`` (``fmt``: an ``AgentFormat``).
      questions: items with ``id``, ``question``, ``golds``.
      base: rollout options; ``context_steps`` and ``temperature`` are replaced.
      context_steps: ``FULL`` or k.
      temperature: 0 for greedy.
      key: PRNG key.
      chunk: questions per rollout batch.
      progress: called with the number of questions finished so far.
      first: global index of ``questions[0]`` (a process's share of the held-out set): question i
        is rolled out as trajectory ``first + i`` under ``key``, so its sampled tokens do not
        depend on the chunks or on how many processes share the questions.

    Returns:
      ``EvalResult`` with means (``summarize``, plus ``kind_metrics`` of the questions) and
      per-question EM and F1 (in ``questions`` order).
    """
    cfg = dataclasses.replace(base, context_steps=context_steps, temperature=temperature)
    trajs: list[Trajectory] = []
    for s in range(0, len(questions), chunk):
        batch = new_trajectories(fmt, questions[s : s + chunk], 1, group_offset=s)
        engine.rollout(params, batch, fmt, tool_env, cfg, key, traj_offset=first + s)
        trajs += batch
        if progress is not None:
            progress(len(trajs))
    em = score_trajectories(trajs, "em", np.float64)
    f1 = score_trajectories(trajs, "f1", np.float64)
    return EvalResult({**summarize(trajs, em, f1), **kind_metrics(questions, em, f1)}, em, trajs, f1)


def prediction_records(questions: Sequence, result: EvalResult, mode: str, dataset: str) -> list[dict]:
    """``prediction_record`` of each question of ``result`` (``evaluate_policy`` on ``questions``)."""
    return [prediction_record(q, tr, em, f1, mode, dataset) for q, tr, em, f1 in
            zip(questions, result.trajectories, result.per_question_em, result.per_question_f1)]


__all__ = ["EvalResult", "evaluate_policy", "is_kind_metric", "kind_metrics", "mode_name", "prediction_record",
           "prediction_records", "question_kind", "summarize"]
