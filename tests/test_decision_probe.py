"""benchmarks/decision_probe.py: where the action word of a turn is found (on the scripted agent's
own trajectories, real world, tokenizer and tag codec) and how the probe's figures are computed."""

import pathlib
import sys

import numpy as np
import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_trajectory

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from decision_probe import decision_position, summarize, word_id  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return small_world(tmp_path_factory.mktemp("spm"), 12)


def test_every_scripted_turn_has_its_action_word_first_in_its_think_block(setup):
    world, tok, fmt, env, offices = setup
    agent = ScriptedAgentConfig(lazy_prob=0.5, duplicate_prob=0.0)
    answer_id, search_id = word_id(tok, agent.think_answer), word_id(tok, agent.think_search)
    rng = np.random.default_rng(0)
    for kind in ("single", "bridge", "multi"):
        for q in [q for q in world.train if q.kind == kind][:4]:
            tr = scripted_trajectory(q, offices, fmt, env, agent, RolloutConfig(), rng)
            for t, turn in enumerate(tr.turns):
                i = decision_position(turn.output_ids, fmt.codec, (answer_id, search_id))
                assert i is not None
                # the token right before it is the <think> tag, and the word is the turn's action
                assert fmt.codec.find_span(turn.output_ids, "<think>", "</think>")[0] == i - 1
                assert turn.output_ids[i] == (answer_id if t == len(tr.turns) - 1 else search_id)
                assert turn.parsed.action == ("answer" if t == len(tr.turns) - 1 else "search")


def test_a_turn_without_a_think_block_or_its_word_has_no_position(setup):
    _, tok, fmt, _, _ = setup
    ids = fmt.codec.tag_ids("<mem>") + tok.encode(" x") + fmt.codec.tag_ids("</mem>")
    assert decision_position(ids, fmt.codec, (word_id(tok, "answer"),)) is None
    think = fmt.codec.tag_ids("<think>") + tok.encode(" maybe") + fmt.codec.tag_ids("</think>")
    assert decision_position(ids + think, fmt.codec, (word_id(tok, "answer"),)) is None


def test_summary_golden_values():
    res = summarize([("bridge", "answer", 0.3, 0.6), ("bridge", "answer", 0.8, 0.1),
                     ("bridge", "search", 0.1, 0.9), ("single", "search", 0.7, 0.2)])
    assert res["bridge"]["answer"] == {"turns": 2, "p_scripted": pytest.approx(0.55), "argmax_right": 0.5}
    assert res["bridge"]["search"] == {"turns": 1, "p_scripted": pytest.approx(0.9), "argmax_right": 1.0}
    assert res["single"]["search"] == {"turns": 1, "p_scripted": pytest.approx(0.2), "argmax_right": 0.0}


def test_a_word_of_several_tokens_is_refused_by_name(setup):
    _, tok, _, _, _ = setup
    with pytest.raises(ValueError, match="' Zzqxv qq' is"):
        word_id(tok, "Zzqxv qq")
