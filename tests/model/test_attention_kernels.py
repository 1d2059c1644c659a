"""The kernel strategies of ``attention`` (``ExecutionConfig.attention_impl``) equal the XLA path.

Each platform's kernels run on the host (``interpret_kernels``: Pallas in interpret mode, cuDNN's
call through ``jax.nn.dot_product_attention``'s XLA implementation): splash attention (TPU) and the
cuDNN call (GPU) without a cache, forward and gradient, on packed rows with padding; the Pallas
paged-attention decode (GPU, TPU) over KV-cache slots read through ``rows``; and the strategies
through the decoder, the forward passes and the slot sampler's decode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mempo_jax.model import attention as attn
from mempo_jax.model import attention_kernels
from mempo_jax.model.attention import attention
from mempo_jax.model.attention_kernels import interpret_kernels, resolve_impl
from mempo_jax.model.attention_mask import AttentionMask
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.decoder import init_cache
from mempo_jax.model.forward import create_model, make_logits_fn, packed_positions, split_model

F32 = dict(rtol=2e-5, atol=2e-5)


def _packed(rng, b=2, t=40, h=4, kvh=2, hd=16):
    """q, k, v ``[b, t, ·, hd]`` and a causal mask over rows packed with 3 segments then padding."""
    seg = np.zeros((b, t), np.int32)
    seg[0, :9], seg[0, 9:25], seg[0, 25:33] = 1, 2, 3
    seg[1, :30] = 1
    q = jnp.asarray(rng.standard_normal((b, t, h, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kvh, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kvh, hd)), jnp.float32)
    return q, k, v, AttentionMask.causal(jnp.asarray(seg > 0), jnp.asarray(seg)), seg > 0


def _value_and_grads(impl, q, k, v, mask, real):
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32) * real[:, :, None, None]

    def loss(q, k, v):
        out = attention(q, k, v, mask, impl=impl)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out)[real], [np.asarray(g) for g in grads]


@pytest.mark.parametrize("impl,platform", [("pallas", "tpu"), ("cudnn", "gpu")])
def test_kernel_paths_equal_xla_on_packed_rows_forward_and_gradient(impl, platform):
    q, k, v, mask, real = _packed(np.random.default_rng(0))
    want, want_grads = _value_and_grads("xla", q, k, v, mask, real)
    with interpret_kernels(platform):
        got, got_grads = _value_and_grads(impl, q, k, v, mask, real)
    np.testing.assert_allclose(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, **F32)
    assert np.abs(want_grads[1]).max() > 1e-2  # the keys' gradient is not trivially zero


def _cache_case(rng, dtype, h=6, kvh=2, hd=16, size=64, layers=2, slots=3):
    """A random cache, 4 query rows reading slots ``[2, 0, 1, 2]`` at positions 5, 63, 0, 30 of layer 1."""
    shape = (layers, slots, kvh, size, hd)
    kc = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    vc = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    q = jnp.asarray(rng.standard_normal((4, 1, h, hd)), jnp.float32).astype(dtype)
    rows, pos = jnp.asarray([2, 0, 1, 2], jnp.int32), jnp.asarray([[5], [63], [0], [30]], jnp.int32)
    return q, kc, vc, AttentionMask.cached(pos), rows


def _decode(impl, q, kc, vc, mask, rows):
    fn = jax.jit(lambda q, kc, vc, mask, rows: attention(q, kc, vc, mask, layer=jnp.int32(1), rows=rows,
                                                         kv_bound=jnp.int32(64), block_k=16, impl=impl))
    return np.asarray(fn(q, kc, vc, mask, rows).astype(jnp.float32))


def test_gpu_paged_decode_equals_xla_over_cache_slots():
    case = _cache_case(np.random.default_rng(1), jnp.float32)
    want = _decode("xla", *case)
    with interpret_kernels("gpu"):
        got = _decode("cudnn", *case)
    np.testing.assert_allclose(got, want, **F32)


def test_tpu_paged_decode_equals_xla_over_cache_slots():
    """The TPU kernel reads K/V in bfloat16: on bfloat16-exact float32 values it equals XLA at float32
    tolerance (the layout and lengths are right); through ``attention`` it takes bfloat16 caches
    (within bfloat16 rounding of XLA on the same cache) and leaves float32 ones to XLA."""
    q, kc, vc, mask, rows = _cache_case(np.random.default_rng(2), jnp.bfloat16)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, kc, vc))
    want = _decode("xla", q32, k32, v32, mask, rows)
    direct = jax.jit(lambda *a: attention_kernels.paged_decode(*a, jnp.int32(1), rows, "tpu", True))(q32, k32, v32, mask)
    np.testing.assert_allclose(np.asarray(direct), want, **F32)
    with interpret_kernels("tpu"):
        got = _decode("pallas", q, kc, vc, mask, rows)
        assert np.array_equal(_decode("pallas", q32, k32, v32, mask, rows), want)  # float32 cache: XLA itself
    np.testing.assert_allclose(got, _decode("xla", q, kc, vc, mask, rows), rtol=2e-2, atol=2e-2)


def test_resolve_impl_per_backend_and_one_line_errors():
    assert [resolve_impl("auto", b) for b in ("cpu", "gpu", "tpu")] == ["xla", "cudnn", "pallas"]
    assert resolve_impl("xla", "tpu") == "xla" and resolve_impl("auto") == "xla"  # this host is a CPU
    with pytest.raises(ValueError, match=r"^ExecutionConfig.attention_impl='cudnn' needs a GPU backend, this one "
                                         r"is cpu \(use 'auto' or 'xla'\)$"):
        resolve_impl("cudnn")
    with pytest.raises(ValueError, match="attention_impl='pallas' needs a TPU backend, this one is gpu"):
        resolve_impl("pallas", "gpu")
    with pytest.raises(ValueError, match=r"attention_impl must be one of \('auto', 'xla', 'cudnn', 'pallas'\)"):
        resolve_impl("flash")
    with interpret_kernels("tpu"):
        assert resolve_impl("auto") == "pallas"
    cfg = ModelConfig.tiny(32, num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
    graphdef, _ = split_model(create_model(cfg))
    with pytest.raises(ValueError, match="attention_impl='pallas' needs a TPU backend"):
        make_logits_fn(graphdef, attention_impl="pallas")
    from mempo_jax.config import ExecutionConfig
    with pytest.raises(ValueError, match="attention_impl"):
        ExecutionConfig(attention_impl="splash")


def test_the_strategy_reaches_the_forward_passes_and_the_decode():
    """``make_logits_fn(attention_impl=...)`` and the decoder's cache path run the kernels (the
    splash kernel is called; packed logits equal XLA's) and a slot sampler's greedy decode with the
    GPU kernels picks the tokens XLA picks."""
    cfg = ModelConfig.tiny(64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, seed=5))
    rng = np.random.default_rng(3)
    seg = np.repeat(np.array([[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0]]), 2, 0)
    ids = jnp.asarray(rng.integers(0, 64, seg.shape), jnp.int32)
    args = (params, ids, jnp.asarray(seg), jnp.asarray(packed_positions(seg)))
    want = np.asarray(jax.jit(make_logits_fn(graphdef).packed)(*args))
    calls = []
    orig = attn.splash_attention
    try:
        attn.splash_attention = lambda *a: calls.append(1) or orig(*a)
        with interpret_kernels("tpu"):
            got = np.asarray(jax.jit(make_logits_fn(graphdef, attention_impl="auto").packed)(*args))
    finally:
        attn.splash_attention = orig
    assert calls  # one trace of the layer scan
    np.testing.assert_allclose(got[seg > 0], want[seg > 0], rtol=1e-4, atol=1e-4)

    from mempo_jax.agent.slot_sampler import SlotSampler
    prompt = jnp.asarray(rng.integers(1, 64, (3, 5)), jnp.int32)
    out = {}
    for impl in ("xla", "cudnn"):
        with interpret_kernels("gpu"):
            sampler = SlotSampler(graphdef, cfg, (), 0, block=16, attention_impl=impl)
            res = sampler.generate(params, prompt, jnp.ones(prompt.shape, bool), jax.random.key(0), 6,
                                   temperature=0.0)
        out[impl] = res
    np.testing.assert_array_equal(np.asarray(out["cudnn"].tokens), np.asarray(out["xla"].tokens))
    np.testing.assert_allclose(np.asarray(out["cudnn"].logprobs), np.asarray(out["xla"].logprobs), rtol=1e-4, atol=1e-4)
    cache = init_cache(cfg, 2, 32)
    assert cache.k.shape == (2, 2, 2, 32, 16)


def test_kernels_under_shard_map_on_a_mesh_equal_xla():
    """On a (2, 1, 2) mesh of 4 emulated devices (``activation_sharding``) the kernels run under
    ``shard_map``: splash on each device's rows and kv heads, forward and gradient; paged decode (the
    TPU and the GPU kernel) over the cache as placed (slots over ``data``, kv heads over ``tensor``),
    rows reading slots held by the other device (``rows``) gathered by the ``psum``. Each equals XLA
    on the same mesh."""
    from mempo_jax.core.sharding import activation_sharding, make_mesh
    from mempo_jax.model.placement import cache_shardings

    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    q, k, v, mask, real = _packed(np.random.default_rng(4), b=2, t=40, h=4, kvh=2, hd=16)

    def on_mesh(impl, *args):
        with activation_sharding(mesh):
            return _value_and_grads(impl, *args)

    want, want_grads = on_mesh("xla", q, k, v, mask, real)
    with interpret_kernels("tpu"):
        got, got_grads = on_mesh("pallas", q, k, v, mask, real)
    np.testing.assert_allclose(got, want, **F32)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, **F32)

    cfg = ModelConfig.tiny(32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    sh = cache_shardings(cfg, 4, 64, mesh).k
    rows = jnp.asarray([3, 0, 1, 2], jnp.int32)  # rows 0 and 3 read slots of the other data shard
    for impl, platform, dtype, tol in (("pallas", "tpu", jnp.bfloat16, 2e-2), ("cudnn", "gpu", jnp.float32, 2e-5)):
        q, kc, vc, mask, _ = _cache_case(np.random.default_rng(5), dtype, h=4, kvh=2, slots=4)
        kc, vc = jax.device_put(kc, sh), jax.device_put(vc, sh)

        def decode(impl):
            with activation_sharding(mesh):
                return _decode(impl, q, kc, vc, mask, rows)

        want = decode("xla")
        with interpret_kernels(platform):
            got = decode(impl)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
