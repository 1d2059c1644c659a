"""A LoRA policy exported both ways loads in transformers: the merged Hugging Face folder, and the
PEFT adapter folder put onto the base checkpoint by ``peft.PeftModel.from_pretrained``; both
continue three prompts greedily token for token as our sampler does with the adapters
(tiny random Qwen2 with q/k/v biases, a Llama, a Qwen3 and a Gemma 3, float32 on CPU)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402

from mempo_jax.agent.engine import RolloutEngine  # noqa: E402
from mempo_jax.model import adapters, lora  # noqa: E402
from mempo_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
MODELS = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
          "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
          # the window (64) exceeds every row here: transformers counts left padding in it (the
          # window itself: tests/model/test_hf_families.py)
          "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                     dict(head_dim=16, sliding_window=64, layer_types=["sliding_attention", "full_attention"]))}
NEW = 16


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SOME = ("q_proj", "v_proj", "down_proj")
# Every case compiles its own sampler, so families and target lists are paired, not crossed: each
# family once, Qwen2 with both lists (a partial list's key layout does not depend on the family:
# ``adapters.save_peft_adapter``).
CASES = [("gemma3", ALL), ("llama", SOME), ("qwen2", ALL), ("qwen2", SOME), ("qwen3", ALL)]


def _base(family, folder):
    """A tiny random checkpoint of ``family`` written to ``folder``."""
    cfg_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**COMMON, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


def _prompts():
    rng = np.random.RandomState(5)
    rows = [rng.randint(1, VOCAB, n) for n in (9, 14, 5)]
    width = max(map(len, rows))
    ids, mask = np.zeros((3, width), np.int64), np.zeros((3, width), np.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
    return ids, mask


def _hf_greedy(model, ids, mask):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW)
    return out.numpy()[:, ids.shape[1]:]


@pytest.mark.parametrize("family, targets", CASES, ids=[f"{f}-{len(t)}" for f, t in CASES])
def test_merged_and_peft_exports_decode_as_ours(family, targets, tmp_path):
    base = _base(family, tmp_path / "base")
    cfg0, _, params0 = load_hf_checkpoint(base)
    cfg, graphdef, params = adapters.add_adapters(cfg0, params0, lora.LoraConfig(rank=4, alpha=8.0,
                                                                             target_modules=targets), 1)
    trainable, frozen = lora.split_trainable(params)
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(trainable))))
    trainable = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), trainable)
    params = lora.join(trainable, frozen)
    ids, mask = _prompts()
    ours = np.asarray(RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=0)(
        params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), jax.random.key(0), max_new_tokens=NEW,
        temperature=0.0).tokens)
    plain = _hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids, mask)
    assert (ours != plain).any()  # the adapters change the continuations

    # the PEFT folder: PEFT's key names and config, loaded onto the base
    written = adapters.save_peft_adapter(tmp_path / "peft", cfg, params, base_model=str(base))
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, list(targets))
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), framework="np") as st:
        q = "base_model.model.model.layers.1.self_attn.q_proj"
        assert st.get_tensor(f"{q}.lora_A.weight").shape == (4, 64)
        assert st.get_tensor(f"{q}.lora_B.weight").shape == (cfg.num_heads * cfg.head_dim, 4)
        assert len(st.keys()) == 2 * 2 * len(targets)
    host = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(host, tmp_path / "peft").eval()
    np.testing.assert_array_equal(_hf_greedy(with_adapter, ids, mask), ours)

    # the merged folder: plain transformers
    merged_cfg, merged = adapters.merge_adapters(cfg, params)
    save_hf_checkpoint(tmp_path / "merged", merged_cfg, merged)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_array_equal(_hf_greedy(model, ids, mask), ours)
