"""Per-kind evaluation metrics (``eval/<kind>/em``): golden values, the kind of a question, the
printed table, and the QA file's own ``type`` field."""

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.data.qa_formats import QAExample
from mempo_jax.data.world import Question
from mempo_jax.run.evaluation import is_kind_metric, kind_metrics, question_kind
from mempo_jax.run.metrics import format_eval_table


def _q(kind, qa_type=""):
    return Question("x", kind, "q?", (("a",),), (), qa_type)


def test_kind_metrics_golden():
    qs = [_q("single"), _q("bridge"), _q("single"), _q("multi"), _q("bridge")]
    em = [1.0, 0.0, 0.0, 0.5, 1.0]
    f1 = [1.0, 0.5, 0.2, 0.5, 1.0]
    got = kind_metrics(qs, em, f1)
    assert list(got) == ["eval/bridge/em", "eval/bridge/f1", "eval/bridge/n", "eval/multi/em", "eval/multi/f1",
                         "eval/multi/n", "eval/single/em", "eval/single/f1", "eval/single/n"]
    assert got["eval/bridge/em"] == 0.5 and got["eval/bridge/f1"] == 0.75 and got["eval/bridge/n"] == 2.0
    assert got["eval/multi/em"] == 0.5 and got["eval/multi/n"] == 1.0
    assert got["eval/single/em"] == 0.5 and got["eval/single/f1"] == pytest.approx(0.6)
    assert all(is_kind_metric(k) for k in got) and not is_kind_metric("em")


def test_kind_metrics_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="3 questions but 2 EM"):
        kind_metrics([_q("a")] * 3, [0.0, 1.0], [0.0, 1.0, 1.0])


def test_question_kind_prefers_the_files_type_then_kind_then_all():
    assert question_kind(_q("hotpotqa", "comparison")) == "comparison"
    assert question_kind(_q("bridge")) == "bridge"
    assert question_kind(QAExample("1", "q?", (("a",),), "nq")) == "all"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["single", "bridge", "multi"]), st.floats(0, 1)), min_size=1, max_size=30))
def test_kind_means_weighted_by_counts_give_the_overall_mean(rows):
    qs = [_q(k) for k, _ in rows]
    em = np.array([v for _, v in rows])
    got = kind_metrics(qs, em, em)
    kinds = {k for k, _ in rows}
    assert sum(got[f"eval/{k}/n"] for k in kinds) == len(rows)
    assert sum(got[f"eval/{k}/em"] * got[f"eval/{k}/n"] for k in kinds) == pytest.approx(em.sum())


def test_table_has_a_column_per_kind():
    m = {"em": 0.25, "f1": 0.3, "tt": 300.4, "pt": 80.0, "turns": 4.0, "format_fail": 0.5}
    evals = {"sft": {"k1": {**m, "eval/bridge/em": 0.0, "eval/bridge/n": 2.0, "eval/single/em": 0.5,
                            "eval/single/n": 2.0}},
             "rl": {"full": dict(m), "k1": {**m, "em": 0.5, "f1": 0.5}}}  # read back from JSON: sorted keys
    assert format_eval_table(evals).splitlines() == [
        "| stage | mode | EM | F1 | TT | PT | turns | format fail | EM bridge (2) | EM single (2) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        "| sft | k1 | 0.250 | 0.300 | 300 | 80 | 4.00 | 0.500 | 0.000 | 0.500 |",
        "| rl | k1 | 0.500 | 0.500 | 300 | 80 | 4.00 | 0.500 | - | - |",
        "| rl | full | 0.250 | 0.300 | 300 | 80 | 4.00 | 0.500 | - | - |",
    ]


def test_hotpotqa_questions_carry_the_files_type(shared_data):
    from mempo_jax.data.qa_questions import load_qa_questions

    path = shared_data / "hotpotqa" / "hotpotqa_dev_distractor_300.rpt.jsonl"
    expected = collections.Counter(json.loads(line)["type"] for line in path.read_text().splitlines() if line.strip())
    qs = load_qa_questions(path)
    assert collections.Counter(question_kind(q) for q in qs) == expected and len(expected) == 2
    assert all(q.kind == "hotpotqa" for q in qs)  # the format stays the kind the scripted agent sees


def test_kind_counts_come_from_the_rows_that_have_the_kind():
    from mempo_jax.run.metrics import kind_columns

    # a row without kinds first (a dataset without types), then two rows that agree on n
    rows = [{"em": 1.0}, {"eval/bridge/em": 0.5, "eval/bridge/n": 2.0}, {"eval/bridge/em": 0.0, "eval/bridge/n": 2.0}]
    assert kind_columns(rows) == (["bridge"], " EM bridge (2) |", "---|")
    # rows that disagree on n: no count in the header
    rows.append({"eval/bridge/em": 1.0, "eval/bridge/n": 5.0})
    assert kind_columns(rows)[1] == " EM bridge |"


def test_modes_sort_by_k_then_full():
    m = {"em": 0.0, "f1": 0.0, "tt": 1.0, "pt": 1.0, "turns": 1.0, "format_fail": 0.0}
    table = format_eval_table({"rl": {"full": m, "k10": m, "k2": m}})
    assert [line.split("|")[2].strip() for line in table.splitlines()[2:]] == ["k2", "k10", "full"]
