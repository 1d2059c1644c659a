"""Retrieval corpus: documents, search hits, corpus JSONL I/O and corpus pooling from QA files.

docs/algorithm.md §7: corpus JSONL rows are ``{"id": str, "contents": "\\"Title\\"\\npassage"}`` — the
DPR wiki-2018 passage style that FlashRAG and Search-R1 corpora use; ``load_corpus`` also reads
``{"id", "title", "text"}`` rows and a HippoRAG corpus (a JSON array of ``{"title", "text"}``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Iterable

from mempo_jax.tools.records import PathLike, field_error, iter_records


@dataclasses.dataclass(frozen=True)
class Document:
    """One passage of the corpus.

    Attributes:
      id: corpus-unique id (a string, e.g. ``"17"``).
      title: the Wikipedia title, one line (no ``"\\n"``).
      text: the passage text.

    Raises:
      ValueError: non-string fields, an empty id, or a title containing a newline.
    """

    id: str
    title: str
    text: str

    def __post_init__(self) -> None:
        for field, value in (("id", self.id), ("title", self.title), ("text", self.text)):
            if not isinstance(value, str):
                raise ValueError(f"Document.{field} must be str, got {type(value).__name__}")
        if not self.id:
            raise ValueError("Document.id must be non-empty")
        if "\n" in self.title:
            raise ValueError(f"Document.title must be one line, got {self.title!r}")

    @property
    def contents(self) -> str:
        """``'"Title"\\ntext'`` (Search-R1 / FlashRAG / DPR wiki format)."""
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, id: str, contents: str) -> "Document":
        """Split a Search-R1 ``contents`` string into title and text.

        The first line is the title, with one pair of surrounding double quotes removed; the
        rest (after the first newline) is the text. Contents without a newline have an empty
        title. ``Document.from_contents(d.id, d.contents) == d`` for every Document ``d``.

        Raises:
          ValueError: ``contents`` is not a string (or the id is invalid, see Document).
        """
        if not isinstance(contents, str):
            raise ValueError(f"contents must be str, got {type(contents).__name__}")
        if "\n" not in contents:
            return cls(id, "", contents)
        title, text = contents.split("\n", 1)
        if len(title) >= 2 and title.startswith('"') and title.endswith('"'):
            title = title[1:-1]
        return cls(id, title, text)

    def to_row(self) -> dict[str, str]:
        """The corpus JSONL row ``{"id", "contents"}`` (docs/algorithm.md §7)."""
        return {"id": self.id, "contents": self.contents}


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved document and its retrieval score (BM25: higher is better, unitless)."""

    document: Document
    score: float


CORPUS_LAYOUTS = ('{"id", "contents": "\\"Title\\"\\npassage"} (Search-R1, FlashRAG), '
                  '{"id", "title", "text"} (Wikipedia passages, e.g. DPR) or {"title", "text"} without ids '
                  '(a HippoRAG corpus; ids are the 0-based row numbers), as JSONL, a JSON array or parquet')


def _row_document(row: dict[str, Any], path: PathLike, where: str, index: int) -> Document:
    """One corpus row as a ``Document`` (layouts: ``CORPUS_LAYOUTS``); ``index`` (0-based) is the id
    of a ``{"title", "text"}`` row without one."""
    key = "id" if "id" in row else "_id" if "_id" in row else None
    if "contents" in row:
        if key is None:
            raise field_error(path, where, "id", 'missing (a {"id", "contents"} row needs its id)')
        if not isinstance(row["contents"], str):
            raise field_error(path, where, "contents", f"must be a string, got {type(row['contents']).__name__}")
    elif "text" in row:
        for field in ("title", "text"):
            if not isinstance(row.get(field, ""), str):
                raise field_error(path, where, field, f"must be a string, got {type(row[field]).__name__}")
    else:
        raise ValueError(f"{path}:{where}: field 'contents' or 'text': missing (the row has {sorted(row)}); "
                         f"a corpus row is {CORPUS_LAYOUTS}")
    doc_id = row[key] if key is not None else index
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id:
        raise field_error(path, where, key or "id", f"must be a non-empty string or int, got {doc_id!r}")
    if "contents" in row:
        return Document.from_contents(doc_id, row["contents"])
    return Document(doc_id, " ".join(row.get("title", "").split()), row["text"])


def load_corpus(path: PathLike) -> list[Document]:
    """Read a retrieval corpus (docs/algorithm.md §7) in any of ``CORPUS_LAYOUTS``.

    Rows are read by ``records.iter_records`` (JSONL, a JSON array or parquet). A row with
    ``contents`` is split into title and text (``Document.from_contents``); a row with ``text``
    keeps its ``title`` (whitespace collapsed to one line; ``""`` when absent). The id is ``id``
    (or ``_id``, BEIR); integer ids become strings; a ``{"title", "text"}`` row without one gets
    its 0-based row number. Blank JSONL lines are skipped.

    Returns:
      the documents in file order.

    Raises:
      ValueError: ``"{path}:{line}: field '...': ..."`` for a missing/mistyped field (a row with
        neither ``contents`` nor ``text`` lists the layouts) or a duplicate id; invalid JSON or
        bytes that are not UTF-8 name the file and line; a file without rows names the file and
        the layouts.
    """
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(iter_records(path)):
        doc = _row_document(row, path, where, index)
        if doc.id in seen:
            raise field_error(path, where, "id", f"duplicate id {doc.id!r} (first at {seen[doc.id]})")
        seen[doc.id] = where
        docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: empty corpus (no rows); a corpus row is {CORPUS_LAYOUTS}")
    return docs


def write_corpus_jsonl(docs: Iterable[Document], path: PathLike) -> None:
    """Write documents as corpus JSONL rows ``{"id", "contents"}`` (UTF-8, one row a line).

    Parent folders are created. ``load_corpus(path)`` returns the same documents.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc.to_row(), ensure_ascii=False) + "\n")


def _pool(docs: list[Document], seen: set[tuple[str, str]], title: str, text: str) -> None:
    if (title, text) not in seen:
        seen.add((title, text))
        docs.append(Document(str(len(docs)), title, text))


def _require(row: dict[str, Any], path: PathLike, where: str, field: str, kind: type) -> Any:
    if field not in row:
        raise field_error(path, where, field, "missing")
    if not isinstance(row[field], kind):
        raise field_error(path, where, field, f"must be {kind.__name__}, got {type(row[field]).__name__}")
    return row[field]


def hotpotqa_paragraphs(row: dict[str, Any], path: PathLike = "<row>", where: str = "?") -> list[tuple[str, list[str]]]:
    """``[(title, sentences)]`` of one HotpotQA / 2WikiMultihopQA record's ``context``.

    Accepts both layouts: Hugging Face ``context = {"title": [...], "sentences": [[...], ...]}``
    and the official ``context = [[title, [sentence, ...]], ...]``.

    Raises:
      ValueError: ``"{path}:{where}: field 'context…': ..."`` for a malformed context.
    """
    ctx = row.get("context")
    if ctx is None:
        raise field_error(path, where, "context", "missing")
    if isinstance(ctx, dict):
        titles, sents = ctx.get("title"), ctx.get("sentences")
        if not isinstance(titles, list) or not isinstance(sents, list) or len(titles) != len(sents):
            raise field_error(path, where, "context", "needs lists 'title' and 'sentences' of equal length")
        pairs = list(zip(titles, sents))
    elif isinstance(ctx, list):
        pairs = []
        for i, item in enumerate(ctx):
            if not isinstance(item, list) or len(item) != 2:
                raise field_error(path, where, f"context[{i}]", "must be [title, [sentences]]")
            pairs.append((item[0], item[1]))
    else:
        raise field_error(path, where, "context", f"must be a dict or list, got {type(ctx).__name__}")
    for i, (title, sentences) in enumerate(pairs):
        if not isinstance(title, str):
            raise field_error(path, where, f"context.title[{i}]", "must be a string")
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise field_error(path, where, f"context.sentences[{i}]", "must be a list of strings")
    return [(t, list(s)) for t, s in pairs]


def pool_hotpotqa_contexts(path: PathLike) -> list[Document]:
    """Pool the context paragraphs of a HotpotQA (or 2WikiMultihopQA) file into a corpus.

    Each paragraph becomes ``Document(id, title, text)`` with ``text`` the sentences joined by
    one space (each stripped; HotpotQA's sentences carry their own leading space). Duplicates by
    ``(title, text)`` are dropped; ids are ``"0"``, ``"1"``, … in first-seen order. The shared
    HotpotQA dev distractor sample (300 questions × 10 paragraphs) pools to 2,967 documents.

    Args:
      path: JSONL (HF layout) or JSON array (official layout) file; see ``records.iter_records``.

    Raises:
      ValueError: a malformed record, naming the file, the line/record and the field.
    """
    docs: list[Document] = []
    seen: set[tuple[str, str]] = set()
    for where, row in iter_records(path):
        for title, sentences in hotpotqa_paragraphs(row, path, where):
            text = " ".join(s.strip() for s in sentences if s.strip())
            _pool(docs, seen, " ".join(title.split()), text)
    return docs


def pool_musique_paragraphs(path: PathLike) -> list[Document]:
    """Pool MuSiQue ``paragraphs[{title, paragraph_text}]`` into a corpus, dedup by (title, text).

    Ids are ``"0"``, ``"1"``, … in first-seen order (MuSiQue's per-question ``idx`` is not unique
    across questions).

    Raises:
      ValueError: a malformed record, naming the file, the line and the field.
    """
    docs: list[Document] = []
    seen: set[tuple[str, str]] = set()
    for where, row in iter_records(path):
        paragraphs = _require(row, path, where, "paragraphs", list)
        for i, para in enumerate(paragraphs):
            if not isinstance(para, dict):
                raise field_error(path, where, f"paragraphs[{i}]", "must be an object")
            title = para.get("title")
            text = para.get("paragraph_text")
            if not isinstance(title, str):
                raise field_error(path, where, f"paragraphs[{i}].title", "missing or not a string")
            if not isinstance(text, str):
                raise field_error(path, where, f"paragraphs[{i}].paragraph_text", "missing or not a string")
            _pool(docs, seen, " ".join(title.split()), text.strip())
    return docs
