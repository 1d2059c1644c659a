"""Retrieval corpus: documents, search hits, corpus JSONL I/O and corpus pooling from QA files.

MEMPO_SPEC §7: corpus JSONL rows are ``{"id": str, "contents": "\\"Title\\"\\npassage"}`` — the
DPR wiki-2018 passage style that FlashRAG and Search-R1 corpora use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterable, Iterator

PathLike = str | os.PathLike


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
        for field in ("id", "title", "text"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"Document.{field} must be str, got {type(getattr(self, field)).__name__}")
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
        """The corpus JSONL row ``{"id", "contents"}`` (MEMPO_SPEC §7)."""
        return {"id": self.id, "contents": self.contents}


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved document and its retrieval score (BM25: higher is better, unitless)."""

    document: Document
    score: float


def iter_jsonl(path: PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, row)`` for every non-blank line of a JSONL file (1-based lines).

    Raises:
      ValueError: ``"{path}:{line}: invalid JSON (...)"`` or a row that is not a JSON object.
      OSError: the file cannot be opened.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: row must be a JSON object, got {type(row).__name__}")
            yield lineno, row


def field_error(path: PathLike, lineno: int, field: str, problem: str) -> ValueError:
    """The house error for bad input rows: ``"{path}:{line}: field '{field}': {problem}"``."""
    return ValueError(f"{path}:{lineno}: field {field!r}: {problem}")


def load_corpus_jsonl(path: PathLike) -> list[Document]:
    """Read a Search-R1/FlashRAG corpus JSONL (rows ``{"id", "contents"}``, MEMPO_SPEC §7).

    Integer ids are accepted and converted to strings. Blank lines are skipped.

    Returns:
      the documents in file order.

    Raises:
      ValueError: ``"{path}:{line}: field 'id'|'contents': ..."`` for a missing/mistyped field or a
        duplicate id; invalid JSON names the file and line.
    """
    docs: list[Document] = []
    seen: dict[str, int] = {}
    for lineno, row in iter_jsonl(path):
        if "id" not in row:
            raise field_error(path, lineno, "id", "missing")
        doc_id = row["id"]
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):
            doc_id = str(doc_id)
        if not isinstance(doc_id, str) or not doc_id:
            raise field_error(path, lineno, "id", f"must be a non-empty string, got {row['id']!r}")
        if doc_id in seen:
            raise field_error(path, lineno, "id", f"duplicate id {doc_id!r} (first on line {seen[doc_id]})")
        if "contents" not in row:
            raise field_error(path, lineno, "contents", "missing")
        if not isinstance(row["contents"], str):
            raise field_error(path, lineno, "contents", f"must be a string, got {type(row['contents']).__name__}")
        seen[doc_id] = lineno
        docs.append(Document.from_contents(doc_id, row["contents"]))
    return docs


def write_corpus_jsonl(docs: Iterable[Document], path: PathLike) -> None:
    """Write documents as corpus JSONL rows ``{"id", "contents"}`` (UTF-8, one row a line).

    Parent folders are created. ``load_corpus_jsonl(path)`` returns the same documents.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc.to_row(), ensure_ascii=False) + "\n")
