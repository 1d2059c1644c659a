"""QA files as the trainer's questions: ``world.Question`` records with a scripted cold-start plan.

Any file ``qa_formats`` reads (FlashRAG / Search-R1 JSONL or parquet, question–answer JSONL,
CSV, HotpotQA, 2WikiMultihopQA, MuSiQue) becomes a list of ``Question(id, kind, question, golds,
hops)``: ``kind`` is the file's format, ``golds`` the example's aliases per objective, ``hops`` the
plan of the scripted agent (``data.scripted_agent``) for the SFT cold start:

* HotpotQA / 2WikiMultihopQA: one search per supporting-fact title (``supporting_facts``, HF
  layout ``{"title": [...], "sent_id": [...]}`` or official ``[[title, sentence_id], ...]``) in
  order; each hop's fact, kept in ``<mem>``, is that title's supporting sentences from the row's
  ``context`` (joined by a space; ``"read {title}"`` when the context lacks them), so the bridge
  fact of hop 1 is still in memory when the answer is given; the last hop also reads the answer
  (``"(1) answer"``).
* MuSiQue: one search per ``question_decomposition`` step for the title of its supporting
  paragraph (``paragraph_support_idx``), keeping the step's answer (the bridge fact); the last
  step's fact is ``"(1) answer"``. Without a decomposition, the ``is_supporting`` paragraphs.
* every other format (no supporting facts): one search for the question text, then the answer
  of each objective (``"(i) alias"``).

``split_questions`` holds out a seeded share of one file, or drops from the training file the
questions of a held-out file (no overlap by normalised question text).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from mempo_jax.data.qa_formats import detect_format, hotpotqa_supporting_titles, iter_dataset_rows
from mempo_jax.data.world import Question
from mempo_jax.tools.records import field_error


def _supporting_facts(row: dict[str, Any], path, where: str) -> list[tuple[str, Any]]:
    """``[(title, sentence id or None), …]`` of a HotpotQA / 2Wiki row, in file order; the field is
    validated by ``qa_formats.hotpotqa_supporting_titles`` (one error naming file, line, field)."""
    hotpotqa_supporting_titles(row, path, where)
    facts = row["supporting_facts"]
    if isinstance(facts, dict):
        titles, sent_ids = facts["title"], facts.get("sent_id")
        if not isinstance(sent_ids, list) or len(sent_ids) != len(titles):
            sent_ids = [None] * len(titles)
        return list(zip(titles, sent_ids))
    return [(f[0], f[1] if len(f) > 1 else None) for f in facts]


def _context_sentences(row: dict[str, Any]) -> dict[str, list]:
    """title → sentences of a row's ``context`` (HF ``{"title", "sentences"}`` or official ``[[title, [s…]]]``)."""
    ctx = row.get("context")
    try:
        if isinstance(ctx, dict):
            return {t: list(s) for t, s in zip(ctx.get("title") or [], ctx.get("sentences") or [])}
        if isinstance(ctx, list):
            return {c[0]: list(c[1]) for c in ctx if isinstance(c, (list, tuple)) and len(c) == 2}
    except TypeError:
        pass
    return {}


def _hotpot_hops(row: dict[str, Any], path, where: str) -> list[tuple[str, tuple[str, ...]]]:
    facts = _supporting_facts(row, path, where)
    context = _context_sentences(row)
    wanted: dict[str, list[int]] = {}
    for title, i in facts:
        ids = wanted.setdefault(title, [])
        if isinstance(i, int) and not isinstance(i, bool):
            ids.append(i)
    hops = []
    for title, ids in wanted.items():
        sents = context.get(title) or []
        got = [" ".join(str(sents[i]).split()) for i in sorted(set(ids)) if 0 <= i < len(sents)]
        hops.append((title, (" ".join(g for g in got if g) or f"read {title}",)))
    return hops


def _musique_hops(row: dict[str, Any], path, where: str) -> list[tuple[str, tuple[str, ...]]]:
    paragraphs = row.get("paragraphs") or []
    by_idx = {p.get("idx", i): p for i, p in enumerate(paragraphs) if isinstance(p, dict)}
    hops = []
    steps = row.get("question_decomposition")
    if isinstance(steps, list) and steps:
        for i, step in enumerate(steps):
            para = by_idx.get(step.get("paragraph_support_idx")) if isinstance(step, dict) else None
            if para is None or not isinstance(para.get("title"), str):
                raise field_error(path, where, f"question_decomposition[{i}].paragraph_support_idx",
                                  "names no paragraph with a title")
            answer = step.get("answer")
            hops.append((" ".join(para["title"].split()), (str(answer),) if answer else ()))
    else:
        hops = [(" ".join(p["title"].split()), (f"read {p['title']}",)) for p in paragraphs
                if isinstance(p, dict) and p.get("is_supporting") and isinstance(p.get("title"), str)]
    return hops


def _plan(fmt: str, row: dict[str, Any], path, where: str, question: str, golds) -> tuple:
    if fmt in ("hotpotqa", "2wikimultihopqa"):
        hops = _hotpot_hops(row, path, where)
    elif fmt == "musique":
        hops = _musique_hops(row, path, where)
    else:
        hops = []
    answers = tuple(f"({i + 1}) {g[0]}" for i, g in enumerate(golds))
    if not hops:
        return ((question, answers),)
    last_query, last_facts = hops[-1]
    if fmt == "musique":  # the last step's own answer is the final one
        last_facts = ()
    hops[-1] = (last_query, tuple(last_facts) + answers)
    return tuple(hops)


def load_qa_questions(path: str | os.PathLike) -> list[Question]:
    """The questions of one QA file (format sniffed, see ``qa_formats``), with scripted plans.

    Returns:
      ``Question`` list in file order; ids are the file's (unique, ``qa_formats.load_dataset``).

    Raises:
      ValueError: a malformed or empty file, a duplicate id, or a row whose supporting facts are
        malformed (naming the file, line and field).
    """
    fmt = detect_format(path)
    out, seen = [], set()
    for where, row, ex in iter_dataset_rows(path, fmt):
        if ex.id in seen:
            raise ValueError(f"{path}: duplicate example id {ex.id!r}")
        seen.add(ex.id)
        out.append(Question(ex.id, fmt, ex.question, ex.golds, _plan(fmt, row, path, where, ex.question, ex.golds)))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def split_questions(train: Sequence[Question], heldout: Sequence[Question] | None, seed: int,
                    heldout_fraction: float = 0.2) -> tuple[list[Question], list[Question], int]:
    """Training and held-out questions with no overlap.

    Args:
      train: the training file's questions.
      heldout: the held-out file's questions, or None: then ``max(1, int(heldout_fraction · n))``
        of ``train`` are held out, chosen by ``np.random.default_rng(seed).permutation`` (the
        order the HotpotQA ``data_path`` runs always used).
      seed: the split seed.
      heldout_fraction: share held out when ``heldout`` is None.

    Returns:
      ``(train, heldout, dropped)``: ``dropped`` counts training questions removed because the
      held-out file asks the same question (case and spacing ignored; ids are not compared, two
      files may number their rows alike).

    Raises:
      ValueError: fewer than 2 questions to split, or no training question left.
    """
    if heldout is None:
        if len(train) < 2:
            raise ValueError(f"{len(train)} question(s) cannot be split into training and held-out questions")
        order = np.random.default_rng(seed).permutation(len(train))
        n_held = max(1, int(heldout_fraction * len(train)))
        return [train[int(i)] for i in order[n_held:]], [train[int(i)] for i in order[:n_held]], 0
    texts = {_key(q.question) for q in heldout}
    kept = [q for q in train if _key(q.question) not in texts]
    if not kept:
        raise ValueError("every training question is also a held-out question")
    return kept, list(heldout), len(train) - len(kept)
