"""The objectives sweep: K-objective questions composed from single-hop ones,
the per-K rollout budget, and the script's smoke configuration end to end (table, plot, JSON)."""

import json
import pathlib
import sys

import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.data.world import Question, build_world, compose_objectives
from mempo_jax.rl.rewards import outcome_reward

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def singles():
    return [q for q in build_world().heldout if q.kind == "single"]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_composites_have_k_distinct_objectives_in_the_worlds_layout(singles, k):
    by_text = {q.question: q for q in singles}
    qs = compose_objectives(singles, k, 5, seed=3)
    assert len(qs) == 5 and all(q.kind == "multi" and len(q.golds) == k == len(q.hops) for q in qs)
    for q in qs:
        assert q.question.startswith("Answer all: (1) ") and f"({k}) " in q.question and f"({k + 1}) " not in q.question
        parts = [by_text[t.strip()] for t in q.question[len("Answer all: "):].split(") ")[1:] for t in [t.rsplit(" (", 1)[0]]]
        assert [p.golds[0] for p in parts] == list(q.golds)
        assert len({h[0] for h in q.hops}) == k  # one search per objective, distinct subjects
        assert [h[1] for h in q.hops] == [(f"({j + 1}) {g[0]}",) for j, g in enumerate(q.golds)]
        # the scorer's per-objective mean: half the answers right -> 0.5 for even k
        half = "; ".join(g[0] if j % 2 == 0 else "wrong" for j, g in enumerate(q.golds))
        assert outcome_reward(half, q.golds, "em") == pytest.approx(0.5)
    assert compose_objectives(singles, k, 5, seed=3) == qs  # seeded


def test_one_objective_is_the_single_question_and_bad_input_is_named(singles):
    one = compose_objectives(singles, 1, 4, seed=0)
    assert all(q in singles for q in one) and len(set(one)) == 4
    with pytest.raises(ValueError, match="single-hop"):
        compose_objectives(singles + [Question("m", "multi", "x", (("a",), ("b",)), ())], 2, 1, 0)
    with pytest.raises(ValueError, match="k must be"):
        compose_objectives(singles[:3], 4, 1, 0)


def test_budget_for_gives_room_for_k_searches():
    from objectives_sweep import budget_for

    base = RolloutConfig(max_turns=6, max_new_tokens=48, max_observation_tokens=64, max_context_tokens=1024)
    assert budget_for(base, 2) == base
    eight = budget_for(base, 8)
    assert eight.max_turns == 10 and eight.max_context_tokens == 160 + 10 * (48 + 64 + 8)


def test_small_sweep_writes_table_plot_and_json(tmp_path, capsys):
    from objectives_sweep import main

    doc = main(["--small", "--json", str(tmp_path / "s.json")])
    res = doc["results"]["by_objectives"]
    assert set(res) == {"1", "2"} and all(set(m) == {"k1", "full"} for m in res.values())
    for k, modes in res.items():
        for m in modes.values():
            assert m["n"] == 3 and m["pt"] <= m["tt"] and m["max_turns"] == int(k) + 2
        assert doc["results"]["k1_over_full"][k]["tt"] == pytest.approx(modes["k1"]["tt"] / modes["full"]["tt"])
    assert json.loads((tmp_path / "s.json").read_text())["section"] == "objectives_sweep"
    assert (tmp_path / "objectives.png").stat().st_size > 1000
    assert "| 2 | full | 3 |" in (tmp_path / "objectives.md").read_text()
    assert "| K | TT k1/full |" in capsys.readouterr().out
    import gzip

    with gzip.open(tmp_path / "objectives_predictions.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 2 * 2 * 3  # K x mode x question
    for k, modes in res.items():  # the records are the answers behind each row's EM and TT
        for mode, m in modes.items():
            rows = [r for r in records if r["objectives"] == int(k) and r["mode"] == mode]
            assert len(rows) == 3 and len({r["id"] for r in rows}) == 3
            assert sum(r["em"] for r in rows) / 3 == pytest.approx(m["em"])
            assert sum(r["tt"] for r in rows) / 3 == pytest.approx(m["tt"])
