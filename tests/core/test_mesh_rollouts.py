"""Greedy multi-turn rollouts (jitted mesh sampler + host tools) give the same token ids on every
mesh (data, fsdp, tensor) = (1,1,1), (8,1,1), (1,8,1), (2,2,2) of 8 emulated CPU devices."""

import jax
import numpy as np
import pytest

from mempo_jax.text.protocol import STOP_TAGS
from mempo_jax.agent.rollout import RolloutConfig, new_trajectories
from mempo_jax.core.batching import pad_sequences
from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.core.sharding import make_mesh
from toy_agent import toy_model, toy_world
from mempo_jax.agent.format import AgentFormat

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2)]


@pytest.fixture(scope="module")
def model():
    tok, env, questions = toy_world()
    cfg, graphdef, params = toy_model(tok.vocab_size, seed=0)
    return tok, env, questions, cfg, graphdef, params


def _greedy_rollout(model, mesh):
    tok, env, questions, cfg, graphdef, params = model
    stop_ids = [tok.eos_id] + [tok.piece_id(t) for t in STOP_TAGS]
    engine = RolloutEngine(graphdef, cfg, stop_ids, tok.pad_id, mesh=mesh)
    rc = RolloutConfig(max_turns=3, max_new_tokens=12, max_context_tokens=256, max_observation_tokens=12,
                       temperature=0.0, context_steps=1, min_rows_bucket=8)
    trajs = new_trajectories(AgentFormat.plain(tok), questions, 2)
    engine.rollout(params, trajs, AgentFormat.plain(tok), env, rc, jax.random.PRNGKey(0))
    return trajs, engine


@pytest.fixture(scope="module")
def greedy_reference(model):
    return _greedy_rollout(model, make_mesh(1, 1, 1))


@pytest.mark.parametrize("shape", MESHES[1:])
def test_greedy_rollouts_give_the_same_ids_on_every_mesh(model, greedy_reference, shape):
    """Multi-turn greedy rollouts (engine + host tools) produce the same token ids on each mesh
    as on the (1,1,1) mesh; the engine's KV cache slots lie over the batch axes."""
    trajs, engine = _greedy_rollout(model, make_mesh(*shape))
    greedy_reference = greedy_reference[0]
    turns = [[t.output_ids for t in tr.turns] for tr in trajs]
    assert turns == [[t.output_ids for t in tr.turns] for tr in greedy_reference]
    assert sum(len(t) for t in turns) >= len(trajs)  # every trajectory sampled at least one turn
    assert any(len(tr.turns) > 1 for tr in trajs)  # tool observations were fed back
    k = engine.sampler.init_state(8, 128, 12).cache.k
    assert k.sharding.shard_shape(k.shape)[1] == 8 // (shape[0] * shape[1])


def test_greedy_sampler_on_a_mesh_equals_the_plain_sampler(model, greedy_reference):
    """The 1-device mesh sampler returns the plain (mesh=None) sampler's ids and log-probs."""
    tok, _, _, cfg, graphdef, params = model
    ids, mask = pad_sequences([tok.encode("where was alice born"), tok.encode("who works at acme and where is")],
                              tok.pad_id, 8, side="left")
    plain = RolloutEngine(graphdef, cfg, [tok.eos_id], tok.pad_id)(params, ids, mask, jax.random.PRNGKey(0),
                                                               8, temperature=0.0)
    meshed = RolloutEngine(graphdef, cfg, [tok.eos_id], tok.pad_id, mesh=make_mesh(1, 1, 1))(
        params, ids, mask, jax.random.PRNGKey(0), 8, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(meshed.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(meshed.logprobs), np.asarray(plain.logprobs), rtol=1e-6, atol=1e-6)
