"""The agent's text format: the prompt a question becomes, and how tool results enter the context.

An ``AgentFormat`` bundles the tokenizer, its ``TagCodec`` (tags as ids or as text), the prompt
template (a checkpoint's chat template, or the plain one of the from-scratch tokenizer), the
system prompt and the tool-result layout. The rollout, the scripted agent, the SFT reader and the
evaluator build every context through it, so a trajectory's ids are the same concatenation of
pieces wherever it is made (docs/algorithm.md §2): ``prompt_ids`` + turn 1's sampled ids +
``observation_ids`` of its tool result + turn 2's sampled ids + … ; k-step contexts are cut from
the same pieces, so they are rendered through the same template.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from mempo_jax.text.chat_template import (
    TOOL_RESULT_LAYOUTS, ChatTemplate, PlainTemplate, encode_rendered, observation_frame, system_prompt)
from mempo_jax.text.protocol import INFORMATION, MEM
from mempo_jax.text.tokenizer import Tokenizer
from mempo_jax.agent.tags import TagCodec
from mempo_jax.tools.clip import OBS_CHARS_PER_TOKEN, clip_text

# The from-scratch tokenizer's system prompt (the tiny world): short, every word in its vocabulary.
PLAIN_SYSTEM_PROMPT = "Search, remember in mem, answer."


@dataclasses.dataclass(frozen=True)
class AgentFormat:
    """Tokenizer + tag codec + prompt template of a policy.

    Attributes:
      tokenizer: the policy's tokenizer (``text.tokenizer.Tokenizer``).
      codec: how protocol tags are written in ids.
      system_prompt: the system message.
      template: a ``ChatTemplate`` (a checkpoint's) or ``PlainTemplate`` (the from-scratch
        tokenizer's: ``BOS + "{system}\\nQuestion: {question}\\n"``).
      tool_layout: ``"assistant"`` (tool results continue the assistant's stream as
        ``<information>…</information>``: Search-R1 / ASearcher), ``"user"`` or ``"tool"`` (the
        result is a user / tool message of the template).

    Raises:
      ValueError: an unknown layout, or a layout the template cannot render.
    """

    tokenizer: Tokenizer
    codec: TagCodec
    system_prompt: str = PLAIN_SYSTEM_PROMPT
    template: ChatTemplate | PlainTemplate = PlainTemplate()
    tool_layout: str = "assistant"

    def __post_init__(self):
        if self.tool_layout not in TOOL_RESULT_LAYOUTS:
            raise ValueError(f"tool_layout must be one of {TOOL_RESULT_LAYOUTS}, got {self.tool_layout!r}")
        if self.tool_layout == "assistant":
            frame = (self.codec.tag_ids(INFORMATION[0]), self.codec.tag_ids(INFORMATION[1]))
        else:
            before, after = observation_frame(self.template, self.tool_layout)
            frame = (encode_rendered(self.tokenizer, before), encode_rendered(self.tokenizer, after))
        object.__setattr__(self, "_frame", frame)

    @classmethod
    def plain(cls, tokenizer, system_prompt: str = PLAIN_SYSTEM_PROMPT) -> "AgentFormat":
        """The from-scratch tokenizer's format: tags as single pieces, the plain prompt."""
        return cls(tokenizer, TagCodec(tokenizer, "tokens"), system_prompt)

    @classmethod
    def for_checkpoint(cls, folder, tokenizer, tags: str = "text", tool_layout: str = "assistant",
                       enabled_tools: Sequence[str] = ("search",), system_prompt_path: Optional[str] = None
                       ) -> "AgentFormat":
        """The format of an HF checkpoint: its own chat template (``chat_template.jinja`` or
        ``tokenizer_config.json``) around the MemPO system prompt (``chat_template.system_prompt``,
        describing only ``enabled_tools``; ``system_prompt_path`` overrides the shipped text).

        Raises:
          FileNotFoundError: the folder has no chat template (message names the folder).
          ValueError: a bad tag mode or layout.
        """
        return cls(tokenizer, TagCodec(tokenizer, tags), system_prompt(enabled_tools, system_prompt_path),
                   ChatTemplate.from_checkpoint(folder), tool_layout)

    def conversation_ids(self, system: str, user: str) -> list[int]:
        """Ids of a system + user message with the assistant's generation prompt, rendered by the
        template (plain: ``BOS`` + ``"{system}\\nQuestion: {user}\\n"``)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return list(self.template.prompt_ids(self.tokenizer, messages, add_generation_prompt=True))

    def prompt_ids(self, question: str) -> list[int]:
        """``conversation_ids`` of the system prompt and the question."""
        return self.conversation_ids(self.system_prompt, question)

    def observation_ids(self, text: str, max_tokens: int) -> list[int]:
        """A tool result as ids: the layout's frame around the text (``<information>`` …
        ``</information>`` in the assistant layout), the text cut to ``OBS_CHARS_PER_TOKEN *
        max_tokens`` characters before encoding (``tools/clip.py``: a huge passage is never
        tokenised whole) and to ``max_tokens`` ids after. Loss mask 0 in training. The tools have
        already neutralised protocol tags in the text (``protocol.neutralize_tags``)."""
        body = self.tokenizer.encode(clip_text(text, OBS_CHARS_PER_TOKEN * max_tokens))[:max_tokens]
        before, after = self._frame
        return list(before) + body + list(after)

    def mem_span(self, ids) -> Optional[tuple[int, int]]:
        """``[start, end)`` of the ``<mem>…</mem>`` block in a turn's ids, or ``None``."""
        return self.codec.find_span(ids, MEM[0], MEM[1])
