"""Stop strings over token ids (``mempo_jax.stop_strings``) and the sampler's device-side stop.

References are independent of the automaton: the brute-force "does the decoded / concatenated
text of the first n tokens contain a stop string" over every prefix, and ``HFTokenizer.decode``
of the real SmolLM2 tokenizer, in which every closing tag is three tokens (``</``, ``search``,
``>``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.agent.protocol import STOP_TAGS
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model
from mempo_jax.sampling import Sampler, SamplerConfig, _compiled_generate
from mempo_jax.stop_strings import StopAutomaton, byte_automaton, find_text_span, token_bytes


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


# ------------------------------------------------------------------------ a real tokenizer


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from mempo_jax.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(smollm2_dir)
    return tok, StopAutomaton.build(STOP_TAGS, token_bytes(tok))


def test_smollm2_tags_are_several_tokens(smol):
    tok, _ = smol
    assert tok.encode("<mem>") == [44, 9808, 46] and tok.encode("</search>") == [9617, 7916, 46]
    assert tok.vocab_size == 49152 and not tok.tag_ids


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=8))
def test_token_bytes_are_exactly_what_decode_gives(smol, ids):
    tok, _ = smol
    table = token_bytes(tok)
    assert b"".join(table[i] for i in ids).decode("utf-8", errors="replace") == tok.decode(ids)


@pytest.mark.parametrize("text, stop_text", [
    ("<mem>x</mem><search>paris</search> more", "<mem>x</mem><search>paris</search>"),  # split tag
    ("<answer>Paris</answer>.\nok", "<answer>Paris</answer>."),  # ">." straddles the tag's end
    ("<search>a</search></answer>", "<search>a</search></"),  # "></" straddles; the first tag wins
    ("x </access> y", "x </access>"),  # " </" carries a space
    ("<mem>a</mem><think>b</think></sear", None),  # a partial tag and </mem> never stop
])
def test_stops_on_the_smollm2_tokenizer(smol, text, stop_text):
    tok, auto = smol
    ids = tok.encode(text)
    n = auto.first_stop(ids)
    if stop_text is None:
        assert n is None
        return
    assert tok.decode(ids[:n]) == stop_text
    assert not any(t in tok.decode(ids[: n - 1]) for t in STOP_TAGS)


def test_straddling_token_really_straddles(smol):
    tok, auto = smol
    ids = tok.encode("</answer>.\n")
    assert [tok.decode([i]) for i in ids[:3]] == ["</", "answer", ">."]
    assert auto.first_stop(ids) == 3


# ----------------------------------------------------------------------- the jitted sampler

# Fragment ids of SmolLM2 that build closing tags in many ways, and the EOS (<|im_end|> = 2).
SMOL_FRAGMENTS = ["</", " </", "search", "answer", "access", "mem", ">", ">.", "></", "<", "h", " x"]


def _biased_model(vocab, favoured, logits, seed=0):
    """A 1-layer model whose next-token distribution is the same at every position: the blocks'
    outputs are zero (the residual stream is the token's embedding), every embedding row is the
    same vector, and the LM head puts ``logits[k]`` on ``favoured[k]`` (−30 elsewhere); sampled at
    temperature 1, every row is an i.i.d. sequence over ``favoured``."""
    cfg = ModelConfig(vocab_size=vocab, embed_dim=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      mlp_dim=8, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=seed))
    params["layers"][0]["attn"]["o"].set_value(jnp.zeros_like(params["layers"][0]["attn"]["o"].get_value()))
    params["layers"][0]["mlp"]["down"].set_value(jnp.zeros_like(params["layers"][0]["mlp"]["down"].get_value()))
    params["embed"].set_value(jnp.ones((vocab, 8), jnp.float32))
    head = np.full((8, vocab), -30.0 / 8, np.float32)  # rmsnorm(ones) = ones: logit = column sum
    for tok, lg in zip(favoured, logits):
        head[:, tok] = lg / 8
    params["lm_head"].set_value(jnp.asarray(head))
    return cfg, graphdef, params


def test_sampler_stops_where_first_stop_says_on_smollm2_ids(smol):
    tok, auto = smol
    favoured = [tok.encode(f)[0] for f in SMOL_FRAGMENTS] + [tok.eos_id]
    assert all(len(tok.encode(f)) == 1 for f in SMOL_FRAGMENTS)
    cfg, graphdef, params = _biased_model(tok.vocab_size, favoured, [1.0] * len(SMOL_FRAGMENTS) + [-2.0])
    stop_ids = [tok.eos_id]
    sampler = Sampler(graphdef, cfg, stop_ids, tok.pad_id, stop_automaton=auto)
    rows, n = 64, 20
    prompt = jnp.asarray(np.full((rows, 4), 9617), jnp.int32)  # "</" x 4: the prompt never counts
    out = sampler(params, prompt, jnp.ones((rows, 4), bool), jax.random.key(3), SamplerConfig(n, 1.0))
    tokens, lengths, stopped, mask = map(np.asarray, (out.tokens, out.lengths, out.stopped, out.mask))
    kinds = {"tag": 0, "eos": 0, "budget": 0}
    for b in range(rows):
        row = tokens[b].tolist()
        full = row[: lengths[b]]
        want = auto.first_stop(full, stop_ids)
        # independent reference: decode every prefix of the sampled ids
        ref = next((k for k in range(1, len(full) + 1)
                    if full[k - 1] in stop_ids or any(t in tok.decode(full[:k]) for t in STOP_TAGS)), None)
        assert want == ref
        if stopped[b]:
            assert lengths[b] == want
            kinds["eos" if full[-1] == tok.eos_id else "tag"] += 1
        else:
            assert lengths[b] == n and want is None
            kinds["budget"] += 1
        assert mask[b].sum() == lengths[b] and all(t == tok.pad_id for t in row[lengths[b]:])
    assert min(kinds.values()) > 0, kinds  # every way of ending a row happened
    # a second sampler with an equal-shaped automaton reuses the compiled program
    before = _compiled_generate.cache_info().currsize
    rebuilt = StopAutomaton.build(STOP_TAGS, token_bytes(tok))
    again = Sampler(graphdef, cfg, stop_ids, tok.pad_id, stop_automaton=rebuilt)
    assert again._generate is sampler._generate and _compiled_generate.cache_info().currsize == before


def test_sampler_rejects_an_automaton_of_another_vocabulary(smol):
    _, auto = smol
    cfg, graphdef, _ = _biased_model(64, [1], [1.0])
    with pytest.raises(ValueError, match="49152 ids but the model has 64"):
        Sampler(graphdef, cfg, [2], 0, stop_automaton=auto)


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
