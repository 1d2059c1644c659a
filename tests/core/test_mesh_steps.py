"""Sharded PPO step on 8 emulated CPU devices: one step agrees across meshes (data, fsdp, tensor)
= (1,1,1), (8,1,1), (1,8,1), (2,2,2), and the parameters, optimizer state, batches and KV cache
carry the shardings their rules give. Greedy rollouts across meshes: ``test_mesh_rollouts.py``."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
from mempo_jax.rl.losses import LossConfig
from mempo_jax.model.forward import make_logits_fn
from mempo_jax.model.placement import cache_shardings
from mempo_jax.core.sharding import batch_shards, make_mesh, opt_state_shardings
from toy_agent import toy_model, toy_world

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2)]
ROWS, SEQ = 16, 24


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _names(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def relative_error(tree, ref) -> float:
    """``||tree - ref|| / ||ref||`` over all leaves (float64)."""
    d = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(_leaves(tree), _leaves(ref)))
    n = sum(float(np.sum(b.astype(np.float64) ** 2)) for b in _leaves(ref))
    return (d / n) ** 0.5


@pytest.fixture(scope="module")
def model():
    tok, env, questions = toy_world()
    cfg, graphdef, params = toy_model(tok.vocab_size, seed=0)
    return tok, env, questions, cfg, graphdef, params


@pytest.fixture(scope="module")
def ppo_batch(model):
    tok, _, _, cfg, graphdef, params = model
    rng = np.random.default_rng(0)
    ids = rng.integers(4, cfg.vocab_size, (ROWS, SEQ)).astype(np.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 1, ROWS)
    valid = np.arange(SEQ)[None] < lengths[:, None]
    loss_mask = (valid & (np.arange(SEQ)[None] >= 6)).astype(np.float32)
    lp = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig())).detached_logprobs(params, ids, valid)
    return {
        "input_ids": ids, "valid": valid, "loss_mask": loss_mask,
        # old policy a little off the current one (ratios clip), reference further off (KL > 0)
        "old_logprobs": (lp + rng.normal(0, 0.3, lp.shape) * loss_mask).astype(np.float32),
        "ref_logprobs": (lp + rng.normal(0, 0.5, lp.shape) * loss_mask).astype(np.float32),
        "advantages": (rng.normal(0, 1, (ROWS, 1)) * loss_mask).astype(np.float32),
    }


def _ppo(model, batch, mesh):
    _, _, _, _, graphdef, params = model
    params = jax.tree.map(lambda x: x.copy(), params)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)),
                      micro_batch_rows=4, mesh=mesh)
    lp = learner.detached_logprobs(learner.params, batch["input_ids"], batch["valid"])
    # two mini-batches = two optimizer steps (the warm-up schedule gives the first one lr = 0)
    metrics = learner.ppo_update(batch, LossConfig(), num_mini_batches=2, rng=np.random.default_rng(1))
    return learner, lp, metrics


@pytest.fixture(scope="module")
def ppo_reference(model, ppo_batch):
    return _ppo(model, ppo_batch, make_mesh(1, 1, 1))


@pytest.mark.parametrize("shape", MESHES[1:])
def test_one_ppo_step_agrees_across_meshes(model, ppo_batch, ppo_reference, ppo_222, shape):
    """Loss, gradient norm, log-probs, updated parameters and Adam moments of one PPO step on a
    mesh equal the (1,1,1) mesh's within 1e-5 relative."""
    ref_learner, ref_lp, ref_m = ppo_reference
    learner, lp, m = ppo_222 if shape == (2, 2, 2) else _ppo(model, ppo_batch, make_mesh(*shape))
    assert ref_m["actor/update_skipped"] == 0.0 and ref_m["actor/grad_norm"] > 0
    assert ref_m["actor/pg_clipfrac"] > 0 and ref_m["actor/kl_loss"] > 0  # the clip and KL paths are live
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert m[k] == pytest.approx(ref_m[k], rel=1e-5, abs=1e-7), k
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
    _, _, _, _, _, init = model
    assert relative_error(learner.params, ref_learner.params) <= 1e-5
    for name, new, ref, old in zip(_names(init), _leaves(learner.params), _leaves(ref_learner.params), _leaves(init)):
        scale = np.abs(ref).max()
        assert np.abs(ref - old).max() > 3e-4 * scale, name  # the update moved every weight (Adam: ~lr = 1e-3)
        if "k_bias" not in name:  # softmax ignores a key bias: its gradient is 0 up to rounding, which Adam
            # normalises to +-lr steps of arbitrary sign, on any mesh
            assert np.linalg.norm(new - ref) <= 1e-5 * np.linalg.norm(ref), name
    assert relative_error(learner.state.opt_state[1][0].mu, ref_learner.state.opt_state[1][0].mu) <= 1e-5
    assert relative_error(learner.state.opt_state[1][0].nu, ref_learner.state.opt_state[1][0].nu) <= 1e-5


def test_mesh_of_one_device_equals_no_mesh(model, ppo_batch, ppo_reference):
    """A 1-device mesh is just the smallest mesh: the same step as the plain (mesh=None) learner."""
    ref_learner, ref_lp, ref_m = ppo_reference
    _, _, _, _, graphdef, params = model
    plain = Learner(make_logits_fn(graphdef), jax.tree.map(lambda x: x.copy(), params),
                    make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)), micro_batch_rows=4)
    np.testing.assert_allclose(plain.detached_logprobs(plain.params, ppo_batch["input_ids"], ppo_batch["valid"]), ref_lp,
                               rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def ppo_222(model, ppo_batch):
    return _ppo(model, ppo_batch, make_mesh(2, 2, 2))


def test_params_and_opt_state_keep_their_rule_shardings(model, ppo_batch, ppo_222):
    _, _, _, _, graphdef, params = model
    learner = ppo_222[0]
    mesh = learner.steps.mesh
    attn = learner.params["layers"]["attn"]
    assert attn["q"].get_value().sharding.spec == P(None, "fsdp", "tensor", None)  # [layers, embed, heads, head_dim]
    assert attn["o"].get_value().sharding.spec == P(None, "tensor", None, "fsdp")
    assert learner.params["embed"].get_value().sharding.spec == P("tensor", "fsdp")  # [vocab, embed]
    assert learner.params["embed"].get_value().addressable_shards[0].data.shape == (params["embed"].shape[0] // 2, 16)
    adam = learner.state.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    assert adam.mu["layers"]["attn"]["q"].get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    assert adam.count.sharding.spec == P()
    expected = opt_state_shardings(learner.steps.optimizer, params, mesh)
    for arr, sh in zip(jax.tree.leaves(learner.state.opt_state), jax.tree.leaves(expected)):
        assert arr.sharding == sh
    placed = learner.steps.place(ppo_batch)
    assert placed["input_ids"].sharding.spec == P(("data", "fsdp"), None)
    assert batch_shards(mesh) == 4
    with pytest.raises(ValueError, match="does not divide over 4 batch shards"):
        learner.steps.place({k: v[:6] for k, v in ppo_batch.items()})


def test_kv_cache_sharding_follows_rules(model):
    cfg = model[3]
    c = cache_shardings(cfg, 16, 40, make_mesh(2, 2, 2))
    assert c.k.spec == P(None, ("data", "fsdp"), "tensor", None, None)  # [layers, batch, kv, slots, hd]
    # 2 kv heads cannot split 8 ways: replicated on that axis, rows still split
    assert cache_shardings(cfg, 16, 40, make_mesh(1, 1, 8)).k.spec == P(None, ("data", "fsdp"), None, None, None)
    assert cache_shardings(cfg, 16, 40, make_mesh(8, 1, 1)).k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
