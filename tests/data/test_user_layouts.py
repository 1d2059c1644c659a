"""Users' data unchanged: the common corpus and QA layouts are read as they are, and every refusal
names the file, the line and what was expected (small files written in tmp_path)."""

from __future__ import annotations

import json

import pytest

from mempo_jax.data.qa_formats import FORMAT_FIELDS, detect_format, load_dataset
from mempo_jax.tools.corpus import Document, load_corpus


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_wikipedia_passage_rows(tmp_path):
    path = _jsonl(tmp_path / "psgs.jsonl", [{"id": "w1", "title": "Paris", "text": "Capital of France."},
                                            {"id": 2, "title": "Lyon\n city", "text": "A city."}])
    assert load_corpus(path) == [Document("w1", "Paris", "Capital of France."), Document("2", "Lyon city", "A city.")]


def test_beir_rows_with_underscore_id(tmp_path):
    path = _jsonl(tmp_path / "corpus.jsonl", [{"_id": "d7", "title": "", "text": "No title."}])
    assert load_corpus(path) == [Document("d7", "", "No title.")]


def test_hipporag_json_array_gets_row_numbers_as_ids(tmp_path):
    path = tmp_path / "musique_corpus.json"
    path.write_text(json.dumps([{"title": "A", "text": "first"}, {"title": "B", "text": "second", "idx": 9}]),
                    encoding="utf-8")
    docs = load_corpus(path)
    assert docs == [Document("0", "A", "first"), Document("1", "B", "second")]
    assert docs[0].contents == '"A"\nfirst'


def test_search_r1_rows_still_read(tmp_path):
    path = _jsonl(tmp_path / "wiki.jsonl", [{"id": "0", "contents": '"Eiffel Tower"\nA tower.'}])
    assert load_corpus(path) == [Document("0", "Eiffel Tower", "A tower.")]


@pytest.mark.parametrize("rows, needle", [
    ([{"id": "1", "body": "x"}], ":1: field 'contents' or 'text': missing (the row has ['body', 'id']); a corpus row is "),
    ([{"title": "A", "text": 5}], ":1: field 'text': must be a string, got int"),
    ([{"id": "1", "title": ["A"], "text": "x"}], ":1: field 'title': must be a string, got list"),
    ([{"title": "A", "text": "x"}, {"id": "0", "title": "B", "text": "y"}], ":2: field 'id': duplicate id '0' (first at 1)"),
    ([{"contents": "x"}], ":1: field 'id': missing (a {\"id\", \"contents\"} row needs its id)"),
])
def test_corpus_refusals_name_line_and_expectation(tmp_path, rows, needle):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_corpus(path)
    assert str(err.value).startswith(f"{path}:") and needle in str(err.value), str(err.value)


def test_an_unknown_corpus_row_lists_every_layout(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"passage": "x"}]), encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_corpus(path)
    message = str(err.value)
    assert message.startswith(f"{path}:record 1: ")
    for layout in ('{"id", "contents"', '{"id", "title", "text"}', '{"title", "text"} without ids (a HippoRAG'):
        assert layout in message, message


def test_empty_corpus_names_the_layouts(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty corpus \(no rows\); a corpus row is \{\"id\", \"contents\""):
        load_corpus(path)


@pytest.mark.parametrize("header", ["Question,Answer", "QUESTION,answer,ID", "question,Answer"])
def test_csv_headers_in_any_case(tmp_path, header):
    path = tmp_path / "qa.csv"
    row = "Who wrote Hamlet?,Shakespeare" + (",q1" if "ID" in header else "")
    path.write_text(f"{header}\n{row}\n", encoding="utf-8")
    assert detect_format(path) == "qa"
    (ex,) = load_dataset(path)
    assert (ex.question, ex.golds) == ("Who wrote Hamlet?", (("Shakespeare",),))
    assert ex.id == ("q1" if "ID" in header else "2")


def test_csv_refusals_say_what_was_expected(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("Query,Answer\nx,y\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        detect_format(path)
    assert str(err.value) == (f"{path}: a QA CSV needs a 'question' column (any case); the header has "
                              f"['Query', 'Answer']; expected {FORMAT_FIELDS['csv']}")
    path.write_text("question,Question,answer\nx,y,z\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r":1: columns \['question', 'Question'\] differ only in case"):
        detect_format(path)


def test_undetectable_qa_file_lists_each_format_and_its_fields(tmp_path):
    path = _jsonl(tmp_path / "odd.jsonl", [{"prompt": "x", "label": "y"}])
    with pytest.raises(ValueError) as err:
        detect_format(path)
    message = str(err.value)
    assert message.startswith(f"{path}:1: cannot detect the QA format from fields ['label', 'prompt']; expected rows of one of: ")
    for name, fields in FORMAT_FIELDS.items():
        assert f"{name}: {fields}" in message
