"""mempo-plot: learning curves of run folders (the real matplotlib figure, its line data read back)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mempo_jax.commands.plot import main
from mempo_jax.run.plot import eval_points, moving_average, plot_runs, stage_series


def _write_run(folder, rewards, f1s):
    folder.mkdir()
    lines = [{"stage": "eval_base_k1", "step": 0, "f1": f1s[0]}, {"stage": "sft", "step": 0, "sft/loss": 2.0}]
    lines += [{"stage": "rl", "step": i, "critic/score/mean": r, "critic/score/zero_std_groups": 1.0 - r,
               "mem/reward/mean": None} for i, r in enumerate(rewards)]
    lines += [{"stage": "eval_sft_k1", "step": 5, "f1": f1s[1]}, {"stage": "eval_rl_k1", "step": 9, "f1": f1s[2]},
              {"stage": "eval_rl_full", "step": 9, "f1": 0.5}]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{\"stage\": \"rl\", \"st"  # a torn last line (a kill mid-write)
    (folder / "metrics.jsonl").write_text(text)


def test_moving_average_is_the_trailing_mean_and_skips_nan():
    v = [1.0, 3.0, np.nan, 5.0, 7.0]
    np.testing.assert_allclose(moving_average(v, 2), [1.0, 2.0, np.nan, 5.0, 6.0])
    np.testing.assert_allclose(moving_average(v, 3), [1.0, 2.0, np.nan, 4.0, 6.0])  # (3 + 5) / 2, (5 + 7) / 2
    np.testing.assert_allclose(moving_average(v, 1), v)


def test_series_keep_step_order_last_value_and_read_null_as_nan():
    recs = [{"stage": "rl", "step": 2, "k": 1.0}, {"stage": "rl", "step": 0, "k": 4.0}, {"stage": "rl", "step": 2, "k": 9.0},
            {"stage": "sft", "step": 1, "k": 7.0}, {"stage": "rl", "step": 1, "k": None}]
    steps, vals = stage_series(recs, "rl", "k")
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(vals, [4.0, np.nan, 9.0])
    assert eval_points([{"stage": "eval_rl_k1", "f1": 0.3}, {"stage": "eval_base_k1", "f1": 0.1},
                        {"stage": "eval_sft_full", "f1": 0.2}]) == {"k1": [("base", 0.1), ("rl", 0.3)],
                                                                  "full": [("sft", 0.2)]}


def test_two_runs_draw_one_line_each_with_their_values(tmp_path):
    _write_run(tmp_path / "mempo", [0.0, 0.5, 1.0], (0.0, 0.2, 0.4))
    _write_run(tmp_path / "grpo", [0.25, 0.25], (0.0, 0.2, 0.3))
    axes = plot_runs([tmp_path / "mempo", tmp_path / "grpo"], tmp_path / "c.png", smooth=2)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reward, zero_std, held_out = axes.flat[0], axes.flat[1], axes.flat[2]  # mem/reward/mean is all null: no panel
    assert reward.get_title() == "critic/score/mean" and held_out.get_title() == "held-out F1"
    assert zero_std.get_title() == "critic/score/zero_std_groups"
    np.testing.assert_allclose(zero_std.lines[0].get_ydata(), [1.0, 0.5, 0.0])  # mempo, raw
    thick = [ln for ln in reward.lines if ln.get_label() in ("mempo", "grpo")]
    np.testing.assert_allclose(thick[0].get_ydata(), [0.0, 0.25, 0.75])
    np.testing.assert_allclose(thick[1].get_ydata(), [0.25, 0.25])
    by_label = {ln.get_label(): list(ln.get_ydata()) for ln in held_out.lines}
    assert by_label == {"mempo k1": [0.0, 0.2, 0.4], "mempo full": [0.5], "grpo k1": [0.0, 0.2, 0.3], "grpo full": [0.5]}


def test_bad_folders_and_keys_are_one_line_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nowhere/metrics.jsonl: no metrics log" in capsys.readouterr().err
    _write_run(tmp_path / "r", [0.1], (0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="none of actor/typo is logged at stage 'rl'"):
        plot_runs([tmp_path / "r"], tmp_path / "x.png", keys=("actor/typo",))
