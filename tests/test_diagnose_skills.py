"""benchmarks/diagnose_skills.py (the skill steps of an episode) and probe_memory_reward.py (which
memories kept what a tool result showed), checked on the scripted agent's own trajectories (real world, tokenizer and BM25), whose behaviour is known by construction."""

import pathlib
import sys

import numpy as np
import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_trajectory

from toy_agent import small_world  # noqa: E402  (tests/: the embedded world at test size)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from diagnose_skills import _contains, episode_skills  # noqa: E402
from probe_memory_reward import memory_labels  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    world, tok, fmt, env, _ = small_world(tmp_path_factory.mktemp("spm"), 20)
    return world, tok, fmt, env


@pytest.mark.parametrize("lazy", [0.0, 1.0])
def test_scripted_bridge_episodes_have_the_skills_they_were_written_with(setup, lazy):
    world, tok, fmt, env = setup
    offices = {c["name"]: c["offices"] for c in world.companies}
    cfg = ScriptedAgentConfig(lazy_prob=lazy, duplicate_prob=0.0)
    rng = np.random.default_rng(0)
    for q in [q for q in world.train if q.kind == "bridge"][:6]:
        tr = scripted_trajectory(q, offices, fmt, env, cfg, RolloutConfig(), rng)
        s = episode_skills(q, tr, tok, world)
        assert s["searched_person_first"] == s["searched_company_after"] == 1.0
        assert s["answered_a_head"] == 1.0  # the lazy agent guesses one of the company's heads
        assert s["city_in_a_mem"] == (0.0 if lazy else 1.0)  # lazy: the birth city is dropped
        assert s["city_dropped"] == (1.0 if lazy else 0.0)  # ... after its tool result showed it
        if not lazy:
            assert s["em"] == 1.0


@pytest.mark.parametrize("lazy", [0.0, 1.0])
def test_scripted_multi_episodes_search_every_subject_and_drop_what_lazy_memory_drops(setup, lazy):
    world, tok, fmt, env = setup
    offices = {c["name"]: c["offices"] for c in world.companies}
    rng = np.random.default_rng(1)
    for q in [q for q in world.train if q.kind == "multi"][:4]:
        tr = scripted_trajectory(q, offices, fmt, env, ScriptedAgentConfig(lazy_prob=lazy, duplicate_prob=0.0),
                                 RolloutConfig(), rng)
        s = episode_skills(q, tr, tok, world)
        assert s["subjects_searched"] == 1.0 and s["sub_answers_seen"] == 1.0
        # lazy: only the newest sub-answer is kept, the others were seen and dropped
        assert s["em"] == pytest.approx(1 / len(q.golds) if lazy else 1.0)
        assert s["sub_answers_dropped"] == pytest.approx(1 - 1 / len(q.golds) if lazy else 0.0)


@pytest.mark.parametrize("text,found", [("<mem> born in Dasroth.</mem>", True), ("dasroth", True),
                                        ("<mem> Dasrothia; Oslo</mem>", False), ("the Das roth", False)])
def test_a_name_counts_as_kept_only_as_whole_words(text, found):
    """``_contains`` (memories, tool results): punctuation splits words, a longer name holding
    the city as a prefix does not count (a substring test did, for bridge memories)."""
    assert _contains(text, ["Dasroth"]) is found


@pytest.mark.parametrize("kind", ["bridge", "multi"])
@pytest.mark.parametrize("lazy", [0.0, 1.0])
def test_probe_labels_each_memory_after_a_shown_answer_and_before_the_answer_turn(setup, kind, lazy):
    """The scripted agent searches one subject per turn and answers last; its lazy memory keeps
    only the newest tool result's fact. So memory t (t >= 1, before the answering turn) follows
    t shown facts: a bridge memory drops the city when lazy; a multi-objective one drops a
    sub-answer from t = 2 on when lazy; a diligent one keeps everything."""
    world, tok, fmt, env = setup
    offices = {c["name"]: c["offices"] for c in world.companies}
    rng = np.random.default_rng(2)
    qs = [q for q in world.train if q.kind == kind][:4]
    assert kind == "bridge" or any(len(q.golds) > 2 for q in qs)  # some multi memory can drop
    for q in qs:
        tr = scripted_trajectory(q, offices, fmt, env, ScriptedAgentConfig(lazy_prob=lazy, duplicate_prob=0.0),
                                 RolloutConfig(), rng)
        last = len(tr.turns) - 1
        want = [(t, "dropped" if lazy and (kind == "bridge" or t >= 2) else "kept") for t in range(1, last)]
        assert memory_labels(q, tr, tok) == want
