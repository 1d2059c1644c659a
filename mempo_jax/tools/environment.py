"""The tool environment of the rollout: each parsed turn goes to the tool registered for its action.

docs/algorithm.md §2: the tools run on the host, between two turns of the policy; §1: a turn with no
valid action gets an error observation and the episode goes on. ``ToolEnvironment`` answers every
turn of a rollout cycle in one call, one ``execute_batch`` per ``Tool`` (the search tool sends all
of a cycle's queries in one request). The rollout engine names no tool: a new tool is registered
here, and its action given to the agent's ``TagCodec`` (see ``Tool``). Tool failures never raise
into the rollout: they are observations with ``ok=False``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from mempo_jax.text.protocol import ANSWER_ACTION, USAGE, ParsedTurn, format_error_observation, tag_pairs


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The observation for one turn.

    Attributes:
      observation: text for the ``<information>`` block (not wrapped).
      kind: the action of the tool that answered (``"search"``, ``"access"``, …), or ``"error"``
        for a malformed turn or an action no tool is registered for.
      ok: False for a malformed turn, an unknown action or a failed tool call.
    """

    observation: str
    kind: str
    ok: bool


class Tool(Protocol):
    """One tool of the environment (``tools.search.SearchTool``, ``AccessTool``).

    Attributes:
      action: the action name the policy writes, ``<action>argument</action>``: a lowercase name
        (``protocol.tag_pairs``), distinct per environment, never ``"answer"``.
      usage: one example call for the format help of error observations, e.g. ``"<search>query</search>"``.

    A new action is a new tag: build the agent's codec with the environment's actions,
    ``TagCodec(tokenizer, mode, actions=env.actions)`` (the parser accepts the action, its closing
    tag stops a turn). In ``"tokens"`` tag mode every tag must be one token of the tokenizer (the
    from-scratch tokenizer holds only the default tags): a new tool needs ``"text"`` tags there, or
    a tokenizer with its two tags added (``HFTokenizer.with_protocol_tags``).
    """

    action: str
    usage: str

    def execute_batch(self, arguments: Sequence[str]) -> list[ToolResult]:
        """One result per argument (the action block's content, verbatim), in order; a failed call
        is a result with ``ok=False``. Text from outside (passages, echoed arguments) goes through
        ``protocol.neutralize_tags(text, actions)``, so it can never encode as a tag id."""


class ToolEnvironment:
    """Routes parsed turns to the registered tools by action (docs/algorithm.md §1–2).

    Args:
      tools: the tools, in the order their actions are listed (``actions``, the format help).

    Attributes:
      actions: the tools' actions then ``"answer"`` (the action vocabulary of the rollout;
        ``("search", "access", "answer")`` for ``tools.search.search_environment``).
      usages: the matching usage examples.

    Raises:
      ValueError: two tools with one action, a tool named ``"answer"``, or an action that is not
        a valid tag name (``protocol.tag_pairs``).
    """

    def __init__(self, tools: Sequence[Tool]):
        self.tools = {t.action: t for t in tools}
        if len(self.tools) != len(tools) or ANSWER_ACTION in self.tools:
            raise ValueError(f"tool actions must be distinct and not {ANSWER_ACTION!r}, got "
                             f"{[t.action for t in tools]}")
        self.actions: tuple[str, ...] = (*self.tools, ANSWER_ACTION)
        self.usages: tuple[str, ...] = (*(t.usage for t in tools), USAGE[ANSWER_ACTION])
        tag_pairs(self.actions)  # raises on a name that is no tag

    def execute(self, parsed: ParsedTurn) -> ToolResult:
        """``execute_batch([parsed])[0]``."""
        return self.execute_batch([parsed])[0]

    def execute_batch(self, parsed: Sequence[ParsedTurn]) -> list[ToolResult]:
        """The observation of every turn, in order: a malformed turn gets ``format_error_observation``
        (kind ``"error"``), a turn whose action has no tool an error naming it, every other turn
        its tool's result; each tool runs once, on all its turns, in registration order.

        Raises:
          ValueError: an element is not a ``ParsedTurn``, is a valid ``<answer>`` turn (answers end
            the episode; the caller scores them; checked before any tool runs), or a tool
            returned a wrong number of results.
        """
        parsed = list(parsed)
        for p in parsed:
            if not isinstance(p, ParsedTurn):
                raise ValueError(f"expected a ParsedTurn, got {type(p).__name__}")
            if p.error is None and p.action == ANSWER_ACTION:
                raise ValueError("an <answer> turn has no tool call; the caller scores answers")
        results: list[ToolResult | None] = [
            None if p.error is None and p.action in self.tools else
            ToolResult(format_error_observation(p.error or f"unknown action <{p.action}>", self.usages), "error", False)
            for p in parsed]
        for action, tool in self.tools.items():
            rows = [i for i, p in enumerate(parsed) if results[i] is None and p.action == action]
            out = tool.execute_batch([parsed[i].argument or "" for i in rows]) if rows else []
            if len(out) != len(rows):
                raise ValueError(f"tool {action!r} returned {len(out)} results for {len(rows)} calls")
            for i, res in zip(rows, out):
                results[i] = res
        return results  # type: ignore[return-value]


__all__ = ["Tool", "ToolEnvironment", "ToolResult"]
