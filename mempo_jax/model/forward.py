"""Functional model calls: the one model contract of the trainer, the scorer and the evaluation.

``LogitsFn`` is the contract (a ``Protocol``): hidden states of padded or packed rows and the LM
head, which the passes apply in chunks (``token_stats``); ``DecoderLogitsFn`` implements it for the
``Decoder``. Everything here is pure: ``(graphdef, params)`` from ``split_model`` and arrays in,
arrays out, so callers can ``jax.jit`` / ``jax.grad`` them with explicit shardings (tunix-style
model contract).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int
from jax.sharding import Mesh

from mempo_jax.core.logprobs import DEFAULT_LOGIT_CHUNK, shifted_logprobs
from mempo_jax.core.sharding import DEFAULT_RULES, Rules, activation_sharding
from mempo_jax.model.attention_kernels import resolve_impl
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.attention_xla import BLOCKED_MIN_LEN
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.init_keys import InitKeys
from mempo_jax.model.decoder import Decoder, project_logits, remat_policy


def _rngs(seed: int) -> InitKeys:
    """The init streams: ``params`` (the base weights) and ``lora`` (adapters, drawn apart so the
    base weights of a seed are the same with or without adapters)."""
    return InitKeys(params=seed, lora=jax.random.fold_in(jax.random.key(seed), 1))


def create_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised ``Decoder`` (normal(0.02) weights, unit norms, zero biases; LoRA
    adapters, when ``cfg`` has them, as ``model.lora.adapter_params``).

    Args:
      cfg: model config.
      seed: integer seed of the ``params`` RNG stream.
    """
    return Decoder(cfg, rngs=_rngs(seed))


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The ``Decoder`` with ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``; allocates nothing)."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=_rngs(0)))


def split_model(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model)`` → ``(graphdef, params)``; ``params`` is an ``nnx.State`` pytree of
    ``nnx.Param`` leaves carrying their logical-axis metadata. Inverse: ``merge_model``."""
    graphdef, params = nnx.split(model)
    return graphdef, params


def merge_model(graphdef: nnx.GraphDef, params: nnx.State) -> Decoder:
    """``nnx.merge(graphdef, params)`` → ``Decoder``."""
    return nnx.merge(graphdef, params)


def positions_from_mask(valid_mask: Bool[ArrayLike, "rows length"]) -> Int[Array, "rows length"]:
    """RoPE positions ``max(cumsum(valid) - 1, 0)``: ``[B, L]`` bool → ``[B, L]`` int32.

    Real tokens are numbered 0, 1, 2, … whatever padding sits left of or between them.
    """
    return jnp.maximum(jnp.cumsum(valid_mask.astype(jnp.int32), axis=-1) - 1, 0).astype(jnp.int32)


@runtime_checkable
class LogitsFn(Protocol):
    """The model contract every pass over ``(params, token rows)`` requires.

    Rows come padded (``valid_mask [B, L]`` bool, True on real tokens, any padding layout) or
    packed end to end (``segment_ids [B, L]`` int32, ``k > 0`` on the row's k-th sequence, 0 on
    padding, and ``positions [B, L]`` int32 restarting at 0 per segment). ``hidden[:, t]``
    followed by the head predicts token ``t + 1``; a packed segment's hidden states equal those of
    the sequence alone in an unpadded row (float32 rounding aside). The caller applies the head,
    ``project(head(params), hidden[:, chunk])``, ``logit_chunk`` positions at a time
    (``core.logprobs.target_logprobs``), so no pass builds ``[B, L, vocab]`` logits.

    Attributes:
      logit_chunk: positions per LM-head chunk (>= 1).
    """

    logit_chunk: int

    def hidden(self, params: Any, input_ids: Int[ArrayLike, "rows length"], valid_mask: Bool[ArrayLike, "rows length"],
               remat: str | None = None) -> Float[Array, "rows length embed"]:
        """``[B, L, embed]`` final hidden states of padded rows; ``remat`` overrides the
        implementation's rematerialisation (``"none"``: nothing saved for a backward pass)."""

    def packed_hidden(self, params: Any, input_ids: Int[ArrayLike, "rows length"],
                      segment_ids: Int[ArrayLike, "rows length"], positions: Int[ArrayLike, "rows length"],
                      remat: str | None = None) -> Float[Array, "rows length embed"]:
        """``[B, L, embed]`` final hidden states of packed rows (``remat`` as ``hidden``)."""

    def head(self, params: Any) -> Any:
        """The LM head's weights (a pytree; gradients flow to it): ``project``'s first argument."""

    def project(self, weight: Any, hidden: Float[Array, "rows chunk embed"]) -> Float[Array, "rows chunk vocab"]:
        """``hidden [B, C, embed]`` → float32 logits ``[B, C, vocab]``."""


def _under_mesh(method):
    """``method`` traced under its ``DecoderLogitsFn``'s ``activation_sharding`` (entered in the call
    itself, so a backward pass traced later enters it again)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with activation_sharding(self.mesh, self.rules):
            return method(self, *args, **kwargs)
    return call


class DecoderLogitsFn:
    """``LogitsFn`` of a ``Decoder``: its pure calls over ``(params, arrays)``: logits, hidden
    states and the LM head.

    ``fn(params, input_ids, valid_mask) -> logits``: ``input_ids [B, L]`` int32, ``valid_mask [B, L]``
    bool (True on real tokens, left or right padding or both) → ``logits [B, L, vocab]`` float32,
    where ``logits[:, t]`` predicts token ``t + 1``. Positions come from ``positions_from_mask``
    and the attention mask is ``causal & valid[:, None, :]`` (an ``attention_mask.AttentionMask``: long
    rows run the blocked attention, no ``[B, L, L]`` array), so a padded row's real tokens get
    exactly the logits of the unpadded row. Logits at padding positions are meaningless. Not
    jitted: wrap it yourself.

    The trainer and the scorers never build ``[B, L, vocab]``: they take ``hidden`` (or
    ``packed_hidden``) and hand ``head(params)`` and ``project`` to
    ``core.logprobs.target_logprobs``, which applies the head ``logit_chunk`` positions at a time
    (``token_stats``).

    Args:
      graphdef: from ``split_model``.
      logit_chunk: positions per LM-head chunk of ``token_stats`` (``ExecutionConfig.logit_chunk_tokens``).
      remat: decoder-layer rematerialisation of the hidden-state calls (``Decoder.hidden_states``;
        ``ExecutionConfig.remat``).
      dense_max_len: rows up to this many tokens take dense attention, longer rows blocked
        (``attention_xla.use_blocked``; ``ExecutionConfig.dense_attention_max_len``): memory and
        time, not values.
      attention_impl: the attention strategy (``attention_kernels.resolve_impl``;
        ``ExecutionConfig.attention_impl``): ``"xla"``, ``"cudnn"``, ``"pallas"`` or ``"auto"``.
      mesh, rules: the mesh the calls run on and its logical-axis rules: every call pins the
        activations to their logical axes there (``core.sharding.activation_sharding``: rows over
        ``data`` x ``fsdp``, so an fsdp mesh gathers each layer's weights and keeps the rows
        sharded). ``None``: no constraint (XLA places the activations).

    Raises:
      ValueError: an unknown ``remat``, ``logit_chunk < 1``, ``dense_max_len < 1``, or an
        ``attention_impl`` unknown or without its backend.
    """

    def __init__(self, graphdef: nnx.GraphDef, *, logit_chunk: int = DEFAULT_LOGIT_CHUNK, remat: str = "none",
                 mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES, dense_max_len: int = BLOCKED_MIN_LEN,
                 attention_impl: str = "xla"):
        remat_policy(remat)
        resolve_impl(attention_impl, mesh=mesh)
        if logit_chunk < 1:
            raise ValueError(f"logit_chunk must be >= 1, got {logit_chunk}")
        if dense_max_len < 1:
            raise ValueError(f"dense_max_len must be >= 1, got {dense_max_len}")
        self.graphdef, self.logit_chunk, self.remat = graphdef, int(logit_chunk), remat
        self.dense_max_len, self.attention_impl = int(dense_max_len), attention_impl
        self.mesh, self.rules = mesh, tuple(rules)

    @_under_mesh
    def __call__(self, params: nnx.State, input_ids: Int[ArrayLike, "rows length"],
                 valid_mask: Bool[ArrayLike, "rows length"]) -> Float[Array, "rows length vocab"]:
        model = nnx.merge(self.graphdef, params)
        valid = valid_mask.astype(bool)
        logits, _ = model(input_ids.astype(jnp.int32), positions_from_mask(valid), AttentionMask.causal(valid),
                          remat=self.remat, dense_max_len=self.dense_max_len,
                          attention_impl=self.attention_impl)
        return logits

    @_under_mesh
    def packed(self, params: nnx.State, input_ids: Int[ArrayLike, "rows length"],
               segment_ids: Int[ArrayLike, "rows length"], positions: Int[ArrayLike, "rows length"],
               logits_at: Int[ArrayLike, "rows positions"] | None = None) -> Float[Array, "rows _ vocab"]:
        """The forward pass over sequences packed end to end in each row.

        Args:
          input_ids: ``[B, L]`` int32, several sequences per row, back to back.
          segment_ids: ``[B, L]`` int32, ``k > 0`` on the tokens of the row's k-th sequence, 0 on
            padding. A token attends only to earlier tokens of its own segment (packed attention
            mask; Krell et al. 2021, "Efficient sequence packing without cross-contamination").
          positions: ``[B, L]`` int32 RoPE positions, restarting at 0 per segment (``packed_positions``).
          logits_at: optional ``[B, K]`` int32 columns: logits only there (``Decoder.__call__``).

        Returns:
          ``logits [B, L, vocab]`` (or ``[B, K, vocab]``) float32. Each segment's logits equal
          those of the sequence alone in an unpacked row (float32 rounding aside).
        """
        model = nnx.merge(self.graphdef, params)
        seg = segment_ids.astype(jnp.int32)
        logits, _ = model(input_ids.astype(jnp.int32), positions.astype(jnp.int32), AttentionMask.causal(seg > 0, seg),
                          logits_at=logits_at, remat=self.remat, dense_max_len=self.dense_max_len,
                          attention_impl=self.attention_impl)
        return logits

    @_under_mesh
    def hidden(self, params: nnx.State, input_ids: Int[ArrayLike, "rows length"],
               valid_mask: Bool[ArrayLike, "rows length"], remat: str | None = None) -> Float[Array, "rows length embed"]:
        """``[B, L, embed]`` final hidden states of ``__call__``'s rows (the LM head's input);
        ``remat`` overrides ``self.remat`` (``"none"`` for a pass that is not differentiated: there
        is no backward pass to save anything for)."""
        model = nnx.merge(self.graphdef, params)
        valid = valid_mask.astype(bool)
        x, _ = model.hidden_states(input_ids.astype(jnp.int32), positions_from_mask(valid), AttentionMask.causal(valid),
                                   remat=self.remat if remat is None else remat, dense_max_len=self.dense_max_len,
                          attention_impl=self.attention_impl)
        return x

    @_under_mesh
    def packed_hidden(self, params: nnx.State, input_ids: Int[ArrayLike, "rows length"],
                      segment_ids: Int[ArrayLike, "rows length"], positions: Int[ArrayLike, "rows length"],
                      remat: str | None = None) -> Float[Array, "rows length embed"]:
        """``[B, L, embed]`` final hidden states of ``packed``'s rows (``remat`` as ``hidden``)."""
        model = nnx.merge(self.graphdef, params)
        seg = segment_ids.astype(jnp.int32)
        x, _ = model.hidden_states(input_ids.astype(jnp.int32), positions.astype(jnp.int32),
                                   AttentionMask.causal(seg > 0, seg), remat=self.remat if remat is None else remat,
                                   dense_max_len=self.dense_max_len,
                          attention_impl=self.attention_impl)
        return x

    @_under_mesh
    def head(self, params: nnx.State) -> Float[Array, "embed vocab"] | tuple[Float[Array, "embed vocab"],
                                                                             Float[Array, ""]]:
        """``project``'s weights: the LM head weight ``[embed, vocab]`` (``Decoder.head_weight``),
        or with ``final_logit_softcapping`` the pair ``(weight, cap)`` (cap a float32 scalar)."""
        model = nnx.merge(self.graphdef, params)
        cap = model.cfg.final_logit_softcapping
        return model.head_weight() if cap is None else (model.head_weight(), jnp.float32(cap))

    @_under_mesh
    def project(self, weight: Float[Array, "embed vocab"] | tuple,
                hidden: Float[Array, "rows chunk embed"]) -> Float[Array, "rows chunk vocab"]:
        """``hidden [B, C, embed]`` → float32 logits ``[B, C, vocab]`` (``decoder.project_logits``,
        soft-capped when ``head`` gave a cap)."""
        if isinstance(weight, tuple):
            weight, cap = weight
            return project_logits(weight, hidden, cap)
        return project_logits(weight, hidden)


def make_logits_fn(graphdef: nnx.GraphDef, *, logit_chunk: int = DEFAULT_LOGIT_CHUNK, remat: str = "none",
                   mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
                   dense_max_len: int = BLOCKED_MIN_LEN, attention_impl: str = "xla") -> DecoderLogitsFn:
    """``DecoderLogitsFn(graphdef, logit_chunk=..., remat=..., mesh=..., rules=..., dense_max_len=...,
    attention_impl=...)``: the ``LogitsFn`` of the trainer, the scorers and the evaluation."""
    return DecoderLogitsFn(graphdef, logit_chunk=logit_chunk, remat=remat, mesh=mesh, rules=rules,
                           dense_max_len=dense_max_len, attention_impl=attention_impl)


def token_stats(fn: LogitsFn, params, input_ids: Int[ArrayLike, "rows length"], *,
                valid: Bool[ArrayLike, "rows length"] | None = None,
                segment_ids: Int[ArrayLike, "rows length"] | None = None,
                positions: Int[ArrayLike, "rows length"] | None = None, temperature: float = 1.0,
                entropy: bool = False, grad: bool = True
                ) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"] | None]:
    """Per-token log-probs (and entropies) of ``input_ids`` under ``fn``, shift-by-one convention of
    ``core.logprobs`` (column 0 is 0), without ``[B, L, vocab]`` logits: the hidden states, then
    the LM head in ``fn.logit_chunk``-position chunks.

    Args:
      fn: the model (``LogitsFn``).
      params: the model parameters.
      input_ids: ``[B, L]`` int32.
      valid: ``[B, L]`` bool, for padded rows; or ``segment_ids`` and ``positions`` ``[B, L]``
        int32 for rows packed end to end (``LogitsFn.packed_hidden``).
      temperature: softmax temperature (> 0).
      entropy: also return entropies.
      grad: the result is differentiated (the decoder layers then follow ``fn``'s own
        rematerialisation; ``False``: ``"none"``, nothing saved for a backward pass).

    Returns:
      ``(logp [B, L], entropy [B, L] or None)`` float32.
    """
    ids = input_ids.astype(jnp.int32)
    remat = None if grad else "none"
    hidden = (fn.hidden(params, ids, valid, remat) if segment_ids is None
              else fn.packed_hidden(params, ids, segment_ids, positions, remat))
    return shifted_logprobs(hidden, ids, fn.project, fn.head(params), temperature, fn.logit_chunk, entropy)


def packed_positions(segment_ids: Int[ArrayLike, "rows length"]) -> Int[np.ndarray, "rows length"]:
    """RoPE positions that restart at 0 at the first token of every segment.

    Args:
      segment_ids: ``[B, L]`` int, the segment of each column (0 = padding); a segment is one
        contiguous run of equal ids.

    Returns:
      ``[B, L]`` int32: ``t − (first column of t's run)`` (padding columns numbered the same way).
    """
    seg = np.asarray(segment_ids)
    b, length = seg.shape
    cols = np.broadcast_to(np.arange(length), (b, length))
    new_run = np.ones((b, length), bool)
    new_run[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts = np.maximum.accumulate(np.where(new_run, cols, 0), axis=1)
    return (cols - starts).astype(np.int32)


def sequence_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: Int[ArrayLike, "rows length"],
    valid_mask: Bool[ArrayLike, "rows length"],
    temperature: float = 1.0,
) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"]]:
    """Per-token log-probabilities and entropies of ``input_ids`` under the model.

    Args:
      graphdef, params: from ``split_model``.
      input_ids: ``[B, L]`` int32.
      valid_mask: ``[B, L]`` bool.
      temperature: softmax temperature (> 0), the sampler's.

    Returns:
      ``(logp [B, L], entropy [B, L])`` float32 in nats, shift-by-one convention of
      ``mempo_jax.core.logprobs`` (column t scores token t given tokens < t). Both are 0 where token t
      or its predecessor is padding (nothing real predicts it).
    """
    logp, ent = token_stats(make_logits_fn(graphdef), params, input_ids, valid=valid_mask, temperature=temperature,
                            entropy=True, grad=False)
    valid = valid_mask.astype(bool)
    scored = valid & jnp.concatenate([jnp.zeros_like(valid[:, :1]), valid[:, :-1]], axis=1)
    return jnp.where(scored, logp, 0.0), jnp.where(scored, ent, 0.0)
