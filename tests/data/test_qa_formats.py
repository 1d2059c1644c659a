"""QA readers on the real shared data, malformed-row errors, multi-objective composition,
corpus pooling and BM25 recall of HotpotQA supporting paragraphs."""

from __future__ import annotations

import json

import pytest

from mempo_jax.data.multi_objective import compose, compose_question
from mempo_jax.data.qa_formats import QAExample, detect_format, load_dataset, map_dataset
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document, load_corpus, pool_hotpotqa_contexts, pool_musique_paragraphs

HOTPOT = "hotpotqa/hotpotqa_dev_distractor_300.rpt.jsonl"
MUSIQUE = "musique/musique_dev_10_with_paragraphs.hoprag.jsonl"

# (file, detected format, record count) — counts from the data folder's SOURCES.md
SHARED_FILES = [
    (HOTPOT, "hotpotqa", 300),
    ("hotpotqa/hotpotqa_dev_500_qa.r1searcher.jsonl", "qa", 500),
    ("bamboogle/bamboogle_125.r1searcher.jsonl", "qa", 125),
    (MUSIQUE, "musique", 10),
    ("musique/musique_dev_500_qa.r1searcher.jsonl", "qa", 500),
    ("2wikimultihopqa/2wiki_dev_500_qa.r1searcher.jsonl", "qa", 500),
    ("flashrag/nq_test_17.flashrag.jsonl", "flashrag", 17),
]


def _by_id(examples):
    return {ex.id: ex for ex in examples}


# -- the shared data -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, fmt, count", SHARED_FILES)
def test_every_shared_file_reads(shared_data, name, fmt, count):
    path = shared_data / name
    assert detect_format(path) == fmt
    examples = load_dataset(path)
    assert len(examples) == count
    assert len({ex.id for ex in examples}) == count
    assert all(ex.num_objectives == 1 and ex.question and ex.golds[0][0] for ex in examples)


def test_shared_values(shared_data):
    nq = load_dataset(shared_data / "flashrag/nq_test_17.flashrag.jsonl")
    assert nq[0] == QAExample(
        "test_0", "who got the first nobel prize in physics", (("Wilhelm Conrad Röntgen",),), "nq_test_17.flashrag"
    )
    assert nq[16].golds == (("Oak Island",),)
    bam = _by_id(load_dataset(shared_data / "bamboogle/bamboogle_125.r1searcher.jsonl", source="bamboogle"))
    assert bam["75"].golds == (("George VI",),)  # the source's trailing newline is stripped
    assert bam["1"].golds == (("james madison",),) and bam["1"].source == "bamboogle"
    hot = load_dataset(shared_data / HOTPOT)
    assert hot[0].id == "5a8ce55f554299441c6b9f62" and hot[0].golds == (("Tulsa",),)
    assert hot[0].question.startswith('The band who released the debut album "Tinted Windows"')
    mus = _by_id(load_dataset(shared_data / MUSIQUE))
    assert mus["2hop__91626_96912"].golds == (("University of Cambridge", "Cambridge"),)  # answer + aliases
    assert mus["2hop__104095_40502"].golds == (("2 million",),)
    two = load_dataset(shared_data / "2wikimultihopqa/2wiki_dev_500_qa.r1searcher.jsonl")
    assert two[0].golds == (("Tetisheri",),) and two[-1].id == "500"


def test_flashrag_corpus_sample(shared_data):
    docs = load_corpus(shared_data / "flashrag/corpus_sample.flashrag.jsonl")
    assert len(docs) == 1000 and docs[0].id == "0" and docs[-1].id == "999"
    assert docs[0].title == "Evan Morris" and docs[0].text.startswith("Evan Morris Evan L. Morris (January 26, 1977")


def test_pooling(shared_data):
    docs = pool_hotpotqa_contexts(shared_data / HOTPOT)
    assert len(docs) == 2967  # SOURCES.md: pooling the contexts gives 2,967 distinct paragraphs
    assert [d.id for d in docs[:3]] == ["0", "1", "2"]
    assert docs[0] == Document(
        "0",
        "Act of Congress (music group)",
        "Act of Congress is a Birmingham, Alabama based singer-songwriter group. They play only acoustic "
        "instruments in their music, giving them a sound that is unique, meshing several genres of music together. "
        'Their first performance of the debut album "Declaration" sold out at WorkPlay Theater in Birmingham in 2008.',
    )
    assert len({(d.title, d.text) for d in docs}) == 2967
    mus = pool_musique_paragraphs(shared_data / MUSIQUE)
    assert len(mus) == 200 and mus[0].title == "Inky Mark"


# Measured on the pooled corpus (2,967 paragraphs), question as the query, bm25s Lucene BM25 with
# English stopwords: recall@k = mean over the 300 questions of the fraction of their 2 gold
# supporting-fact titles among the top-k titles (recall@1 is at most 0.5).
MEASURED_RECALL = {1: 0.3933, 3: 0.6283, 5: 0.7050}


def test_bm25_recall_of_supporting_paragraphs(shared_data):
    path = shared_data / HOTPOT
    index = BM25Index(pool_hotpotqa_contexts(path))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    golds = [set(r["supporting_facts"]["title"]) for r in rows]
    hits = index.search([r["question"] for r in rows], topk=5)
    recall = {
        k: sum(len(g & {h.document.title for h in hs[:k]}) / len(g) for g, hs in zip(golds, hits)) / len(rows)
        for k in (1, 3, 5)
    }
    print("BM25 recall@1/3/5 on pooled HotpotQA:", {k: round(v, 4) for k, v in recall.items()})
    assert recall[1] <= recall[3] <= recall[5] <= 1.0
    for k, measured in MEASURED_RECALL.items():
        assert recall[k] >= 0.9 * measured, (k, recall[k])


# -- other layouts --------------------------------------------------------------------------------
def _official(row):
    """HF hotpot_qa row → the official HotpotQA layout (``_id``, list-of-[title, sentences])."""
    return {
        "_id": row["id"],
        "question": row["question"],
        "answer": row["answer"],
        "type": row["type"],
        "level": row["level"],
        "supporting_facts": [list(x) for x in zip(row["supporting_facts"]["title"], row["supporting_facts"]["sent_id"])],
        "context": [list(x) for x in zip(row["context"]["title"], row["context"]["sentences"])],
    }


def test_official_hotpotqa_json_array(shared_data, tmp_path):
    src = shared_data / HOTPOT
    rows = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines()[:20]]
    official = tmp_path / "hotpot_dev_distractor_v1.json"
    official.write_text(json.dumps([_official(r) for r in rows], indent=1), encoding="utf-8")
    assert detect_format(official) == "hotpotqa"
    got = load_dataset(official, source="x")
    want = [QAExample(e.id, e.question, e.golds, "x") for e in load_dataset(src)[:20]]
    assert got == want
    hf = tmp_path / "hf.jsonl"
    hf.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert pool_hotpotqa_contexts(official) == pool_hotpotqa_contexts(hf)


def test_2wiki_official_layout(tmp_path):
    row = {
        "_id": "8813f87c0bdd11eba7f7acde48001122",
        "type": "compositional",
        "question": "Who is the director of film X's father?",
        "context": [["Film X", ["Film X is a 1999 film.", "It was directed by Ann Lee."]], ["Ann Lee", ["Her father was Bo Lee."]]],
        "supporting_facts": [["Film X", 1], ["Ann Lee", 0]],
        "evidences": [["Film X", "director", "Ann Lee"], ["Ann Lee", "father", "Bo Lee"]],
        "answer": "Bo Lee",
    }
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([row]), encoding="utf-8")
    assert detect_format(path) == "2wikimultihopqa"
    assert load_dataset(path) == [QAExample(row["_id"], row["question"], (("Bo Lee",),), "dev")]
    assert [d.text for d in pool_hotpotqa_contexts(path)] == [
        "Film X is a 1999 film. It was directed by Ann Lee.",
        "Her father was Bo Lee.",
    ]


def test_search_r1_parquet_and_jsonl(tmp_path):
    rows = [
        {
            "id": "train_0",
            "question": "total number of death row inmates in the us?",
            "golden_answers": ["2,718"],
            "data_source": "nq",
            "prompt": [{"role": "user", "content": "Answer the given question. ..."}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["2,718"]}},
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "question": "who sings love will keep us alive?",
            "data_source": "hotpotqa",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Eagles", "the Eagles"]}},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    want = [
        QAExample("train_0", rows[0]["question"], (("2,718",),), "nq"),
        QAExample("2", rows[1]["question"], (("Eagles", "the Eagles"),), "hotpotqa"),  # no id: the line
    ]
    assert detect_format(jsonl) == "flashrag" and load_dataset(jsonl) == want
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    got = load_dataset(parquet)
    assert [(e.question, e.golds, e.source) for e in got] == [(e.question, e.golds, e.source) for e in want]
    assert got[0].id == "train_0" and got[1].id == "row 2"


def test_multi_objective_golden_answers_nested(tmp_path):
    path = tmp_path / "mo.jsonl"
    path.write_text(json.dumps({"id": "a", "question": "q1 q2", "golden_answers": [["x", "X"], ["y"]]}) + "\n")
    assert load_dataset(path)[0].golds == (("x", "X"), ("y",))


# -- malformed rows: file, line and field ------------------------------------------------------------
GOOD_QA = {"idx": 1, "question": "q?", "answer": "a"}
GOOD_FLASH = {"id": "1", "question": "q?", "golden_answers": ["a"]}
GOOD_HOTPOT = {"id": "h", "question": "q?", "answer": "a", "supporting_facts": {"title": ["T"], "sent_id": [0]},
               "context": {"title": ["T"], "sentences": [["s."]]}}
GOOD_MUSIQUE = {"id": "m", "question": "q?", "answer": "a", "answer_aliases": [],
                "paragraphs": [{"idx": 0, "title": "T", "paragraph_text": "p", "is_supporting": True}]}


@pytest.mark.parametrize(
    "good, bad, field",
    [
        (GOOD_QA, {"idx": 3, "answer": "a"}, "question"),
        (GOOD_QA, {"idx": 3, "question": "q?"}, "answer"),
        (GOOD_QA, {"idx": 3, "question": "q?", "answer": ["", " "]}, "answer"),
        (GOOD_QA, {"idx": 3, "question": "q?", "answer": {"x": 1}}, "answer"),
        (GOOD_QA, {"idx": [3], "question": "q?", "answer": "a"}, "idx"),
        (GOOD_FLASH, {"id": "3", "question": "q?", "golden_answers": [None]}, "golden_answers"),
        (GOOD_FLASH, {"id": "3", "question": "", "golden_answers": ["a"]}, "question"),
        (GOOD_FLASH, {"id": "3", "question": "q", "reward_model": {"ground_truth": {}}}, "golden_answers"),
        (GOOD_HOTPOT, {**GOOD_HOTPOT, "id": "h3", "context": {"title": ["T"], "sentences": []}}, "context"),
        (GOOD_HOTPOT, {**GOOD_HOTPOT, "id": "h3", "answer": None}, "answer"),
        (GOOD_MUSIQUE, {**GOOD_MUSIQUE, "id": "m3", "answer_aliases": "b"}, "answer_aliases"),
        (GOOD_MUSIQUE, {**GOOD_MUSIQUE, "id": "m3", "answer": 5}, "answer"),
    ],
)
def test_malformed_row_names_file_line_field(tmp_path, good, bad, field):
    path = tmp_path / "data.jsonl"
    other = {**good, "id": "second"} if "id" in good else {**good, "idx": 2}
    path.write_text(json.dumps(good) + "\n" + json.dumps(other) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_dataset(path)
    assert str(err.value).startswith(f"{path}:4: field {field!r}"), str(err.value)


def test_pooling_errors_name_file_line_field(tmp_path):
    path = tmp_path / "m.jsonl"
    bad = {**GOOD_MUSIQUE, "paragraphs": [{"idx": 0, "title": "T"}]}
    path.write_text(json.dumps(GOOD_MUSIQUE) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: field 'paragraphs\[0\]\.paragraph_text'"):
        pool_musique_paragraphs(path)
    path = tmp_path / "h.json"
    path.write_text(json.dumps([GOOD_HOTPOT, {**GOOD_HOTPOT, "context": [["T", "not a list"]]}]))
    with pytest.raises(ValueError, match=r"h\.json:record 2: field 'context\.sentences\[0\]'"):
        pool_hotpotqa_contexts(path)


def test_format_detection_and_errors(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:1: cannot detect"):
        load_dataset(path)
    with pytest.raises(ValueError, match="unknown QA format"):
        load_dataset(path, format="squad")
    path.write_text('{"question": "q", "answer": "a"}\n{"question": "q", "answer": "a"\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: invalid JSON"):
        load_dataset(path)
    path.write_text('{"id": "1", "question": "q", "answer": "a"}\n{"id": "1", "question": "r", "answer": "b"}\n')
    with pytest.raises(ValueError, match="duplicate example id '1'"):
        load_dataset(path)


# -- grain and multi-objective -------------------------------------------------------------------------
def test_grain_map_dataset(shared_data):
    ds = map_dataset(shared_data / "bamboogle/bamboogle_125.r1searcher.jsonl")
    assert len(ds) == 125 and ds[74].golds == (("George VI",),)
    a = [ex.id for ex in ds.shuffle(seed=3)]
    assert a == [ex.id for ex in ds.shuffle(seed=3)] and sorted(a, key=int) == [str(i) for i in range(1, 126)]
    batches = list(ds.batch(50, batch_fn=list))
    assert [len(b) for b in batches] == [50, 50, 25]


def _pool(n):
    return [QAExample(str(i), f"question {i}?", ((f"answer {i}",),), "toy") for i in range(n)]


def test_compose_multi_objective():
    pool = _pool(10)
    got = compose(pool, k=3, seed=0)
    assert len(got) == 3 and got == compose(pool, k=3, seed=0)
    assert got != compose(pool, k=3, seed=1)
    used = [pid for ex in got for pid in ex.id.split("+")]
    assert len(used) == 9 == len(set(used))
    for ex in got:
        ids = ex.id.split("+")
        assert ex.source == "toy:mo3" and ex.num_objectives == 3
        assert ex.question == "\n".join(f"Question {j}: question {i}?" for j, i in enumerate(ids, 1))
        assert ex.golds == tuple((f"answer {i}",) for i in ids)  # answer j belongs to question j
    many = compose(pool, k=4, seed=7, num=25)
    assert len(many) == 25 and all(len(set(ex.id.split("+"))) == 4 for ex in many)
    assert compose(pool, k=1, seed=0)[0].golds[0][0].startswith("answer ")
    mixed = compose(pool[:2] + [QAExample("z", "q?", (("a",),), "other")], k=3, seed=0)
    assert mixed[0].source == "mixed:mo3"
    assert compose_question(["a\n b", "c"]) == "Question 1: a b\nQuestion 2: c"
    for bad in (0, 11):
        with pytest.raises(ValueError):
            compose(pool, k=bad, seed=0)


def test_compose_on_real_data(shared_data):
    nq = load_dataset(shared_data / "flashrag/nq_test_17.flashrag.jsonl", source="nq")
    got = compose(nq, k=5, seed=42)
    assert len(got) == 3 and {ex.source for ex in got} == {"nq:mo5"}
    by_id = _by_id(nq)
    for ex in got:
        parts = [by_id[i] for i in ex.id.split("+")]
        assert ex.golds == tuple(p.golds[0] for p in parts)
        assert ex.question.splitlines()[2] == f"Question 3: {parts[2].question}"
