"""The rollout's host-local mesh (``core.rollout_mesh``), the weight sync onto it, and the plan's
rollout section for the pod recipes."""

import pathlib

import jax
import numpy as np
import pytest

from mempo_jax.core.rollout_mesh import rollout_mesh, weight_sync
from mempo_jax.core.sharding import make_mesh, param_shardings, shard_params
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_rollout_mesh_puts_the_hosts_devices_on_tensor_where_the_heads_divide():
    mesh = make_mesh(2, 2, 2)  # 8 devices of this one process
    assert dict(rollout_mesh(mesh, 4, 2).shape) == {"data": 4, "fsdp": 1, "tensor": 2}  # 2 kv heads
    assert dict(rollout_mesh(mesh, 8, 8).shape) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert dict(rollout_mesh(mesh, 4, 2, tensor=1).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert set(rollout_mesh(mesh, 4, 2).devices.flat) == set(mesh.devices.flat)
    with pytest.raises(ValueError, match=r"MeshConfig.rollout_tensor = 4 must divide .* 2 kv heads"):
        rollout_mesh(mesh, 4, 2, tensor=4)


def test_weight_sync_places_the_training_params_on_the_rollout_mesh():
    cfg = ModelConfig.tiny(64, num_layers=1)
    _, params = split_model(create_model(cfg, seed=0))
    train = shard_params(params, make_mesh(1, 4, 2))
    local = rollout_mesh(make_mesh(1, 4, 2), cfg.num_heads, cfg.num_kv_heads)
    target = param_shardings(params, local)
    synced = weight_sync(train, target)
    for got, want, s in zip(jax.tree.leaves(synced), jax.tree.leaves(params), jax.tree.leaves(target)):
        assert got.sharding == s
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    again = weight_sync(synced, target)  # already in place: the same arrays
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(synced)))


@pytest.mark.parametrize("recipe, hosts, mesh", [("qwen2_5_0_5b_v5e8.gin", 1, {"data": 4, "fsdp": 1, "tensor": 2}),
                                                  ("qwen2_5_7b_v5p64.gin", 8, {"data": 1, "fsdp": 1, "tensor": 4})])
def test_plan_gives_each_host_its_rollout_mesh(recipe, hosts, mesh):
    from mempo_jax import config_loader
    from mempo_jax.run import memory_plan as plan
    from mempo_jax.core import mesh_config

    mesh_config.register()
    cfg = config_loader.load_config([str(REPO / "configs" / recipe)])
    pod = mesh_config.from_gin()
    r = plan.rollout_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    assert (r["hosts"], r["mesh"], r["fits"]) == (hosts, mesh, True)
    model = plan.model_config(cfg)
    size = 2 if cfg.execution.rollout_dtype == "bfloat16" else model.weight_dtype.itemsize
    assert r["sync_bytes"] == model.num_params() * size  # the whole model into each chip


def test_a_bfloat16_rollout_copy_halves_the_weight_sync():
    from mempo_jax import config_loader
    from mempo_jax.run import memory_plan as plan
    from mempo_jax.core import mesh_config

    mesh_config.register()
    recipe = [str(REPO / "configs" / "qwen2_5_0_5b_v5e8.gin")]
    cfg = config_loader.load_config(recipe)
    pod = mesh_config.from_gin()
    f32 = plan.rollout_plan(cfg, pod.mesh, pod.tpu, pod.plan)
    bf16 = plan.rollout_plan(config_loader.load_config(recipe, ['ExecutionConfig.rollout_dtype="bfloat16"']),
                             pod.mesh, pod.tpu, pod.plan)
    model = plan.model_config(cfg)
    assert bf16["sync_bytes"] == model.num_params() * 2
    assert f32["sync_bytes"] == model.num_params() * model.weight_dtype.itemsize
