"""Local BM25 search over a list of Documents, on the ``bm25s`` library.

The local stand-in for Search-R1's retrieval server (docs/algorithm.md §2, §7): Lucene BM25
(bm25s defaults k1 = 1.5, b = 0.75), title + text tokenised with bm25s' scikit-learn-style
tokenizer (lower-case, ``\\b\\w\\w+\\b``), English stopwords removed, no stemming.
Persistence uses bm25s' own ``save``/``load`` (``.npy`` without pickle, JSON vocab) plus a JSONL
file of the documents — nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Sequence

import bm25s
import numpy as np

from mempo_jax.tools.corpus import Document, Hit, PathLike, load_corpus, write_corpus_jsonl

_DOCS_FILE = "docs.jsonl"
_META_FILE = "mempo_bm25.json"
_FORMAT_VERSION = 1
_STOPWORDS = "en"

logging.getLogger("bm25s").setLevel(logging.WARNING)


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords=_STOPWORDS, return_ids=False, show_progress=False)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest strictly positive scores: score descending, ties by index ascending.

    On the host in numpy, so a search never compiles or runs an XLA program (bm25s' ``retrieve``
    picks its JAX top-k when JAX is installed, which on a TPU host puts the search on the
    accelerator), and a tie at the k-th place resolves by corpus position (bm25s' numpy top-k uses
    ``argpartition``, whose order among equal scores is arbitrary). Documents scoring ``<= 0`` share
    no term with the query and are never returned, so only the positive scores are partitioned and
    sorted: a query matching a few documents of a large corpus costs O(num_docs) once.

    Args:
      scores: ``[num_docs]`` float scores (bm25s' ``get_scores``).
      k: ``>= 1``.

    Returns:
      ``[min(k, number of positive scores)]`` int64 indices into ``scores``.
    """
    cand = np.flatnonzero(scores > 0)
    if cand.size > k:  # keep every index scoring at least the k-th highest value (boundary ties included)
        kth = np.partition(scores[cand], cand.size - k)[cand.size - k]
        cand = cand[scores[cand] >= kth]
    return cand[np.lexsort((cand, -scores[cand]))[:k]]


class BM25Index:
    """BM25 index with a ``search``/``get`` contract shared with ``RemoteSearchBackend``.

    Args:
      docs: the corpus; ids must be unique; at least one document.

    Raises:
      ValueError: an empty corpus or a duplicate id.
    """

    def __init__(self, docs: Sequence[Document], *, _retriever: bm25s.BM25 | None = None):
        docs = list(docs)
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self._docs = docs
        self._by_id: dict[str, int] = {}
        for i, doc in enumerate(docs):
            if doc.id in self._by_id:
                raise ValueError(f"duplicate document id {doc.id!r} (positions {self._by_id[doc.id]} and {i})")
            self._by_id[doc.id] = i
        if _retriever is None:
            _retriever = bm25s.BM25()
            _retriever.index(_tokenize([f"{d.title}\n{d.text}" for d in docs]), show_progress=False)
        self._retriever = _retriever

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def documents(self) -> list[Document]:
        """The corpus in index order (a copy of the list)."""
        return list(self._docs)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-k BM25 hits for each query.

        Args:
          queries: ``num_queries`` query strings.
          topk: hits per query, ``>= 1``; clamped to the corpus size.

        Returns:
          ``num_queries`` lists of at most ``topk`` Hits, scores strictly positive and
          non-increasing (equal scores ordered by corpus position). Documents sharing no term with the
          query are not returned, so a query of stopwords only gets ``[]``.

        Raises:
          ValueError: ``topk < 1`` or a query that is not a string.
        """
        if isinstance(queries, str):
            raise ValueError("queries must be a list of strings, not one string")
        queries = list(queries)
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise ValueError(f"queries[{i}] must be a string, got {type(q).__name__}")
        if not queries:
            return []
        out: list[list[Hit]] = []
        for tokens in _tokenize(queries):
            if not tokens:  # stopwords only: no term to match
                out.append([])
                continue
            scores = np.asarray(self._retriever.get_scores(tokens))
            out.append([Hit(self._docs[int(i)], float(scores[i])) for i in top_k(scores, topk)])
        return out

    def get(self, doc_id: str) -> Document | None:
        """The document with this id, or None (ids are compared exactly, after ``str()``)."""
        i = self._by_id.get(str(doc_id))
        return None if i is None else self._docs[i]

    def save(self, directory: PathLike) -> None:
        """Write the index to ``directory`` (created): bm25s arrays/vocab, ``docs.jsonl``, metadata.

        No pickle: bm25s writes ``.npy`` with ``allow_pickle=False`` and JSON; documents are JSONL.
        """
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(directory), show_progress=False)
        write_corpus_jsonl(self._docs, directory / _DOCS_FILE)
        meta = {"format": _FORMAT_VERSION, "num_docs": len(self._docs), "stopwords": _STOPWORDS}
        (directory / _META_FILE).write_text(json.dumps(meta) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: PathLike) -> "BM25Index":
        """Read an index written by ``save`` (``allow_pickle=False`` throughout).

        Raises:
          FileNotFoundError: the directory or one of its files is missing.
          ValueError: metadata/document count mismatch or malformed files (naming the file).
        """
        directory = pathlib.Path(directory)
        meta_path = directory / _META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: not a BM25Index folder (missing {_META_FILE})")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path}: invalid JSON ({exc.msg})") from None
        if meta.get("format") != _FORMAT_VERSION:
            raise ValueError(f"{meta_path}: field 'format': expected {_FORMAT_VERSION}, got {meta.get('format')!r}")
        docs = load_corpus(directory / _DOCS_FILE)
        if len(docs) != meta.get("num_docs"):
            raise ValueError(f"{meta_path}: field 'num_docs': {meta.get('num_docs')!r} but {len(docs)} documents")
        retriever = bm25s.BM25.load(str(directory), load_corpus=False, allow_pickle=False, show_progress=False)
        if retriever.scores["num_docs"] != len(docs):
            raise ValueError(f"{directory}: bm25s index has {retriever.scores['num_docs']} documents, docs file {len(docs)}")
        return cls(docs, _retriever=retriever)
