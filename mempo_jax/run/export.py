"""Export a trained policy as a Hugging Face checkpoint folder that transformers loads.

``python -m mempo_jax.commands.train`` calls ``export_policy`` after RL for a run from a Hugging Face
checkpoint (``ModelOptions.checkpoint``): ``RUN_DIR/hf_export`` holds ``config.json`` and the
safetensors of ``mempo_jax.model.hf_io.save_hf_checkpoint`` plus the tokenizer (``tokenizer.json``
with the protocol tags the run added, ``tokenizer_config.json`` incl. its chat template,
``chat_template.jinja``, ``generation_config.json``, ``special_tokens_map.json``: those the source
had). ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` read it, and
``python -m mempo_jax.commands.evaluate --hf_checkpoint RUN_DIR/hf_export`` evaluates it.

A LoRA run (``LoraConfig.rank > 0``) is exported both ways: ``hf_export`` holds the merged weights
(``W + (alpha / r) A B``, ``model.adapters.merge_adapters``), and ``RUN_DIR/peft_adapter`` the adapters
alone as a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the source checkpoint.

Any checkpoint of a run folder can be exported later with ``python -m mempo_jax.commands.export``
(``mempo-export``).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Optional

import jax

from mempo_jax.core import paths
from mempo_jax.core.paths import run_path
from mempo_jax.run.export_protocol import ExportProtocol
from mempo_jax.model.adapters import merge_adapters, save_peft_adapter
from mempo_jax.model.hf_io import read_hf_config, save_hf_checkpoint
from mempo_jax.text.hf_tokenizer import HFTokenizer

EXPORT_DIR = "hf_export"
PEFT_EXPORT_DIR = "peft_adapter"
# config.json keys of the source checkpoint that the ModelConfig does not hold (token ids, context).
CARRIED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def export_policy(folder: str | os.PathLike, model_cfg, params, tokenizer,
                  source: Optional[str | os.PathLike] = None,
                  protocol: Optional[ExportProtocol] = None) -> pathlib.Path:
    """Write ``params`` and ``tokenizer`` as a Hugging Face checkpoint folder.

    The folder is written as ``FOLDER.tmp`` and renamed into place when complete (an older export
    there is replaced only then), so a crash never leaves a half-written export. A ``gs://…``
    folder is written in the local temp dir and uploaded when complete (``paths.replace_folder``:
    a crash during the upload leaves a partial folder, replaced by the next export). Every process
    must call it (sharded arrays are gathered collectively); process 0 alone writes.

    Args:
      folder: the output folder (e.g. ``RUN_DIR/hf_export``).
      model_cfg: the policy's ``ModelConfig`` (the architecture of ``config.json``).
      params: the policy's ``nnx.State`` (written in its own dtype; LoRA adapters merged in).
      tokenizer: an ``HFTokenizer`` (its ``save`` writes the tokenizer files).
      source: the Hugging Face folder the policy came from; its ``CARRIED_CONFIG_KEYS`` go into
        ``config.json`` (else the tokenizer's EOS / BOS / pad ids).
      protocol: the run's prompt, tags, top-k and rollout budgets, written beside the weights
        (``run.export_protocol``: ``mempo_protocol.json``, the system prompt, ``generation_config.json``).

    Returns:
      The folder.

    Raises:
      ValueError: a tokenizer without a Hugging Face form (our SentencePiece model), or a config
        that the Qwen2 / Llama layout cannot express (``CheckpointError``).
    """

    if not isinstance(tokenizer, HFTokenizer):
        raise ValueError("only a policy with a Hugging Face tokenizer (a run from ModelOptions.checkpoint) can be "
                         "exported as a Hugging Face checkpoint; this one has a SentencePiece model")

    model_cfg, params = merge_adapters(model_cfg, params)  # a LoRA policy: its merged weights
    folder = run_path(folder)
    extra = {"eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id}
    if source is not None and (pathlib.Path(source) / "config.json").is_file():
        src = json.loads((pathlib.Path(source) / "config.json").read_text(encoding="utf-8"))
        extra.update({k: src[k] for k in CARRIED_CONFIG_KEYS if k in src})
    writer = jax.process_index() == 0
    tmp = _staging(folder, writer)
    save_hf_checkpoint(tmp, model_cfg, params, extra_config=extra, tokenizer=tokenizer)
    if writer:
        if protocol is not None:
            protocol.write(tmp, {k: extra[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id")})
        paths.replace_folder(tmp, folder)
    return folder


def _staging(folder, writer: bool) -> pathlib.Path:
    """Where an export of ``folder`` is written first: ``FOLDER.tmp`` beside a local folder (an older
    one removed by process 0), a new folder of the local temp dir for a ``gs://`` one."""
    if paths.is_remote(folder):
        return paths.local_temp_folder(folder, prefix=folder.name + ".tmp")
    tmp = folder.with_name(folder.name + ".tmp")
    if writer and tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def export_adapter(folder: str | os.PathLike, model_cfg, params, source: str | os.PathLike) -> pathlib.Path:
    """Write a LoRA policy's adapters as a PEFT folder over the ``source`` checkpoint
    (``model.adapters.save_peft_adapter``), as ``FOLDER.tmp`` renamed into place when complete.

    Raises:
      ValueError: the policy has no adapters, or its embedding rows differ from the source's
        (protocol tags added as tokens: the adapters alone do not describe the policy then).
    """

    base = read_hf_config(source)
    if base.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"the policy has {model_cfg.vocab_size} embedding rows and {source} {base.vocab_size}: "
                         "a PEFT adapter folder cannot carry the added rows; use the merged export")
    folder = run_path(folder)
    writer = jax.process_index() == 0
    tmp = _staging(folder, writer)
    save_peft_adapter(tmp, model_cfg, params, base_model=str(source))
    if writer:
        paths.replace_folder(tmp, folder)
    return folder
