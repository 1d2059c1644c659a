"""Qwen2 / Llama decoder in Flax NNX: config presets, decoder with KV cache, functional wrappers."""

from mempo_jax.model.config import PRESETS, ModelConfig
from mempo_jax.model.decoder import Decoder, KVCache, init_cache
from mempo_jax.model.forward import (
    abstract_model,
    create_model,
    make_logits_fn,
    merge_model,
    positions_from_mask,
    sequence_logprobs,
    split_model,
)

__all__ = [
    "PRESETS", "ModelConfig", "Decoder", "KVCache", "init_cache", "abstract_model", "create_model",
    "make_logits_fn", "merge_model", "positions_from_mask", "sequence_logprobs", "split_model",
]
