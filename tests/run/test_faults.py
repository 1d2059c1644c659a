"""Faults and bad input: non-finite gradients, one-line errors for bad data, gin
bindings, tokenizers and run folders, the safety of the tools and of checkpoint loading, and a
property test of rollout bookkeeping under random model outputs and tool results."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import SMALL_PARAMS, train_command  # noqa: E402
from fault_train import fault_command  # noqa: E402
from mempo_jax.agent.format import AgentFormat

from conftest import SPM_CACHE, one_device_env  # noqa: E402  (the session's shared caches)


def _train(run_dir, params=(), faults=None, timeout=600):
    """The small run as a subprocess; ``faults`` (``{"nan_grad_steps": "2,4-6"}``): through
    ``tests/fault_train.py`` (``train.main(hooks=FaultHooks(...))``)."""
    cmd = train_command(run_dir, params, SPM_CACHE)
    if faults:
        cmd = fault_command(faults) + cmd[3:]  # cmd[:3]: python -m mempo_jax.commands.train
    return subprocess.run(cmd, env=one_device_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _errors(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("error:")]


# ---- non-finite gradients -------------------------------------------------------------------------
NAN_PARAMS = ("RLConfig.steps=7", "CheckpointConfig.max_consecutive_nonfinite=3")


@pytest.fixture(scope="module")
def nan_run(small_run, tmp_path_factory):
    """RL steps 2 and 4-6 get NaN gradients (test hook); 3 in a row stop the run at step 6.

    After the session's small run (same shapes): its programs load from the XLA cache."""
    run = tmp_path_factory.mktemp("nan") / "run"
    proc = _train(run, NAN_PARAMS, {"nan_grad_steps": "2,4-6"})
    return run, proc


@pytest.mark.slow
def test_nan_step_is_skipped_counted_and_training_continues(nan_run):
    run, _ = nan_run
    rl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"stage": "rl"' in x]
    assert [r["step"] for r in rl] == list(range(7))
    skipped = [r["actor/update_skipped"] for r in rl]
    assert skipped == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # both mini-batch updates of a NaN step skipped
    assert [r["faults/skipped_updates"] for r in rl] == [0.0, 0.0, 2.0, 2.0, 4.0, 6.0, 8.0]
    assert [r["faults/nonfinite_streak"] for r in rl] == [0.0, 0.0, 1.0, 0.0, 1.0, 2.0, 3.0]
    assert rl[2]["actor/grad_norm"] is None  # NaN is logged as null
    assert rl[3]["actor/grad_norm"] > 0.0  # step 3 trained normally after the skipped step


@pytest.mark.slow
def test_consecutive_nan_steps_stop_with_one_line_and_keep_last_good_checkpoint(nan_run):
    from mempo_jax.run.checkpoint import read_checkpoint

    run, proc = nan_run
    assert proc.returncode == 3, proc.stderr[-2000:]
    err = _errors(proc.stderr)
    assert len(err) == 1 and "\n" not in err[0]
    assert err[0].startswith("error: RL steps 4-6: 3 consecutive steps with non-finite loss or gradients")
    assert err[0].endswith(f"Last good checkpoint: {run / 'checkpoints'}/4")
    # checkpoint 2 (after healthy step 1) and 4 (after healthy step 3); none during the streak
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [2, 4]
    step, items = read_checkpoint(run / "checkpoints")
    assert step == 4 and items["meta"]["faults"] == {"streak": 0, "streak_start": -1, "skipped_updates": 2,
                                                      "faulty_steps": 1}
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(items["params"]))
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_stopped_run_resumes_from_last_good_checkpoint(nan_run, tmp_path):
    """Without the fault the same command resumes at checkpoint 4 and finishes."""
    src, _ = nan_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    proc = _train(run, NAN_PARAMS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming RL after step 4" in proc.stdout
    rl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"stage": "rl"' in x]
    assert [r["step"] for r in rl] == list(range(7))  # lines of steps 4-6 replaced, not duplicated
    assert [r["actor/update_skipped"] for r in rl][4:] == [0.0, 0.0, 0.0]
    assert json.loads((run / "summary.json").read_text())["eval"]["rl"]["k1"]["n"] == 4


def test_learner_skips_a_nonfinite_update_bit_for_bit():
    from toy_agent import toy_model

    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.rl.losses import LossConfig
    from mempo_jax.model.forward import make_logits_fn

    cfg, graphdef, params = toy_model(40)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig(learning_rate=1e-2)))
    rng = np.random.default_rng(0)
    rows = {"input_ids": rng.integers(4, 40, (4, 16)).astype(np.int32), "valid": np.ones((4, 16), bool),
            "loss_mask": np.pad(np.ones((4, 15), np.float32), ((0, 0), (1, 0))),  # none in column 0
            "old_logprobs": np.full((4, 16), -3.0, np.float32),
            "ref_logprobs": np.full((4, 16), -3.0, np.float32), "advantages": np.ones((4, 16), np.float32)}
    snap = lambda t: [np.array(x) for x in jax.tree.leaves(t)]  # noqa: E731
    p0, o0 = snap(learner.params), snap(learner.state.opt_state)
    m = learner.ppo_update(dict(rows, advantages=np.full((4, 16), np.nan, np.float32)), LossConfig(), 1,
                           np.random.default_rng(0))
    assert m["actor/update_skipped"] == 1.0 and not np.isfinite(m["actor/grad_norm"])
    assert all(np.array_equal(a, b) for a, b in zip(p0, snap(learner.params)))
    assert all(np.array_equal(a, b) for a, b in zip(o0, snap(learner.state.opt_state)))
    for _ in range(2):  # the warm-up schedule's first learning rate is 0
        m = learner.ppo_update(rows, LossConfig(), 1, np.random.default_rng(0))
        assert m["actor/update_skipped"] == 0.0
    assert not all(np.array_equal(a, b) for a, b in zip(p0, snap(learner.params)))


# ---- bad input: one line, what and where, before anything changes ------------------------------------
def _main(capsys, run_dir, *params, cache=SPM_CACHE):
    from mempo_jax.commands import train

    argv = ["--run_dir", str(run_dir), "--cache_dir", str(cache)]
    for p in (*SMALL_PARAMS, *params):
        argv += ["--gin_param", p]
    rc = train.main(argv)
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1, err
    return rc, err[0]


def test_unknown_gin_binding(tmp_path, capsys):
    rc, err = _main(capsys, tmp_path / "r", "RLConfig.stepz=3")
    assert rc == 2
    assert err == ("error: config error: Configurable 'RLConfig' doesn't have a parameter named 'stepz'. "
                   "(--gin_param RLConfig.stepz=3)")
    gin = tmp_path / "bad.gin"
    gin.write_text("RLConfig.steps = 3\nNoSuchConfig.x = 1\n")
    from mempo_jax.commands import train

    rc = train.main(["--run_dir", str(tmp_path / "r"), "--gin_file", str(gin)])
    err = _errors(capsys.readouterr().err)
    assert rc == 2 and err == [f"error: config error: No configurable matching 'NoSuchConfig'. ({gin}:2: NoSuchConfig.x = 1)"]


def test_wrongly_typed_binding(tmp_path, capsys):
    rc, err = _main(capsys, tmp_path / "r", 'RLConfig.steps="ten"')
    assert rc == 2 and err == "error: config error: RLConfig.steps must be an int, got 'ten' (--gin_param RLConfig.steps=\"ten\")"


def test_missing_and_malformed_data_files(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    rc, err = _main(capsys, tmp_path / "r", 'ExperimentConfig.dataset="hotpotqa"', f'ExperimentConfig.data_path="{missing}"')
    assert rc == 2 and err == f"error: ExperimentConfig.data_path: no such file: {missing}"
    bad = tmp_path / "bad.jsonl"
    good = {"id": "a", "question": "q?", "answer": "x", "supporting_facts": {"title": ["T"], "sent_id": [0]},
            "context": {"title": ["T"], "sentences": [["s."]]}}
    bad.write_text(json.dumps(good) + "\n" + '{"id": "b", "question": \n')
    rc, err = _main(capsys, tmp_path / "r", 'ExperimentConfig.dataset="hotpotqa"', f'ExperimentConfig.data_path="{bad}"')
    assert rc == 2 and err.startswith(f"error: {bad}:2") and "\n" not in err


def test_tokenizer_without_protocol_tags(tmp_path, capsys):
    import sentencepiece as spm

    from mempo_jax.config_loader import load_config
    from mempo_jax.data.world import build_world
    from mempo_jax.run.experiment import tokenizer_texts
    from mempo_jax.text.tokenizer import train_sentencepiece

    cache = tmp_path / "spm"
    cfg = load_config([str(REPO / "configs" / "tiny_world.gin")], SMALL_PARAMS)
    world = build_world(cfg.world)
    texts = tokenizer_texts(cfg, world.documents, world.train + world.heldout)
    cached = pathlib.Path(train_sentencepiece(texts, cache, cfg.vocab_size).path)  # the file the run will load
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=150, hard_vocab_limit=False, minloglevel=2)
    shutil.copyfile(tmp_path / "plain.model", cached)
    rc, err = _main(capsys, tmp_path / "r", cache=cache)
    assert rc == 2
    assert err == (f"error: tokenizer {cached} lacks the protocol tag '<mem>' as a single piece; retrain it with "
                   "the tags as user-defined symbols")


@pytest.fixture
def finished_copy(nan_run, tmp_path):
    """A run folder with SFT and RL checkpoints (the NaN run's), copied."""
    run = tmp_path / "copy"
    shutil.copytree(nan_run[0], run)
    return run


def _snapshot(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and not p.relative_to(run).as_posix().startswith(".cache")}


@pytest.mark.slow
def test_checkpoint_of_another_model_shape(finished_copy, capsys):
    before = _snapshot(finished_copy)
    rc, err = _main(capsys, finished_copy, *NAN_PARAMS,
                    'ModelOptions.overrides=(("num_layers",2),("embed_dim",32),("num_heads",2),("num_kv_heads",1),'
                    '("head_dim",16),("mlp_dim",64))')
    assert rc == 2
    assert err == (f"error: {finished_copy / 'model_config.json'}: the run folder's checkpoints are of another "
                   "model shape (stored vs this config: num_layers 1 vs 2); use another --run_dir or the same "
                   "ModelOptions")
    assert _snapshot(finished_copy) == before  # nothing lost: logs, checkpoints, artifacts untouched


def test_checkpoint_restore_into_another_shape_is_one_line(tmp_path):
    from mempo_jax.run.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(3, {"w": np.zeros((4, 8), np.float32)}, {"c": np.zeros((), np.int32)}, {"seed": 0})
    with pytest.raises(ValueError) as e:
        ck.restore(3, {"w": np.zeros((4, 16), np.float32)})
    ck.close()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {tmp_path / 'ck'}/3 does not match this model:") and "\n" not in msg
    assert "(4, 8)" in msg and "(4, 16)" in msg


@pytest.mark.slow
def test_run_folder_of_another_seed_or_with_lost_metrics(finished_copy, capsys):
    before = _snapshot(finished_copy)
    rc, err = _main(capsys, finished_copy, *NAN_PARAMS, "ExperimentConfig.seed=1")
    assert rc == 2 and err == (f"error: {finished_copy / 'sft_checkpoint'}/6: checkpoint of seed 0, but "
                               "ExperimentConfig.seed = 1")
    assert _snapshot(finished_copy) == before
    rc, err = _main(capsys, finished_copy, *NAN_PARAMS, "RLConfig.seed=1")  # the RL stage's own seed
    assert rc == 2 and "the checkpoint's RNG stream is not this config's (seed 1)" in err
    assert _snapshot(finished_copy) == before
    with open(finished_copy / "metrics.jsonl", "r+b") as f:
        f.truncate(100)
    rc, err = _main(capsys, finished_copy, *NAN_PARAMS)
    assert rc == 2
    assert err.startswith(f"error: {finished_copy / 'metrics.jsonl'} holds 100 bytes but "
                          f"{finished_copy / 'checkpoints'}/4 recorded ")


# ---- safety ------------------------------------------------------------------------------------------
def _docs():
    from mempo_jax.tools.corpus import Document

    return [Document("0", "Alice", "Alice was born in Paris."), Document("doc-1", "Acme", "Bob works at Acme.")]


@pytest.mark.parametrize("arg", ["/etc/passwd", "file:///etc/passwd", "../../../../etc/passwd", "~/.ssh/id_rsa",
                                 "http://127.0.0.1:9/secret", "https://example.com/", "0/../doc-1", "*", ""])
def test_access_serves_only_corpus_documents(arg):
    from mempo_jax.text.protocol import parse_turn
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    env = search_environment(BM25Index(_docs()), topk=1)
    res = env.execute(parse_turn(f"<mem>m</mem><access>{arg}</access>"))
    assert res.ok is False and "No document with id" in res.observation or res.kind == "error"
    assert "root:" not in res.observation
    ok = env.execute(parse_turn("<mem>m</mem><access>[doc doc-1]</access>"))
    assert ok.ok and ok.observation == _docs()[1].contents


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_access_result_is_a_corpus_document_or_an_error(arg):
    from mempo_jax.text.protocol import ParsedTurn
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.search import search_environment

    env = search_environment(BM25Index(_docs()), topk=1)
    res = env.execute(ParsedTurn("m", None, "access", arg, None))
    assert (res.ok and res.observation in {d.contents for d in _docs()}) or (not res.ok)


def test_remote_access_sends_the_id_as_a_query_parameter():
    import httpx

    from mempo_jax.tools.remote import RemoteSearchBackend

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        return httpx.Response(404, json={"detail": "unknown"})

    backend = RemoteSearchBackend("http://127.0.0.1:8000", max_retries=0)
    backend._client = httpx.Client(transport=httpx.MockTransport(handler))
    assert backend.get("../../etc/passwd?x=1#frag") is None
    assert seen[0].host == "127.0.0.1" and seen[0].path == "/access"
    assert seen[0].params["id"] == "../../etc/passwd?x=1#frag"


def test_retrieval_server_binds_loopback_by_default(tmp_path, monkeypatch):
    import uvicorn

    from mempo_jax.commands import retrieval_server
    from mempo_jax.tools.corpus import write_corpus_jsonl

    write_corpus_jsonl(_docs(), tmp_path / "c.jsonl")
    bound = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: bound.update(host=host, port=port))
    assert retrieval_server.main(["--corpus", str(tmp_path / "c.jsonl")]) in (0, None)
    assert bound["host"] == "127.0.0.1"


@pytest.mark.slow
def test_checkpoints_and_indexes_are_never_unpickled(tmp_path, monkeypatch, nan_run):
    from mempo_jax.run.checkpoint import Checkpointer, load_policy, read_checkpoint
    from mempo_jax.tools.bm25 import BM25Index

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, {"w": np.arange(6, dtype=np.float32)}, {"c": np.zeros((), np.int32)}, {"seed": 0})
    params, _, meta = ck.restore(1, {"w": np.zeros(6, np.float32)})
    ck.close()
    assert np.array_equal(np.asarray(params["w"]), np.arange(6)) and meta == {"seed": 0}
    BM25Index(_docs()).save(tmp_path / "index")
    assert BM25Index.load(tmp_path / "index").get("doc-1").title == "Acme"
    step, items = read_checkpoint(nan_run[0] / "checkpoints")
    assert step == 4 and items["meta"]["step"] == 4
    tok, model_cfg, _, params = load_policy(nan_run[0])
    assert model_cfg.num_layers == 1 and tok.vocab_size == 400


# ---- property test: random model outputs and tool results ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Q:
    id: str
    question: str
    golds: tuple


def _random_backend(data):
    from mempo_jax.tools.corpus import Document, Hit
    from mempo_jax.tools.search import ToolError

    text = st.text(st.characters(codec="utf-8"), max_size=60) | st.sampled_from(
        ["<mem>", "</mem>", "<answer> paris</answer>", "<information>", "alice born paris", ""])
    # A Document title is one line (Document validates it); bodies may hold anything.
    title = text.map(lambda t: " ".join(t.splitlines()))

    class Backend:
        def search(self, queries, topk):
            if data.draw(st.integers(0, 5)) == 0:
                raise ToolError(data.draw(st.sampled_from(["timeout", "unreachable", "http 503"])))
            return [[Hit(Document(str(i), data.draw(title), data.draw(text)), 1.0)
                     for i in range(data.draw(st.integers(0, topk)))] for _ in queries]

        def get(self, doc_id):
            k = data.draw(st.integers(0, 3))
            if k == 0:
                raise ToolError("timeout")
            return None if k == 1 else Document(doc_id, data.draw(title), data.draw(text))

    return Backend()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_outputs_and_tool_results_keep_bookkeeping_consistent(data):
    """Random sampled ids (tags often), random stop flags and log-probs, random tool results and
    failures, through rollout → parsing → tools → training rows → reward → memory contexts →
    advantages: no exception; masks, spans and views agree."""
    from reference_rollout import ReferenceEngine
    from toy_agent import WordTokenizer

    from mempo_jax.text.protocol import MEM
    from mempo_jax.agent.rollout import RolloutConfig, new_trajectories
    from mempo_jax.agent.trajectory import FULL, build_training_rows
    from mempo_jax.rl.memory_views import memory_contexts
    from mempo_jax.rl.rewards import score_trajectories
    from mempo_jax.rl.step import compute_advantages
    from mempo_jax.agent.slot_sampler import SampleOutput
    from mempo_jax.tools.search import search_environment

    tok = WordTokenizer()
    tags = [tok.piece_id(t) for t in ("<mem>", "</mem>", "<search>", "</search>", "<answer>", "</answer>",
                                      "<access>", "</access>", "<think>", "</think>")]
    token = st.sampled_from(tags) | st.integers(0, tok.vocab_size - 1)
    word = st.integers(4 + len(tags) + 2, tok.vocab_size - 1)  # plain words (after specials and tags)
    pid = tok.piece_id

    @st.composite
    def output(draw, max_new):
        """A turn: random ids, or a well-formed turn (``<mem>``, optional ``<think>``, an action)
        with random words, some ids replaced or dropped, cut to the budget."""
        if draw(st.booleans()):
            return draw(st.lists(token, min_size=1, max_size=max_new))
        action = draw(st.sampled_from(["search", "access", "answer"]))
        ids = [pid("<mem>")] + draw(st.lists(word, min_size=1, max_size=4)) + [pid("</mem>")]
        if draw(st.booleans()):
            ids += [pid("<think>")] + draw(st.lists(word, max_size=3)) + [pid("</think>")]
        arg = [pid("paris")] if action == "answer" and draw(st.booleans()) else draw(st.lists(word, min_size=1, max_size=3))
        ids += [pid(f"<{action}>")] + arg + [pid(f"</{action}>")]
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # corruption
            i = draw(st.integers(0, len(ids) - 1))
            if draw(st.booleans()):
                ids[i] = draw(token)
            elif len(ids) > 1:
                del ids[i]
        return ids[:max_new]
    n_q, group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    questions = [_Q(f"q{i}", "where was alice born", data.draw(st.sampled_from([(("paris",),), (("rome",), ("bob",))])))
                 for i in range(n_q)]
    cfg = RolloutConfig(max_turns=data.draw(st.integers(1, 4)), max_new_tokens=data.draw(st.sampled_from([20, 12, 6, 1])),
                        max_context_tokens=data.draw(st.sampled_from([200, 90, 40])),
                        max_observation_tokens=data.draw(st.integers(1, 12)),
                        context_steps=data.draw(st.sampled_from([FULL, 1, 2])), min_rows_bucket=1)
    sampled = []

    def sample_fn(params, ids, mask, key, max_new, temperature, top_p):
        b = ids.shape[0]
        tokens = np.full((b, max_new), tok.pad_id, np.int32)
        logp = np.zeros((b, max_new), np.float32)
        lengths = np.zeros(b, np.int32)
        for i in range(b):
            out = data.draw(output(max_new))
            tokens[i, : len(out)], lengths[i] = out, len(out)
            logp[i, : len(out)] = data.draw(st.lists(st.floats(-30.0, 0.0), min_size=len(out), max_size=len(out)))
        stopped = np.asarray(data.draw(st.lists(st.sampled_from([True, True, True, False]), min_size=b, max_size=b)))
        sampled.append((tokens, logp, lengths))
        return SampleOutput(tokens, logp, np.arange(max_new)[None] < lengths[:, None], lengths, stopped)

    env = search_environment(_random_backend(data), topk=2)
    trajs = new_trajectories(AgentFormat.plain(tok), questions, group)
    ReferenceEngine(sample_fn).rollout(None, trajs, AgentFormat.plain(tok), env, cfg, jax.random.PRNGKey(0))

    for tr in trajs:
        assert tr.done and tr.end_reason in ("answer", "max_turns", "budget") and len(tr.turns) <= cfg.max_turns
        for t, turn in enumerate(tr.turns):
            assert turn.context_len == len(tr.policy_context(cfg.context_steps, t))
            assert turn.context_len + cfg.max_new_tokens <= cfg.max_context_tokens
            info = turn.observation_ids
            if info:  # <information> … </information>, at most max_observation_tokens inside
                assert info[0] == tok.piece_id("<information>") and info[-1] == tok.piece_id("</information>")
                assert len(info) - 2 <= cfg.max_observation_tokens
            if turn.mem_span is not None:
                s, e = turn.mem_span
                assert turn.output_ids[s] == tok.piece_id(MEM[0]) and turn.output_ids[e - 1] == tok.piece_id(MEM[1])
            assert len(turn.output_logprobs) == len(turn.output_ids)
    event(f"end reasons {sorted({tr.end_reason for tr in trajs})}")
    event(f"tool calls: {any(tr.num_tool_calls for tr in trajs)}; answers: {any(tr.answer for tr in trajs)}")
    rewards = score_trajectories(trajs, "em")
    assert rewards.shape == (len(trajs),) and ((rewards >= 0) & (rewards <= 1)).all()
    assert ((score_trajectories(trajs, "f1") >= rewards - 1e-6)).all()

    rows = build_training_rows(trajs, cfg.context_steps, tok.pad_id)
    generated = sum(len(t.output_ids) for tr in trajs for t in tr.turns)
    assert rows.loss_mask.sum() == generated
    assert (rows.valid >= (rows.loss_mask > 0)).all()
    assert (rows.old_logprobs[rows.loss_mask == 0] == 0).all()
    assert np.isclose(rows.old_logprobs.sum(), sum(sum(t.output_logprobs) for tr in trajs for t in tr.turns),
                      rtol=1e-4, atol=1e-2)
    for row, s, e, (ti, t) in zip(rows.mem_rows, rows.mem_starts, rows.mem_ends, rows.mem_turn):
        assert rows.input_ids[row, s] == tok.piece_id(MEM[0]) and rows.input_ids[row, e - 1] == tok.piece_id(MEM[1])
        assert (rows.loss_mask[row, s:e] == 1).all() and rows.traj_index[row] == ti
        assert trajs[ti].turns[t].mem_span is not None

    event(f"<mem> spans: {len(rows.mem_turn) > 0}")
    full, mem, answers = memory_contexts(trajs, rows.mem_turn, tok, "gold")
    assert len(full) == len(mem) == len(answers) == len(rows.mem_turn)
    for (ti, t), f, m in zip(rows.mem_turn, full, mem):
        tr = trajs[ti]
        s, e = tr.turns[t].mem_span
        assert m == tr.prompt_ids + tr.turns[t].output_ids[s:e]
        assert len(f) == len(tr.prompt_ids) + sum(len(x.output_ids) + len(x.observation_ids) for x in tr.turns[:t])
    r_mem = np.asarray(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=len(full), max_size=len(full))), np.float32)
    adv, a_t, a_m = compute_advantages(trajs, rows, rewards, r_mem, n_q, 1.0)
    assert adv.shape == rows.input_ids.shape and np.isfinite(adv).all() and np.isfinite(a_t).all()
    assert (adv[rows.loss_mask == 0] == 0).all()
    assert a_t.shape == (len(trajs),) and a_m.shape == (len(rows.mem_turn),)
