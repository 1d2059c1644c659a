"""Orbax checkpoints of the training state.

A checkpoint holds the policy parameters, the optimizer state and a JSON metadata item (stage,
step, seed, and what a resume needs). Orbax writes each step to
a temporary folder and renames it when complete, so a killed save is never taken for a complete
one; ``CheckpointManager`` keeps the last ``max_to_keep``. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore the policy parameters, the optimizer state and JSON metadata.

    The three are separate orbax items (``params``, ``opt_state``, ``meta``), so a policy can be
    restored without knowing the optimizer that trained it.

    Args:
      directory: the checkpoint folder (``RUN_DIR/checkpoints``).
      max_to_keep: how many of the newest checkpoints are kept.
      async_save: save in a background thread (``wait()`` before exit).
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("params", "opt_state", "meta"))

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Save checkpoint ``step``: two pytrees of arrays and JSON-able ``meta``."""
        self._mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                     opt_state=ocp.args.StandardSave(opt_state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or ``None``."""
        return self._mgr.latest_step()

    def restore(self, step: int, params: Any, opt_state: Any = None) -> tuple[Any, Any, dict]:
        """Restore checkpoint ``step`` into the structure (and shardings) of the given targets.

        ``opt_state=None`` restores parameters and metadata only.

        Raises:
          ValueError: if the stored arrays do not match the targets' shapes (another model shape).
        """
        items = {"params": ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, params)),
                 "meta": ocp.args.JsonRestore()}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, opt_state))
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step} does not match this model: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from None
        return out["params"], (out["opt_state"] if opt_state is not None else None), dict(out["meta"])

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for saves and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()


def save_run_artifacts(run_dir: str | os.PathLike, tokenizer, model_cfg) -> None:
    """Copy the tokenizer model to ``RUN_DIR/tokenizer.model`` and write ``RUN_DIR/model_config.json``
    (the ``ModelConfig`` fields), so a run folder alone is enough to rebuild its policy."""
    run_dir = pathlib.Path(run_dir)
    src = pathlib.Path(tokenizer.path)
    dst = run_dir / "tokenizer.model"
    if src.resolve() != dst.resolve():
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    tmp = run_dir / "model_config.json.tmp"
    tmp.write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2), encoding="utf-8")
    os.replace(tmp, run_dir / "model_config.json")


def load_policy(run_dir: str | os.PathLike, step: Optional[int] = None):
    """Rebuild a trained policy from a run folder written by ``python -m mempo_jax.train``.

    Args:
      run_dir: the run folder (``tokenizer.model``, ``model_config.json``, ``checkpoints/``).
      step: checkpoint step (default: the latest complete one).

    Returns:
      ``(tokenizer, model_cfg, graphdef, params)``.

    Raises:
      FileNotFoundError: if the folder lacks one of those files or any checkpoint.
      ValueError: if the checkpoint does not match ``model_config.json``.
    """
    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import create_model, split_model
    from mempo_jax.tokenizer import SentencePieceTokenizer

    run_dir = pathlib.Path(run_dir)
    for name in ("tokenizer.model", "model_config.json", "checkpoints"):
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} not found: is {run_dir} a run folder of mempo_jax.train?")
    tokenizer = SentencePieceTokenizer(run_dir / "tokenizer.model")
    fields = json.loads((run_dir / "model_config.json").read_text(encoding="utf-8"))
    if isinstance(fields.get("rope_scaling"), list):
        fields["rope_scaling"] = tuple(tuple(x) for x in fields["rope_scaling"])
    model_cfg = ModelConfig(**fields)
    graphdef, params = split_model(create_model(model_cfg, seed=0))
    ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    params, _, _ = ckpt.restore(step, params)
    ckpt.close()
    return tokenizer, model_cfg, graphdef, params
