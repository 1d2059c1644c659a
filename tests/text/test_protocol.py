"""Tag protocol and turn parser (docs/algorithm.md §1): never raises, error iff invalid, round trip."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.text import protocol as P
from mempo_jax.text.protocol import (
    ALL_TAG_PIECES,
    STOP_TAGS,
    ParsedTurn,
    format_error_observation,
    parse_turn,
    render_turn,
)

# ---------------------------------------------------------------------------------------------
# An independent oracle for validity: one regular expression written from the spec's wording.
_ANY_TAG = "|".join(re.escape(p) for p in ALL_TAG_PIECES)
_C = rf"((?:(?!{_ANY_TAG}).)*)"  # content: any text that contains no tag piece
_ORACLE = re.compile(
    rf"\s*<mem>{_C}</mem>\s*(?:<think>{_C}</think>\s*)?<(search|access|answer)>{_C}</\3>\s*",
    re.DOTALL,
)


def oracle(text: str) -> tuple[str, str | None, str, str] | None:
    """(mem, think, action, argument) if ``text`` is a valid turn, else None."""
    m = _ORACLE.fullmatch(text)
    if m is None or not m.group(4).strip():
        return None
    return m.group(1), m.group(2), m.group(3), m.group(4)


# ---------------------------------------------------------------------------------------------
def test_constants():
    assert P.MEM == ("<mem>", "</mem>")
    assert P.INFORMATION == ("<information>", "</information>")
    assert len(ALL_TAG_PIECES) == 12 and len(set(ALL_TAG_PIECES)) == 12
    assert STOP_TAGS == ("</search>", "</access>", "</answer>")
    for pair in (P.MEM, P.THINK, P.SEARCH, P.ACCESS, P.ANSWER, P.INFORMATION):
        assert pair[0] in ALL_TAG_PIECES and pair[1] in ALL_TAG_PIECES


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<mem>m</mem><think>t</think><search>q</search>", ("m", "t", "search", "q")),
        ("  <mem>m</mem>\n<answer>Paris</answer>\n\n", ("m", None, "answer", "Paris")),
        ("<mem></mem><access> 17 </access>", ("", None, "access", " 17 ")),
        ("<mem>a < b > c</mem><answer>x</answer>", ("a < b > c", None, "answer", "x")),
        # multi-objective answer is kept intact (docs/algorithm.md §1, ';' separated)
        ("<mem>m</mem><answer>a; b; c</answer>", ("m", None, "answer", "a; b; c")),
    ],
)
def test_valid_turns(text, expected):
    got = parse_turn(text)
    assert got.error is None and got.valid
    assert (got.mem, got.think, got.action, got.argument) == expected


@pytest.mark.parametrize(
    "text, fragment, extracted",
    [
        # missing <mem>; action still extracted (unambiguous)
        ("<think>t</think><search>q</search>", "missing <mem>", (None, "t", "search", "q")),
        ("<search>q</search>", "missing <mem>", (None, None, "search", "q")),
        # unclosed tags
        ("<mem>m<search>q</search>", "<mem> is not closed", ("m", None, "search", "q")),
        ("<mem>m</mem><answer>Paris", "<answer> is not closed", ("m", None, "answer", "Paris")),
        ("<mem>m</mem><think>t<answer>x</answer>", "<think> is not closed", ("m", "t", "answer", "x")),
        # nested tags
        (
            "<mem>a<think>b</think>c</mem><search>q</search>",
            "nested <think> inside <mem>",
            ("a<think>b</think>c", None, "search", "q"),
        ),
        (
            "<mem>m</mem><answer>x<search>y</search></answer>",
            "nested <search> inside <answer>",
            ("m", None, "answer", "x<search>y</search>"),
        ),
        # two actions: ambiguous, neither is extracted
        ("<mem>m</mem><search>q</search><answer>a</answer>", "more than one action", ("m", None, None, None)),
        ("<mem>m</mem><answer>a</answer><answer>b</answer>", "more than one action", ("m", None, None, None)),
        # no action
        ("<mem>m</mem><think>t</think>", "no action", ("m", "t", None, None)),
        ("", "missing <mem>", (None, None, None, None)),
        # empty argument
        ("<mem>m</mem><answer></answer>", "empty <answer>", ("m", None, "answer", "")),
        ("<mem>m</mem><search> \n</search>", "empty <search>", ("m", None, "search", " \n")),
        # text outside blocks
        ("Sure! <mem>m</mem><answer>x</answer>", "text outside blocks before", ("m", None, "answer", "x")),
        ("<mem>m</mem> so <answer>x</answer>", "text outside blocks between", ("m", None, "answer", "x")),
        ("<mem>m</mem><answer>x</answer> done", "text outside blocks after", ("m", None, "answer", "x")),
        # order and duplicates
        ("<think>t</think><mem>m</mem><answer>x</answer>", "<mem> must come first", ("m", "t", "answer", "x")),
        ("<mem>m</mem><answer>x</answer><think>t</think>", "<think> after the action", ("m", "t", "answer", "x")),
        ("<mem>a</mem><mem>b</mem><answer>x</answer>", "more than one <mem>", (None, None, "answer", "x")),
        ("<mem>m</mem><information>r</information><answer>x</answer>", "<information>", ("m", None, "answer", "x")),
        ("<mem>m</mem></think><answer>x</answer>", "</think> without opening <think>", ("m", None, "answer", "x")),
    ],
)
def test_invalid_turns(text, fragment, extracted):
    got = parse_turn(text)
    assert got.error is not None and not got.valid
    assert fragment in got.error, got.error
    assert (got.mem, got.think, got.action, got.argument) == extracted
    assert oracle(text) is None


def test_non_string_input_does_not_raise():
    for bad in (None, 17, b"<mem>m</mem>", ["<mem>"]):
        got = parse_turn(bad)  # type: ignore[arg-type]
        assert got.error and got.action is None


def test_error_lists_at_most_three_problems():
    got = parse_turn("x </mem> y </think> z </search> w </answer>")
    assert got.error is not None and got.error.count(";") == 2


def test_format_error_observation():
    obs = format_error_observation("missing <mem>")
    assert obs.startswith("Format error: missing <mem>.")
    for piece in ("<mem>", "</mem>", "<think>", "<search>", "<access>", "<answer>"):
        assert piece in obs
    assert "\n" not in obs
    # the environment wraps it in <information>; the body must not close that wrapper early
    assert "</information>" not in format_error_observation("bad </information> here")


def test_render_turn_canonical_text():
    assert render_turn("m", "t", "search", "q") == "<mem>m</mem><think>t</think><search>q</search>"
    assert render_turn(" m ", None, "answer", "a; b") == "<mem> m </mem><answer>a; b</answer>"


@pytest.mark.parametrize(
    "args",
    [
        ("m", None, "shout", "q"),  # unknown action
        ("m", None, "answer", "  "),  # blank argument
        ("m<think>", None, "answer", "x"),  # tag piece inside a field
        ("m", "t</think>", "answer", "x"),
        ("m", None, "search", "q</search>"),
    ],
)
def test_render_turn_rejects_unparseable_fields(args):
    with pytest.raises(ValueError):
        render_turn(*args)


# ---------------------------------------------------------------------------------------------
# Property tests: random strings, random concatenations of tag pieces and text.
_TEXTS = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", " ", "\n", "q", "a; b", "<", ">", "</", "<mem", "mem>", "</answer", "\t x "]
)
_PIECES = st.lists(st.sampled_from(ALL_TAG_PIECES) | _TEXTS, max_size=14).map("".join)


def _well_formed() -> st.SearchStrategy[str]:
    """Mostly-valid turns with random whitespace, so the valid branch is exercised too."""
    ws = st.sampled_from(["", " ", "\n", "\t \n"])
    body = st.text(max_size=8).filter(lambda s: not re.search(_ANY_TAG, s))
    return st.tuples(
        ws, body, ws, st.none() | body, ws, st.sampled_from(["search", "access", "answer"]), body, ws
    ).map(
        lambda t: t[0]
        + f"<mem>{t[1]}</mem>"
        + t[2]
        + ("" if t[3] is None else f"<think>{t[3]}</think>")
        + t[4]
        + f"<{t[5]}>{t[6]}</{t[5]}>"
        + t[7]
    )


@settings(max_examples=600, deadline=None)
@given(st.text(max_size=60) | _PIECES | _well_formed())
def test_property_never_raises_and_error_iff_invalid(text):
    got = parse_turn(text)
    assert isinstance(got, ParsedTurn)
    expected = oracle(text)
    if expected is None:
        assert got.error, f"accepted an invalid turn: {text!r}"
        assert isinstance(got.error, str)
    else:
        assert got.error is None, f"rejected a valid turn {text!r}: {got.error}"
        assert (got.mem, got.think, got.action, got.argument) == expected


_FIELD = st.text(max_size=20).filter(lambda s: not re.search(_ANY_TAG, s))


@settings(max_examples=300, deadline=None)
@given(
    _FIELD,
    st.none() | _FIELD,
    st.sampled_from(["search", "access", "answer"]),
    _FIELD.filter(lambda s: s.strip() != ""),
)
def test_property_render_round_trip(mem, think, action, argument):
    text = render_turn(mem, think, action, argument)
    assert parse_turn(text) == ParsedTurn(mem, think, action, argument, None)
    # generation stops at the closing action tag, which render_turn emits last
    assert text.endswith(f"</{action}>") and f"</{action}>" in STOP_TAGS


def _megabyte_turns():
    n = 50_000
    distinct = "<mem>m</mem>" + "".join(f"w{i}<think>x</think>" for i in range(n))  # ~10⁵ distinct errors
    nested = "<mem>" + "<think>" * (n // 2) + "</search>" * (n // 2) + "</mem><answer>a</answer>"
    return {"distinct": distinct[:1_000_000], "nested": nested + " " * (1_000_000 - len(nested))}


@pytest.mark.parametrize("kind", ["distinct", "nested"])
def test_megabyte_malformed_turn_parses_in_linear_time(kind):
    import time

    text = _megabyte_turns()[kind]
    assert len(text) == 1_000_000
    t0 = time.perf_counter()
    parsed = parse_turn(text)
    seconds = time.perf_counter() - t0
    # 0.2-0.3 s measured after the fix on a busy 2-core box; before, the de-duplication (and the
    # nested-tag list) were quadratic: ~12 s (distinct) and ~40 s (nested) for this megabyte
    assert seconds < 5.0, seconds
    assert parsed.error is not None and parsed.error.count("; ") <= 2  # still at most three problems
    if kind == "distinct":
        assert parsed.error.startswith("text outside blocks between tags: 'w0'; text outside blocks between tags: 'w1'")
    else:
        assert parsed.error == "nested <think> inside <mem>; stray </search> inside <mem>"
