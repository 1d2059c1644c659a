"""Orbax checkpoints of the training state.

A checkpoint holds the policy parameters, the optimizer state and a JSON metadata item (stage,
step, seed, and what a resume needs: data-iterator state, metric-log offsets, fault counters,
RNG bookkeeping). Orbax writes each step to a temporary folder and renames it when complete, so
a killed save is never taken for a complete one (leftover temporary folders are removed when a
``Checkpointer`` opens the folder, see ``remove_partial_saves``); ``CheckpointManager`` keeps the last ``max_to_keep``.
Nothing is pickled: arrays are tensorstore/OCDBT, metadata is JSON.

Layout of a run folder (``python -m mempo_jax.train``): ``sft_checkpoint/N`` (SFT; the final one
is the frozen reference policy of RL), ``checkpoints/N`` (RL step N), ``model_config.json`` and
the tokenizer: ``tokenizer.model`` (our SentencePiece model) or, for a run from a Hugging Face
checkpoint, ``hf_tokenizer/`` (``tokenizer.json`` with the protocol tags the run added, and the
checkpoint's ``tokenizer_config.json`` / ``generation_config.json`` / chat template).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
        remove_partial_saves(self.directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("params", "opt_state", "meta"))

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Save checkpoint ``step``: two pytrees of arrays and JSON-able ``meta``.

        With ``async_save`` the call returns once the arrays are copied off the device (the
        caller may donate or overwrite them); the write finishes in the background and the step
        counts as complete only after its folder is renamed (``wait()`` / ``close()`` block).

        Raises:
          TypeError: ``meta`` is not JSON-serialisable.
        """
        json.dumps(meta)  # fail here, with the caller's frame, rather than in the writer thread
        self._mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                     opt_state=ocp.args.StandardSave(opt_state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or ``None``."""
        return self._mgr.latest_step()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(self._mgr.all_steps())

    def restore_meta(self, step: int) -> dict:
        """The JSON metadata of checkpoint ``step`` alone (no arrays are read).

        Raises:
          ValueError: the checkpoint has no readable metadata item.
        """
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step} has no readable metadata: "
                             f"{_first_line(e)}") from None
        return dict(out["meta"])

    def restore(self, step: int, params: Any, opt_state: Any = None) -> tuple[Any, Any, dict]:
        """Restore checkpoint ``step`` into the structure (and shardings) of the given targets.

        Args:
          step: the checkpoint step.
          params: target pytree: arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
          opt_state: target optimizer state, or ``None`` to restore parameters and metadata only.

        Returns:
          ``(params, opt_state or None, meta)``.

        Raises:
          ValueError: one line naming the checkpoint, if the stored arrays do not match the
            targets' shapes or structure (a checkpoint of another model shape or optimizer).
        """
        items = {"params": ocp.args.StandardRestore(jax.tree.map(_abstract, params)), "meta": ocp.args.JsonRestore()}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(jax.tree.map(_abstract, opt_state))
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step} does not match this model: {_first_line(e)}") from None
        _check_like(out["params"], params, f"{self.directory}/{step}")
        if opt_state is not None:
            _check_like(out["opt_state"], opt_state, f"{self.directory}/{step}")
        return out["params"], (out["opt_state"] if opt_state is not None else None), dict(out["meta"])

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for saves and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()


def remove_partial_saves(directory: str | os.PathLike) -> list[str]:
    """Delete the temporary folders of saves that never completed (``N.orbax-checkpoint-tmp…``,
    left by a killed process), synchronously, on process 0 only; returns their names.

    Orbax never lists them as steps; removing them here, not in orbax's background cleanup
    thread, keeps a run that exits at once (a one-line error) free of that thread's noise.
    """
    directory = pathlib.Path(directory)
    if jax.process_index() != 0 or not directory.is_dir():
        return []
    removed = []
    for p in directory.iterdir():
        if ".orbax-checkpoint-tmp" in p.name:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def _abstract(x):
    """A restore target; without a sharding, one on the default device (orbax would otherwise
    return numpy arrays of the *stored* shape without checking it)."""
    x = x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)
    if getattr(x, "sharding", None) is None:
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    return x


def _check_like(restored, target, where: str) -> None:
    """Every restored leaf has its target's shape and dtype (a ``ValueError`` names the first that does not)."""
    got = jax.tree_util.tree_flatten_with_path(restored)[0]
    want = jax.tree_util.tree_flatten_with_path(target)[0]
    if len(got) != len(want):
        raise ValueError(f"checkpoint {where} does not match this model: {len(got)} arrays stored, {len(want)} expected")
    for (path, a), (_, b) in zip(got, want):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(f"checkpoint {where} does not match this model: {jax.tree_util.keystr(path)} is stored as "
                             f"{a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


def read_checkpoint(directory: str | os.PathLike, step: Optional[int] = None) -> tuple[int, dict]:
    """Every item of a checkpoint as stored (numpy arrays, no target needed), for comparisons.

    Args:
      directory: a checkpoint folder (``RUN/checkpoints`` or ``RUN/sft_checkpoint``).
      step: the step (default: the newest complete one).

    Returns:
      ``(step, {"params": pytree, "opt_state": pytree, "meta": dict})``.

    Raises:
      FileNotFoundError: no complete checkpoint in ``directory``.
    """
    ckpt = Checkpointer(directory, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {directory}")
        out = ckpt._mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(),
                                                              opt_state=ocp.args.StandardRestore(),
                                                              meta=ocp.args.JsonRestore()))
        return step, {k: out[k] for k in ("params", "opt_state", "meta")}
    finally:
        ckpt.close()


SP_TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_DIR = "hf_tokenizer"


def _is_hf_tokenizer(tokenizer) -> bool:
    """An ``HFTokenizer`` (saved as a folder) rather than a SentencePiece model (one file)."""
    return callable(getattr(tokenizer, "save", None))


def _hf_tokenizer_json(tokenizer) -> Any:
    """The ``tokenizer.json`` a ``HFTokenizer`` writes, parsed (the in-memory tokenizer with its tags)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return json.loads((tokenizer.save(tmp) / "tokenizer.json").read_text(encoding="utf-8"))


def run_tokenizer_path(run_dir: str | os.PathLike) -> Optional[pathlib.Path]:
    """The tokenizer a run folder holds: ``RUN_DIR/hf_tokenizer`` (a folder with ``tokenizer.json``)
    when present, else ``RUN_DIR/tokenizer.model``, else None."""
    run_dir = pathlib.Path(run_dir)
    if (run_dir / HF_TOKENIZER_DIR / "tokenizer.json").is_file():
        return run_dir / HF_TOKENIZER_DIR
    if (run_dir / SP_TOKENIZER_FILE).is_file():
        return run_dir / SP_TOKENIZER_FILE
    return None


def load_run_tokenizer(run_dir: str | os.PathLike):
    """The run folder's tokenizer: ``HFTokenizer(RUN_DIR/hf_tokenizer)`` or
    ``SentencePieceTokenizer(RUN_DIR/tokenizer.model)`` (``run_tokenizer_path``).

    Raises:
      FileNotFoundError: the folder holds neither.
    """
    path = run_tokenizer_path(run_dir)
    if path is None:
        raise FileNotFoundError(f"{pathlib.Path(run_dir) / SP_TOKENIZER_FILE} (or {HF_TOKENIZER_DIR}/tokenizer.json) "
                                f"not found: is {run_dir} a run folder of mempo_jax.train?")
    if path.is_dir():
        from mempo_jax.hf_tokenizer import HFTokenizer

        return HFTokenizer(path)
    from mempo_jax.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(path)


def check_run_artifacts(run_dir: str | os.PathLike, tokenizer, model_cfg) -> None:
    """Before a run folder is resumed: its ``model_config.json`` and tokenizer (``tokenizer.model``
    or ``hf_tokenizer/tokenizer.json``) must be those this config builds (else the checkpoints
    belong to another model).

    Args:
      run_dir: the run folder; absent files are not checked.
      tokenizer: the tokenizer built now (SentencePiece: ``.path`` is its model file; HF: compared
        by the ``tokenizer.json`` it writes).
      model_cfg: the ``ModelConfig`` built now.

    Raises:
      ValueError: one line naming the file and the first fields that differ.
    """
    run_dir = pathlib.Path(run_dir)
    cfg_path = run_dir / "model_config.json"
    if cfg_path.is_file():
        try:
            stored = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not JSON ({e})") from None
        now = json.loads(json.dumps(dataclasses.asdict(model_cfg)))
        diff = [f"{k} {stored.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(stored) | set(now))
                if stored.get(k) != now.get(k)]
        if diff:
            raise ValueError(f"{cfg_path}: the run folder's checkpoints are of another model shape "
                             f"(stored vs this config: {', '.join(diff[:4])}); use another --run_dir or the same "
                             "ModelOptions")
    if _is_hf_tokenizer(tokenizer):
        hf_path = run_dir / HF_TOKENIZER_DIR / "tokenizer.json"
        if hf_path.is_file():
            try:
                stored = json.loads(hf_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{hf_path}: not JSON ({e})") from None
            if stored != _hf_tokenizer_json(tokenizer):
                raise ValueError(f"{hf_path} differs from the tokenizer this config builds ({tokenizer.path}): the "
                                 "checkpoints belong to another vocabulary; use another --run_dir")
        return
    tok_path = run_dir / SP_TOKENIZER_FILE
    if tok_path.is_file() and pathlib.Path(tokenizer.path).resolve() != tok_path.resolve():
        if _sha256(tok_path) != _sha256(tokenizer.path):
            raise ValueError(f"{tok_path} differs from the tokenizer this config builds ({tokenizer.path}): the "
                             "checkpoints belong to another vocabulary; use another --run_dir")


def _sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def save_run_artifacts(run_dir: str | os.PathLike, tokenizer, model_cfg) -> None:
    """Write the tokenizer and ``RUN_DIR/model_config.json`` (the ``ModelConfig`` fields), so a run
    folder alone is enough to rebuild its policy (``load_policy``).

    A SentencePiece tokenizer's model file is copied to ``RUN_DIR/tokenizer.model``; an
    ``HFTokenizer`` (a run from a Hugging Face checkpoint) is saved, protocol tags included, to
    ``RUN_DIR/hf_tokenizer/`` (written beside it and renamed into place).
    """
    run_dir = pathlib.Path(run_dir)
    if _is_hf_tokenizer(tokenizer):
        import tempfile

        dst = run_dir / HF_TOKENIZER_DIR
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=HF_TOKENIZER_DIR + ".tmp", dir=run_dir))
        tokenizer.save(tmp)
        os.chmod(tmp, 0o755)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    else:
        _copy_sentencepiece(run_dir, tokenizer)
    tmp = run_dir / "model_config.json.tmp"
    tmp.write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2), encoding="utf-8")
    os.replace(tmp, run_dir / "model_config.json")


def _copy_sentencepiece(run_dir: pathlib.Path, tokenizer) -> None:
    src = pathlib.Path(tokenizer.path)
    dst = run_dir / SP_TOKENIZER_FILE
    if src.resolve() != dst.resolve():
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def load_policy(run_dir: str | os.PathLike, step: Optional[int] = None):
    """Rebuild a trained policy from a run folder written by ``python -m mempo_jax.train``.

    Args:
      run_dir: the run folder (``tokenizer.model`` or ``hf_tokenizer/``, ``model_config.json``,
        ``checkpoints/``).
      step: checkpoint step (default: the latest complete one).

    Returns:
      ``(tokenizer, model_cfg, graphdef, params)``; the tokenizer is a ``SentencePieceTokenizer``
      or, for a run from a Hugging Face checkpoint, an ``HFTokenizer`` (``load_run_tokenizer``).

    Raises:
      FileNotFoundError: if the folder lacks one of those files or any checkpoint.
      ValueError: if the checkpoint does not match ``model_config.json``.
    """
    from mempo_jax.model.config import ModelConfig
    from mempo_jax.model.forward import abstract_model, split_model

    run_dir = pathlib.Path(run_dir)
    for name in ("model_config.json", "checkpoints"):
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} not found: is {run_dir} a run folder of mempo_jax.train?")
    tokenizer = load_run_tokenizer(run_dir)
    fields = json.loads((run_dir / "model_config.json").read_text(encoding="utf-8"))
    if isinstance(fields.get("rope_scaling"), list):
        fields["rope_scaling"] = tuple(tuple(x) for x in fields["rope_scaling"])
    model_cfg = ModelConfig(**fields)
    graphdef, params = split_model(abstract_model(model_cfg))  # shapes only: the checkpoint fills them
    ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    params, _, _ = ckpt.restore(step, params)
    ckpt.close()
    return tokenizer, model_cfg, graphdef, params
