"""The decoder's one attention function (``attention``): dense masked softmax for short rows,
blocked (flash-style) attention for long rows and for every KV-cache read.

``dense_attention`` materialises the ``[batch, kv_heads, groups, T, S]`` float32 scores (HF
``eager_attention_forward``); training and scoring rows up to ``BLOCKED_MIN_LEN`` tokens use it.
``blocked_attention`` computes the same result one ``[block_q, block_k]`` tile at a time with the
online-softmax recurrence of FlashAttention (Dao et al. 2022, "FlashAttention", Algorithm 1; Rabe &
Staats 2021, "Self-attention does not need O(n²) memory"): per query block a running maximum
``m``, normaliser ``l`` and weighted sum ``acc`` are rescaled by ``exp(m_old − m_new)`` as each key
block arrives, so no ``[T, S]`` score tensor exists. Over a KV cache (``[layers, slots, kv_heads,
size, head_dim]``, one context per slot from position 0) each key block is sliced out of the cache
in place and the loop stops after the last block any query can see (a traced trip count:
flash-decoding's split-K decode); without a cache, tiles whose mask is all False (above the causal
diagonal, another segment of a packed row, padding) are skipped at run time (``lax.cond``).

Masks come either as a dense ``[batch, T, S]`` bool array or as an ``AttentionMask`` — O(T + S)
integers from which each tile's mask is computed: causal by index (``AttentionMask.causal``, or
by cache position, ``AttentionMask.cached``), key validity, and optional segment ids (packed rows:
a query attends only to keys of its own segment).

Which implementation runs is a named strategy (``ExecutionConfig.attention_impl``, resolved by
``resolve_impl``): ``"xla"`` is the dense / blocked code above on every backend; ``"cudnn"`` (GPU)
runs training and cache-less prefill through cuDNN's flash attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) and one-token decode over the KV-cache
slots through the Pallas GPU paged-attention kernel (``jax.experimental.pallas.ops.gpu``);
``"pallas"`` (TPU) runs them through the Pallas TPU splash-attention and paged-attention kernels
(``jax.experimental.pallas.ops.tpu``); ``"auto"`` picks per backend. The masks stay ours: causal
order, key validity and packed-row segments become the kernels' segment ids / mask, cache
positions their per-row lengths. ``interpret_kernels(platform)`` runs a platform's kernel paths on
the host (Pallas in interpret mode, cuDNN's call through its XLA implementation), for tests.

The platform is the one the program is compiled for: that of the devices of the mesh the model
function is traced under (``core.sharding.activation_sharding``), so a CPU host lowering for a
TPU slice's compile-only devices (``run.aot``) gets the TPU program; without a mesh, JAX's
default backend. A Mosaic (Pallas TPU) or Triton (Pallas GPU) kernel cannot be partitioned by XLA,
so on a mesh of several devices each kernel runs under ``jax.shard_map`` over the mesh's batch and
head axes (the activations' logical-axis rules): splash attention on each device's rows and kv
heads with their segment ids; paged decode on each device's cache slots and kv heads, every query
row served by the device that holds its slot (``paged_decode``). cuDNN's attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) is a ``custom_partitioning`` call in
JAX (batch and head dimensions sharded, sequence and head_dim not): it partitions under ``jit``
as it is.

A kernel that cannot take a shape (``kernel_problem``: the TPU paged-attention kernel needs a
head_dim that is a multiple of 128) leaves that path to XLA under ``"auto"``, with one log line;
an explicit ``"pallas"`` is refused at start-up (``check_kernels``) with one line naming the field,
the shape and the reason.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.model.attention_kernels import (KERNEL_PLATFORM, cudnn_attention, log_fallback, paged_decode,
                                              splash_attention, interpret_active, kernel_problem, resolve_impl)
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.attention_xla import BLOCK_K, BLOCKED_MIN_LEN, blocked_attention, dense_attention, use_blocked


def attention(q: Float[ArrayLike, "rows length heads head_dim"], k: Float[ArrayLike, "*cache _ _ head_dim"],
              v: Float[ArrayLike, "*cache _ _ head_dim"], mask: Bool[Array, "rows length keys"] | AttentionMask, *, heads_major: bool = False,
              layer: Int[ArrayLike, ""] | None = None, rows: Int[Array, "rows"] | None = None,
              kv_bound: Int[ArrayLike, ""] | None = None,
              block_k: int = BLOCK_K,
              dense_max_len: int = BLOCKED_MIN_LEN, impl: str = "xla") -> Float[Array, "rows length heads head_dim"]:
    """The decoder's attention. Arguments and result as ``blocked_attention`` (``[batch, T, heads,
    head_dim]`` in ``q.dtype``, before the output projection); ``impl`` is
    ``ExecutionConfig.attention_impl`` (``resolve_impl``).

    ``"xla"``: ``blocked_attention`` for a KV cache (``layer`` given) and for rows longer than
    ``dense_max_len`` tokens (``use_blocked``), ``dense_attention`` otherwise; dense keeps a
    ``[batch, heads, T, S]`` float32 score block per layer for the backward pass, blocked one tile.
    A kernel strategy (``"cudnn"``, ``"pallas"``) takes over where its kernel applies and leaves
    the rest to ``"xla"``:

    - without a cache, under an ``AttentionMask.causal`` mask (``q_index`` the column index: the
      forward passes' masks): cuDNN flash attention for bfloat16 / float16 queries (float32 rows
      stay on XLA: cuDNN has no float32 kernel), splash attention on TPU. A dense bool mask takes XLA.
    - over a cache, one query token per row (decode): paged attention, reading each row's
      ``position + 1`` keys. The TPU kernel reads K/V in bfloat16, so it takes bfloat16 caches
      only; the GPU kernel a cache of ``q.dtype``. A cache size that is no multiple of 16 tokens,
      and prefill (T > 1) over a cache, take XLA (``kv_bound`` bounds the blocks read there).

    The strategies agree up to float32 summation order (tests/model/test_attention.py runs each
    kernel path in interpret mode against XLA, forward and gradient).

    Raises:
      ValueError: as ``blocked_attention``, or from ``resolve_impl``.
    """
    requested, impl = impl, resolve_impl(impl)
    if isinstance(mask, AttentionMask) and mask.window is not None:
        impl = "xla"  # the kernels take no sliding window
    interpret = interpret_active()
    if layer is not None:
        if impl != "xla" and q.shape[1] == 1 and isinstance(mask, AttentionMask) and (
                k.dtype == jnp.bfloat16 if impl == "pallas" else k.dtype == q.dtype):
            problem = None if interpret else kernel_problem(impl, q.shape[-1], KERNEL_PLATFORM[impl])
            if problem and requested != "auto":
                raise ValueError(f"ExecutionConfig.attention_impl={requested!r}: {problem} (use 'auto' or 'xla')")
            out = None if problem else paged_decode(q, k, v, mask, layer, rows, KERNEL_PLATFORM[impl], interpret)
            if problem:
                log_fallback(problem)
            if out is not None:
                return out
        return blocked_attention(q, k, v, mask, layer=layer, rows=rows, kv_bound=kv_bound, block_k=block_k)
    if impl != "xla" and isinstance(mask, AttentionMask) and mask.kv_valid is not None:
        kk, vv = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) if heads_major else (k, v)
        if impl == "pallas":
            return splash_attention(q, kk, vv, mask, interpret)
        if interpret or q.dtype in (jnp.bfloat16, jnp.float16):
            return cudnn_attention(q, kk, vv, mask, interpret)
    t = q.shape[1]
    s = k.shape[2] if heads_major else k.shape[1]
    if use_blocked(t, s, min_len=dense_max_len):
        return blocked_attention(q, k, v, mask, heads_major=heads_major, kv_bound=kv_bound, block_k=block_k)
    return dense_attention(q, k, v, mask, heads_major=heads_major)
