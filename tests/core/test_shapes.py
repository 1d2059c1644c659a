"""The shape hints are checked while the tests run (``tests/conftest.py``), and only then: a wrongly
shaped or typed array, or two arguments that disagree on a named dimension, stop the call with
jaxtyping's ``TypeCheckError``; a product run (no import hook) does not check them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from conftest import without_shape_checks
from mempo_jax.core.logprobs import token_logprobs
from mempo_jax.rl.advantage import outcome_advantage, token_advantages
from mempo_jax.rl.losses import policy_loss, LossConfig

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_a_wrong_rank_or_dtype_is_stopped():
    ids = jnp.zeros(4, jnp.int32)
    np.testing.assert_allclose(outcome_advantage(jnp.asarray([1.0, 0.0, 1.0, 1.0]), ids, 1),
                               [0.5, -1.5, 0.5, 0.5], rtol=1e-5)  # mean 0.75, unbiased std 0.5
    with pytest.raises(TypeCheckError, match="rewards"):
        outcome_advantage(jnp.zeros((4, 2)), ids, 1)  # [trajectories, 2], not [trajectories]
    with pytest.raises(TypeCheckError, match="group_ids"):
        outcome_advantage(jnp.zeros(4), jnp.zeros(4), 1)  # float group ids


def test_arguments_that_disagree_on_a_dimension_are_stopped():
    logits = jnp.zeros((2, 5, 7))
    assert token_logprobs(logits, jnp.zeros((2, 5), jnp.int32)).shape == (2, 5)
    with pytest.raises(TypeCheckError, match="input_ids"):
        token_logprobs(logits, jnp.zeros((3, 5), jnp.int32))  # rows 3 against the logits' 2
    with pytest.raises(TypeCheckError, match="loss_mask"):
        token_advantages(jnp.zeros(2), jnp.zeros((2, 5)), jnp.ones((2, 6)))  # length 6 against 5
    lp = jnp.zeros((2, 5))
    with pytest.raises(TypeCheckError, match="advantages"):
        policy_loss(lp, lp, jnp.zeros((5, 2)), jnp.ones((2, 5)), LossConfig())


def test_the_product_own_error_without_the_checker():
    with without_shape_checks(), pytest.raises(ValueError, match="disagree"):
        token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((3, 5), jnp.int32))


def test_a_product_run_checks_nothing():
    code = ("import jax.numpy as jnp; from mempo_jax.rl.advantage import outcome_advantage; "
            "print(outcome_advantage(jnp.zeros(4), jnp.zeros(4), 1).shape)")  # float group ids: cast, no check
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(4,)"
