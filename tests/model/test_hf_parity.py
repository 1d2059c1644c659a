"""Parity with transformers (CPU, float32) for imported Qwen2 / Llama checkpoints, export, and
checkpoint key errors. Tiny random models are built with transformers' own config classes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from mempo_jax.model.config import ModelConfig  # noqa: E402
from mempo_jax.model.forward import make_logits_fn, sequence_logprobs  # noqa: E402
from mempo_jax.model.hf_io import (  # noqa: E402
    CheckpointError,
    config_from_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402
from mempo_jax.core.sharding import make_mesh  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
MODELS = {
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False)),
    "llama_rope_scaled": ("llama", dict(
        tie_word_embeddings=False, head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
}


def _hf_model(kind, extra, seed):
    cls_cfg, cls_model = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if kind == "qwen2"
                          else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**COMMON, **extra)).float().eval()
    with torch.no_grad():  # random everything (biases and norms too), sharp enough for greedy parity
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    kind, extra = MODELS[request.param]
    model = _hf_model(kind, extra, seed=sorted(MODELS).index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, graphdef, params = load_hf_checkpoint(path)
    return request.param, model, path, cfg, graphdef, params


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor(np.asarray(ids))).logits.double()
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.tensor(np.asarray(ids))[:, 1:, None])[..., 0]
    return logp.numpy()


def _report(name, what, value):
    print(f"PARITY {name} {what}: max abs diff {value:.3e}")


def test_config_is_read(checkpoint):
    name, model, _, cfg, _, params = checkpoint
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.tie_embeddings == (name == "qwen2_tied")
    assert ("lm_head" in params) != cfg.tie_embeddings
    assert (cfg.rope_scaling is not None) == (name == "llama_rope_scaled")
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_logprobs_match_transformers(checkpoint):
    name, model, _, _, graphdef, params = checkpoint
    ids = np.random.RandomState(0).randint(0, VOCAB, (4, 64)).astype(np.int32)
    logp, _ = sequence_logprobs(graphdef, params, jnp.asarray(ids), jnp.ones((4, 64), bool))
    diff = np.abs(np.asarray(logp)[:, 1:] - _hf_logprobs(model, ids)).max()
    _report(name, "logprobs 4x64", diff)
    assert diff < 1e-4


def test_logprobs_match_transformers_with_left_padding(checkpoint):
    name, model, _, _, graphdef, params = checkpoint
    rng = np.random.RandomState(1)
    lengths = [64, 50, 33, 17]
    rows = [rng.randint(0, VOCAB, n).astype(np.int32) for n in lengths]
    ids = np.zeros((4, 64), np.int32)
    mask = np.zeros((4, 64), bool)
    for b, r in enumerate(rows):
        ids[b, 64 - len(r):], mask[b, 64 - len(r):] = r, True
    logp, _ = sequence_logprobs(graphdef, params, jnp.asarray(ids), jnp.asarray(mask))
    diff = 0.0
    for b, r in enumerate(rows):  # reference: transformers on the unpadded row
        ref = _hf_logprobs(model, r[None])[0]
        diff = max(diff, np.abs(np.asarray(logp)[b, 64 - len(r) + 1:] - ref).max())
    _report(name, "logprobs left-padded", diff)
    assert diff < 1e-4


def test_greedy_generation_matches_transformers(checkpoint):
    name, model, _, cfg, graphdef, params = checkpoint
    rng = np.random.RandomState(2)
    prompts = [rng.randint(1, VOCAB, n) for n in (12, 7, 16, 3)]
    ids = np.zeros((4, 16), np.int64)
    mask = np.zeros((4, 16), np.int64)
    for b, p in enumerate(prompts):
        ids[b, 16 - len(p):], mask[b, 16 - len(p):] = p, 1
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=32, min_new_tokens=32).numpy()[:, 16:]
    out = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=0)(
        params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), jax.random.key(0),
        max_new_tokens=32, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert len(np.unique(ref)) > 8  # not a degenerate repetition


def test_export_reloads_in_transformers_with_same_logits(checkpoint, tmp_path):
    name, model, _, cfg, graphdef, params = checkpoint
    # Force a sharded export (index file) for one model, single file for the others.
    max_bytes = 100_000 if name == "qwen2_untied" else 4 * 1024**3
    written = save_hf_checkpoint(tmp_path, cfg, params, max_shard_bytes=max_bytes)
    assert ("model.safetensors.index.json" in written) == (name == "qwen2_untied")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor(np.random.RandomState(3).randint(0, VOCAB, (2, 40)))
    with torch.no_grad():
        a, b = model(ids).logits.numpy(), reloaded(ids).logits.numpy()
    _report(name, "export->transformers logits", np.abs(a - b).max())
    np.testing.assert_allclose(b, a, atol=1e-6)
    # And back into ours: identical parameters.
    cfg2, _, params2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_import_places_params_in_their_sharding(checkpoint):
    name, _, path, _, graphdef, params = checkpoint
    mesh = make_mesh(1, 2, 2)
    _, _, sharded = load_hf_checkpoint(path, mesh)
    q = sharded["layers"]["attn"]["q"].get_value()  # [layers, embed, heads, head_dim]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)
    ids, mask = jnp.asarray(np.random.RandomState(4).randint(0, VOCAB, (2, 24)), jnp.int32), jnp.ones((2, 24), bool)
    logits_fn = jax.jit(make_logits_fn(graphdef))
    np.testing.assert_allclose(np.asarray(logits_fn(sharded, ids, mask)), np.asarray(logits_fn(params, ids, mask)),
                               atol=1e-5)


# ------------------------------------------------------------------------------ key errors


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_keys")
    _hf_model("qwen2", dict(tie_word_embeddings=False), seed=9).save_pretrained(path)
    return path


def _variant(src, dst, edit, config_edit=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **(config_edit or {})}))
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_stray_key_is_named(qwen_dir, tmp_path):
    bad = _variant(qwen_dir, tmp_path / "stray",
                   lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        load_hf_checkpoint(bad)


def test_missing_key_is_named(qwen_dir, tmp_path):
    bad = _variant(qwen_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(bad)


def test_misshaped_key_is_named(qwen_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.bias"] = np.zeros((3,), np.float32)

    bad = _variant(qwen_dir, tmp_path / "shape", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias has shape \(3,\)"):
        load_hf_checkpoint(bad)


def test_tied_checkpoint_with_lm_head_must_equal_embedding(qwen_dir, tmp_path):
    tie = {"tie_word_embeddings": True}
    same = _variant(qwen_dir, tmp_path / "same", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}),
                    tie)
    cfg, _, params = load_hf_checkpoint(same)
    assert cfg.tie_embeddings and "lm_head" not in params
    differs = _variant(qwen_dir, tmp_path / "differs", lambda t: None, tie)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs"):
        load_hf_checkpoint(differs)


def test_index_pointing_to_wrong_file_is_named(qwen_dir, tmp_path):
    bad = _variant(qwen_dir, tmp_path / "index", lambda t: None)
    weight_map = {k: "model.safetensors" for k in load_file(str(bad / "model.safetensors"))}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_hf_checkpoint(bad)


# ------------------------------------------------------------------------- real config.json


def test_real_config_json_files_give_the_presets():
    # Abridged from the published config.json files (transformers v4 keys).
    qwen7 = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
             "intermediate_size": 18944, "max_position_embeddings": 32768, "model_type": "qwen2",
             "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
             "use_sliding_window": False, "vocab_size": 152064}
    llama8 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
    assert config_from_hf(qwen7) == ModelConfig.qwen2_5_7b()
    assert config_from_hf(llama8) == ModelConfig.llama3_1_8b()
    with pytest.raises(CheckpointError, match="rope_type"):
        config_from_hf({**llama8, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="model_type"):
        config_from_hf({**llama8, "model_type": "mistral"})
