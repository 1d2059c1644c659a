"""Padded references of the packed passes: every sequence alone in its own padded row.

The product scores rows packed end to end (``rl.packed_logprobs.PackedLogprobs``,
``MemoryRewardScorer``); these compute the same values the plain way, through
``model.forward.token_stats`` over padded rows (``valid``), to check the packed ones against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mempo_jax.model.forward import LogitsFn, token_stats
from mempo_jax.rl.memory_reward import MemoryRewardOutput, answer_likelihood, build_scoring_batch


def padded_logprobs(fn: LogitsFn, params, input_ids, valid, temperature: float = 1.0) -> np.ndarray:
    """``[R, L]`` float32 per-token log-probs of padded rows (``core.logprobs`` convention), no gradient."""
    call = jax.jit(lambda p, i, v: token_stats(fn, p, i, valid=v, temperature=temperature, grad=False)[0])
    return np.asarray(call(params, jnp.asarray(input_ids, jnp.int32), jnp.asarray(valid, bool)), np.float32)


def padded_scores(fn: LogitsFn, params, full_contexts, mem_contexts, answers, answer_prefix, full_prefix=(),
                  temperature: float = 1.0) -> MemoryRewardOutput:
    """``MemoryRewardScorer``'s output from one padded stacked batch (``build_scoring_batch``)."""
    m = len(full_contexts)
    ids, valid, answer_mask = build_scoring_batch(full_contexts, mem_contexts, answers, answer_prefix, 0,
                                                  full_prefix=full_prefix)
    logp = padded_logprobs(fn, params, ids, valid, temperature)
    p = np.asarray(answer_likelihood(logp, answer_mask), np.float32)
    return MemoryRewardOutput(p[m:] - p[:m], p[:m], p[m:])
