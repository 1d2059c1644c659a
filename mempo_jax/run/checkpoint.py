"""Orbax checkpoints of the training state.

A checkpoint holds the policy parameters, the optimizer state and a JSON metadata item (stage,
step, seed, and what a resume needs: data-iterator state, metric-log offsets, fault counters,
RNG bookkeeping). Orbax writes each step to a temporary folder and renames it when complete (in a
``gs://`` folder, which has no rename: under its final name, with ``commit_success.txt`` written
last), so a killed save is never taken for a complete one (leftover temporary or uncommitted
folders are removed when a ``Checkpointer`` opens the folder, see ``remove_partial_saves``); ``CheckpointManager`` keeps the last ``max_to_keep``.
Nothing is pickled: arrays are tensorstore/OCDBT, metadata is JSON.

Integrity: the metadata of every checkpoint also records a 32-bit checksum of every array
(``array_checksums``), computed on the device at save time; a restore recomputes them, so array
data that decodes without an error but is not what was saved (a flipped bit, a torn write) is
found. A checkpoint that cannot be read (bad array data, a missing manifest or metadata file, a
checksum mismatch) raises ``CorruptCheckpoint``; the trainer then resumes from the newest older
checkpoint that restores (``resume.find_resume_point``) and keeps the corrupt one.

Layout of a run folder (``python -m mempo_jax.commands.train``): ``sft_checkpoint/N`` (SFT; the final one
is the frozen reference policy of RL), ``checkpoints/N`` (RL step N), ``model_config.json`` and
the tokenizer: ``tokenizer.model`` (our SentencePiece model) or, for a run from a Hugging Face
checkpoint, ``hf_tokenizer/`` (``tokenizer.json`` with the protocol tags the run added, and the
checkpoint's ``tokenizer_config.json`` / ``generation_config.json`` / chat template).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.model.lora import trainable_part
from mempo_jax.config_loader import load_config
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import abstract_model, split_model
from mempo_jax.run.experiment import lora_policy_params
from mempo_jax.text.hf_tokenizer import HFTokenizer
from mempo_jax.text.tokenizer import SentencePieceTokenizer

CHECKSUM_KEY = "array_checksums"  # reserved key of the metadata item (not returned by ``restore``)


class CheckpointWriteError(OSError):
    """A checkpoint save failed (``errno``: ``ENOSPC`` for a full disk, ``EROFS``, ``EIO``…);
    ``filename`` is the checkpoint folder. The previous complete checkpoint is unaffected."""


def _write_error(e: BaseException, where: str) -> CheckpointWriteError:
    """An orbax/tensorstore save failure (often a ``ValueError`` such as ``RESOURCE_EXHAUSTED …
    [os_error_code='28']``) as one ``CheckpointWriteError``."""
    if isinstance(e, OSError) and e.errno:
        return CheckpointWriteError(e.errno, f"{e.strerror or _first_line(e)} (saving a checkpoint)", where)
    text = str(e)
    code = next((int(c) for c in re.findall(r"os_error_code='?(\d+)", text)), None)
    if code is None:
        code = errno.ENOSPC if "No space left" in text else errno.EROFS if "Read-only file system" in text else errno.EIO
    reason = os.strerror(code) if code != errno.EIO else _first_line(e, 200)
    return CheckpointWriteError(code, f"{reason} (saving a checkpoint)", where)


class _OrbaxTracebacks(logging.Filter):
    """Drops the tracebacks orbax logs from its background save threads: the same failure reaches
    the caller as an exception (``CheckpointWriteError``), reported in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)


logging.getLogger("absl").addFilter(_OrbaxTracebacks())
_late_read_filters_installed = False
_failed_restores: set[str] = set()  # checkpoint folders being restored now, or whose restore failed


@contextlib.contextmanager
def _quiet_late_reads(where: str):
    """Around a restore of checkpoint folder ``where``: when the restore fails, tensorstore reads
    still in flight finish after orbax has closed the restore's event loop; each raises
    ``RuntimeError('Event loop is closed')`` as an *unraisable* exception (``sys.unraisablehook``,
    printed as a bare traceback from tensorstore's threads) and the futures of the other failing
    reads are logged as "Future exception was never retrieved" when collected. Both are harmless
    (the restore has failed and is reported in one line) and are dropped: the folder is registered
    *before* the restore starts, since those threads may print before the caller's ``except``
    runs, and unregistered only when the restore succeeds (no read is left in flight then). Every
    other unraisable exception or log record is passed on."""
    global _late_read_filters_installed
    names = {str(where)} | (set() if paths.is_remote(where) else {str(pathlib.Path(where).resolve())})
    failed_before = names <= _failed_restores
    _failed_restores.update(names)
    if not _late_read_filters_installed:
        previous = sys.unraisablehook

        def hook(unraisable):
            e = unraisable.exc_value
            if _failed_restores and isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
                return
            previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_drop_unretrieved_read_errors)
        _late_read_filters_installed = True
    yield
    if not failed_before:  # not reached when the restore raised: its folder stays registered
        _failed_restores.difference_update(names)


def _drop_unretrieved_read_errors(record: logging.LogRecord) -> bool:
    """``asyncio`` log filter, installed at the first restore: drops the "Future exception was
    never retrieved" / "Task exception was never retrieved" records (asyncio names the class of
    the collected object) of that restore's other reads (orbax returns on the first failing
    read; the futures of the others are logged with a traceback when collected, long after the one
    line that reports the unreadable checkpoint): those whose message or exception names a file of
    a checkpoint folder whose restore failed. Every other record passes."""
    msg = record.getMessage()
    if not re.match(r"\w+ exception was never retrieved", msg):
        return True
    text = msg + (str(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else "")
    return not any(where in text for where in _failed_restores)


class CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be read back: its array data or metadata is damaged or missing.

    Attributes:
      where: the checkpoint folder (``RUN/checkpoints/6``).
      reason: one line saying what failed.
    """

    def __init__(self, where: str, reason: str):
        super().__init__(f"checkpoint {where} is unreadable: {reason}")
        self.where, self.reason = where, reason


class Checkpointer:
    """Save and restore the policy parameters, the optimizer state and JSON metadata.

    The three are separate orbax items (``params``, ``opt_state``, ``meta``), so a policy can be
    restored without knowing the optimizer that trained it.

    Args:
      directory: the checkpoint folder (``RUN_DIR/checkpoints``), local or ``gs://…`` (orbax
        writes a Cloud Storage step under its final name and marks it complete with
        ``commit_success.txt``; ``steps`` lists only complete ones either way).
      max_to_keep: how many of the newest checkpoints are kept.
      async_save: save in a background thread (``wait()`` before exit).
      prepare: create the folder and remove partial saves now (``prepare()``); ``False`` opens it
        for reading only (an absent folder has no steps and is not created) until ``prepare()``.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3, async_save: bool = True,
                 prepare: bool = True):
        self.directory = run_path(directory)
        if not paths.is_remote(self.directory):
            self.directory = self.directory.absolute()
        if prepare:
            remove_partial_saves(self.directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=prepare)
        self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("params", "opt_state", "meta"))

    def prepare(self) -> None:
        """Make the folder ready for saves: create it, remove partial saves (``remove_partial_saves``)
        and re-read its steps (after checkpoints were moved away, ``set_aside``)."""
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        remove_partial_saves(self.directory)
        self._mgr.reload()

    def set_aside(self, step: int, into: str | os.PathLike):
        """Move checkpoint ``step`` (e.g. a corrupt one) out of the folder, into the folder ``into``
        as ``{folder name}-{step}`` (``-1``, ``-2``… when taken), on process 0; nothing is deleted
        (on Cloud Storage a copy of every object, then a delete). Call ``prepare()`` afterwards.
        Returns the new path."""
        into = run_path(into)
        dst = into / f"{self.directory.name}-{step}"
        n = 0
        while dst.exists():
            n += 1
            dst = into / f"{self.directory.name}-{step}-{n}"
        if jax.process_index() == 0:
            into.mkdir(parents=True, exist_ok=True)
            paths.move_folder(self.directory / str(step), dst)
        return dst

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Save checkpoint ``step``: two pytrees of arrays and JSON-able ``meta``.

        With ``async_save`` the call returns once the arrays are copied off the device (the
        caller may donate or overwrite them); the write finishes in the background and the step
        counts as complete only after its folder is renamed (``wait()`` / ``close()`` block).

        Raises:
          TypeError: ``meta`` is not JSON-serialisable.
          CheckpointWriteError: this save or the previous asynchronous one failed (an
            ``OSError``: a full disk is ``ENOSPC``).
        """
        json.dumps(meta)  # fail here, with the caller's frame, rather than in the writer thread
        meta = {**meta, CHECKSUM_KEY: {"params": array_checksums(params), "opt_state": array_checksums(opt_state)}}
        try:  # also reports the failure of the previous asynchronous save
            self._mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                         opt_state=ocp.args.StandardSave(opt_state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise ValueError, OSError…
            raise _write_error(e, str(self.directory)) from None

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or ``None``."""
        return self._mgr.latest_step()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(self._mgr.all_steps())

    def restore_meta(self, step: int) -> dict:
        """The JSON metadata of checkpoint ``step`` alone (no arrays are read).

        Raises:
          CorruptCheckpoint: the checkpoint has no readable metadata item (a ``ValueError``).
        """
        meta = self._read_meta(step)
        meta.pop(CHECKSUM_KEY, None)
        return meta

    def _read_meta(self, step: int) -> dict:
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = out["meta"]
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore/json raise many types; all mean "unreadable"
            raise CorruptCheckpoint(f"{self.directory}/{step}", f"no readable metadata ({_first_line(e)})") from None
        if not isinstance(meta, dict):
            raise CorruptCheckpoint(f"{self.directory}/{step}", f"metadata is a {type(meta).__name__}, not a dict")
        return dict(meta)

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
          CorruptCheckpoint: (a ``ValueError``) one line naming the checkpoint, if its arrays or
            metadata cannot be read (damaged or missing files) or differ from the checksums
            recorded at save time.
        """
        where = f"{self.directory}/{step}"
        meta = self._read_meta(step)
        items = {"params": ocp.args.StandardRestore(jax.tree.map(_abstract, params))}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(jax.tree.map(_abstract, opt_state))
        try:
            with _quiet_late_reads(where):
                out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - tensorstore raises bare Exceptions for unreadable chunks
            stored = self._stored_shapes(step, list(items))
            wanted = _shape_multiset({k: params if k == "params" else opt_state for k in items})
            if stored is not None and stored != wanted:
                if self._layers_one_by_one(step):
                    raise ValueError(f"checkpoint {where} stores the decoder layers one by one (params/layers/0/...), "
                                     "the layout of versions before the layers were stored stacked; this version "
                                     "reads stacked layers only: run it again in a new run folder") from None
                raise ValueError(f"checkpoint {where} does not match this model: {_first_line(e)}") from None
            raise CorruptCheckpoint(where, _first_line(e)) from None
        _check_like(out["params"], params, where)
        if opt_state is not None:
            _check_like(out["opt_state"], opt_state, where)
        sums = meta.pop(CHECKSUM_KEY, None)
        if sums is not None:  # checkpoints of older versions have none
            for name in items:
                bad = _first_mismatch(out[name], sums.get(name))
                if bad is not None:
                    raise CorruptCheckpoint(where, f"{name}{bad} differs from the checksum recorded at save time "
                                                   "(damaged array data)")
        return out["params"], (out["opt_state"] if opt_state is not None else None), meta

    def _layers_one_by_one(self, step: int) -> bool:
        """The stored parameters keep each decoder layer apart (``layers/0``, ``layers/1``, …)."""
        try:
            tree = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "params")
            layers = getattr(tree, "tree", tree).get("layers", {})
            return isinstance(layers, dict) and "0" in layers
        except Exception:  # noqa: BLE001 - unreadable metadata: not this case
            return False

    def _stored_shapes(self, step: int, names) -> Optional[dict]:
        """The multiset of stored ``(shape, dtype)`` per item, from orbax's array metadata (None
        when that cannot be read either)."""
        try:
            out = {}
            for name in names:
                tree = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / name)
                out[name] = sorted((tuple(m.shape), str(np.dtype(m.dtype))) for m in jax.tree.leaves(
                    getattr(tree, "tree", tree), is_leaf=lambda x: hasattr(x, "shape")))
            return out
        except Exception:  # noqa: BLE001 - unreadable metadata: the checkpoint is corrupt
            return None

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete.

        Raises:
          CheckpointWriteError: a pending save failed.
        """
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise _write_error(e, str(self.directory)) from None

    def close(self) -> None:
        """Wait for saves and release the manager (also when a pending save failed).

        Raises:
          CheckpointWriteError: a pending save failed.
        """
        try:
            self.wait()
        finally:
            self._mgr.close()


def remove_partial_saves(directory: str | os.PathLike) -> list[str]:
    """Delete the temporary folders of saves that never completed (``N.orbax-checkpoint-tmp…``,
    left by a killed process; on Cloud Storage also the step folders without
    ``commit_success.txt``, ``paths.partial_steps``), synchronously, on process 0 only; returns
    their names.

    Orbax never lists them as steps; removing them here, not in orbax's background cleanup
    thread, keeps a run that exits at once (a one-line error) free of that thread's noise.
    """
    directory = run_path(directory)
    if jax.process_index() != 0 or not directory.is_dir():
        return []
    removed = []
    for p in paths.partial_steps(directory):
        paths.rmtree(p)
        removed.append(p.name)
    for p in directory.iterdir():
        if ".orbax-checkpoint-tmp" in p.name:
            if p.is_dir():
                paths.rmtree(p)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def _abstract(x):
    """A restore target; without a sharding, one on the default device (orbax would otherwise
    return numpy arrays of the *stored* shape without checking it)."""
    x = x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)
    if x.sharding is None:
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


def _first_line(e: BaseException, limit: int = 240) -> str:
    """The first line of an error message without tensorstore's spec dump, at most ``limit``
    characters (tensorstore's messages run to several KB)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    for cut in (" [tensorstore_spec", " See full TensorStore details"):
        line = line.split(cut)[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _shape_multiset(items: dict) -> dict:
    return {name: sorted((tuple(x.shape), str(np.dtype(x.dtype))) for x in jax.tree.leaves(tree))
            for name, tree in items.items()}


_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative-hash constant: position weights


@jax.jit
def _leaf_checksum(x):
    """One leaf's checksum (``array_checksums``). Jitted per leaf, not over the whole tree: one
    small program per distinct (shape, dtype), and one leaf's temporaries at a time."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_ or x.dtype.itemsize not in (1, 2, 4):
        u = x.astype(jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
        u = u.astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)  # the flat position, without a reshape (keeps the sharding)
    stride = 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2 ** 32)
        stride *= x.shape[d]
    weight = index * _GOLDEN * jnp.uint32(2) + jnp.uint32(1)  # odd: a changed element always changes the sum
    return jnp.sum(u * weight, dtype=jnp.uint32)  # wraps: order-free mod 2^32


def array_checksums(tree: Any) -> list[int]:
    """One 32-bit checksum per array leaf of ``tree`` (in ``jax.tree.leaves`` order).

    The checksum of a leaf is ``sum_i bits(x_i) · (2 · 2654435761 · i + 1) mod 2^32`` over its
    flat positions ``i`` (the raw bits, so it is exact for every dtype; integer sums wrap, so the
    result does not depend on the reduction order or the sharding). The weights are odd, hence
    invertible mod 2^32: any change of a single element changes the checksum. Computed on the
    device (a few elementwise ops and one reduction per leaf).

    Args:
      tree: a pytree of arrays (jax or numpy; any shape and dtype).

    Returns:
      A list of Python ints in ``[0, 2^32)``.
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    return [int(c) for c in jax.device_get([_leaf_checksum(x) for x in leaves])]


def _first_mismatch(tree: Any, recorded) -> Optional[str]:
    """The key path of the first leaf of ``tree`` whose checksum differs from ``recorded``, else None."""
    got = array_checksums(tree)
    if not isinstance(recorded, list) or len(recorded) != len(got):
        return f" (checksums of {len(got)} arrays expected, {len(recorded) if isinstance(recorded, list) else 0} recorded)"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for path, a, b in zip(paths, got, recorded):
        if a != int(b):
            return path
    return None


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
    # a reader never deletes a bucket's uncommitted step: it may be a live run's save in progress
    ckpt = Checkpointer(directory, async_save=False, prepare=not paths.is_remote(directory))
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

    return isinstance(tokenizer, HFTokenizer)


def _hf_tokenizer_json(tokenizer) -> Any:
    """The ``tokenizer.json`` a ``HFTokenizer`` writes, parsed (the in-memory tokenizer with its tags)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return json.loads((tokenizer.save(tmp) / "tokenizer.json").read_text(encoding="utf-8"))


def run_tokenizer_path(run_dir: str | os.PathLike):
    """The tokenizer a run folder (local or ``gs://…``) holds: ``RUN_DIR/hf_tokenizer`` (a folder
    with ``tokenizer.json``) when present, else ``RUN_DIR/tokenizer.model``, else None."""
    run_dir = run_path(run_dir)
    if (run_dir / HF_TOKENIZER_DIR / "tokenizer.json").is_file():
        return run_dir / HF_TOKENIZER_DIR
    if (run_dir / SP_TOKENIZER_FILE).is_file():
        return run_dir / SP_TOKENIZER_FILE
    return None


def load_run_tokenizer(run_dir: str | os.PathLike):
    """The run folder's tokenizer: ``HFTokenizer(RUN_DIR/hf_tokenizer)`` or
    ``SentencePieceTokenizer(RUN_DIR/tokenizer.model)`` (``run_tokenizer_path``; from a Cloud
    Storage run folder, read from a local copy, ``paths.local_copy``).

    Raises:
      FileNotFoundError: the folder holds neither.
    """
    path = run_tokenizer_path(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_path(run_dir) / SP_TOKENIZER_FILE} (or {HF_TOKENIZER_DIR}/tokenizer.json) "
                                f"not found: is {run_dir} a run folder of mempo_jax.commands.train?")
    path = paths.local_copy(path)
    if path.is_dir():
        return HFTokenizer(path)

    return SentencePieceTokenizer(path)


def check_run_artifacts(run_dir: str | os.PathLike, tokenizer, model_cfg) -> None:
    """Before a run folder is resumed: its ``model_config.json`` and tokenizer (``tokenizer.model``
    or ``hf_tokenizer/tokenizer.json``) must be those this config builds (else the checkpoints
    belong to another model).

    Args:
      run_dir: the run folder (local or ``gs://…``); absent files are not checked.
      tokenizer: the tokenizer built now (SentencePiece: ``.path`` is its model file; HF: compared
        by the ``tokenizer.json`` it writes).
      model_cfg: the ``ModelConfig`` built now.

    Raises:
      ValueError: one line naming the file and the first fields that differ.
    """
    run_dir = run_path(run_dir)
    cfg_path = run_dir / "model_config.json"
    if cfg_path.is_file():
        try:
            stored = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not JSON ({e})") from None
        now = json.loads(json.dumps(dataclasses.asdict(model_cfg)))
        # fields added since the file was written hold their defaults there
        stored = {**{f.name: now[f.name] for f in dataclasses.fields(model_cfg) if f.name not in stored
                     and getattr(model_cfg, f.name) == f.default}, **stored}
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
    if tok_path.is_file() and (paths.is_remote(tok_path) or pathlib.Path(tokenizer.path).resolve() != tok_path.resolve()):
        if _sha256(tok_path) != _sha256(tokenizer.path):
            raise ValueError(f"{tok_path} differs from the tokenizer this config builds ({tokenizer.path}): the "
                             "checkpoints belong to another vocabulary; use another --run_dir")


def _sha256(path) -> str:
    return hashlib.sha256(run_path(path).read_bytes()).hexdigest()


def save_run_artifacts(run_dir: str | os.PathLike, tokenizer, model_cfg) -> None:
    """Write the tokenizer and ``RUN_DIR/model_config.json`` (the ``ModelConfig`` fields), so a run
    folder alone is enough to rebuild its policy (``load_policy``).

    A SentencePiece tokenizer's model file is copied to ``RUN_DIR/tokenizer.model``; an
    ``HFTokenizer`` (a run from a Hugging Face checkpoint) is saved, protocol tags included, to
    ``RUN_DIR/hf_tokenizer/`` (written beside it and renamed into place; in a Cloud Storage run
    folder written locally and uploaded, ``paths.replace_folder``). Every file is written whole
    (``paths.write_bytes_atomic``).
    """
    run_dir = run_path(run_dir)
    if _is_hf_tokenizer(tokenizer):
        import tempfile

        dst = run_dir / HF_TOKENIZER_DIR
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=HF_TOKENIZER_DIR + ".tmp",
                                            dir=None if paths.is_remote(run_dir) else run_dir))
        tokenizer.save(tmp)
        os.chmod(tmp, 0o755)
        paths.replace_folder(tmp, dst)
    else:
        _copy_sentencepiece(run_dir, tokenizer)
    paths.write_text_atomic(run_dir / "model_config.json", json.dumps(dataclasses.asdict(model_cfg), indent=2))


def _copy_sentencepiece(run_dir, tokenizer) -> None:
    src = pathlib.Path(tokenizer.path)
    dst = run_dir / SP_TOKENIZER_FILE
    if paths.is_remote(dst) or src.resolve() != dst.resolve():
        paths.upload_file(src, dst)  # whole: a temporary file renamed into place, or one object upload


def load_policy(run_dir: str | os.PathLike, step: Optional[int] = None, folder: str = "checkpoints"):
    """Rebuild a trained policy from a run folder written by ``python -m mempo_jax.commands.train``.

    Args:
      run_dir: the run folder, local or ``gs://…`` (``tokenizer.model`` or ``hf_tokenizer/``, ``model_config.json``,
        ``checkpoints/``; a LoRA run's also ``config.gin``: its checkpoints hold the adapters, the
        base is rebuilt by ``experiment.lora_policy_params``).
      step: checkpoint step (default: the latest complete one).
      folder: the checkpoint folder inside ``run_dir``: ``"checkpoints"`` (RL, default) or
        ``"sft_checkpoint"`` (the SFT policy, the RL run's frozen reference).

    Returns:
      ``(tokenizer, model_cfg, graphdef, params)``; the tokenizer is a ``SentencePieceTokenizer``
      or, for a run from a Hugging Face checkpoint, an ``HFTokenizer`` (``load_run_tokenizer``).

    Raises:
      FileNotFoundError: if the folder lacks one of those files or any checkpoint.
      ValueError: if the checkpoint does not match ``model_config.json``.
    """

    run_dir = run_path(run_dir)
    for name in ("model_config.json", folder):
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} not found: is {run_dir} a run folder of mempo_jax.commands.train?")
    tokenizer = load_run_tokenizer(run_dir)
    fields = json.loads((run_dir / "model_config.json").read_text(encoding="utf-8"))
    if isinstance(fields.get("rope_scaling"), list):
        fields["rope_scaling"] = tuple(tuple(x) for x in fields["rope_scaling"])
    fields["lora_targets"] = tuple(fields.get("lora_targets", ()))
    model_cfg = ModelConfig(**fields)
    graphdef, params = split_model(abstract_model(model_cfg))  # shapes only: the checkpoint fills them
    ckpt = Checkpointer(run_dir / folder, async_save=False, prepare=not paths.is_remote(run_dir))  # as read_checkpoint
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / folder}")
    params, _, _ = ckpt.restore(step, trainable_part(params))  # a LoRA run's checkpoints hold the adapters
    ckpt.close()
    if model_cfg.lora_rank:
        params = lora_policy_params(load_config([str(paths.local_copy(run_dir / "config.gin"))]), model_cfg, params)
    return tokenizer, model_cfg, graphdef, params
