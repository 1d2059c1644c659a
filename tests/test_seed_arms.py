"""benchmarks/seed_arms.py: the pooled paired statistic over seeds × questions, read from
``mempo-evaluate``-style folders as ``mempo-compare`` reads them, and the decision rule stated in
docs/results.md."""

import gzip
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import seed_arms  # noqa: E402

KINDS = ("single", "bridge", "multi", "bridge")


def _folder(path: pathlib.Path, em):
    path.mkdir(parents=True)
    recs = [{"dataset": "unseen", "mode": "k1", "id": f"q{i}", "kind": k, "em": float(e), "f1": float(e)}
            for i, (k, e) in enumerate(zip(KINDS, em))]
    (path / "predictions.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    (path / "eval_meta.json").write_text("{}")


@pytest.mark.parametrize("arm_em, helps", [
    # bridge + multi per seed (questions 1-3): seed 0 +2/3, seed 1 +2/3, seed 2 0 -> pooled +4/9, 2 of 3 favour
    ({0: [0, 1, 1, 1], 1: [1, 1, 1, 1], 2: [0, 0, 0, 1]}, True),
    # seed 0 only: 1 of 3 favour -> does not help whatever the CI
    ({0: [0, 1, 1, 1], 1: [0, 0, 0, 1], 2: [0, 0, 0, 1]}, False),
])
def test_report_pools_seeds_and_applies_the_rule(tmp_path, arm_em, helps):
    base = {0: [1, 0, 0, 1], 1: [0, 0, 0, 1], 2: [0, 0, 0, 1]}
    for s in range(3):
        _folder(seed_arms.arm_dir(tmp_path, "grpo", s) / "unseen", base[s])
        _folder(seed_arms.arm_dir(tmp_path, "mempo_hs", s) / "unseen", arm_em[s])
    doc = seed_arms.report(tmp_path, ["grpo", "mempo_hs"], [0, 1, 2], samples=500)
    got = doc["arms"]["mempo_hs"]
    hard = got["unseen"]["hard"]
    per_seed = [sum(a - b for a, b in zip(arm_em[s][1:], base[s][1:])) / 3 for s in range(3)]
    assert hard["n"] == 9 and hard["per_seed"] == pytest.approx(per_seed)
    assert hard["em"][0] == pytest.approx(sum(per_seed) / 3)
    assert hard["favour"] == sum(v > 0 for v in per_seed) and got["unseen"]["helps"] is helps
    assert hard["em"][1] <= hard["em"][0] <= hard["em"][2]
    assert got["unseen"]["all"]["n"] == 12
    assert "no " in got["train_heldout"]["missing"]  # the trainer's own evaluation is absent here


def test_the_rule_needs_the_ci_above_zero_and_two_seeds_in_three():
    assert seed_arms.decide({"em": [0.1, 0.01, 0.2], "favour": 2}, 3)
    assert not seed_arms.decide({"em": [0.1, 0.0, 0.2], "favour": 3}, 3)  # CI touching 0
    assert not seed_arms.decide({"em": [0.1, 0.01, 0.2], "favour": 1}, 3)

