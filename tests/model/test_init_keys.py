"""``InitKeys``: the keys ``nnx.Rngs`` draws, counted in Python; the abstract model it makes."""

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import abstract_model, create_model, split_model
from mempo_jax.model.init_keys import InitKeys


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), order=st.lists(st.sampled_from(["params", "lora"]), max_size=12))
def test_draws_equal_nnx_rngs_draws_in_any_interleaving(seed, order):
    lora = jax.random.fold_in(jax.random.key(seed), 1)
    ours, theirs = InitKeys(params=seed, lora=lora), nnx.Rngs(params=seed, lora=lora)
    for stream in order:
        a, b = getattr(ours, stream)(), getattr(theirs, stream)()
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_streams_are_named_and_a_missing_one_is_an_error():
    keys = InitKeys(params=0)
    assert "params" in keys and "lora" not in keys
    with pytest.raises(AttributeError, match="no init-key stream 'lora' \\(streams: params\\)"):
        keys.lora()


def test_abstract_model_is_the_created_model_without_its_values():
    cfg = ModelConfig.tiny(300).replace(lora_rank=4, lora_targets=("q_proj", "down_proj"))
    graph_a, abstract = split_model(abstract_model(cfg))
    graph_c, created = split_model(create_model(cfg, seed=5))
    assert graph_a == graph_c
    flat_a, flat_c = nnx.to_flat_state(abstract), nnx.to_flat_state(created)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_c]
    for (path, va), (_, vc) in zip(flat_a, flat_c):
        assert isinstance(va.get_raw_value(), jax.ShapeDtypeStruct), path
        assert (va.shape, va.dtype) == (vc.shape, vc.dtype), path
        assert va.get_metadata()["out_sharding"] == vc.get_metadata()["out_sharding"], path
