"""How the protocol tags are written in a tokenizer's ids: one id each, or plain text.

Two modes (``RolloutConfig``/``ModelOptions.tags``):

* ``"tokens"`` — every tag of ``protocol.ALL_TAG_PIECES`` is one id: the from-scratch
  SentencePiece tokenizer (user-defined pieces), or an HF tokenizer with the tags added as tokens.
  Spans and stops are found by id comparison.
* ``"text"`` — the tags are ordinary text, several BPE tokens each (how a checkpoint SFT'd on
  text trajectories writes them). Spans and stops are found on the sampled ids through their
  decoded text and each token's character offsets, never by re-tokenising text (ARCHITECTURE.md,
  token-in/token-out).

Every consumer (rollout, scripted agent, SFT reader, memory-reward scorer) goes through a
``TagCodec``, so the two modes differ in this module only.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mempo_jax.agent.protocol import ALL_TAG_PIECES, STOP_TAGS

TAG_MODES = ("tokens", "text")


class TagCodec:
    """Protocol tags of one tokenizer in one mode.

    Args:
      tokenizer: the project tokenizer interface (``encode``, ``decode``, ``piece_id``,
        ``eos_id``, ``pad_id``, ``bos_id``; HF tokenizers also ``stop_ids``).
      mode: ``"tokens"`` or ``"text"``.

    Attributes:
      stop_ids: ids that end a turn by themselves: EOS, end-of-turn specials and, in ``tokens``
        mode, the closing action tags.

    Raises:
      ValueError: unknown mode, or (``tokens`` mode) a tag that is not a single piece of the
        tokenizer (the message names the tag).
    """

    def __init__(self, tokenizer, mode: str = "tokens"):
        if mode not in TAG_MODES:
            raise ValueError(f"tag mode must be one of {TAG_MODES}, got {mode!r}")
        self.tokenizer, self.mode = tokenizer, mode
        if mode == "tokens":
            self._ids = {}
            for tag in ALL_TAG_PIECES:
                try:
                    self._ids[tag] = int(tokenizer.piece_id(tag))
                except KeyError:
                    raise ValueError(f"tags='tokens' needs every protocol tag as one token, but {tag!r} is not a "
                                     f"single piece of this tokenizer (use tags='text', or add the tags)") from None
        stop = {int(tokenizer.eos_id)}
        if hasattr(tokenizer, "stop_ids"):  # HF: generation-config EOS ids and end-of-turn specials
            stop |= set(int(i) for i in tokenizer.stop_ids(()))
        if mode == "tokens":
            stop |= {self._ids[t] for t in STOP_TAGS}
        self.stop_ids: tuple[int, ...] = tuple(sorted(stop))

    def tag_ids(self, tag: str) -> list[int]:
        """Ids that write ``tag`` (one of ``ALL_TAG_PIECES``) on its own: ``[id]`` in tokens mode,
        ``tokenizer.encode(tag)`` in text mode.

        Raises:
          KeyError: for a string that is not a protocol tag.
        """
        if tag not in ALL_TAG_PIECES:
            raise KeyError(f"not a protocol tag: {tag!r}")
        if self.mode == "tokens":
            return [self._ids[tag]]
        return list(self.tokenizer.encode(tag))

    def find_span(self, ids: Sequence[int], open_tag: str, close_tag: str) -> Optional[tuple[int, int]]:
        """``[start, end)`` token span from the first ``open_tag`` to the first ``close_tag`` after
        it, both included, or ``None`` when either is missing.

        In text mode the span covers every token that holds a character of the block (a token
        that straddles the block's edge is included).
        """
        if self.mode == "tokens":
            ids = [int(i) for i in ids]
            try:
                start = ids.index(self._ids[open_tag])
                end = ids.index(self._ids[close_tag], start + 1)
            except ValueError:
                return None
            return start, end + 1
        raise NotImplementedError("text-mode spans")

    def first_stop(self, ids: Sequence[int]) -> Optional[int]:
        """Length of the shortest prefix of ``ids`` that ends the turn (a stop id, or in text mode
        the token that completes a closing action tag), or ``None``."""
        for n, i in enumerate(ids, start=1):
            if int(i) in self.stop_ids:
                return n
        if self.mode == "tokens":
            return None
        raise NotImplementedError("text-mode stops")
