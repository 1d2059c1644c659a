"""SFTConfig.reader_fraction: memory-reader rows (``sft.reader_rows``) — the memory reward's two
views of the answer turn, followed by the scorer's answer prefix and an answer, loss on the answer."""

import numpy as np
import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_trajectory
from mempo_jax.rl.sft import reader_rows
from mempo_jax.rl.memory_views import gold_answer_ids
from mempo_jax.run.experiment import answer_prefix_ids

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    world, tok, fmt, env, offices = small_world(tmp_path_factory.mktemp("spm"), 20)
    qs = [q for q in world.train if q.kind == "bridge"][:4] + [q for q in world.train if q.kind == "multi"][:4]

    def play(lazy, seed):
        rng = np.random.default_rng(seed)
        return [scripted_trajectory(q, offices, fmt, env, ScriptedAgentConfig(lazy_prob=lazy, duplicate_prob=0.0),
                                    RolloutConfig(context_steps=1), rng) for q in qs]

    return tok, fmt, qs, play(1.0, 0), play(0.0, 1)


def _answer_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m]).strip()


def test_rows_are_the_scorer_views_with_the_loss_on_the_answer(setup):
    tok, fmt, qs, lazy, diligent = setup
    full_prefix, answer_prefix = answer_prefix_ids(tok, "empty_mem")
    rows = reader_rows(lazy, tok, fmt.codec, answer_prefix, full_prefix, 1.0, np.random.default_rng(0), diligent)
    assert len(rows) == 2 * len(qs)
    for i, q in enumerate(qs):
        (mem_ids, mem_mask), (full_ids, full_mask) = rows[2 * i], rows[2 * i + 1]
        last = len(lazy[i].turns) - 1
        ctx = lazy[i].mem_traj(last) + answer_prefix  # memory view: the lazy trajectory's own answer
        assert mem_ids[: len(ctx)] == ctx and not any(mem_mask[: len(ctx)])
        assert _answer_text(tok, mem_ids, mem_mask) == lazy[i].answer
        gold = gold_answer_ids(tok, q.golds)  # full view: the diligent replay's history, the gold Z
        ctx = diligent[i].full_traj(len(diligent[i].turns) - 1) + full_prefix + answer_prefix
        assert full_ids == ctx + gold and full_mask == [0.0] * len(ctx) + [1.0] * len(gold)
    # a lazy memory supports a wrong answer on some of these questions: the two targets differ there
    assert any(lazy[i].answer != q.answer for i, q in enumerate(qs))
    assert all(diligent[i].answer == q.answer for i, q in enumerate(qs))


def test_fraction_draws_one_number_per_trajectory(setup):
    tok, fmt, qs, lazy, diligent = setup
    fp, ap = answer_prefix_ids(tok, "empty_mem")
    for frac in (0.0, 0.5, 1.0):
        rng = np.random.default_rng(3)
        rows = reader_rows(lazy, tok, fmt.codec, ap, fp, frac, rng)
        chosen = int((np.random.default_rng(3).random(len(qs)) < frac).sum())
        assert len(rows) == 2 * chosen
        assert rng.random() == np.random.default_rng(3).random(len(qs) + 1)[-1]
    with pytest.raises(ValueError, match="3 full_trajs for 8"):
        reader_rows(lazy, tok, fmt.codec, ap, fp, 1.0, np.random.default_rng(0), diligent[:3])
