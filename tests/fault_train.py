"""Test-only entry point: the trainer with injected faults, for the subprocess tests.

``python tests/fault_train.py [--nan_grad_steps 2,4-6] [--sigterm_rollout_step 3] [--sigkill_rollout_step 1]
[--sigkill_update_step 1] TRAIN_ARGS…`` runs
``mempo_jax.commands.train.main(TRAIN_ARGS, hooks=FaultHooks(...))``: the product's command line
(``python -m mempo_jax.commands.train``) injects nothing. A malformed fault value is a one-line error
(exit status 2).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository's mempo_jax

from mempo_jax.run.faults import FaultHooks  # noqa: E402


def parse_steps(text: str) -> frozenset[int]:
    """``"2,4-6"`` → ``{2, 4, 5, 6}``.

    Raises:
      argparse.ArgumentTypeError: a part that is not ``N`` or ``N-M``.
    """
    out: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must look like '1,3-5', got {text!r}") from None
    return frozenset(out)


def fault_command(faults: dict) -> list[str]:
    """The command-line head that runs this file with ``faults`` (``{"nan_grad_steps": "2,4-6"}``)."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve())]
    for name, value in faults.items():
        cmd += [f"--{name}", str(value)]
    return cmd


def main(argv=None) -> int:
    """Parse the fault options, then run the trainer on the rest of ``argv`` with them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nan_grad_steps", type=parse_steps, default=frozenset())
    p.add_argument("--sigterm_rollout_step", type=int, default=None)
    p.add_argument("--sigkill_rollout_step", type=int, default=None)
    p.add_argument("--sigkill_update_step", type=int, default=None)
    faults, rest = p.parse_known_args(argv)
    from mempo_jax.commands import train

    return train.main(rest, hooks=FaultHooks(faults.nan_grad_steps, faults.sigterm_rollout_step,
                                             faults.sigkill_rollout_step, faults.sigkill_update_step))


if __name__ == "__main__":
    sys.exit(main())
