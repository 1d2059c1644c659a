"""Protocol tags as added tokens in a model without spare rows: the embedding (and an
untied LM head) grows as transformers' ``resize_token_embeddings(…, mean_resizing=True)`` grows
it, and the export loads and generates in transformers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mempo_jax.text.protocol import ALL_TAG_PIECES  # noqa: E402
from mempo_jax.config import ModelOptions  # noqa: E402
from mempo_jax.run.experiment import load_checkpoint_policy  # noqa: E402
from mempo_jax.model.forward import make_logits_fn  # noqa: E402
from mempo_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from mempo_jax.model.resize import mean_resized_rows, padded_rows, resize_vocab, vocab_row_multiple  # noqa: E402
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402
from mempo_jax.core.sharding import make_mesh  # noqa: E402


def test_row_multiples():
    assert [padded_rows(n, 64) for n in (1, 64, 65, 49164)] == [64, 64, 128, 49216]
    assert vocab_row_multiple() == 64
    assert vocab_row_multiple(make_mesh(1, 2, 4)) == 64  # lcm(64, tensor 4)
    assert vocab_row_multiple(make_mesh(1, 1, 8), base=12) == 24
    with pytest.raises(ValueError):
        padded_rows(10, 0)


def _hf_llama(vocab, hidden, tied, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # rows with a clear non-zero mean and unequal spreads per dimension
        model.model.embed_tokens.weight.normal_(0.0, 1.0).mul_(torch.linspace(0.5, 2.0, hidden)).add_(0.3)
        if not tied:
            model.lm_head.weight.normal_(0.0, 1.0).mul_(torch.linspace(2.0, 0.5, hidden)).sub_(0.2)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_new_rows_match_transformers_mean_resizing(tied, tmp_path):
    vocab, hidden, added = 300, 16, 12
    model = _hf_llama(vocab, hidden, tied)
    model.save_pretrained(tmp_path)
    old_embed = model.model.embed_tokens.weight.detach().numpy().copy()
    old_head = model.lm_head.weight.detach().numpy().copy()
    model.resize_token_embeddings(vocab + added, pad_to_multiple_of=64, mean_resizing=True)
    hf_embed = model.model.embed_tokens.weight.detach().numpy()
    hf_head = model.lm_head.weight.detach().numpy()

    cfg, _, params = load_hf_checkpoint(tmp_path)
    cfg2, graphdef, params2 = resize_vocab(cfg, params, padded_rows(vocab + added, 64))
    ours_embed = np.asarray(params2["embed"].get_value())
    assert cfg2.vocab_size == hf_embed.shape[0] == 320 and ours_embed.shape == hf_embed.shape
    pairs = [(old_embed, ours_embed, hf_embed)]
    if not tied:
        pairs.append((old_head, np.asarray(params2["lm_head"].get_value()).T, hf_head))
    else:
        assert "lm_head" not in params2
    for old, ours, hf in pairs:
        np.testing.assert_array_equal(ours[:vocab], old)  # the old rows are kept exactly
        mean, std = old.mean(0), old.std(0)
        noise = np.sqrt(1e-9) * std  # per-dimension std of N(mu, 1e-9 Sigma)
        for new in (ours[vocab:], hf[vocab:]):  # transformers' rows and ours: the same law
            assert new.shape == (20, hidden)
            np.testing.assert_allclose(new.mean(0), mean, atol=float(noise.max()) * 2 + 1e-6)
            ratio = (new - mean).std(0) / noise
            assert 0.5 < ratio.mean() < 1.6, ratio  # noise of the right scale, not exactly the mean
        np.testing.assert_allclose(ours[vocab:], hf[vocab:], atol=float(noise.max()) * 8 + 1e-6)


def test_rank_deficient_rows_get_exactly_the_mean():
    old = np.random.default_rng(0).normal(size=(6, 16)).astype(np.float32)  # 6 rows < 16 dims: not PD
    new = mean_resized_rows(old, 10)
    np.testing.assert_array_equal(new[:6], old)
    np.testing.assert_allclose(new[6:], np.broadcast_to(old.mean(0), (4, 16)), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="cannot shrink"):
        mean_resized_rows(old, 5)


def test_old_logits_unchanged_and_mesh_placement(tmp_path):
    model = _hf_llama(300, 16, tied=False)
    model.save_pretrained(tmp_path)
    mesh = make_mesh(2, 2, 2)
    cfg, graphdef, params = load_hf_checkpoint(tmp_path, mesh=mesh)  # every parameter on the mesh
    cfg2, graphdef2, params2 = resize_vocab(cfg, params, 320, mesh=mesh)
    assert params2["embed"].get_value().sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    ids = jnp.asarray([[1, 5, 299, 7]], jnp.int32)
    mask = jnp.ones((1, 4), bool)
    before = np.asarray(make_logits_fn(graphdef)(params, ids, mask))
    after = np.asarray(make_logits_fn(graphdef2)(params2, ids, mask))
    assert after.shape[-1] == 320
    np.testing.assert_allclose(after[..., :300], before, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the real checkpoint, exported


@pytest.fixture(scope="module")
def tagged_smollm2(smollm2_first_layers):
    """SmolLM2-135M-Instruct (its first layers, for the CPU budget) with the tags as added tokens."""
    return load_checkpoint_policy(ModelOptions(checkpoint=str(smollm2_first_layers), tags="tokens"))


def test_rows_for_tags(tagged_smollm2, smollm2_dir):
    from mempo_jax.text.hf_tokenizer import HFTokenizer

    base = HFTokenizer(smollm2_dir)
    assert base.rows_for_protocol_tags(49152) == 49164  # no spare row: one new row per tag
    assert base.rows_for_protocol_tags(49170) == 49170  # enough spare rows
    assert base.rows_for_protocol_tags(49158) == 49164
    cfg, _, params, tok = tagged_smollm2
    assert cfg.vocab_size == 49216 and params["embed"].get_value().shape == (49216, 576)  # 49,164 → ×64
    assert [tok.piece_id(t) for t in ALL_TAG_PIECES] == list(range(49152, 49164))


def test_export_loads_and_generates_in_transformers(tagged_smollm2, tmp_path):
    cfg, graphdef, params, tok = tagged_smollm2
    written = save_hf_checkpoint(tmp_path, cfg, params, tokenizer=tok)
    assert written[:2] == ["config.json", "model.safetensors"] and "tokenizer.json" in written
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 49216
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.encode("<mem>", add_special_tokens=False) == [tok.piece_id("<mem>")]
    text = "Question: capital of France?<mem>"
    prompt = tok.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == prompt and prompt[-1] == tok.piece_id("<mem>")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.get_input_embeddings().weight.shape == (49216, 576)
    np.testing.assert_array_equal(model.get_input_embeddings().weight[49152:].detach().numpy(),
                                  np.asarray(params["embed"].get_value())[49152:])
    n = 8
    with torch.no_grad():
        hf_ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    sampler = RolloutEngine(graphdef, cfg, [tok.eos_id], tok.pad_id)
    out = sampler(params, jnp.asarray([prompt], jnp.int32), jnp.ones((1, len(prompt)), bool), jax.random.key(0),
                  n, 0.0)
    ours = np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist()
    assert ours == hf_ids, (tok.decode(ours), hf_tok.decode(hf_ids))
