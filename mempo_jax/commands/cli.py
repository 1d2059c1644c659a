"""What the command-line tools share: the name a usage line shows."""

from __future__ import annotations

import os
import sys


def command_name(module: str) -> str:
    """The command as the user ran it, for ``argparse``'s ``prog``: the console script's name
    (``mempo-train``, installed by ``pyproject.toml``) when run as one, else ``python -m module``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("mempo-") else f"python -m {module}"
