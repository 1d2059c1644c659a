"""Learning curves of run folders as a PNG (``mempo-plot``)::

    python -m mempo_jax.commands.plot RUN_DIR [RUN_DIR …] [--out curves.png] [--keys K,…] [--stage rl]
        [--smooth 5] [--title T]

Draws ``mempo_jax.run.plot.plot_runs``: one panel per metric of the chosen training stage, one line
per run, and the held-out F1 of every evaluation. Exit status: 0 written (the PNG's path printed),
2 a missing metrics log or a bad argument (one ``error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import sys

from mempo_jax.commands.cli import command_name
from mempo_jax.run.plot import DEFAULT_KEYS, plot_runs


def main(argv=None) -> int:
    """Draw the curves; returns 0, or 2 after one ``error: …`` line on stderr."""
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.plot"), description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="run folders of python -m mempo_jax.commands.train")
    p.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    p.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated metric names (default %(default)s)")
    p.add_argument("--stage", default="rl", help="training stage whose steps are the x axis: rl or sft (default rl)")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window in steps (default 5; 1 = none)")
    p.add_argument("--title", default="", help="figure title")
    a = p.parse_args(argv)
    try:
        plot_runs(a.run_dirs, a.out, [k for k in a.keys.split(",") if k], a.stage, a.smooth, a.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
