"""Stop strings over token ids (``mempo_jax.text.stop_strings``) and the sampler's device-side stop.

References are independent of the automaton: the brute-force "does the concatenated text of the
first n tokens contain a stop string" over every prefix. The tests on the real SmolLM2 tokenizer
(every tag several tokens) are in ``test_tags.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.text.protocol import STOP_TAGS
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model
from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.text.stop_strings import StopAutomaton, byte_automaton, find_text_span


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


@pytest.mark.parametrize("use_mesh, temperature", [(False, 1.0), (True, 0.0)])
def test_single_token_tags_by_automaton_equal_stop_ids(tiny, use_mesh, temperature):
    """Where the tags are single tokens, stopping by the automaton and by stop ids is the same."""
    from mempo_jax.core.sharding import make_mesh

    cfg, graphdef, params = tiny
    vocab = [b"w%d " % i for i in range(VOCAB)]
    tags = {}
    for i, tag in zip((5, 17, 40), STOP_TAGS):
        vocab[i] = tag.encode()
        tags[i] = tag
    auto = StopAutomaton.build(STOP_TAGS, vocab)
    mesh = make_mesh(2, 2, 2) if use_mesh else None
    kw = {} if mesh is None else {"mesh": mesh}
    by_ids = RolloutEngine(graphdef, cfg, [3, *tags], 0, **kw)
    by_text = RolloutEngine(graphdef, cfg, [3], 0, stop_automaton=auto, **kw)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, VOCAB, (8, 6)), jnp.int32)
    mask = jnp.ones((8, 6), bool)
    a = by_ids(params, ids, mask, jax.random.key(0), 16, temperature)
    b = by_text(params, ids, mask, jax.random.key(0), 16, temperature)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(a.stopped).any()


# ------------------------------------------------- device = host on arbitrary forced sequences

L = 16  # generated tokens per row
SEQ_FRAGMENTS = FRAGMENTS + [b""]  # the last one is the stop id (EOS: decodes to nothing)
EOS_F = len(SEQ_FRAGMENTS) - 1
F = len(SEQ_FRAGMENTS)


def _tok_id(k, f):
    """Id of fragment f at generated position k (id 0: the prompt's start token and the pad)."""
    return 1 + k * F + f


@pytest.fixture(scope="module")
def forced():
    """A 1-layer model whose greedy output is any sequence we choose through the LM head alone:
    id ``(k, f)`` is embedded as the unit vector ``e_k`` (its position), and LM-head row ``k``
    points at the next id. The head is a parameter, so every sequence runs the same program."""
    vocab, d = 1 + L * F, 32
    cfg = ModelConfig(vocab_size=vocab, embed_dim=d, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      mlp_dim=8, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=0))
    layer = params["layers"]  # the one layer, stacked
    layer["attn"]["o"].set_value(jnp.zeros_like(layer["attn"]["o"].get_value()))
    layer["mlp"]["down"].set_value(jnp.zeros_like(layer["mlp"]["down"].get_value()))
    embed = np.zeros((vocab, d), np.float32)
    embed[0, L] = 1.0
    for k in range(L):
        embed[1 + k * F: 1 + (k + 1) * F, k] = 1.0
    params["embed"].set_value(jnp.asarray(embed))
    vocab_bytes = [b""] + [SEQ_FRAGMENTS[f] for _ in range(L) for f in range(F)]
    auto = StopAutomaton.build(STOP_TAGS, vocab_bytes)
    stop_ids = [_tok_id(k, EOS_F) for k in range(L)]
    sampler = RolloutEngine(graphdef, cfg, stop_ids, 0, stop_automaton=auto)
    return cfg, params, sampler, auto, stop_ids


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, F - 1), min_size=L, max_size=L))
def test_device_stop_equals_host_first_stop_on_any_sequence(forced, frags):
    """The jitted sampler, forced to emit any fragment sequence, stops where the host's
    ``first_stop`` (and the brute force over the bytes) says: tags split across tokens, completed
    by the prefill's own token, ending inside a token, or a stop id."""
    cfg, params, sampler, auto, stop_ids = forced
    head = np.zeros((cfg.embed_dim, cfg.vocab_size), np.float32)
    scale = 10.0 / np.sqrt(cfg.embed_dim)  # rmsnorm(e_k) = sqrt(D) e_k
    head[L, _tok_id(0, frags[0])] = scale  # after the prompt's start token: fragment 0
    for k in range(L - 1):
        head[k, _tok_id(k + 1, frags[k + 1])] = scale
    params["lm_head"].set_value(jnp.asarray(head))
    out = sampler(params, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool), jax.random.key(0),
                  L, 0.0)
    ids = [_tok_id(k, f) for k, f in enumerate(frags)]
    got = np.asarray(out.tokens[0]).tolist()
    n = auto.first_stop(ids, stop_ids)
    assert n == _brute_first([SEQ_FRAGMENTS[f] for f in frags], [t.encode() for t in STOP_TAGS], stop_ids, ids)
    assert int(out.lengths[0]) == (n or L) and bool(out.stopped[0]) == (n is not None)
    assert got[: n or L] == ids[: n or L] and all(t == 0 for t in got[n or L:])
    slots = sampler.sampler
    for which in ("extend", "decode"):  # one compiled program each for every sequence
        assert slots._program(which, slots.init_state(1, slots.cache_size(2 + L), L))._cache_size() == 1
