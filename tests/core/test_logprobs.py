"""Chunked log-probs and entropies: the same values and gradients as the unchunked formula
(``log_softmax`` over ``[rows, length, vocab]``, shifted by one, column 0 zero), at any chunk size
and temperature, from logits or from the model's hidden states and LM head; and the update
program built from them keeps no ``[rows, length, vocab]`` float32 buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import without_shape_checks
from mempo_jax.core.logprobs import shifted_logprobs, target_logprobs, token_entropy, token_logprobs
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, packed_positions, split_model, token_stats

VOCAB = 96


def reference(logits, ids, temperature):
    """The unchunked formula: full float32 log-softmax, shifted by one; column 0 is 0."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    lsm = jnp.concatenate([lsm[:, :1], lsm[:, :-1]], axis=1)
    logp = jnp.take_along_axis(lsm, ids[..., None], axis=-1)[..., 0].at[:, 0].set(0.0)
    ent = (-jnp.sum(jnp.exp(lsm) * lsm, axis=-1)).at[:, 0].set(0.0)
    return logp, ent


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logits_match_the_unchunked_formula_and_its_gradient(chunk, temperature):
    rng = np.random.RandomState(chunk)
    logits = jnp.asarray(3 * rng.randn(3, 10, VOCAB), jnp.float32)
    ids = jnp.asarray(rng.randint(0, VOCAB, (3, 10)), jnp.int32)
    w = jnp.asarray(rng.randn(3, 10), jnp.float32)
    want_lp, want_ent = reference(logits, ids, temperature)
    lp, ent = shifted_logprobs(logits, ids, temperature=temperature, chunk=chunk, entropy=True)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)
    assert np.all(np.asarray(lp)[:, 0] == 0) and np.all(np.asarray(ent)[:, 0] == 0)
    np.testing.assert_allclose(token_logprobs(logits, ids, temperature, chunk), want_lp, atol=2e-5)
    np.testing.assert_allclose(token_entropy(logits, temperature, chunk), want_ent, atol=2e-5)

    def loss(fn):
        return lambda x: jnp.sum(w * fn(x)[0]) + 0.3 * jnp.sum(w * fn(x)[1])

    g = jax.grad(loss(lambda x: shifted_logprobs(x, ids, temperature=temperature, chunk=chunk, entropy=True)))(logits)
    g_ref = jax.grad(loss(lambda x: reference(x, ids, temperature)))(logits)
    np.testing.assert_allclose(g, g_ref, atol=2e-5)


def test_target_logprobs_scores_given_targets_without_shift():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(2, 5, VOCAB), jnp.float32)
    tgt = jnp.asarray(rng.randint(0, VOCAB, (2, 5)), jnp.int32)
    lp, ent = target_logprobs(logits, tgt, temperature=2.0, chunk=2)
    want = jnp.take_along_axis(jax.nn.log_softmax(logits / 2.0), tgt[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(lp, want, atol=1e-6)
    assert ent is None
    with without_shape_checks(), pytest.raises(ValueError, match="disagree"):
        target_logprobs(logits, tgt[:, :4])


@pytest.fixture(scope="module", params=["tied", "untied"])
def model(request):
    cfg = ModelConfig.tiny(VOCAB, num_layers=2, tie_embeddings=request.param == "tied")
    graphdef, params = split_model(create_model(cfg, seed=1))
    return graphdef, params


def _loss_and_grad(stats, params, w):
    def loss(p):
        lp, ent = stats(p)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(w * ent)

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable"])
def test_model_hidden_path_matches_full_logits_values_and_gradients(model, remat):
    """``token_stats`` over the LM head in 4-position chunks (padded rows and packed rows) equals
    the unchunked formula over ``LogitsFn``'s full logits, value and gradient w.r.t. every
    parameter, at temperature 0.7; decoder-layer remat changes nothing."""
    graphdef, params = model
    rng = np.random.RandomState(2)
    ids = jnp.asarray(rng.randint(0, VOCAB, (2, 11)), jnp.int32)
    valid = jnp.asarray(np.arange(11)[None, :] >= np.array([[0], [3]]))  # row 1 left-padded
    w = jnp.asarray(rng.randn(2, 11), jnp.float32) * valid
    full = make_logits_fn(graphdef)
    chunked = make_logits_fn(graphdef, logit_chunk=4, remat=remat)
    v_ref, g_ref = _loss_and_grad(lambda p: reference(full(p, ids, valid), ids, 0.7), params, w)
    v, g = _loss_and_grad(lambda p: token_stats(chunked, p, ids, valid=valid, temperature=0.7, entropy=True),
                          params, w)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g, g_ref)

    seg = np.array([[1] * 4 + [2] * 7, [1] * 6 + [2] * 3 + [0] * 2], np.int32)
    pos = jnp.asarray(packed_positions(seg))
    seg = jnp.asarray(seg)
    v_ref, g_ref = _loss_and_grad(lambda p: reference(full.packed(p, ids, seg, pos), ids, 0.7), params, w)
    v, g = _loss_and_grad(lambda p: token_stats(chunked, p, ids, segment_ids=seg, positions=pos, temperature=0.7,
                                                entropy=True), params, w)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g, g_ref)


def test_gradient_program_keeps_no_rows_by_length_by_vocab_buffer():
    """XLA's temporaries of the log-prob gradient stay below one float32 ``[rows, length, vocab]``
    block (the unchunked formula's program holds several)."""
    cfg = ModelConfig.tiny(32768, num_layers=1)
    graphdef, params = split_model(create_model(cfg, seed=0))
    rows, length = 4, 512
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    valid = jax.ShapeDtypeStruct((rows, length), jnp.bool_)
    block = rows * length * cfg.vocab_size * 4
    full, chunked = make_logits_fn(graphdef), make_logits_fn(graphdef, logit_chunk=16)

    def temp(stats):
        grad = jax.jit(jax.grad(lambda p, i, v: jnp.sum(sum(stats(p, i, v)))))
        return grad.lower(params, ids, valid).compile().memory_analysis().temp_size_in_bytes

    unchunked = temp(lambda p, i, v: reference(full(p, i, v), i, 1.0))
    small = temp(lambda p, i, v: token_stats(chunked, p, i, valid=v, entropy=True))
    assert small < block < unchunked


def test_bfloat16_reference_weights_give_close_logprobs():
    """``ExecutionConfig.reference_dtype = "bfloat16"``: the reference's log-probs from bfloat16
    weights stay within bfloat16 rounding of the float32 ones."""
    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer

    cfg = ModelConfig.tiny(VOCAB, num_layers=2)
    graphdef, params = split_model(create_model(cfg, seed=4))
    ids = np.random.RandomState(0).randint(0, VOCAB, (4, 16)).astype(np.int32)
    valid = np.ones((4, 16), bool)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig()))
    f32 = learner.detached_logprobs(params, ids, valid)
    bf16 = learner.detached_logprobs(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), ids, valid)
    assert 0 < np.abs(bf16 - f32).max() < 0.05
