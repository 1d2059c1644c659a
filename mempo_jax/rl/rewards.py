"""Outcome reward R_T: exact match / token F1 of the final ``<answer>`` (docs/algorithm.md §3).

Host-side, pure Python (strings in, floats out). Formulas follow the official SQuAD v2.0
evaluation script (``normalize_answer``, ``compute_exact``, ``compute_f1``) as used by FlashRAG's
``ExactMatch`` / ``F1_Score`` metrics (``flashrag/evaluator/metrics.py``), including FlashRAG's
yes/no/noanswer rule in F1: max over gold aliases.

Conventions worth knowing:

* Only ASCII punctuation (``string.punctuation``) is dropped. Unicode punctuation such as the
  right single quote ``’`` or the em dash ``—`` is *kept*, exactly as the SQuAD script does, so
  ``"Dvořák’s"`` normalises to ``"dvořák’s"`` while ``"Dvořák's"`` normalises to ``"dvořáks"``.
* A gold that normalises to the empty string (``"The"``, ``"The The"``) is matched by any
  prediction that also normalises to ``""`` (``"the"``, ``"a"``, ``"."``): EM 1.0, F1 1.0; any
  other prediction scores 0.0 on both (SQuAD v2 convention for empty answers).
* ``outcome_reward`` scores ``None`` or a blank (whitespace-only) prediction as 0 — "no answer".
"""

from __future__ import annotations

import collections
import re
import string
from typing import Callable, Sequence

import numpy as np
from jaxtyping import Float

from mempo_jax.core.registry import Registry

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)

MetricFn = Callable[[str, Sequence[str]], float]
_METRICS: Registry[MetricFn] = Registry("metric")
register_metric = _METRICS.register  # fn(prediction, golds) -> float, for outcome_reward
get_metric = _METRICS.get  # the metric registered under a name ("em", "f1", ...); ValueError if unknown


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop ASCII punctuation, drop articles, collapse whitespace.

    Order as in the SQuAD v2.0 eval script: ``lower`` → remove ``string.punctuation`` characters →
    replace whole-word ``a``/``an``/``the`` by a space → ``" ".join(s.split())``. Unicode
    punctuation (``’``, ``—``, ``«``) is kept.

    Args:
      s: any text.

    Returns:
      The normalised text (possibly ``""``).
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _exact_one(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


# FlashRAG ``F1_Score.token_level_scores``: when either normalised side is one of these and the two
# differ, the pair scores 0 (a "no, it is not" does not half-match a "no").
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})


def _f1_one(prediction: str, gold: str) -> float:
    pred_norm, gold_norm = normalize_answer(prediction), normalize_answer(gold)
    if (pred_norm in _CLOSED_ANSWERS or gold_norm in _CLOSED_ANSWERS) and pred_norm != gold_norm:
        return 0.0
    pred_toks = pred_norm.split()
    gold_toks = gold_norm.split()
    if not pred_toks or not gold_toks:  # SQuAD v2: 1 iff both empty
        return float(pred_toks == gold_toks)
    num_same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2.0 * precision * recall / (precision + recall)


@register_metric("em")
def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """Exact match after ``normalize_answer``, max over gold aliases (SQuAD ``compute_exact``).

    Args:
      prediction: predicted answer text.
      golds: gold aliases; an empty list scores 0.0.

    Returns:
      1.0 or 0.0.
    """
    return max((_exact_one(prediction, g) for g in golds), default=0.0)


@register_metric("f1")
def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Counter-based token F1, max over gold aliases (SQuAD v2 ``compute_f1``, FlashRAG ``F1_Score``).

    Tokens are ``normalize_answer(x).split()``; overlap counts repeated tokens at most
    ``min(count_pred, count_gold)`` times (multiset intersection). F1 = 2PR / (P + R) with
    P = overlap / len(pred), R = overlap / len(gold). When either side normalises to no tokens the
    score is 1.0 iff both do (SQuAD v2 convention; FlashRAG scores that pair 0). FlashRAG's
    closed-answer rule is applied per alias: when the normalised prediction or the normalised
    alias is ``"yes"``, ``"no"`` or ``"noanswer"`` and the two differ, that alias scores 0
    (``f1("no, it is not", ["no"]) == 0``, ``f1("yes", ["yes sir"]) == 0``; HotpotQA has many
    yes/no golds). ``"Yes."`` against ``"yes"`` normalises equal and scores 1.

    Args:
      prediction: predicted answer text.
      golds: gold aliases; an empty list scores 0.0.

    Returns:
      A float in [0, 1].
    """
    return max((_f1_one(prediction, g) for g in golds), default=0.0)


def split_objectives(answer: str) -> list[str]:
    """Split a multi-objective answer on ``';'`` and strip each part (docs/algorithm.md §1).

    Empty parts are kept so that positions stay aligned with objectives:
    ``"a;; b"`` → ``["a", "", "b"]``.
    """
    return [part.strip() for part in answer.split(";")]


def outcome_reward(
    prediction: str | None,
    golds: Sequence[Sequence[str]],
    metric: str = "em",
) -> float:
    """Outcome reward R_T of one trajectory (docs/algorithm.md §3).

    Single objective (``len(golds) == 1``): the whole prediction is scored against the aliases
    (not split on ``';'``). Multi-objective (``len(golds) > 1``): the prediction is split with
    ``split_objectives``; part ``i`` is scored against objective ``i``'s aliases, missing or blank
    parts score 0, extra parts are ignored; the reward is the mean over objectives.

    Args:
      prediction: the text inside ``<answer>``; ``None`` when no (valid) answer was given.
      golds: one list of gold aliases per objective, e.g. ``[["Paris"], ["Berlin", "Berlin, DE"]]``.
      metric: a registered metric name, ``"em"`` (default) or ``"f1"``.

    Returns:
      A float in [0, 1]; 0.0 for ``None`` or a blank prediction.

    Raises:
      ValueError: for an unknown ``metric`` (the message names it) or an empty ``golds``.
    """
    score = get_metric(metric)
    if len(golds) == 0:
        raise ValueError("golds must hold at least one objective (a list of aliases)")
    if isinstance(golds[0], str):
        raise ValueError("golds must be a list of alias lists, e.g. [['Paris']], not a list of str")
    if prediction is None or not prediction.strip():
        return 0.0
    if len(golds) == 1:
        return float(score(prediction, golds[0]))
    parts = split_objectives(prediction)
    total = 0.0
    for i, aliases in enumerate(golds):
        if i < len(parts) and parts[i]:
            total += score(parts[i], aliases)
    return total / len(golds)


def score_trajectories(trajs: Sequence, metric: str, dtype=np.float32) -> Float[np.ndarray, "trajectories"]:
    """``outcome_reward`` of each trajectory's answer against its golds: ``[trajectories]`` in
    [0, 1], 0 where no answer was given (docs/algorithm.md §3).

    Args:
      trajs: items with ``answer`` (str or None) and ``golds`` (e.g. ``agent.trajectory.Trajectory``).
      metric: ``"em"`` or ``"f1"`` (as ``outcome_reward``).
      dtype: the result's dtype (float32 for the RL step's rewards; float64 where per-question
        scores are stored, e.g. the evaluation).

    Raises:
      ValueError: as ``outcome_reward``.
    """
    return np.asarray([outcome_reward(t.answer, t.golds, metric) for t in trajs], dtype)
