"""Blocked (flash-style) attention equals the dense masked softmax, and packed rows equal unpacked ones.

Properties over generated shapes (hypothesis): tile sizes that do and do not divide T and S,
GQA groups, heads-major and slot-major layouts, dense bool masks and structural
``AttentionMask``s with segments; gradients too (the training forward runs the blocked path).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import without_shape_checks
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.attention_xla import blocked_attention, dense_attention, use_blocked
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, packed_positions, split_model

TOL = dict(rtol=2e-5, atol=2e-5)


def _qkv(rng, b, t, s, h, kvh, hd):
    q = rng.standard_normal((b, t, h, hd)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, hd)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _reference(q, k, v, mask):
    """Independent float64 numpy attention (repeat_kv, softmax over allowed keys)."""
    q, k, v, mask = (np.asarray(x, np.float64) if x.dtype != bool else np.asarray(x) for x in (q, k, v, mask))
    mask = mask | ~mask.any(-1, keepdims=True)  # a row that sees nothing: uniform (rows the tests ignore)
    b, t, h, hd = q.shape
    g = h // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    sc = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    sc = np.where(mask[:, None], sc, -np.inf)
    sc = sc - sc.max(-1, keepdims=True)
    p = np.exp(sc)
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 40), s_extra=st.integers(0, 24), kvh=st.sampled_from([1, 2]),
       g=st.sampled_from([1, 3]), bq=st.sampled_from([4, 7, 16]), bk=st.sampled_from([5, 8, 64]),
       heads_major=st.booleans(), seed=st.integers(0, 2**16))
def test_blocked_equals_dense_on_random_masks(b, t, s_extra, kvh, g, bq, bk, heads_major, seed):
    rng = np.random.default_rng(seed)
    s = t + s_extra
    q, k, v = _qkv(rng, b, t, s, kvh * g, kvh, 8)
    mask = rng.random((b, t, s)) < 0.6
    mask[:, :, 0] = True  # every query sees a key (rows without one are garbage by contract)
    mask = jnp.asarray(mask)
    kk, vv = (jnp.swapaxes(x, 1, 2) for x in (k, v)) if heads_major else (k, v)
    want = _reference(q, k, v, mask)
    dense = jax.jit(dense_attention, static_argnames="heads_major")(q, kk, vv, mask, heads_major=heads_major)
    blocked = jax.jit(blocked_attention, static_argnames=("heads_major", "block_q", "block_k"))(
        q, kk, vv, mask, heads_major=heads_major, block_q=bq, block_k=bk)
    np.testing.assert_allclose(np.asarray(dense), want, **TOL)
    np.testing.assert_allclose(np.asarray(blocked), want, **TOL)
    assert blocked.shape == q.shape and blocked.dtype == q.dtype


@settings(max_examples=5, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5), tail=st.integers(0, 9),
       bq=st.sampled_from([3, 8, 32]), bk=st.sampled_from([4, 8, 32]), seed=st.integers(0, 2**16))
def test_structural_mask_with_segments_equals_its_dense_form(lengths, tail, bq, bk, seed):
    rng = np.random.default_rng(seed)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(tail, int)])[None]
    length = seg.shape[1]
    spec = AttentionMask.causal(jnp.asarray(seg > 0), jnp.asarray(seg, jnp.int32))
    cols = np.arange(length)
    dense = (seg[0][:, None] == seg[0][None, :]) & (cols[None, :] <= cols[:, None]) & (seg[0][None, :] > 0)
    np.testing.assert_array_equal(np.asarray(spec.dense())[0], dense)
    q, k, v = _qkv(rng, 1, length, length, 2, 1, 8)
    got = np.asarray(jax.jit(blocked_attention, static_argnames=("block_q", "block_k"))(q, k, v, spec, block_q=bq,
                                                                                         block_k=bk))
    real = seg[0] > 0
    want = _reference(q, k, v, jnp.asarray(dense[None]))
    np.testing.assert_allclose(got[:, real], want[:, real], **TOL)
    assert np.isfinite(got).all()  # padding queries see nothing: finite garbage, never NaN


def test_gradients_of_blocked_equal_dense():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 37, 37, 4, 2, 8)
    valid = jnp.asarray(np.arange(37)[None] < np.array([[37], [29]]))
    spec = AttentionMask.causal(valid)
    w = jnp.asarray(rng.standard_normal((2, 37, 4, 8)).astype(np.float32)) * valid[:, :, None, None]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    gd = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: dense_attention(q, k, v, spec), *a), argnums=(0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: blocked_attention(q, k, v, spec, block_q=8, block_k=16),
                                          *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(gd, gb):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), **TOL)
        assert np.isfinite(np.asarray(b)).all()


def test_skipped_tiles_and_fully_masked_rows_are_finite():
    q, k, v = _qkv(np.random.default_rng(1), 1, 16, 16, 2, 2, 4)
    mask = jnp.zeros((1, 16, 16), bool).at[0, 8:, :4].set(True)  # queries 0..7 see nothing
    out = np.asarray(blocked_attention(q, k, v, mask, block_q=4, block_k=4))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:, 8:], _reference(q, k, v, mask)[:, 8:], **TOL)
    # a fully masked row gets 0 (probabilities exactly 0 on masked keys)
    np.testing.assert_array_equal(out[:, :8], 0)
    with without_shape_checks(), pytest.raises(ValueError, match=r"must be \[batch, T, S\]"):
        blocked_attention(q, k, v, mask[:, :5])


def test_model_takes_the_blocked_path_for_long_rows_and_matches_dense():
    """Rows over 1,024 tokens take the blocked path; a 300-token forward through it (two 256
    tiles) equals the same model through dense attention."""
    assert use_blocked(1025, 1025) and not use_blocked(1, 2048) and not use_blocked(1024, 1024)
    assert not use_blocked(512, 512) and use_blocked(300, 300, min_len=256)
    cfg = ModelConfig.tiny(64, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=3))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 300)), jnp.int32)
    valid = jnp.asarray(np.arange(300)[None] < np.array([[300], [270]]))
    from mempo_jax.model import attention as layers
    orig = layers.use_blocked
    out = {}
    try:
        for name, blocked in (("blocked", True), ("dense", False)):
            calls = []
            layers.use_blocked = lambda t, s, min_len=None, _b=blocked, _c=calls: _c.append((t, s)) or _b
            out[name] = np.asarray(jax.jit(make_logits_fn(graphdef))(params, ids, valid))
            assert calls, "attend did not consult use_blocked"
    finally:
        layers.use_blocked = orig
    real = np.asarray(valid)
    assert not np.array_equal(out["blocked"], out["dense"])  # two different reduction orders ran
    np.testing.assert_allclose(out["blocked"][real], out["dense"][real], rtol=1e-4, atol=1e-4)


def test_dense_max_len_sends_shorter_rows_to_the_blocked_path_with_the_same_values_and_gradients():
    """``LogitsFn(dense_max_len=16)`` (``ExecutionConfig.dense_attention_max_len``) runs 40-token
    rows through the blocked attention: another reduction order, the same hidden states and the
    same gradient through the rematerialised layer scan (float32 tolerance)."""
    cfg = ModelConfig.tiny(64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=7))
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, 64, (2, 40)), jnp.int32)
    valid = jnp.asarray(np.arange(40)[None] < np.array([[40], [29]]))
    real = np.asarray(valid)
    out, grads = {}, {}
    for name, n in (("dense", 1024), ("blocked", 16)):
        fn = make_logits_fn(graphdef, remat="full", dense_max_len=n)
        out[name] = np.asarray(jax.jit(fn.hidden)(params, ids, valid))
        loss = lambda p, fn=fn: jnp.sum(jnp.where(valid[..., None], fn.hidden(p, ids, valid) ** 2, 0.0))  # noqa: E731
        grads[name] = jax.jit(jax.grad(loss))(params)
    assert not np.array_equal(out["blocked"], out["dense"])
    np.testing.assert_allclose(out["blocked"][real], out["dense"][real], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(grads["blocked"]), jax.tree.leaves(grads["dense"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="dense_max_len must be >= 1"):
        make_logits_fn(graphdef, dense_max_len=0)


def test_packed_rows_equal_unpacked_rows():
    cfg = ModelConfig.tiny(64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=4))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 64, n).tolist() for n in (5, 11, 3)]
    ids = np.zeros((1, 24), np.int32)
    seg = np.zeros((1, 24), np.int32)
    col = 0
    for i, s in enumerate(seqs):
        ids[0, col : col + len(s)] = s
        seg[0, col : col + len(s)] = i + 1
        col += len(s)
    pos = packed_positions(seg)
    np.testing.assert_array_equal(pos[0, :19], list(range(5)) + list(range(11)) + list(range(3)))
    fn = make_logits_fn(graphdef)
    packed_fn = jax.jit(fn.packed)
    packed = np.asarray(packed_fn(params, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos)))
    # each sequence alone: right-padded rows of one shape (one compile), padding changes nothing
    alone_ids, alone_valid = np.zeros((3, 12), np.int32), np.zeros((3, 12), bool)
    for i, s in enumerate(seqs):
        alone_ids[i, : len(s)], alone_valid[i, : len(s)] = s, True
    alone = np.asarray(jax.jit(fn)(params, jnp.asarray(alone_ids), jnp.asarray(alone_valid)))
    col = 0
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(packed[0, col : col + len(s)], alone[i, : len(s)], rtol=1e-5, atol=1e-5)
        col += len(s)
    at = jnp.asarray([[4, 15, 18]], jnp.int32)
    some = np.asarray(packed_fn(params, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos), at))
    np.testing.assert_allclose(some[0], packed[0, [4, 15, 18]], rtol=1e-6, atol=1e-6)
