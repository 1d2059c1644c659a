"""Tests for mempo_jax.rl.memory_reward through the real scorer, on a model whose probabilities we set.

The test model is a causal bigram table conditioned on whether a MARKER token has appeared so
far in the sequence: ``logits[b, t] = table[seen_marker(b, ≤t), ids[b, t]]`` (``Bigram``, a
``LogitsFn`` whose hidden states are these logits and whose head is the identity). Only full
contexts hold MARKER, so the same answer gets a different probability under full and memory
contexts.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.core.logprobs import target_logprobs, token_logprobs
from mempo_jax.rl.memory_reward import MemoryRewardScorer, answer_likelihood, build_scoring_batch
from padded_reference import padded_scores

V = 16
PAD, MARKER, PREFIX = 0, 1, 2
Z = [5, 6, 7]  # answer tokens; the chain PREFIX→5→6→7
CHAIN = {PREFIX: 5, 5: 6, 6: 7}


def make_table(p_marker: dict, p_plain: dict, other=0.05) -> jnp.ndarray:
    """table[h, prev] = log-probs; P(CHAIN[prev] | prev) = p_h[prev]; other prevs: PREFIX gets `other`."""
    table = np.zeros((2, V, V))
    for h, probs in enumerate([p_plain, p_marker]):
        for prev in range(V):
            row = np.full(V, 0.0)
            if prev in CHAIN:
                row[:] = (1 - probs[prev]) / (V - 1)
                row[CHAIN[prev]] = probs[prev]
            else:  # context tokens: give the prefix (never scored) a distinctive probability
                row[:] = (1 - other) / (V - 1)
                row[PREFIX] = other
            table[h, prev] = np.log(row)
    return jnp.asarray(table, jnp.float32)


class Bigram:
    """The test model as a ``LogitsFn``: ``params`` is the table, the "hidden states" are the
    logits, the head is the identity. A packed segment sees only its own MARKERs."""

    logit_chunk = 256

    def hidden(self, table, ids, valid, remat=None):
        seen = jnp.cumsum((ids == MARKER).astype(jnp.int32), axis=1) > 0
        return table[seen.astype(jnp.int32), ids]

    def packed_hidden(self, table, ids, segment_ids, positions, remat=None):
        marks = jnp.cumsum((ids == MARKER).astype(jnp.int32), axis=1)
        start = jnp.arange(ids.shape[1])[None, :] - positions  # the first column of each token's segment
        before = jnp.take_along_axis(marks - (ids == MARKER).astype(jnp.int32), start, axis=1)
        return table[(marks - before > 0).astype(jnp.int32), ids]

    def head(self, table):
        return None

    def project(self, weight, hidden):
        return hidden


class Counting(Bigram):
    """``Bigram`` that counts its packed calls' Python traces and device executions (a debug callback)."""

    def __init__(self):
        self.counts = {"trace": 0, "exec": 0}

    def _bump(self):
        self.counts["exec"] += 1

    def packed_hidden(self, *args, **kwargs):
        self.counts["trace"] += 1
        jax.debug.callback(self._bump)
        return super().packed_hidden(*args, **kwargs)


bigram = Bigram()


UNIFORM = {PREFIX: 0.72, 5: 0.72, 6: 0.72}
UNIFORM_MEM = {PREFIX: 0.68, 5: 0.68, 6: 0.68}


def test_spec_example_072_068_with_rows_of_different_lengths():
    table = make_table(UNIFORM, UNIFORM_MEM)
    fn = Counting()
    counts = fn.counts
    scorer = MemoryRewardScorer(fn, PAD, [PREFIX])
    full = [[8, MARKER, 9, 10], [MARKER], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, MARKER, 9, 10, 11]]
    mem = [[8, 11], [12], [8, 9, 10, 11, 12]]
    answers = [Z, Z[:1], Z[:2]]
    out = scorer(table, full, mem, answers)
    np.testing.assert_allclose(out.p_full, [0.72] * 3, atol=1e-6)
    np.testing.assert_allclose(out.p_mem, [0.68] * 3, atol=1e-6)
    np.testing.assert_allclose(out.r_mem, [-0.04] * 3, atol=1e-6)
    assert out.r_mem.dtype == np.float32 and out.r_mem.shape == (3,)
    assert counts == {"trace": 1, "exec": 1}  # one model call on the stacked batch
    # A second call with the same bucket shapes: no retrace, exactly one more execution.
    out2 = scorer(table, full[::-1], mem[::-1], answers[::-1])
    np.testing.assert_allclose(out2.r_mem, [-0.04] * 3, atol=1e-6)
    assert counts == {"trace": 1, "exec": 2}


def test_memory_that_keeps_the_marker_gets_zero_reward():
    table = make_table(UNIFORM, UNIFORM_MEM)
    scorer = MemoryRewardScorer(bigram, PAD, [PREFIX])
    out = scorer(table, [[MARKER, 9], [9, 9]], [[MARKER], [MARKER, 3]], [Z, Z])
    # turn 0: both contexts hold the marker → 0; turn 1: memory gains it → +0.04.
    np.testing.assert_allclose(out.r_mem, [0.0, 0.04], atol=1e-6)
    np.testing.assert_allclose(out.p_full, [0.72, 0.68], atol=1e-6)


def test_p_is_geometric_mean_of_answer_token_probs():
    probs = {PREFIX: 0.9, 5: 0.5, 6: 0.3}
    table = make_table(probs, probs)
    scorer = MemoryRewardScorer(bigram, PAD, [PREFIX])
    out = scorer(table, [[8, 9]], [[10]], [Z])
    geo = float(np.exp(np.mean(np.log([0.9, 0.5, 0.3]))))  # 0.5130
    np.testing.assert_allclose(out.p_full, [geo], rtol=1e-6)
    np.testing.assert_allclose(out.p_mem, [geo], rtol=1e-6)
    assert abs(geo - np.mean([0.9, 0.5, 0.3])) > 0.05  # not the arithmetic mean
    assert abs(geo - 0.9 * 0.5 * 0.3) > 0.3  # not the product (not length-normalised)


def test_temperature_divides_logits():
    probs = {PREFIX: 0.9, 5: 0.5, 6: 0.3}
    table = make_table(probs, probs)
    out = MemoryRewardScorer(bigram, PAD, [PREFIX], temperature=2.0)(table, [[8]], [[9]], [Z])
    ps = []
    for prev, nxt in [(PREFIX, 5), (5, 6), (6, 7)]:
        z = np.asarray(table[0, prev], np.float64) / 2.0
        ps.append(np.exp(z[nxt] - np.log(np.exp(z).sum())))
    np.testing.assert_allclose(out.p_full, [np.exp(np.mean(np.log(ps)))], rtol=1e-5)
    with pytest.raises(ValueError):
        MemoryRewardScorer(bigram, PAD, [PREFIX], temperature=0.0)


def test_build_scoring_batch_layout():
    ids, valid, am = build_scoring_batch([[8, 9, 10], [11]], [[12], [13, 14]], [[5, 6], [7]], [2, 3], pad_id=0)
    assert ids.shape == (4, 16) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids[0, :7], [8, 9, 10, 2, 3, 5, 6])
    np.testing.assert_array_equal(ids[1, :4], [11, 2, 3, 7])
    np.testing.assert_array_equal(ids[2, :5], [12, 2, 3, 5, 6])  # rows M.. = mem contexts, Z again
    np.testing.assert_array_equal(ids[3, :5], [13, 14, 2, 3, 7])
    np.testing.assert_array_equal(valid.sum(1), [7, 4, 5, 5])
    expected = np.zeros((4, 16), bool)
    expected[0, 5:7] = expected[1, 3] = expected[2, 3:5] = expected[3, 4] = True  # not prefix, not pad
    np.testing.assert_array_equal(am, expected)
    assert np.all(ids[~valid] == 0)
    # Long rows go to the next power-of-two length; row padding adds all-invalid rows.
    ids, valid, am = build_scoring_batch([list(range(8, 28))] * 3, [[9]] * 3, [[5]] * 3, [2], 0,
                                         pad_rows_to_bucket=True, min_rows=4)
    assert ids.shape == (8, 32)
    assert not valid[6:].any() and not am[6:].any() and am[:6].sum() == 6


def test_full_prefix_goes_on_the_full_view_only():
    ids, valid, am = build_scoring_batch([[8, 9]], [[12]], [[5, 6]], [2], pad_id=0, full_prefix=[3, 4])
    np.testing.assert_array_equal(ids[0, :7], [8, 9, 3, 4, 2, 5, 6])  # full + full_prefix + prefix + Z
    np.testing.assert_array_equal(ids[1, :4], [12, 2, 5, 6])  # mem + prefix + Z
    np.testing.assert_array_equal(np.flatnonzero(am[0]), [5, 6])
    np.testing.assert_array_equal(np.flatnonzero(am[1]), [2, 3])
    # through the scorer: a full_prefix holding MARKER changes P_full only (0.68 → 0.72)
    table = make_table(UNIFORM, UNIFORM_MEM)
    plain = MemoryRewardScorer(bigram, PAD, [PREFIX])(table, [[9]], [[9]], [Z])
    marked = MemoryRewardScorer(bigram, PAD, [PREFIX], full_prefix=[MARKER])(table, [[9]], [[9]], [Z])
    np.testing.assert_allclose([plain.p_full[0], plain.p_mem[0]], [0.68, 0.68], atol=1e-6)
    np.testing.assert_allclose([marked.p_full[0], marked.p_mem[0], marked.r_mem[0]], [0.72, 0.68, -0.04], atol=1e-6)


def test_answer_prefix_ids_per_memory_prefix_mode():
    from mempo_jax.run.experiment import answer_prefix_ids
    from toy_agent import WordTokenizer

    tok = WordTokenizer()
    t = [tok.piece_id(p) for p in ("<think>", "</think>", "<answer>")]
    assert answer_prefix_ids(tok) == ([tok.piece_id("<mem>"), tok.piece_id("</mem>")], t)  # default empty_mem
    assert answer_prefix_ids(tok, "think") == ([], t)
    assert answer_prefix_ids(tok, "none") == ([], [])
    with pytest.raises(ValueError, match="MemoryRewardConfig.prefix"):
        answer_prefix_ids(tok, "mem")


def test_build_scoring_batch_errors():
    with pytest.raises(ValueError):
        build_scoring_batch([[1]], [[1], [2]], [[5]], [2], 0)
    with pytest.raises(ValueError):
        build_scoring_batch([[]], [[1]], [[5]], [], 0)  # Z at position 0: unscoreable


def test_answer_likelihood_direct():
    logp = jnp.log(jnp.asarray([[0.5, 0.25, 0.9, 0.01], [0.3, 0.3, 0.3, 0.3]]))
    mask = jnp.asarray([[False, True, True, False], [False, False, False, False]])
    p = np.asarray(answer_likelihood(logp, mask))
    np.testing.assert_allclose(p, [math.sqrt(0.25 * 0.9), 0.0], rtol=1e-6)


def test_empty_batch_does_not_call_the_model():
    fn = Counting()
    out = MemoryRewardScorer(fn, PAD, [PREFIX])(None, [], [], [])
    assert all(a.shape == (0,) and a.dtype == np.float32 for a in out)
    assert fn.counts == {"trace": 0, "exec": 0}


def test_scores_are_detached():
    table = make_table(UNIFORM, UNIFORM_MEM)
    scorer = MemoryRewardScorer(bigram, PAD, [PREFIX])
    ids = jnp.asarray([[MARKER, 9, PREFIX] + Z], jnp.int32)
    seg, pos = jnp.ones_like(ids), jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    at, tgt = jnp.asarray([[2, 3, 4]], jnp.int32), jnp.asarray([Z], jnp.int32)
    g = jax.jit(jax.grad(lambda t: scorer.packed_logprobs(t, ids, seg, pos, at, tgt).sum()))(table)
    assert float(jnp.abs(g).max()) == 0.0
    # Without stop_gradient the same expression has a non-zero gradient (the test has teeth).

    def raw(t):
        hidden = jnp.take_along_axis(bigram.packed_hidden(t, ids, seg, pos), at[..., None], axis=1)
        return target_logprobs(hidden, tgt)[0].sum()
    assert float(jnp.abs(jax.jit(jax.grad(raw))(table)).max()) > 0.0


def test_batch_sharding_over_8_devices_matches():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.asarray(jax.devices())
    mesh = Mesh(devices, ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    table = make_table(UNIFORM, UNIFORM_MEM)
    scorer = MemoryRewardScorer(bigram, PAD, [PREFIX], min_rows=len(devices), batch_sharding=sharding)
    out = scorer(table, [[MARKER, 9]] * 3, [[9]] * 3, [Z] * 3)
    np.testing.assert_allclose(out.r_mem, [-0.04] * 3, atol=1e-6)


def test_length_buckets_cover_every_bucket_length_up_to_the_bound():
    from mempo_jax.core.batching import bucket_length, length_buckets

    assert length_buckets(64, 200) == [64, 128, 256]
    assert length_buckets(128, 128) == [128]
    for n in range(0, 700, 7):  # every length below the bound lands in a listed bucket
        assert bucket_length(n, 64) in length_buckets(64, 700)


# ------------------------------------------------------------------ packed scoring


def _tiny_decoder(vocab=48, seed=5):
    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import create_model, make_logits_fn, split_model

    cfg = ModelConfig.tiny(vocab, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=seed))
    return make_logits_fn(graphdef), params


def test_packed_scoring_equals_padded_scoring_on_a_real_decoder():
    """Packed rows (segment ids, positions restarting per segment) give the padded path's P."""
    fn, params = _tiny_decoder()
    rng = np.random.default_rng(0)
    m = 7
    full = [rng.integers(4, 48, int(rng.integers(20, 90))).tolist() for _ in range(m)]
    mem = [rng.integers(4, 48, int(rng.integers(2, 12))).tolist() for _ in range(m)]
    answers = [rng.integers(4, 48, int(rng.integers(1, 6))).tolist() for _ in range(m)]
    answers[3] = []  # no answer tokens: P = 0 on both paths
    kw = dict(chunk_rows=16, min_length=16, full_prefix=[3])
    calls = []
    packed = MemoryRewardScorer(fn, 0, [1, 2], **kw)
    orig = packed.packed_logprobs
    packed.packed_logprobs = lambda *a: calls.append(a[1].shape) or orig(*a)
    got = packed(params, full, mem, answers)
    want = padded_scores(fn, params, full, mem, answers, [1, 2], full_prefix=[3])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert got.p_full[3] == 0.0 and got.p_mem[3] == 0.0
    assert len(calls) == 1  # one stacked call
    rows, length = calls[0]
    assert rows * length < 16 * 128  # fewer positions than the padded [16, 128] batch
    # an independent check of one value: P(Z | mem_0) from an unpacked forward pass
    row = mem[0] + [1, 2] + answers[0]
    lp = np.asarray(token_logprobs(fn(params, jnp.asarray([row]), jnp.ones((1, len(row)), bool)), jnp.asarray([row])))
    n = len(answers[0])
    np.testing.assert_allclose(got.p_mem[0], np.exp(lp[0, -n:].mean()), rtol=2e-5)


def test_packed_scoring_chunks_and_precompile_compile_nothing_later():
    fn, params = _tiny_decoder(seed=6)
    rng = np.random.default_rng(1)
    m = 12
    full = [rng.integers(4, 48, int(rng.integers(30, 60))).tolist() for _ in range(m)]
    mem = [rng.integers(4, 48, int(rng.integers(2, 9))).tolist() for _ in range(m)]
    answers = [rng.integers(4, 48, 3).tolist() for _ in range(m)]
    small = MemoryRewardScorer(fn, 0, [1], chunk_rows=2, min_rows=2, min_length=16)
    assert small.precompile(params, [16, 32, 64]) == 3  # one row bucket (2) per length
    traced = []
    orig = small._packed_logprobs
    small._packed_logprobs = lambda *a: traced.append(1) or orig(*a)
    got = small(params, full, mem, answers)
    assert traced == []  # every packed call hit a precompiled shape
    want = padded_scores(fn, params, full, mem, answers, [1])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_first_fit_decreasing_and_packing_plan():
    from mempo_jax.core.packing import first_fit_decreasing, pack, plan_packing

    bins = first_fit_decreasing([5, 3, 8, 2, 4], 10)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 8, 2, 4][i] for i in b) <= 10 for b in bins)
    assert bins == [[2, 3], [0, 4], [1]]  # 8+2, 5+4, 3 (longest first, first fit)
    assert first_fit_decreasing([3, 3, 3], 10, [2, 2, 2], 3) == [[0], [1], [2]]  # the weight budget binds
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([11], 10)
    length, calls = plan_packing([100, 30, 30, 20], 16, rows_per_call=8)
    assert length == 128 and calls == [[[0, 3], [1, 2]]]  # [2, 128]; [1, 256] ties, the shorter wins
    pk = pack([[7, 8], [9]], [[0, 1]], 4, 2, pad_id=0)
    np.testing.assert_array_equal(pk.input_ids, [[7, 8, 9, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(pk.segment_ids, [[1, 1, 2, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(pk.positions, [[0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(pk.row_of[0], [0, 0, 1, -1])
