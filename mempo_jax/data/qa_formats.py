"""QA datasets in their public formats → ``QAExample`` records, and a grain source over them.

Formats (docs/algorithm.md §6–7; all read by ``load_dataset(path, format="auto")``):

* ``"flashrag"`` — FlashRAG / Search-R1 rows ``{"id", "question", "golden_answers": [str]}``
  (JSONL or Search-R1 parquet); when ``golden_answers`` is absent, Search-R1's
  ``reward_model.ground_truth.target`` is used. A list of lists is read as one alias list per
  objective (multi-objective).
* ``"qa"`` — question/answer rows ``{"question", "answer": str | [str]}`` with an optional
  ``id``/``idx`` (e.g. R1-Searcher's ``eval_set/*.jsonl``).
* ``"hotpotqa"`` — HF ``hotpot_qa`` layout (``id``, ``context.title/sentences``) or the official
  layout (``_id``, ``context = [[title, sentences]]``, a JSON array).
* ``"2wikimultihopqa"`` — 2WikiMultihopQA (official layout, HotpotQA-like plus ``evidences``).
* ``"musique"`` — MuSiQue (``paragraphs``, ``answer``, ``answer_aliases``).
* CSV (``*.csv``, header row) — read as ``"qa"``: a ``question`` and an ``answer`` column, an
  optional ``id`` column, header names in any case (``Question,Answer``); an ``answer`` cell
  holding a JSON array (``["Paris", "paris, france"]``) gives several aliases. A CSV without a
  ``question`` (or ``answer``) column is one error naming the file and its columns.

A file whose format cannot be detected is refused with the fields each format expects
(``FORMAT_FIELDS``).

Gold strings are whitespace-stripped and de-duplicated (order kept); rewards apply SQuAD
normalisation later (docs/algorithm.md §3).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Iterator, Sequence

import grain

from mempo_jax.tools.corpus import hotpotqa_paragraphs
from mempo_jax.tools.records import PathLike, csv_columns, field_error, first_record, iter_records

FORMATS: tuple[str, ...] = ("flashrag", "qa", "hotpotqa", "2wikimultihopqa", "musique")
# What each format's rows hold (for refusals); the keys are FORMATS plus the CSV layout.
FORMAT_FIELDS: dict[str, str] = {
    "flashrag": '{"id", "question", "golden_answers": [str]} (FlashRAG, Search-R1; or Search-R1\'s '
                "reward_model.ground_truth.target)",
    "qa": '{"question", "answer": str | [str]}, optional "id"',
    "hotpotqa": '{"_id" or "id", "question", "answer", "context", "supporting_facts"}',
    "2wikimultihopqa": 'the hotpotqa fields plus "evidences" or a "type"',
    "musique": '{"id", "question", "answer", "answer_aliases", "paragraphs"}',
    "csv": "a header row with question and answer columns (any case), optional id",
}
_TWOWIKI_TYPES = {"compositional", "inference", "bridge_comparison"}
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One (possibly multi-objective) question.

    Attributes:
      id: example id (string).
      question: the prompt text.
      golds: one tuple of accepted aliases per objective; single-hop QA has one objective.
      source: dataset name (Search-R1 ``data_source``, else the file name without extension).

    Raises:
      ValueError: empty question/golds, an objective without aliases, or non-string values.
    """

    id: str
    question: str
    golds: tuple[tuple[str, ...], ...]
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not isinstance(self.source, str):
            raise ValueError("QAExample.id and .source must be strings")
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"QAExample {self.id!r}: question must be non-empty text")
        if not isinstance(self.golds, tuple) or not self.golds:
            raise ValueError(f"QAExample {self.id!r}: golds must be a non-empty tuple of alias tuples")
        for aliases in self.golds:
            if not isinstance(aliases, tuple) or not aliases or not all(isinstance(a, str) and a for a in aliases):
                raise ValueError(f"QAExample {self.id!r}: each objective needs >= 1 non-empty alias, got {aliases!r}")

    @property
    def num_objectives(self) -> int:
        """Number of sub-questions whose answers go into one ``<answer>`` (``;``-separated)."""
        return len(self.golds)


# -- field helpers ------------------------------------------------------------------------------
def _aliases(value: Any, path: PathLike, where: str, field: str) -> tuple[str, ...]:
    """A gold value (str | number | list of those) → a tuple of stripped, unique, non-empty strings."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise field_error(path, where, field, f"answers must be strings, got {type(item).__name__} at [{i}]")
        text = str(item).strip()
        if text and text not in out:
            out.append(text)
    if not out:
        raise field_error(path, where, field, "no non-empty answer")
    return tuple(out)


def _golds(value: Any, path: PathLike, where: str, field: str) -> tuple[tuple[str, ...], ...]:
    """Flat list → one objective; list of lists → one objective each."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        return tuple(_aliases(v, path, where, f"{field}[{i}]") for i, v in enumerate(value))
    return (_aliases(value, path, where, field),)


def _question(row: dict[str, Any], path: PathLike, where: str) -> str:
    q = row.get("question")
    if not isinstance(q, str) or not q.strip():
        raise field_error(path, where, "question", "missing or not a non-empty string")
    return q.strip()


def _id(row: dict[str, Any], path: PathLike, where: str, keys: Sequence[str]) -> str:
    for key in keys:
        if key in row and row[key] is not None:
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
                raise field_error(path, where, key, f"must be a non-empty string or int, got {value!r}")
            return str(value)
    return where  # no id field: the location is unique within the file


def _require(row: dict[str, Any], path: PathLike, where: str, field: str) -> Any:
    if field not in row or row[field] is None:
        raise field_error(path, where, field, "missing")
    return row[field]


# -- one reader per format ------------------------------------------------------------------------
def _flashrag(row: dict[str, Any], path: PathLike, where: str, source: str) -> QAExample:
    if "golden_answers" in row and row["golden_answers"] is not None:
        golds = _golds(row["golden_answers"], path, where, "golden_answers")
    else:
        rm = row.get("reward_model")
        target = rm.get("ground_truth") if isinstance(rm, dict) else None
        target = target.get("target") if isinstance(target, dict) else target
        if target is None:
            raise field_error(path, where, "golden_answers", "missing (and no reward_model.ground_truth.target)")
        golds = _golds(target, path, where, "reward_model.ground_truth.target")
    src = row.get("data_source") if isinstance(row.get("data_source"), str) and row.get("data_source") else source
    return QAExample(_id(row, path, where, ("id", "idx")), _question(row, path, where), golds, src)


def _qa(row: dict[str, Any], path: PathLike, where: str, source: str) -> QAExample:
    golds = _golds(_require(row, path, where, "answer"), path, where, "answer")
    return QAExample(_id(row, path, where, ("id", "idx", "_id")), _question(row, path, where), golds, source)


def expected_formats() -> str:
    """``"flashrag: {...}; qa: {...}; ..."``: every format and the fields it expects (refusals)."""
    return "; ".join(f"{name}: {fields}" for name, fields in FORMAT_FIELDS.items())


def _csv_qa(row: dict[str, Any], path: PathLike, where: str, source: str) -> QAExample:
    """A CSV row (every value a string): column names are matched in any case (``Question``); an
    ``answer`` cell that is a JSON array is a list of aliases; an empty ``id`` cell counts as absent."""
    row = {str(k).lower(): v for k, v in row.items()}
    answer = row.get("answer")
    if isinstance(answer, str) and answer.strip().startswith("["):
        try:
            parsed = json.loads(answer)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            row["answer"] = parsed
    for key in ("id", "idx", "_id"):
        if row.get(key) == "":
            row.pop(key)
    return _qa(row, path, where, source)


def _hotpot_like(row: dict[str, Any], path: PathLike, where: str, source: str) -> QAExample:
    hotpotqa_paragraphs(row, path, where)  # validates the context layout
    answer = _require(row, path, where, "answer")
    if not isinstance(answer, str):
        raise field_error(path, where, "answer", f"must be a string, got {type(answer).__name__}")
    golds = (_aliases(answer, path, where, "answer"),)
    return QAExample(_id(row, path, where, ("_id", "id")), _question(row, path, where), golds, source)


def hotpotqa_supporting_titles(row: dict[str, Any], path: PathLike, where: str) -> list[str]:
    """The distinct titles of a HotpotQA row's ``supporting_facts``, in order (HF layout
    ``{"title": [...], "sent_id": [...]}`` or official ``[[title, sent_id], ...]``).

    Raises:
      ValueError: ``"{path}:{where}: field 'supporting_facts…': ..."`` for a missing or
        malformed field.
    """
    facts = _require(row, path, where, "supporting_facts")
    if isinstance(facts, dict):
        titles = facts.get("title")
        if not isinstance(titles, list):
            raise field_error(path, where, "supporting_facts.title", "missing or not a list")
    elif isinstance(facts, list):
        titles = []
        for i, item in enumerate(facts):
            if not isinstance(item, (list, tuple)) or not item:
                raise field_error(path, where, f"supporting_facts[{i}]", "must be [title, sent_id]")
            titles.append(item[0])
    else:
        raise field_error(path, where, "supporting_facts", f"must be a dict or list, got {type(facts).__name__}")
    for i, title in enumerate(titles):
        if not isinstance(title, str):
            raise field_error(path, where, f"supporting_facts.title[{i}]", f"must be a string, got {title!r}")
    return list(dict.fromkeys(titles))


def _musique(row: dict[str, Any], path: PathLike, where: str, source: str) -> QAExample:
    answer = _require(row, path, where, "answer")
    if not isinstance(answer, str):
        raise field_error(path, where, "answer", f"must be a string, got {type(answer).__name__}")
    aliases = row.get("answer_aliases") or []
    if not isinstance(aliases, list):
        raise field_error(path, where, "answer_aliases", f"must be a list, got {type(aliases).__name__}")
    _require(row, path, where, "paragraphs")
    golds = (_aliases([answer, *aliases], path, where, "answer"),)
    return QAExample(_id(row, path, where, ("id",)), _question(row, path, where), golds, source)


_READERS: dict[str, Callable[[dict[str, Any], PathLike, str, str], QAExample]] = {
    "flashrag": _flashrag,
    "qa": _qa,
    "hotpotqa": _hotpot_like,
    "2wikimultihopqa": _hotpot_like,
    "musique": _musique,
}


def sniff_format(row: dict[str, Any]) -> str | None:
    """The format of one row by its keys (see module doc), or None when none fits."""
    if "paragraphs" in row and "answer" in row:
        return "musique"
    if "context" in row and "supporting_facts" in row:
        if "evidences" in row or row.get("type") in _TWOWIKI_TYPES:
            return "2wikimultihopqa"
        return "hotpotqa"
    if "golden_answers" in row or "reward_model" in row:
        return "flashrag"
    if "question" in row and "answer" in row:
        return "qa"
    return None


def _is_csv(path: PathLike) -> bool:
    return pathlib.Path(path).suffix.lower() == ".csv"


def default_source(path: PathLike) -> str:
    """Dataset name from a file name: ``bamboogle_125.r1searcher.jsonl`` → ``bamboogle_125.r1searcher``."""
    name = pathlib.Path(path).name
    for suffix in _DATA_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def detect_format(path: PathLike) -> str:
    """Sniff the format of a file from its first row (``sniff_format``).

    A ``*.csv`` file is ``"qa"`` when its header has ``question`` and ``answer`` columns (any case).

    Raises:
      ValueError: an empty file, a first row that fits no format (naming file and line, and the
        fields each format expects), a CSV without a ``question`` / ``answer`` column (naming the
        file and its columns) or with two columns of one name in different cases.
    """
    if _is_csv(path):
        columns = csv_columns(path)
        if not columns:
            raise ValueError(f"{path}: empty file, cannot detect the QA format; expected {FORMAT_FIELDS['csv']}")
        lower = [c.lower() for c in columns]
        for name in set(lower):
            if lower.count(name) > 1:
                raise ValueError(f"{path}:1: columns {[c for c in columns if c.lower() == name]} differ only in case")
        for need in ("question", "answer"):
            if need not in lower:
                raise ValueError(f"{path}: a QA CSV needs a {need!r} column (any case); the header has {columns}; "
                                 f"expected {FORMAT_FIELDS['csv']}")
        return "qa"
    first = first_record(path)
    if first is None:
        raise ValueError(f"{path}: empty file, cannot detect the QA format; expected rows of one of: "
                         f"{expected_formats()}")
    where, row = first
    fmt = sniff_format(row)
    if fmt is None:
        raise ValueError(f"{path}:{where}: cannot detect the QA format from fields {sorted(row)}; expected rows "
                         f"of one of: {expected_formats()}")
    return fmt


def iter_dataset(path: PathLike, format: str = "auto", source: str | None = None) -> Iterator[QAExample]:
    """Stream ``QAExample``s from a file (JSONL, JSON array, parquet or CSV; see ``records``).

    Args:
      path: the data file.
      format: one of ``FORMATS`` or ``"auto"`` (sniffed from the first row).
      source: dataset name for ``QAExample.source``; default ``default_source(path)``
        (a Search-R1 row's ``data_source`` wins in the flashrag format).

    Raises:
      ValueError: unknown format, or a malformed row: ``"{path}:{line}: field '{field}': ..."``.
    """
    for _, _, example in iter_dataset_rows(path, format, source):
        yield example


def iter_dataset_rows(path: PathLike, format: str = "auto",
                      source: str | None = None) -> Iterator[tuple[str, dict[str, Any], QAExample]]:
    """``(location, raw row, QAExample)`` for every row, for readers that need more of a row than
    the example keeps (e.g. the supporting facts of a HotpotQA row). Arguments and errors as
    ``iter_dataset``."""
    if format == "auto":
        format = detect_format(path)
    if format not in _READERS:
        raise ValueError(f"unknown QA format {format!r}; expected 'auto' or one of {FORMATS}")
    reader = _csv_qa if format == "qa" and _is_csv(path) else _READERS[format]
    src = default_source(path) if source is None else source
    for where, row in iter_records(path):
        yield where, row, reader(row, path, where, src)


def load_dataset(path: PathLike, format: str = "auto", source: str | None = None) -> list[QAExample]:
    """All examples of a file as a list; see ``iter_dataset`` for arguments and errors.

    Raises:
      ValueError: also on duplicate example ids (naming the file and the id).
    """
    examples = list(iter_dataset(path, format, source))
    seen: set[str] = set()
    for ex in examples:
        if ex.id in seen:
            raise ValueError(f"{path}: duplicate example id {ex.id!r}")
        seen.add(ex.id)
    return examples


class QADataSource(Sequence[QAExample]):
    """A grain random-access data source (``__len__``/``__getitem__``) over one QA file.

    Usable as ``grain.MapDataset.source(QADataSource(path))`` or with ``grain.DataLoader``.
    Records are parsed once, at construction.
    """

    def __init__(self, path: PathLike, format: str = "auto", source: str | None = None):
        self._examples = load_dataset(path, format, source)
        self.path = str(path)

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index):  # type: ignore[override]
        return self._examples[index]

    def __repr__(self) -> str:
        return f"QADataSource({self.path!r}, {len(self)} examples)"


def map_dataset(path_or_examples: PathLike | Sequence[QAExample], format: str = "auto") -> grain.MapDataset:
    """``grain.MapDataset.source`` over a QA file (via ``QADataSource``) or a list of examples.

    Example: ``map_dataset(path).shuffle(seed=0).batch(8)`` — grain MapDataset transformations.
    """
    if isinstance(path_or_examples, (str, pathlib.Path)):
        return grain.MapDataset.source(QADataSource(path_or_examples, format))
    return grain.MapDataset.source(list(path_or_examples))
