"""Tests for mempo_jax.rl.losses: hand-computed PPO/dual-clip/KL values and gradient accumulation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.rl.losses import (
    LossConfig,
    aggregate_loss,
    loss_denominator,
    kl_penalty,
    mempo_loss,
    policy_loss,
    safe_divide,
)

CFG = LossConfig()


def _row(*xs):
    return jnp.asarray([xs], jnp.float32)


def test_loss_config_defaults_and_validation():
    assert (CFG.clip_ratio_low, CFG.clip_ratio_high, CFG.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert (CFG.kl_coef, CFG.kl_type, CFG.entropy_coef, CFG.loss_agg_mode) == (0.001, "low_var_kl", 0.0, "token-mean")
    with pytest.raises(ValueError, match="'k9'"):
        LossConfig(kl_type="k9")
    with pytest.raises(ValueError, match="'mean'"):
        LossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError):
        LossConfig(clip_ratio_c=1.0)


def test_policy_loss_hand_values():
    # columns: (A, ratio) → expected per-token loss, ε-clipped?, worked by hand:
    cases = [
        (1.0, 1.5, -1.2, 1.0),  # max(-1.5, -1.2) = -1.2, clip active
        (1.0, 0.5, -0.5, 0.0),  # max(-0.5, -0.8) = -0.5
        (1.0, 1.1, -1.1, 0.0),  # inside the trust region
        (-1.0, 0.5, 0.8, 1.0),  # max(0.5, 0.8) = 0.8; dual min(3, 0.8) = 0.8
        (-1.0, 1.5, 1.5, 0.0),  # max(1.5, 1.2) = 1.5 (< 3)
        (-2.0, 10.0, 6.0, 0.0),  # max(20, 2.4) = 20, dual clip → c·|A| = 6
        (0.0, 7.0, 0.0, 0.0),
    ]
    adv = _row(*[c[0] for c in cases])
    old = jnp.full_like(adv, -1.0)
    logp = old + jnp.log(_row(*[c[1] for c in cases]))
    mask = jnp.ones_like(adv)
    pg, clipped, ppo_kl = policy_loss(logp, old, adv, mask, CFG)
    np.testing.assert_allclose(pg[0], [c[2] for c in cases], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(clipped[0], [c[3] for c in cases])
    np.testing.assert_allclose(ppo_kl[0], -np.log([c[1] for c in cases]), rtol=1e-5, atol=1e-6)


def test_asymmetric_clip_and_ratio_clamp():
    cfg = LossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3)
    adv = _row(1.0, -1.0, -1.0, 1.0)
    old = jnp.zeros_like(adv)
    logp = _row(math.log(1.5), math.log(0.5), 50.0, 50.0)
    pg, clipped, ppo_kl = policy_loss(logp, old, adv, jnp.ones_like(adv), cfg)
    # 1.5 → clip at 1.3 → -1.3;  0.5 → clip at 0.9 → max(0.5, 0.9) = 0.9;
    # log-ratio 50 → clamped to 20: A<0 → capped at c·|A| = 3;  A>0 → clip 1.3 → -1.3.
    np.testing.assert_allclose(pg[0], [-1.3, 0.9, 3.0, -1.3], rtol=1e-6)
    np.testing.assert_array_equal(clipped[0], [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(ppo_kl[0, 2:], [-20.0, -20.0])  # verl: ppo_kl of the clamped ratio
    assert np.all(np.isfinite(pg))


def test_dual_clip_gradient_is_zero_when_capped():
    adv = _row(-2.0, -2.0)
    old = jnp.zeros_like(adv)
    g = jax.grad(lambda lp: jnp.sum(policy_loss(lp, old, adv, jnp.ones_like(adv), CFG)[0]))(
        _row(math.log(10.0), math.log(1.1))
    )
    # capped token: constant 6 → no gradient; in-region token: d(-A·e^lp)/dlp = 2·1.1.
    np.testing.assert_allclose(g[0], [0.0, 2.2], rtol=1e-5)


def test_policy_loss_masks_output():
    adv = _row(1.0, 1.0)
    pg, clipped, ppo_kl = policy_loss(_row(0.5, 0.5), _row(0.0, 0.0), adv, _row(1, 0), CFG)
    assert float(pg[0, 1]) == 0.0 and float(clipped[0, 1]) == 0.0 and float(ppo_kl[0, 1]) == 0.0
    assert float(pg[0, 0]) == pytest.approx(-1.2)


def test_kl_estimators_hand_values():
    logp = _row(-1.0, -2.0, -0.5)
    ref = _row(-2.0, -1.0, -0.5)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1")[0], [1.0, -1.0, 0.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "kl")[0], [1.0, -1.0, 0.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "abs")[0], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2")[0], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "mse")[0], [0.5, 0.5, 0.0])
    # k3: kl = ref - logp; e^kl - kl - 1:  kl=-1 → e^-1 = 0.367879;  kl=1 → e - 2 = 0.718282.
    k3 = [math.exp(-1.0), math.e - 2.0, 0.0]
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3")[0], k3, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kl_penalty(logp, ref, "low_var_kl")[0], k3, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(logp, ref, "k4")


def test_k3_clamps():
    # kl = 2 → e² - 3 = 4.389056 (below the output clamp); kl = -5 → e^-5 + 4 = 4.006738.
    logp = _row(0.0, 0.0, 0.0, -30.0, -1000.0, -jnp.inf)
    ref = _row(2.0, -5.0, -30.0, 0.0, 0.0, 0.0)
    k3 = np.asarray(kl_penalty(logp, ref, "k3")[0])
    np.testing.assert_allclose(k3[:2], [math.exp(2) - 3, math.exp(-5) + 4], rtol=1e-6)
    # kl = -30 → clamped to -20 → e^-20 + 19 → output clamp 10; kl = +30, +1000, +inf → 10.
    np.testing.assert_array_equal(k3[2:], [10.0, 10.0, 10.0, 10.0])  # finite even for logp = -inf
    # k1 and k2 are not clamped.
    assert float(kl_penalty(logp, ref, "k1")[0, 3]) == -30.0
    assert float(kl_penalty(logp, ref, "k2")[0, 2]) == pytest.approx(450.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_gradient_moves_logp_toward_ref(kind):
    ref = _row(-1.0, -1.0)
    start = _row(-0.4, -2.3)  # above and below the reference
    grad_fn = jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, kind)))
    g = np.asarray(grad_fn(start)[0])
    if kind == "k1":  # k1's gradient is constant 1: it only pushes logp down (not toward ref)
        np.testing.assert_allclose(g, [1.0, 1.0])
        return
    assert g[0] > 0 and g[1] < 0  # descent lowers the first, raises the second
    lp = start
    for _ in range(20):
        lp = lp - 0.1 * grad_fn(lp)
    assert np.all(np.abs(np.asarray(lp - ref)) < np.abs(np.asarray(start - ref)))
    if kind == "k3":  # analytic: d/dlogp (e^(ref-lp) - (ref-lp) - 1) = 1 - e^(ref-lp)
        np.testing.assert_allclose(g, [1 - math.exp(-0.6), 1 - math.exp(1.3)], rtol=1e-6)


def _np_agg(v, m, mode, length=None):
    v, m = np.asarray(v, np.float64), np.asarray(m, np.float64)
    has = m.sum(1) > 0
    if mode == "token-mean":
        return (v * m).sum(), m.sum()
    if mode == "seq-mean-token-mean":
        return sum((v[i] * m[i]).sum() / m[i].sum() for i in range(len(v)) if has[i]), has.sum()
    if mode == "seq-mean-token-sum":
        return (v * m).sum(), has.sum()
    return (v * m).sum() / (length or v.shape[1]), has.sum()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregate_loss_hand_and_reference(mode):
    v = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0], [8.0, 8.0, 8.0, 8.0]], np.float32)
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    total, den = aggregate_loss(v, m, mode)
    hand = {
        "token-mean": (3 + 22, 6),  # 25/6
        "seq-mean-token-mean": (1.5 + 5.5, 2),  # the all-masked row counts nowhere
        "seq-mean-token-sum": (25, 2),
        "seq-mean-token-sum-norm": (25 / 4, 2),
    }[mode]
    np.testing.assert_allclose([float(total), float(den)], hand, rtol=1e-6)
    np.testing.assert_allclose([float(total), float(den)], _np_agg(v, m, mode), rtol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregate_loss_over_packed_sequences_equals_the_unpacked_rows(mode):
    """The hand rows above packed into one row (segments 1, 2, 3; two padding columns): every
    mode gives the unpacked value, sequences counted per segment (norm length fixed at 4)."""
    v = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0], [8.0, 8.0, 8.0, 8.0]], np.float32)
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    pv = np.concatenate([v.reshape(-1), [5.0, 5.0]])[None]
    pm = np.concatenate([m.reshape(-1), [0.0, 0.0]])[None]
    seg = np.array([[1] * 4 + [2] * 4 + [3] * 4 + [0, 0]], np.int32)
    got = aggregate_loss(pv, pm, mode, norm_length=4, segment_ids=seg)
    np.testing.assert_allclose([float(x) for x in got], _np_agg(v, m, mode, 4), rtol=1e-6)
    np.testing.assert_allclose(float(loss_denominator(pm, mode, seg)), _np_agg(v, m, mode, 4)[1])


def test_aggregate_ignores_nan_off_mask_and_unknown_mode():
    v = jnp.asarray([[1.0, jnp.nan, jnp.inf]])
    total, den = aggregate_loss(v, jnp.asarray([[1, 0, 0]]), "token-mean")
    assert float(total) == 1.0 and float(den) == 1.0
    with pytest.raises(ValueError, match="'sum'"):
        aggregate_loss(v, v, "sum")
    assert float(safe_divide(jnp.float32(3.0), jnp.float32(0.0))) == 3.0


def _toy_batch(seed=0, b=6, t=7, d=4, v=5):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    w_old = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    w_ref = w_old + 0.3 * jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    w = w_old + 0.4 * jnp.asarray(rng.normal(size=(d, v)), jnp.float32)  # far enough to clip
    adv = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
    # Rows with very different token counts, one row fully masked.
    lengths = np.array([7, 1, 3, 0, 6, 2])
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.float32)
    ent = jnp.asarray(rng.random(size=(b, t)), jnp.float32)
    return x, ids, w_old, w_ref, w, adv, mask, ent


def _logp(w, x, ids):
    logits = jnp.einsum("btd,dv->btv", x, w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[..., None], -1)[..., 0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_full_batch(mode):
    x, ids, w_old, w_ref, w, adv, mask, ent = _toy_batch()
    cfg = LossConfig(loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01)
    old, ref = _logp(w_old, x, ids), _logp(w_ref, x, ids)

    @jax.jit
    def parts(w, x, ids, old, ref, adv, mask, ent):
        loss_sum, den, _ = mempo_loss(_logp(w, x, ids), old, ref, adv, mask, cfg, ent)
        return loss_sum, den

    batch = (x, ids, old, ref, adv, mask, ent)
    rows = lambda a, b: [arr[a:b] for arr in batch]  # noqa: E731
    grad_sum = jax.jit(jax.grad(lambda w, *bt: parts(w, *bt)[0]))
    grad_mean = jax.jit(jax.grad(lambda w, *bt: safe_divide(*parts(w, *bt))))

    g_full = grad_mean(w, *batch)
    micro = [(0, 2), (2, 6)]  # 8 tokens vs 11 tokens
    den_total = sum(parts(w, *rows(a, b))[1] for a, b in micro)
    g_acc = sum(grad_sum(w, *rows(a, b)) for a, b in micro) / den_total
    np.testing.assert_allclose(g_acc, g_full, rtol=1e-5, atol=1e-7)
    # Averaging per-micro-batch means is a different (wrong) gradient: the test has teeth.
    g_naive = sum(grad_mean(w, *rows(a, b)) for a, b in micro) / len(micro)
    assert not np.allclose(g_naive, g_full, rtol=1e-3, atol=1e-5)


def test_mempo_loss_composition_and_metrics():
    x, ids, w_old, w_ref, w, adv, mask, ent = _toy_batch(seed=1)
    cfg = LossConfig(kl_coef=0.05, entropy_coef=0.02, kl_type="k3")
    logp, old, ref = _logp(w, x, ids), _logp(w_old, x, ids), _logp(w_ref, x, ids)
    loss_sum, den, met = mempo_loss(logp, old, ref, adv, mask, cfg, ent)
    m = np.asarray(mask, np.float64)
    # numpy reference of the token-mean objective
    ratio = np.exp(np.clip(np.asarray(logp - old, np.float64), -20, 20))
    a = np.asarray(adv, np.float64)
    l1, l2 = -a * ratio, -a * np.clip(ratio, 0.8, 1.2)
    pg = np.where(a < 0, np.minimum(np.maximum(l1, l2), -a * 3.0), np.maximum(l1, l2))
    kl_in = np.clip(np.asarray(ref - logp, np.float64), -20, 20)
    k3 = np.clip(np.exp(kl_in) - kl_in - 1, -10, 10)
    e = np.asarray(ent, np.float64)
    np.testing.assert_allclose(float(den), m.sum())
    np.testing.assert_allclose(float(loss_sum), ((pg + 0.05 * k3 - 0.02 * e) * m).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(met["pg_loss"]), (pg * m).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(met["kl"]), (k3 * m).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(met["entropy"]), (e * m).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(met["clipfrac"]), ((l2 > l1) * m).sum())
    np.testing.assert_allclose(float(met["ppo_kl"]), (np.asarray(old - logp) * m).sum(), rtol=1e-4, atol=1e-5)
    assert 0 < float(met["clipfrac"]) < m.sum()  # the toy batch really exercises clipping
    with pytest.raises(ValueError):
        mempo_loss(logp, old, None, adv, mask, cfg, ent)
    with pytest.raises(ValueError):
        mempo_loss(logp, old, ref, adv, mask, cfg, None)
    s0, _, met0 = mempo_loss(logp, old, None, adv, mask, LossConfig(kl_coef=0.0))
    np.testing.assert_allclose(float(s0), (pg * m).sum(), rtol=1e-5)
    assert float(met0["kl"]) == 0.0 and float(met0["entropy"]) == 0.0


def test_lr_schedule_warmup_then_cosine_decay_golden():
    from mempo_jax.rl.learner import OptimConfig, lr_schedule

    s = lr_schedule(OptimConfig(learning_rate=2.0, warmup_steps=4, decay_steps=8, final_lr_fraction=0.25))
    got = np.array([float(s(i)) for i in range(14)])
    # warm-up 2*(i+1)/4; then 2*(0.25 + 0.75*(1 + cos(pi*j/8))/2) for j = 0..8, then held at 0.5.
    want = [0.5, 1.0, 1.5, 2.0] + [2 * (0.25 + 0.75 * (1 + np.cos(np.pi * j / 8)) / 2) for j in range(9)] + [0.5]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    const = lr_schedule(OptimConfig(learning_rate=1e-3, warmup_steps=1))
    assert float(const(0)) == pytest.approx(1e-3)  # the first update is not a zero step
    with pytest.raises(ValueError, match="final_lr_fraction"):
        lr_schedule(OptimConfig(final_lr_fraction=1.5))
