"""The shipped recipes (``configs/*.gin``) and the files they name, found from any working directory.

In a source checkout the recipes are the repository's ``configs/`` folder; an installed package
carries the same files as ``mempo_jax/configs/`` (``pyproject.toml``). ``RECIPES_DIR`` is whichever
of the two exists. A recipe is named by a path (``configs/tiny_world.gin``, ``my.gin``) or by its
name (``tiny_world``, ``smollm2_hotpotqa.gin``); an ``include`` inside a gin file, and a relative
``ModelOptions.system_prompt_path``, is looked up in the working directory, then beside the
including file, then among the shipped recipes (``configs/X`` and ``X`` both name a shipped file).
"""

from __future__ import annotations

import os
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent
# Installed: mempo_jax/configs; source checkout: <repository>/configs.
RECIPES_DIR = next((d for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs") if d.is_dir()), _PACKAGE / "configs")
DEFAULT_RECIPE = "tiny_world"


def recipe_names() -> list[str]:
    """The shipped recipes' names (``configs/*.gin`` without the suffix), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.gin"))


def _shipped_candidates(name: str) -> list[pathlib.Path]:
    """Where a relative ``name`` may sit among the shipped files: ``RECIPES_DIR/name`` and, for a
    name starting ``configs/``, the same path under ``RECIPES_DIR``'s parent."""
    return [RECIPES_DIR / name, RECIPES_DIR.parent / name]


def find_file(name: str | os.PathLike, beside: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The file ``name`` names, or ``None``.

    Looked up as given (absolute, or relative to the working directory), then relative to the
    folder ``beside`` (an including gin file's folder), then among the shipped files
    (``RECIPES_DIR/name``, and ``configs/...`` under ``RECIPES_DIR``'s parent).
    """
    path = pathlib.Path(name)
    if path.is_file():
        return path
    if path.is_absolute():
        return None
    candidates = ([pathlib.Path(beside) / path] if beside is not None else []) + _shipped_candidates(str(path))
    return next((c for c in candidates if c.is_file()), None)


def resolve_recipe(name: str | os.PathLike) -> str:
    """The gin file a ``--gin_file`` value names: a path (``find_file``), or a shipped recipe's
    name with or without ``.gin`` (``smollm2_hotpotqa``). An unknown name is returned unchanged
    (``config_loader.load_config`` then reports it, listing ``recipe_names()``)."""
    text = str(name)
    for candidate in (text, text + ".gin") if not text.endswith(".gin") else (text,):
        found = find_file(candidate)
        if found is not None:
            return str(found)
    return text


def search_dirs(gin_files) -> list[str]:
    """The folders gin searches for an ``include`` (after the working directory): each given file's
    folder, ``RECIPES_DIR`` and its parent (so ``include 'tiny_world.gin'`` finds the shipped
    recipe, as ``include 'configs/tiny_world.gin'`` does unless a ``configs`` folder is importable
    from ``sys.path``: gin's package-resource reader then fails on it; write the bare name)."""
    dirs = [str(pathlib.Path(f).resolve().parent) for f in gin_files]
    dirs += [str(RECIPES_DIR), str(RECIPES_DIR.parent)]
    return list(dict.fromkeys(dirs))


def gin_file_help(default: str | None = DEFAULT_RECIPE) -> str:
    """The ``--gin_file`` help text of the command-line tools: what a value may be, the shipped
    recipes, and the default (``None``: no default)."""
    tail = f"; default {default}" if default else ""
    return (f"gin config, repeatable: a path, or a shipped recipe by name ({', '.join(recipe_names())}){tail}")
