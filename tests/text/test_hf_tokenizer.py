"""HFTokenizer on a small byte-level BPE trained here (Qwen2.5-Instruct special-token layout)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mempo_jax.text.protocol import STOP_TAGS
from mempo_jax.text.hf_tokenizer import QWEN_DEFAULT_SYSTEM, HFTokenizer
from mempo_jax.text.stop_strings import StopAutomaton, token_bytes

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = [
    "the capital of france is paris . who wrote hamlet ? shakespeare wrote hamlet .",
    "search the wiki for the director of the film and answer with the name",
    "<mem>paris is the capital</mem><think>need the river</think><search>river paris</search>",
    "naïve café — 東京 is tokyo; ünïcödé text survives byte level bpe",
] * 20


def _train(path, added=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    if added:
        tok.add_tokens(list(added))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return HFTokenizer(_train(tmp_path_factory.mktemp("t") / "qwen_like"))


def test_special_ids_and_interface(tok):
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 0, None)
    assert tok.piece_id("<|im_start|>") == 1
    vocab = Tokenizer.from_file(str(tok.path)).get_vocab(with_added_tokens=True)
    assert tok.vocab_size == max(vocab.values()) + 1 > 300
    with pytest.raises(KeyError, match="</search>"):
        tok.piece_id("</search>")  # a protocol tag is several BPE tokens here
    text = "who wrote hamlet ? naïve 東京"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text) + [tok.eos_id, tok.pad_id]) == text


def test_stop_ids_are_eos_end_of_turn_and_single_token_tags(tok, tmp_path):
    assert tok.stop_ids() == (0, 2)  # <|endoftext|> and <|im_end|>; tags are multi-token
    with_tag = HFTokenizer(_train(tmp_path / "with_tag", added=["</answer>"]))
    answer_id = with_tag.piece_id("</answer>")
    assert with_tag.stop_ids() == (0, 2, answer_id)
    assert set(with_tag.stop_ids(STOP_TAGS)) >= {answer_id}


def test_chat_ids_equal_encoding_of_the_rendered_template(tok):
    messages = [{"role": "user", "content": "who wrote hamlet?"}]
    ids = tok.chat_ids(messages)
    rendered = (f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nwho wrote hamlet?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok.encode(rendered)
    assert ids.count(tok.piece_id("<|im_start|>")) == 3 and ids.count(tok.eos_id) == 2
    own_system = tok.chat_ids([{"role": "system", "content": "be brief"}] + messages, add_generation_prompt=False)
    assert tok.decode(own_system) == "<|im_start|>system\nbe brief\n<|im_start|>user\nwho wrote hamlet?\n"


def _first_stop(tok, ids):
    return StopAutomaton.build(STOP_TAGS, token_bytes(tok)).first_stop(ids)


def _brute(tok, ids):
    """Shortest prefix whose decoded text contains a closing tag (decode every prefix)."""
    return next((n for n in range(1, len(ids) + 1) if any(t in tok.decode(ids[:n]) for t in STOP_TAGS)), None)


def test_tag_stop_fires_at_the_completing_token(tok):
    ids = tok.encode("<think>need the river</think><search>river paris</search>")
    assert len(tok.encode("</search>")) > 1
    assert _first_stop(tok, ids) == len(ids)
    assert _first_stop(tok, tok.encode("<search>river paris</sea")) is None
    assert _first_stop(tok, ids + tok.encode(" the capital")) == len(ids)


WORDS = ["the", " paris", " river", "?", " 東京", "naïve", "</search>", "</answer>", "<mem>", "</", "search>",
         ">", "\n", " <", "answer"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=14))
def test_first_tag_stop_equals_brute_force(tok, words):
    ids = tok.encode("".join(words))
    assert _first_stop(tok, ids) == _brute(tok, ids)


def test_token_bytes_concatenate_to_the_decoded_text(tok):
    ids = tok.encode("naïve café — 東京 <mem>x</mem>") + [tok.eos_id, tok.pad_id, 1]
    table = token_bytes(tok)
    assert len(table) == tok.vocab_size and table[tok.eos_id] == table[tok.pad_id] == b""
    assert b"".join(table[i] for i in ids).decode() == tok.decode(ids)


def test_tag_ending_inside_a_longer_token(tmp_path):
    merged = HFTokenizer(_train(tmp_path / "merged", added=["h>\n"]))  # "</search>\n" ends in "h>\n"
    ids = merged.encode("river paris</search>\nmore text")
    n = _first_stop(merged, ids)
    assert merged._tok.id_to_token(ids[n - 1]) == "h>\n"
    assert merged.decode(ids[:n]).endswith("</search>\n")
    assert n == _brute(merged, ids)


def test_added_tokens_go_through_the_byte_level_decoder(tmp_path):
    folder = _train(tmp_path / "added", added=["é<x>", "東京"])  # "é" is GPT-2's char for byte 0xE9
    added = HFTokenizer(folder)
    ids = [added.piece_id("é<x>"), added.piece_id("東京")]
    assert added.token_bytes()[ids[0]] == b"\xe9<x>" and added.decode(ids) == "\ufffd<x>東京"
    assert b"".join(added.token_bytes()[i] for i in ids).decode("utf-8", errors="replace") == added.decode(ids)


@pytest.fixture(scope="module")
def spm_like(tmp_path_factory):
    """A SentencePiece-style tokenizer.json (Metaspace normaliser, byte-fallback pieces <0xNN>,
    the Llama 2 / Mistral decoder chain Replace ▁ → space, ByteFallback, Fuse, Strip)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] +
                                  [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(TEXT, trainer)
    folder = tmp_path_factory.mktemp("spm") / "llama2_like"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return HFTokenizer(folder)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORDS + ["🙂", "ß", " <0x41>"]), min_size=1, max_size=10))
def test_token_bytes_of_a_sentencepiece_style_tokenizer(spm_like, words):
    ids = spm_like.encode("".join(words))  # unseen characters become <0xNN> byte tokens (valid UTF-8 runs)
    text = b"".join(spm_like.token_bytes()[i] for i in ids).decode("utf-8", errors="replace")
    assert spm_like.decode(ids) in (text, text[1:])  # Strip removes one leading space
    assert _first_stop(spm_like, ids) == _brute(spm_like, ids)
