"""A binding of a field in ``config_loader.RETIRED_FIELDS``, in a recipe, a ``--gin_param`` or a run
folder's ``config.gin``, is refused at start-up with one line naming the field to bind instead."""

from __future__ import annotations

import pathlib

import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.commands import plan
from mempo_jax.config import DEFAULT_GIN
from mempo_jax.config_loader import RETIRED_FIELDS
from mempo_jax.run.run_folder import DEFAULT_TOPK, run_rollout_options


def _expected(old: str, new: str | None) -> str:
    return f"{old} moved to {new}; bind {new} instead" if new else f"{old} was removed; delete the binding"


@pytest.mark.parametrize("old, new", sorted(RETIRED_FIELDS.items()))
def test_a_retired_field_in_a_recipe_is_one_line_naming_its_replacement(old, new, tmp_path, capsys):
    recipe = tmp_path / "mine.gin"
    recipe.write_text(f"include 'tiny_world.gin'\n{old} = 1\n")
    assert plan.main(["--gin_file", str(recipe)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: config error: {_expected(old, new)} ({recipe}:2: {old} = 1)"]
    assert plan.main(["--gin_file", "tiny_world", "--gin_param", f"{old}=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: config error: {_expected(old, new)} (--gin_param {old}=1)"]


def test_a_run_folder_written_with_a_retired_field_is_refused_in_one_line(tmp_path, capsys):
    """The evaluation reads the run's rollout options from its ``config.gin``; one that binds a
    retired field is one warning line, and the defaults are used."""
    gin = tmp_path / "config.gin"
    gin.write_text(pathlib.Path(DEFAULT_GIN).read_text() + "\nRLConfig.memory_norm = 'center'\n")
    assert run_rollout_options(tmp_path) == (RolloutConfig(), DEFAULT_TOPK, "defaults (config.gin unreadable)")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "RLConfig.memory_norm moved to MemoryRewardConfig.norm" in err[0], err
