"""Which search backend serves which QA files: a corpus JSONL, a ``/retrieve`` server, or the
passages the QA files carry (docs/algorithm.md §7).

Shared by the evaluation command (``plan_corpora``: one backend per ``--dataset``) and the trainer
(``training_backend``: one backend for the training and held-out files). Three sources:

* a running Search-R1-compatible server (``connect_retriever`` → ``RemoteSearchBackend``, with its
  timeouts and retries), checked once at start-up: a server that does not answer is one error
  naming the URL;
* a corpus file (``load_corpus``: Search-R1 / FlashRAG, Wikipedia passages, HippoRAG) → a local ``BM25Index``;
* the context paragraphs of HotpotQA / 2WikiMultihopQA (``context``) and MuSiQue (``paragraphs``)
  files, pooled (``pooled_passages``) and deduplicated across files (``merge_passages``).
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional, Sequence

from mempo_jax.tools.corpus import Document
from mempo_jax.data.qa_formats import detect_format
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import load_corpus, pool_hotpotqa_contexts, pool_musique_paragraphs
from mempo_jax.tools.remote import RemoteSearchBackend
from mempo_jax.tools.search import ToolError


def pooled_passages(path: str | os.PathLike) -> Optional[list[Document]]:
    """The passages a QA file carries, pooled into a corpus, or None when it carries none.

    HotpotQA / 2WikiMultihopQA ``context`` → ``pool_hotpotqa_contexts``; MuSiQue ``paragraphs`` →
    ``pool_musique_paragraphs`` (ids ``"0"``, ``"1"``, …, deduplicated by (title, text)).
    FlashRAG / Search-R1, question–answer and CSV files return None.

    Raises:
      ValueError: an empty or malformed file (naming file, line and field).
    """

    fmt = detect_format(path)
    if fmt in ("hotpotqa", "2wikimultihopqa"):
        return pool_hotpotqa_contexts(path)
    if fmt == "musique":
        return pool_musique_paragraphs(path)
    return None


def merge_passages(pools: Sequence[Sequence[Document]], *, id_prefix: str = "",
                   skip: Sequence[Document] = ()) -> list[Document]:
    """Union of several pooled corpora: deduplicated by (title, text), renumbered
    ``f"{id_prefix}0"``, ``f"{id_prefix}1"``, … in first-seen order (each pool numbers its own
    passages from 0, so ids would collide).

    Args:
      pools: the corpora, in order.
      id_prefix: prefix of the new ids (e.g. ``"ctx"`` when the union is appended to a corpus
        whose own ids are numbers).
      skip: passages already present elsewhere (their (title, text) pairs are left out).
    """
    out, seen = [], {(d.title, d.text) for d in skip}
    for pool in pools:
        for d in pool:
            if (d.title, d.text) not in seen:
                seen.add((d.title, d.text))
                out.append(Document(f"{id_prefix}{len(out)}", d.title, d.text))
    return out


def connect_retriever(url: str, option: str = "--retriever_url", **client_kw):
    """A ``RemoteSearchBackend`` for ``url`` that has answered one ``POST /retrieve``.

    Args:
      url: the server's base URL (``http://127.0.0.1:8000``; a trailing ``/retrieve`` is accepted).
      option: the flag or config field named in the error (``--retriever_url``,
        ``ExperimentConfig.retriever_url``).
      client_kw: ``timeout_s``, ``max_retries``, ``backoff_s`` of ``RemoteSearchBackend``.

    Raises:
      ValueError: one line naming ``option`` and the URL when the server is down, times out after
        its retries, or does not speak the Search-R1 protocol.
    """

    backend = RemoteSearchBackend(url, **client_kw)
    try:
        backend.search(["test"], 1)
    except ToolError as e:
        backend.close()
        raise ValueError(f"{option} {url}: the retrieval server does not answer POST /retrieve ({e.reason})") from None
    return backend


def plan_corpora(specs: Sequence, corpus: Optional[str], retriever_url: Optional[str]):
    """One search backend per dataset, as the evaluation command chooses them, and a description
    of each.

    Rule: ``retriever_url`` serves every dataset; else ``corpus`` does; else a dataset that
    carries passages is searched over its own, and one that carries none (Bamboogle, R1-Searcher
    and FlashRAG QA files) over the union of the passages pooled from the other datasets.

    Args:
      specs: the datasets (objects with ``name`` and ``path``); their files must exist.
      corpus: ``--corpus`` file (Search-R1 corpus JSONL) or None.
      retriever_url: ``--retriever_url`` or None (exclusive with ``corpus``).

    Returns:
      ``({name: backend}, {name: description})``; backends are ``BM25Index`` or
      ``RemoteSearchBackend`` (datasets may share one object).

    Raises:
      ValueError: a dataset without passages and no corpus anywhere (asks for ``--corpus``), an
        unreachable retriever, or a malformed corpus / data file.
      FileNotFoundError: a missing ``--corpus`` file.
    """

    if retriever_url:
        backend = connect_retriever(retriever_url)
        return {s.name: backend for s in specs}, {s.name: f"retriever {backend.url}" for s in specs}
    if corpus:
        if not pathlib.Path(corpus).is_file():
            raise FileNotFoundError(f"--corpus: no such file: {corpus}")
        index = BM25Index(load_corpus(corpus))
        return {s.name: index for s in specs}, {s.name: f"corpus {corpus} ({len(index)} passages)" for s in specs}
    pools = {s.name: pooled_passages(s.path) for s in specs}
    own = {n: p for n, p in pools.items() if p}
    backends, notes = {}, {}
    for name, pool in own.items():
        backends[name] = BM25Index(pool)
        notes[name] = f"own passages ({len(pool)})"
    missing = [s.name for s in specs if s.name not in own]
    if missing:
        if not own:
            raise ValueError(f"dataset {missing[0]!r} carries no passages and no corpus was given: pass "
                             "--corpus FILE (Search-R1 corpus JSONL) or --retriever_url URL, or add a "
                             "--dataset that carries passages (HotpotQA, 2Wiki, MuSiQue) to pool from")
        union = merge_passages(list(own.values()))
        index = BM25Index(union)
        for name in missing:
            backends[name] = index
            notes[name] = f"pooled from {'+'.join(own)} ({len(union)} passages)"
    return {s.name: backends[s.name] for s in specs}, {s.name: notes[s.name] for s in specs}


def training_backend(qa_paths: Sequence[str | os.PathLike], corpus_path: str = "", retriever_url: str = "",
                     pool_contexts: bool = False, *, prefix: str = "ExperimentConfig"):
    """The one search backend of a training run over QA files (training and held-out).

    Rule (the config fields of ``ExperimentConfig``):

    * ``retriever_url``: that server (checked now; ``pool_contexts`` cannot add to it);
    * ``corpus_path``: BM25 over the corpus JSONL, its ids kept; with ``pool_contexts`` the
      passages the QA files carry are appended (ids ``ctx0``, ``ctx1``, …; those already in the
      corpus are left out);
    * neither: BM25 over the passages the QA files carry (``merge_passages`` of each file's
      ``pooled_passages``: ids ``"0"``, ``"1"``, …), whatever ``pool_contexts`` says. One HotpotQA
      file gives exactly ``pool_hotpotqa_contexts`` of it.

    Args:
      qa_paths: the QA files (duplicates are read once).
      corpus_path, retriever_url, pool_contexts: as above ("" = not set).
      prefix: the config class named in errors.

    Returns:
      ``(backend, documents, note)``: a ``BM25Index`` or ``RemoteSearchBackend``, the local passages
      (``[]`` for a retriever) and a one-line description.

    Raises:
      ValueError: both sources set, ``pool_contexts`` with a retriever, QA files without passages
        and no corpus or retriever (naming the fields), a retriever that does not answer (naming
        the URL), a malformed corpus / QA file.
      FileNotFoundError: a missing corpus file.
    """

    if corpus_path and retriever_url:
        raise ValueError(f"{prefix}.corpus_path and {prefix}.retriever_url are exclusive; set one")
    if retriever_url:
        if pool_contexts:
            raise ValueError(f"{prefix}.pool_contexts cannot add passages to the index of {prefix}.retriever_url "
                             f"{retriever_url}; set pool_contexts = False or use corpus_path")
        backend = connect_retriever(retriever_url, f"{prefix}.retriever_url")
        return backend, [], f"retriever {backend.url}"
    paths = list(dict.fromkeys(str(p) for p in qa_paths))
    pools = {p: pooled_passages(p) for p in paths} if (pool_contexts or not corpus_path) else {}
    pools = {p: docs for p, docs in pools.items() if docs}
    if corpus_path:
        if not pathlib.Path(corpus_path).is_file():
            raise FileNotFoundError(f"{prefix}.corpus_path: no such file: {corpus_path}")
        docs = load_corpus(corpus_path)
        extra = merge_passages(list(pools.values()), id_prefix="ctx", skip=docs)
        clash = {d.id for d in docs} & {d.id for d in extra}
        if clash:
            raise ValueError(f"{prefix}.pool_contexts: corpus {corpus_path} already uses id {sorted(clash)[0]!r}, "
                             "the id of a pooled passage")
        note = f"corpus {corpus_path} ({len(docs)} passages)"
        if pools:
            note += f" + {len(extra)} pooled from {'+'.join(pathlib.Path(p).name for p in pools)}"
        docs = docs + extra
    else:
        if not pools:
            raise ValueError(f"{paths[0] if paths else 'the QA files'}: carries no passages; set "
                             f"{prefix}.corpus_path (a Search-R1 corpus JSONL) or {prefix}.retriever_url")
        docs = merge_passages(list(pools.values()))
        note = f"pooled from {'+'.join(pathlib.Path(p).name for p in pools)} ({len(docs)} passages)"
    return BM25Index(docs), docs, note
