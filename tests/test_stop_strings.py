"""Stop strings over token ids (``mempo_jax.stop_strings``) and the sampler's device-side stop.

References are independent of the automaton: the brute-force "does the concatenated text of the
first n tokens contain a stop string" over every prefix. The tests on the real SmolLM2 tokenizer
(every tag several tokens) are in ``test_tags.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.agent.protocol import STOP_TAGS
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model
from mempo_jax.sampling import Sampler, SamplerConfig
from mempo_jax.stop_strings import StopAutomaton, byte_automaton, find_text_span


def _brute_first(chunks, strings, stop_ids=(), ids=None):
    """Smallest n with a stop string in ``b"".join(chunks[:n])`` or ``ids[n-1]`` in ``stop_ids``."""
    for n in range(1, len(chunks) + 1):
        if ids is not None and ids[n - 1] in stop_ids:
            return n
        text = b"".join(chunks[:n])
        if any(s in text for s in strings):
            return n
    return None


# ------------------------------------------------------------------------ the byte automaton


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="</searchnwr>x", max_size=40))
def test_byte_automaton_accepts_exactly_where_a_string_ends(text):
    strings = [b"</search>", b"</answer>", b"</access>", b"aa"]  # "aa": overlapping self-suffixes
    delta, accepts = byte_automaton(strings)
    data = text.encode()
    state = 0
    for k, b in enumerate(data, start=1):
        state = delta[state, b]
        assert bool(accepts[state]) == any(data[:k].endswith(s) for s in strings)


def test_byte_automaton_rejects_empty_strings():
    with pytest.raises(ValueError, match="non-empty"):
        byte_automaton([b"</a>", b""])
    with pytest.raises(ValueError, match="non-empty"):
        StopAutomaton.build([], [b"a"])


FRAGMENTS = [b"<", b"</", b"/", b"se", b"search", b"arch", b"h>", b">", b">\n", b"></", b"answer", b"x", b"",
             b"</search>", b"access>", b"\xe6\x9d"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(FRAGMENTS) - 1), max_size=14), st.sets(st.integers(0, len(FRAGMENTS) - 1),
                                                                          max_size=2))
def test_first_stop_equals_brute_force_over_token_bytes(ids, stop_ids):
    auto = StopAutomaton.build(STOP_TAGS, FRAGMENTS)
    assert auto.next_state.shape == auto.completes.shape == (auto.num_states, len(FRAGMENTS))
    want = _brute_first([FRAGMENTS[i] for i in ids], [t.encode() for t in STOP_TAGS], stop_ids, ids)
    assert auto.first_stop(ids, stop_ids) == want


def test_find_text_span_includes_straddling_tokens():
    vocab = [b"a <", b"mem", b">x", b"</", b"mem><", b"think", b">", b"<mem>", b"</mem>"]
    assert find_text_span(vocab, [0, 1, 2, 3, 4, 5, 6], "<mem>", "</mem>") == (0, 5)
    assert find_text_span(vocab, [5, 7, 8, 7, 8], "<mem>", "</mem>") == (1, 3)  # the first block
    assert find_text_span(vocab, [8, 7, 5], "<mem>", "</mem>") is None  # close before open, no close after
    assert find_text_span(vocab, [0, 1, 2], "<mem>", "</mem>") is None


VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny(VOCAB, num_layers=1)
    graphdef, params = split_model(create_model(cfg, seed=0))
    params = jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, params)  # varied greedy outputs
    return cfg, graphdef, params


@pytest.mark.parametrize("use_mesh, temperature", [(False, 0.0), (False, 1.0), (True, 1.0)])
def test_single_token_tags_by_automaton_equal_stop_ids(tiny, use_mesh, temperature):
    """Where the tags are single tokens, stopping by the automaton and by stop ids is the same."""
    from mempo_jax.sharding import make_mesh

    cfg, graphdef, params = tiny
    vocab = [b"w%d " % i for i in range(VOCAB)]
    tags = {}
    for i, tag in zip((5, 17, 40), STOP_TAGS):
        vocab[i] = tag.encode()
        tags[i] = tag
    auto = StopAutomaton.build(STOP_TAGS, vocab)
    mesh = make_mesh(2, 2, 2) if use_mesh else None
    kw = {} if mesh is None else {"mesh": mesh}
    by_ids = Sampler(graphdef, cfg, [3, *tags], 0, **kw)
    by_text = Sampler(graphdef, cfg, [3], 0, stop_automaton=auto, **kw)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, VOCAB, (8, 6)), jnp.int32)
    mask = jnp.ones((8, 6), bool)
    scfg = SamplerConfig(16, temperature)
    a = by_ids(params, ids, mask, jax.random.key(0), scfg)
    b = by_text(params, ids, mask, jax.random.key(0), scfg)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(a.stopped).any()
