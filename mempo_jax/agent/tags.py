"""How the protocol tags are written in a tokenizer's ids: one id each, or plain text.

Two modes (``ModelOptions.tags``; ``python -m mempo_jax.commands.evaluate --tags``):

* ``"tokens"`` — every tag of ``protocol.tag_pieces(actions)`` is one id: the from-scratch
  SentencePiece tokenizer (user-defined pieces), or an HF tokenizer with the tags added as tokens.
  Spans and stops are found by id comparison.
* ``"text"`` — the tags are ordinary text, several BPE tokens each (how a checkpoint SFT'd on
  text trajectories writes them). Spans and stops are found on the sampled ids through the bytes
  each token decodes to (``HFTokenizer.token_bytes``) and their offsets, never by re-tokenising
  text (token in, token out: docs/algorithm.md §2). The sampler stops a row on the device with the
  codec's ``stop_automaton`` (``mempo_jax.text.stop_strings``: a byte automaton over the closing
  action tags lifted to ``[states, vocab]`` tables), and ``first_stop`` makes the same lookups on
  the host, so both agree on every row: the first token whose bytes complete ``</search>``,
  ``</access>`` or ``</answer>`` (a tag split across tokens, or ending inside a token such as
  ``>\\n``), or a stop id.

Every consumer (rollout, scripted agent, SFT reader, memory-reward scorer) goes through a
``TagCodec``, so the two modes differ in this module only.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mempo_jax.text.protocol import ACTIONS, stop_tags, tag_pieces
from mempo_jax.agent.trajectory import find_span
from mempo_jax.text.hf_tokenizer import HFTokenizer
from mempo_jax.text.stop_strings import StopAutomaton, find_text_span, token_bytes

TAG_MODES = ("tokens", "text")


class TagCodec:
    """Protocol tags of one tokenizer in one mode.

    Args:
      tokenizer: the project tokenizer interface (``encode``, ``decode``, ``piece_id``,
        ``eos_id``, ``pad_id``, ``bos_id``; HF tokenizers also ``stop_ids``).
      mode: ``"tokens"`` or ``"text"``.
      actions: the action vocabulary (``protocol.ACTIONS``; a tool environment's ``actions``):
        the tags are ``protocol.tag_pieces(actions)``, a turn stops at ``stop_tags(actions)``, the
        turn parser (``agent.turns.make_turn``) accepts these actions.

    Attributes:
      actions: as given (a tuple).
      pieces: the protocol tags (the 12 ``ALL_TAG_PIECES`` for the default actions).
      stop_tags: the closing action tags.
      stop_ids: ids that end a turn by themselves: EOS, end-of-turn specials and, in ``tokens``
        mode, the closing action tags.

    Raises:
      ValueError: unknown mode, (``tokens`` mode) a tag that is not a single piece of the
        tokenizer, or (``text`` mode) a tag the tokenizer cannot write (its ids do not decode back
        to the tag); the message names the tag.
    """

    def __init__(self, tokenizer, mode: str = "tokens", actions: tuple[str, ...] = ACTIONS):
        if mode not in TAG_MODES:
            raise ValueError(f"tag mode must be one of {TAG_MODES}, got {mode!r}")
        self.tokenizer, self.mode, self.actions = tokenizer, mode, tuple(actions)
        self.pieces, self.stop_tags = tag_pieces(self.actions), stop_tags(self.actions)
        if mode == "tokens":
            self._ids = {}
            for tag in self.pieces:
                try:
                    self._ids[tag] = int(tokenizer.piece_id(tag))
                except KeyError:
                    raise ValueError(f"tags='tokens' needs every protocol tag as one token, but {tag!r} is not a "
                                     f"single piece of this tokenizer (use tags='text', or add the tags)") from None
        else:
            for tag in self.pieces:
                ids = list(tokenizer.encode(tag))
                if not ids or tokenizer.decode(ids) != tag:
                    raise ValueError(f"tags='text': the tokenizer cannot write the protocol tag {tag!r} "
                                     f"(encodes to {ids}, which decode to {tokenizer.decode(ids)!r})")
        self._bytes: Optional[list[bytes]] = None
        self._automata: dict[int, StopAutomaton] = {}
        stop = {int(tokenizer.eos_id)}
        if isinstance(tokenizer, HFTokenizer):  # its generation-config EOS ids and end-of-turn specials
            stop |= set(int(i) for i in tokenizer.stop_ids(()))
        if mode == "tokens":
            stop |= {self._ids[t] for t in self.stop_tags}
        self.stop_ids: tuple[int, ...] = tuple(sorted(stop))

    def tag_ids(self, tag: str) -> list[int]:
        """Ids that write ``tag`` (one of ``pieces``) on its own: ``[id]`` in tokens mode,
        ``tokenizer.encode(tag)`` in text mode.

        Raises:
          KeyError: for a string that is not a protocol tag.
        """
        if tag not in self.pieces:
            raise KeyError(f"not a protocol tag: {tag!r}")
        if self.mode == "tokens":
            return [self._ids[tag]]
        return list(self.tokenizer.encode(tag))

    def token_bytes(self, rows: Optional[int] = None) -> list[bytes]:
        """Bytes each id ``0 … rows - 1`` decodes to (``stop_strings.token_bytes``; cached, grown on
        demand; ids beyond the tokenizer, e.g. spare embedding rows, are ``b""``)."""
        rows = int(self.tokenizer.vocab_size if rows is None else rows)
        if self._bytes is None or len(self._bytes) < rows:
            self._bytes = token_bytes(self.tokenizer, max(rows, int(self.tokenizer.vocab_size)))
        return self._bytes

    def stop_automaton(self, rows: Optional[int] = None) -> Optional[StopAutomaton]:
        """The sampler's device-side stop for text tags: ``StopAutomaton`` of ``stop_tags`` over
        ``rows`` ids (the model's embedding rows; default the tokenizer's size), cached per
        ``rows``. ``None`` in tokens mode (the closing tags are stop ids there)."""
        if self.mode == "tokens":
            return None
        rows = int(self.tokenizer.vocab_size if rows is None else rows)
        if rows not in self._automata:
            self._automata[rows] = StopAutomaton.build(self.stop_tags, self.token_bytes(rows)[:rows])
        return self._automata[rows]

    def _rows_for(self, ids: Sequence[int]) -> int:
        return max(int(self.tokenizer.vocab_size), max((int(i) for i in ids), default=-1) + 1)

    def find_span(self, ids: Sequence[int], open_tag: str, close_tag: str) -> Optional[tuple[int, int]]:
        """``[start, end)`` token span from the first ``open_tag`` to the first ``close_tag`` after
        it, both included, or ``None`` when either is missing.

        In text mode the span covers every token that holds a character of the block (a token
        that straddles the block's edge is included).
        """
        if self.mode == "tokens":
            return find_span([int(i) for i in ids], self._ids[open_tag], self._ids[close_tag])
        return find_text_span(self.token_bytes(self._rows_for(ids)), ids, open_tag, close_tag)

    def first_stop(self, ids: Sequence[int]) -> Optional[int]:
        """Length of the shortest prefix of ``ids`` that ends the turn (a stop id, or in text mode
        the token that completes a closing action tag), or ``None``. In text mode these are the
        lookups of the sampler's ``stop_automaton``, so they agree with the device on every row.

        Raises:
          IndexError: (text mode) a negative id.
        """
        if self.mode == "tokens":
            for n, i in enumerate(ids, start=1):
                if int(i) in self.stop_ids:
                    return n
            return None
        ids = [int(i) for i in ids]
        return self.stop_automaton(self._rows_for(ids)).first_stop(ids, self.stop_ids)

    def end_at_close(self, ids: Sequence[int], close_tag: str) -> list[int]:
        """``ids`` of a block found by ``find_span`` (it ends with the token holding the last byte of
        ``close_tag``), made to end exactly at ``close_tag``: in text mode a last token that runs
        past it (SmolLM2 writes ``</mem><think>`` as ``</ mem >< think >``: ``><`` holds the next
        tag's ``<``) is replaced by the tokenizer's ids of its bytes up to the close; otherwise, and
        in tokens mode, ``ids`` unchanged. The memory reward's views are built on this
        (``rl.memory_views.memory_view``), so the scorer's answer prefix or later tool results follow a
        block that reads ``…</mem>``, not ``…</mem><``.

        Args:
          ids: ``[n]`` int token ids (sampled or encoded); only the last token can be replaced.
          close_tag: a protocol tag of ``pieces``.
        Returns:
          ``[n']`` ids (``n' >= n - 1``; equal to ``ids`` unless the last token straddles).
        """
        ids = [int(i) for i in ids]
        if self.mode == "tokens" or not ids:
            return ids
        vocab = self.token_bytes(self._rows_for(ids))
        data, cl = b"".join(vocab[i] for i in ids), close_tag.encode("utf-8")
        end = data.rfind(cl, max(0, len(data) - len(vocab[ids[-1]]) - len(cl) + 1))
        extra = len(data) - (end + len(cl))
        if end < 0 or extra <= 0:
            return ids
        keep = vocab[ids[-1]][: len(vocab[ids[-1]]) - extra]  # never empty: it holds the close's last byte
        try:
            return ids[:-1] + [int(i) for i in self.tokenizer.encode(keep.decode("utf-8"))]
        except UnicodeDecodeError:  # the kept bytes start inside a character: leave the ids as sampled
            return ids

    def turn_text(self, ids: Sequence[int]) -> str:
        """The text of one generated turn, as the turn parser should read it: ``decode(ids)``; in
        text mode cut right after the first closing action tag, so the rest of the token that
        completed it (the ``.`` of ``>.``) is not stray text of the turn. The ids are not changed."""
        text = self.tokenizer.decode([int(i) for i in ids])
        if self.mode == "tokens":
            return text
        ends = [text.find(t) + len(t) for t in self.stop_tags if t in text]
        return text[: min(ends)] if ends else text
