"""Sharding tests on 8 emulated CPU devices: logits invariant to the mesh, real param shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, make_logits_fn, split_model
from mempo_jax.model.placement import init_sharded_params
from mempo_jax.core.sharding import (
    DEFAULT_RULES,
    batch_sharding,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_params,
)

VOCAB = 128


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny(VOCAB, num_layers=2, qkv_bias=True, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=0))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (8, 16)), jnp.int32)
    mask = jnp.arange(16)[None] >= jnp.array([0, 3, 0, 5, 1, 0, 7, 2])[:, None]  # left padding
    logits_fn = make_logits_fn(graphdef)
    ref = np.asarray(jax.jit(logits_fn)(params, ids, mask))
    return cfg, graphdef, params, ids, mask, logits_fn, ref


def test_eight_devices_are_emulated():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 1, 8)])
def test_logits_equal_on_every_mesh(tiny, shape):
    _, _, params, ids, mask, logits_fn, ref = tiny
    mesh = make_mesh(*shape)
    sharded = shard_params(params, mesh)
    bs = batch_sharding(mesh)
    out = jax.jit(logits_fn)(sharded, jax.device_put(ids, bs), jax.device_put(mask, bs))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_sharded_params_have_the_rule_shardings(tiny):
    _, _, params, *_ = tiny
    mesh = make_mesh(2, 2, 2)
    sharded = shard_params(params, mesh)
    attn = sharded["layers"]["attn"]  # layer weights stacked: a leading [layers] axis, never sharded
    n = tiny[0].num_layers
    expected = {
        "embed": (sharded["embed"], P("tensor", "fsdp"), (64, 64)),  # [vocab, embed]
        "lm_head": (sharded["lm_head"], P("fsdp", "tensor"), (64, 64)),  # [embed, vocab]
        "q": (attn["q"], P(None, "fsdp", "tensor", None), (n, 64, 2, 32)),  # [layers, embed, heads, head_dim]
        "k": (attn["k"], P(None, "fsdp", "tensor", None), (n, 64, 1, 32)),  # [layers, embed, kv_heads, head_dim]
        "q_bias": (attn["q_bias"], P(None, "tensor", None), (n, 2, 32)),
        "o": (attn["o"], P(None, "tensor", None, "fsdp"), (n, 2, 32, 64)),  # [layers, heads, head_dim, embed]
        "gate": (sharded["layers"]["mlp"]["gate"], P(None, "fsdp", "tensor"), (n, 64, 192)),  # [layers, embed, mlp]
        "down": (sharded["layers"]["mlp"]["down"], P(None, "tensor", "fsdp"), (n, 192, 64)),  # [layers, mlp, embed]
        "norm": (sharded["final_norm"]["weight"], P(None), (128,)),
    }
    for name, (var, spec, shard_shape) in expected.items():
        arr = var.get_value()
        assert arr.sharding.spec == spec, name
        assert arr.addressable_shards[0].data.shape == shard_shape, name
        assert len(arr.sharding.device_set) == 8, name


def test_indivisible_dimension_falls_back_to_replication():
    mesh = make_mesh(1, 1, 8)
    # 2 kv heads cannot split 8 ways; the mlp dimension can.
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh.shape, (128, 2, 32)) == P("fsdp", None, None)
    assert logical_to_spec(("embed", "mlp"), DEFAULT_RULES, mesh.shape, (128, 384)) == P("fsdp", "tensor")
    # batch maps to two axes; only the dividing ones are kept.
    mesh2 = make_mesh(2, 4, 1)
    assert logical_to_spec(("batch", None), DEFAULT_RULES, mesh2.shape, (2, 5)) == P("data", None)
    assert logical_to_spec(("batch", None), DEFAULT_RULES, mesh2.shape, (8, 5)) == P(("data", "fsdp"), None)
    # any axis -> size mapping; an axis it does not name has size 1
    assert logical_to_spec(("embed", "mlp"), DEFAULT_RULES, {"tensor": 5}, (128, 384)) == P("fsdp", None)
    assert logical_to_spec(("embed", "mlp"), DEFAULT_RULES, {}, (128, 384)) == P("fsdp", "tensor")
    with pytest.raises(ValueError, match="unknown_axis"):
        logical_to_spec(("unknown_axis",), DEFAULT_RULES)


def test_make_mesh_validates():
    assert make_mesh(1, 1, 1).devices.shape == (1, 1, 1)
    assert make_mesh(2, 2, 2).axis_names == ("data", "fsdp", "tensor")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(2, 4, 2)
    with pytest.raises(ValueError, match=">= 1"):
        make_mesh(0, 1, 1)


def test_init_sharded_params_equals_host_init(tiny):
    cfg, _, params, *_ = tiny
    mesh = make_mesh(1, 4, 2)
    _, sharded = init_sharded_params(cfg, 0, mesh)
    shardings = param_shardings(params, mesh)
    for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)  # jit vs eager rounding
        assert b.sharding == s
