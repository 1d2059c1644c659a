"""What a run folder of the trainer says about itself: its complete checkpoint steps, and the
rollout and model options and the source checkpoint it was trained with (read from
``RUN_DIR/config.gin``). A run folder is a local path or ``gs://…`` (``core.paths.run_path``)."""

from __future__ import annotations

import os
import pathlib
import sys

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.config import ExperimentConfig, ModelOptions
from mempo_jax.config_loader import load_config
from mempo_jax.run.experiment import policy_format
from mempo_jax.run.export_protocol import ExportProtocol

DEFAULT_TOPK = 3  # Search-R1 / MemPO reference range 3–5, used when the run folder has no config.gin


CHECKPOINT_FOLDERS = ("checkpoints", "sft_checkpoint")  # a run folder's RL and SFT checkpoints


def checkpoint_steps(run_dir: str | os.PathLike, folder: str = "checkpoints") -> list[int]:
    """Steps of the complete checkpoints under ``RUN_DIR/folder`` (``checkpoints``: RL;
    ``sft_checkpoint``: SFT), ascending.

    Orbax writes a local step to a temporary folder (``N.orbax-checkpoint-tmp-…``) and renames it to
    ``N`` when complete, so only all-digit folder names count; on Cloud Storage only those that
    also hold ``commit_success.txt`` (``paths.complete_steps``).
    """
    return paths.complete_steps(run_path(run_dir) / folder)


def _run_config(run_dir) -> tuple[ExperimentConfig | None, str]:
    """``(ExperimentConfig or None, note)`` from ``RUN_DIR/config.gin`` (``None``: absent, or refused by
    ``config_loader.load_config``, e.g. a binding of a field in ``config_loader.RETIRED_FIELDS``: one warning line)."""
    path = run_path(run_dir) / "config.gin"
    if not path.is_file():
        return None, "defaults (no config.gin)"
    try:
        return load_config([str(paths.local_copy(path))]), str(path)
    except ValueError as e:
        print(f"[evaluate] warning: {path} unreadable ({e}); using default rollout options", file=sys.stderr)
        return None, "defaults (config.gin unreadable)"


def run_rollout_options(run_dir) -> tuple[RolloutConfig, int, str]:
    """The rollout options and ``topk`` the run was trained with, read from ``RUN_DIR/config.gin``.

    Returns:
      ``(RolloutConfig, topk, note)``: defaults (``RolloutConfig()``, ``DEFAULT_TOPK``) when the file
      is absent or refused by ``config_loader.load_config``; ``note`` says which was used.
    """
    cfg, note = _run_config(run_dir)
    return (RolloutConfig(), DEFAULT_TOPK, note) if cfg is None else (cfg.rl.rollout, cfg.topk, note)


def run_model_options(run_dir) -> ModelOptions:
    """The run's ``ModelOptions`` (how its policy is prompted), default ones without a readable config."""
    cfg, _ = _run_config(run_dir)
    return ModelOptions() if cfg is None else cfg.model


def run_policy_format(run_dir, tokenizer):
    """The ``AgentFormat`` a run's policy was trained with: ``experiment.policy_format`` over the
    run's ``ModelOptions`` and its saved tokenizer folder (``tokenizer.path.parent``: the chat
    template the run copied), so it does not depend on the directory a command runs from.

    Args:
      run_dir: the run folder (``RUN_DIR/config.gin``; default options without one).
      tokenizer: the run's tokenizer, as ``checkpoint.load_policy`` returns it.
    """
    return policy_format(run_model_options(run_dir), tokenizer, folder=tokenizer.path.parent)


def run_source_checkpoint(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """The Hugging Face folder a run started from (``ModelOptions.checkpoint`` in
    ``RUN_DIR/config.gin``) when it still exists, else None."""
    gin_file = run_path(run_dir) / "config.gin"
    try:
        source = load_config([str(paths.local_copy(gin_file))]).model.checkpoint if gin_file.is_file() else ""
    except ValueError:
        return None
    return pathlib.Path(source) if source and (pathlib.Path(source) / "config.json").is_file() else None


def run_protocol(run_dir: str | os.PathLike, tokenizer) -> ExportProtocol | None:
    """The protocol a run's policy was trained with (``run.export_protocol``): its system prompt as
    ``experiment.policy_format`` builds it over the run's saved tokenizer, tags, top-k and rollout
    budgets; None without a readable ``RUN_DIR/config.gin``."""
    cfg, _ = _run_config(run_dir)
    if cfg is None:
        return None
    fmt = policy_format(cfg.model, tokenizer, folder=tokenizer.path.parent)  # run_policy_format, config read once
    return ExportProtocol.of_run(cfg, fmt.system_prompt)
