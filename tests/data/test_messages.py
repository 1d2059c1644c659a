"""SFT trajectory files (``data/messages.py``): validation, conversion through ``AgentFormat``, loss
masks, full vs k-step rows, parquet, the scripted agent's writer and the HotpotQA cold start.

Real components: the embedded world, a trained SentencePiece tokenizer, BM25 tools, pyarrow
parquet files, the shared HotpotQA file and (when cached) the SmolLM2 HF tokenizer.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import SPM_CACHE
from hypothesis import given, settings, strategies as st

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.protocol import MEM, parse_turn, render_turn
from mempo_jax.agent.rollout import RolloutConfig, apply_tools, make_turn, new_trajectories
from mempo_jax.agent.trajectory import FULL, build_training_rows
from mempo_jax.data.messages import (Conversation, conversation_trajectory, load_sft_trajectories, parse_row,
                                     read_messages, write_messages)
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_conversation, scripted_trajectory
from mempo_jax.rl.sft import sft_rows

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOLLM2 = pathlib.Path(os.environ.get("MEMPO_SMOLLM2_DIR", pathlib.Path.home() / ".cache/mempo_jax/smollm2-135m-instruct"))
HOTPOT = "hotpotqa/hotpotqa_dev_distractor_300.rpt.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tuple(small_world(tmp_path_factory.mktemp("spm"), 20))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


TWO_TURNS = {"messages": [
    {"role": "system", "content": "Answer with tags."},
    {"role": "user", "content": "Who founded Acme?"},
    {"role": "assistant", "content": "<mem> none</mem><think> search</think><search> Acme</search>"},
    {"role": "tool", "content": "[doc 3] Acme: founded by Ada."},
    {"role": "assistant", "content": "<mem> founded by Ada</mem><think> answer</think><answer> Ada</answer>"},
]}


# ---- scripted agent → messages → trajectories ---------------------------------------------------

def test_scripted_trajectory_ids_equal_the_rollouts_own_bookkeeping(setup, tmp_path):
    """The scripted turns read back from a messages file carry exactly the ids the RL rollout would
    have recorded had the policy sampled those turns: the rollout's prompt, ``make_turn``'s ``<mem>``
    span and ``apply_tools``' observation from the live tool environment (not the file's text)."""
    world, tok, fmt, env, offices = setup
    cfg, rcfg = ScriptedAgentConfig(0.5, 0.3), RolloutConfig(max_observation_tokens=24)
    qs = [next(q for q in world.train if q.kind == k) for k in ("single", "bridge", "multi")] + world.train[:5]
    rng = np.random.default_rng(3)
    convs = [scripted_conversation(q, offices, env, cfg, rng) for q in qs]
    path = tmp_path / "scripted.jsonl"
    assert write_messages(path, convs) == len(qs)
    trajs = load_sft_trajectories(path, fmt, rcfg.max_observation_tokens, rcfg.context_steps)
    assert [tr.question_id for tr in trajs] == [q.id for q in qs]
    for q, tr in zip(qs, trajs):
        ref = new_trajectories(fmt, [q], 1)[0]
        assert tr.prompt_ids == ref.prompt_ids and tr.golds == tuple(q.golds)
        for turn in tr.turns:
            expect = make_turn(fmt, turn.output_ids, None, stopped=True)
            expect.context_len = len(ref.policy_context(rcfg.context_steps))
            apply_tools(fmt, env, [ref], [expect], rcfg)
            assert (turn.output_ids, turn.mem_span, turn.observation_ids, turn.context_len) == \
                (expect.output_ids, expect.mem_span, expect.observation_ids, expect.context_len)
            assert turn.parsed == expect.parsed and turn.parsed.error is None
        assert ref.done and ref.answer == tr.answer == tr.turns[-1].parsed.argument.strip()
    # the same generator state gives the same trajectories in memory (scripted_trajectory)
    rng = np.random.default_rng(3)
    direct = [scripted_trajectory(q, offices, fmt, env, cfg, rcfg, rng) for q in qs]
    for a, b in zip(direct, trajs):
        assert a.prompt_ids == b.prompt_ids
        assert [(t.output_ids, t.observation_ids, t.mem_span, t.context_len) for t in a.turns] == \
            [(t.output_ids, t.observation_ids, t.mem_span, t.context_len) for t in b.turns]


def test_scripted_conversation_is_render_turn_text_and_raw_observations(setup):
    world, tok, fmt, env, offices = setup
    q = next(q for q in world.train if q.kind == "bridge")
    conv = scripted_conversation(q, offices, env, ScriptedAgentConfig(0.0, 0.0), np.random.default_rng(0))
    assert conv.user == q.question and conv.system is None and len(conv.turns) == len(q.hops) + 1
    for (text, tool), (query, _) in zip(conv.turns, q.hops):
        assert text == render_turn(parse_turn(text).mem, " search", "search", " " + query)
        assert tool == env.execute_batch([parse_turn(text)])[0].observation  # raw, unwrapped, uncut
    last, tool = conv.turns[-1]
    assert tool is None and parse_turn(last).argument == " " + q.answer
    assert parse_row(conv.to_row(), "x.jsonl", 1) == conv


# ---- loss masks and row counts ------------------------------------------------------------------

def test_two_turn_conversation_masks(setup, tmp_path):
    """Loss 1 exactly on the assistant tokens; 0 on system+user prompt and on the tool result."""
    _, tok, fmt, _, _ = setup
    (tr,) = load_sft_trajectories(_write_jsonl(tmp_path / "two.jsonl", [TWO_TURNS]), fmt, 64)
    a1, a2 = (tok.encode(m["content"]) for m in TWO_TURNS["messages"][2::2])
    prompt = fmt.conversation_ids("Answer with tags.", "Who founded Acme?")
    obs = fmt.observation_ids("[doc 3] Acme: founded by Ada.", 64)
    assert tok.decode(obs) == "<information>[doc 3] Acme: founded by Ada.</information>"
    assert tok.decode(prompt[1:] if tok.bos_id is not None else prompt).startswith("Answer with tags.")
    full = build_training_rows([tr], FULL, tok.pad_id)
    n = int(full.valid[0].sum())
    assert full.input_ids[0, :n].tolist() == prompt + a1 + obs + a2
    assert full.loss_mask[0, :n].tolist() == [0.0] * len(prompt) + [1.0] * len(a1) + [0.0] * len(obs) + [1.0] * len(a2)
    assert int(full.loss_mask.sum()) == len(a1) + len(a2) and (full.loss_mask[0, n:] == 0).all()
    trained = full.input_ids[0][full.loss_mask[0] == 1].tolist()
    assert tok.decode(trained) == "".join(m["content"] for m in TWO_TURNS["messages"][2::2])
    k1 = build_training_rows([tr], 1, tok.pad_id)
    assert k1.input_ids.shape[0] == 2
    lens = k1.valid.sum(1).tolist()
    assert k1.input_ids[0, : lens[0]].tolist() == prompt + a1
    assert k1.input_ids[1, : lens[1]].tolist() == prompt + a1 + obs + a2
    assert k1.loss_mask[0].sum() == len(a1) and k1.loss_mask[1].sum() == len(a2)
    assert (k1.loss_mask[1, : len(prompt) + len(a1) + len(obs)] == 0).all()  # the earlier turn is context now
    # <mem> spans on the ids, in row coordinates
    assert full.mem_starts.tolist() == [len(prompt), len(prompt) + len(a1) + len(obs)]
    assert full.input_ids[0, full.mem_starts[0]] == tok.piece_id(MEM[0])


def test_system_message_defaults_to_the_formats_prompt(setup):
    _, _, fmt, _, _ = setup
    row = {"messages": TWO_TURNS["messages"][1:]}
    tr = conversation_trajectory(parse_row(row, "f", 1), fmt, 64)
    assert tr.prompt_ids == fmt.prompt_ids("Who founded Acme?")  # the rollout's prompt of the question


def test_full_and_kstep_rows_from_one_file(setup, tmp_path):
    world, tok, fmt, env, offices = setup
    rng = np.random.default_rng(0)
    convs = [scripted_conversation(q, offices, env, ScriptedAgentConfig(), rng) for q in world.train[:12]]
    path = tmp_path / "rows.jsonl"
    write_messages(path, convs + [Conversation(None, "Q?", (("<mem> a</mem><answer> b</answer>", "trailing"),))])
    trajs = load_sft_trajectories(path, fmt, 64)
    turns = sum(len(c.turns) for c in convs) + 1
    assert len(sft_rows(trajs, FULL, 0.0, tok.pad_id, rng)) == len(convs) + 1
    assert len(sft_rows(trajs, 1, 0.0, tok.pad_id, rng)) == turns
    assert len(sft_rows(trajs, 2, 1.0, tok.pad_id, rng)) == turns + len(convs) + 1
    # the trailing tool message is the last turn's observation (masked)
    assert tok.decode(trajs[-1].turns[-1].observation_ids) == "<information>trailing</information>"
    assert trajs[-1].end_reason == "answer" and trajs[-1].answer == "b"


def test_parquet_file_reads_like_jsonl(setup, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    world, tok, fmt, env, offices = setup
    rng = np.random.default_rng(1)
    rows = [scripted_conversation(q, offices, env, ScriptedAgentConfig(), rng).to_row() for q in world.train[:6]]
    rows.append(TWO_TURNS)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")  # a list<struct<role, content>> column
    _write_jsonl(tmp_path / "sft.jsonl", rows)
    from_pq, from_js = read_messages(tmp_path / "sft.parquet"), read_messages(tmp_path / "sft.jsonl")
    assert [(c.system, c.user, c.turns) for c in from_pq] == [(c.system, c.user, c.turns) for c in from_js]
    a = load_sft_trajectories(tmp_path / "sft.parquet", fmt, 32)
    b = load_sft_trajectories(tmp_path / "sft.jsonl", fmt, 32)
    assert [t.full_traj(len(t.turns)) for t in a] == [t.full_traj(len(t.turns)) for t in b]
    assert write_messages(tmp_path / "out.parquet", from_js) == 7  # the writer's parquet reads back
    assert [c.turns for c in read_messages(tmp_path / "out.parquet")] == [c.turns for c in from_js]
    bad = [dict(TWO_TURNS), {"messages": [{"role": "user", "content": "Q?"}, {"role": "bot", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: field 'messages\[1\]\.role': unknown role 'bot'"):
        read_messages(tmp_path / "bad.parquet")


# ---- bad input: one error naming file:line:field --------------------------------------------------

U = {"role": "user", "content": "Q?"}
A = {"role": "assistant", "content": "<mem> x</mem><answer> y</answer>"}
T = {"role": "tool", "content": "obs"}
BAD = {
    "unknown role": ([U, {"role": "bot", "content": "hi"}], r"messages\[1\]\.role': unknown role 'bot'"),
    "missing role": ([U, {"content": "hi"}], r"messages\[1\]\.role': missing"),
    "missing content": ([U, {"role": "assistant"}], r"messages\[1\]\.content': missing"),
    "list content": ([U, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}],
                     r"messages\[1\]\.content': must be a string, got list"),
    "null content": ([{"role": "user", "content": None}, A], r"messages\[0\]\.content': must be a string, got NoneType"),
    "message not object": ([U, "hello"], r"messages\[1\]': must be an object, got str"),
    "no user": ([{"role": "system", "content": "S"}, A], r"messages\[1\]\.role': role 'assistant' where the user"),
    "empty": ([], r"messages\[0\]\.role': end of messages where the user"),
    "tool first": ([T, U, A], r"messages\[0\]\.role': role 'tool' where the user"),
    "tool before assistant": ([U, T, A], r"messages\[1\]\.role': tool message before any assistant"),
    "two tools": ([U, A, T, T, A], r"messages\[3\]\.role': two tool messages in a row"),
    "second user": ([U, A, T, U, A], r"messages\[3\]\.role': 'user' message after the question"),
    "late system": ([U, {"role": "system", "content": "S"}, A], r"messages\[1\]\.role': 'system' message after"),
    "no assistant": ([{"role": "system", "content": "S"}, U], r"messages': no assistant message"),
    "blank assistant": ([U, {"role": "assistant", "content": "  "}], r"messages\[1\]\.content': empty assistant"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_row_is_one_error_naming_file_line_field(setup, tmp_path, case):
    messages, pattern = BAD[case]
    path = _write_jsonl(tmp_path / "data.jsonl", [TWO_TURNS, TWO_TURNS, {"messages": messages}, TWO_TURNS])
    with pytest.raises(ValueError, match=r"data\.jsonl:3: field '" + pattern) as err:
        read_messages(path)
    assert "\n" not in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["system", "user", "assistant", "tool"]), max_size=8))
def test_accepted_role_orders_are_exactly_the_grammar(roles):
    """The validator accepts a role sequence iff it matches ``[system] user (assistant [tool])+``
    (an independent regular expression), and an accepted row keeps every assistant and tool text."""
    row = {"messages": [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]}
    ok = re.fullmatch(r"(s)?u(at?)+", "".join(r[0] for r in roles)) is not None
    try:
        conv = parse_row(row, "g.jsonl", 1)
    except ValueError as e:
        assert not ok and str(e).startswith("g.jsonl:1: field 'messages")
        return
    assert ok
    texts = [m["content"] for m in row["messages"] if m["role"] in ("assistant", "tool")]
    assert [t for pair in conv.turns for t in pair if t is not None] == texts


@pytest.mark.parametrize("row, pattern", [
    ({"conversations": []}, r"data\.jsonl:2: field 'messages': missing"),
    ({"messages": "hi"}, r"data\.jsonl:2: field 'messages': must be a list of messages, got str"),
    ({"messages": TWO_TURNS["messages"], "golds": "Ada"}, r"data\.jsonl:2: field 'golds': must be a list"),
])
def test_bad_row_fields(tmp_path, row, pattern):
    with pytest.raises(ValueError, match=pattern):
        read_messages(_write_jsonl(tmp_path / "data.jsonl", [TWO_TURNS, row]))


def test_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="SFTConfig.data_path: no such file"):
        read_messages(tmp_path / "none.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(TWO_TURNS) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_messages(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no messages rows"):
        read_messages(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"row being written\):2: field 'messages\[1\]\.role'"):
        write_messages(tmp_path / "w.jsonl", [TWO_TURNS, {"messages": [U, T]}])
    assert not (tmp_path / "w.jsonl").exists()


# ---- the writer command and HotpotQA --------------------------------------------------------------

def _cli(args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "mempo_jax.commands.write_sft_messages", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_writer_cli_bad_config_exits_2_and_writes_nothing(tmp_path):
    out = _cli(["--out", str(tmp_path / "x.jsonl"), "--gin_param", 'ExperimentConfig.dataset="hotpotqa"',
                "--gin_param", f'ExperimentConfig.data_path="{tmp_path / "missing.jsonl"}"'])
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "ExperimentConfig.data_path: no such file" in out.stderr and not (tmp_path / "x.jsonl").exists()


def test_hotpotqa_scripted_messages_keep_the_bridge_fact(tmp_path, shared_data):
    """``write_sft_messages`` on the HotpotQA recipe data: training questions only, every
    conversation searches each supporting title, keeps the first title's supporting sentence in
    ``<mem>`` while searching the second and answers the gold answer."""
    from mempo_jax.config_loader import load_config
    from mempo_jax.run.experiment import load_questions

    data = shared_data / HOTPOT
    params = ['ExperimentConfig.dataset="hotpotqa"', f'ExperimentConfig.data_path="{data}"',
              "ScriptedAgentConfig.lazy_prob=0.0", "ScriptedAgentConfig.duplicate_prob=0.0"]
    out = _cli(["--out", str(tmp_path / "hotpot.jsonl"), *sum((["--gin_param", p] for p in params), [])])
    assert out.returncode == 0, out.stderr[-2000:]
    convs = read_messages(tmp_path / "hotpot.jsonl")
    train_q, held_q, *_ = load_questions(load_config([str(REPO / "configs/tiny_world.gin")], params))
    assert len(train_q) + len(held_q) == 300 and len(held_q) == 60
    assert not {q.id for q in train_q} & {q.id for q in held_q}
    assert not {q.question for q in train_q} & {q.question for q in held_q}
    assert [c.id for c in convs] == [q.id for q in train_q]
    records = {r["id"]: r for r in map(json.loads, data.read_text().splitlines())}
    for c in convs:
        rec = records[c.id]
        titles = list(dict.fromkeys(rec["supporting_facts"]["title"]))
        parsed = [parse_turn(a) for a, _ in c.turns]
        assert [p.argument.strip() for p in parsed[:-1]] == titles and all(p.error is None for p in parsed)
        sents = dict(zip(rec["context"]["title"], rec["context"]["sentences"]))
        first = [sents[t][i].strip() for t, i in zip(*rec["supporting_facts"].values()) if t == titles[0]]
        assert all(" ".join(s.split()) in parsed[1].mem for s in first)  # the bridge fact, kept
        assert all(" ".join(s.split()) in parsed[-1].mem for s in first)
        assert parsed[-1].action == "answer" and parsed[-1].argument.strip() == rec["answer"]
        assert c.golds == ((rec["answer"],),)
        assert all(tool for _, tool in c.turns[:-1]) and c.turns[-1][1] is None


def test_smollm2_text_tags_through_the_same_reader(tmp_path):
    """A tokenizer where every tag is several BPE tokens (SmolLM2, text tags): the ``<mem>`` span
    comes from the ids and the loss-masked tokens decode to the assistant texts."""
    if not (SMOLLM2 / "tokenizer.json").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"SmolLM2 folder missing under CI: {SMOLLM2}")
        pytest.skip(f"SmolLM2 folder absent: {SMOLLM2} (python -m mempo_jax.commands.smollm2)")
    try:
        from mempo_jax.agent.tags import TagCodec
        from mempo_jax.text.hf_tokenizer import HFTokenizer

        tok = HFTokenizer(SMOLLM2)
        fmt = AgentFormat(tok, TagCodec(tok, "text"))
        fmt.mem_span(tok.encode("<mem> x</mem>"))
    except (ImportError, NotImplementedError) as e:
        pytest.skip(f"text-mode tags not available yet: {e}")
    assert len(tok.encode("<mem>")) > 1
    (tr,) = load_sft_trajectories(_write_jsonl(tmp_path / "two.jsonl", [TWO_TURNS]), fmt, 64)
    for turn, msg in zip(tr.turns, TWO_TURNS["messages"][2::2]):
        s, e = turn.mem_span
        block = f"<mem>{parse_turn(msg['content']).mem}</mem>"
        text = tok.decode(turn.output_ids[s:e])  # a token straddling the block's edge is included
        assert text.startswith(block) and len(text) - len(block) < len(tok.decode(turn.output_ids[e - 1:e]))
    full = build_training_rows([tr], FULL, tok.pad_id)
    trained = full.input_ids[0][full.loss_mask[0] == 1].tolist()
    assert tok.decode(trained) == "".join(m["content"] for m in TWO_TURNS["messages"][2::2])
    assert int(full.loss_mask.sum()) == sum(len(tok.encode(m["content"])) for m in TWO_TURNS["messages"][2::2])


# ---- the trainer reads SFTConfig.data_path ---------------------------------------------------------

def test_train_rejects_a_bad_messages_file_before_touching_the_run_folder(tmp_path, capfd):
    from mempo_jax.commands import train

    bad = _write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS, {"messages": [U, {"role": "bot", "content": "x"}]}])
    run = tmp_path / "run"
    capfd.readouterr()
    assert train.main(["--run_dir", str(run), "--gin_param", f'SFTConfig.data_path="{bad}"']) == 2
    assert capfd.readouterr().err.strip() == f"error: {bad}:2: field 'messages[1].role': unknown role 'bot' " \
                                             "(expected one of system, user, assistant, tool)"
    assert not run.exists()


@pytest.mark.slow
def test_train_runs_sft_from_a_messages_file(tmp_path, capsys):
    """``SFTConfig.data_path`` end to end: a messages file (not the scripted agent) trains the SFT stage
    (``train.main`` in-process: no signal or second process needed)."""
    from mempo_jax.commands import train

    small = ["WorldConfig.num_people=60", "WorldConfig.num_companies=20", "WorldConfig.num_cities=16",
             "WorldConfig.num_countries=4", "WorldConfig.num_single=10", "WorldConfig.num_bridge=10",
             "WorldConfig.num_multi=10", "ExperimentConfig.vocab_size=600"]
    data = _write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS, {"messages": TWO_TURNS["messages"][1:3]}] * 3)
    n = 6
    run = tmp_path / "run"
    params = small + [
        f'SFTConfig.data_path="{data}"', "SFTConfig.steps=2", "SFTConfig.batch_rows=4", "RLConfig.steps=0",
        'ModelOptions.overrides=(("num_layers", 1), ("embed_dim", 32), ("num_heads", 2), ("num_kv_heads", 1), '
        '("head_dim", 16), ("mlp_dim", 64))', "EvalConfig.num_questions=1", "EvalConfig.context_modes=(1,)",
        "EvalConfig.bootstrap_samples=10", "RolloutConfig.max_turns=1", "RolloutConfig.max_new_tokens=8"]
    rc = train.main(["--run_dir", str(run), "--cache_dir", str(SPM_CACHE), *sum((["--gin_param", p] for p in params), [])])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    assert f"[mempo] SFT on {n} conversations of {data}" in out.out
    sft = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"stage": "sft"' in line]
    assert len(sft) == 2 and all(np.isfinite(m["sft/loss"]) for m in sft)
