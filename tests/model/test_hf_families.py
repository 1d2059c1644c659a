"""Parity with transformers for the Qwen3 and Gemma 3 (text) families on tiny random models that
transformers builds from its own config classes (no download): per-token log-probs of padded and
packed rows in float32 and bfloat16, greedy decode through our engine, and the export read back by
transformers.

Each config exercises what sets its family apart: Qwen3 an explicit ``head_dim`` (32, not
``hidden / heads`` = 16), q/k norms and tied embeddings; Gemma 3 sliding-window layers (window 8,
shorter than every row) interleaved with a global one, separate RoPE bases with linear scaling on
the global layer, ``query_pre_attn_scalar`` ≠ ``head_dim``, ``(1 + weight)`` norms (weights drawn
around 0), post norms, GeGLU, √D-scaled embeddings and a final logit soft-cap.

Tolerances are those of the existing parity tests: float32 log-probs within 1e-4 nats
(``test_hf_parity.py``), bfloat16 per-token log-probs mean |Δ| < 0.03, max |Δ| < 0.2 nats
(``test_bfloat16.py``), the export's logits within 1e-6 of the source model's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_parity import _hf_logprobs  # noqa: E402  (transformers' per-token log-probs, float64)
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402
from mempo_jax.model.forward import (  # noqa: E402
    abstract_model, make_logits_fn, packed_positions, sequence_logprobs, split_model, token_stats)
from mempo_jax.model.hf_io import config_to_hf, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, rms_norm_eps=1e-6)
MODELS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=0.5,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_theta=1000000.0, rope_local_base_freq=10000.0,
                    rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


def _hf_model(name):
    cfg_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(sorted(MODELS).index(name))
    model = model_cls(cfg_cls(**COMMON, **extra, attn_implementation="eager")).float().eval()
    gemma = name == "gemma3"
    with torch.no_grad():  # random everything, sharp enough for greedy parity
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma scales by (1 + weight)
                p.uniform_(-0.2, 0.2) if gemma else p.uniform_(0.8, 1.2)
            else:  # Gemma's √D-scaled tied embedding at 0.1 makes greedy decode repeat its input token
                p.normal_(0.0, 0.02 if gemma and "embed" in pname else 0.1)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers on one thread: on two busy cores its generate loop is ~50x slower with two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, graphdef, params = load_hf_checkpoint(path)
    return request.param, model, path, cfg, graphdef, params


def _report(name, what, value):
    print(f"PARITY {name} {what}: {value}")


def test_config_and_parameter_count(family):
    name, model, _, cfg, _, params = family
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.tie_embeddings and "lm_head" not in params
    assert cfg.head_dim == 32 and cfg.post_norms == (name == "gemma3")
    if name == "gemma3":
        assert cfg.local_layers == (True, True, False, True) and cfg.sliding_window == 8
        assert cfg.rope_scaling == (("factor", 4.0),) and cfg.rope_local_base_freq == 10000.0
        assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping == 0.5
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_logprobs_padded_rows_float32(family):
    name, model, _, cfg, graphdef, params = family
    rng = np.random.RandomState(1)
    lengths = [64, 50, 33, 17]
    rows = [rng.randint(0, VOCAB, n).astype(np.int32) for n in lengths]
    ids, mask = np.zeros((4, 64), np.int32), np.zeros((4, 64), bool)
    for b, r in enumerate(rows):  # left padding: positions and the window count real tokens only
        ids[b, 64 - len(r):], mask[b, 64 - len(r):] = r, True
    logp, _ = sequence_logprobs(graphdef, params, jnp.asarray(ids), jnp.asarray(mask))
    diff = max(np.abs(np.asarray(logp)[b, 64 - len(r) + 1:] - _hf_logprobs(model, r[None])[0]).max()
               for b, r in enumerate(rows))
    _report(name, "float32 logprobs, left-padded 4x64, max abs diff", f"{diff:.2e}")
    assert diff < 1e-4
    if name == "gemma3":  # the window is exercised: every layer global gives other log-probs
        unwindowed, _ = split_model(abstract_model(cfg.replace(layer_types=None)))
        logp2, _ = sequence_logprobs(unwindowed, params, jnp.asarray(ids), jnp.asarray(mask))
        assert np.abs(np.asarray(logp2) - np.asarray(logp)).max() > 1e-3


def _packed_batch(seed):
    """Two rows of 96 columns, each three sequences end to end (the last row's tail padding)."""
    rng = np.random.RandomState(seed)
    lengths = [[40, 30, 26], [20, 45, 21]]
    ids, seg = np.zeros((2, 96), np.int32), np.zeros((2, 96), np.int32)
    seqs = []
    for b, row in enumerate(lengths):
        col = 0
        for k, n in enumerate(row):
            s = rng.randint(0, VOCAB, n).astype(np.int32)
            ids[b, col:col + n], seg[b, col:col + n] = s, k + 1
            seqs.append((b, col, s))
            col += n
    return ids, seg, seqs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_packed_batch(family, dtype):
    name, model, path, cfg, graphdef, params = family
    ids, seg, seqs = _packed_batch(2)
    if dtype == "bfloat16":  # our bfloat16 model (weights too) against transformers' bfloat16 model
        _, graphdef, params = load_hf_checkpoint(path, dtype="bfloat16", param_dtype="bfloat16")
        ref_model = _hf_model(name).to(torch.bfloat16)
    else:
        ref_model = model
    fn = make_logits_fn(graphdef)
    logp, _ = token_stats(fn, params, jnp.asarray(ids), segment_ids=jnp.asarray(seg),
                          positions=jnp.asarray(packed_positions(seg)), grad=False)
    logp = np.asarray(logp)
    d = np.concatenate([np.abs(logp[b, col + 1:col + len(s)] - _hf_logprobs(ref_model, s[None])[0])
                        for b, col, s in seqs])
    f32 = np.concatenate([np.abs(logp[b, col + 1:col + len(s)] - _hf_logprobs(model, s[None])[0])
                          for b, col, s in seqs])
    _report(name, f"{dtype} logprobs, packed 2x96 (6 sequences), vs transformers {dtype}: mean / max abs diff",
            f"{d.mean():.2e} / {d.max():.2e}; vs transformers float32: {f32.mean():.2e} / {f32.max():.2e}")
    if dtype == "float32":
        assert d.max() < 1e-4
    else:
        assert d.mean() < 0.03 and d.max() < 0.2, (d.mean(), d.max())
        assert f32.max() > 0  # bfloat16 is really in the computation


def _greedy_reference(model, prompts, n):
    out = []
    for p in prompts:  # one prompt at a time: no padding for transformers' window to count
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor(p[None], dtype=torch.long), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        out.append(ref.numpy()[0, len(p):])
    return np.stack(out)


def _greedy_ours(graphdef, cfg, params, prompts, n):
    width = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, True
    out = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=0)(
        params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), max_new_tokens=n, temperature=0.0)
    return np.asarray(out.tokens)


def test_greedy_decode_matches_transformers(family):
    name, model, _, cfg, graphdef, params = family
    rng = np.random.RandomState(3)
    prompts = [rng.randint(1, VOCAB, n) for n in (12, 7, 16, 3, 9, 14, 5, 11)]
    n = 64
    ref = _greedy_reference(model, prompts, n)
    ours = _greedy_ours(graphdef, cfg, params, prompts, n)
    same = float((ours == ref).mean())
    _report(name, "greedy decode, 8 prompts x 64 new tokens, float32: tokens equal", f"{same:.4f}")
    np.testing.assert_array_equal(ours, ref)
    assert len(np.unique(ref)) > 40  # not a degenerate repetition


def test_export_is_read_by_transformers_and_decodes_the_same(family, tmp_path):
    name, model, _, cfg, graphdef, params = family
    written = save_hf_checkpoint(tmp_path, cfg, params)
    assert written == ["config.json", "model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.model_type == {"qwen3": "qwen3", "gemma3": "gemma3_text"}[name]
    ids = torch.tensor(np.random.RandomState(4).randint(0, VOCAB, (2, 40)))
    with torch.no_grad():
        a, b = model(ids).logits.numpy(), reloaded(ids).logits.numpy()
    _report(name, "export -> transformers logits max abs diff", f"{np.abs(a - b).max():.2e}")
    np.testing.assert_allclose(b, a, atol=1e-6)
    prompts = [np.random.RandomState(5).randint(1, VOCAB, n) for n in (10, 6)]
    cfg2, graphdef2, params2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    np.testing.assert_array_equal(_greedy_ours(graphdef2, cfg2, params2, prompts, 16),
                                  _greedy_reference(reloaded, prompts, 16))


def test_export_refuses_what_the_family_cannot_express(family):
    from mempo_jax.model.hf_config import CheckpointError

    name, _, _, cfg, _, _ = family
    with pytest.raises(CheckpointError, match="model_type 'qwen2'"):
        config_to_hf(cfg, "qwen2")
    other = "gemma3_text" if name == "qwen3" else "qwen3"
    with pytest.raises(CheckpointError, match=f"model_type '{other}'"):
        config_to_hf(cfg, other)
