"""An evaluation's report: the markdown table and the bar charts of ``{dataset: {mode: metrics}}``
(``eval.json``'s results)."""

from __future__ import annotations

import os

from mempo_jax.run.metrics import kind_cells, kind_columns


def format_table(results: dict) -> str:
    """Markdown table, one row per (dataset, mode): n, EM, F1, TT, PT, turns, tool calls, format
    fail, and EM per question kind (``metrics.kind_columns``: a QA file's ``type``, the tiny world's
    kinds; "-" where a dataset has no such kind)."""
    kinds, head, rule = kind_columns([m for modes in results.values() for m in modes.values()])
    lines = ["| dataset | mode | n | EM | F1 | TT | PT | turns | tool calls | format fail |" + head,
             "|---|---|---|---|---|---|---|---|---|---|" + rule]
    for name, modes in results.items():
        for mode, m in modes.items():
            lines.append(f"| {name} | {mode} | {m['n']} | {m['em']:.3f} | {m['f1']:.3f} | {m['tt']:.0f} | "
                         f"{m['pt']:.0f} | {m['turns']:.2f} | {m['tool_calls']:.2f} | {m['format_fail']:.3f} |"
                         + kind_cells(m, kinds))
    return "\n".join(lines)


CHART_PANELS = (("em", "EM", "%.2f"), ("f1", "F1", "%.2f"), ("format_fail", "format-fail rate", "%.2f"),
                ("tt", "TT (tokens / question)", "%.0f"))  # (result key, panel title, bar label format)


def write_chart(results: dict, path: str | os.PathLike, title: str = "") -> None:
    """Write ``chart_figure(results)`` as a PNG at ``path``, with ``title`` above the panels."""
    fig, axes = chart_figure(results)
    save_figure(fig, axes.flat[0], path, title)


def chart_figure(results: dict):
    """``(figure, axes [2, 2])``: four grouped bar charts, EM, F1, format-fail rate and TT (tokens
    per question), per dataset, one bar per context mode; every bar carries its value as text, so a
    chart whose scores are all 0 still reads "0.00" on each bar (a missing mode reads "n/a"). The
    three rates share the fixed axis [0, 1].

    Args:
      results: ``{dataset: {mode: {"em", "f1", "format_fail", "tt", …}}}`` (``eval.json``'s ``results``).

    Uses the matplotlib Agg backend (no display needed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(results)
    modes = list(dict.fromkeys(m for r in results.values() for m in r))
    x = np.arange(len(names))
    width = 0.8 / max(len(modes), 1)
    fig, axes = plt.subplots(2, 2, figsize=(max(7.0, 2.0 * len(names) * max(len(modes), 1) / 2 + 4), 6.4))
    for ax, (key, label, fmt) in zip(axes.flat, CHART_PANELS):
        for j, mode in enumerate(modes):
            vals = np.asarray([results[n].get(mode, {}).get(key, np.nan) for n in names], np.float64)
            bars = ax.bar(x + (j - (len(modes) - 1) / 2) * width, np.nan_to_num(vals), width, label=mode)
            ax.bar_label(bars, labels=["n/a" if np.isnan(v) else fmt % v for v in vals], fontsize=7, padding=1)
        ax.set_xticks(x, names)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        if key != "tt":
            ax.set_ylim(0, 1.12)
        else:
            ax.set_ylim(0, max(1.0, float(np.nanmax([r.get(m, {}).get("tt", 0.0) for r in results.values()
                                                      for m in modes] or [0.0]))) * 1.15)
    return fig, axes


def save_figure(fig, legend_axes, path: str | os.PathLike, title: str = "") -> None:
    """Writes a matplotlib figure as a PNG (120 dpi) and closes it: a "context" legend on
    ``legend_axes``, ``title`` (if any) above the panels, tight layout."""
    import matplotlib.pyplot as plt

    legend_axes.legend(title="context")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
