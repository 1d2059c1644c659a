"""Tokenizer of Hugging Face checkpoints (``tokenizer.json``) behind the project's tokenizer interface.

Same surface as ``mempo_jax.text.tokenizer.SentencePieceTokenizer``: ``encode``, ``decode``,
``piece_id``, ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``. Differences a caller must know:

* ``bos_id`` is ``None`` for tokenizers without a BOS token (Qwen2.5); prepend nothing then.
* Protocol tags (``<mem>``, ``</search>``, …) are usually *several* byte-level BPE tokens of a
  checkpoint's tokenizer, so ``piece_id`` raises ``KeyError`` for them. By default a run keeps
  them so (``ModelOptions.tags = "text"``, ``TagCodec`` text mode): closing tags and ``<mem>``
  spans are found on the sampled ids through their bytes (``token_bytes`` +
  ``mempo_jax.text.stop_strings``), never by re-tokenising text (token in, token out: docs/algorithm.md §2).
  With ``tags = "tokens"`` a run uses ``with_protocol_tags(embedding_rows)``: every tag becomes
  one added token whose id is a spare embedding row (Qwen2.5: 151,936 rows vs 151,665 tokens), a
  renamed reserved special token (Llama 3: ``<|reserved_special_token_N|>``) or, after the
  embedding was resized to ``rows_for_protocol_tags`` (``model.resize``), a new row. Those rows are
  untrained at first; the SFT cold start trains them.
* The Qwen chat template (``<|im_start|>role\\n…<|im_end|>\\n``) is applied by ``chat_ids``,
  with the special tokens inserted as ids.

Sources: the ``tokenizers`` library; Qwen2.5 ``tokenizer_config.json`` chat template.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import shutil
from typing import Iterable, Mapping, Sequence

from tokenizers import Tokenizer

from mempo_jax.text.protocol import ALL_TAG_PIECES, STOP_TAGS

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# End-of-turn / end-of-text specials of the supported families (Qwen2.5, Llama 3.x).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
# Llama 3 reserves 248 such tokens (ids 128002…128255, minus the named ones); free for the tags.
# Files of a checkpoint folder that ``save`` copies beside the written ``tokenizer.json``.
COPIED_FILES = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja", "special_tokens_map.json")
RESERVED_TOKEN = re.compile(r"^<\|reserved_special_token_(\d+)\|>$")


def _token_name(value) -> str | None:
    if isinstance(value, Mapping):  # {"content": "<|im_end|>", ...} in older tokenizer_config.json
        return value.get("content")
    return value


def gpt2_unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` map: vocabulary character → byte value.

    Byte-level BPE stores each byte as one printable character: the 188 printable Latin-1
    bytes as themselves, the other 68 as ``chr(256 + n)`` in byte order. Source: openai/gpt-2
    ``encoder.py`` ``bytes_to_unicode``; the HF ``tokenizers`` ``ByteLevel`` pre-tokenizer uses the
    same table.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer:
    """``tokenizers.Tokenizer`` of an HF checkpoint with the project's tokenizer interface.

    Args:
      path: a checkpoint folder (``tokenizer.json`` and optional ``tokenizer_config.json``,
        ``generation_config.json``) or a ``tokenizer.json`` file.
      eos_token, pad_token, bos_token: override the special token names of
        ``tokenizer_config.json``. Without a pad token the EOS id is used for padding.

    Attributes:
      vocab_size: ids of the tokenizer incl. added tokens (the model's embedding may be larger).
      pad_id, eos_id: int; bos_id: int or None.
      extra_eos_ids: further end-of-sequence ids from ``generation_config.json``.
      tag_ids: protocol tag → id, for the tags that are single tokens (all 12 after
        ``with_protocol_tags``).

    Raises:
      FileNotFoundError: if ``tokenizer.json`` is absent.
      KeyError: if a named special token is not in the vocabulary, or there is no EOS token.
    """

    def __init__(self, path: str | os.PathLike, *, eos_token: str | None = None, pad_token: str | None = None,
                 bos_token: str | None = None):
        path = pathlib.Path(path)
        folder = path if path.is_dir() else path.parent
        tok_file = path / "tokenizer.json" if path.is_dir() else path
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {tok_file}")
        self.path = tok_file
        self._tok = Tokenizer.from_file(str(tok_file))
        conf = {}
        if (folder / "tokenizer_config.json").is_file():
            conf = json.loads((folder / "tokenizer_config.json").read_text())
        eos = eos_token or _token_name(conf.get("eos_token"))
        if eos is None:
            eos = next((t for t in END_OF_TURN_TOKENS if self._tok.token_to_id(t) is not None), None)
        if eos is None:
            raise KeyError(f"no EOS token named in {folder} and none of {END_OF_TURN_TOKENS} in the vocabulary")
        self.eos_id = self.piece_id(eos)
        pad = pad_token or _token_name(conf.get("pad_token"))
        self.pad_id = self.piece_id(pad) if pad else self.eos_id
        bos = bos_token or _token_name(conf.get("bos_token"))
        self.bos_id = self.piece_id(bos) if bos else None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        extra = []
        if (folder / "generation_config.json").is_file():
            gen = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
            extra = [gen] if isinstance(gen, int) else list(gen or [])
        self.extra_eos_ids = tuple(int(i) for i in extra if int(i) != self.eos_id)
        self.tag_ids = {t: int(i) for t in ALL_TAG_PIECES if (i := self._tok.token_to_id(t)) is not None}
        self._token_bytes: tuple[bytes, ...] | None = None

    def encode(self, text: str) -> list[int]:
        """Text → ids, no BOS/EOS added. Special-token strings in ``text`` map to their ids."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; pad, BOS and EOS ids are dropped, other specials decode to their text."""
        drop = {self.pad_id, self.eos_id, self.bos_id}
        return self._tok.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def piece_id(self, piece: str) -> int:
        """Id of a token string that is one entry of the vocabulary (e.g. ``"<|im_end|>"``).

        Raises:
          KeyError: if ``piece`` is not a single token (e.g. a protocol tag split by BPE).
        """
        i = self._tok.token_to_id(piece)
        if i is None:
            raise KeyError(f"piece {piece!r} is not a single token of {self.path}")
        return int(i)

    def check_protocol_tags(self, tags: Sequence[str] = ALL_TAG_PIECES) -> None:
        """Raise ``ValueError`` naming the first of ``tags`` that is not a single token
        (same contract as ``SentencePieceTokenizer.check_protocol_tags``)."""
        for tag in tags:
            if self._tok.token_to_id(tag) is None:
                raise ValueError(f"tokenizer {self.path} lacks the protocol tag {tag!r} as a single token; "
                                 "use HFTokenizer.with_protocol_tags(embedding_rows)")

    def with_protocol_tags(self, embedding_rows: int, tags: Sequence[str] = ALL_TAG_PIECES) -> "HFTokenizer":
        """A copy of this tokenizer in which every tag is one token with an id < ``embedding_rows``.

        A tag that is already a single token keeps its id. Each other tag takes, in order, an
        unused reserved special token (``<|reserved_special_token_N|>``, lowest N first, renamed
        to the tag; Llama 3) or else the next id after the vocabulary (a spare embedding row;
        Qwen2.5). Tags are added tokens with ``normalized=False, special=False``: they are
        matched in text before pre-tokenisation (``encode("x<mem>y")`` gives the tag's id) and
        ``decode`` writes their text back. EOS / PAD / BOS / end-of-turn ids are never reused.
        ``self`` is not changed.

        Args:
          embedding_rows: rows of the model's token embedding (``ModelConfig.vocab_size``).
          tags: the strings to make single tokens (default: the 12 ``ALL_TAG_PIECES``).

        Returns:
          A new ``HFTokenizer``; ``piece_id(tag)`` works, ``vocab_size`` counts the added tags
          (still ≤ ``embedding_rows``), ``tag_ids`` maps tag → id.

        Raises:
          ValueError: naming the first tag that has no free reserved token and no spare row
            (``vocab_size`` ids already fill ``embedding_rows``), a tag that is already a token
            with an id ≥ ``embedding_rows``, or a tokenizer larger than the embedding.

        Source: the added-token layout of HF ``tokenizer.json`` (``added_tokens`` entries
        ``{id, content, single_word, lstrip, rstrip, normalized, special}``).
        """
        vocab = self._tok.get_vocab(with_added_tokens=True)
        top = max(vocab.values()) + 1
        if top > embedding_rows:
            raise ValueError(f"tokenizer {self.path} has ids up to {top - 1} but the model has only "
                             f"{embedding_rows} embedding rows")
        data = json.loads(self._tok.to_str())
        reserved_entries = self._free_reserved(data, embedding_rows)
        model_vocab = data.get("model", {}).get("vocab")
        added = {entry["content"] for entry in data.get("added_tokens", [])}
        want: dict[str, int] = {}
        for tag in dict.fromkeys(tags):
            i = vocab.get(tag)
            if i is not None:
                if i >= embedding_rows:
                    raise ValueError(f"protocol tag {tag!r} is token {i}, beyond the model's {embedding_rows} "
                                     "embedding rows")
                if tag not in added:  # a merge of the BPE model: pre-tokenisation would split it
                    data.setdefault("added_tokens", []).append(
                        {"id": i, "content": tag, "single_word": False, "lstrip": False, "rstrip": False,
                         "normalized": False, "special": False})
                want[tag] = i
                continue
            if reserved_entries:
                entry = reserved_entries.pop(0)
                if isinstance(model_vocab, dict) and entry["content"] in model_vocab:
                    model_vocab[tag] = model_vocab.pop(entry["content"])
                entry.update(content=tag, normalized=False, special=False)
            elif top < embedding_rows:
                entry = {"id": top, "content": tag, "single_word": False, "lstrip": False, "rstrip": False,
                         "normalized": False, "special": False}
                data.setdefault("added_tokens", []).append(entry)
                top += 1
            else:
                raise ValueError(
                    f"no room for protocol tag {tag!r}: the tokenizer {self.path} (plus the tags placed before "
                    f"it) fills all {embedding_rows} embedding rows of the model and has no free "
                    "<|reserved_special_token_N|>; a model with spare embedding rows is needed")
            want[tag] = int(entry["id"])
        out = copy.copy(self)
        out._tok = Tokenizer.from_str(json.dumps(data))
        out._token_bytes = None
        got = {tag: out._tok.token_to_id(tag) for tag in want}
        if got != want:  # the tokenizers library assigned other ids than planned
            raise ValueError(f"protocol tags got ids {got}, expected {want}")
        out.vocab_size = int(out._tok.get_vocab_size(with_added_tokens=True))
        out.tag_ids = want
        return out

    def _free_reserved(self, data: dict, embedding_rows: int) -> list[dict]:
        """The ``added_tokens`` entries of ``data`` (``tokenizer.json``) that are unused reserved
        specials (``<|reserved_special_token_N|>``, lowest N first) below ``embedding_rows``."""
        keep = {self.eos_id, self.pad_id, self.bos_id, *self.extra_eos_ids, *self.end_of_turn_ids}
        reserved = sorted((int(m.group(1)), entry) for entry in data.get("added_tokens", [])
                          if (m := RESERVED_TOKEN.match(entry["content"])) and entry["id"] not in keep
                          and entry["id"] < embedding_rows)
        return [entry for _, entry in reserved]

    def rows_for_protocol_tags(self, embedding_rows: int, tags: Sequence[str] = ALL_TAG_PIECES) -> int:
        """The fewest embedding rows (≥ ``embedding_rows``) with room for every tag as one token:
        ``embedding_rows`` when spare rows or free reserved tokens suffice, else the tokenizer's
        ids plus one new row per tag that has neither. ``with_protocol_tags(rows)`` then succeeds
        (for any ``rows`` at least this; the model's embedding must be resized to it first)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        top = max(vocab.values()) + 1
        missing = [t for t in dict.fromkeys(tags) if t not in vocab]
        free = len(self._free_reserved(json.loads(self._tok.to_str()), embedding_rows))
        spare = max(0, embedding_rows - top)
        return int(embedding_rows) + max(0, len(missing) - free - spare)

    def save(self, folder: str | os.PathLike) -> pathlib.Path:
        """Write ``tokenizer.json`` (incl. added protocol tags) into ``folder`` and copy the
        source's ``tokenizer_config.json``, ``generation_config.json``, ``chat_template.jinja`` and
        ``special_tokens_map.json`` (``COPIED_FILES``, those present) beside it, so an exported
        checkpoint folder (``save_hf_checkpoint``) loads with its tags and chat template. Returns
        the folder."""
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        for name in COPIED_FILES:
            src = self.path.parent / name
            if src.is_file() and src.resolve() != (folder / name).resolve():
                shutil.copyfile(src, folder / name)
        return folder

    def token_bytes(self) -> tuple[bytes, ...]:
        """The bytes each id ``0 … vocab_size - 1`` decodes to (cached), so that the bytes of a
        sequence are the concatenation of its tokens' bytes (``stop_strings`` matches stop tags on
        them).

        Each id's string (an added token's content, else the model's vocabulary entry) goes
        through the per-token step of the ``tokenizer.json`` decoder, as ``tokenizers`` decodes
        added tokens and vocabulary entries alike; pad, EOS and BOS are ``b""`` (``decode`` drops
        them).

        * ``ByteLevel`` decoder (GPT-2, Qwen2, Llama 3, SmolLM): every character through the
          inverse GPT-2 byte map (a character outside it as its UTF-8). Exact: ``decode(ids)`` is
          these bytes decoded as UTF-8 with replacement.
        * ``Metaspace`` / ``ByteFallback`` decoders (SentencePiece-style ``tokenizer.json``):
          ``<0xNN>`` → byte NN, else ``▁`` → space. Exact up to the leading space ``Strip``
          removes, where every run of ``<0xNN>`` tokens is valid UTF-8 (on an invalid run
          ``ByteFallback`` writes one U+FFFD per token, ASCII bytes included; here the bytes stay).
        * Any other decoder: ``decode([id])`` per id (exact only for context-free decoders).
        """
        if self._token_bytes is not None:
            return self._token_bytes

        data = json.loads(self._tok.to_str())
        decoders = data.get("decoder") or {}
        kinds = {d.get("type") for d in decoders.get("decoders", [decoders])} if decoders else set()
        strings: list[str | None] = [None] * self.vocab_size
        for piece, i in self._tok.get_vocab(with_added_tokens=False).items():
            if i < self.vocab_size:
                strings[i] = piece
        for entry in data.get("added_tokens", []):
            if entry["id"] < self.vocab_size:
                strings[entry["id"]] = entry["content"]
        if "ByteLevel" in kinds:
            table = gpt2_unicode_to_bytes()
            out = [b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece or "")
                   for piece in strings]
        elif kinds & {"Metaspace", "ByteFallback"}:
            byte_piece = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
            out = []
            for piece in strings:
                m = byte_piece.match(piece or "") if "ByteFallback" in kinds else None
                out.append(bytes([int(m.group(1), 16)]) if m else (piece or "").replace("\u2581", " ").encode("utf-8"))
        else:
            out = [self._tok.decode([i], skip_special_tokens=False).encode("utf-8") for i in range(self.vocab_size)]
        for i in {self.pad_id, self.eos_id, self.bos_id} - {None}:
            out[i] = b""
        self._token_bytes = tuple(out)
        return self._token_bytes

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids of the end-of-turn / end-of-text specials present (``END_OF_TURN_TOKENS``)."""
        ids = (self._tok.token_to_id(t) for t in END_OF_TURN_TOKENS)
        return tuple(int(i) for i in ids if i is not None)

    def stop_ids(self, tags: Sequence[str] = STOP_TAGS) -> tuple[int, ...]:
        """The sampler's stop set: EOS ∪ generation-config EOS ids ∪ end-of-turn ids ∪ the ids of
        those ``tags`` that are single tokens. Multi-token tags need ``stop_strings.StopAutomaton``."""
        ids = {self.eos_id, *self.extra_eos_ids, *self.end_of_turn_ids}
        for tag in tags:
            i = self._tok.token_to_id(tag)
            if i is not None:
                ids.add(int(i))
        return tuple(sorted(ids))

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        default_system: str | None = QWEN_DEFAULT_SYSTEM,
    ) -> list[int]:
        """Qwen (ChatML) template as ids: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
        then ``<|im_start|>assistant\\n`` when ``add_generation_prompt``.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, …]``.
          add_generation_prompt: open an assistant turn at the end.
          default_system: system message inserted when the first message is not a system one
            (Qwen2.5's default); None inserts nothing.

        Returns:
          ids equal to ``encode`` of the rendered template string (special tokens as ids).

        Raises:
          KeyError: if the vocabulary lacks ``<|im_start|>`` / ``<|im_end|>``, or a message lacks
            ``role`` / ``content``.
        """
        start, end = self.piece_id(IM_START), self.piece_id(IM_END)
        msgs = list(messages)
        if default_system is not None and (not msgs or msgs[0]["role"] != "system"):
            msgs.insert(0, {"role": "system", "content": default_system})
        newline = self.encode("\n")
        ids: list[int] = []
        for m in msgs:
            ids += [start] + self.encode(f"{m['role']}\n{m['content']}") + [end] + newline
        if add_generation_prompt:
            ids += [start] + self.encode("assistant\n")
        return ids
