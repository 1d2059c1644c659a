"""The PPO "old" log-probs recomputed by the policy before the update.

``PackedLogprobs`` packs the training rows end to end and must give the padded pass's
values on every scored token; ``policy_old_logprobs`` reports the
sampler/trainer gap, checked against a sampler run on the same weights (float32: ~1e-5).
"""

import dataclasses

import jax
import numpy as np

from mempo_jax.agent.trajectory import TrainingRows
from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, split_model
from mempo_jax.rl.packed_logprobs import PackedLogprobs
from mempo_jax.rl.step import policy_old_logprobs
from mempo_jax.agent.engine import RolloutEngine
from padded_reference import padded_logprobs


def _model(seed=7, vocab=48):
    cfg = ModelConfig.tiny(vocab, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=seed))
    return cfg, graphdef, params


def test_packed_logprobs_equal_the_padded_pass():
    _, graphdef, params = _model()
    fn = make_logits_fn(graphdef)
    rng = np.random.default_rng(0)
    n, length = 9, 64
    lens = rng.integers(1, length + 1, n)
    lens[2] = 0  # an empty row
    valid = np.arange(length)[None] < lens[:, None]
    valid[4] = np.roll(valid[4], 5)  # left padding on one row
    ids = np.where(valid, rng.integers(3, 48, (n, length)), 0).astype(np.int32)
    want = padded_logprobs(fn, params, ids, valid, 0.7)
    calc = PackedLogprobs(fn, 0.7, rows_per_call=4, min_length=16)
    got = calc(params, ids, valid)
    scored = valid & np.concatenate([np.zeros((n, 1), bool), valid[:, :-1]], axis=1)
    np.testing.assert_allclose(got[scored], want[scored], rtol=1e-5, atol=1e-5)
    assert (got[~scored] == 0).all()
    assert calc.precompile(params, [16, 32, 64]) == 3 * 3  # row buckets 1, 2, 4 at each length


def test_policy_old_logprobs_match_the_sampler_in_float32():
    cfg, graphdef, params = _model(seed=8)
    sampler = RolloutEngine(graphdef, cfg, stop_ids=(), pad_id=0)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 48, (3, 12)).astype(np.int32)
    out = sampler(params, prompt, np.ones((3, 12), bool), jax.random.PRNGKey(0), 10, 1.0)
    toks, lps = np.asarray(out.tokens), np.asarray(out.logprobs)
    ids = np.concatenate([prompt, toks], axis=1)
    valid = np.ones(ids.shape, bool)
    loss = np.concatenate([np.zeros((3, 12)), np.ones((3, 10))], axis=1).astype(np.float32)
    old = np.concatenate([np.zeros((3, 12)), lps], axis=1).astype(np.float32)
    rows = TrainingRows(input_ids=ids, valid=valid, loss_mask=loss, old_logprobs=old,
                        traj_index=np.arange(3), mem_turn=[], mem_rows=np.zeros(0, int),
                        mem_starts=np.zeros(0, int), mem_ends=np.zeros(0, int))
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig()), temperature=1.0)
    recomputed, metrics = policy_old_logprobs(learner, rows)
    np.testing.assert_allclose(recomputed[:, 12:], lps, atol=2e-5)
    assert (recomputed[:, :12] == 0).all()
    assert 0.0 < metrics["rollout/logprob_diff/mean"] < 2e-5  # float32: noise only, but not bitwise
    assert metrics["rollout/logprob_diff/max"] >= metrics["rollout/logprob_diff/mean"]
    # the gap metric has teeth: a perturbed sampler record shows up
    bad = dataclasses.replace(rows, old_logprobs=old + 0.1 * loss)
    assert abs(policy_old_logprobs(learner, bad)[1]["rollout/logprob_diff/mean"] - 0.1) < 1e-4
