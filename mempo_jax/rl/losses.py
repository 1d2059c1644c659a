"""PPO/GRPO policy loss with KL to a reference policy (docs/algorithm.md §5).

Formulas follow verl's ``trainer/ppo/core_algos.py``: ``compute_policy_loss`` (clipped surrogate
with dual clip), ``kl_penalty`` (k1 / k2 / k3 estimators with their clamps) and ``agg_loss``.
Unlike verl, aggregation returns a ``(sum, denominator)`` pair (tunix style): the trainer adds the
sums of all micro-batches and divides once by the denominator of the whole mini-batch, so
gradient accumulation equals the full-batch gradient.

All arrays are ``[batch, seq]``; log-probabilities are natural-log float32 of the sampled tokens
(``mempo_jax.core.logprobs.token_logprobs``); masks are bool or {0, 1} floats.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Float, Int, Shaped

from mempo_jax.core.registry import Registry
from mempo_jax.core.validation import check

Array = jax.Array
KLFn = Callable[[Array, Array], Array]
AggFn = Callable[[Array, Array, "int | None", "Array | None"], "tuple[Array, Array]"]
_KL: Registry[KLFn] = Registry("KL estimator")
_AGG: Registry[AggFn] = Registry("loss aggregation mode")
register_kl_estimator = _KL.register  # fn(logp, ref_logp) -> [B, T], under one or more names
register_loss_agg_mode = _AGG.register  # fn(values, mask, norm_length, segment_ids) -> (sum, denominator)


ZERO_ADVANTAGE_CHOICES = ("train", "skip")  # LossConfig.zero_advantage


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static options of the MemPO policy loss (docs/algorithm.md §5; verl actor defaults).

    Attributes:
      clip_ratio_low / clip_ratio_high: ratio clipped to ``[1 - low, 1 + high]``.
      clip_ratio_c: dual-clip bound; for A < 0 the per-token loss is at most ``c · |A|``.
      kl_coef: weight of the KL-to-reference loss term (0 disables it).
      kl_type: a registered KL estimator ("low_var_kl"/"k3", "k1"/"kl", "k2"/"mse", "abs").
      entropy_coef: weight of the entropy bonus (subtracted from the loss).
      loss_agg_mode: a registered aggregation mode (see ``aggregate_loss``).
      zero_advantage: what ``Learner.ppo_update`` does with a mini-batch whose loss tokens all
        carry advantage 0 (every group in it scored alike; with ``RLConfig.memory_coef = 0``
        common once a policy stops answering): ``"train"`` runs its optimizer step like any other
        (its gradient is the KL term alone, and Adam's first moment keeps moving the parameters
        along the earlier steps' direction: by up to the learning rate per step where those
        gradients agreed); ``"skip"`` does not run it (parameters and optimizer state unchanged,
        like a mini-batch without loss tokens). DAPO's dynamic sampling (arXiv:2503.14476 §3.2)
        goes further: it drops each zero-variance group and samples more to refill the batch.

    Raises:
      ValueError: one line naming the field: an unknown ``kl_type`` / ``loss_agg_mode`` /
        ``zero_advantage``,
        ``clip_ratio_c <= 1``, a clip ratio or ``kl_coef`` below 0, ``clip_ratio_low >= 1``, a
        non-finite value.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    zero_advantage: str = "train"

    def __post_init__(self):
        check(self, "kl_type", str, choices=_KL.names())
        check(self, "zero_advantage", str, choices=ZERO_ADVANTAGE_CHOICES)
        check(self, "loss_agg_mode", str, choices=_AGG.names())
        check(self, "clip_ratio_c", float, gt=1.0)  # dual clip
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef"):
            check(self, name, float, lo=0.0)
        check(self, "clip_ratio_low", float, lt=1.0)  # the ratio's lower clip 1 - low stays > 0
        check(self, "entropy_coef", float)


@register_kl_estimator("k1", "kl")
def _kl_k1(logp: Array, ref_logp: Array) -> Array:
    return logp - ref_logp


@register_kl_estimator("abs")
def _kl_abs(logp: Array, ref_logp: Array) -> Array:
    return jnp.abs(logp - ref_logp)


@register_kl_estimator("k2", "mse")
def _kl_k2(logp: Array, ref_logp: Array) -> Array:
    return 0.5 * jnp.square(logp - ref_logp)


@register_kl_estimator("k3", "low_var_kl")
def _kl_k3(logp: Array, ref_logp: Array) -> Array:
    kl = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


def kl_penalty(logp: Float[ArrayLike, "*batch"], ref_logp: Float[ArrayLike, "*batch"], kind: str) -> Float[Array, "*batch"]:
    """Per-token KL estimate between the policy and the reference (verl ``kl_penalty``).

    * ``"k1"``/``"kl"``: ``logp - ref_logp``;
    * ``"k2"``/``"mse"``: ``0.5 (logp - ref_logp)²``;
    * ``"k3"``/``"low_var_kl"``: ``kl = clip(ref_logp - logp, ±20)``,
      ``clip(exp(kl) - kl - 1, ±10)`` (Schulman's unbiased, non-negative estimator);
    * ``"abs"``: ``|logp - ref_logp|``.

    Args:
      logp, ref_logp: ``[B, T]`` float32 log-probabilities (nats) of the same tokens.
      kind: estimator name.

    Returns:
      ``[B, T]`` float32 (nats), unmasked.

    Raises:
      ValueError: for an unknown ``kind`` (the message names it).
    """
    return _KL.get(kind)(jnp.asarray(logp, jnp.float32), jnp.asarray(ref_logp, jnp.float32))


def _policy_terms(logp, old_logp, advantages, loss_mask, cfg: LossConfig):
    m = jnp.asarray(loss_mask, bool)
    adv = jnp.asarray(advantages, jnp.float32)
    neg_approx_kl = jnp.clip(jnp.asarray(logp, jnp.float32) - old_logp, -20.0, 20.0)
    ratio = jnp.exp(neg_approx_kl)
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clip_loss1 = jnp.maximum(loss1, loss2)
    loss3 = -adv * cfg.clip_ratio_c
    clip_loss2 = jnp.minimum(loss3, clip_loss1)
    pg = jnp.where(adv < 0, clip_loss2, clip_loss1)
    clipped = (loss2 > loss1).astype(jnp.float32)
    clipped_lower = ((clip_loss1 > loss3) & (adv < 0)).astype(jnp.float32)
    zero = lambda x: jnp.where(m, x, 0.0)  # noqa: E731
    return zero(pg), zero(clipped), zero(-neg_approx_kl), zero(clipped_lower)


def policy_loss(
    logp: Float[ArrayLike, "rows length"],
    old_logp: Float[ArrayLike, "rows length"],
    advantages: Float[ArrayLike, "rows length"],
    loss_mask: Shaped[ArrayLike, "rows length"],
    cfg: LossConfig,
) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"], Float[Array, "rows length"]]:
    """Per-token clipped PPO surrogate with dual clip (verl ``compute_policy_loss``).

    ``ratio = exp(clip(logp - old_logp, ±20))``;
    ``L = max(-A·ratio, -A·clip(ratio, 1 - ε_low, 1 + ε_high))``; for ``A < 0`` additionally
    ``L = min(L, -A·c)`` (dual clip, Ye et al. 2020).

    Args:
      logp: ``[B, T]`` float32 log-probs under the current policy (differentiated).
      old_logp: ``[B, T]`` float32 log-probs under the sampling policy (constants).
      advantages: ``[B, T]`` float32.
      loss_mask: ``[B, T]`` bool/float; outputs are 0 where it is 0.
      cfg: ``LossConfig`` (clip ratios).

    Returns:
      ``(pg_losses, clipped, ppo_kl)``, each ``[B, T]`` float32: the per-token loss, 1.0 where
      the ε-clip was active (``-A·clip(ratio) > -A·ratio``), and ``old_logp - logp`` (clamped).
    """
    pg, clipped, ppo_kl, _ = _policy_terms(logp, old_logp, advantages, loss_mask, cfg)
    return pg, clipped, ppo_kl


def _row_sums(x: Float[Array, "rows length"], segment_ids: Int[ArrayLike, "rows length"] | None) -> Float[Array, "rows _"]:
    """Per-sequence sums of ``x [B, T]``: ``[B, 1]`` (each row one sequence) without
    ``segment_ids``; with them ``[B, T + 1]``, column k the sum over the row's k-th packed
    sequence (column 0: padding)."""
    if segment_ids is None:
        return jnp.sum(x, axis=-1, keepdims=True)
    t = x.shape[-1]
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=t + 1))(x, jnp.asarray(segment_ids, jnp.int32))


def _num_sequences(mask: Float[Array, "rows length"], segment_ids: Int[ArrayLike, "rows length"] | None) -> Float[Array, ""]:
    """Sequences with at least one loss token (float32 scalar)."""
    return jnp.sum((_row_sums(mask, segment_ids) > 0).astype(jnp.float32))


@register_loss_agg_mode("token-mean")
def _agg_token_mean(values, mask, norm_length=None, segment_ids=None):
    return jnp.sum(values * mask), jnp.sum(mask)


@register_loss_agg_mode("seq-mean-token-mean")
def _agg_seq_mean_token_mean(values, mask, norm_length=None, segment_ids=None):
    n_tok = _row_sums(mask, segment_ids)
    per_seq = _row_sums(values * mask, segment_ids) / jnp.maximum(n_tok, 1.0)
    return jnp.sum(per_seq), jnp.sum((n_tok > 0).astype(jnp.float32))


@register_loss_agg_mode("seq-mean-token-sum")
def _agg_seq_mean_token_sum(values, mask, norm_length=None, segment_ids=None):
    return jnp.sum(values * mask), _num_sequences(mask, segment_ids)


@register_loss_agg_mode("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(values, mask, norm_length=None, segment_ids=None):
    length = values.shape[-1] if norm_length is None else norm_length
    total = jnp.sum(values * mask) / jnp.float32(length)
    return total, _num_sequences(mask, segment_ids)


def loss_denominator(mask: Shaped[ArrayLike, "rows length"], mode: str,
                     segment_ids: Int[ArrayLike, "rows length"] | None = None) -> Float[Array, ""]:
    """The denominator of a whole mini-batch for ``mode`` (float32 scalar): the registered mode's
    own denominator (``aggregate_loss``) over the mini-batch — its loss tokens for
    ``"token-mean"``, else its sequences with at least one loss token (rows, or the packed
    sequences of ``segment_ids``).

    Raises:
      ValueError: for an unknown ``mode``.
    """
    mask = jnp.asarray(mask, jnp.float32)
    return aggregate_loss(jnp.zeros_like(mask), mask, mode, segment_ids=segment_ids)[1]


def aggregate_loss(
    values: Float[ArrayLike, "rows length"],
    mask: Shaped[ArrayLike, "rows length"],
    mode: str,
    norm_length: int | None = None,
    segment_ids: Int[ArrayLike, "rows length"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Masked aggregation as a ``(sum, denominator)`` pair (verl ``agg_loss``, summable form).

    The loss is ``Σ_micro sum / Σ_micro denominator`` over the whole mini-batch (see
    ``safe_divide``). Modes (``m`` = mask, sequences with no valid token count nowhere):

    * ``"token-mean"``: ``(Σ v·m, Σ m)``;
    * ``"seq-mean-token-mean"``: ``(Σ_seq Σ_t v·m / Σ_t m, #seqs with ≥ 1 token)``;
    * ``"seq-mean-token-sum"``: ``(Σ v·m, #seqs with ≥ 1 token)``;
    * ``"seq-mean-token-sum-norm"``: ``(Σ v·m / L, #seqs with ≥ 1 token)``, ``L = norm_length``
      or ``T``; keep ``L`` constant across micro-batches and steps (Dr. GRPO). verl divides this
      mode by ``L`` only (no mean over sequences); here it is a mean over sequences as well.

    A sequence is a row, or with ``segment_ids`` each packed sequence of a row (the PPO update
    packs rows end to end, ``core.packing.pack_token_rows``), so packing changes no mode's value.

    Args:
      values: ``[B, T]`` float per-token values.
      mask: ``[B, T]`` bool/float.
      mode: a registered aggregation mode.
      norm_length: static constant ``L`` of "seq-mean-token-sum-norm"; default ``T``.
      segment_ids: optional ``[B, T]`` int32, ``k >= 1`` on a row's k-th packed sequence, 0 on
        padding; ``None``: each row is one sequence.

    Returns:
      ``(sum, denominator)``, two float32 scalars.

    Raises:
      ValueError: for an unknown ``mode`` (the message names it).
    """
    fn = _AGG.get(mode)
    mask = jnp.asarray(mask, jnp.float32)
    values = jnp.where(mask != 0, jnp.asarray(values, jnp.float32), 0.0)  # NaN/inf off-mask stay out
    return fn(values, mask, norm_length, segment_ids)


def safe_divide(total: Float[ArrayLike, "*batch"], denominator: Float[ArrayLike, "*batch"]) -> Float[Array, "*batch"]:
    """``total / max(denominator, 1)``: the loss (or metric mean) from accumulated sums."""
    return total / jnp.maximum(denominator, 1.0)


def mempo_loss(
    logp: Float[ArrayLike, "rows length"],
    old_logp: Float[ArrayLike, "rows length"],
    ref_logp: Float[ArrayLike, "rows length"] | None,
    advantages: Float[ArrayLike, "rows length"],
    loss_mask: Shaped[ArrayLike, "rows length"],
    cfg: LossConfig,
    entropy: Float[ArrayLike, "rows length"] | None = None,
    segment_ids: Int[ArrayLike, "rows length"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""], dict[str, Float[Array, ""]]]:
    """MemPO actor loss of one micro-batch as summable parts (docs/algorithm.md §5).

    Per token: ``pg + kl_coef · kl_penalty(logp, ref_logp, kl_type) - entropy_coef · entropy``,
    aggregated with ``cfg.loss_agg_mode``. The mini-batch loss is
    ``safe_divide(Σ loss_sum, Σ denominator)`` over its micro-batches; each metric likewise.

    Args:
      logp: ``[B, T]`` float32 current-policy log-probs (the differentiated input).
      old_logp: ``[B, T]`` float32 sampling-policy log-probs.
      ref_logp: ``[B, T]`` float32 reference-policy log-probs; may be None iff ``kl_coef == 0``.
      advantages: ``[B, T]`` float32 (``advantage.token_advantages``).
      loss_mask: ``[B, T]`` bool/float, 1 on trained tokens.
      cfg: ``LossConfig``.
      entropy: ``[B, T]`` float32 token entropies (nats); required iff ``entropy_coef != 0``.
      segment_ids: optional ``[B, T]`` int32 packed-sequence ids (``aggregate_loss``).

    Returns:
      ``(loss_sum, denominator, metrics)``: float32 scalars and a dict of float32 scalar *sums*
      ``pg_loss, kl, clipfrac, clipfrac_lower, ppo_kl, entropy`` (same denominator; 0 for an
      absent term).

    Raises:
      ValueError: if ``ref_logp`` / ``entropy`` is missing while its coefficient is non-zero.
    """
    if ref_logp is None and cfg.kl_coef != 0.0:
        raise ValueError("ref_logp is required when kl_coef != 0")
    if entropy is None and cfg.entropy_coef != 0.0:
        raise ValueError("entropy is required when entropy_coef != 0")
    mask = jnp.asarray(loss_mask, jnp.float32)
    agg = lambda v: aggregate_loss(v, mask, cfg.loss_agg_mode, segment_ids=segment_ids)[0]  # noqa: E731

    pg, clipped, ppo_kl, clipped_lower = _policy_terms(logp, old_logp, advantages, mask, cfg)
    per_token = pg
    zero = jnp.zeros((), jnp.float32)
    kl_sum = ent_sum = zero
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg.kl_type)
        kl_sum = agg(kl)
        if cfg.kl_coef != 0.0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None:
        ent = jnp.asarray(entropy, jnp.float32)
        ent_sum = agg(ent)
        if cfg.entropy_coef != 0.0:
            per_token = per_token - cfg.entropy_coef * ent
    loss_sum, denominator = aggregate_loss(per_token, mask, cfg.loss_agg_mode, segment_ids=segment_ids)
    metrics = {
        "pg_loss": agg(pg),
        "kl": kl_sum,
        "clipfrac": agg(clipped),
        "clipfrac_lower": agg(clipped_lower),
        "ppo_kl": agg(ppo_kl),
        "entropy": ent_sum,
    }
    return loss_sum, denominator, metrics
