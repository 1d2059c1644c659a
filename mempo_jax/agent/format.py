"""The agent's text format: the prompt a question becomes, and how tool results enter the context.

An ``AgentFormat`` bundles the tokenizer, its ``TagCodec`` (tags as ids or as text) and the
prompt template. The rollout, the scripted agent, the SFT reader and the evaluator build every
context through it, so a trajectory's ids are the same concatenation of pieces wherever it is
made (MEMPO_SPEC §2): ``prompt_ids`` + turn 1's sampled ids + ``observation_ids`` of its tool
result + turn 2's sampled ids + … ; k-step contexts are cut from the same pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from mempo_jax.agent.protocol import INFORMATION
from mempo_jax.agent.tags import TagCodec

# The from-scratch tokenizer's system prompt (the tiny world): short, every word in its vocabulary.
PLAIN_SYSTEM_PROMPT = "Search, remember in mem, answer."


@dataclasses.dataclass(frozen=True)
class AgentFormat:
    """Tokenizer + tag codec + prompt template of a policy.

    Attributes:
      tokenizer: the project tokenizer interface.
      codec: how protocol tags are written in ids.
      system_prompt: the system message.
      template: ``None`` for the plain format of the from-scratch tokenizer
        (``BOS + "{system}\\nQuestion: {question}\\n"``).
    """

    tokenizer: Any
    codec: TagCodec
    system_prompt: str = PLAIN_SYSTEM_PROMPT
    template: Optional[Any] = None

    @classmethod
    def plain(cls, tokenizer, system_prompt: str = PLAIN_SYSTEM_PROMPT) -> "AgentFormat":
        """The from-scratch tokenizer's format: tags as single pieces, the plain prompt."""
        return cls(tokenizer, TagCodec(tokenizer, "tokens"), system_prompt)

    def user_text(self, question: str) -> str:
        """The user message of a question."""
        return f"Question: {question}"

    def conversation_ids(self, system: str, user: str) -> list[int]:
        """Ids of a system + user message, ready for the assistant's first turn.

        Plain format: ``BOS`` (if the tokenizer has one) + ``"{system}\\n{user}\\n"``.
        """
        if self.template is None:
            bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
            return bos + self.tokenizer.encode(f"{system}\n{user}\n")
        raise NotImplementedError("chat templates")

    def prompt_ids(self, question: str) -> list[int]:
        """``conversation_ids`` of the system prompt and ``user_text(question)``."""
        return self.conversation_ids(self.system_prompt, self.user_text(question))

    def observation_ids(self, text: str, max_tokens: int) -> list[int]:
        """A tool result as ids: ``<information>`` + text (cut to ``max_tokens`` ids) +
        ``</information>``; tool-result ids get loss mask 0 in training."""
        body = self.tokenizer.encode(text)[:max_tokens]
        return self.codec.tag_ids(INFORMATION[0]) + body + self.codec.tag_ids(INFORMATION[1])

    def mem_span(self, ids) -> Optional[tuple[int, int]]:
        """``[start, end)`` of the ``<mem>…</mem>`` block in a turn's ids, or ``None``."""
        from mempo_jax.agent.protocol import MEM

        return self.codec.find_span(ids, MEM[0], MEM[1])
