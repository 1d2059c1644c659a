"""LoRA adapters (``mempo_jax.model.lora``): the forward term, training only the adapters, the
reference sharing the base, the merged and PEFT exports against transformers + peft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.model import adapters, lora
from mempo_jax.model.config import LORA_TARGETS, ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, split_model
from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
from mempo_jax.rl.losses import LossConfig

CFG = ModelConfig.tiny(96, qkv_bias=True, num_layers=2)
ADAPTERS = lora.LoraConfig(rank=4, alpha=8.0)


def _adapted(seed=0, targets=tuple(LORA_TARGETS), noise=0.05):
    """``(cfg, graphdef, base params, adapted params)``; the adapters' B are set to noise (B = 0
    would make the adapted model its base)."""
    graphdef0, base = split_model(create_model(CFG, seed))
    cfg, graphdef, params = adapters.add_adapters(CFG, base, lora.LoraConfig(rank=4, alpha=8.0, target_modules=targets),
                                              seed)
    trainable, frozen = lora.split_trainable(params)
    keys = iter(jax.random.split(jax.random.key(seed + 7), len(jax.tree.leaves(trainable))))
    trainable = jax.tree.map(lambda x: x + noise * jax.random.normal(next(keys), x.shape), trainable)
    return cfg, graphdef, (graphdef0, base), lora.join(trainable, frozen)


def _batch(seed=0, b=3, t=12):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(1, CFG.vocab_size, (b, t)), jnp.int32), jnp.ones((b, t), bool)


def test_fresh_adapters_leave_the_base_exactly():
    graphdef0, base = split_model(create_model(CFG, 3))
    cfg, graphdef, params = adapters.add_adapters(CFG, base, ADAPTERS, 3)
    ids, valid = _batch()
    assert bool(jnp.all(make_logits_fn(graphdef)(params, ids, valid) == make_logits_fn(graphdef0)(base, ids, valid)))
    # the same seed draws the same base weights with or without adapters (own init stream)
    _, direct = split_model(create_model(cfg, 3))
    for a, b in zip(jax.tree.leaves(lora.split_trainable(direct)[1]), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainable = lora.trainable_part(params)
    assert sum(x.size for x in jax.tree.leaves(trainable)) == cfg.num_lora_params() == 2 * 4 * (
        (128 + 128) + 2 * (128 + 64) + (128 + 128) + 3 * (128 + 384))
    b_leaves = [v for p, v in jax.tree_util.tree_flatten_with_path(trainable)[0] if "lora_b" in jax.tree_util.keystr(p)]
    assert b_leaves and all(not np.asarray(v).any() for v in b_leaves)
    a = np.asarray(params["layers"]["mlp"]["down_lora_a"][...])[0]  # layer 0's [mlp, r]: uniform in ±1/sqrt(384)
    assert a.shape == (384, 4) and 0.8 / np.sqrt(384) < np.abs(a).max() <= 1 / np.sqrt(384)


@pytest.mark.parametrize("targets", [tuple(LORA_TARGETS), ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_adapted_forward_equals_the_merged_weights(targets):
    cfg, graphdef, _, params = _adapted(targets=targets)
    assert set(lora.trainable_part(params)["layers"]["attn"]) == {
        f"{LORA_TARGETS[t][1]}_lora_{x}" for t in targets if LORA_TARGETS[t][0] == "attn" for x in "ab"}
    ids, valid = _batch(1)
    base_cfg, merged = adapters.merge_adapters(cfg, params)
    assert base_cfg == CFG and not lora.has_adapters(merged)
    graphdef_m, _ = split_model(create_model(base_cfg, 0))
    got = make_logits_fn(graphdef)(params, ids, valid)
    want = make_logits_fn(graphdef_m)(jax.tree.map(jnp.asarray, merged), ids, valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    # the rollout engine (prefill + decode on its KV cache) runs the adapters too: the merged model's greedy tokens
    out = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=0)(params, ids, valid, jax.random.key(0),
                                                              max_new_tokens=10, temperature=0.0)
    ref = RolloutEngine(graphdef_m, base_cfg, stop_ids=[], pad_id=0)(jax.tree.map(jnp.asarray, merged), ids, valid,
                                                                     jax.random.key(0), max_new_tokens=10,
                                                                     temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_learner_trains_the_adapters_alone_and_the_reference_shares_the_base():
    cfg, graphdef, _, params = _adapted(noise=0.0)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig(learning_rate=1e-2)),
                      micro_batch_rows=2)
    ref = lora.reference_params(learner.params)
    frozen = lora.split_trainable(learner.params)[1]
    for a, b in zip(jax.tree.leaves(lora.split_trainable(ref)[1]), jax.tree.leaves(frozen)):
        assert a is b  # the same base arrays: no second copy
    adam = learner.state.opt_state[1][0]  # chain(clip, adamw)
    assert jax.tree.structure(adam.mu) == jax.tree.structure(lora.trainable_part(learner.params))
    base_before = [np.array(x) for x in jax.tree.leaves(frozen)]
    ids, valid = _batch(2, b=4, t=10)
    mask = np.zeros((4, 10), np.float32)
    mask[:, 5:] = 1.0
    m = learner.sft_step({"input_ids": np.asarray(ids), "valid": np.asarray(valid), "loss_mask": mask})
    assert m["sft/grad_norm"] > 0
    rng = np.random.default_rng(0)
    rows = {"input_ids": np.asarray(ids), "valid": np.asarray(valid), "loss_mask": mask,
            "old_logprobs": np.full((4, 10), -4.0, np.float32), "ref_logprobs": np.full((4, 10), -4.0, np.float32),
            "advantages": rng.normal(0, 1, (4, 10)).astype(np.float32)}
    learner.ppo_update(rows, LossConfig(), 2, rng)
    for a, b in zip(jax.tree.leaves(lora.split_trainable(learner.params)[1]), base_before):
        np.testing.assert_array_equal(np.asarray(a), b)  # the base is bitwise unchanged
    for a, b in zip(jax.tree.leaves(lora.split_trainable(ref)[1]), base_before):
        np.testing.assert_array_equal(np.asarray(a), b)  # and was never donated (still readable)
    moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree.leaves(lora.trainable_part(learner.params)), jax.tree.leaves(lora.trainable_part(ref)))]
    assert all(moved)
    # the reference is the policy before training: its log-probs are the base's (B = 0)
    lp_ref = learner.detached_logprobs(ref, np.asarray(ids), np.asarray(valid))
    base_learner_lp = learner.detached_logprobs(lora.join(jax.tree.map(jnp.zeros_like, lora.trainable_part(ref)), frozen),
                                       np.asarray(ids), np.asarray(valid))
    np.testing.assert_array_equal(lp_ref, base_learner_lp)


def test_bad_lora_config_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"LoraConfig.target_modules must name modules of .*q_proj.*got \['qkv'\]"):
        lora.LoraConfig(rank=4, target_modules=("qkv",))
    with pytest.raises(ValueError, match="LoraConfig.rank"):
        lora.LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="LoraConfig.base_dtype is not a dtype name"):
        lora.LoraConfig(rank=2, base_dtype="bf17")
    with pytest.raises(ValueError, match="ModelConfig.lora_targets: unknown module name"):
        CFG.replace(lora_rank=2, lora_targets=("lm_head",))
    from mempo_jax.config_loader import load_config

    with pytest.raises(ValueError, match=r"^config error: LoraConfig.alpha must be > 0"):
        load_config([], ["LoraConfig.rank=4", "LoraConfig.alpha=0.0"])
    cfg = load_config([], ["LoraConfig.rank=8", "LoraConfig.target_modules=('q_proj', 'v_proj')",
                           "LoraConfig.base_dtype='bfloat16'"])
    assert cfg.lora == lora.LoraConfig(rank=8, target_modules=("q_proj", "v_proj"), base_dtype="bfloat16")
    assert cfg.lora.model_config(CFG).param_dtype == "bfloat16"


def test_bfloat16_base_with_float32_adapters():
    graphdef0, base = split_model(create_model(CFG, 0))
    cfg, graphdef, params = adapters.add_adapters(CFG, base, lora.LoraConfig(rank=4, base_dtype="bfloat16"), 0)
    trainable, frozen = lora.split_trainable(params)
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.float32)}
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig()), micro_batch_rows=2)
    ids, valid = _batch(3, b=2, t=8)
    m = learner.sft_step({"input_ids": np.asarray(ids), "valid": np.asarray(valid),
                          "loss_mask": np.ones((2, 8), np.float32)})
    assert np.isfinite(m["sft/loss"]) and m["sft/grad_norm"] > 0
