"""The kernel attention strategies and their choice: ``resolve_impl`` maps
``ExecutionConfig.attention_impl`` to ``"xla"``, ``"cudnn"`` (GPU) or ``"pallas"`` (TPU) for the
platform a program is built for; ``check_kernels`` is the start-up check; cuDNN flash attention,
Pallas splash attention and Pallas paged decode run our masks, under ``shard_map`` on a mesh of
several devices. The overview: ``model.attention``."""
from __future__ import annotations

import contextlib
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from mempo_jax.core.sharding import active_mesh, logical_to_spec
from mempo_jax.model.attention_mask import CACHE_AXES, AttentionMask
from mempo_jax.model.attention_xla import grouped

_log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")  # ExecutionConfig.attention_impl
KERNEL_PLATFORM = {"cudnn": "gpu", "pallas": "tpu"}  # the backend each kernel strategy needs
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


def interpret_active() -> bool:
    """Whether the kernel paths run on the host (inside ``interpret_kernels``)."""
    return bool(_interpret)


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
    need = KERNEL_PLATFORM.get(impl)
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


def cudnn_attention(q, k, v, mask: AttentionMask, interpret: bool):
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
    qg = jnp.pad(jnp.transpose(grouped(_scaled(q), kvh), (0, 2, 3, 1, 4)), ((0, 0),) + pad)  # [B, kv, g, L, hd]
    kk = jnp.pad(jnp.swapaxes(k, 1, 2).astype(q.dtype), pad)  # [B, kv, L, hd]
    vv = jnp.pad(jnp.swapaxes(v, 1, 2).astype(q.dtype), pad)

    def one(qh, kh, vh, s):
        return kernel(qh, kh, vh, segment_ids=splash.SegmentIds(s, s))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qg, kk, vv, seg)  # [B, kv, g, L, hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4))[:, :t].reshape(b, t, h, hd)


def splash_attention(q, k, v, mask: AttentionMask, interpret: bool):
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


def paged_decode(q, k, v, mask: AttentionMask, layer, rows, platform: str, interpret: bool):
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
def log_fallback(problem: str) -> None:
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
        log_fallback(problem)
    elif problem:
        raise ValueError(f"ExecutionConfig.attention_impl={impl!r}: {problem} (use 'auto' or 'xla')")
    return resolved
