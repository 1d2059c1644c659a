"""Golden tests for mempo_jax.rl.rewards (docs/algorithm.md §3, SQuAD v2 eval conventions)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.rl.rewards import (
    exact_match,
    f1_score,
    get_metric,
    normalize_answer,
    outcome_reward,
    register_metric,
    split_objectives,
)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple a DAY ", "apple day"),
        ("Theater", "theater"),  # article only as a whole word
        ("Annan", "annan"),
        ("A-ha", "aha"),  # punctuation is dropped before articles are looked for
        ("the-the", "thethe"),
        ("The", ""),
        ("The The", ""),
        ("U.S.A.", "usa"),
        ("tab\tand\nnewline", "tab and newline"),
    ],
)
def test_normalize_answer_golden(raw, expected):
    assert normalize_answer(raw) == expected


def test_unicode_punctuation_is_kept():
    # ’ (U+2019), — (U+2014) and « » are not in string.punctuation: SQuAD keeps them.
    assert normalize_answer("Dvořák’s — Symphony") == "dvořák’s — symphony"
    assert normalize_answer("Dvořák's") == "dvořáks"
    assert exact_match("Dvořák’s", ["Dvořák's"]) == 0.0
    assert exact_match("«Paris»", ["Paris"]) == 0.0
    assert f1_score("«Paris»", ["Paris"]) == 0.0
    assert exact_match("\"Paris\"", ["Paris"]) == 1.0  # ASCII quotes are dropped


def test_gold_that_normalises_to_empty():
    assert normalize_answer("The") == ""
    # Any prediction that also normalises to "" matches (SQuAD v2), anything else does not.
    assert exact_match("the", ["The"]) == 1.0
    assert exact_match("a", ["The"]) == 1.0
    assert f1_score(".", ["The"]) == 1.0
    assert exact_match("The Beatles", ["The"]) == 0.0
    assert f1_score("The Beatles", ["The"]) == 0.0
    # ...and the reverse: an empty-normalised prediction against a real gold.
    assert f1_score("the", ["Beatles"]) == 0.0
    assert outcome_reward("a", [["The"]]) == 1.0
    assert outcome_reward("Beatles", [["The"]], metric="f1") == 0.0


def test_empty_and_missing_predictions_score_zero():
    for metric in ("em", "f1"):
        assert outcome_reward(None, [["Paris"]], metric) == 0.0
        assert outcome_reward("", [["Paris"]], metric) == 0.0
        assert outcome_reward("   ", [["Paris"]], metric) == 0.0
        assert outcome_reward(None, [["The"]], metric) == 0.0  # even for an empty-normalising gold
    assert exact_match("Paris", []) == 0.0
    assert f1_score("Paris", []) == 0.0


def test_several_aliases_take_the_max():
    golds = ["United States of America", "USA", "U.S."]
    assert exact_match("usa", golds) == 1.0
    assert exact_match("U.S", golds) == 1.0  # "us" == normalise("U.S.")
    assert exact_match("America", golds) == 0.0
    # F1 against each alias: "united states" vs "united states of america" → P=1, R=1/2 → 2/3;
    # vs "usa" → 0; vs "us" → 0.  Max = 2/3.
    assert f1_score("United States", golds) == pytest.approx(2 / 3)
    assert outcome_reward("United States", [golds], metric="f1") == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        # pred toks [cat,cat,cat] (3) ∩ gold [cat] (1): overlap 1 → P=1/3, R=1 → F1 = 1/2.
        ("cat cat cat", "cat", 0.5),
        # [cat,cat,cat,sat] ∩ [cat,sat,on,mat]: cat×1 + sat×1 = 2 → P=R=1/2 → 1/2.
        ("The cat cat cat sat", "cat sat on the mat", 0.5),
        # [new,york,new,york] ∩ [new,york,city]: 2 → P=1/2, R=2/3 → F1 = 4/7.
        ("New York, New York", "New York City", 4 / 7),
        # [cat,cat] ∩ [cat,cat,dog]: 2 → P=1, R=2/3 → 4/5.
        ("cat cat", "cat cat dog", 0.8),
        ("dog", "cat", 0.0),
        ("Cat!", "the cat", 1.0),
    ],
)
def test_counter_f1_repeated_tokens(pred, gold, expected):
    assert f1_score(pred, [gold]) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pred, golds, expected", [
    ("no, it is not", ["no"], 0.0),  # token F1 would be 0.4 (P 1/4, R 1)
    ("noanswer found", ["noanswer"], 0.0),  # token F1 would be 2/3
    ("yes", ["yes sir"], 0.0),  # a closed prediction against an open gold: 2/3 without the rule
    ("yes", ["no"], 0.0),
    ("Yes.", ["yes"], 1.0),  # equal after normalisation: the rule does not apply
    ("NO!", ["no"], 1.0),
    ("yes and no", ["yes and no"], 1.0),  # neither side is exactly a closed answer
    ("yes and no", ["yes"], 0.0),
    ("no, it is not", ["no", "it is not"], 6 / 7),  # per alias: the open alias keeps its F1
])
def test_f1_closed_answer_rule_follows_flashrag(pred, golds, expected):
    assert f1_score(pred, golds) == pytest.approx(expected, abs=1e-12)


def test_closed_answer_rule_per_objective_and_not_in_em():
    assert outcome_reward("no, it is not; Paris", [["no"], ["Paris"]], metric="f1") == pytest.approx(0.5)
    assert exact_match("no, it is not", ["no"]) == 0.0 and exact_match("No.", ["no"]) == 1.0


def test_split_objectives():
    assert split_objectives(" Paris ;Berlin; Rome ") == ["Paris", "Berlin", "Rome"]
    assert split_objectives("a;; b") == ["a", "", "b"]
    assert split_objectives("only") == ["only"]


def test_multi_objective_partial_credit():
    golds = [["Paris"], ["Berlin", "Berlin, Germany"], ["Rome"]]
    assert outcome_reward("Paris; Berlin; Rome", golds) == 1.0
    assert outcome_reward("Paris; Munich; Rome", golds) == pytest.approx(2 / 3)
    assert outcome_reward("Paris", golds) == pytest.approx(1 / 3)  # missing parts score 0
    assert outcome_reward("Paris;; Rome", golds) == pytest.approx(2 / 3)
    assert outcome_reward("Paris; berlin germany; Rome; Madrid", golds) == 1.0  # extra ignored
    assert outcome_reward("Rome; Paris; Berlin", golds) == 0.0  # order matters
    # F1: part 0 "new york" vs "new york city" → P=1, R=2/3 → 0.8; part 1 exact → 1.0; mean 0.9.
    golds_f1 = [["New York City"], ["Los Angeles"]]
    assert outcome_reward("New York; Los Angeles", golds_f1, metric="f1") == pytest.approx(0.9)
    assert outcome_reward("New York; Los Angeles", golds_f1, metric="em") == pytest.approx(0.5)


def test_single_objective_is_not_split():
    # One objective: the whole text is the answer. F1("paris france", "paris") = 2/3, not 1.
    assert outcome_reward("Paris; France", [["Paris"]], metric="f1") == pytest.approx(2 / 3)
    assert outcome_reward("Paris; France", [["Paris"]], metric="em") == 0.0


def test_unknown_metric_and_bad_golds():
    with pytest.raises(ValueError, match="'bleu'"):
        outcome_reward("Paris", [["Paris"]], metric="bleu")
    with pytest.raises(ValueError, match="'rouge'"):
        get_metric("rouge")
    with pytest.raises(ValueError):
        outcome_reward("Paris", [])
    with pytest.raises(ValueError):
        outcome_reward("Paris", ["Paris"])  # a flat list of str is a caller bug
    with pytest.raises(ValueError):
        register_metric("em")(lambda p, g: 0.0)


_words = st.lists(st.sampled_from(["cat", "dog", "the", "a", "new", "york", "Cat,", "DOG!"]), max_size=6)


@settings(max_examples=200, deadline=None)
@given(_words, _words)
def test_f1_properties(pred_words, gold_words):
    pred, gold = " ".join(pred_words), " ".join(gold_words)
    f1 = f1_score(pred, [gold])
    assert 0.0 <= f1 <= 1.0
    assert f1 == pytest.approx(f1_score(gold, [pred]))  # symmetric
    em = exact_match(pred, [gold])
    if em == 1.0:
        assert f1 == 1.0
    if f1 == 1.0:  # F1 1 ⇔ same multiset of tokens
        assert sorted(normalize_answer(pred).split()) == sorted(normalize_answer(gold).split())
    assert normalize_answer(normalize_answer(pred)) == normalize_answer(pred)  # idempotent
