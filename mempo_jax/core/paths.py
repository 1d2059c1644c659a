"""The one path layer of a run folder: a local folder or a Cloud Storage prefix (``gs://BUCKET/…``).

``run_path`` turns a ``--run_dir`` into a path object: a ``pathlib.Path`` for a local folder (every
local read and write stays what it was: temporary file, fsync, ``os.replace``), an
``etils.epath.Path`` for ``gs://`` (the layer orbax uses too; epath reaches Cloud Storage through
fsspec's ``gcsfs``). Both have the ``pathlib`` methods the run folder code calls (``/``, ``name``,
``parent``, ``exists``, ``is_dir``, ``is_file``, ``iterdir``, ``read_text``, ``read_bytes``,
``open``, ``mkdir``, ``unlink``); what differs is here:

* whole-file writes (``write_bytes_atomic``, ``write_text_atomic``): locally a temporary file,
  fsynced, renamed into place; on Cloud Storage one object upload, which is atomic (readers see the
  old object or the new one, never a part);
* folders written elsewhere first (``replace_folder``): locally a rename; on Cloud Storage the
  files are uploaded one by one after the old prefix is removed;
* ``complete_steps``: orbax renames a finished local checkpoint into place, but on Cloud Storage
  (no rename) writes the step under its final name and marks it complete with
  ``commit_success.txt`` last;
* append-only logs have no Cloud Storage form: a remote run folder's logs are written to a local
  staging copy and uploaded whole (``upload_file``), see ``run_logs.RunLogs``.

Credentials come from the environment as for any Google client (application default credentials,
``GOOGLE_APPLICATION_CREDENTIALS``, the VM's service account); ``STORAGE_EMULATOR_HOST`` points the
Python side at an emulator, ``TENSORSTORE_GCS_HTTP_URL`` the checkpoint arrays (tensorstore).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterator, Union

import fsspec
from etils import epath

REMOTE_SCHEMES = ("gs://",)
COMMIT_FILE = "commit_success.txt"  # orbax's mark of a complete checkpoint where there is no rename

RunPath = Union[pathlib.Path, Any]  # pathlib.Path, or etils.epath.Path for gs://


def is_remote(path: str | os.PathLike) -> bool:
    """True for a Cloud Storage path (``gs://…``, as a string or an ``epath.Path``)."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def run_path(path: str | os.PathLike) -> RunPath:
    """The path object of a run folder or of a file in one.

    Args:
      path: a local path, or ``gs://BUCKET/PREFIX``.

    Returns:
      ``pathlib.Path(path)`` for a local path (unchanged behaviour), ``etils.epath.Path(path)`` for
      ``gs://`` (needs ``gcsfs``).
    """
    if is_remote(path):
        return epath.Path(os.fspath(path))
    return pathlib.Path(path)


def file_size(path: RunPath) -> int:
    """Bytes in the file at ``path``; 0 when it is absent."""
    if not is_remote(path):
        return path.stat().st_size if path.exists() else 0
    return int(path.stat().length) if path.exists() else 0


@contextlib.contextmanager
def naming_file(path: str | os.PathLike):
    """Re-raise an ``OSError`` without a file name (a failed ``write``/``flush``/``fsync``, e.g.
    ``ENOSPC``) with ``path`` as its ``filename``, so the one-line error names the file."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def write_bytes_atomic(path: str | os.PathLike | RunPath, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader (or a crash) sees the old file or the new one.

    Locally through ``PATH.tmp``, fsynced, and ``os.replace``; on Cloud Storage one object upload.
    ``path`` may be a string (``run_path`` turns it into a path object).

    Raises:
      OSError: naming the file (e.g. ``ENOSPC``); a local temporary file is removed. On Cloud
        Storage a failure that is no ``OSError`` (gcsfs's ``HttpError`` once its retries are spent)
        is raised as one with ``errno.EIO``.
    """
    path = run_path(path)
    if is_remote(path):
        try:
            with naming_file(path):
                path.write_bytes(data)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - gcsfs / aiohttp / google-auth raise their own types
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise OSError(errno.EIO, f"{type(e).__name__}: {text[:200]}", str(path)) from None
        return
    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with naming_file(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike | RunPath, text: str) -> None:
    """``write_bytes_atomic`` of ``text`` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike | RunPath, obj) -> None:
    """``write_text_atomic`` of ``obj`` as JSON (indented, keys sorted)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def upload_file(local: str | os.PathLike, dst: RunPath) -> None:
    """Copy the local file ``local`` to ``dst`` whole (on Cloud Storage: one atomic object write).

    Raises:
      OSError: naming ``dst``.
    """
    write_bytes_atomic(dst, pathlib.Path(local).read_bytes())


def upload_tree(local: str | os.PathLike, dst: RunPath) -> list[str]:
    """Copy every file under the local folder ``local`` to the same relative paths under ``dst``
    (each with ``write_bytes_atomic``). Returns the relative paths copied."""
    local = pathlib.Path(local)
    copied = []
    for root, _dirs, files in os.walk(local):
        for name in sorted(files):
            rel = pathlib.Path(root, name).relative_to(local)
            target = dst.joinpath(*rel.parts)
            if not is_remote(target):
                target.parent.mkdir(parents=True, exist_ok=True)
            upload_file(pathlib.Path(root, name), target)
            copied.append(rel.as_posix())
    return copied


def rmtree(path: RunPath) -> None:
    """Remove the folder (or prefix) ``path`` and everything under it; nothing when absent."""
    if is_remote(path):
        if path.exists():
            path.rmtree()
        return
    shutil.rmtree(path, ignore_errors=True)


def local_temp_folder(dst: RunPath, prefix: str = "mempo_") -> pathlib.Path:
    """A new empty local folder to write ``dst`` in before ``replace_folder``: ``DST.tmp`` beside a
    local ``dst`` (same file system, so the rename is atomic; an older one is removed), a folder in
    the system temp dir for a remote one."""
    if is_remote(dst):
        return pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    tmp = pathlib.Path(dst).with_name(pathlib.Path(dst).name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def replace_folder(src: str | os.PathLike, dst: RunPath) -> None:
    """Put the finished local folder ``src`` at ``dst``, replacing what is there.

    Locally: ``dst`` is removed and ``src`` renamed to it. On Cloud Storage: the ``dst`` prefix
    is removed, ``src``'s files are uploaded (``upload_tree``) and ``src`` is removed; a crash
    half-way leaves a partial folder, which the next write replaces.
    """
    if is_remote(dst):
        rmtree(dst)
        upload_tree(src, dst)
        shutil.rmtree(src, ignore_errors=True)
        return
    if pathlib.Path(dst).exists():
        shutil.rmtree(dst)
    os.replace(src, dst)


def move_folder(src: RunPath, dst: RunPath) -> None:
    """Move the folder ``src`` to ``dst`` (both local or both on Cloud Storage): a rename locally,
    a copy of every object and a delete on Cloud Storage (not atomic)."""
    if not is_remote(src):
        os.replace(src, dst)
        return
    fs, path = fsspec.core.url_to_fs(os.fspath(src))
    target = fsspec.core.url_to_fs(os.fspath(dst))[1]
    fs.copy(path.rstrip("/") + "/", target.rstrip("/") + "/", recursive=True)  # server-side copies
    fs.rm(path, recursive=True)


def complete_steps(folder: RunPath) -> list[int]:
    """Steps of the complete orbax checkpoints under ``folder``, ascending; ``[]`` when absent.

    Locally a step counts when its folder has its final all-digit name (orbax renames a finished
    save into place); on Cloud Storage when its folder also holds ``commit_success.txt``.
    """
    try:
        if not folder.is_dir():
            return []
        names = [p.name for p in folder.iterdir() if p.name.isdigit() and p.is_dir()]
    except OSError:
        return []
    if is_remote(folder):
        names = [n for n in names if (folder / n / COMMIT_FILE).exists()]
    return sorted(int(n) for n in names)


def partial_steps(folder: RunPath) -> list[RunPath]:
    """The step folders of saves that did not finish under a remote checkpoint ``folder`` (all-digit
    names without ``commit_success.txt``); ``[]`` for a local folder (there a partial save keeps
    orbax's temporary name) or an absent one."""
    if not is_remote(folder) or not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.name.isdigit() and p.is_dir() and not (p / COMMIT_FILE).exists()]


def iter_files(folder: RunPath) -> Iterator[str]:
    """Relative paths of every file under ``folder`` (a listing, for reports and tests)."""
    if is_remote(folder):
        fs, root = fsspec.core.url_to_fs(os.fspath(folder))
        root = root.rstrip("/")
        for name in sorted(fs.find(root)):
            yield name[len(root) + 1:]
        return
    for p in sorted(pathlib.Path(folder).rglob("*")):
        if p.is_file():
            yield p.relative_to(folder).as_posix()


def local_copy(path: RunPath) -> pathlib.Path:
    """A local path holding the file or folder at ``path``, for readers that need one (SentencePiece,
    ``tokenizers``, gin): ``path`` itself when local, else a copy downloaded into a new folder of
    the system temp dir (left there: the caller may keep reading it for the rest of the process).

    Raises:
      FileNotFoundError: nothing at ``path``.
    """
    if not is_remote(path):
        return pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such object or folder")
    dst = pathlib.Path(tempfile.mkdtemp(prefix="mempo_copy_")) / path.name
    fs, src = fsspec.core.url_to_fs(os.fspath(path))
    if fs.isdir(src):
        fs.get(src.rstrip("/") + "/", os.fspath(dst), recursive=True)
    else:
        fs.get(src, os.fspath(dst))
    return dst


def remote_folder_problem(path: RunPath) -> str | None:
    """Why the Cloud Storage folder ``path`` cannot be a run folder, or None: its bucket cannot be
    listed (absent, no credentials, no permission, no network), or ``path`` is an object (a file)."""
    fs, where = fsspec.core.url_to_fs(os.fspath(path))
    bucket = where.split("/", 1)[0]
    try:
        fs.ls(bucket, detail=False)
        if where.rstrip("/") != bucket and fs.isfile(where):
            return "exists and is not a folder"
    except Exception as e:  # noqa: BLE001 - gcsfs / google-auth raise many types; each means "unusable"
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"cannot list bucket gs://{bucket} ({type(e).__name__}: {text[:200]})"
    return None
