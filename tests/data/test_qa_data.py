"""QA files as training data: CSV QA files, the scripted plans of
``data.qa_questions``, the train / held-out split, and the search backend of a training run
(``tools.backends.training_backend``) on the shared files; no model is built here."""

from __future__ import annotations

import json

import pytest

from mempo_jax.config import ExperimentConfig
from mempo_jax.data.qa_formats import detect_format, load_dataset
from mempo_jax.data.qa_questions import load_qa_questions, split_questions
from mempo_jax.run.backends import merge_passages, training_backend
from mempo_jax.tools.corpus import Document, load_corpus, pool_hotpotqa_contexts, write_corpus_jsonl

HOTPOT = "hotpotqa/hotpotqa_dev_distractor_300.rpt.jsonl"
MUSIQUE = "musique/musique_dev_10_with_paragraphs.hoprag.jsonl"
NQ = "flashrag/nq_test_17.flashrag.jsonl"
CORPUS = "flashrag/corpus_sample.flashrag.jsonl"
BAMBOOGLE = "bamboogle/bamboogle_125.r1searcher.jsonl"


# -- CSV ----------------------------------------------------------------------------------------
def test_csv_qa_file(tmp_path):
    path = tmp_path / "my_qa.csv"
    path.write_text('\ufeffid,question,answer\n'  # the BOM a spreadsheet writes
                    'q1,"Who wrote ""Hamlet""?",Shakespeare\n'
                    '\n'
                    ',"Capital of\nFrance?","[""Paris"", ""paris, france""]"\n', encoding="utf-8")
    assert detect_format(path) == "qa"
    a, b = load_dataset(path)
    assert (a.id, a.question, a.golds, a.source) == ("q1", 'Who wrote "Hamlet"?', (("Shakespeare",),), "my_qa")
    # no id: the row's location (the line where the quoted, two-line row ends)
    assert (b.id, b.question, b.golds) == ("5", "Capital of\nFrance?", (("Paris", "paris, france"),))
    q = load_qa_questions(path)[1]
    assert q.hops == (("Capital of\nFrance?", ("(1) Paris",)),) and q.kind == "qa"


@pytest.mark.parametrize("header, message", [
    ("query,answer", "a QA CSV needs a 'question' column (any case); the header has ['query', 'answer']"),
    ("question,gold", "a QA CSV needs a 'answer' column"),
])
def test_csv_without_question_or_answer_column_is_one_error(tmp_path, header, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"{header}\nwho,me\n")
    with pytest.raises(ValueError) as e:
        load_dataset(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_csv_row_with_wrong_number_of_values_names_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("question,answer\nwho,me\nwhat,this,that\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: 3 values for the 2 columns"):
        load_dataset(path)


# -- scripted plans -------------------------------------------------------------------------------
def test_plans_of_the_shared_files(shared_data):
    raw = json.loads((shared_data / HOTPOT).open().readline())
    hotpot = load_qa_questions(shared_data / HOTPOT)
    assert len(hotpot) == 300 and hotpot[0].id == raw["id"] and hotpot[0].kind == "hotpotqa"
    titles = list(dict.fromkeys(raw["supporting_facts"]["title"]))  # 'Tinted Windows (album)', '(band)'
    assert [h[0] for h in hotpot[0].hops] == titles
    # each hop keeps its title's supporting sentence (the bridge fact), read from the raw context
    context = dict(zip(raw["context"]["title"], raw["context"]["sentences"]))
    sent = {t: " ".join(context[t][i].split()) for t, i in zip(raw["supporting_facts"]["title"],
                                                              raw["supporting_facts"]["sent_id"])}
    assert [h[1][0] for h in hotpot[0].hops] == [sent[t] for t in titles]
    assert hotpot[0].hops[-1][1] == (sent[titles[-1]], f"(1) {raw['answer']}")
    assert "Tinted Windows" in hotpot[0].hops[0][1][0]
    # MuSiQue: one search per decomposition step for its supporting paragraph's title, keeping its answer
    musique = load_qa_questions(shared_data / MUSIQUE)[0]
    assert musique.hops == (("Ken Epp", ("Conservative Party of Canada",)),
                            ("2017 Conservative Party of Canada leadership election", ("(1) Andrew Scheer",)))
    nq = load_qa_questions(shared_data / NQ)[2]  # test_2: two gold aliases
    assert nq.golds == (("Olivia", "MFSK"),)
    assert nq.hops == (("which mode is used for short wave broadcast service", ("(1) Olivia",)),)


def test_split_questions(shared_data):
    qs = load_qa_questions(shared_data / NQ)
    train, held, dropped = split_questions(qs, None, seed=0)
    assert (len(train), len(held), dropped) == (14, 3, 0) and not {q.id for q in train} & {q.id for q in held}
    assert split_questions(qs, None, seed=0) == (train, held, 0)  # seeded
    assert split_questions(qs, None, seed=1)[1] != held
    # a held-out file that shares questions with the training file: those leave the training set
    bamboogle = load_qa_questions(shared_data / BAMBOOGLE)[:5]
    echo = [q.__class__(f"x{i}", q.kind, "  " + q.question.upper() + " ", q.golds, q.hops)
            for i, q in enumerate(qs[:3])]
    train, held, dropped = split_questions(qs, bamboogle + echo, seed=0)
    assert dropped == 3 and [q.id for q in train] == [q.id for q in qs[3:]] and len(held) == 8


# -- search backends of a training run ------------------------------------------------------------
def test_pooled_contexts_are_the_legacy_hotpotqa_corpus(shared_data):
    backend, docs, note = training_backend([shared_data / HOTPOT, shared_data / HOTPOT])
    assert docs == pool_hotpotqa_contexts(shared_data / HOTPOT) and len(backend) == 2967
    assert note == "pooled from hotpotqa_dev_distractor_300.rpt.jsonl (2967 passages)"
    # two files: their union, renumbered; the passage-less NQ file adds nothing
    backend, docs, note = training_backend([shared_data / NQ, shared_data / HOTPOT, shared_data / MUSIQUE])
    assert 2967 < len(docs) <= 2967 + 200 and [d.id for d in docs] == [str(i) for i in range(len(docs))]


def test_corpus_keeps_its_ids_and_pool_contexts_appends(shared_data, tmp_path):
    corpus = load_corpus(shared_data / CORPUS)
    backend, docs, note = training_backend([shared_data / HOTPOT], shared_data / CORPUS)
    assert docs == corpus and note == f"corpus {shared_data / CORPUS} (1000 passages)"
    # pool_contexts: the HotpotQA paragraphs follow as ctx0, ctx1, …; one already in the corpus is not repeated
    pooled = pool_hotpotqa_contexts(shared_data / HOTPOT)
    small = tmp_path / "corpus.jsonl"
    write_corpus_jsonl(corpus[:5] + [Document("p7", pooled[7].title, pooled[7].text)], small)
    _, docs, note = training_backend([shared_data / HOTPOT], small, pool_contexts=True)
    assert [d.id for d in docs[:6]] == ["0", "1", "2", "3", "4", "p7"] and len(docs) == 6 + 2966
    assert docs[6] == Document("ctx0", pooled[0].title, pooled[0].text)
    assert pooled[7].text not in {d.text for d in docs[7:]}
    assert note.endswith("+ 2966 pooled from hotpotqa_dev_distractor_300.rpt.jsonl")
    assert len(backend) == 1000


def test_backend_errors_name_the_fields(shared_data, tmp_path):
    with pytest.raises(ValueError, match=r"nq_test_17.flashrag.jsonl: carries no passages; set "
                                         r"ExperimentConfig.corpus_path .* or ExperimentConfig.retriever_url"):
        training_backend([shared_data / NQ])
    with pytest.raises(FileNotFoundError, match="ExperimentConfig.corpus_path: no such file"):
        training_backend([shared_data / NQ], tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match=r"^ExperimentConfig.retriever_url http://127.0.0.1:9: the retrieval "
                                         r"server does not answer POST /retrieve \(unreachable\)$"):
        training_backend([shared_data / NQ], retriever_url="http://127.0.0.1:9")
    assert merge_passages([[Document("a", "t", "x")], [Document("b", "t", "x")]], id_prefix="c") == \
        [Document("c0", "t", "x")]


@pytest.mark.parametrize("fields, message", [
    (dict(train_path="x.jsonl"), "ExperimentConfig.train_path is set but dataset is 'tiny_world'"),
    (dict(dataset="qa"), "ExperimentConfig.train_path (or data_path) is required"),
    (dict(dataset="qa", train_path="a", data_path="b"), "name different files"),
    (dict(dataset="qa", train_path="a", corpus_path="c", retriever_url="u"), "are exclusive"),
    (dict(dataset="qa", train_path="a", retriever_url="u", pool_contexts=True), "pool_contexts cannot add"),
    (dict(dataset="wiki"), "must be one of ('tiny_world', 'hotpotqa', 'qa')"),
])
def test_config_checks(fields, message):
    with pytest.raises(ValueError) as e:
        ExperimentConfig(**fields)
    assert message in str(e.value)
    assert ExperimentConfig(dataset="hotpotqa", data_path="h.jsonl").qa_train_path == "h.jsonl"
