"""Orbax checkpoints of the training state.

A checkpoint holds the policy parameters, the optimizer state and a JSON metadata item (stage,
step, RNG seed state, the metric-log offset, the data-iterator state). Orbax writes each step to
a temporary folder and renames it when complete, so a killed save is never taken for a complete
one; ``CheckpointManager`` keeps the last ``max_to_keep``. Nothing is pickled.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore ``{"params", "opt_state"}`` pytrees plus JSON metadata.

    Args:
      directory: the checkpoint folder (``RUN_DIR/checkpoints``).
      max_to_keep: how many of the newest checkpoints are kept.
      async_save: save in a background thread (``wait()`` before exit).
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON-able) as checkpoint ``step``."""
        self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or ``None``."""
        return self._mgr.latest_step()

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` into the structure (and shardings) of ``target``.

        Raises:
          ValueError: if the stored arrays do not match ``target``'s shapes (another model shape).
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                  meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step} does not match this model: {str(e).splitlines()[0]}") from None
        return out.state, dict(out.meta)

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for saves and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()
