"""The one name → function registry behind ``RLConfig.outcome_metric``, ``LossConfig.kl_type`` and
``LossConfig.loss_agg_mode``."""

import pytest

from mempo_jax.rl import losses

from mempo_jax.rl import rewards
from mempo_jax.core.registry import Registry


def test_register_get_names_and_errors():
    reg = Registry("widget")
    f = reg.register("a", "b")(lambda: 1)
    assert reg.get("a") is f and reg.get("b") is f and reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown widget 'c'; known: \['a', 'b'\]"):
        reg.get("c")


def test_the_config_fields_choose_from_the_registries():
    assert rewards.get_metric("em")("Paris", ["paris"]) == 1.0
    assert rewards.get_metric("f1")("the Paris city", ["Paris"]) == pytest.approx(2 * 0.5 / 1.5)
    assert losses._KL.names() == ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]
    assert losses._AGG.names() == ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                   "token-mean"]
    with pytest.raises(ValueError, match="LossConfig.kl_type"):
        losses.LossConfig(kl_type="k4")
