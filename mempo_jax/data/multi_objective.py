"""Multi-objective QA: k questions joined into one prompt, one objective per sub-question.

docs/algorithm.md §1: multi-objective questions (MEM1 and MemPO evaluate 2–10 sub-questions;
``benchmarks/objectives_sweep.py`` sweeps 1–8) put all answers into one ``<answer>``, separated
by ``;``; the outcome reward is the mean over objectives (§3). The prompt numbers the sub-questions so that answer i belongs to
question i::

    Question 1: Who wrote Hamlet?
    Question 2: What is the capital of France?
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mempo_jax.data.qa_formats import QAExample


def compose_question(questions: Sequence[str]) -> str:
    """``"Question 1: q1\\nQuestion 2: q2…"`` — the numbered prompt of a composite question."""
    return "\n".join(f"Question {i}: {' '.join(q.split())}" for i, q in enumerate(questions, 1))


def join(parts: Sequence[QAExample], k: int | None = None) -> QAExample:
    """One composite QAExample from ``parts`` (in order).

    id: the part ids joined by ``"+"``; golds: the parts' objectives concatenated; source:
    ``"{source}:mo{k}"`` with the common source of the parts, or ``"mixed:mo{k}"``.

    Raises:
      ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("join needs at least one example")
    k = len(parts) if k is None else k
    sources = {p.source for p in parts}
    source = sources.pop() if len(sources) == 1 else "mixed"
    return QAExample(
        id="+".join(p.id for p in parts),
        question=compose_question([p.question for p in parts]),
        golds=tuple(g for p in parts for g in p.golds),
        source=f"{source}:mo{k}",
    )


def compose(examples: Sequence[QAExample], k: int, seed: int, num: int | None = None) -> list[QAExample]:
    """Seeded multi-objective composites of ``k`` distinct questions each.

    Args:
      examples: the pool of (single-objective) questions; ids should be unique.
      k: sub-questions per composite, ``1 <= k <= len(examples)``.
      seed: numpy ``default_rng`` seed; the same inputs and seed give the same output.
      num: composites to make. None (default): ``len(examples) // k`` composites from one
        permutation, so every question is used at most once (the remainder is dropped).
        An int: ``num`` composites, each drawing ``k`` distinct questions independently
        (questions may recur across composites).

    Returns:
      ``num`` QAExamples; ``golds`` has one alias tuple per sub-question, in prompt order.

    Raises:
      ValueError: ``k`` out of range or ``num < 0``.
    """
    examples = list(examples)
    if not isinstance(k, int) or not 1 <= k <= len(examples):
        raise ValueError(f"k must be an int in [1, {len(examples)}] (the number of examples), got {k!r}")
    rng = np.random.default_rng(seed)
    if num is None:
        order = rng.permutation(len(examples))
        return [join([examples[i] for i in order[s : s + k]], k) for s in range(0, len(examples) - k + 1, k)]
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    return [join([examples[i] for i in rng.choice(len(examples), size=k, replace=False)], k) for _ in range(num)]
