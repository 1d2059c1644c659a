"""bfloat16 compute: ``ModelConfig.dtype = "bfloat16"`` (in a run:
``ModelOptions.overrides = (("dtype", "bfloat16"),)``, as the pod recipes set it) puts the
activations and the KV cache in bfloat16 while the master weights and the optimizer state stay
float32 (``param_dtype``); norms' statistics, attention scores/softmax, logits and log-probs are
float32.

Tolerances, stated (bfloat16 keeps 8 mantissa bits, ~0.4 % relative per rounding), measured on
this tiny model (init std 0.2 so logits are O(1)) with margins of ~2x:

* per-token log-probs vs float32: mean |Δ| < 0.03 nats, max |Δ| < 0.2 nats (measured 0.013 / 0.07),
  dense (40 tokens) and blocked attention (300 tokens) alike;
* memory-reward P (packed scoring): |log P_bf16 − log P_f32| < 0.05;
* one PPO step: the parameter update's cosine with the float32 update > 0.95;
* sampler (bf16 KV cache, cached decode) vs the trainer's recompute (full forward): mean gap
  in (0, 0.05) nats — the mismatch ``rollout/logprob_diff/mean`` reports (zero-gap would mean
  the test compared a thing with itself).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
from mempo_jax.core.logprobs import token_logprobs
from mempo_jax.rl.losses import LossConfig
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import init_cache
from mempo_jax.model.forward import create_model, make_logits_fn, split_model

CFG = ModelConfig.tiny(64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                       initializer_range=0.2)


@pytest.fixture(scope="module")
def models():
    g32, params = split_model(create_model(CFG, seed=1))
    g16, p16 = split_model(create_model(CFG.replace(dtype="bfloat16"), seed=1))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p16))  # master weights stay float32
    return g32, g16, params


@pytest.mark.parametrize("length", [40, 300])  # 300 > one 256 tile: the blocked attention path
def test_bf16_logprobs_within_stated_tolerance(models, length):
    g32, g16, params = models
    rng = np.random.default_rng(length)
    ids = jnp.asarray(rng.integers(0, 64, (2, length)), jnp.int32)
    valid = jnp.ones((2, length), bool)
    lp32 = np.asarray(token_logprobs(jax.jit(make_logits_fn(g32))(params, ids, valid), ids))[:, 1:]
    logits16 = jax.jit(make_logits_fn(g16))(params, ids, valid)
    assert logits16.dtype == jnp.float32  # logits (and log-probs) are float32 in either mode
    lp16 = np.asarray(token_logprobs(logits16, ids))[:, 1:]
    d = np.abs(lp16 - lp32)
    assert d.mean() < 0.03 and d.max() < 0.2, (d.mean(), d.max())
    assert d.max() > 0  # bf16 is really in the computation


def test_bf16_kv_cache_and_activations_dtype():
    cache = init_cache(CFG.replace(dtype="bfloat16"), 2, 8)
    assert cache.k.dtype == jnp.bfloat16 and cache.v.dtype == jnp.bfloat16
    from mempo_jax.model.attention_xla import blocked_attention

    q = jnp.ones((1, 20, 4, 8), jnp.bfloat16)
    kv = jnp.ones((1, 20, 2, 8), jnp.bfloat16)
    out = blocked_attention(q, kv, kv, jnp.ones((1, 20, 20), bool), block_q=8, block_k=8)
    assert out.dtype == jnp.bfloat16


def test_bf16_packed_scoring_and_ppo_step(models):
    from mempo_jax.rl.memory_reward import MemoryRewardScorer

    g32, g16, params = models
    rng = np.random.default_rng(3)
    full = [rng.integers(4, 64, int(rng.integers(20, 60))).tolist() for _ in range(4)]
    mem = [rng.integers(4, 64, int(rng.integers(3, 10))).tolist() for _ in range(4)]
    answers = [rng.integers(4, 64, 3).tolist() for _ in range(4)]
    p32 = MemoryRewardScorer(make_logits_fn(g32), 0, [1], min_length=16)(params, full, mem, answers)
    p16 = MemoryRewardScorer(make_logits_fn(g16), 0, [1], min_length=16)(params, full, mem, answers)
    for a, b in ((p32.p_full, p16.p_full), (p32.p_mem, p16.p_mem)):
        assert np.abs(np.log(b) - np.log(a)).max() < 0.05

    n, length = 4, 32
    ids = rng.integers(3, 64, (n, length)).astype(np.int32)
    mask = (np.arange(length)[None] >= 8).astype(np.float32) * np.ones((n, 1), np.float32)
    lp = np.asarray(token_logprobs(make_logits_fn(g32)(params, jnp.asarray(ids), jnp.ones((n, length), bool)),
                                   jnp.asarray(ids)))
    batch = {"input_ids": ids, "valid": np.ones((n, length), bool), "loss_mask": mask,
             "old_logprobs": (lp * mask).astype(np.float32), "ref_logprobs": (lp * mask).astype(np.float32),
             "advantages": (rng.normal(0, 1, (n, 1)) * mask).astype(np.float32)}
    deltas = []
    for g in (g32, g16):
        learner = Learner(make_logits_fn(g), jax.tree.map(jnp.array, params),
                          make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1)), micro_batch_rows=2)
        learner.ppo_update(batch, LossConfig(), 1, np.random.default_rng(0))
        leaves = jax.tree.leaves(learner.params)
        assert all(x.dtype == jnp.float32 for x in leaves)  # float32 master weights after the update
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(learner.state.opt_state) if hasattr(x, "dtype")
                   and jnp.issubdtype(x.dtype, jnp.floating))  # float32 optimizer state
        deltas.append(np.concatenate([(np.asarray(a) - np.asarray(b)).ravel()
                                      for a, b in zip(leaves, jax.tree.leaves(params))]))
    cos = float(deltas[0] @ deltas[1] / np.linalg.norm(deltas[0]) / np.linalg.norm(deltas[1]))
    assert cos > 0.95, cos


def test_bf16_sampler_vs_trainer_gap_is_what_the_metric_reports(models):
    from mempo_jax.agent.trajectory import TrainingRows
    from mempo_jax.rl.step import policy_old_logprobs
    from mempo_jax.agent.engine import RolloutEngine

    _, g16, params = models
    sampler = RolloutEngine(g16, CFG.replace(dtype="bfloat16"), stop_ids=(), pad_id=0)
    prompt = np.random.default_rng(4).integers(3, 64, (4, 16)).astype(np.int32)
    out = sampler(params, prompt, np.ones((4, 16), bool), jax.random.PRNGKey(1), 12, 1.0)
    ids = np.concatenate([prompt, np.asarray(out.tokens)], axis=1)
    loss = np.concatenate([np.zeros((4, 16)), np.ones((4, 12))], axis=1).astype(np.float32)
    old = np.concatenate([np.zeros((4, 16)), np.asarray(out.logprobs)], axis=1).astype(np.float32)
    rows = TrainingRows(input_ids=ids, valid=np.ones(ids.shape, bool), loss_mask=loss, old_logprobs=old,
                        traj_index=np.arange(4), mem_turn=[], mem_rows=np.zeros(0, int),
                        mem_starts=np.zeros(0, int), mem_ends=np.zeros(0, int))
    learner = Learner(make_logits_fn(g16), params, make_optimizer(OptimConfig()))
    _, m = policy_old_logprobs(learner, rows)
    assert 0.0 < m["rollout/logprob_diff/mean"] < 0.05, m
