"""The package: pyproject.toml agrees with requirements*.txt and lists every subpackage; the shipped
recipes load by name from any working directory, with includes found beside the including file or
among the shipped recipes; a shipped prompt file named in a recipe is found from anywhere."""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

from mempo_jax import recipes
from mempo_jax.config_loader import load_config
from mempo_jax.text.chat_template import system_prompt

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _requirements(path: pathlib.Path) -> list[str]:
    """The requirement lines of a requirements file: comments, blanks and ``-r`` includes dropped."""
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "-r"))]


def test_runtime_and_test_pins_match_the_requirements_files():
    assert PYPROJECT["project"]["dependencies"] == _requirements(REPO / "requirements.txt")
    assert PYPROJECT["project"]["optional-dependencies"]["test"] == _requirements(REPO / "requirements-test.txt")
    jax_range = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("jax>="))[len("jax"):]
    assert PYPROJECT["project"]["optional-dependencies"]["cuda"] == [f"jax[cuda12]{jax_range}"]
    assert PYPROJECT["project"]["optional-dependencies"]["tpu"] == [f"jax[tpu]{jax_range}"]


def test_ci_pins_the_lowest_version_of_every_range():
    """.ci/constraints-lowest.txt pins each ranged requirement at its lower bound (what CI's whole
    suite installs), and every ranged requirement has a pin there."""
    ranged = {m.group(1): m.group(2) for d in PYPROJECT["project"]["dependencies"]
              if (m := re.fullmatch(r"([\w-]+)>=([\d.]+),<[\d.]+", d))}
    pins = dict(line.split("==") for line in _requirements(REPO / ".ci" / "constraints-lowest.txt"))
    assert ranged == pins and {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"} <= set(pins)


def test_every_subpackage_and_the_recipes_are_packaged():
    folders = sorted(".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "mempo_jax").rglob("__init__.py"))
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    assert sorted(p for p in listed if p != "mempo_jax.configs") == folders
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"mempo_jax.configs": "configs"}


def test_console_scripts_name_existing_functions():
    import importlib

    scripts = PYPROJECT["project"]["scripts"]
    assert {"mempo-train", "mempo-evaluate", "mempo-plan", "mempo-retrieve-server"} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(vars(importlib.import_module(module))[func]), target


def test_recipe_names_and_resolution(tmp_path, monkeypatch):
    assert {"tiny_world", "hotpotqa", "smollm2_hotpotqa"} <= set(recipes.recipe_names())
    monkeypatch.chdir(tmp_path)
    shipped = recipes.RECIPES_DIR / "smollm2_hotpotqa.gin"
    for name in ("smollm2_hotpotqa", "smollm2_hotpotqa.gin", "configs/smollm2_hotpotqa.gin"):
        assert pathlib.Path(recipes.resolve_recipe(name)).resolve() == shipped.resolve(), name
    own = tmp_path / "tiny_world.gin"  # a file in the working directory wins over the shipped one
    own.write_text("RLConfig.steps = 1\n")
    assert recipes.resolve_recipe("tiny_world") == "tiny_world.gin"
    assert recipes.resolve_recipe("no_such_recipe") == "no_such_recipe"


def test_shipped_recipes_load_by_name_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["smollm2_hotpotqa"])  # includes 'configs/tiny_world.gin'
    assert cfg.dataset == "hotpotqa" and cfg.rl.rollout.context_steps == 1
    assert load_config(["hotpotqa"], ["RLConfig.steps = 5"]).rl.steps == 5


def test_every_shipped_recipe_loads_where_a_configs_folder_is_importable(tmp_path, monkeypatch):
    """gin's package-resource reader turns ``include 'configs/x.gin'`` into the package ``configs``;
    a ``configs`` folder importable from ``sys.path`` (a namespace package: a benchmark run from its
    own folder puts the repository root there) makes it raise a TypeError naming no file. The shipped
    recipes include bare names, which never reach that reader."""
    (tmp_path / "root" / "configs").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    for name in recipes.recipe_names():
        for line in (recipes.RECIPES_DIR / f"{name}.gin").read_text().splitlines():
            assert not (line.startswith("include") and "/" in line), (name, line)
        load_config([name])


@pytest.mark.parametrize("include", ["tiny_world.gin", "mine/base.gin"])
def test_includes_are_found_beside_the_file_or_among_the_recipes(tmp_path, monkeypatch, include):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.gin").write_text("include 'tiny_world.gin'\nRLConfig.steps = 7\n")
    user = tmp_path / "mine" / "exp.gin"
    user.write_text(f"include '{include}'\nRLConfig.group_size = 2\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere if include != "mine/base.gin" else tmp_path)
    cfg = load_config([str(user)])
    assert cfg.rl.group_size == 2 and cfg.dataset == "tiny_world"
    assert cfg.rl.steps == (7 if include == "mine/base.gin" else 8)  # tiny_world.gin binds 8


def test_an_include_read_as_an_importable_package_is_explained(tmp_path, monkeypatch):
    """``include 'configs/x.gin'`` beside the including file, run where another ``configs`` folder is
    importable: gin's package reader fails with a TypeError naming no file; the error says why and
    what to write, and the bare name loads."""
    (tmp_path / "mine" / "configs").mkdir(parents=True)
    (tmp_path / "mine" / "configs" / "base.gin").write_text("include 'tiny_world.gin'\nRLConfig.steps = 7\n")
    (tmp_path / "mine" / "base.gin").write_text("include 'tiny_world.gin'\nRLConfig.steps = 7\n")
    user = tmp_path / "mine" / "exp.gin"
    user.write_text("include 'configs/base.gin'\n")
    (tmp_path / "run" / "configs").mkdir(parents=True)  # an importable namespace package named configs
    monkeypatch.chdir(tmp_path / "run")
    monkeypatch.syspath_prepend(str(tmp_path / "run"))
    with pytest.raises(ValueError) as e:
        load_config([str(user)])
    msg = str(e.value)  # the package's folders: this one first, and any other `configs` on sys.path
    assert msg.startswith(
        f"config error: expected str, bytes or os.PathLike object, not NoneType ({user}:1: include "
        f"'configs/base.gin'); gin looked for it inside the importable Python package 'configs' "
        f"({tmp_path / 'run' / 'configs'}"), msg
    assert msg.endswith("): include it by its bare name, or by an absolute path"), msg
    user.write_text("include 'base.gin'\n")
    assert load_config([str(user)]).rl.steps == 7


def test_a_recipe_prompt_file_is_found_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = system_prompt(("search",), "configs/prompts/mempo_search_short.txt")
    assert text == system_prompt(("search",), str(recipes.RECIPES_DIR / "prompts" / "mempo_search_short.txt"))
    with pytest.raises(FileNotFoundError, match="system prompt file not found: nope.txt"):
        system_prompt(("search",), "nope.txt")


def test_include_lookup_logs_nothing(tmp_path, monkeypatch, caplog):
    """gin's package-resource reader logs "Path not found: F" for each folder an include is not in;
    a recipe that loads prints no such line."""
    import logging

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    load_config(["smollm2_hotpotqa"])
    assert not [r for r in caplog.records if str(r.msg).startswith("Path not found")]
    assert not logging.getLogger().filters  # the filter is removed after the parse


def test_usage_names_the_command_as_run(monkeypatch):
    from mempo_jax.commands.cli import command_name

    monkeypatch.setattr("sys.argv", ["/venv/bin/mempo-train", "--help"])
    assert command_name("mempo_jax.commands.train") == "mempo-train"
    monkeypatch.setattr("sys.argv", ["/repo/mempo_jax/train.py", "--help"])
    assert command_name("mempo_jax.commands.train") == "python -m mempo_jax.commands.train"
