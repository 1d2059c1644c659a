"""Tests for mempo_jax.rl.advantage against hand-derived numbers and an independent numpy reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.rl.advantage import (
    group_normalize,
    memory_advantage,
    outcome_advantage,
    scatter_span_values,
    token_advantages,
)

EPS = 1e-6


def np_group_normalize(values, group_ids, valid=None, eps=EPS):
    """Independent float64 reference: a Python loop over groups."""
    values = np.asarray(values, np.float64)
    valid = np.ones(len(values), bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros(len(values))
    for g in np.unique(np.asarray(group_ids)[valid]):
        idx = np.where((np.asarray(group_ids) == g) & valid)[0]
        v = values[idx]
        if len(v) == 1:
            out[idx] = v
        elif np.all(v == v[0]):
            out[idx] = 0.0
        else:
            out[idx] = (v - v.mean()) / (v.std(ddof=1) + eps)
    return out


def test_spec_example_hand_numbers():
    # [1,0,1,1,0]: mean 0.6; unbiased var = (3·0.4² + 2·0.6²)/4 = 1.2/4 = 0.3, std = √0.3 ≈ 0.5477
    # (the spec's "std 0.5" is rounded): a 1 gets 0.4/√0.3 ≈ 0.7303, a 0 gets −0.6/√0.3 ≈ −1.0954.
    r = jnp.array([1, 0, 1, 1, 0], jnp.float32)
    a = np.asarray(outcome_advantage(r, jnp.zeros(5, jnp.int32), 1))
    s = math.sqrt(0.3) + EPS
    np.testing.assert_allclose(a, [0.4 / s, -0.6 / s, 0.4 / s, 0.4 / s, -0.6 / s], rtol=1e-6)
    np.testing.assert_allclose(a[:2], [0.7302955, -1.0954433], atol=1e-6)
    # The biased std (√0.24) would give 0.8165 / −1.2247: the test tells the two apart.
    assert abs(a[0] - 0.4 / math.sqrt(0.24)) > 0.05
    # 12 ones + 8 zeros (mean 0.6, unbiased std √(20·0.24/19) ≈ 0.5026) ≈ the spec's +0.8 / −1.2.
    r20 = jnp.array([1.0] * 12 + [0.0] * 8)
    a20 = np.asarray(outcome_advantage(r20, jnp.zeros(20, jnp.int32), 1))
    np.testing.assert_allclose(a20[[0, -1]], [0.7958224, -1.1937336], atol=1e-5)


@pytest.mark.parametrize("value", [0.35, 1.0, 0.0, 0.1, 1 / 3])
def test_all_equal_group_is_exactly_zero(value):
    r = jnp.full((16,), value, jnp.float32)
    a = np.asarray(jax.jit(group_normalize, static_argnums=2)(r, jnp.zeros(16, jnp.int32), 1))
    assert np.all(a == 0.0)


def test_naive_formula_is_not_exactly_zero_for_035():
    # The hazard the max == min rule guards against (so the test above has teeth): a float32
    # segment sum of 16 × 0.35 divided by 16 is 0.35 − 6e-8, and (v − mean)/(std + eps) ≈ 0.06.
    r = jnp.full((16,), 0.35, jnp.float32)
    mean = jax.ops.segment_sum(r, jnp.zeros(16, jnp.int32), 1)[0] / 16
    assert float(r[0] - mean) != 0.0
    naive = (r - mean) / (jnp.std(r, ddof=1) + EPS)
    assert float(jnp.max(jnp.abs(naive))) > 0.01


def test_group_of_one_gets_raw_value_and_invalid_gets_zero():
    v = jnp.array([0.7, 1.0, 0.0, 5.0, -2.0], jnp.float32)
    g = jnp.array([0, 1, 1, 2, 1], jnp.int32)
    valid = jnp.array([True, True, True, True, False])
    a = np.asarray(group_normalize(v, g, 3, valid))
    # group 0 = {0.7} → raw; group 2 = {5.0} → raw; group 1 = {1, 0} (the invalid −2 excluded):
    # mean 0.5, unbiased std √0.5 → ±0.5/√0.5 = ±0.70711.
    np.testing.assert_allclose(a, [0.7, 0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS), 5.0, 0.0], rtol=1e-6)


def test_memory_advantage_pools_all_turns_of_all_trajectories():
    # Question 0: trajectory A has 3 turns, trajectory B has 2; question 1: trajectory C, 2 turns.
    r_mem = np.array([-0.04, 0.10, 0.02, 0.30, -0.20, 0.5, 0.5, 0.0], np.float32)
    traj = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    qid_of_traj = np.array([0, 0, 1])
    groups = qid_of_traj[traj]
    valid = np.array([True] * 7 + [False])
    a = np.asarray(memory_advantage(jnp.asarray(r_mem), jnp.asarray(groups), 2, jnp.asarray(valid)))
    pooled = r_mem[:5].astype(np.float64)
    expected_q0 = (pooled - pooled.mean()) / (pooled.std(ddof=1) + EPS)
    np.testing.assert_allclose(a[:5], expected_q0, rtol=1e-5)
    assert len(set(np.round(a[:3], 6))) == 3  # turns of one trajectory get different values
    # Per-trajectory normalisation would differ: trajectory A alone has a different mean.
    per_traj = (r_mem[:3] - r_mem[:3].mean()) / (r_mem[:3].std(ddof=1) + EPS)
    assert not np.allclose(a[:3], per_traj, atol=1e-3)
    np.testing.assert_array_equal(a[5:], [0.0, 0.0, 0.0])  # all-equal valid group, then padding


def np_scatter(values, rows, starts, ends, valid, shape):
    out = np.zeros(shape, np.float32)
    for v, r, s, e, ok in zip(values, rows, starts, ends, valid):
        if ok:
            out[r, s:e] = v
    return out


def test_scatter_span_values_against_loop():
    values = np.array([0.5, -1.25, 2.0, 9.0, 3.0, 0.125], np.float32)
    rows = np.array([0, 0, 2, 1, 3, 3])
    starts = np.array([1, 5, 0, 2, 6, 9])
    ends = np.array([4, 6, 3, 7, 9, 12])  # row 3: adjacent spans [6,9) and [9,12) (T = 12)
    valid = np.array([True, True, True, False, True, True])
    out = np.asarray(jax.jit(scatter_span_values, static_argnums=5)(values, rows, starts, ends, valid, (4, 12)))
    ref = np_scatter(values, rows, starts, ends, valid, (4, 12))
    np.testing.assert_array_equal(out, ref)
    assert np.all(out[1] == 0.0)  # the invalid span wrote nothing
    assert np.count_nonzero(out) == 3 + 1 + 3 + 3 + 3


_scatter_jit = jax.jit(scatter_span_values, static_argnums=5)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_scatter_random_non_overlapping(data):
    b, t, m_pad = 3, 16, 12
    spans = []
    for r in range(b):
        cuts = sorted(data.draw(st.lists(st.integers(0, t), min_size=0, max_size=8, unique=True)))
        for s, e in zip(cuts[::2], cuts[1::2]):
            spans.append((r, s, e))
    m = len(spans)
    vals = np.asarray(data.draw(st.lists(st.floats(-3, 3, width=32), min_size=m_pad, max_size=m_pad)), np.float32)
    valid = np.asarray(data.draw(st.lists(st.booleans(), min_size=m_pad, max_size=m_pad)), bool)
    valid[m:] = False  # padding spans (row 0, [0, 16)) would overwrite row 0 if they were used
    spans += [(0, 0, t)] * (m_pad - m)
    rows, starts, ends = (np.array([s[i] for s in spans], np.int32) for i in range(3))
    out = _scatter_jit(vals, rows, starts, ends, valid, (b, t))
    np.testing.assert_array_equal(np.asarray(out), np_scatter(vals, rows, starts, ends, valid, (b, t)))


def test_token_advantages_end_to_end_three_questions():
    rng = np.random.default_rng(0)
    n, q, t = 16, 3, 24
    group_ids = np.repeat(np.arange(q), n)  # ids per question, before the n copies
    rewards = rng.integers(0, 2, size=q * n).astype(np.float32)
    rewards[n : 2 * n] = 0.35  # question 1: all-equal F1 rewards
    a_t = np.asarray(outcome_advantage(jnp.asarray(rewards), jnp.asarray(group_ids), q))
    np.testing.assert_allclose(a_t, np_group_normalize(rewards, group_ids), rtol=1e-5, atol=1e-6)
    assert np.all(a_t[n : 2 * n] == 0.0)
    # Rows of different questions don't interfere: changing question 2 leaves question 0 as is.
    rewards2 = rewards.copy()
    rewards2[2 * n :] = rng.random(n)
    a_t2 = np.asarray(outcome_advantage(jnp.asarray(rewards2), jnp.asarray(group_ids), q))
    np.testing.assert_array_equal(a_t2[:n], a_t[:n])
    assert not np.allclose(a_t2[2 * n :], a_t[2 * n :])
    # Whole-batch normalisation would give something else.
    whole = (rewards - rewards.mean()) / (rewards.std(ddof=1) + EPS)
    assert not np.allclose(a_t[:n], whole[:n], atol=1e-3)

    # Two <mem> turns per trajectory at fixed spans; memory advantage pooled per question.
    rows = np.repeat(np.arange(q * n), 2)
    starts = np.tile([2, 10], q * n)
    ends = np.tile([6, 13], q * n)
    r_mem = rng.normal(size=2 * q * n).astype(np.float32)
    mem_valid = np.ones(2 * q * n, bool)
    a_m = memory_advantage(jnp.asarray(r_mem), jnp.asarray(group_ids[rows]), q, jnp.asarray(mem_valid))
    np.testing.assert_allclose(np.asarray(a_m), np_group_normalize(r_mem, group_ids[rows]), rtol=1e-4, atol=1e-5)
    mem_tok = scatter_span_values(a_m, rows, starts, ends, mem_valid, (q * n, t))
    loss_mask = np.zeros((q * n, t), np.float32)
    loss_mask[:, 1:20] = 1.0
    adv = np.asarray(token_advantages(jnp.asarray(a_t), mem_tok, jnp.asarray(loss_mask)))
    assert adv.shape == (48, t)
    ref = (a_t[:, None] + np_scatter(np.asarray(a_m), rows, starts, ends, mem_valid, (q * n, t))) * loss_mask
    np.testing.assert_allclose(adv, ref, rtol=1e-6)
    np.testing.assert_allclose(adv[:, 7:10], np.repeat(a_t[:, None], 3, 1), rtol=1e-6)  # no <mem>: A_T only
    assert np.all(adv[:, 0] == 0.0) and np.all(adv[:, 20:] == 0.0)  # loss mask 0


_group_normalize_jit = jax.jit(group_normalize, static_argnums=2)
_PAD_N, _MAX_GROUPS = 64, 5


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_group_mean_zero_std_one(data):
    num_groups = data.draw(st.integers(1, _MAX_GROUPS))
    sizes = data.draw(st.lists(st.integers(2, 12), min_size=num_groups, max_size=num_groups))
    # Rewards on a 0.25 grid: distinct values are >= 0.25 apart, so eps is negligible.
    vals, gids = [], []
    for g, size in enumerate(sizes):
        vals += data.draw(st.lists(st.integers(0, 8), min_size=size, max_size=size))
        gids += [g] * size
    n = len(vals)
    perm = np.asarray(data.draw(st.permutations(list(range(n)))))
    v = (np.asarray(vals, np.float32) * 0.25)[perm]
    g = np.asarray(gids, np.int32)[perm]
    # Pad to one static shape (padding: invalid, garbage values and ids) so jit compiles once.
    vp = np.concatenate([v, np.full(_PAD_N - n, 99.0, np.float32)])
    gp = np.concatenate([g, np.zeros(_PAD_N - n, np.int32)])
    valid = np.arange(_PAD_N) < n
    out = np.asarray(_group_normalize_jit(vp, gp, _MAX_GROUPS, valid))
    assert np.all(out[n:] == 0.0)
    out = out[:n]
    np.testing.assert_allclose(out, np_group_normalize(v, g), rtol=1e-4, atol=1e-5)
    for k in range(num_groups):
        o, vk = out[g == k], v[g == k]
        if np.all(vk == vk[0]):
            assert np.all(o == 0.0)
        else:
            assert abs(o.mean()) < 1e-5
            assert o.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_centred_memory_advantage_subtracts_the_group_mean_only():
    # Two groups; R_M in probability units, one padding turn. Golden values by hand.
    r_mem = np.asarray([0.010, 0.012, 0.008, 0.5, -0.1, 9.0], np.float32)
    groups = np.asarray([0, 0, 0, 1, 1, 0], np.int32)
    valid = np.asarray([True, True, True, True, True, False])
    a = np.asarray(memory_advantage(jnp.asarray(r_mem), jnp.asarray(groups), 2, jnp.asarray(valid), "center"))
    np.testing.assert_allclose(a, [0.0, 0.002, -0.002, 0.3, -0.3, 0.0], atol=1e-7)
    z = np.asarray(memory_advantage(jnp.asarray(r_mem), jnp.asarray(groups), 2, jnp.asarray(valid)))
    np.testing.assert_allclose(z[:3], [0.0, 1.0, -1.0], atol=1e-3)  # the spec's z-score blows noise up to +-1
    with pytest.raises(ValueError, match=r"known: \['center', 'zscore'\]"):
        memory_advantage(jnp.asarray(r_mem), jnp.asarray(groups), 2, jnp.asarray(valid), "mean")


_GROUP_NORMALIZE = jax.jit(group_normalize, static_argnums=2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=2, max_size=5), min_size=1, max_size=6))
def test_zero_std_group_share_counts_the_groups_whose_outcome_advantage_is_zero(groups):
    """``critic/score/zero_std_groups``: the share of groups that GRPO's normalisation zeroes."""
    from mempo_jax.rl.group_filter import zero_std_group_share

    rewards = np.array([r for g in groups for r in g], np.float32)
    ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int32)
    n = len(rewards)  # padded to one shape: one compile of the normalisation for every example
    a = np.asarray(_GROUP_NORMALIZE(np.pad(rewards, (0, 30 - n)), np.pad(ids, (0, 30 - n)), 6, np.arange(30) < n))[:n]
    zeroed = [bool(np.all(a[ids == g] == 0.0)) for g in range(len(groups))]
    perm = np.random.default_rng(n).permutation(n)  # the order of the trajectories does not matter
    assert zero_std_group_share(rewards[perm], ids[perm]) == pytest.approx(np.mean(zeroed))
    assert zero_std_group_share(np.zeros(0), np.zeros(0, np.int32)) == 0.0
