"""Per-token log-probabilities and entropies from logits.

One place for the shift-by-one convention shared by the trainer (old, reference and new
log-probs), the memory-reward scorer and the sampler's parity tests.

Convention: for ``input_ids [batch, seq]`` and the model's ``logits [batch, seq, vocab]``
(``logits[:, t]`` predicts token ``t + 1``), ``logp[:, t]`` is the log-probability of
``input_ids[:, t]`` given ``input_ids[:, :t]``; ``logp[:, 0]`` is 0 (nothing predicts the first
token). Temperature divides the logits before the softmax, as in the sampler (MEMPO_SPEC §5:
"log-probs in the trainer use the same temperature as the sampler").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _shifted_log_softmax(logits: jax.Array, temperature: float) -> jax.Array:
    """``[batch, seq, vocab]`` logits → ``[batch, seq, vocab]`` log-softmax aligned to targets.

    Row ``t`` of the result is the distribution over token ``t`` (row 0 is a dummy copy of the
    distribution over token 1 and must be masked by the caller).
    """
    scaled = logits.astype(jnp.float32) / jnp.float32(temperature)
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.concatenate([logp_all[:, :1], logp_all[:, :-1]], axis=1)


def token_logprobs(logits: jax.Array, input_ids: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each token given its prefix.

    Args:
      logits: ``[batch, seq, vocab]`` float, ``logits[:, t]`` scores token ``t + 1``.
      input_ids: ``[batch, seq]`` int32 token ids.
      temperature: softmax temperature (> 0), the sampler's.

    Returns:
      ``[batch, seq]`` float32 natural-log probabilities; column 0 is 0.

    Raises:
      ValueError: if the leading shapes of ``logits`` and ``input_ids`` differ.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {logits.shape} and input_ids {input_ids.shape} disagree on [batch, seq]")
    logp_all = _shifted_log_softmax(logits, temperature)
    picked = jnp.take_along_axis(logp_all, input_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked.at[:, 0].set(0.0)


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy (nats) of the distribution that produced each token, aligned like ``token_logprobs``.

    Args:
      logits: ``[batch, seq, vocab]`` float.
      temperature: softmax temperature (> 0).

    Returns:
      ``[batch, seq]`` float32; column 0 is 0.
    """
    logp_all = _shifted_log_softmax(logits, temperature)
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return ent.at[:, 0].set(0.0)
