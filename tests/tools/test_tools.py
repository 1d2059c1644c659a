"""Local tools: corpus format, BM25 search on a real bm25s index, ToolEnvironment observations."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.text.protocol import parse_turn, render_turn
from mempo_jax.tools.bm25 import BM25Index, top_k
from mempo_jax.tools.corpus import Document, Hit, load_corpus, write_corpus_jsonl
from mempo_jax.tools.search import ToolError, ToolResult, format_hits, search_environment

DOCS = [
    Document("0", "Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."),
    Document("1", "Great Wall of China", "The Great Wall is a series of fortifications across northern China."),
    Document("2", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    Document("3", "Paris", "Paris is the capital and most populous city of France."),
    Document("4", "Amazon River", "The Amazon River in South America is the largest river by discharge."),
    Document("17", "Ada Lovelace", "Ada Lovelace was an English mathematician who wrote the first program."),
]


@pytest.fixture(scope="module")
def index():
    return BM25Index(DOCS)


# -- corpus ---------------------------------------------------------------------------------
def test_document_contents_round_trip():
    d = Document("7", "Title with \"quotes\"", "line one\nline two")
    assert d.contents == '"Title with "quotes""\nline one\nline two'
    assert Document.from_contents("7", d.contents) == d
    assert Document.from_contents("8", "no title line") == Document("8", "", "no title line")
    assert Document.from_contents("9", "Bare title\ntext") == Document("9", "Bare title", "text")
    with pytest.raises(ValueError):
        Document("1", "two\nlines", "x")
    with pytest.raises(ValueError):
        Document("", "t", "x")


def test_corpus_jsonl_round_trip(tmp_path):
    path = tmp_path / "sub" / "corpus.jsonl"
    write_corpus_jsonl(DOCS, path)
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert first == {"id": "0", "contents": '"Eiffel Tower"\n' + DOCS[0].text}
    assert load_corpus(path) == DOCS


@pytest.mark.parametrize(
    "rows, needle",
    [
        (['{"id": "1", "contents": "\\"A\\"\\nx"}', '{"contents": "\\"B\\"\\ny"}'], ":2: field 'id': missing"),
        (['{"id": "1"}'], ":1: field 'contents' or 'text': missing (the row has ['id']); a corpus row is {\"id\", \"contents\""),
        (['{"id": "1", "contents": 5}'], ":1: field 'contents': must be a string"),
        (['{"id": [1], "contents": "x"}'], ":1: field 'id'"),
        (['{"id": "1", "contents": "x"}', "", '{"id": "1", "contents": "y"}'], ":3: field 'id': duplicate"),
        (['{"id": "1", "contents": "x"}', "{not json"], ":2: invalid JSON"),
    ],
)
def test_corpus_errors_name_file_line_field(tmp_path, rows, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_corpus(path)
    assert str(err.value).startswith(str(path)) and needle in str(err.value), str(err.value)


def test_integer_ids_become_strings(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 3, "contents": "\\"T\\"\\nx"}\n', encoding="utf-8")
    assert load_corpus(path) == [Document("3", "T", "x")]


# -- BM25 -----------------------------------------------------------------------------------
def test_bm25_obvious_document_ranks_first(index):
    (everest,), (lovelace,), (amazon,) = [
        [hits[0]] for hits in index.search(["highest mountain Himalayas", "first program mathematician", "river discharge"], topk=3)
    ]
    assert everest.document.id == "2"
    assert lovelace.document.id == "17"
    assert amazon.document.id == "4"


def test_bm25_scores_descending_and_title_indexed(index):
    hits = index.search(["Paris France capital"], topk=6)[0]
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    assert hits[0].document.id == "3"  # title "Paris" + "capital" + "France"
    assert {h.document.id for h in hits} == {"0", "3"}  # only documents sharing a term
    # a title-only term still retrieves its document
    assert index.search(["Lovelace"], topk=1)[0][0].document.id == "17"


def test_bm25_topk_clamped_and_empty(index):
    hits = index.search(["the tower wall mountain city river program"], topk=100)[0]
    assert len(hits) == len(DOCS)
    assert index.search(["the of and"], topk=3) == [[]]  # stopwords only
    assert index.search(["zyxwvut"], topk=3) == [[]]  # unknown term
    assert index.search([], topk=3) == []
    with pytest.raises(ValueError):
        index.search(["x"], topk=0)
    with pytest.raises(ValueError):
        index.search("a single string", topk=1)
    with pytest.raises(ValueError):
        BM25Index([])
    with pytest.raises(ValueError):
        BM25Index([DOCS[0], DOCS[0]])


def test_bm25_get(index):
    assert index.get("17") == DOCS[5]
    assert index.get("99") is None
    assert len(index) == 6


def test_bm25_save_load_round_trip(index, tmp_path):
    index.save(tmp_path / "idx")
    files = sorted(p.name for p in (tmp_path / "idx").iterdir())
    assert "docs.jsonl" in files and not any(f.endswith((".pkl", ".pickle")) for f in files)
    loaded = BM25Index.load(tmp_path / "idx")
    queries = ["highest mountain", "Paris France", "first program", "Great Wall China fortifications"]
    assert loaded.search(queries, topk=4) == index.search(queries, topk=4)
    assert loaded.get("4") == DOCS[4]
    with pytest.raises(FileNotFoundError):
        BM25Index.load(tmp_path / "nowhere")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2, 4), min_size=1, max_size=40), st.integers(1, 45))
def test_top_k_matches_sorted_order(levels, k):
    """Tie-heavy scores (a few levels, zeros and negatives): the brute-force order, k-th place ties by index."""
    scores = np.asarray(levels, np.float32) * np.float32(0.75)
    want = [i for i in sorted(range(len(levels)), key=lambda i: (-levels[i], i)) if levels[i] > 0][:k]
    assert top_k(scores, k).tolist() == want


def test_bm25_ties_by_corpus_position_and_no_xla():
    """53 documents of 3 words from 6: many equal scores at the k-th place. Hits are bm25s' own scores
    ordered (score desc, position asc), and the search compiles no XLA program (bm25s' ``retrieve``
    would run its JAX top-k)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    docs = [Document(str(i), "t", " ".join(rng.choice(words, 3))) for i in range(53)]
    index = BM25Index(docs)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    queries = words + ["alpha beta", "gamma omega", "sigma delta beta", "alpha zzz"]
    tied_at_k = 0
    for k in (1, 2, 3, 5, 7):
        got = index.search(queries, k)
        for query, hits in zip(queries, got):
            scores = index._retriever.get_scores(query.split())
            order = [j for j in sorted(range(len(docs)), key=lambda j: (-float(scores[j]), j)) if scores[j] > 0]
            assert [(h.document.id, h.score) for h in hits] == [(str(j), float(scores[j])) for j in order[:k]]
            tied_at_k += len(order) > k and scores[order[k - 1]] == scores[order[k]]
    assert tied_at_k >= 20  # the corpus does exercise ties at the boundary
    assert compiles == []


# -- observations ---------------------------------------------------------------------------
def test_format_hits():
    hits = [Hit(DOCS[5], 3.2), Hit(Document("x", "", "multi\n line   text"), 1.0)]
    assert format_hits(hits) == (
        "[doc 17] Ada Lovelace: Ada Lovelace was an English mathematician who wrote the first program.\n"
        "[doc x] multi line text"
    )
    assert format_hits(hits, max_chars=10).splitlines()[0] == "[doc 17] Ada Lovelace: Ada Lovel…"
    assert format_hits([]) == "No results."


def _turn(action, arg):
    return parse_turn(render_turn("m", None, action, arg))


def test_execute_search_access_and_errors(index):
    env = search_environment(index, topk=2)
    res = env.execute(_turn("search", "highest mountain"))
    assert res.kind == "search" and res.ok
    assert res.observation.startswith("[doc 2] Mount Everest: Mount Everest is")
    assert len(res.observation.splitlines()) == 1  # only Everest shares a term
    res = env.execute(_turn("access", " 17 "))
    assert res == ToolResult('"Ada Lovelace"\n' + DOCS[5].text, "access", True)
    assert env.execute(_turn("access", "[doc 17]")).ok  # copied label is accepted
    res = env.execute(_turn("access", "/etc/passwd"))
    assert res.kind == "access" and not res.ok
    assert "No document with id '/etc/passwd'" in res.observation
    res = env.execute(parse_turn("<search>q</search>"))
    assert res.kind == "error" and not res.ok and "missing <mem>" in res.observation
    with pytest.raises(ValueError):
        env.execute(_turn("answer", "Paris"))
    closed = search_environment(index, topk=2, allow_access=False).execute(_turn("access", "17"))
    assert closed.kind == "error" and not closed.ok and "Ada" not in closed.observation
    assert closed.observation.startswith("Format error: unknown action <access>.")


class CountingBackend:
    """The real index, counting calls (not a mock: every answer comes from bm25s)."""

    def __init__(self, inner):
        self.inner, self.search_calls = inner, 0

    def search(self, queries, topk):
        self.search_calls += 1
        return self.inner.search(queries, topk)

    def get(self, doc_id):
        return self.inner.get(doc_id)


def test_execute_batch_equals_execute_and_batches(index):
    turns = [
        _turn("search", "highest mountain"),
        _turn("access", "3"),
        parse_turn("<mem>m</mem>oops"),
        _turn("search", "Paris capital"),
        _turn("access", "nope"),
        _turn("search", "the of"),
    ]
    backend = CountingBackend(index)
    env = search_environment(backend, topk=3)
    batch = env.execute_batch(turns)
    assert backend.search_calls == 1
    assert batch == [search_environment(index, topk=3).execute(t) for t in turns]
    assert [r.ok for r in batch] == [True, True, False, True, False, True]
    assert batch[5].observation == "No results."
    with pytest.raises(ValueError):
        env.execute_batch([turns[0], _turn("answer", "x")])
    assert env.execute_batch([]) == []


class FailingBackend:
    def search(self, queries, topk):
        raise ToolError("timeout", "http://10.0.0.1:8000/retrieve took too long")

    def get(self, doc_id):
        raise ToolError("unreachable", "/var/run/socket")


def test_backend_failure_becomes_observation():
    env = search_environment(FailingBackend(), topk=3)
    res = env.execute_batch([_turn("search", "a"), _turn("search", "b"), _turn("access", "1")])
    assert [(r.kind, r.ok) for r in res] == [("search", False), ("search", False), ("access", False)]
    assert "timeout" in res[0].observation and "unreachable" in res[2].observation
    assert not any("10.0.0.1" in r.observation or "/var/run" in r.observation for r in res)
