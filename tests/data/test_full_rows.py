"""ScriptedAgentConfig.full_rows: whole-history SFT rows from a replay of the
same question ("diligent", "recall"), k-step rows from the (lazy) trajectory itself."""

import numpy as np
import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.agent.trajectory import FULL, build_training_rows
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_conversation, scripted_trajectory
from mempo_jax.rl.sft import sft_rows

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)


@pytest.fixture(scope="module")
def trajs(tmp_path_factory):
    world, tok, fmt, env, offices = small_world(tmp_path_factory.mktemp("spm"), 20)
    qs = [q for q in world.train if q.kind == "bridge"][:5]

    def play(lazy, seed):
        rng = np.random.default_rng(seed)
        return [scripted_trajectory(q, offices, fmt, env, ScriptedAgentConfig(lazy_prob=lazy, duplicate_prob=0.0),
                                    RolloutConfig(context_steps=1), rng) for q in qs]

    return tok, qs, play(1.0, 0), play(0.0, 1), (offices, env)


def _rows(trajs, steps, pad):
    r = build_training_rows(trajs, steps, pad)
    return [(ids[: int(v.sum())].tolist(), m[: int(v.sum())].tolist()) for ids, v, m in zip(r.input_ids, r.valid,
                                                                                              r.loss_mask)]


def test_full_rows_come_from_the_diligent_replay(trajs):
    tok, qs, lazy, diligent, _ = trajs
    got = sft_rows(lazy, 1, 1.0, tok.pad_id, np.random.default_rng(0), full_trajs=diligent)
    k_rows, full_rows = _rows(lazy, 1, tok.pad_id), _rows(diligent, FULL, tok.pad_id)
    assert got == k_rows + full_rows
    for (ids, _), q in zip(full_rows, qs):  # the diligent whole-history row ends in the gold answer
        assert tok.decode(ids).rstrip().endswith(f"<answer> {q.answer}</answer>")
    assert sft_rows(lazy, 1, 1.0, tok.pad_id, np.random.default_rng(0)) == k_rows + _rows(lazy, FULL, tok.pad_id)


def test_the_same_draws_pick_the_same_questions(trajs):
    tok, qs, lazy, diligent, _ = trajs
    a = sft_rows(lazy, 1, 0.5, tok.pad_id, np.random.default_rng(7))
    b = sft_rows(lazy, 1, 0.5, tok.pad_id, np.random.default_rng(7), full_trajs=diligent)
    n_k = len(_rows(lazy, 1, tok.pad_id))
    assert a[:n_k] == b[:n_k] and len(a) == len(b)
    picked = [i for i in range(len(qs)) if _rows([lazy[i]], FULL, tok.pad_id)[0] in a[n_k:]]
    assert b[n_k:] == [_rows([diligent[i]], FULL, tok.pad_id)[0] for i in picked]
    with pytest.raises(ValueError, match="4 full_trajs for 5"):
        sft_rows(lazy, 1, 0.5, tok.pad_id, np.random.default_rng(7), full_trajs=diligent[:4])


def test_recall_keeps_the_lazy_memories_and_answers_right(trajs):
    tok, qs, *_, (offices, env) = trajs
    cfg = ScriptedAgentConfig(lazy_prob=1.0, duplicate_prob=0.0)
    for q in qs:  # bridge questions: a lazy agent forgets the birth city and guesses an office head
        lazy = scripted_conversation(q, offices, env, cfg, np.random.default_rng(5))
        rng = np.random.default_rng(5)
        recall = scripted_conversation(q, offices, env, cfg, rng, recall=True)
        assert rng.random() == _after(q, offices, env, cfg)  # the same draws as the lazy play
        assert recall.turns[:-1] == lazy.turns[:-1]  # searches, memories and tool results unchanged
        text = recall.turns[-1][0]
        assert text.endswith(f"<answer> {q.answer}</answer>") and f"(1) {q.answer}" in text.split("</mem>")[0]
        assert text.split("</mem>")[0].count(";") == sum(len(h[1]) for h in q.hops) - 1  # every fact recalled
    assert any(not c.turns[-1][0].endswith(f"<answer> {q.answer}</answer>")
               for q in qs for c in [scripted_conversation(q, offices, env, cfg, np.random.default_rng(5))])


def _after(q, offices, env, cfg):
    rng = np.random.default_rng(5)
    scripted_conversation(q, offices, env, cfg, rng)
    return rng.random()


def test_think_wording_is_a_binding_and_changes_nothing_else(trajs):
    """``think_search`` / ``think_answer`` replace the think text and only it: the same draws, the
    same memories, searches and answers; a tag piece in the wording is one line naming the field."""
    tok, qs, *_, (offices, env) = trajs
    named = ScriptedAgentConfig(lazy_prob=0.5, duplicate_prob=0.5)
    worded = ScriptedAgentConfig(lazy_prob=0.5, duplicate_prob=0.5, think_search="A fact is still missing.",
                                 think_answer="The facts are in memory.")
    for i, q in enumerate(qs):
        a = scripted_conversation(q, offices, env, named, np.random.default_rng(i))
        b = scripted_conversation(q, offices, env, worded, np.random.default_rng(i))
        assert len(a.turns) == len(b.turns) and a.turns[-1][0].count("<think>") == 1
        for (ta, oa), (tb, ob) in zip(a.turns, b.turns):
            assert oa == ob
            expect = ta.replace("<think> search</think>", "<think> A fact is still missing.</think>")
            assert tb == expect.replace("<think> answer</think>", "<think> The facts are in memory.</think>")
        assert "<think> The facts are in memory.</think><answer>" in b.turns[-1][0]
    with pytest.raises(ValueError, match=r"^ScriptedAgentConfig.think_answer: think contains the tag piece '<answer>'$"):
        ScriptedAgentConfig(think_answer="x <answer> y")
