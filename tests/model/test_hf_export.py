"""The Hugging Face export of a policy on real SmolLM2-135M-Instruct weights.

SmolLM2 (Llama layout, tied embeddings, ChatML template; Q4_1-dequantized weights, see
``mempo_jax.model.smollm2``) is imported with our loader, exported with ``export_policy`` (what
``python -m mempo_jax.commands.train`` writes to ``RUN_DIR/hf_export``), and transformers must load the
export and continue three chat prompts greedily token for token as our sampler does on the
re-imported export. To stay within the test budget on CPU the model keeps its first
``SMOLLM2_LAYERS`` layers (conftest's ``smollm2_first_layers``: real weights, real tokenizer and
template); the full 30-layer model passes the same check:
``MEMPO_SMOLLM2_LAYERS=30 python -m pytest -q tests/model/test_hf_export.py``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from conftest import SMOLLM2_LAYERS  # noqa: E402
from mempo_jax.run.export import export_policy  # noqa: E402
from mempo_jax.text.hf_tokenizer import HFTokenizer  # noqa: E402
from mempo_jax.model.hf_io import load_hf_checkpoint  # noqa: E402
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Who wrote Hamlet?"}],
    [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Another one?"}],
]


def test_smollm2_export_decodes_greedily_as_transformers(smollm2_first_layers, tmp_path):
    src = smollm2_first_layers
    cfg, _, params = load_hf_checkpoint(src)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.vocab_size == 49152 and cfg.num_layers == SMOLLM2_LAYERS
    tok = HFTokenizer(src)
    out = export_policy(tmp_path / "hf_export", cfg, params, tok, source=src)
    assert not (tmp_path / "hf_export.tmp").exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    exported = json.loads((out / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert exported["model_type"] == "llama" and exported["tie_word_embeddings"] is True
    for key in ("bos_token_id", "eos_token_id", "max_position_embeddings"):
        assert exported[key] == source[key], key
    with safe_open(str(out / "model.safetensors"), framework="np") as st:
        assert "lm_head.weight" not in st.keys()

    # transformers loads the export: the chat template renders, the weights decode
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rows = [list(hf_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for c in CONVERSATIONS]
    tail = tok.encode("<|im_start|>assistant\n")
    assert all(r[-len(tail):] == tail for r in rows)
    width, n = max(map(len, rows)), 8
    ids, mask = np.full((3, width), tok.pad_id, np.int64), np.zeros((3, width), np.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_id)
    ref = ref.numpy()[:, width:]

    # ours on the re-imported export: the same parameters, bit for bit, and the same tokens
    cfg2, graphdef2, params2 = load_hf_checkpoint(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours = RolloutEngine(graphdef2, cfg2, stop_ids=[], pad_id=tok.pad_id)(
        params2, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), jax.random.key(0),
        max_new_tokens=n, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours.tokens), ref)
    assert len(np.unique(ref)) > 4, [hf_tok.decode(r) for r in ref]  # not one token repeated


def test_export_refuses_a_sentencepiece_policy(tmp_path):
    from mempo_jax.text.tokenizer import SentencePieceTokenizer

    class SentencePieceLike(SentencePieceTokenizer):  # no model file needed: refused before any use
        def __init__(self):
            pass

    with pytest.raises(ValueError, match="SentencePiece"):
        export_policy(tmp_path / "x", None, None, SentencePieceLike())
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()
