"""Token-choice primitives of the sampler (``agent/slot_sampler.py``):
the top-p nucleus filter and the stop-id test, both traced inside the jitted decode loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_p_filter(logits: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """Keep the nucleus: the most probable tokens whose mass first reaches ``top_p``.

    Token j (in descending probability order) is kept when the mass strictly before it is
    ``< top_p``; the most probable token is always kept. Source: Holtzman et al. 2019, as in
    HF ``TopPLogitsWarper`` / the gemma sampler.

    Args:
      logits: ``[B, V]`` float (already divided by the temperature).
      top_p: scalar in (0, 1].

    Returns:
      ``[B, V]`` float32 logits with ``-inf`` outside the nucleus.
    """
    logits = logits.astype(jnp.float32)
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (mass_before < top_p).at[:, 0].set(True)
    rows = jnp.arange(logits.shape[0])[:, None]
    keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def is_stop(tok: jax.Array, stop_ids) -> jax.Array:
    """``[B]`` bool: whether each sampled id of ``tok`` ``[B]`` int32 is one of ``stop_ids``
    (a static tuple of ints; none: all False)."""
    if not stop_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(stop_ids, jnp.int32)[None, :], axis=-1)


def pick(logits: jax.Array, keys: jax.Array, temperature, top_p, greedy: bool, use_top_p: bool):
    """One token per row: ``[R, V]`` logits and ``[R]`` PRNG keys → (token ``[R]`` int32, its
    log-prob ``[R]`` float32 under the temperature-scaled softmax). Greedy takes the argmax; otherwise
    a categorical draw per row, inside the top-p nucleus when ``use_top_p`` (static)."""
    scaled = logits.astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        if use_top_p:
            scaled = top_p_filter(scaled, top_p)
        tok = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
