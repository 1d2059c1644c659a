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
row served by the device that holds its slot (``_paged_decode``). cuDNN's attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) is a ``custom_partitioning`` call in
JAX (batch and head dimensions sharded, sequence and head_dim not): it partitions under ``jit``
as it is.

A kernel that cannot take a shape (``kernel_problem``: the TPU paged-attention kernel needs a
head_dim that is a multiple of 128) leaves that path to XLA under ``"auto"``, with one log line;
an explicit ``"pallas"`` is refused at start-up (``check_kernels``) with one line naming the field,
the shape and the reason.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from mempo_jax.core.sharding import active_mesh, logical_to_spec

_log = logging.getLogger(__name__)

# logical axes of a KV cache ``[layers, slots, kv_heads, size, head_dim]`` (KVCache.k / .v; model.placement)
CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")
BLOCK_Q = 256  # query rows per tile (tokens)
BLOCK_K = 256  # key columns per tile (tokens)

_NEG = jnp.finfo(jnp.float32).min  # masked score (as dense_attention: a fully masked row is uniform, never NaN)


class AttentionMask(NamedTuple):
    """A structural attention mask: query t may attend to key s iff

    ``kv_valid[b, s] and s <= q_index[b, t] and (segments are None or q_segments[b, t] == kv_segments[b, s])``
    ``and (window is None or s > q_index[b, t] - window)``.

    Attributes:
      q_index: ``[batch, T]`` int32, the key index (KV-cache position, or column of the same
        sequence) of each query token: causality is ``s <= q_index``.
      kv_valid: ``[batch, S]`` bool, True on keys that hold a real token; ``None``: every key
        (a KV cache read by position, ``AttentionMask.cached``; its ``shape`` then has ``S = None``).
      q_segments: optional ``[batch, T]`` int32 segment id of each query (packed rows).
      kv_segments: optional ``[batch, S]`` int32 segment id of each key.
      window: optional int32 scalar (may be traced) W >= 1: a query sees only the W keys ending at
        its own index (sliding-window attention, HF ``sliding_window_overlay``: ``s > q_index − W``).
        The kernel strategies take no window: a windowed mask runs on ``"xla"``.
    """

    q_index: Int[Array, "rows length"]
    kv_valid: Optional[Bool[Array, "rows keys"]]
    q_segments: Optional[Int[Array, "rows length"]] = None
    kv_segments: Optional[Int[Array, "rows keys"]] = None
    window: Optional[Int[ArrayLike, ""]] = None

    @classmethod
    def causal(cls, valid: Bool[ArrayLike, "rows length"],
               segment_ids: Int[ArrayLike, "rows length"] | None = None) -> "AttentionMask":
        """The mask of a forward pass without a cache over ``valid [batch, L]`` bool (keys are the
        queries themselves: ``q_index = arange(L)``), packed by ``segment_ids [batch, L]`` when given."""
        b, length = valid.shape
        q_index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        return cls(q_index, valid.astype(bool), segment_ids, segment_ids)

    @classmethod
    def cached(cls, positions: Int[ArrayLike, "rows length"]) -> "AttentionMask":
        """The mask of new tokens at KV-cache ``positions [batch, T]`` int32: each attends to the
        cache positions ``<= `` its own (a slot holds one context from position 0)."""
        return cls(positions.astype(jnp.int32), None)

    @property
    def shape(self) -> tuple[int, int, int | None]:
        """``(batch, T, S)``, the shape of the dense mask it stands for (``S = None`` without ``kv_valid``)."""
        s = None if self.kv_valid is None else self.kv_valid.shape[1]
        return (self.q_index.shape[0], self.q_index.shape[1], s)

    def dense(self, s: int | None = None) -> Bool[Array, "rows length keys"]:
        """The ``[batch, T, S]`` bool mask (``s``: the key count when ``kv_valid`` is None)."""
        return self.tile(0, 0, self.q_index.shape[1], self.kv_valid.shape[1] if s is None else s)

    def tile(self, q0, k0, bq: int, bk: int) -> Bool[Array, "rows {bq} {bk}"]:
        """``[batch, bq, bk]`` bool mask of queries ``[q0, q0 + bq)`` and keys ``[k0, k0 + bk)``
        (``q0``, ``k0`` may be traced; the arrays must already cover the ranges)."""
        qi = jax.lax.dynamic_slice_in_dim(self.q_index, q0, bq, axis=1)
        ks = k0 + jnp.arange(bk, dtype=jnp.int32)
        m = ks[None, None, :] <= qi[:, :, None]
        if self.kv_valid is not None:
            m = m & jax.lax.dynamic_slice_in_dim(self.kv_valid, k0, bk, axis=1)[:, None, :]
        if self.q_segments is not None:
            qs = jax.lax.dynamic_slice_in_dim(self.q_segments, q0, bq, axis=1)
            kseg = jax.lax.dynamic_slice_in_dim(self.kv_segments, k0, bk, axis=1)
            m = m & (qs[:, :, None] == kseg[:, None, :])
        if self.window is not None:
            m = m & (ks[None, None, :] > qi[:, :, None] - self.window)
        return m

    def pad(self, t: int, s: int) -> "AttentionMask":
        """Padded to ``t`` queries and ``s`` keys (new keys invalid, new queries at index −1: they see nothing)."""
        def p(x, n, v):
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=v)
        qs = None if self.q_segments is None else p(self.q_segments, t, -1)
        ks = None if self.kv_segments is None else p(self.kv_segments, s, -2)
        kv = None if self.kv_valid is None else p(self.kv_valid, s, False)
        return AttentionMask(p(self.q_index, t, -1), kv, qs, ks, self.window)


def _grouped(q: Float[ArrayLike, "rows length heads head_dim"],
             kvh: int) -> Float[ArrayLike, "rows length {kvh} _ head_dim"]:
    """``[B, T, H, hd]`` → ``[B, T, kv_heads, groups, hd]`` (query head j uses kv head j // groups, HF repeat_kv)."""
    b, t, h, hd = q.shape
    return q.reshape(b, t, kvh, h // kvh, hd)


def dense_attention(q: Float[ArrayLike, "rows length heads head_dim"], k: Float[ArrayLike, "rows _ _ head_dim"],
                    v: Float[ArrayLike, "rows _ _ head_dim"], mask: Bool[Array, "rows length keys"] | AttentionMask, *,
                    heads_major: bool = False) -> Float[Array, "rows length heads head_dim"]:
    """Masked softmax attention, scores materialised (HF ``eager_attention_forward`` with GQA).

    Args:
      q: ``[batch, T, heads, head_dim]``.
      k, v: ``[batch, S, kv_heads, head_dim]``, or ``[batch, kv_heads, S, head_dim]`` with ``heads_major``.
      mask: ``[batch, T, S]`` bool or an ``AttentionMask``; a query row with no True entry gets
        uniform weights (garbage, never NaN).
      heads_major: layout of ``k``/``v``.

    Returns:
      ``[batch, T, heads, head_dim]`` in ``q.dtype`` (before the output projection). Scores and
      softmax in float32, the probabilities cast to ``q.dtype`` for the value product.
    """
    b, t, h, hd = q.shape
    kvh = k.shape[1] if heads_major else k.shape[2]
    if isinstance(mask, AttentionMask):
        mask = mask.dense(k.shape[2] if heads_major else k.shape[1])
    kv_spec = "bksh" if heads_major else "bskh"
    qg = _grouped(q, kvh)
    scores = jnp.einsum(f"btkgh,{kv_spec}->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgh", probs, v.astype(q.dtype)).reshape(b, t, h, hd)


def _key_block(cache: Float[ArrayLike, "layers slots kv_heads cache head_dim"], layer, rows, start,
               block: int) -> Float[Array, "_ kv_heads {block} head_dim"]:
    """``[B, kv_heads, block, head_dim]``: positions ``[start, start + block)`` of layer ``layer``
    of slots ``rows`` (``None``: every slot) of a ``[layers, slots, kv_heads, S, head_dim]`` cache,
    sliced in place (neither the layer nor the rows' slots are copied first)."""
    _, s, kvh, _, hd = cache.shape
    layer, start = jnp.asarray(layer, jnp.int32), jnp.asarray(start, jnp.int32)
    zero = jnp.int32(0)
    if rows is None:
        return jax.lax.dynamic_slice(cache, (layer, zero, zero, start, zero), (1, s, kvh, block, hd))[0]
    return jax.vmap(lambda r: jax.lax.dynamic_slice(cache, (layer, r, zero, start, zero),
                                                    (1, 1, kvh, block, hd))[0, 0])(rows.astype(jnp.int32))


def blocked_attention(q: Float[ArrayLike, "rows length heads head_dim"], k: Float[ArrayLike, "*cache _ _ head_dim"],
                      v: Float[ArrayLike, "*cache _ _ head_dim"], mask: Bool[Array, "rows length keys"] | AttentionMask, *,
                      heads_major: bool = False, layer: Int[ArrayLike, ""] | None = None,
                      rows: Int[Array, "rows"] | None = None, kv_bound: Int[ArrayLike, ""] | None = None,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Float[Array, "rows length heads head_dim"]:
    """``dense_attention`` computed tile by tile with an online softmax (FlashAttention, Alg. 1).

    Queries are processed ``block_q`` at a time (``lax.map``; each query block rematerialised in
    the backward pass, ``jax.checkpoint``), keys ``block_k`` at a time inside. Per key tile the
    running max ``m``, normaliser ``l`` and weighted sum ``acc`` are rescaled by
    ``exp(m_old − m_new)``; masked entries get probability exactly 0. Peak attention memory is one
    ``[batch, heads, block_q, block_k]`` float32 tile instead of ``[batch, heads, T, S]``.

    Which key tiles are read: with ``kv_bound`` (a traced scalar: no query sees a key at or past
    it) only the first ``ceil(kv_bound / block_k)`` tiles (a ``while`` loop, forward only: the
    decode and prefill of a KV cache, flash-decoding's split-K); without it every tile, a tile
    whose mask is all False for every row being skipped (``lax.cond``; reverse-differentiable).

    Args:
      q: ``[batch, T, heads, head_dim]`` (after RoPE).
      k, v: ``[batch, S, kv_heads, head_dim]``, ``[batch, kv_heads, S, head_dim]`` with
        ``heads_major``, or, with ``layer``, a whole KV cache ``[layers, slots, kv_heads, S,
        head_dim]`` of which query row b reads layer ``layer`` of slot ``rows[b]`` (``rows=None``:
        slot b), each key tile sliced straight out of the cache.
      mask: ``[batch, T, S]`` bool or an ``AttentionMask`` (``kv_valid=None``: every key valid,
        the mask of a KV cache read by position).
      heads_major: layout of ``k``/``v`` (ignored with ``layer``).
      layer: int32 scalar layer of a whole cache; rows: ``[batch]`` int32 slots, with ``layer`` only.
      kv_bound: optional int32 scalar ``> `` every key position any used query sees.
      block_q, block_k: tile sizes (tokens; clipped to T and S). With ``layer``, ``S`` must be a
        multiple of the key tile (the cache is not padded).

    Returns:
      ``[batch, T, heads, head_dim]`` in ``q.dtype``, equal to ``dense_attention`` within float32
      rounding on every query row with at least one True mask entry (a row with none gets 0).

    Raises:
      ValueError: if the mask's shape is not ``[batch, T, S]``, ``heads`` is not a multiple of
        ``kv_heads``, ``rows`` come without ``layer``, or the cache does not match the rows / tile.
    """
    b, t, h, hd = q.shape
    if layer is None:
        if rows is not None:
            raise ValueError("rows needs a whole cache and its layer index")
        if not heads_major:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, kv, S, hd]
        k, v, layer = k[None], v[None], 0
    kvh, s = k.shape[2], k.shape[3]
    if rows is None and k.shape[1] != b:
        raise ValueError(f"{b} query rows but {k.shape[1]} cache slots (pass rows=)")
    if h % kvh:
        raise ValueError(f"heads {h} must be a multiple of kv heads {kvh}")
    mshape = mask.shape if isinstance(mask, AttentionMask) else tuple(mask.shape)
    if mshape[2] is not None and tuple(mshape) != (b, t, s):
        raise ValueError(f"attention mask {tuple(mshape)} must be [batch, T, S] = {(b, t, s)}")
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    if sp != s:
        if k.shape[0] != 1 or rows is not None:
            raise ValueError(f"cache size {s} must be a multiple of the key block {bk}")
        k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, sp - s), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, sp - s), (0, 0)))
    g = h // kvh
    qg = (_grouped(q, kvh).astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(hd))).astype(q.dtype)
    qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    if isinstance(mask, AttentionMask):
        mask = mask.pad(tp, sp)
        tile = mask.tile
    else:
        dense = jnp.pad(mask.astype(bool), ((0, 0), (0, tp - t), (0, sp - s)))

        def tile(q0, k0, bq_, bk_):
            return jax.lax.dynamic_slice(dense, (0, q0, k0), (b, bq_, bk_))

    def q_block(qi):
        q0 = qi * bq
        qb = jax.lax.dynamic_slice_in_dim(qg, q0, bq, axis=1)  # [B, bq, kv, g, hd]

        def update(j, carry, mt):
            m, l, acc = carry
            kb = _key_block(k, layer, rows, j * bk, bk).astype(q.dtype)  # [B, kv, bk, hd]
            vb = _key_block(v, layer, rows, j * bk, bk).astype(q.dtype)
            sc = jnp.einsum("btkgh,bksh->bkgts", qb, kb, preferred_element_type=jnp.float32)
            sc = jnp.where(mt[:, None, None], sc, _NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(mt[:, None, None], jnp.exp(sc - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(q.dtype), vb,
                                                     preferred_element_type=jnp.float32)
            return m_new, l, acc

        def k_step(j, carry):
            mt = tile(q0, j * bk, bq, bk)  # [B, bq, bk]
            if kv_bound is not None:  # the trip count already skips the dead tiles
                return update(j, carry, mt)
            return jax.lax.cond(jnp.any(mt), lambda c: update(j, c, mt), lambda c: c, carry)

        init = (jnp.full((b, kvh, g, bq), _NEG, jnp.float32), jnp.zeros((b, kvh, g, bq), jnp.float32),
                jnp.zeros((b, kvh, g, bq, hd), jnp.float32))
        trips = nk if kv_bound is None else jnp.minimum((kv_bound + bk - 1) // bk, nk).astype(jnp.int32)
        _, l, acc = jax.lax.fori_loop(0, trips, k_step, init)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kv, g, bq, hd]
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, bq, h, hd).astype(q.dtype)

    if nq == 1:
        return q_block(jnp.int32(0))[:, :t]
    out = jax.lax.map(jax.checkpoint(q_block, prevent_cse=False), jnp.arange(nq))  # [nq, B, bq, H, hd]
    return jnp.moveaxis(out, 0, 1).reshape(b, tp, h, hd)[:, :t]


# tokens: rows up to this length stay on dense attention (the default of ExecutionConfig.dense_attention_max_len)
BLOCKED_MIN_LEN = 1024


def use_blocked(t: int, s: int, min_len: int = BLOCKED_MIN_LEN) -> bool:
    """Whether ``attend`` takes the blocked path for ``T`` queries over ``S`` keys: when both exceed
    ``min_len`` tokens (default 1,024; ``ExecutionConfig.dense_attention_max_len``). Shorter rows
    (every row of the tiny default, decode steps with T = 1) stay on dense attention: at 512 tokens
    dense is the faster one on CPU (prefill 512: 7.1x transformers dense vs 3.7x blocked,
    ``benchmarks/bench_decode.py``), and the default run keeps its float32 reduction order, hence
    its figures, bit for bit.
    """
    return t > min_len and s > min_len


ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")  # ExecutionConfig.attention_impl
_KERNEL_PLATFORM = {"cudnn": "gpu", "pallas": "tpu"}  # the backend each kernel strategy needs
_AUTO = {"gpu": "cudnn", "tpu": "pallas"}  # "auto": any other backend takes "xla"
_interpret: list[str] = []  # the platform whose kernel paths run on this host (interpret_kernels)


@contextlib.contextmanager
def interpret_kernels(platform: str):
    """Within the block, ``resolve_impl`` treats the backend as ``platform`` (``"gpu"`` or
    ``"tpu"``) and its kernel paths run on the host: the Pallas kernels in interpret mode,
    ``"cudnn"``'s call through ``jax.nn.dot_product_attention``'s XLA implementation (float32
    too). For parity tests and ``benchmarks/device_check.py --smoke``; a function traced inside
    the block keeps its kernels when called outside (jit caches by argument, not by this state).

    Raises:
      ValueError: ``platform`` is not ``"gpu"`` or ``"tpu"``.
    """
    if platform not in _AUTO:
        raise ValueError(f"interpret_kernels platform must be 'gpu' or 'tpu', got {platform!r}")
    _interpret.append(platform)
    try:
        yield
    finally:
        _interpret.pop()


def mesh_platform(mesh) -> str | None:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: the platform of a ``jax.sharding.Mesh``'s devices (compile-only
    TPU devices included); ``None`` for ``None`` or a device-less ``AbstractMesh``."""
    if not isinstance(mesh, jax.sharding.Mesh):
        return None
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def target_platform(backend: str | None = None, mesh=None) -> str:
    """The platform a program is built for: that of ``interpret_kernels``, else of ``mesh``'s devices
    (default: the mesh of the enclosing ``activation_sharding``), else ``backend``, else JAX's default backend."""
    if _interpret:
        return _interpret[-1]
    if mesh is None and backend is None:
        active = active_mesh()
        mesh = active[0] if active else None
    return mesh_platform(mesh) or backend or jax.default_backend()


def resolve_impl(impl: str, backend: str | None = None, mesh=None) -> str:
    """The concrete strategy of ``ExecutionConfig.attention_impl`` on the target platform
    (``target_platform``: ``interpret_kernels``' platform, else the devices of ``mesh`` or of the
    traced function's ``activation_sharding`` mesh, else ``backend``, else
    ``jax.default_backend()``): ``"auto"`` → ``"cudnn"`` on GPU, ``"pallas"`` on TPU, ``"xla"``
    elsewhere; any other value is returned as it is.

    Raises:
      ValueError: an unknown name, or ``"cudnn"`` off a GPU / ``"pallas"`` off a TPU (one line
        naming the config field).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"ExecutionConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    platform = target_platform(backend, mesh)
    if impl == "auto":
        return _AUTO.get(platform, "xla")
    need = _KERNEL_PLATFORM.get(impl)
    if need is not None and platform != need:
        raise ValueError(f"ExecutionConfig.attention_impl={impl!r} needs a {need.upper()} backend, this one is "
                         f"{platform} (use 'auto' or 'xla')")
    return impl


def _kernel_segments(mask: AttentionMask, length: int) -> Int[Array, "rows {length}"]:
    """``[batch, length]`` int32 segment ids equivalent to a cache-less ``AttentionMask.causal``
    mask under a causal kernel mask: the row's segment id on valid keys (0 without segments), −1
    on padding and on the columns added up to ``length`` (a padding query then sees the padding
    at or before it: never an empty row, whose softmax a kernel would divide by 0)."""
    seg = jnp.zeros_like(mask.q_index) if mask.kv_segments is None else mask.kv_segments.astype(jnp.int32)
    seg = jnp.where(mask.kv_valid, seg, -1)
    return jnp.pad(seg, ((0, 0), (0, length - seg.shape[1])), constant_values=-1)


def _scaled(q):
    """``q / sqrt(head_dim)`` in float32, back in ``q.dtype`` (the kernels take the scale folded in)."""
    return (q.astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(q.shape[-1]))).astype(q.dtype)


def _cudnn_attention(q, k, v, mask: AttentionMask, interpret: bool):
    """cuDNN's flash attention (``jax.nn.dot_product_attention``) on ``q [B, T, H, hd]``, ``k, v
    [B, S, kv, hd]`` under our mask: causal by index, validity and segments as its boolean mask."""
    dense = mask.dense(k.shape[1])[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=dense, is_causal=True,
                                        implementation=None if interpret else "cudnn")


def _splash_kernel(length: int, groups: int, block: int, interpret: bool):
    """The Pallas TPU splash-attention kernel (MQA form: ``groups`` query heads over one kv head)
    for ``length`` tokens under a causal mask, ``block``-token tiles forward and backward (built
    per trace: its mask tables are arrays of the trace that builds it)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(groups)])
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _batch_head_axes(spec: jax.sharding.PartitionSpec, batch_dim: int, head_dim: int):
    """The mesh axes of a ``PartitionSpec``'s batch and head dimensions (entries, ``None``: not sharded)."""
    entry = lambda i: spec[i] if i < len(spec) else None  # noqa: E731
    return entry(batch_dim), entry(head_dim)


def _axis_names(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _splash_local(q, k, v, seg, interpret: bool):
    """Splash attention on one device's shard: ``q [B, T, H, hd]``, ``k, v [B, T, kv, hd]``,
    ``seg [B, L]`` kernel segment ids (``_kernel_segments``, ``L`` = T padded to 128): one kernel
    call per (row, kv head) under ``vmap``, the kernel's causal mask over ``L`` tokens."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, h, hd = q.shape
    kvh = k.shape[2]
    length = seg.shape[1]
    block = next(n for n in (512, 256, 128) if length % n == 0)
    kernel = _splash_kernel(length, h // kvh, block, interpret)
    pad = ((0, 0), (0, 0), (0, length - t), (0, 0))
    qg = jnp.pad(jnp.transpose(_grouped(_scaled(q), kvh), (0, 2, 3, 1, 4)), ((0, 0),) + pad)  # [B, kv, g, L, hd]
    kk = jnp.pad(jnp.swapaxes(k, 1, 2).astype(q.dtype), pad)  # [B, kv, L, hd]
    vv = jnp.pad(jnp.swapaxes(v, 1, 2).astype(q.dtype), pad)

    def one(qh, kh, vh, s):
        return kernel(qh, kh, vh, segment_ids=splash.SegmentIds(s, s))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qg, kk, vv, seg)  # [B, kv, g, L, hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4))[:, :t].reshape(b, t, h, hd)


def _splash_attention(q, k, v, mask: AttentionMask, interpret: bool):
    """Splash attention on ``q [B, T, H, hd]``, ``k, v [B, S = T, kv, hd]``: the rows padded to a
    multiple of 128 tokens, our mask as the kernel's causal mask and segment ids
    (``_kernel_segments``). On a mesh of several devices (``core.sharding.active_mesh``) the kernel
    runs under ``shard_map``: rows over the ``batch`` rule's axes, kv heads (and their query heads)
    over the ``kv_heads`` rule's, segment ids with their rows; each device's kernel sees its shard."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    seg = _kernel_segments(mask, -(-t // 128) * 128)
    local = functools.partial(_splash_local, interpret=interpret)
    active = active_mesh()
    if active is None or active[0].size == 1:
        return local(q, k, v, seg)
    mesh, rules = active
    rows, heads = _batch_head_axes(logical_to_spec(("batch", None, "kv_heads", None), rules, mesh.shape,
                                                   (b, t, kvh, hd)), 0, 2)
    P = jax.sharding.PartitionSpec
    qkv = P(rows, None, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)), out_specs=qkv,
                         check_vma=False)(q, k, v, seg)


def _paged_local(q, k, v, slot, lengths, layer, page: int, platform: str, interpret: bool):
    """The paged-attention kernel over one device's cache ``[layers, slots, kv, size, hd]``: query row
    b (``q [B, 1, H, hd]``) reads layer ``layer`` of slot ``slot[b]`` (an index into this cache),
    its first ``lengths[b]`` positions. Returns ``[B, 1, H, hd]`` in the kernel's dtype."""
    nl, slots, kvh, size, hd = k.shape
    b, _, h, _ = q.shape
    pps = size // page
    per_block = next(n for n in (8, 4, 2, 1) if pps % n == 0)
    kp, vp = k.reshape(1, -1, page, hd), v.reshape(1, -1, page, hd)
    first = ((jnp.asarray(layer, jnp.int32) * slots + slot)[:, None] * kvh + jnp.arange(kvh, dtype=jnp.int32)) * pps
    pages = (first[..., None] + jnp.arange(pps, dtype=jnp.int32)).reshape(b * kvh, pps)
    qr = _scaled(q).reshape(b * kvh, h // kvh, hd)
    lengths = jnp.repeat(lengths, kvh)
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

        splits = next(n for n in (16, 8, 4, 2, 1) if pps % (n * per_block) == 0)
        out = gpu_paged.paged_attention(qr, kp, vp, pages, lengths, pages_per_compute_block=per_block,
                                        k_splits=splits, interpret=interpret)
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            out = tpu_paged(qr, kp, vp, lengths, pages, pages_per_compute_block=per_block)
    return out.reshape(b, 1, h, hd)


def _paged_decode(q, k, v, mask: AttentionMask, layer, rows, platform: str, interpret: bool):
    """One-token decode over the whole KV cache ``[layers, slots, kv, size, hd]`` through a Pallas
    paged-attention kernel (``platform`` ``"gpu"`` or ``"tpu"``), the cache read in place.

    The cache is viewed as pages of one kv head each (a free reshape: ``[1, layers · slots · kv ·
    pages, page, hd]``); query row b becomes ``kv`` kernel rows of ``groups`` heads, (row b, kv
    head j) reading the pages of layer ``layer``, slot ``rows[b]``, head j, ``positions + 1`` of
    them valid (``AttentionMask.cached``).

    On a mesh of several devices the kernel runs under ``shard_map`` over the cache as it is
    placed (``model.placement.cache_shardings``: slots over the ``batch`` rule's axes, kv heads over
    ``kv_heads``'): every device gets all query rows of its heads, serves the rows whose slot it
    holds (the others read one page and are zeroed) and a ``psum`` over the slot axes gathers the
    rows; the cache is never moved. Returns ``[B, 1, H, hd]`` in ``q.dtype``, or ``None`` where
    the cache size has no page size (a multiple of 16 tokens): the caller takes XLA.
    """
    nl, slots, kvh, size, hd = k.shape
    b, _, h, _ = q.shape
    page = 16 if platform == "gpu" else next((n for n in (128, 64, 32, 16) if size % n == 0), 0)
    if not page or size % page:
        return None
    slot = jnp.arange(b, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    lengths = jnp.clip(mask.q_index[:, 0] + 1, 1, size).astype(jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    kernel = functools.partial(_paged_local, page=page, platform=platform, interpret=interpret)
    active = active_mesh()
    if active is None or active[0].size == 1:
        return kernel(q, k, v, slot, lengths, layer).astype(q.dtype)
    mesh, rules = active
    cache_spec = logical_to_spec(CACHE_AXES, rules, mesh.shape, k.shape)
    slot_axes, heads = _batch_head_axes(cache_spec, 1, 2)
    names = _axis_names(slot_axes)

    def local(q, k, v, slot, lengths, layer):
        if not names:
            return kernel(q, k, v, slot, lengths, layer)
        held = k.shape[1]
        first = jax.lax.axis_index(names) * held
        here = (slot >= first) & (slot < first + held)
        out = kernel(q, k, v, jnp.where(here, slot - first, 0), jnp.where(here, lengths, 1), layer)
        return jax.lax.psum(jnp.where(here[:, None, None, None], out, jnp.zeros_like(out)), names)

    P = jax.sharding.PartitionSpec
    qs = P(None, None, heads, None)
    out = jax.shard_map(local, mesh=mesh, in_specs=(qs, cache_spec, cache_spec, P(), P(), P()), out_specs=qs,
                        check_vma=False)(q, k, v, slot, lengths, layer)
    return out.astype(q.dtype)


# what "auto" left to XLA, logged once per reason (kernel_problem)
@functools.lru_cache(maxsize=None)
def _log_fallback(problem: str) -> None:
    _log.warning("attention_impl='auto': %s; that path uses XLA attention", problem)


def kernel_problem(impl: str, head_dim: int, platform: str) -> str | None:
    """Why a concrete strategy's kernel cannot take this model on ``platform`` (one phrase naming
    the kernel, the shape and the reason), or ``None``. The TPU paged-attention kernel (decode over
    the KV cache) needs ``head_dim`` a multiple of 128: its Mosaic lowering tiles a block's last two
    dimensions by 8 and 128 (the TPU compiler: "The Pallas TPU lowering currently requires … divisible
    by 8 and 128"); interpret mode has no such limit."""
    if impl == "pallas" and platform == "tpu" and head_dim % 128:
        return (f"the Pallas TPU paged-attention kernel (decode) needs head_dim a multiple of 128 (its Mosaic "
                f"lowering tiles by 8 x 128), this model's head_dim is {head_dim}")
    return None


def check_kernels(impl: str, head_dim: int, mesh=None) -> str:
    """Start-up check of ``ExecutionConfig.attention_impl`` for a model of ``head_dim`` on ``mesh``
    (its devices' platform, ``target_platform``): returns the resolved strategy; under ``"auto"`` a
    path whose kernel cannot take the shape is logged once and left to XLA (``attention`` does so
    as it traces).

    Raises:
      ValueError: as ``resolve_impl``, or an explicit ``"pallas"`` whose kernel cannot take the
        shape (one line: the field, the shape, the reason).
    """
    resolved = resolve_impl(impl, mesh=mesh)
    problem = None if _interpret else kernel_problem(resolved, head_dim, target_platform(mesh=mesh))
    if problem and impl == "auto":
        _log_fallback(problem)
    elif problem:
        raise ValueError(f"ExecutionConfig.attention_impl={impl!r}: {problem} (use 'auto' or 'xla')")
    return resolved


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
    interpret = bool(_interpret)
    if layer is not None:
        if impl != "xla" and q.shape[1] == 1 and isinstance(mask, AttentionMask) and (
                k.dtype == jnp.bfloat16 if impl == "pallas" else k.dtype == q.dtype):
            problem = None if interpret else kernel_problem(impl, q.shape[-1], _KERNEL_PLATFORM[impl])
            if problem and requested != "auto":
                raise ValueError(f"ExecutionConfig.attention_impl={requested!r}: {problem} (use 'auto' or 'xla')")
            out = None if problem else _paged_decode(q, k, v, mask, layer, rows, _KERNEL_PLATFORM[impl], interpret)
            if problem:
                _log_fallback(problem)
            if out is not None:
                return out
        return blocked_attention(q, k, v, mask, layer=layer, rows=rows, kv_bound=kv_bound, block_k=block_k)
    if impl != "xla" and isinstance(mask, AttentionMask) and mask.kv_valid is not None:
        kk, vv = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) if heads_major else (k, v)
        if impl == "pallas":
            return _splash_attention(q, kk, vv, mask, interpret)
        if interpret or q.dtype in (jnp.bfloat16, jnp.float16):
            return _cudnn_attention(q, kk, vv, mask, interpret)
    t = q.shape[1]
    s = k.shape[2] if heads_major else k.shape[1]
    if use_blocked(t, s, min_len=dense_max_len):
        return blocked_attention(q, k, v, mask, heads_major=heads_major, kv_bound=kv_bound, block_k=block_k)
    return dense_attention(q, k, v, mask, heads_major=heads_major)
