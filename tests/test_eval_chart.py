"""eval.png: EM, F1, format-fail rate and TT per dataset and mode, every bar labelled with its value,
so a chart of all-zero scores is readable (the real matplotlib figure, its text read back)."""

from __future__ import annotations

from mempo_jax.run.eval_report import CHART_PANELS, chart_figure, write_chart


def _labels(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_all_zero_scores_are_labelled(tmp_path):
    results = {name: {mode: {"em": 0.0, "f1": 0.0, "format_fail": 1.0, "tt": 2100.0} for mode in ("k1", "full")}
               for name in ("bamboogle", "hotpotqa")}
    fig, axes = chart_figure(results)
    panels = {ax.get_title(): ax for ax in axes.flat}
    assert list(panels) == [label for _, label, _ in CHART_PANELS]
    assert _labels(panels["EM"]) == ["0.00"] * 4 and _labels(panels["F1"]) == ["0.00"] * 4
    assert _labels(panels["format-fail rate"]) == ["1.00"] * 4
    assert _labels(panels["TT (tokens / question)"]) == ["2100"] * 4
    assert [t.get_text() for t in panels["EM"].get_xticklabels()] == ["bamboogle", "hotpotqa"]
    assert panels["EM"].get_ylim() == (0.0, 1.12)
    write_chart(results, tmp_path / "eval.png", "title")
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_mode_reads_n_a():
    results = {"a": {"k1": {"em": 0.5, "f1": 0.25, "format_fail": 0.0, "tt": 10.0}, "full": {"em": 1.0, "f1": 1.0,
               "format_fail": 0.0, "tt": 30.0}}, "b": {"k1": {"em": 0.0, "f1": 0.0, "format_fail": 0.0, "tt": 5.0}}}
    _, axes = chart_figure(results)
    assert _labels(axes.flat[0]) == ["0.50", "0.00", "1.00", "n/a"]  # k1 bars (a, b), then full bars (a, b)
    assert _labels(axes.flat[3]) == ["10", "5", "30", "n/a"]
