"""The protocol an exported policy was trained with, written beside its weights.

A Hugging Face export (``run.export.export_policy``) holds weights, tokenizer and chat template; a
MemPO policy also needs the system prompt it was trained under, how the protocol tags are written,
the search top-k and the turn and token budgets of its rollout. ``ExportProtocol`` carries them:

* ``mempo_protocol.json``: ``{"format_version", "tags", "chat_template", "tool_layout", "topk",
  "system_prompt_file", "stop_strings", "rollout": {max_turns, max_new_tokens, max_context_tokens,
  max_observation_tokens, context_steps}}``;
* ``mempo_system_prompt.txt``: the system prompt as the policy saw it (placeholders filled);
* ``generation_config.json`` (the standard file, merged over the source's): greedy decoding
  (``do_sample`` false, the held-out evaluation's) and ``max_new_tokens`` per turn. A turn ends at
  an action's closing tag (``STOP_STRINGS``); that stays out of this file, since transformers'
  ``generate`` refuses ``stop_strings`` there unless it is handed the tokenizer.

``mempo-evaluate --hf_checkpoint DIR`` prompts and rolls out with them unless a flag overrides one
(``commands.evaluate``), so an export evaluates like its run folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Optional

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.agent.trajectory import FULL, parse_context_steps
from mempo_jax.text.protocol import ACCESS, ANSWER, SEARCH

PROTOCOL_FILE = "mempo_protocol.json"
PROMPT_FILE = "mempo_system_prompt.txt"
GENERATION_CONFIG_FILE = "generation_config.json"
FORMAT_VERSION = 1
ROLLOUT_FIELDS = ("max_turns", "max_new_tokens", "max_context_tokens", "max_observation_tokens", "context_steps")
STOP_STRINGS = (SEARCH[1], ACCESS[1], ANSWER[1])  # a policy turn ends with one action's closing tag


@dataclasses.dataclass(frozen=True)
class ExportProtocol:
    """How a policy is prompted and rolled out.

    Attributes:
      system_prompt: the system message text (as the policy saw it).
      tags: ``ModelOptions.tags`` (``"text"`` or ``"tokens"``).
      chat_template: ``ModelOptions.chat_template``.
      tool_layout: ``ModelOptions.tool_layout``.
      topk: passages per search (``ExperimentConfig.topk``).
      rollout: the run's ``RolloutConfig`` (its ``ROLLOUT_FIELDS`` are written; sampling options are
        not: the evaluation is greedy).
    """

    system_prompt: str
    tags: str
    chat_template: str
    tool_layout: str
    topk: int
    rollout: RolloutConfig

    @classmethod
    def of_run(cls, cfg, system_prompt: str) -> "ExportProtocol":
        """The protocol of a run's ``ExperimentConfig`` whose policy format has ``system_prompt``."""
        m = cfg.model
        return cls(system_prompt, m.tags, m.chat_template, m.tool_layout, cfg.topk, cfg.rl.rollout)

    def record(self) -> dict[str, Any]:
        """The ``mempo_protocol.json`` object."""
        ro = {name: value for name, value in dataclasses.asdict(self.rollout).items() if name in ROLLOUT_FIELDS}
        ro["context_steps"] = "full" if parse_context_steps(ro["context_steps"]) == FULL else ro["context_steps"]
        return {"format_version": FORMAT_VERSION, "tags": self.tags, "chat_template": self.chat_template,
                "tool_layout": self.tool_layout, "topk": self.topk, "system_prompt_file": PROMPT_FILE,
                "stop_strings": list(STOP_STRINGS), "rollout": ro}

    def write(self, folder: str | os.PathLike, token_ids: dict[str, Optional[int]]) -> None:
        """Write the protocol files into ``folder`` (an export being assembled).

        Args:
          folder: the export folder (exists).
          token_ids: ``{"eos_token_id", "bos_token_id", "pad_token_id"}`` of the policy (None: absent).
        """
        folder = pathlib.Path(folder)
        (folder / PROMPT_FILE).write_text(self.system_prompt, encoding="utf-8")
        (folder / PROTOCOL_FILE).write_text(json.dumps(self.record(), indent=2) + "\n", encoding="utf-8")
        gen_path = folder / GENERATION_CONFIG_FILE
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        for name in ("temperature", "top_p", "top_k"):  # sampling options contradict do_sample = false
            gen.pop(name, None)
        gen.update({k: v for k, v in token_ids.items() if v is not None})
        gen.update({"do_sample": False, "max_new_tokens": self.rollout.max_new_tokens})
        gen_path.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Optional["ExportProtocol"]:
        """The protocol stored in an export ``folder``, or None when it has no ``PROTOCOL_FILE``.

        Raises:
          ValueError: one line naming the file and the field that is missing or malformed.
          FileNotFoundError: the system prompt file it names is not in ``folder``.
        """
        folder = pathlib.Path(folder)
        path = folder / PROTOCOL_FILE
        if not path.is_file():
            return None
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: expected a JSON object")
        if rec.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {rec.get('format_version')!r}, this version reads {FORMAT_VERSION}")

        def field(name, kind, where=rec, prefix=""):
            value = where.get(name)
            if isinstance(value, bool) or not isinstance(value, kind):  # JSON true is no count
                raise ValueError(f"{path}: field {prefix}{name} is missing or not {kind.__name__}")
            return value

        ro = field("rollout", dict)
        values = {}
        for name in ROLLOUT_FIELDS:
            if name == "context_steps":
                try:
                    parse_context_steps(ro.get(name))
                    values[name] = ro[name]
                except (ValueError, TypeError, KeyError):
                    raise ValueError(f"{path}: field rollout.context_steps is {ro.get(name)!r}, not k >= 1 or 'full'") from None
            else:
                values[name] = field(name, int, ro, "rollout.")
        prompt_path = folder / field("system_prompt_file", str)
        if not prompt_path.is_file():
            raise FileNotFoundError(f"{path}: system_prompt_file {prompt_path.name} is not in {folder}")
        try:
            rollout = RolloutConfig(**values)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return cls(prompt_path.read_text(encoding="utf-8"), field("tags", str), field("chat_template", str),
                   field("tool_layout", str), field("topk", int), rollout)
