"""Per-token log-probabilities and entropies, computed over sequence chunks of hidden states.

One place for the shift-by-one convention shared by the trainer (old, reference and new
log-probs), the memory-reward scorer and the sampler's parity tests.

Convention: for ``input_ids [batch, seq]`` and the model's ``logits [batch, seq, vocab]``
(``logits[:, t]`` predicts token ``t + 1``), ``logp[:, t]`` is the log-probability of
``input_ids[:, t]`` given ``input_ids[:, :t]``; ``logp[:, 0]`` is 0 (nothing predicts the first
token). Temperature divides the logits before the softmax, as in the sampler (docs/algorithm.md §5:
"log-probs in the trainer use the same temperature as the sampler").

Memory: the ``[batch, seq, vocab]`` logits are never built. The model returns its final hidden
states ``[batch, seq, embed]``; ``target_logprobs`` applies the LM head (``project``), the
log-softmax (``logsumexp``), the target gather and the entropy to ``chunk`` positions at a time in a
``lax.scan`` whose body has a hand-written VJP that recomputes the chunk's logits in the backward
pass, so the forward and the backward pass each hold one ``[batch, chunk, vocab]`` float32 block
and its gradient (tunix ``compute_logps_chunk_size``, MaxText
``num_vocab_tiling``). A caller holding logits passes them as the hidden states with the identity
projection (``token_logprobs``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

# ExecutionConfig.logit_chunk_tokens: sequence positions per LM-head chunk. At micro-batch 8 and
# Qwen's 151,936-token vocabulary one chunk's float32 logits are 8 · 256 · 151,936 · 4 B = 1.2 GiB.
DEFAULT_LOGIT_CHUNK = 256

Project = Callable[[Any, jax.Array], jax.Array]
"""``project(weights, hidden [B, C, D]) -> logits [B, C, V]`` (the LM head)."""


def identity_project(weights: Any, hidden: Float[Array, "*batch vocab"]) -> Float[Array, "*batch vocab"]:
    """The projection of callers that already hold logits: ``hidden`` is returned unchanged."""
    del weights
    return hidden


def target_logprobs(hidden: Float[ArrayLike, "rows length embed"], targets: Int[ArrayLike, "rows length"],
                    project: Project = identity_project, weights: Any = None, temperature: float = 1.0,
                    chunk: int = DEFAULT_LOGIT_CHUNK, entropy: bool = False
                    ) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"] | None]:
    """``log softmax(project(weights, hidden[:, t]) / T)[targets[:, t]]`` at every position, chunked.

    Args:
      hidden: ``[B, T, D]`` hidden states (any float dtype) or, with ``identity_project``, logits.
      targets: ``[B, T]`` int token ids scored at each position.
      project: the LM head, ``project(weights, [B, C, D]) -> [B, C, V]``.
      weights: the head's parameters (a pytree; gradients flow to it).
      temperature: softmax temperature (> 0).
      chunk: positions per chunk (>= 1); ``T`` is padded up to a multiple of it.
      entropy: also return the entropy of each position's distribution.

    Returns:
      ``(logp [B, T], entropy [B, T] or None)`` float32, natural logs / nats. Peak temporary: one
      ``[B, min(chunk, T), V]`` float32 block (and its gradient in the backward pass).

    Raises:
      ValueError: if ``hidden`` and ``targets`` disagree on ``[B, T]`` or ``chunk < 1``.
    """
    b, t = targets.shape
    if hidden.shape[:2] != (b, t):
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree on [batch, seq]")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    c = min(int(chunk), t)
    n = -(-t // c)
    if n * c != t:
        hidden = jnp.pad(hidden, ((0, 0), (0, n * c - t), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, n * c - t)))
    one = _chunk_stats(project, 1.0 / float(temperature), bool(entropy))
    if n == 1:
        logp, ent = one(weights, hidden, targets)
    else:
        hs = jnp.moveaxis(hidden.reshape((b, n, c) + hidden.shape[2:]), 1, 0)  # [n, B, C, D]
        ts = jnp.moveaxis(targets.reshape(b, n, c), 1, 0)
        _, (logp, ent) = jax.lax.scan(lambda carry, x: (carry, one(weights, *x)), None, (hs, ts))
        unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
        logp = unchunk(logp)
        ent = None if ent is None else unchunk(ent)
    return logp, ent


def _chunk_stats(project: Project, inv_t: float, entropy: bool):
    """``(weights, hidden [B, C, D], targets [B, C]) -> (logp [B, C], entropy [B, C] or None)``
    with a hand-written VJP: the forward pass keeps only ``logsumexp`` and the entropy (``[B, C]``);
    the backward pass recomputes the chunk's logits ``z`` and pulls
    ``dz = g_logp · (onehot − p) − g_ent · p · (log p + H)`` (``p = softmax z``, ``H`` the entropy)
    back through the head, so one chunk holds the logits and their gradient only."""

    def stats(w, h, tgt):
        z = project(w, h).astype(jnp.float32) * jnp.float32(inv_t)  # [B, C, V]
        lse = jax.nn.logsumexp(z, axis=-1)
        hit = jnp.arange(z.shape[-1], dtype=jnp.int32) == tgt[..., None].astype(jnp.int32)
        logp = jnp.sum(jnp.where(hit, z, 0.0), axis=-1) - lse
        if not entropy:
            return (logp, None), lse
        logp_all = z - lse[..., None]
        return (logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)), lse

    @jax.custom_vjp
    def one(w, h, tgt):
        return stats(w, h, tgt)[0]

    def fwd(w, h, tgt):
        out, lse = stats(w, h, tgt)
        return out, (w, h, tgt, lse, out[1])

    def bwd(res, g):
        w, h, tgt, lse, ent = res
        g_lp, g_ent = g
        raw, pull = jax.vjp(project, w, h)
        z = raw.astype(jnp.float32) * jnp.float32(inv_t)
        logp_all = z - lse[..., None]
        p = jnp.exp(logp_all)
        hit = jnp.arange(z.shape[-1], dtype=jnp.int32) == tgt[..., None].astype(jnp.int32)
        dz = g_lp[..., None] * (jnp.where(hit, 1.0, 0.0) - p)
        if ent is not None:
            dz = dz - g_ent[..., None] * p * (logp_all + ent[..., None])
        dw, dh = pull((dz * jnp.float32(inv_t)).astype(raw.dtype))
        return dw, dh, None

    one.defvjp(fwd, bwd)
    return one


def shifted_logprobs(hidden: Float[ArrayLike, "rows length embed"], input_ids: Int[ArrayLike, "rows length"],
                     project: Project = identity_project, weights: Any = None, temperature: float = 1.0,
                     chunk: int = DEFAULT_LOGIT_CHUNK, entropy: bool = False
                     ) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"] | None]:
    """Log-probability (and entropy) of each token given its prefix, from the hidden states.

    ``hidden[:, t]`` predicts token ``t + 1``; the result follows the module's convention.

    Args:
      hidden: ``[B, L, D]`` final hidden states (or logits with ``identity_project``).
      input_ids: ``[B, L]`` int token ids.
      project, weights, temperature, chunk, entropy: as ``target_logprobs``.

    Returns:
      ``(logp [B, L], entropy [B, L] or None)`` float32; column 0 is 0 in both.
    """
    targets = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)
    logp, ent = target_logprobs(hidden, targets, project, weights, temperature, chunk, entropy)
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # noqa: E731
    return shift(logp), None if ent is None else shift(ent)


def token_logprobs(logits: Float[ArrayLike, "rows length vocab"], input_ids: Int[ArrayLike, "rows length"],
                   temperature: float = 1.0, chunk: int = DEFAULT_LOGIT_CHUNK) -> Float[Array, "rows length"]:
    """Log-probability of each token given its prefix, from logits.

    Args:
      logits: ``[batch, seq, vocab]`` float, ``logits[:, t]`` scores token ``t + 1``.
      input_ids: ``[batch, seq]`` int32 token ids.
      temperature: softmax temperature (> 0), the sampler's.
      chunk: positions per chunk (``target_logprobs``).

    Returns:
      ``[batch, seq]`` float32 natural-log probabilities; column 0 is 0.

    Raises:
      ValueError: if the leading shapes of ``logits`` and ``input_ids`` differ.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {logits.shape} and input_ids {input_ids.shape} disagree on [batch, seq]")
    return shifted_logprobs(logits, input_ids, temperature=temperature, chunk=chunk)[0]


def token_entropy(logits: Float[ArrayLike, "rows length vocab"], temperature: float = 1.0,
                  chunk: int = DEFAULT_LOGIT_CHUNK) -> Float[Array, "rows length"]:
    """Entropy (nats) of the distribution that produced each token, aligned like ``token_logprobs``.

    Args:
      logits: ``[batch, seq, vocab]`` float.
      temperature: softmax temperature (> 0).
      chunk: positions per chunk (``target_logprobs``).

    Returns:
      ``[batch, seq]`` float32; column 0 is 0.
    """
    ids = jnp.zeros(logits.shape[:2], jnp.int32)
    return shifted_logprobs(logits, ids, temperature=temperature, chunk=chunk, entropy=True)[1]
