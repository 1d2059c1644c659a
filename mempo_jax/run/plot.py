"""Learning curves of one or more run folders as a PNG (the ``mempo-plot`` command draws them).

Reads each folder's ``metrics.jsonl`` (what ``python -m mempo_jax.commands.train`` writes: one JSON object per
line with ``stage``, ``step`` and the stage's metrics) and draws one panel per metric of the chosen
training stage (default ``rl``), one line per run, plus a last panel with the held-out F1 of every
evaluation the runs hold (``eval_<stage>_<mode>`` lines: base, sft, rl; one line per run and
context mode). Lines are the raw values (thin) and their trailing moving average over ``--smooth``
steps (thick). Runs are labelled by their folder names, so comparing arms (MemPO against GRPO from
the same SFT start) is ``mempo-plot runs/mempo runs/grpo``.

Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import io
import pathlib
from typing import Mapping, Sequence

import numpy as np

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.run.metrics import read_jsonl

# the training reward; the share of groups whose outcome scores are all equal (their outcome advantage
# is 0: docs/algorithm.md section 5); how often an episode ends with an answer; the memory reward; KL
DEFAULT_KEYS = ("critic/score/mean", "critic/score/zero_std_groups", "answered/rate", "mem/reward/mean",
                "actor/kl_loss")
EVAL_STAGES = ("base", "sft", "rl")  # the trainer's evaluation points, in the order they run


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` finite values up to each index (fewer at the start).

    ``[n]`` float64; a NaN input stays NaN at its index and is left out of the later means.
    ``window <= 1`` returns the values.
    """
    v = np.asarray(values, np.float64)
    if window <= 1:
        return v.copy()
    out = np.full_like(v, np.nan)
    for i in range(len(v)):
        if np.isnan(v[i]):
            continue
        w = v[max(0, i - window + 1): i + 1]
        out[i] = np.nanmean(w)
    return out


def stage_series(records: Sequence[Mapping], stage: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``key`` over the ``stage`` lines of a metrics log, in step order; a
    step logged twice (a resumed run re-logs nothing, but a copied log might) keeps its last value.
    Missing or null values read NaN."""
    by_step: dict[int, float] = {}
    for r in records:
        if r.get("stage") == stage and "step" in r:
            v = r.get(key)
            by_step[int(r["step"])] = float("nan") if v is None else float(v)
    steps = np.asarray(sorted(by_step), np.int64)
    return steps, np.asarray([by_step[s] for s in steps], np.float64)


def eval_points(records: Sequence[Mapping], metric: str = "f1") -> dict[str, list[tuple[str, float]]]:
    """``{mode: [(stage, value), …]}`` of the ``eval_<stage>_<mode>`` lines, stages in
    ``EVAL_STAGES`` order (the last line of a stage and mode wins)."""
    found: dict[tuple[str, str], float] = {}
    for r in records:
        name = str(r.get("stage", ""))
        if not name.startswith("eval_") or metric not in r:
            continue
        stage, _, mode = name[len("eval_"):].partition("_")
        if stage in EVAL_STAGES and mode:
            found[(stage, mode)] = float(r[metric])
    modes = sorted({m for _, m in found}, key=lambda m: (m == "full", m))
    return {m: [(s, found[(s, m)]) for s in EVAL_STAGES if (s, m) in found] for m in modes}


def plot_runs(run_dirs: Sequence[str | pathlib.Path], out: str | pathlib.Path, keys: Sequence[str] = DEFAULT_KEYS,
              stage: str = "rl", smooth: int = 5, title: str = ""):
    """Writes the curves of ``run_dirs`` to ``out`` (PNG, 120 dpi) and returns the figure's axes.
    Run folders and ``out`` may be local or ``gs://…`` (``out`` is written whole,
    ``paths.write_bytes_atomic``).

    Raises:
      FileNotFoundError: a folder without ``metrics.jsonl`` (named in the message).
      ValueError: no folder logs any of ``keys`` at ``stage``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {}
    for d in run_dirs:
        path = run_path(d) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no metrics log (is {d} a run folder of mempo_jax.commands.train?)")
        logs[run_path(d).name if paths.is_remote(d) else pathlib.Path(d).resolve().name] = read_jsonl(path)
    present = [k for k in keys if any(np.isfinite(stage_series(r, stage, k)[1]).any() for r in logs.values())]
    if not present:
        raise ValueError(f"none of {', '.join(keys)} is logged at stage {stage!r} in {', '.join(map(str, run_dirs))}")
    n = len(present) + 1
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, present):
        for i, (name, records) in enumerate(logs.items()):
            steps, vals = stage_series(records, stage, key)
            if not len(steps):
                continue
            c = colors[i % len(colors)]
            ax.plot(steps, vals, color=c, alpha=0.35, linewidth=0.8)
            ax.plot(steps, moving_average(vals, smooth), color=c, linewidth=2.0, label=name)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(f"{stage} step")
        ax.grid(alpha=0.3)
    ax = axes.flat[len(present)]
    for i, (name, records) in enumerate(logs.items()):
        for j, (mode, pts) in enumerate(eval_points(records).items()):
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", color=colors[i % len(colors)],
                        linestyle=("-", "--", ":")[j % 3], label=f"{name} {mode}")
    ax.set_title("held-out F1", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    for extra in list(axes.flat)[n:]:
        extra.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if paths.is_remote(out):
        buf = io.BytesIO()
        fig.savefig(buf, dpi=120, format="png")
        paths.write_bytes_atomic(run_path(out), buf.getvalue())
    else:
        fig.savefig(out, dpi=120)
    plt.close(fig)
    return axes
