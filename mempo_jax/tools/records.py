"""Reading rows out of data files: JSONL, a JSON array, parquet or CSV — each with its location.

Shared by the corpus reader/pooling (``tools/corpus.py``) and the QA readers
(``data/qa_formats.py``). Every row comes with a location string for error messages
(house rule: a bad row names the file, the line and the field):

* JSONL — the 1-based line number, e.g. ``data.jsonl:12``;
* JSON array (the official HotpotQA / 2Wiki ``*.json`` files) — ``data.json:record 7`` (1-based);
* parquet (Search-R1 ``train.parquet``) — ``data.parquet:row 7`` (1-based; needs ``pyarrow``);
* CSV with a header row (``*.csv``) — the 1-based line where the row ends, e.g. ``data.csv:3``
  (the header is line 1); every value is a string (Python's ``csv`` module, Excel dialect).
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
from typing import Any, Iterator

PathLike = str | os.PathLike


def field_error(path: PathLike, where: int | str, field: str, problem: str) -> ValueError:
    """The house error for a bad row: ``"{path}:{where}: field '{field}': {problem}"``."""
    return ValueError(f"{path}:{where}: field {field!r}: {problem}")


def _utf8_error(path: PathLike, where: str, e: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path}:{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}"
                      f"{' of the line' if where else ''}: {e.reason})")


def _lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` of a UTF-8 file, read as bytes so a bad byte names its line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(path, str(lineno), e) from None


def iter_jsonl(path: PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, row)`` for every non-blank line of a JSONL file (1-based lines).

    Raises:
      ValueError: ``"{path}:{line}: invalid JSON (...)"``, ``"{path}:{line}: not UTF-8 text
        (...)"`` or a row that is not a JSON object.
      OSError: the file cannot be opened.
    """
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: row must be a JSON object, got {type(row).__name__}")
        yield lineno, row


def _first_char(path: PathLike) -> str:
    """The first non-blank byte of the file, as a character ("" for a blank file)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip()
            if stripped:
                return chr(stripped[0])


def csv_columns(path: PathLike) -> list[str]:
    """The header row of a CSV file (column names, stripped); ``[]`` for an empty file.

    Raises:
      OSError: the file cannot be opened.
    """
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: the BOM spreadsheet programs write
        header = next(csv.reader(f), [])
    return [c.strip() for c in header]


def _iter_csv(path: pathlib.Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        try:
            header = [c.strip() for c in next(reader, [])]
            for values in reader:
                if not any(v.strip() for v in values):
                    continue  # blank line
                if len(values) != len(header):
                    raise ValueError(f"{path}:{reader.line_num}: {len(values)} values for the {len(header)} "
                                     f"columns of the header {header}")
                yield str(reader.line_num), dict(zip(header, values))
        except csv.Error as exc:
            raise ValueError(f"{path}:{reader.line_num}: invalid CSV ({exc})") from None


def iter_records(path: PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, row)`` for every row of a JSONL, JSON-array, parquet or CSV file.

    The container is chosen by name for ``*.parquet`` (parquet) and ``*.csv`` (CSV with a header
    row; values are strings), else by content: a file whose first non-blank character is ``[`` →
    one JSON array of objects; anything else → JSONL.

    Returns:
      an iterator of ``("12", row)`` (JSONL or CSV line), ``("record 7", row)`` or ``("row 7", row)``.

    Raises:
      ValueError: invalid JSON or CSV, bytes that are not UTF-8, a non-object row, or a CSV row whose number of values is
        not the header's (naming the file and location).
      ImportError: a parquet file without ``pyarrow`` installed.
      OSError: the file cannot be opened.
    """
    path = pathlib.Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
        for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"row {i}", row
        return
    if path.suffix.lower() == ".csv":
        yield from _iter_csv(path)
        return
    if _first_char(path) == "[":
        raw = path.read_bytes()
        try:
            rows = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}: {exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ValueError(f"{path}:record {i}: row must be a JSON object, got {type(row).__name__}")
            yield f"record {i}", row
        return
    for lineno, row in iter_jsonl(path):
        yield str(lineno), row


def first_record(path: PathLike) -> tuple[str, dict[str, Any]] | None:
    """The first ``(location, row)`` of a file (see ``iter_records``), or None when it is empty."""
    for item in iter_records(path):
        return item
    return None
