"""One-shot generation (``RolloutEngine.__call__``: the slot sampler's prefill + decode) on a tiny random model: greedy parity with uncached decoding, per-row stops,
log-prob parity with sequence_logprobs, padding invariance, top-p, determinism, compile cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mempo_jax.core.batching import pad_sequences
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, sequence_logprobs, split_model
from mempo_jax.agent.decoding import top_p_filter
from mempo_jax.agent.engine import RolloutEngine

VOCAB = 96
PAD = 0
N = 12
PROMPTS = [[5, 17, 33, 2, 9], [44, 3], [8, 8, 61, 70, 12, 90, 1]]


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.tiny(VOCAB, num_layers=2)
    graphdef, params = split_model(create_model(cfg, seed=0))
    # Sharpen the random model (weights x5) so greedy outputs vary instead of repeating one id.
    params = jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, params)
    ids, mask = pad_sequences(PROMPTS, PAD, length=8, side="left")
    return cfg, graphdef, params, jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def greedy_out(setup):
    cfg, graphdef, params, ids, mask = setup
    sampler = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)
    return sampler(params, ids, mask, jax.random.key(0), max_new_tokens=N, temperature=0.0)


def test_greedy_with_cache_equals_uncached_argmax(setup, greedy_out):
    cfg, graphdef, params, _, _ = setup
    logits_fn = jax.jit(make_logits_fn(graphdef))
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(N):  # full forward each step, right-padded to a fixed length
            ids, mask = pad_sequences([seq], PAD, length=32)
            logits = np.asarray(logits_fn(params, jnp.asarray(ids), jnp.asarray(mask)))
            seq.append(int(np.argmax(logits[0, len(seq) - 1])))
        np.testing.assert_array_equal(np.asarray(greedy_out.tokens[b]), seq[len(prompt):])
    assert np.all(np.asarray(greedy_out.mask)) and not np.any(np.asarray(greedy_out.stopped))
    np.testing.assert_array_equal(np.asarray(greedy_out.lengths), [N] * len(PROMPTS))


def _first_stop(row, stop_ids):
    hits = [t for t, tok in enumerate(row) if tok in stop_ids]
    return hits[0] if hits else None


def test_rows_stop_at_their_own_stop_token_and_are_padded(setup, greedy_out):
    cfg, graphdef, params, ids, mask = setup
    free = np.asarray(greedy_out.tokens)
    # Choose a stop set from the greedy output so that rows stop at different steps (or never).
    best = None
    for cand in sorted({int(t) for t in free[:, 1:-1].ravel()}):
        stops = [_first_stop(list(r), {cand}) for r in free]
        if len({s for s in stops}) == len(stops) and stops[0] is not None:
            best = cand
            break
    assert best is not None, "no stop id separates the rows; change the seed"
    stop_ids = [best, VOCAB + 5]  # an unused id in the set is harmless
    out = RolloutEngine(graphdef, cfg, stop_ids=stop_ids, pad_id=PAD)(
        params, ids, mask, jax.random.key(0), max_new_tokens=N, temperature=0.0)
    tokens, m = np.asarray(out.tokens), np.asarray(out.mask)
    for b, row in enumerate(free):
        s = _first_stop(list(row), set(stop_ids))
        length = N if s is None else s + 1
        assert out.lengths[b] == length and bool(out.stopped[b]) == (s is not None)
        np.testing.assert_array_equal(tokens[b, :length], row[:length])
        assert np.all(tokens[b, length:] == PAD) and np.all(m[b, :length]) and not np.any(m[b, length:])
        assert np.all(np.asarray(out.logprobs)[b, length:] == 0)
    assert len(set(np.asarray(out.lengths).tolist())) == len(PROMPTS)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_sequence_logprobs(setup, temperature):
    cfg, graphdef, params, ids, mask = setup
    out = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)(
        params, ids, mask, jax.random.key(1), max_new_tokens=N, temperature=temperature)
    full_ids = jnp.concatenate([ids, out.tokens], axis=1)
    full_mask = jnp.concatenate([mask, out.mask], axis=1)
    logp, _ = sequence_logprobs(graphdef, params, full_ids, full_mask, temperature=temperature)
    got, ref = np.asarray(out.logprobs), np.asarray(logp)[:, ids.shape[1]:]
    np.testing.assert_allclose(got, np.where(np.asarray(out.mask), ref, 0.0), atol=1e-5)
    assert np.all(got[np.asarray(out.mask)] < 0)


def test_greedy_logprobs_use_temperature_one(setup, greedy_out):
    _, graphdef, params, ids, mask = setup
    full_ids = jnp.concatenate([ids, greedy_out.tokens], axis=1)
    full_mask = jnp.concatenate([mask, greedy_out.mask], axis=1)
    logp, _ = sequence_logprobs(graphdef, params, full_ids, full_mask, temperature=1.0)
    np.testing.assert_allclose(np.asarray(greedy_out.logprobs), np.asarray(logp)[:, 8:], atol=1e-5)


def test_left_padding_invariance(setup, greedy_out):
    cfg, graphdef, params, _, _ = setup
    ids, mask = pad_sequences(PROMPTS, PAD, length=16, side="left")
    sampler = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)
    out = sampler(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                  max_new_tokens=N, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy_out.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(greedy_out.logprobs), atol=1e-5)


def test_same_key_same_samples_and_no_recompile_per_temperature(setup):
    cfg, graphdef, params, ids, mask = setup
    sampler = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)
    a = sampler(params, ids, mask, jax.random.key(7), N, 1.0)
    b = sampler(params, ids, mask, jax.random.key(7), N, 1.0)
    d = sampler(params, ids, mask, jax.random.key(8), N, 1.0)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.any(np.asarray(a.tokens) != np.asarray(d.tokens))
    slots = sampler.sampler
    state = slots.init_state(len(PROMPTS), slots.cache_size(7 + N), N)
    programs = [slots._program(which, state) for which in ("extend", "decode")]
    sizes = [p._cache_size() for p in programs]  # (greedy and top-p variants of other tests included)
    again = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)  # a new instance shares the programs
    again(params, ids, mask, jax.random.key(7), N, 0.9)  # another temperature: a traced value
    assert [again.sampler._program(w, state) for w in ("extend", "decode")] == programs
    assert [p._cache_size() for p in programs] == sizes


FIXED_PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


@settings(max_examples=40, deadline=None)
@given(top_p=st.floats(min_value=0.01, max_value=1.0), perm_seed=st.integers(0, 1000))
def test_top_p_filter_keeps_exactly_the_nucleus(top_p, perm_seed):
    assume(np.all(np.abs(np.cumsum(FIXED_PROBS) - top_p) > 1e-4))  # no float ties at the boundary
    perm = np.random.RandomState(perm_seed).permutation(len(FIXED_PROBS))
    probs = FIXED_PROBS[perm]
    kept = np.isfinite(np.asarray(top_p_filter(jnp.log(jnp.asarray(probs))[None], top_p))[0])
    # Reference: the smallest prefix (by descending prob) whose mass reaches top_p.
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    k = int(np.searchsorted(cum, top_p)) + 1
    expected = np.zeros(len(probs), bool)
    expected[order[:min(k, len(probs))]] = True
    np.testing.assert_array_equal(kept, expected)


def test_top_p_sampler_draws_only_from_the_nucleus(setup):
    cfg, graphdef, params, ids, mask = setup
    sampler = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)
    logits = make_logits_fn(graphdef)(params, ids, mask)[:, -1]
    nucleus = np.isfinite(np.asarray(top_p_filter(logits, 0.3)))
    assert np.all(nucleus.sum(-1) < VOCAB // 2)
    for seed in range(4):
        out = sampler(params, ids, mask, jax.random.key(seed), max_new_tokens=N, top_p=0.3)
        first = np.asarray(out.tokens[:, 0])
        assert np.all(nucleus[np.arange(len(first)), first])


def test_generate_refuses_bad_options(setup):
    cfg, graphdef, params, ids, mask = setup
    sampler = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=PAD)
    for kw, name in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=4, top_p=0.0), "top_p"),
                     (dict(max_new_tokens=4, temperature=-1.0), "temperature")):
        with pytest.raises(ValueError, match=name):
            sampler(params, ids, mask, jax.random.key(0), **kw)
    with pytest.raises(ValueError, match="at least one real token"):
        sampler(params, ids, np.zeros_like(mask), jax.random.key(0), 4)


def test_placing_placed_weights_copies_nothing(setup):
    """``SlotSampler.place`` of weights already on the sampler's mesh (and in its dtype) returns
    the same buffers: the rollout samples from the policy's own arrays, the layers as the decoder
    stores them (stacked), with no second copy. Sampling from the placed weights equals sampling
    from the unplaced ones."""
    from mempo_jax.agent.slot_sampler import SlotSampler

    cfg, graphdef, params, ids, mask = setup
    sampler = SlotSampler(graphdef, cfg, stop_ids=[], pad_id=PAD)
    placed = sampler.place(params)
    again = sampler.place(placed)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(again)):
        assert x.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()
    assert jax.tree.leaves(placed["layers"])[0].shape[0] == cfg.num_layers
    key = jax.random.key(3)
    got = sampler.generate(placed, np.asarray(ids), np.asarray(mask), key, N, temperature=1.0)
    want = sampler.generate(params, np.asarray(ids), np.asarray(mask), key, N, temperature=1.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)


def test_slot_programs_do_not_grow_with_the_number_of_layers():
    """The decoder's layer loop is a scan in the slot programs: the compiled decode and prefill
    programs of a 2-layer and a 6-layer model have the same number of HLO instructions, within 5 % (an
    unrolled loop grows with depth, six layers about 3x two; XLA:CPU holds host memory per compiled
    kernel). The counts move by a few percent with the programs compiled before in the same process."""
    from mempo_jax.agent.slot_sampler import SlotSampler

    def instructions(layers):
        cfg = ModelConfig.tiny(VOCAB, num_layers=layers)
        graphdef, params = split_model(create_model(cfg, seed=0))
        sampler = SlotSampler(graphdef, cfg, stop_ids=[], pad_id=PAD)
        placed = sampler.place(params)
        state = sampler.init_state(4, 32, 8)
        f32 = jnp.float32(1.0)
        i32 = jnp.zeros((4,), jnp.int32)
        decode = sampler._program("decode", state).lower(placed, state, jax.random.key(0), f32, f32, rows=None,
                                                         steps=4, greedy=False, use_top_p=False)
        extend = sampler._program("extend", state).lower(placed, state, i32, jnp.zeros((4, 8), jnp.int32), i32 + 1, i32,
                                                         jnp.ones((4,), bool), i32, i32, jax.random.key(0), f32, f32,
                                                         greedy=False, use_top_p=False)
        return [p.compile().as_text().count("\n") for p in (decode, extend)]

    two, six = instructions(2), instructions(6)  # unrolled, six layers would hold about 3x the instructions
    assert all(abs(b - a) <= 0.05 * a for a, b in zip(two, six)), (two, six)
