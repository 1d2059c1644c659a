"""Paired comparison of two held-out evaluations (``mempo-compare``)::

    python -m mempo_jax.commands.compare RUN_A[:STAGE] RUN_B[:STAGE] [--kinds bridge,multi] [--samples 2000]
        [--seed 0] [--json]

Prints ``mempo_jax.run.compare.format_comparison`` (``--json``: the result of ``compare``), and one
``note:`` line on stderr per caveat. Exit status: 0, or 2 for an evaluation that cannot be read or
compared (one ``error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from mempo_jax.commands.cli import command_name
from mempo_jax.run.compare import compare, format_comparison, load_evaluation, notes, only_kinds


def main(argv=None) -> int:
    """Compare; returns 0, or 2 after one ``error: …`` line on stderr."""
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.compare"), description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="RUN_DIR[:STAGE] (stage base, sft or rl; default rl), or a mempo-evaluate --out folder")
    p.add_argument("b", help="RUN_DIR[:STAGE] or mempo-evaluate --out folder to compare against")
    p.add_argument("--samples", type=_positive, default=2000,
                   help="bootstrap resamples (default %(default)s, as EvalConfig.bootstrap_samples)")
    p.add_argument("--seed", type=int, default=0,
                   help="bootstrap seed (default %(default)s; summary.json uses ExperimentConfig.seed)")
    p.add_argument("--kinds", default=None,
                   help="compare only questions of these kinds, comma-separated (e.g. bridge,multi: the kinds "
                        "recorded in the predictions files)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        a, b = load_evaluation(args.a), load_evaluation(args.b)
        if args.kinds:
            kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
            a, b = only_kinds(a, kinds), only_kinds(b, kinds)
        result = compare(a, b, args.samples, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_comparison(a, b, result))
    for line in notes(a, b):
        print(f"note: {line}", file=sys.stderr)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
