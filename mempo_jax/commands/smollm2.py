"""SmolLM2-135M-Instruct as a Hugging Face folder, offline (``mempo-smollm2``)::

    python -m mempo_jax.commands.smollm2 [DIR] [--force]   # default $MEMPO_CACHE/smollm2-135m-instruct

Runs ``mempo_jax.model.smollm2.convert`` (cached: a second call with the same GGUF file returns at
once; ``--force`` converts again) and prints the folder. Exit status: 0, or 2 with one ``error:``
line on stderr when the GGUF package or a converter dependency is missing.
"""

from __future__ import annotations

import argparse
import sys

from mempo_jax.model.smollm2 import convert, default_dir


def run_conversion(description: str, convert_fn, default, argv=None) -> int:
    """The conversion commands' CLI: ``[DIR] [--force]``, ``convert_fn(dir, force=)``'s folder
    printed; returns 0, or 2 after one ``error:`` line on stderr (a missing package or converter
    dependency, or a GGUF file that fails its checksum)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("dir", nargs="?", default=None, help=f"destination (default {default})")
    parser.add_argument("--force", action="store_true", help="convert again even when cached")
    args = parser.parse_args(argv)
    try:
        print(convert_fn(args.dir, force=args.force))
    except (FileNotFoundError, ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """Convert (or find cached) and print the folder; returns 0, or 2 after one line on failure."""
    return run_conversion(__doc__.splitlines()[0], convert, default_dir(), argv)


if __name__ == "__main__":
    sys.exit(main())
