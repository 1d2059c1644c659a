"""``RLConfig.filter_groups``: which question groups an RL step trains on (``rl/group_filter.py``),
and that ``rl_step`` scores, computes log-probs for and updates only the kept groups' trajectories."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_memory_reward import _scripted_sample_fn, _toy_learner_and_scorer

from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.rl.group_filter import GROUP_FILTERS, kept_trajectories, zero_std_group_share
from mempo_jax.rl.config import RLConfig
from mempo_jax.rl.interfaces import RLCluster
from mempo_jax.rl.step import rl_step


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=5), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_outcome_std_keeps_whole_groups_whose_rewards_differ(groups, seed):
    rewards = np.array([r for g in groups for r in g], np.float32)
    ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(rewards))  # trajectory order does not matter
    kept = kept_trajectories("outcome_std", rewards[perm], ids[perm])
    want = np.array([len(set(g)) > 1 for g in groups])[ids[perm]]
    np.testing.assert_array_equal(kept, want)
    assert kept_trajectories("none", rewards, ids).all()
    # the share that is dropped is the logged share of groups without an outcome advantage
    assert zero_std_group_share(rewards, ids) == pytest.approx(1.0 - np.mean([len(set(g)) > 1 for g in groups]))


def test_an_unknown_filter_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown RL group filter 'dapo'; known: \['none', 'outcome_std'\]"):
        kept_trajectories("dapo", np.zeros(2), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"filter_groups must be one of \('none', 'outcome_std'\)"):
        RLConfig(filter_groups="dapo")
    assert GROUP_FILTERS.names() == ["none", "outcome_std"]


SEARCH = "<mem> alice</mem><search> alice</search>"
RIGHT, WRONG = "<mem> paris</mem><answer> paris</answer>", "<mem> rome</mem><answer> rome</answer>"


def _step(answers, filter_groups):
    """One RL step on the toy world's first two questions (gold ``paris`` and ``bob``), 3
    trajectories each: a search, then ``answers[row]``."""
    tok, env, questions, learner, scorer = _toy_learner_and_scorer()
    before = jax.tree.map(np.asarray, learner.params)
    cfg = RLConfig(questions_per_step=2, group_size=3, outcome_metric="em", filter_groups=filter_groups,
                   rollout=RolloutConfig(max_turns=2, max_new_tokens=12, max_context_tokens=128,
                                         max_observation_tokens=8, temperature=1.0, context_steps=1,
                                         min_rows_bucket=8))
    cluster = RLCluster(learner, jax.tree.map(lambda x: x.copy(), learner.params),
                        _scripted_sample_fn([[SEARCH] * 6, answers]), scorer, AgentFormat.plain(tok), env)
    m, trajs = rl_step(cluster, questions[:2], cfg, jax.random.PRNGKey(0), np.random.default_rng(0))
    return m, trajs, scorer, before, learner


def test_outcome_std_trains_only_the_group_whose_answers_differ():
    m, trajs, scorer, _, _ = _step([RIGHT, WRONG, WRONG, WRONG, WRONG, WRONG], "outcome_std")
    assert [tr.group_id for tr in trajs] == [0, 0, 0, 1, 1, 1]  # every sampled trajectory is returned
    assert m["critic/score/mean"] == pytest.approx(1 / 6)  # rewards of every sampled trajectory
    assert m["critic/score/zero_std_groups"] == 0.5 and m["train/kept_groups"] == 0.5
    (full, mem, answers), = scorer.calls
    assert len(full) == 6 and m["mem/turns"] == 6.0  # 3 trajectories x 2 turns of question 0 only
    assert m["train/rows"] == 6.0 and np.isfinite(m["actor/pg_loss"])
    m_all, _, scorer_all, _, _ = _step([RIGHT, WRONG, WRONG, WRONG, WRONG, WRONG], "none")
    assert len(scorer_all.calls[0][0]) == 12 and m_all["train/rows"] == 12.0 and m_all["train/kept_groups"] == 1.0


def test_a_step_without_a_differing_group_updates_nothing_and_logs_the_same_names():
    m, trajs, scorer, before, learner = _step([WRONG] * 6, "outcome_std")
    assert len(trajs) == 6 and not scorer.calls
    assert m["train/kept_groups"] == 0.0 and m["train/rows"] == 0.0 and m["critic/score/zero_std_groups"] == 1.0
    assert not any(k.startswith("actor/") for k in m)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, learner.params))):
        np.testing.assert_array_equal(a, b)
    m_trained, *_ = _step([RIGHT, WRONG, WRONG, WRONG, WRONG, WRONG], "outcome_std")
    assert {k for k in m_trained if not k.startswith(("actor/", "rollout/logprob_diff", "timing/"))} == \
        {k for k in m if not k.startswith("timing/")}


def test_a_group_filter_on_several_processes_is_refused_before_anything_runs(monkeypatch):
    """Each process would drop a different number of rows: the run stops at start-up, naming the field."""
    import types

    from jax.sharding import AbstractMesh

    from mempo_jax.core.sharding import DEFAULT_RULES
    from mempo_jax.run import context

    mesh = AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"))
    cfg = lambda name: types.SimpleNamespace(sft=types.SimpleNamespace(steps=0, batch_rows=8),  # noqa: E731
                                             rl=RLConfig(steps=2, questions_per_step=4, filter_groups=name))
    context.check_mesh_sizes(cfg("outcome_std"), mesh, DEFAULT_RULES)  # one process
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    context.check_mesh_sizes(cfg("none"), mesh, DEFAULT_RULES)
    with pytest.raises(ValueError, match=r"RLConfig.filter_groups = 'outcome_std' runs on one process, not 2"):
        context.check_mesh_sizes(cfg("outcome_std"), mesh, DEFAULT_RULES)
