"""Decoder tests: RoPE, GQA, causality, padding, KV cache, parameter counts, config validation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.core.logprobs import token_logprobs
from mempo_jax.model.config import PRESETS, ModelConfig
from mempo_jax.model.decoder import init_cache
from mempo_jax.model.forward import (
    abstract_model,
    create_model,
    make_logits_fn,
    merge_model,
    positions_from_mask,
    sequence_logprobs,
    split_model,
)
from mempo_jax.model.layers import apply_rope, rope_inv_freq

VOCAB = 128


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny(VOCAB)
    graphdef, params = split_model(create_model(cfg, seed=0))
    return cfg, graphdef, params, jax.jit(make_logits_fn(graphdef))


def _ids(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).randint(0, VOCAB, shape), jnp.int32)


# ---------------------------------------------------------------------------------------- RoPE


def _np_inv_freq(head_dim, theta, scaling):
    """Scalar-loop reference of HF's default + llama3 inverse frequencies (float64)."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        if scaling:
            s = dict(scaling)
            wavelen = 2 * math.pi / f
            lo_w = s["original_max_position_embeddings"] / s["low_freq_factor"]
            hi_w = s["original_max_position_embeddings"] / s["high_freq_factor"]
            if wavelen < hi_w:
                pass
            elif wavelen > lo_w:
                f = f / s["factor"]
            else:
                smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                    s["high_freq_factor"] - s["low_freq_factor"])
                f = (1 - smooth) * f / s["factor"] + smooth * f
        out.append(f)
    return np.array(out)


def _np_rope_complex(x, positions, inv_freq):
    """Rotate-half RoPE as complex multiplication of the pairs (x[i], x[i + d/2])."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    z = z * np.exp(1j * positions[..., None, None] * inv_freq)
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("preset", ["qwen2_5_0_5b", "llama3_2_1b", "llama3_1_8b"])
def test_rope_inv_freq_matches_reference(preset):
    cfg = PRESETS[preset]()
    ref = _np_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(rope_inv_freq(cfg), ref, rtol=2e-6)
    if cfg.rope_scaling:  # scaling really changed the low frequencies
        assert not np.allclose(_np_inv_freq(cfg.head_dim, cfg.rope_theta, None), ref)


def test_apply_rope_matches_complex_reference():
    rng = np.random.RandomState(0)
    x = rng.randn(2, 5, 3, 16).astype(np.float32)
    pos = rng.randint(0, 500, (2, 5)).astype(np.int32)
    cfg = ModelConfig.llama3_2_1b().replace(head_dim=16)
    inv = rope_inv_freq(cfg)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), inv))
    np.testing.assert_allclose(got, _np_rope_complex(x, pos, inv.astype(np.float64)), atol=2e-4)
    # Relative: <rope(q, m), rope(k, n)> depends on m - n only.
    q, k = rng.randn(1, 1, 1, 16).astype(np.float32), rng.randn(1, 1, 1, 16).astype(np.float32)
    dot = lambda m, n: float(np.sum(np.asarray(apply_rope(q, jnp.array([[m]]), inv))  # noqa: E731
                                    * np.asarray(apply_rope(k, jnp.array([[n]]), inv))))
    assert dot(7, 3) == pytest.approx(dot(104, 100), abs=1e-4)
    assert dot(7, 3) != pytest.approx(dot(7, 4), abs=1e-3)


# ----------------------------------------------------------------------------------- attention


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = ModelConfig.tiny(VOCAB, num_layers=2)
    mha_cfg = gqa_cfg.replace(num_kv_heads=gqa_cfg.num_heads)
    groups = gqa_cfg.num_groups
    g_def, g_params = split_model(create_model(gqa_cfg, seed=1))
    m_def, m_params = split_model(create_model(mha_cfg, seed=2))
    src, dst = g_params["layers"]["attn"], m_params["layers"]["attn"]  # [layers, ...] each
    for name in ("q", "o"):
        dst[name].set_value(src[name].get_value())
    for name in ("k", "v"):  # kv head j serves query heads j*G .. j*G+G-1 (HF repeat_kv)
        dst[name].set_value(jnp.repeat(src[name].get_value(), groups, axis=2))
    for name in ("attn_norm", "mlp_norm"):
        m_params["layers"][name]["weight"].set_value(g_params["layers"][name]["weight"].get_value())
    for name in ("gate", "up", "down"):
        m_params["layers"]["mlp"][name].set_value(g_params["layers"]["mlp"][name].get_value())
    m_params["embed"].set_value(g_params["embed"].get_value())
    ids, mask = _ids(3, (2, 12)), jnp.ones((2, 12), bool)
    a = make_logits_fn(g_def)(g_params, ids, mask)
    b = make_logits_fn(m_def)(m_params, ids, mask)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # A wrong mapping (tile instead of repeat) gives different logits: the test can fail.
    for name in ("k", "v"):
        m_params["layers"]["attn"][name].set_value(jnp.tile(g_params["layers"]["attn"][name].get_value(), (1, 1, groups, 1)))
    c = make_logits_fn(m_def)(m_params, ids, mask)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-4


def test_causal_future_tokens_do_not_change_past_logits(tiny):
    _, _, params, logits_fn = tiny
    ids = _ids(4, (2, 16))
    changed = ids.at[:, 9:].set((ids[:, 9:] + 5) % VOCAB)
    mask = jnp.ones((2, 16), bool)
    a, b = np.asarray(logits_fn(params, ids, mask)), np.asarray(logits_fn(params, changed, mask))
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_left_and_right_padding_do_not_change_real_token_logits(tiny):
    _, _, params, logits_fn = tiny
    ids = _ids(5, (1, 10))
    ref = np.asarray(logits_fn(params, ids, jnp.ones((1, 10), bool)))[0]
    left = jnp.concatenate([jnp.full((1, 6), 7, jnp.int32), ids], axis=1)
    left_mask = jnp.arange(16)[None] >= 6
    right = jnp.concatenate([ids, jnp.full((1, 6), 7, jnp.int32)], axis=1)
    right_mask = jnp.arange(16)[None] < 10
    np.testing.assert_allclose(np.asarray(logits_fn(params, left, left_mask))[0, 6:], ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits_fn(params, right, right_mask))[0, :10], ref, atol=1e-5)
    np.testing.assert_array_equal(positions_from_mask(left_mask)[0], [0] * 7 + list(range(1, 10)))


def test_kv_cache_incremental_equals_full_forward(tiny):
    cfg, graphdef, params, logits_fn = tiny
    ids = _ids(6, (2, 12))
    full = np.asarray(logits_fn(params, ids, jnp.ones((2, 12), bool)))
    model = merge_model(graphdef, params)
    size = 16
    cache = init_cache(cfg, 2, size)
    # Prefill 8 tokens, then 4 single-token steps (row b is slot b; positions are cache positions).
    pos = jnp.broadcast_to(jnp.arange(12)[None], (2, 12)).astype(jnp.int32)
    logits, cache = model(ids[:, :8], pos[:, :8], cache=cache, block_k=4)
    np.testing.assert_allclose(np.asarray(logits), full[:, :8], atol=1e-5)
    for t in range(8, 12):
        logits, cache = model(ids[:, t:t + 1], pos[:, t:t + 1], cache=cache, block_k=4)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], atol=1e-5)
    assert cache.k.shape == (cfg.num_layers, 2, cfg.num_kv_heads, size, cfg.head_dim)
    assert np.all(np.asarray(cache.k)[:, :, :, 12:] == 0)  # unwritten positions untouched
    # rows: slot 1 fed from a single row; an out-of-range row writes nothing
    one = init_cache(cfg, 2, size)
    logits, one = model(ids[:1, :8], pos[:1, :8], cache=one, rows=jnp.array([1]), block_k=4)
    np.testing.assert_allclose(np.asarray(logits)[0], full[0, :8], atol=1e-5)
    assert np.all(np.asarray(one.k)[:, 0] == 0) and np.any(np.asarray(one.k)[:, 1] != 0)
    _, same = model(ids[:1, :8], pos[:1, :8], cache=one, rows=jnp.array([2]), block_k=4)
    np.testing.assert_array_equal(np.asarray(same.k), np.asarray(one.k))
    with pytest.raises(ValueError, match="attn_mask=None"):
        model(ids[:, :8], pos[:, :8], jnp.ones((2, 8, size), bool), init_cache(cfg, 2, size))


def test_sequence_logprobs_matches_manual_gather(tiny):
    _, graphdef, params, logits_fn = tiny
    ids = _ids(7, (2, 10))
    mask = jnp.arange(10)[None] < jnp.array([[10], [6]])
    logp, ent = sequence_logprobs(graphdef, params, ids, mask, temperature=0.7)
    logits = np.asarray(logits_fn(params, ids, mask), np.float64) / 0.7
    lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids_np = np.asarray(ids)
    for b, n in ((0, 10), (1, 6)):
        for t in range(1, n):
            assert logp[b, t] == pytest.approx(lsm[b, t - 1, ids_np[b, t]], abs=1e-5)
            assert ent[b, t] == pytest.approx(-(np.exp(lsm[b, t - 1]) * lsm[b, t - 1]).sum(), abs=1e-4)
    assert np.all(np.asarray(logp)[1, 6:] == 0) and logp[0, 0] == 0
    np.testing.assert_allclose(np.asarray(logp)[0], np.asarray(token_logprobs(logits_fn(params, ids, mask), ids, 0.7))[0],
                               atol=1e-6)


def test_untied_and_biased_model_runs_and_bfloat16_is_close():
    cfg = ModelConfig.tiny(VOCAB, num_layers=2, qkv_bias=True, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=3))
    assert "lm_head" in params and "q_bias" in params["layers"]["attn"]
    ids, mask = _ids(8, (2, 8)), jnp.ones((2, 8), bool)
    f32 = np.asarray(make_logits_fn(graphdef)(params, ids, mask))
    bf_def, _ = split_model(create_model(cfg.replace(dtype="bfloat16"), seed=3))
    bf16 = make_logits_fn(bf_def)(params, ids, mask)
    assert bf16.dtype == jnp.float32
    assert np.abs(np.asarray(bf16) - f32).max() < 5e-2


# -------------------------------------------------------------------------------- param counts


def test_tiny_param_count_equals_analytic(tiny):
    cfg, _, params, _ = tiny
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    untied = cfg.replace(tie_embeddings=False, qkv_bias=True)
    _, p2 = split_model(create_model(untied, seed=0))
    assert sum(x.size for x in jax.tree.leaves(p2)) == untied.num_params()
    assert 0.5e6 < cfg.num_params() < 3e6


@pytest.mark.parametrize("std", [0.02, 0.1])
def test_initializer_range_sets_the_weight_std(std):
    _, params = split_model(create_model(ModelConfig.tiny(VOCAB, initializer_range=std), seed=0))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    # Layer weights carry a leading [layers] axis: each layer's matrices (norms are ones, biases zeros).
    mats = [m for path, x in flat for m in (np.asarray(x) if "layers" in jax.tree_util.keystr(path) else [np.asarray(x)])
            if m.ndim >= 2]
    assert len(mats) >= 1 + 7 * ModelConfig.tiny(VOCAB).num_layers
    for m in mats:  # each matrix has >= 4096 entries: the sample std is within ~3 %
        assert abs(m.std() / std - 1.0) < 0.05


PUBLISHED = {  # rounded sizes from the Hugging Face model cards
    "qwen2_5_0_5b": 0.494e9,
    "qwen2_5_1_5b": 1.54e9,
    "qwen2_5_3b": 3.09e9,
    "qwen2_5_7b": 7.61e9,
    "llama3_2_1b": 1.24e9,
    "llama3_2_3b": 3.21e9,
    "llama3_1_8b": 8.03e9,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_param_counts_match_published(preset):
    cfg = PRESETS[preset]()
    _, abstract_params = split_model(abstract_model(cfg))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
    assert counted == cfg.num_params()
    assert abs(counted - PUBLISHED[preset]) / PUBLISHED[preset] < 0.02


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(head_dim=31), "head_dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(dtype="float33"), "dtype"),
        (dict(rope_scaling=(("factor", 8.0), ("low_freq_factor", 1.0))), "rope_scaling"),
        (dict(initializer_range=0.0), "initializer_range"),
    ],
)
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.tiny(VOCAB).replace(**changes)


def test_rope_scaling_is_canonicalised_and_hashable():
    a = ModelConfig.llama3_1_8b()
    b = a.replace(rope_scaling=tuple(reversed(a.rope_scaling)))
    assert a == b and hash(a) == hash(b)
