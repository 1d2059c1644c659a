"""SentencePiece tokenizer with the MemPO protocol tags as single pieces.

The tokenizer is trained on the world's text (or a real corpus) with every protocol tag
(``<mem>``, ``</mem>``, ``<think>``, … ``</information>``) as a *user-defined symbol*, so a tag is
always exactly one id, wherever it appears. That makes the rollout's bookkeeping exact: the
``<mem>`` span of a turn and the stop tags are found on the sampled ids, never by re-tokenising
text (token in, token out: docs/algorithm.md §2).

The trained model is cached on disk, keyed by a hash of its training text and options.

``Tokenizer`` is the interface every tokenizer of the package offers (this one and
``hf_tokenizer.HFTokenizer``); the agent, the rollout and the trainers use nothing else of it.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import re
import tempfile
from typing import Iterable, Optional, Protocol, Sequence

import sentencepiece as spm

from mempo_jax.text.protocol import ALL_TAG_PIECES

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer(Protocol):
    """The project's tokenizer interface (``SentencePieceTokenizer``, ``HFTokenizer``).

    Attributes:
      vocab_size: number of ids the tokenizer writes (may be below the model's embedding rows).
      pad_id, eos_id: the padding and end-of-sequence ids.
      bos_id: the beginning-of-sequence id, ``None`` where the tokenizer has none (Qwen).
    """

    vocab_size: int
    pad_id: int
    bos_id: Optional[int]
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Text -> ids (no BOS / EOS added)."""

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (pad, BOS and EOS dropped)."""

    def piece_id(self, piece: str) -> int:
        """The id of ``piece``; ``KeyError`` if it is not one token."""


class NotATokenizer(ValueError):
    """A file that SentencePiece cannot load (garbage, truncated, another format)."""


class SentencePieceTokenizer:
    """Thin wrapper over a SentencePiece model; the project's tokenizer interface.

    Attributes:
      vocab_size: number of ids.
      pad_id, bos_id, eos_id: special ids (0, 2, 3 for models trained here).
    """

    def __init__(self, model_path: str | os.PathLike):
        """Load a ``.model`` file.

        Raises:
          FileNotFoundError: if the file does not exist.
          ValueError: if the file is not a SentencePiece model (names it), or the model lacks a
            protocol tag as a single piece (names the tag).
        """
        path = pathlib.Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise NotATokenizer(f"tokenizer {path} is not a SentencePiece model ({_spm_message(e)})") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.pad_id = int(self._sp.pad_id())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        self.check_protocol_tags(ALL_TAG_PIECES)

    def encode(self, text: str) -> list[int]:
        """Text → ids (no BOS/EOS added)."""
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; pad, BOS and EOS ids are dropped, tags decode to their text."""
        specials = {self.pad_id, self.bos_id, self.eos_id}
        return self._sp.decode([int(i) for i in ids if int(i) not in specials])

    def piece_id(self, piece: str) -> int:
        """Id of a piece that must exist as one token.

        Raises:
          KeyError: if ``piece`` is not a single piece of this vocabulary.
        """
        i = int(self._sp.piece_to_id(piece))
        if i == self._sp.unk_id() or self._sp.id_to_piece(i) != piece:
            raise KeyError(f"piece {piece!r} is not a single token of {self.path}")
        return i

    def check_protocol_tags(self, tags: Sequence[str]) -> None:
        """Raise ``ValueError`` naming the first tag that is not a single piece."""
        for tag in tags:
            try:
                self.piece_id(tag)
            except KeyError:
                raise ValueError(
                    f"tokenizer {self.path} lacks the protocol tag {tag!r} as a single piece; "
                    "retrain it with the tags as user-defined symbols"
                ) from None


def train_sentencepiece(
    texts: Sequence[str], cache_dir: str | os.PathLike, vocab_size: int = 1024, model_type: str = "bpe"
) -> SentencePieceTokenizer:
    """Train (or load from cache) a SentencePiece model whose tags are single pieces.

    Args:
      texts: training sentences (passages, questions, scripted trajectories).
      cache_dir: folder for ``spm-<hash>.model``; reused when the same texts and options recur.
      vocab_size: vocabulary size including special ids and the tags.
      model_type: ``"bpe"`` or ``"unigram"``.

    Returns:
      The loaded tokenizer. Byte fallback is on, so unseen characters never map to ``<unk>``.

    Raises:
      ValueError: if ``texts`` is empty; if ``vocab_size`` does not fit the text (too small for
        its distinct characters plus the fixed pieces, or too large for it), naming the size
        SentencePiece needs; if the cached model is not a SentencePiece model (names the file:
        delete it to retrain). Nothing is written to ``cache_dir`` before training succeeds.
    """
    if not texts:
        raise ValueError("train_sentencepiece needs at least one text")
    digest = hashlib.sha256()
    for t in (model_type, str(vocab_size), *ALL_TAG_PIECES, *texts):
        digest.update(t.encode("utf-8"))
        digest.update(b"\0")
    cache = pathlib.Path(cache_dir)
    model_path = cache / f"spm-{digest.hexdigest()[:16]}.model"
    if model_path.is_file():
        try:
            return SentencePieceTokenizer(model_path)
        except NotATokenizer as e:
            raise NotATokenizer(f"cached {e}: delete it to retrain") from None
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(t.replace("\n", " ") for t in texts),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            user_defined_symbols=list(ALL_TAG_PIECES),
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            character_coverage=1.0,
            max_sentence_length=16384,
            num_threads=2,
            minloglevel=2,
        )
    except RuntimeError as e:
        msg = _spm_message(e)
        m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            raise ValueError(f"vocabulary size {vocab_size} (ExperimentConfig.vocab_size) is too small for the "
                             f"tokenizer's training text: SentencePiece needs at least {m.group(2)} pieces (its "
                             "distinct characters, 256 byte pieces, the special ids and the protocol tags)") from None
        raise ValueError(f"SentencePiece cannot train a {vocab_size}-piece vocabulary (ExperimentConfig.vocab_size) "
                         f"on this text: {msg}") from None
    cache.mkdir(parents=True, exist_ok=True)
    # A temporary name of this writer's own: processes sharing the cache (xdist workers, the
    # processes of one host) may train the same model at once, and each must rename its own file.
    fd, tmp_name = tempfile.mkstemp(prefix=model_path.stem + ".", suffix=".tmp", dir=cache)
    tmp = pathlib.Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's model from other users
    except OSError as e:  # e.g. ENOSPC: name the file
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(tmp)) from None
    os.replace(tmp, model_path)  # atomic: a killed run never leaves a half-written model
    return SentencePieceTokenizer(model_path)


def _spm_message(e: BaseException) -> str:
    """SentencePiece's error without its source location (``Internal: src/x.cc(12) [cond] msg``)."""
    text = " ".join(str(e).split())
    return re.sub(r"^(INTERNAL|Internal|internal)?:?\s*\S+\.cc\(\d+\)\s*(\[[^\]]*\]\s*)?", "", text) or text
