"""Character budget of a tool observation, applied before it is tokenised.

A tool result is cut to ``RolloutConfig.max_observation_tokens`` ids after encoding. Encoding a
50 MB passage whole to keep its first 64 ids costs seconds per turn, so the
text is first cut to ``OBS_CHARS_PER_TOKEN`` characters per kept token. That budget is generous:
a SentencePiece piece of the from-scratch tokenizer is at most 16 characters
(``max_sentencepiece_length``; byte-fallback pieces are one byte), so the first ``n`` ids of
the cut text equal the first ``n`` ids of the whole text whenever the cut falls at least one
word after character ``16·n``. Byte-level BPE tokens of HF checkpoints are rarely longer than a
few characters in running text; text made of very long tokens (runs of 100 dashes) simply
yields fewer than ``n`` ids after the cut.
"""

from __future__ import annotations

OBS_CHARS_PER_TOKEN = 32  # characters kept per observation token before encoding


def clip_text(text: str, max_chars: int) -> str:
    """The first ``max_chars`` characters of ``text`` (the whole text when it is shorter).

    Args:
      text: any str.
      max_chars: character budget, ``>= 0`` (Python ``str`` characters, i.e. code points).

    Returns:
      ``text[:max_chars]`` (no marker is added: the caller cuts to tokens after encoding).

    Raises:
      ValueError: ``max_chars < 0``.
      TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"clip_text needs a str, got {type(text).__name__}")
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    return text if len(text) <= max_chars else text[:max_chars]
