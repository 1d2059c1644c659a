"""Rollout bookkeeping: context views, loss masks and <mem> spans (docs/algorithm.md §2, §5).

Uses the real world, the real SentencePiece tokenizer, real BM25 tools and, for sampled turns,
the real jitted sampler over a tiny random model.
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mempo_jax.text.protocol import ALL_TAG_PIECES, INFORMATION, MEM
from mempo_jax.agent.rollout import RolloutConfig, apply_tools, make_turn, new_trajectories
from mempo_jax.agent.trajectory import FULL, build_training_rows
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_trajectory
from mempo_jax.agent.format import AgentFormat

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    world, tok, _, env, offices = small_world(tmp_path_factory.mktemp("spm"), 40)
    rng = np.random.default_rng(0)
    trajs = [scripted_trajectory(q, offices, AgentFormat.plain(tok), env, ScriptedAgentConfig(0.5, 0.3), RolloutConfig(), rng)
             for q in world.train]
    return world, tok, env, trajs


def test_protocol_tags_are_single_pieces(setup):
    _, tok, _, _ = setup
    for tag in ALL_TAG_PIECES:
        assert tok.encode(tag) == [tok.piece_id(tag)]
    assert tok.encode("x<mem>y") == tok.encode("x") + [tok.piece_id("<mem>")] + tok.encode("y")


def test_world_splits_share_no_question_and_kinds_exist(setup):
    world, _, _, _ = setup
    assert not {q.question for q in world.train} & {q.question for q in world.heldout}
    assert {q.kind for q in world.train} == {"single", "bridge", "multi"}
    for q in world.train:
        if q.kind == "multi":
            assert 2 <= len(q.golds) <= 4 and q.answer.count(";") == len(q.golds) - 1


def test_bridge_answer_needs_first_hop_fact(setup):
    """The company passage alone names several office heads; only the birth city picks the gold."""
    world, _, _, _ = setup
    by_name = {c["name"]: c for c in world.companies}
    bridges = [q for q in world.train if q.kind == "bridge"]
    assert bridges
    for q in bridges:
        company = q.hops[1][0]
        heads = set(by_name[company]["offices"].values())
        assert q.golds[0][0] in heads and len(heads) >= 2


def test_full_traj_never_holds_turn_output(setup):
    _, tok, _, trajs = setup
    for tr in trajs[:50]:
        for t, turn in enumerate(tr.turns):
            full = tr.full_traj(t)
            expect = list(tr.prompt_ids)
            for prev in tr.turns[:t]:
                expect += prev.output_ids + prev.observation_ids
            assert full == expect
            assert full[len(full) - len(turn.output_ids):] != turn.output_ids or not turn.output_ids


def test_mem_traj_is_prompt_plus_mem_block(setup):
    _, tok, _, trajs = setup
    open_id, close_id = tok.piece_id(MEM[0]), tok.piece_id(MEM[1])
    for tr in trajs[:50]:
        for t, turn in enumerate(tr.turns):
            mem = tr.mem_traj(t)
            block = mem[len(tr.prompt_ids):]
            assert mem[: len(tr.prompt_ids)] == tr.prompt_ids
            assert block[0] == open_id and block[-1] == close_id
            assert tok.decode(block) == f"<mem>{turn.parsed.mem}</mem>"


def test_k1_context_is_prompt_last_turn_and_latest_observation(setup):
    _, _, _, trajs = setup
    tr = max(trajs, key=lambda t: len(t.turns))
    for t in range(1, len(tr.turns)):
        prev = tr.turns[t - 1]
        assert tr.policy_context(1, t) == tr.prompt_ids + prev.output_ids + prev.observation_ids
        if t >= 2:
            older = tr.turns[t - 2]
            assert tr.policy_context(2, t) == tr.prompt_ids + older.output_ids + prev.output_ids + prev.observation_ids


@pytest.mark.parametrize("steps", [FULL, 1])
def test_loss_mask_zero_exactly_on_tool_results_and_prompt(setup, steps):
    _, tok, _, trajs = setup
    info_open, info_close = tok.piece_id(INFORMATION[0]), tok.piece_id(INFORMATION[1])
    rows = build_training_rows(trajs[:40], steps, tok.pad_id)
    for r in range(rows.input_ids.shape[0]):
        ids, mask, valid = rows.input_ids[r], rows.loss_mask[r], rows.valid[r]
        inside = False
        generated = 0
        for i in range(int(valid.sum())):
            if ids[i] == info_open:
                inside = True
            if inside:
                assert mask[i] == 0.0
            if ids[i] == info_close:
                inside = False
            generated += mask[i]
        assert (mask[~valid] == 0).all()
        tr = trajs[rows.traj_index[r]]
        if steps == FULL:
            assert generated == sum(len(t.output_ids) for t in tr.turns)
    # every <mem> span lies on loss-masked generated tokens and starts with <mem>
    for row, s, e in zip(rows.mem_rows, rows.mem_starts, rows.mem_ends):
        assert rows.input_ids[row, s] == tok.piece_id(MEM[0]) and rows.input_ids[row, e - 1] == tok.piece_id(MEM[1])
        assert (rows.loss_mask[row, s:e] == 1).all()


def test_scripted_lazy_agent_forgets_and_diligent_agent_answers(setup):
    world, tok, env, _ = setup
    offices = {c["name"]: c["offices"] for c in world.companies}
    multi = [q for q in world.train if q.kind == "multi" and len(q.golds) >= 3][:10]
    rng = np.random.default_rng(1)
    for q in multi:
        good = scripted_trajectory(q, offices, AgentFormat.plain(tok), env, ScriptedAgentConfig(0.0, 0.0), RolloutConfig(), rng)
        lazy = scripted_trajectory(q, offices, AgentFormat.plain(tok), env, ScriptedAgentConfig(1.0, 0.0), RolloutConfig(), rng)
        assert good.answer.strip() == q.answer
        assert lazy.answer.strip().startswith("unknown")


def test_sampled_rollout_bookkeeping(setup):
    """A real rollout with a tiny random model: ids, log-probs and spans line up per turn."""
    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import create_model, split_model
    from mempo_jax.agent.engine import RolloutEngine

    world, tok, env, _ = setup
    cfg = ModelConfig.tiny(tok.vocab_size, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
                           mlp_dim=64)
    graphdef, params = split_model(create_model(cfg, 0))
    stop = [tok.eos_id, tok.piece_id("</search>"), tok.piece_id("</access>"), tok.piece_id("</answer>")]
    engine = RolloutEngine(graphdef, cfg, stop, tok.pad_id)
    trajs = new_trajectories(AgentFormat.plain(tok), world.train[:4], 3)
    assert [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    rcfg = RolloutConfig(max_turns=3, max_new_tokens=12, context_steps=1)
    engine.rollout(params, trajs, AgentFormat.plain(tok), env, rcfg, jax.random.PRNGKey(0))
    for tr in trajs:
        assert tr.done and 1 <= len(tr.turns) <= 3
        for t, turn in enumerate(tr.turns):
            assert 1 <= len(turn.output_ids) <= 12 and len(turn.output_logprobs) == len(turn.output_ids)
            assert turn.context_len == len(tr.policy_context(1, t))
            if turn.parsed.error is not None:  # random output: an error observation, the episode goes on
                assert turn.observation_ids[0] == tok.piece_id(INFORMATION[0])
    rows = build_training_rows(trajs, 1, tok.pad_id)
    assert rows.input_ids.shape[0] == sum(len(t.turns) for t in trajs)
    assert np.allclose(rows.old_logprobs[rows.loss_mask == 0], 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 599), min_size=1, max_size=10), min_size=1, max_size=5),
       st.lists(st.text(max_size=40), min_size=5, max_size=5))
def test_random_outputs_never_break_bookkeeping(setup, outputs, observations):
    """Random model outputs and random tool results: no exception, masks and spans consistent."""
    _, tok, _, _ = setup

    class RandomTools:
        def execute_batch(self, parsed):
            from mempo_jax.tools.search import ToolResult
            return [ToolResult(observations[i % 5], "search", i % 2 == 0) for i in range(len(parsed))]

    tr = new_trajectories(AgentFormat.plain(tok), [dataclasses.make_dataclass("Q", ["id", "question", "golds"])("q", "Who?", (("x",),))], 1)[0]
    cfg = RolloutConfig(max_turns=len(outputs), max_observation_tokens=16)
    for out in outputs:
        if tr.done:
            break
        turn = make_turn(AgentFormat.plain(tok), out, [0.0] * len(out), stopped=True)
        turn.context_len = len(tr.policy_context(1))
        apply_tools(AgentFormat.plain(tok), RandomTools(), [tr], [turn], cfg)
    rows = build_training_rows([tr], 1, tok.pad_id)
    assert rows.loss_mask.sum() == sum(len(t.output_ids) for t in tr.turns)
    for row, s, e in zip(rows.mem_rows, rows.mem_starts, rows.mem_ends):
        assert 0 <= s < e <= rows.input_ids.shape[1] and (rows.loss_mask[row, s:e] == 1).all()


@pytest.mark.parametrize("value, want", [("full", 0), (" FULL ", 0), (0, 0), (3, 3), ("2", 2), ("k1", 1), ("K4", 4)])
def test_context_steps_parse_the_mode_names_of_the_tables(value, want):
    """``parse_context_steps`` inverts ``mode_name`` ("k1", "full") and takes plain integers."""
    from mempo_jax.agent.trajectory import mode_name, parse_context_steps

    assert parse_context_steps(value) == want
    assert parse_context_steps(mode_name(want)) == want


@pytest.mark.parametrize("value", ["k0", "k", "kx", "most", -1, "-2", "k-1"])
def test_context_steps_refuse_anything_else(value):
    from mempo_jax.agent.trajectory import parse_context_steps

    with pytest.raises(ValueError, match=r"context_steps must be 'full' or an integer >= 1, got"):
        parse_context_steps(value)
