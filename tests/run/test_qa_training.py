"""RL on any QA set, on the shared FlashRAG / Bamboogle / HotpotQA files.

* ``python -m mempo_jax.commands.train`` on a FlashRAG QA file with a corpus JSONL (a tiny model trained
  from scratch) and, from a Hugging Face checkpoint with ``SFTConfig.steps = 0``, against a real
  ``mempo_jax.commands.retrieval_server`` process on loopback: the retrieved passages in
  ``rollouts.jsonl`` are the server's, the frozen reference is the checkpoint (KL 0 before the first
  update), and ``RUN_DIR/hf_export`` holds the RL policy that transformers loads and decodes
  greedily token for token as our sampler does.
* ``python -m mempo_jax.commands.evaluate --hf_checkpoint`` on that export gives the ``eval.json`` of
  ``--run_dir`` on the run folder (whose tokenizer is now ``hf_tokenizer/``).
* Bad input: a retriever that does not answer, a CSV without a ``question`` column: one line
  naming the URL / file, exit 2, the run folder untouched.

The checkpoint is a tiny Qwen2 with spare embedding rows for the protocol tags, shaped into a
near-bigram "scripted" policy (as ``test_hf_train``): every turn writes
``<mem> a</mem><think> b</think><search> c</search>`` with ``c`` a word of the corpus, so every
turn calls the search tool.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mempo_jax.commands import evaluate as ev  # noqa: E402
from mempo_jax.commands import train  # noqa: E402
from mempo_jax.text.protocol import render_turn  # noqa: E402
from mempo_jax.agent.format import AgentFormat  # noqa: E402
from mempo_jax.run.checkpoint import read_checkpoint  # noqa: E402
from mempo_jax.data.qa_questions import load_qa_questions  # noqa: E402
from mempo_jax.run.experiment import _tokenizer_texts  # noqa: E402
from mempo_jax.text.hf_tokenizer import HFTokenizer  # noqa: E402
from mempo_jax.model.config import ModelConfig  # noqa: E402
from mempo_jax.model.forward import create_model, split_model  # noqa: E402
from mempo_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402
from mempo_jax.tools.bm25 import BM25Index  # noqa: E402
from mempo_jax.tools.corpus import load_corpus  # noqa: E402
from mempo_jax.tools.search import format_hits  # noqa: E402
from conftest import SPM_CACHE, free_port, retrieval_server  # noqa: E402  (the session's tokenizer cache, loopback server)
from test_hf_train import _bpe  # noqa: E402  (the Qwen2.5-layout byte-level BPE of a test checkpoint)

REPO = pathlib.Path(__file__).resolve().parents[2]
NQ = "flashrag/nq_test_17.flashrag.jsonl"
CORPUS = "flashrag/corpus_sample.flashrag.jsonl"
BAMBOOGLE = "bamboogle/bamboogle_125.r1searcher.jsonl"
VOCAB, SPARE, D_MODEL = 480, 16, 64
TINY_SCRATCH = ('ModelOptions.overrides=(("num_layers", 1), ("embed_dim", 32), ("num_heads", 2), '
                '("num_kv_heads", 1), ("head_dim", 16), ("mlp_dim", 64))')
SMALL_RUN = ["RLConfig.steps=1", "RLConfig.questions_per_step=2", "RLConfig.group_size=2",
             "RolloutConfig.max_turns=2", "RolloutConfig.max_new_tokens=12", "RolloutConfig.max_context_tokens=256",
             "RolloutConfig.max_observation_tokens=16", "RolloutConfig.min_rows_bucket=4",
             "EvalConfig.num_questions=2", "EvalConfig.context_modes=(1,)", "EvalConfig.bootstrap_samples=20",
             "ExperimentConfig.topk=1"]


@pytest.fixture(scope="module")
def data():
    from conftest import require_shared_data  # the module-scoped twin of the ``shared_data`` fixture

    path = require_shared_data()
    return path


# ------------------------------------------------------------------------------ the checkpoint


@pytest.fixture(scope="module")
def scripted_checkpoint(data, tmp_path_factory):
    """A Qwen2 HF folder (``save_hf_checkpoint`` + ``tokenizer.json``) whose greedy turn is
    ``<mem> a</mem><think> b</think><search> c</search>``; returns ``(folder, chain ids, c)``."""
    folder = tmp_path_factory.mktemp("qwen_qa")
    docs = load_corpus(data / CORPUS)
    questions = load_qa_questions(data / NQ) + load_qa_questions(data / BAMBOOGLE)[:4]
    _bpe(folder, _tokenizer_texts(docs[:300], questions))
    tok = HFTokenizer(folder).with_protocol_tags(VOCAB + SPARE)  # the ids load_checkpoint_policy assigns
    index = BM25Index(docs)
    vocab = sorted((i, t) for t, i in tok._tok.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha()
                   and len(t) > 3)
    words = [" " + t[1:] for _, t in vocab if len(tok.encode(" " + t[1:])) == 1]
    query = next(w for w in words if index.search([w.strip()], 1)[0])  # a word some passage contains
    mem_word, think_word = [w for w in words if w != query][:2]
    chain = tok.encode(render_turn(mem_word, think_word, "search", query))
    assert len(chain) == 9 and len(set(chain)) == 9, tok.decode(chain)
    nl, info_close = tok.encode("\n")[-1], tok.piece_id("</information>")
    assert {AgentFormat.plain(tok).prompt_ids(q.question)[-1] for q in questions} == {nl}
    transitions = [(nl, chain[0]), (info_close, chain[0])] + list(zip(chain[:-1], chain[1:]))

    cfg = ModelConfig.tiny(VOCAB + SPARE, embed_dim=D_MODEL, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           mlp_dim=128, qkv_bias=True, tie_embeddings=False)
    _, params = split_model(create_model(cfg, seed=0))
    layers = params["layers"]  # every layer's weights, stacked
    for var in (layers["attn"]["o"], layers["mlp"]["down"]):  # small layer outputs: the residual stream ≈ the token's embedding
        var.set_value(var.get_value() * 0.1)
    emb = np.asarray(params["embed"].get_value())
    head = np.zeros((D_MODEL, cfg.vocab_size), np.float32)
    for src, dst in transitions:  # logit(dst | src) ≈ 12 after the final RMS norm; every other ≈ 0
        head[:, dst] += 12.0 / math.sqrt(D_MODEL) * emb[src] / np.linalg.norm(emb[src])
    params["lm_head"].set_value(jnp.asarray(head))
    save_hf_checkpoint(folder, cfg, params, extra_config={"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
                                                          "bos_token_id": None})
    return folder, chain, query


@pytest.fixture(scope="module")
def retriever(data, tmp_path_factory):
    """``python -m mempo_jax.commands.retrieval_server`` over the FlashRAG corpus sample on a free
    loopback port; yields its URL."""
    with retrieval_server(data / CORPUS, tmp_path_factory.mktemp("server") / "index", 1000) as url:
        yield url


def _train_in_process(run_dir, params) -> int:
    argv = ["--run_dir", str(run_dir), "--gin_file", str(REPO / "configs" / "tiny_world.gin"),
            "--cache_dir", str(SPM_CACHE)]
    for p in params:
        argv += ["--gin_param", p]
    return train.main(argv)


@pytest.fixture(scope="module")
def checkpoint_run(data, scripted_checkpoint, retriever, tmp_path_factory):
    """RL straight from the checkpoint (``SFTConfig.steps = 0``) on NQ, held-out Bamboogle,
    search through the retriever; one mini-batch so the first update sees the reference."""
    folder, _, _ = scripted_checkpoint
    tmp = tmp_path_factory.mktemp("ckpt_run")
    run = tmp / "run"
    rc = _train_in_process(run, [
        'ExperimentConfig.dataset="qa"', f'ExperimentConfig.train_path="{data / NQ}"',
        f'ExperimentConfig.eval_path="{data / BAMBOOGLE}"', f'ExperimentConfig.retriever_url="{retriever}"',
        f'ModelOptions.checkpoint="{folder}"', 'ModelOptions.tags="tokens"', "ModelOptions.overrides=()",
        "SFTConfig.steps=0",
        "RLConfig.num_mini_batches=1", "RolloutConfig.temperature=1.0", "rl/OptimConfig.learning_rate=1e-3",
        *SMALL_RUN])
    assert rc == 0
    return run


# ------------------------------------------------------------------------------------ tests


@pytest.mark.slow
def test_train_on_flashrag_file_with_corpus_jsonl(data, tmp_path, capsys):
    """The user's command on a FlashRAG QA file + corpus JSONL (tiny model from scratch, SFT on the
    scripted plan "search the question, answer"): every stage runs; the search backend is the corpus.
    (``train.main`` in-process: no signal or second process needed.)"""
    run = tmp_path / "run"
    rc = _train_in_process(run, [
        'ExperimentConfig.dataset="qa"', f'ExperimentConfig.train_path="{data / NQ}"',
        f'ExperimentConfig.corpus_path="{data / CORPUS}"', "ExperimentConfig.vocab_size=600", TINY_SCRATCH,
        "SFTConfig.steps=2", "SFTConfig.batch_rows=4", *SMALL_RUN])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    # 17 NQ questions, 20 % (3) held out; 1,000 passages in the corpus sample (SOURCES.md)
    assert f"qa: 14 train / 3 held-out questions, search corpus {data / CORPUS} (1000 passages)" in out.out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dataset"] == "qa" and summary["heldout_questions"] == 2 and summary["hf_export"] is None
    assert set(summary["eval"]["rl"]["k1"]) >= {"em", "f1", "tt", "pt", "turns", "format_fail"}
    rl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"stage": "rl"' in line]
    assert len(rl) == 1 and np.isfinite(rl[0]["actor/pg_loss"])
    assert (run / "tokenizer.model").is_file() and not (run / "hf_tokenizer").exists()


@pytest.mark.slow
def test_checkpoint_run_searches_the_retriever(checkpoint_run, scripted_checkpoint, data):
    """Every turn searches ``c``; the observations in rollouts.jsonl are the server's top-1 hit,
    i.e. what BM25 over the same corpus returns (cut to max_observation_tokens = 16 ids)."""
    folder, chain, query = scripted_checkpoint
    tok = HFTokenizer(checkpoint_run / "hf_tokenizer")
    expected = format_hits(BM25Index(load_corpus(data / CORPUS)).search([query.strip()], 1)[0])
    want = tok.decode(tok.encode("<information>") + tok.encode(expected)[:16] + tok.encode("</information>"))
    records = [json.loads(line) for line in (checkpoint_run / "rollouts.jsonl").read_text().splitlines()]
    turns = [t for r in records for t in r["turns"]]
    assert turns and expected.startswith("[doc ")
    scripted = [t for t in turns if t["text"] == tok.decode(chain)]
    assert len(scripted) >= len(turns) // 2  # temperature 1 with logit gaps of 12: almost every turn
    assert {t["information"] for t in scripted} == {want}


@pytest.mark.slow
def test_sft_steps_0_makes_the_checkpoint_the_reference(checkpoint_run, scripted_checkpoint):
    folder, _, _ = scripted_checkpoint
    step, stored = read_checkpoint(checkpoint_run / "sft_checkpoint")
    assert step == 0
    _, _, original = load_hf_checkpoint(folder)
    got, want = jax.tree.leaves(stored["params"]), [np.asarray(x) for x in jax.tree.leaves(original)]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), b)
    # One mini-batch: the only update is taken at the reference itself, so its KL is 0 (a reference
    # other than the initial policy would give KL > 0); the update then moves the policy.
    rl = [json.loads(line) for line in (checkpoint_run / "metrics.jsonl").read_text().splitlines()
          if '"stage": "rl"' in line]
    assert len(rl) == 1 and abs(rl[0]["actor/kl_loss"]) < 1e-6 and rl[0]["actor/grad_norm"] > 0
    summary = json.loads((checkpoint_run / "summary.json").read_text())
    assert summary["eval"]["sft"]["k1"]["n"] == 2  # the zero-shot evaluation of the checkpoint


@pytest.mark.slow
def test_export_after_rl_loads_in_transformers_and_decodes_as_ours(checkpoint_run, tmp_path):
    export = checkpoint_run / "hf_export"
    assert json.loads((checkpoint_run / "summary.json").read_text())["hf_export"] == str(export)
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    # the export is the final RL checkpoint's policy, bit for bit
    step, stored = read_checkpoint(checkpoint_run / "checkpoints")
    assert step == 1
    cfg, graphdef, params = load_hf_checkpoint(export)
    for a, b in zip(jax.tree.leaves(stored["params"]), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tok = HFTokenizer(checkpoint_run / "hf_tokenizer")
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    texts = ["Search, remember in mem, answer.\nQuestion: who wrote hamlet?\n", "<mem> none</mem><think>",
             "<information>[doc 3] Evan Morris: a lobbyist</information>"]
    rows = [hf_tok(t, add_special_tokens=False).input_ids for t in texts]
    assert rows == [tok.encode(t) for t in texts]  # the tags are single tokens for transformers too
    width, n = max(map(len, rows)), 10
    ids, mask = np.full((3, width), tok.pad_id, np.int64), np.zeros((3, width), np.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_id)
    ours = RolloutEngine(graphdef, cfg, stop_ids=[], pad_id=tok.pad_id)(
        params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), jax.random.key(0),
        max_new_tokens=n, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours.tokens), ref.numpy()[:, width:])


@pytest.mark.slow
def test_evaluate_hf_checkpoint_equals_the_run_folder(checkpoint_run, retriever, data, tmp_path):
    """The same policy two ways (the run folder with its hf_tokenizer/, and its HF export) on the
    same data, no option given: the export carries the run's tags (tokens), top-k and budgets
    (``mempo_protocol.json``), so both evaluate alike: the same eval.json."""
    common = ["--dataset", f"bamboogle={data / BAMBOOGLE}", "--dataset", f"nq={data / NQ}",
              "--corpus", str(data / CORPUS), "--limit", "2"]
    assert ev.main(["--run_dir", str(checkpoint_run), *common, "--out", str(tmp_path / "run")]) == 0
    assert ev.main(["--hf_checkpoint", str(checkpoint_run / "hf_export"), *common,
                    "--out", str(tmp_path / "hf")]) == 0
    a, b = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("run", "hf"))
    assert a == b and set(a) == {"bamboogle", "nq"} and set(a["nq"]) == {"k1", "full"}
    assert a["nq"]["k1"]["turns"] == 2.0 and a["nq"]["k1"]["tool_calls"] == 2.0  # search, search: no answer
    meta = json.loads((tmp_path / "hf" / "eval_meta.json").read_text())
    assert meta["hf_checkpoint"] == str(checkpoint_run / "hf_export") and meta["run_dir"] is None
    assert meta["rollout_options_from"] == str(checkpoint_run / "hf_export" / "mempo_protocol.json")
    assert (tmp_path / "hf" / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert "Hugging Face checkpoint" in (tmp_path / "hf" / "eval.md").read_text()
    # mempo-compare reads the two --out folders: every dataset and mode, no question apart
    from mempo_jax.run.compare import compare, load_evaluation

    diff = compare(load_evaluation(str(tmp_path / "hf")), load_evaluation(str(tmp_path / "run")))
    assert sorted(diff) == ["bamboogle/full", "bamboogle/k1", "nq/full", "nq/k1"]
    assert all(r["diff"] == 0 and r["above"] == r["below"] == 0 and r["n"] == 2
               for metrics in diff.values() for r in metrics.values())


def test_evaluate_hf_checkpoint_zero_shot_on_pooled_hotpotqa(scripted_checkpoint, data, tmp_path):
    """Any HF checkpoint (here the untrained one) on a HotpotQA slice searched over its own
    paragraphs: every question runs two searches and no answer."""
    folder, _, _ = scripted_checkpoint
    out = tmp_path / "out"
    assert ev.main(["--hf_checkpoint", str(folder), "--tags", "tokens", "--dataset",
                    f"hotpotqa={data / 'hotpotqa/hotpotqa_dev_distractor_300.rpt.jsonl'}", "--limit", "2",
                    "--modes", "1", "--max_turns", "2", "--max_new_tokens", "12", "--out", str(out)]) == 0
    m = json.loads((out / "eval.json").read_text())["hotpotqa"]["k1"]
    assert (m["n"], m["turns"], m["tool_calls"], m["em"], m["format_fail"]) == (2, 2.0, 2.0, 0.0, 1.0)
    assert json.loads((out / "eval_meta.json").read_text())["corpus"]["hotpotqa"] == "own passages (2967)"


@pytest.mark.parametrize("case", ["no_folder", "no_tokenizer", "with_run_dir"])
def test_evaluate_hf_checkpoint_bad_input(case, scripted_checkpoint, data, tmp_path, capsys):
    folder, _, _ = scripted_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    argv = {"no_folder": ["--hf_checkpoint", str(tmp_path / "nope")],
            "no_tokenizer": ["--hf_checkpoint", str(bad)],
            "with_run_dir": ["--hf_checkpoint", str(folder), "--run_dir", str(tmp_path)]}[case]
    message = {"no_folder": "no such folder", "no_tokenizer": "tokenizer.json not found",
               "with_run_dir": "do not also pass --run_dir"}[case]
    assert ev.main(argv + ["--dataset", f"b={data / BAMBOOGLE}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["dead_retriever", "csv_without_question"])
def test_bad_qa_input_exits_2_and_leaves_the_run_folder_untouched(case, data, tmp_path, capsys):
    bad_csv = tmp_path / "qa.csv"
    bad_csv.write_text("query,answer\nwho wrote hamlet,shakespeare\n")
    port = free_port()  # nothing listens there
    params = {"dead_retriever": [f'ExperimentConfig.train_path="{data / NQ}"',
                                 f'ExperimentConfig.retriever_url="http://127.0.0.1:{port}"'],
              "csv_without_question": [f'ExperimentConfig.train_path="{bad_csv}"',
                                       f'ExperimentConfig.corpus_path="{data / CORPUS}"']}[case]
    message = {"dead_retriever": f"ExperimentConfig.retriever_url http://127.0.0.1:{port}: the retrieval server "
                                 "does not answer",
               "csv_without_question": f"{bad_csv}: a QA CSV needs a 'question' column"}[case]
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    (existing / "note.txt").write_text("keep")
    for run in (fresh, existing):
        assert _train_in_process(run, ['ExperimentConfig.dataset="qa"', *params]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not fresh.exists()
    assert sorted(p.name for p in existing.iterdir()) == ["note.txt"]


@pytest.mark.slow
def test_export_command_on_the_run_folder(checkpoint_run, tmp_path, capsys):
    """``python -m mempo_jax.commands.export`` of the run folder's RL step 1 writes what the trainer wrote."""
    from mempo_jax.commands import export

    assert export.main(["--run_dir", str(checkpoint_run), "--checkpoint", "1", "--out", str(tmp_path / "e")]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json", "mempo_protocol.json",
                 "mempo_system_prompt.txt", "generation_config.json"):
        assert (tmp_path / "e" / name).read_bytes() == (checkpoint_run / "hf_export" / name).read_bytes(), name
    assert export.main(["--run_dir", str(checkpoint_run), "--checkpoint", "7", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and not (tmp_path / "f").exists()
