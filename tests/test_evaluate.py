"""The evaluation command: a tiny run folder built here, evaluated on slices of the real
Bamboogle and HotpotQA files in both context modes; output files; corpus planning; bad input."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from reference_rollout import ReferenceEngine

from mempo_jax.commands import evaluate as ev
from mempo_jax.run import experiment
from mempo_jax.run.checkpoint import Checkpointer, save_run_artifacts
from mempo_jax.data.world import WorldConfig, build_world
from mempo_jax.run.experiment import _tokenizer_texts
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model
from mempo_jax.text.tokenizer import train_sentencepiece

BAMBOOGLE = "bamboogle/bamboogle_125.r1searcher.jsonl"
HOTPOT = "hotpotqa/hotpotqa_dev_distractor_300.rpt.jsonl"
MUSIQUE = "musique/musique_dev_10_with_paragraphs.hoprag.jsonl"
CORPUS = "flashrag/corpus_sample.flashrag.jsonl"
KEYS = ("em", "f1", "tt", "pt", "turns", "format_fail")
STEP = 7
SFT_STEP = 3  # the fixture run's SFT checkpoint (other parameters: seed 1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as ``mempo_jax.commands.train`` writes it: tokenizer.model, model_config.json, checkpoints/7,
    sft_checkpoint/3."""
    world = build_world(WorldConfig(num_people=30, num_companies=10, num_cities=8, num_countries=3,
                                    num_single=10, num_bridge=10, num_multi=10))
    run = tmp_path_factory.mktemp("run")
    tok = train_sentencepiece(_tokenizer_texts(world.documents, world.train + world.heldout), run / ".cache", 400)
    cfg = ModelConfig.tiny(tok.vocab_size, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64)
    save_run_artifacts(run, tok, cfg)
    for folder, step, seed in (("checkpoints", STEP, 0), ("sft_checkpoint", SFT_STEP, 1)):
        _, params = split_model(create_model(cfg, seed=seed))
        ckpt = Checkpointer(run / folder, async_save=False)
        ckpt.save(step, params, {"count": jnp.zeros((), jnp.int32)}, {"stage": "test", "step": step})
        ckpt.close()
    return run


@pytest.fixture(scope="module")
def evaluated(run_dir, tmp_path_factory):
    from conftest import require_shared_data  # the module-scoped twin of the ``shared_data`` fixture

    data = require_shared_data()
    out = tmp_path_factory.mktemp("eval")
    rc = ev.main(["--run_dir", str(run_dir), "--dataset", f"bamboogle={data / BAMBOOGLE}",
                  "--dataset", f"hotpotqa={data / HOTPOT}", "--limit", "4", "--max_turns", "3",
                  "--out", str(out)])
    return rc, out


def test_eval_json_has_every_dataset_mode_and_metric(evaluated):
    rc, out = evaluated
    assert rc == 0
    results = json.loads((out / "eval.json").read_text())
    assert set(results) == {"bamboogle", "hotpotqa"}
    for name, modes in results.items():
        assert set(modes) == {"k1", "full"}
        for mode, m in modes.items():
            assert set(KEYS) <= set(m), (name, mode)
            assert m["n"] == 4
            for k in ("em", "f1", "format_fail"):
                assert 0.0 <= m[k] <= 1.0, (name, mode, k, m[k])
            assert m["em"] <= m["f1"] + 1e-9  # an exact match has F1 = 1
            assert 1.0 <= m["turns"] <= 3.0  # --max_turns 3 reaches the rollout
            assert 0 < m["pt"] <= m["tt"] <= 3 * m["pt"] + 1e-9


def test_predictions_agree_with_eval_json(evaluated):
    """The per-question lines are the questions of the files, and their means are eval.json's."""
    _, out = evaluated
    results = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4
    bamboogle = [r for r in rows if r["dataset"] == "bamboogle" and r["mode"] == "k1"]
    assert [r["id"] for r in bamboogle] == ["1", "2", "3", "4"]  # R1-Searcher idx, file order
    assert bamboogle[0]["golds"] == [["james madison"]]  # Bamboogle idx 1 (Citibank, founded 1812)
    for name, modes in results.items():
        for mode, m in modes.items():
            sel = [r for r in rows if r["dataset"] == name and r["mode"] == mode]
            for k in ("em", "f1", "tt", "pt", "turns"):
                assert np.isclose(np.mean([r[k] for r in sel]), m[k]), (name, mode, k)
            assert np.isclose(np.mean([r["format_failures"] > 0 or r["answer"] is None for r in sel]),
                              m["format_fail"])


def test_eval_md_png_and_meta(evaluated, run_dir):
    _, out = evaluated
    md = (out / "eval.md").read_text()
    for name in ("bamboogle", "hotpotqa"):
        for mode in ("k1", "full"):
            assert f"| {name} | {mode} | 4 |" in md
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "eval_meta.json").read_text())
    assert meta["checkpoint_step"] == STEP
    assert meta["corpus"]["hotpotqa"] == "own passages (2967)"  # SOURCES.md: 2,967 distinct paragraphs
    assert meta["corpus"]["bamboogle"] == "pooled from hotpotqa (2967 passages)"
    assert meta["rollout"]["max_turns"] == 3 and meta["topk"] == ev.DEFAULT_TOPK
    assert meta["rollout"]["temperature"] == 0.0 and "context_steps" not in meta["rollout"]


class ScriptedPolicy:
    """A stand-in ``sample_fn``: two searches, then the answer "james madison".

    The stage is read from the context (the last query the policy wrote), so it works in k = 1
    mode, where only the previous turn is visible, as well as in full mode.
    """

    def __init__(self, tok):
        self.tok = tok
        self.turns = [tok.encode("<mem> none </mem><search> Citibank founded </search>"),
                      tok.encode("<mem> Citibank </mem><search> Madison president </search>"),
                      tok.encode("<mem> Citibank 1812 </mem><answer> james madison </answer>")]

    def _next(self, row) -> list[int]:
        text = self.tok.decode(row)
        return self.turns[2 if "Madison president" in text else 1 if "Citibank founded" in text else 0]

    def __call__(self, params, ids, mask, key, max_new_tokens, temperature, top_p):
        from mempo_jax.agent.slot_sampler import SampleOutput

        rows = [self._next(row) for row in np.asarray(ids).tolist()]
        n = max_new_tokens
        assert max(map(len, rows)) <= n
        tokens = np.array([r + [self.tok.pad_id] * (n - len(r)) for r in rows], np.int32)
        lengths = np.array([len(r) for r in rows], np.int32)
        return SampleOutput(tokens, np.zeros(tokens.shape, np.float32), np.arange(n)[None] < lengths[:, None],
                            lengths, np.ones(len(rows), bool))


def _scripted_eval(run_dir, shared_data, out, retrieval: list[str]) -> dict:
    rc = ev.main(["--run_dir", str(run_dir), "--dataset", f"bamboogle={shared_data / BAMBOOGLE}", *retrieval,
                  "--topk", "2", "--limit", "4", "--out", str(out)])
    assert rc == 0
    return json.loads((out / "eval.json").read_text())


def test_scripted_policy_scores_through_the_cli(run_dir, shared_data, tmp_path, monkeypatch):
    """Search, search, answer: Bamboogle idx 1's gold is "james madison", idx 2–4's are not, so
    EM = F1 = 1/4 in both modes, 3 turns and 2 tool calls per episode, no format failure. The
    answer turn's k = 1 context drops the first search and its result, so k1 has fewer tokens."""
    monkeypatch.setattr(experiment, "make_engine", lambda graphdef, cfg, fmt, **_: ReferenceEngine(ScriptedPolicy(fmt.tokenizer)))
    out = tmp_path / "out"
    results = _scripted_eval(run_dir, shared_data, out, ["--corpus", str(shared_data / CORPUS)])["bamboogle"]
    for mode in ("k1", "full"):
        m = results[mode]
        assert (m["em"], m["f1"], m["turns"], m["tool_calls"], m["format_fail"]) == (0.25, 0.25, 3.0, 2.0, 0.0)
        assert m["tt"] > m["pt"] > 0
    assert results["k1"]["pt"] < results["full"]["pt"] and results["k1"]["tt"] < results["full"]["tt"]
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["em"] for r in rows if r["mode"] == "k1"] == [1.0, 0.0, 0.0, 0.0]
    assert {r["answer"] for r in rows} == {"james madison"} and {r["end"] for r in rows} == {"answer"}
    meta = json.loads((out / "eval_meta.json").read_text())
    assert meta["topk"] == 2 and meta["corpus"]["bamboogle"].endswith("(1000 passages)")


def test_retriever_url_gives_the_local_corpus_results(run_dir, shared_data, tmp_path, monkeypatch):
    """The same corpus behind a Search-R1 /retrieve server (in-process uvicorn on loopback) yields
    the same search results, hence the same token counts, as the local BM25 index."""
    import threading
    import time

    import uvicorn

    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.corpus import load_corpus
    from mempo_jax.tools.retrieval_server import create_app

    monkeypatch.setattr(experiment, "make_engine", lambda graphdef, cfg, fmt, **_: ReferenceEngine(ScriptedPolicy(fmt.tokenizer)))
    local = _scripted_eval(run_dir, shared_data, tmp_path / "local", ["--corpus", str(shared_data / CORPUS)])
    app = create_app(BM25Index(load_corpus(shared_data / CORPUS)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not (server.started and server.servers):
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        remote = _scripted_eval(run_dir, shared_data, tmp_path / "remote",
                                ["--retriever_url", f"http://127.0.0.1:{port}"])
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert remote == local
    assert json.loads((tmp_path / "remote" / "eval_meta.json").read_text())["corpus"]["bamboogle"] == \
        f"retriever http://127.0.0.1:{port}"


# -- corpus planning ----------------------------------------------------------------------------
def test_passage_less_dataset_pools_from_every_other_file(shared_data):
    specs = [ev.DatasetSpec("bamboogle", shared_data / BAMBOOGLE), ev.DatasetSpec("hotpotqa", shared_data / HOTPOT),
             ev.DatasetSpec("musique", shared_data / MUSIQUE)]
    backends, notes = ev.plan_corpora(specs, None, None)
    assert len(backends["hotpotqa"]) == 2967 and len(backends["musique"]) == 200  # SOURCES.md counts
    union = backends["bamboogle"]
    assert 2967 < len(union) <= 2967 + 200
    assert [d.id for d in union.documents] == [str(i) for i in range(len(union))]  # renumbered, unique
    assert notes["bamboogle"].startswith("pooled from hotpotqa+musique")


def test_explicit_corpus_serves_every_dataset(shared_data):
    specs = [ev.DatasetSpec("hotpotqa", shared_data / HOTPOT)]
    backends, notes = ev.plan_corpora(specs, str(shared_data / CORPUS), None)
    assert len(backends["hotpotqa"]) == 1000 and "1000 passages" in notes["hotpotqa"]


def test_multi_objective_and_limit(shared_data):
    qs = ev.load_questions(shared_data / BAMBOOGLE, limit=5, multi_objective=3, seed=0)
    assert len(qs) == 5 and all(q.num_objectives == 3 for q in qs)
    assert qs[0].question.startswith("Question 1: ") and "\nQuestion 3: " in qs[0].question
    assert len(ev.load_questions(shared_data / BAMBOOGLE, multi_objective=2)) == 62  # 125 // 2


def test_rollout_options_come_from_the_runs_config_gin(tmp_path):
    assert ev.run_rollout_options(tmp_path)[:2] == (ev.RolloutConfig(), ev.DEFAULT_TOPK)  # no config.gin
    (tmp_path / "config.gin").write_text("ExperimentConfig.topk = 4\nExperimentConfig.rl = @RLConfig()\n"
                                         "RLConfig.rollout = @RolloutConfig()\nRolloutConfig.max_turns = 2\n"
                                         "RolloutConfig.max_new_tokens = 40\n")
    rollout, topk, source = ev.run_rollout_options(tmp_path)
    assert (rollout.max_turns, rollout.max_new_tokens, topk, source) == (2, 40, 4, str(tmp_path / "config.gin"))
    (tmp_path / "config.gin").write_text("NoSuchConfig.field = 1\n")  # another version's config: defaults
    assert ev.run_rollout_options(tmp_path)[:2] == (ev.RolloutConfig(), ev.DEFAULT_TOPK)


# -- run folder resolution and bad input --------------------------------------------------------
def test_checkpoint_accepts_step_or_run_folder(run_dir):
    rl = (run_dir, STEP, "checkpoints")
    assert ev.resolve_run(str(run_dir), None) == rl
    assert ev.resolve_run(str(run_dir), str(STEP)) == rl
    assert ev.resolve_run(None, str(run_dir)) == rl
    assert ev.resolve_run(None, str(run_dir / "checkpoints")) == rl
    assert ev.resolve_run(None, str(run_dir / "checkpoints" / str(STEP))) == rl
    sft = (run_dir, SFT_STEP, "sft_checkpoint")  # the SFT policy of the same run
    assert ev.resolve_run(None, str(run_dir / "sft_checkpoint")) == sft
    assert ev.resolve_run(str(run_dir), str(run_dir / "sft_checkpoint" / str(SFT_STEP))) == sft
    with pytest.raises(FileNotFoundError, match=r"step 3 not found.*\[7\]"):
        ev.resolve_run(str(run_dir), "3")
    with pytest.raises(FileNotFoundError, match=r"step 7 not found under .*sft_checkpoint \(have \[3\]\)"):
        ev.resolve_run(None, str(run_dir / "sft_checkpoint" / "7"))
    with pytest.raises(ValueError, match="name different run folders"):
        ev.resolve_run(str(run_dir.parent), str(run_dir / "sft_checkpoint"))


def test_the_sft_checkpoint_is_the_policy_evaluated_when_named(run_dir):
    """``--checkpoint RUN/sft_checkpoint`` evaluates the SFT parameters (seed 1), not the RL ones."""
    import jax

    cfg = ev.load_eval_policy(None, None, run_dir, STEP).model_cfg
    for folder, step, seed in (("checkpoints", STEP, 0), ("sft_checkpoint", SFT_STEP, 1)):
        got = ev.load_eval_policy(None, None, run_dir, step, folder).params
        want = split_model(create_model(cfg, seed=seed))[1]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case, message", [
    ("no_run", "run folder not found"),
    ("no_step", "checkpoint step 99 not found"),
    ("no_equals", "--dataset expects NAME=PATH"),
    ("no_file", "no such file"),
    ("no_corpus", "pass --corpus FILE"),
    ("bad_mode", "context_steps must be 'full'"),
    ("no_server", "the retrieval server does not answer"),
    ("out_is_file", "exists and is not a folder"),
    ("empty_corpus", "empty corpus (no rows)"),
    ("utf8_corpus", "corpus.jsonl:2: not UTF-8 text (byte 0xff"),
    ("utf8_dataset", "qa.jsonl:2: not UTF-8 text (byte 0xfe"),
])
def test_bad_input_exits_2_with_one_line(case, message, run_dir, shared_data, tmp_path, capsys):
    bamboogle = f"bamboogle={shared_data / BAMBOOGLE}"
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "corpus.jsonl").write_bytes(b'{"id": "0", "contents": "\\"A\\"\\nx"}\n{"id": "1", "contents": "\xff"}\n')
    (tmp_path / "qa.jsonl").write_bytes(b'{"question": "q?", "answer": "a"}\n{"question": "\xfe", "answer": "b"}\n')
    argv = {
        "no_run": ["--run_dir", str(tmp_path / "nope"), "--dataset", bamboogle],
        "no_step": ["--run_dir", str(run_dir), "--checkpoint", "99", "--dataset", bamboogle],
        "no_equals": ["--run_dir", str(run_dir), "--dataset", str(shared_data / BAMBOOGLE)],
        "no_file": ["--run_dir", str(run_dir), "--dataset", f"x={tmp_path / 'missing.jsonl'}"],
        "no_corpus": ["--run_dir", str(run_dir), "--dataset", bamboogle],
        "bad_mode": ["--run_dir", str(run_dir), "--dataset", bamboogle, "--modes", "1,everything"],
        "no_server": ["--run_dir", str(run_dir), "--dataset", bamboogle, "--retriever_url", "http://127.0.0.1:9"],
        "out_is_file": ["--run_dir", str(run_dir), "--dataset", bamboogle, "--corpus", str(shared_data / CORPUS)],
        "empty_corpus": ["--run_dir", str(run_dir), "--dataset", bamboogle, "--corpus", str(tmp_path / "empty.jsonl")],
        "utf8_corpus": ["--run_dir", str(run_dir), "--dataset", bamboogle, "--corpus", str(tmp_path / "corpus.jsonl")],
        "utf8_dataset": ["--run_dir", str(run_dir), "--dataset", f"x={tmp_path / 'qa.jsonl'}",
                         "--corpus", str(shared_data / CORPUS)],
    }[case]
    out = tmp_path / "out"
    if case == "out_is_file":  # --out naming an existing file used to fail after the whole evaluation
        out.write_text("keep me")
    assert ev.main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    if case == "out_is_file":
        assert err == f"error: --out {out}: exists and is not a folder\n" and out.read_text() == "keep me"
    elif case.startswith("utf8"):
        assert str(tmp_path) in err  # the file is named
    else:
        assert not (out / "eval.json").exists()


def test_table_has_an_em_column_per_question_kind():
    base = {"n": 4, "em": 0.5, "f1": 0.5, "tt": 100.4, "pt": 50.0, "turns": 2.0, "tool_calls": 1.0, "format_fail": 0.0}
    results = {"hotpotqa": {"k1": {**base, "eval/bridge/em": 0.25, "eval/bridge/n": 2.0,
                                   "eval/comparison/em": 0.75, "eval/comparison/n": 2.0}},
               "bamboogle": {"k1": dict(base)}}
    assert ev.format_table(results).splitlines() == [
        "| dataset | mode | n | EM | F1 | TT | PT | turns | tool calls | format fail | EM bridge (2) | EM comparison (2) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| hotpotqa | k1 | 4 | 0.500 | 0.500 | 100 | 50 | 2.00 | 1.00 | 0.000 | 0.250 | 0.750 |",
        "| bamboogle | k1 | 4 | 0.500 | 0.500 | 100 | 50 | 2.00 | 1.00 | 0.000 | - | - |",
    ]
