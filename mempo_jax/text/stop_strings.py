"""Stop strings over a tokenizer's ids: a byte-level automaton precomputed per (state, token).

A policy that writes its protocol tags as text (``</search>`` = three BPE tokens ``</``,
``search``, ``>``) must stop at the first closing tag *of its decoded output*, also when the tag is
split across tokens or ends inside a token that carries more text (``>\\n``, ``>.``). The
sampler cannot decode on the device, so the text is matched by a deterministic finite automaton
over bytes (Aho-Corasick over the stop strings: Aho & Corasick 1975; the KMP automaton for one
string), lifted to tokens on the host: for every automaton state ``s`` and token id ``v``,

* ``next_state[s, v]`` — the state after reading the bytes of ``v`` from ``s``;
* ``completes[s, v]`` — True when one of those bytes ends an occurrence of a stop string.

A row's output stops at its first token with ``completes[state, token]``; ``state`` starts at 0
(the empty text) with the first generated token. The tables are ``[states, vocab]`` (3 closing
tags: 23 states), built vectorised with numpy from each token's bytes, so the device does one
gather per decode step and the host (``StopAutomaton.first_stop``) the same lookups: both agree
by construction.

Exactness: the stop decision is made on the concatenated bytes of the tokens
(``token_bytes``). For byte-level BPE tokenizers (GPT-2 / Qwen2 / Llama 3 / SmolLM: a
``ByteLevel`` decoder) those are exactly the bytes the tokenizer decodes to; decoding with
invalid UTF-8 replaces only non-ASCII bytes (the Unicode "maximal subpart" practice of both
Python and Rust), so an ASCII stop string occurs in the decoded text iff it occurs in the bytes.
SentencePiece-style ``tokenizer.json`` files (``Metaspace`` / ``ByteFallback`` decoders: Llama 2,
Mistral, Gemma) are exact up to the one leading space their ``Strip`` decoder removes, which no
stop string contains, wherever each run of byte-fallback tokens (``<0xNN>``) is valid UTF-8 (on
an invalid run ``ByteFallback`` decodes every byte token, ASCII ones too, as U+FFFD; the bytes are
kept here, so a tag spelled with byte tokens next to an invalid byte stops here but is not in the
decoded text). Any other tokenizer falls back to ``decode([id])`` per id, exact only when
decoding is context-free.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mempo_jax.text.hf_tokenizer import HFTokenizer


# ------------------------------------------------------------------------------ token bytes


def token_bytes(tokenizer, rows: Optional[int] = None) -> list[bytes]:
    """The bytes each id decodes to, for ids ``0 … rows - 1``.

    Uses ``tokenizer.token_bytes()`` for an ``HFTokenizer`` (exact for byte-level and
    SentencePiece-style decoders, see the module docstring), else
    ``tokenizer.decode([id]).encode("utf-8")`` per id (exact only for context-free decoding).
    Ids beyond the tokenizer (spare embedding rows) decode to ``b""``.

    Args:
      tokenizer: the project tokenizer interface (``decode``, ``vocab_size``).
      rows: how many ids (the model's embedding rows); default ``tokenizer.vocab_size``.

    Returns:
      A list of ``rows`` byte strings.
    """
    rows = int(tokenizer.vocab_size if rows is None else rows)
    if isinstance(tokenizer, HFTokenizer):
        table = list(tokenizer.token_bytes())
    else:
        table = [tokenizer.decode([i]).encode("utf-8") for i in range(int(tokenizer.vocab_size))]
    return (table + [b""] * max(0, rows - len(table)))[:rows]


# ------------------------------------------------------------------------------- automaton


def byte_automaton(strings: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick DFA of ``strings`` over the byte alphabet.

    States are the trie nodes (0 = root = nothing matched); ``delta[s, b]`` follows the goto
    edge or, failing that, the failure links (the longest proper suffix that is a trie node).

    Args:
      strings: non-empty byte strings.

    Returns:
      ``(delta [S, 256] int32, accepts [S] bool)``: ``accepts[s]`` is True when the text read so
      far ends with one of ``strings`` (a node that is a string, or whose failure chain reaches one).

    Raises:
      ValueError: for an empty list or an empty string.

    Source: Aho & Corasick, "Efficient string matching", CACM 18(6), 1975 (the DFA variant).
    """
    if not strings or any(len(s) == 0 for s in strings):
        raise ValueError(f"stop strings must be non-empty, got {list(strings)!r}")
    goto: list[dict[int, int]] = [{}]
    accepts = [False]
    for s in strings:
        node = 0
        for b in s:
            if b not in goto[node]:
                goto.append({})
                accepts.append(False)
                goto[node][b] = len(goto) - 1
            node = goto[node][b]
        accepts[node] = True
    n = len(goto)
    delta = np.zeros((n, 256), np.int32)
    fail = [0] * n
    order = [0]
    for b, child in goto[0].items():  # breadth first: a node's failure state is built before it
        delta[0, b] = child
        order.append(child)
    i = 1
    while i < len(order):
        node = order[i]
        i += 1
        accepts[node] = accepts[node] or accepts[fail[node]]
        delta[node] = delta[fail[node]]
        for b, child in goto[node].items():
            fail[child] = int(delta[fail[node], b]) if node else 0
            delta[node, b] = child
            order.append(child)
    return delta, np.asarray(accepts, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """Stop strings lifted to token ids: ``[states, vocab]`` transition and completion tables.

    Attributes:
      strings: the stop strings (text).
      next_state: ``[S, V]`` int32, the state after token ``v`` from state ``s``.
      completes: ``[S, V]`` bool, True when token ``v`` read from state ``s`` ends a stop string
        (anywhere inside its bytes).

    Build with ``StopAutomaton.build``. Equality is identity (the tables are large); the
    sampler keys its compiled program on the table shapes only.
    """

    strings: tuple[str, ...]
    next_state: np.ndarray
    completes: np.ndarray

    @property
    def num_states(self) -> int:
        """Automaton states S."""
        return int(self.next_state.shape[0])

    @property
    def vocab_size(self) -> int:
        """Token ids V covered (the model's embedding rows)."""
        return int(self.next_state.shape[1])

    @classmethod
    def build(cls, strings: Sequence[str], vocab_bytes: Sequence[bytes]) -> "StopAutomaton":
        """Precompute the tables for ``strings`` over the tokens whose bytes are ``vocab_bytes``.

        Vectorised: tokens are sorted by byte length and every state is advanced over all tokens
        still holding a byte at position j, so the work is ``S × total vocabulary bytes``
        (SmolLM2, 49,152 tokens: about 0.2 s).

        Args:
          strings: non-empty stop strings (UTF-8 encoded for matching).
          vocab_bytes: ``token_bytes(tokenizer, rows)``: the bytes of ids ``0 … V-1``.

        Raises:
          ValueError: for an empty ``strings`` or an empty string.
        """
        strings = tuple(str(s) for s in strings)
        delta, accepts = byte_automaton([s.encode("utf-8") for s in strings])
        v = len(vocab_bytes)
        lengths = np.fromiter((len(b) for b in vocab_bytes), np.int64, count=v)
        order = np.argsort(-lengths, kind="stable")  # longest first: position j is held by a prefix
        width = int(lengths.max(initial=0))
        data = np.zeros((v, max(width, 1)), np.uint8)
        for row, tok in enumerate(order):
            b = vocab_bytes[tok]
            if b:
                data[row, : len(b)] = np.frombuffer(b, np.uint8)
        sorted_len = lengths[order]
        s = delta.shape[0]
        state = np.broadcast_to(np.arange(s, dtype=np.int32)[:, None], (s, v)).copy()
        hit = np.zeros((s, v), bool)
        for j in range(width):
            k = int(np.searchsorted(-sorted_len, -j, side="left"))  # tokens with length > j: [0, k)
            if k == 0:
                break
            nxt = delta[state[:, :k], data[None, :k, j]]
            state[:, :k] = nxt
            hit[:, :k] |= accepts[nxt]
        next_state = np.empty_like(state)
        completes = np.empty_like(hit)
        next_state[:, order] = state
        completes[:, order] = hit
        return cls(strings, next_state, completes)

    def first_stop(self, ids: Sequence[int], stop_ids: Sequence[int] = ()) -> Optional[int]:
        """Length of the shortest prefix of ``ids`` that ends with a stop: a token that completes
        a stop string, or one of ``stop_ids``; ``None`` if there is none.

        The same table lookups as the sampler's decode loop (host-side, for recorded rows).

        Raises:
          IndexError: for an id outside ``[0, vocab_size)``.
        """
        stops = {int(i) for i in stop_ids}
        state = 0
        for n, tok in enumerate(ids, start=1):
            tok = int(tok)
            if not 0 <= tok < self.vocab_size:
                raise IndexError(f"token id {tok} outside the automaton's vocabulary of {self.vocab_size}")
            if tok in stops or self.completes[state, tok]:
                return n
            state = int(self.next_state[state, tok])
        return None


def byte_offsets(vocab_bytes: Sequence[bytes], ids: Sequence[int]) -> np.ndarray:
    """``[len(ids) + 1]`` int64 byte offsets of each token in the concatenated output bytes:
    token i holds bytes ``[offsets[i], offsets[i + 1])``."""
    return np.concatenate([[0], np.cumsum([len(vocab_bytes[int(i)]) for i in ids], dtype=np.int64)])


def find_text_span(vocab_bytes: Sequence[bytes], ids: Sequence[int], open_text: str,
                   close_text: str) -> Optional[tuple[int, int]]:
    """Token span ``[start, end)`` of the first ``open_text … close_text`` block in the bytes of
    ``ids``: from the token holding the first byte of the first ``open_text`` to the token holding
    the last byte of the first ``close_text`` that starts after it. A token straddling either edge
    of the block is included. ``None`` when either string is missing.

    Found on the sampled ids and their byte offsets, never on re-tokenised text.
    """
    data = b"".join(vocab_bytes[int(i)] for i in ids)
    op, cl = open_text.encode("utf-8"), close_text.encode("utf-8")
    a = data.find(op)
    if a < 0:
        return None
    c = data.find(cl, a + len(op))
    if c < 0:
        return None
    ends = byte_offsets(vocab_bytes, ids)[1:]
    start = int(np.searchsorted(ends, a, side="right"))  # first token whose end is past byte a
    end = int(np.searchsorted(ends, c + len(cl) - 1, side="right")) + 1
    return start, end
