"""benchmarks/ablation.py: the paired MemPO − GRPO statistic, the arm folders
that resume from one SFT start, and the smoke configuration end to end through the real trainer."""

import json
import pathlib
import sys

import pytest

from mempo_jax.data.world import Question

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import ablation  # noqa: E402


def _q(kind):
    return Question("x", kind, "q?", (("a",),), ())


def test_paired_difference_pools_the_hard_kinds_over_seeds():
    held = [_q("single"), _q("bridge"), _q("multi"), _q("bridge")]
    a = {0: {"em": {"k1": [1, 1, 0.5, 0]}, "f1": {"k1": [1, 1, 0.5, 0.5]}},
         1: {"em": {"k1": [0, 1, 1, 1]}, "f1": {"k1": [0, 1, 1, 1]}}}
    b = {0: {"em": {"k1": [0, 0, 0.5, 0]}, "f1": {"k1": [0, 0, 0.5, 0]}},
         1: {"em": {"k1": [1, 0, 0, 1]}, "f1": {"k1": [1, 0, 0, 1]}}}
    got = ablation.paired_difference(a, b, held, ("bridge", "multi"), "k1", samples=500)
    # hard questions: seed 0 diffs [1, 0, 0], seed 1 diffs [1, 1, 0] -> pooled mean 0.5
    assert got["n"] == 6 and got["em"][0] == pytest.approx(0.5)
    assert got["per_seed_em"] == {"0": pytest.approx(1 / 3), "1": pytest.approx(2 / 3)}
    assert got["f1"][0] == pytest.approx((1 + 0 + 0.5 + 1 + 1 + 0) / 6)
    assert got["em"][1] <= 0.5 <= got["em"][2] and 0 <= got["em"][1] and got["em"][2] <= 1


def test_arm_folder_is_the_sft_folder_without_rl_state(tmp_path):
    sft = tmp_path / "sft"
    for name in ("checkpoints/0/x", "sft_checkpoint/4/x", "eval_sft.json", "eval_rl.json", "summary.json",
                 "metrics.jsonl", "tokenizer.model"):
        (sft / name).parent.mkdir(parents=True, exist_ok=True)
        (sft / name).write_text(name)
    ablation.start_arm(sft, tmp_path / "arm")
    got = sorted(str(p.relative_to(tmp_path / "arm")) for p in (tmp_path / "arm").rglob("*") if p.is_file())
    assert got == ["eval_sft.json", "metrics.jsonl", "sft_checkpoint/4/x", "tokenizer.model"]
    (tmp_path / "arm" / "metrics.jsonl").write_text("kept")
    ablation.start_arm(sft, tmp_path / "arm")  # an existing arm folder resumes: left as it is
    assert (tmp_path / "arm" / "metrics.jsonl").read_text() == "kept"


@pytest.mark.slow  # the trainer, in-process: one SFT start and three RL arms
def test_small_ablation_runs_arms_from_one_sft_start(tmp_path, capsys):
    out = tmp_path / "abl"
    doc = ablation.main(["--small", "--rl_steps", "1", "--out", str(out), "--json", str(tmp_path / "a.json")])
    res = doc["results"]
    assert set(res["arms"]) == {"mempo", "grpo", "grpo_full"}
    sft_eval = json.loads((out / "seed0" / "sft" / "eval_sft.json").read_text())["evals"]
    for arm, cfg_line in (("mempo", "memory_coef = 1.0"), ("grpo", "memory_coef = 0.0"),
                          ("grpo_full", "context_steps = 'full'")):
        run = out / "seed0" / arm
        lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert sum(r["stage"] == "sft" for r in lines) == 4 and sum(r["stage"] == "rl" for r in lines) == 1
        assert res["arms"][arm]["0"]["eval"]["sft"] == sft_eval  # the one SFT start, evaluated once
        assert cfg_line in (run / "config.gin").read_text()
        assert set(res["arms"][arm]["0"]["curve"]) == {"0", "1"}
        assert any(k.startswith("eval/") and k.endswith("/em") for k in res["arms"][arm]["0"]["eval"]["rl"]["k1"])
    assert res["mempo_minus_grpo_hard"]["n"] == sum(1 for k in ("bridge", "multi")
                                                    for _ in range(int(sft_eval["k1"].get(f"eval/{k}/n", 0))))
    assert (out / "ablation.png").stat().st_size > 1000 and "MemPO − GRPO" in (out / "ablation.md").read_text()
    by_kind = res["mempo_minus_grpo_by_kind"]
    assert set(by_kind) == {"bridge", "multi"} and by_kind["bridge"]["n"] + by_kind["multi"]["n"] == \
        res["mempo_minus_grpo_hard"]["n"]
    assert "MemPO − GRPO (k1 EM, multi):" in (out / "ablation.md").read_text()
    assert json.loads((tmp_path / "a.json").read_text())["section"] == "ablation"
    assert "| SFT start | k1 |" in capsys.readouterr().out
    # a lever on the same SFT start: copied, not trained again (its metrics are byte for byte the same)
    lever = tmp_path / "lever"
    doc2 = ablation.main(["--small", "--rl_steps", "1", "--out", str(lever), "--sft_from", str(out),
                          "--arms", "mempo,grpo", "--gin_param", 'MemoryRewardConfig.baseline="input"'])
    for name in ("metrics.jsonl", "eval_sft.json"):
        assert (lever / "seed0" / "sft" / name).read_bytes() == (out / "seed0" / "sft" / name).read_bytes()
    assert doc2["results"]["arms"]["grpo"]["0"]["eval"]["sft"] == sft_eval
    assert "MemoryRewardConfig.baseline = 'input'" in (lever / "seed0" / "mempo" / "config.gin").read_text()
    with pytest.raises(FileNotFoundError, match="not a finished SFT start"):
        ablation.main(["--small", "--out", str(tmp_path / "x"), "--sft_from", str(tmp_path / "nowhere")])


@pytest.mark.parametrize("binding", ["RLConfig.memory_coef=0.3", 'RolloutConfig.context_steps="full"'])
def test_an_arm_defining_binding_is_refused(tmp_path, binding):
    # the arm's own binding comes last and would silently override it (a lever that never acted)
    with pytest.raises(SystemExit, match="defines an arm.*--memory_coef"):
        ablation.main(["--out", str(tmp_path), "--gin_param", binding])
    assert not any(tmp_path.iterdir())
