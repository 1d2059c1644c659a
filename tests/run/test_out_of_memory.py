"""A device out-of-memory (XLA's own ``RESOURCE_EXHAUSTED``) is one line naming the phase and the
binding to lower; other runtime errors are not rewritten."""

import jax
import jax.numpy as jnp
import pytest

from mempo_jax.commands.train import out_of_memory_line


def _allocate_a_terabyte():
    jax.jit(lambda x: jnp.broadcast_to(x, (2**38,)) + 1)(jnp.float32(1)).block_until_ready()


def ppo_update():  # the name the trainer's update has in a traceback
    _allocate_a_terabyte()


def rollout_cached():
    _allocate_a_terabyte()


@pytest.mark.parametrize("fn, phase, binding", [
    (ppo_update, "the PPO update", "ExecutionConfig.micro_batch_rows"),
    (rollout_cached, "sampling", "RolloutConfig.num_slots"),
])
def test_out_of_memory_is_one_line_with_the_phase_and_binding(fn, phase, binding):
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        fn()
    line = out_of_memory_line(info.value)
    assert line.startswith(f"device out of memory in {phase} (RESOURCE_EXHAUSTED")
    assert f"lower {binding}" in line and "\n" not in line


def test_other_runtime_errors_pass_through():
    assert out_of_memory_line(RuntimeError("INVALID_ARGUMENT: shapes")) is None
