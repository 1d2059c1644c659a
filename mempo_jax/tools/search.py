"""Host-side tools of the rollout: turn a parsed ``<search>``/``<access>`` into an observation.

docs/algorithm.md §2: the tool runs on the host (reference: ``ToolParser.parse`` →
``AsearcherSearchTool.execute``, a retrieval call); §1: a turn with no valid action gets an
error observation and the episode goes on. The environment wraps every observation returned
here in ``<information>…</information>``. Tool failures never raise into the rollout: a backend
raising ``ToolError`` becomes an observation with ``ok=False``. Every piece of text that comes
from the tool or the corpus (titles, passages, ids, echoed arguments) goes through
``neutralize_tags``, so it can never be encoded as a protocol tag id.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Protocol, Sequence

from mempo_jax.text.protocol import ParsedTurn, format_error_observation, neutralize_tags
from mempo_jax.tools.corpus import Document, Hit

Kind = Literal["search", "access", "error"]
_ARG_QUOTE = 40  # the model's own argument is echoed up to this many characters
_DOC_LABEL = re.compile(r"^\[?\s*doc\s+", re.IGNORECASE)


class ToolError(Exception):
    """A retrieval backend failed (down, timeout, HTTP 5xx, malformed reply).

    Attributes:
      reason: a short category safe to show the model (no URLs or paths), e.g. ``"timeout"``.
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class SearchBackend(Protocol):
    """What ToolEnvironment needs: ``BM25Index`` and ``RemoteSearchBackend`` implement it."""

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]: ...

    def get(self, doc_id: str) -> Document | None: ...


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The observation for one turn.

    Attributes:
      observation: text for the ``<information>`` block (not wrapped).
      kind: ``"search"``/``"access"`` for tool calls, ``"error"`` for a malformed turn.
      ok: False for a malformed turn, an unknown id, a disabled tool or a backend failure.
    """

    observation: str
    kind: Kind
    ok: bool


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _safe_line(text: str) -> str:
    """Tool text on one line, with protocol-tag openers neutralised."""
    return neutralize_tags(_one_line(text))


def format_hits(hits: Sequence[Hit], max_chars: int | None = None) -> str:
    """Compact search observation: one line per hit, ``[doc 17] Title: text``.

    Args:
      hits: ranked hits (best first).
      max_chars: cut each passage text to this many characters (with ``"…"``); None keeps it
        whole. Whitespace runs (newlines included) become single spaces. Id, title and text
        go through ``neutralize_tags`` (``<answer>`` in a passage reads ``&lt;answer>``).

    Returns:
      the lines joined by ``"\\n"``; ``"No results."`` when ``hits`` is empty.
    """
    if not hits:
        return "No results."
    lines = []
    for hit in hits:
        text = _safe_line(hit.document.text)
        if max_chars is not None and len(text) > max_chars:
            text = text[: max(max_chars - 1, 0)].rstrip() + "…"
        title = _safe_line(hit.document.title)
        doc_id = _safe_line(hit.document.id)
        lines.append(f"[doc {doc_id}] {title}: {text}" if title else f"[doc {doc_id}] {text}")
    return "\n".join(lines)


def _quote(arg: str) -> str:
    arg = _safe_line(arg)
    return repr(arg if len(arg) <= _ARG_QUOTE else arg[: _ARG_QUOTE - 1] + "…")


class ToolEnvironment:
    """Executes search/access turns against a backend (docs/algorithm.md §2).

    Args:
      search_backend: ``search(queries, topk) -> list[list[Hit]]`` and ``get(id) -> Document|None``.
      topk: hits per search (Search-R1 / MemPO reference: 3–5), ``>= 1``.
      allow_access: whether ``<access>`` is offered; when False it answers with an error.
      snippet_chars: cut each hit's text in search observations; None (default) keeps it whole.

    Raises:
      ValueError: ``topk < 1``.
    """

    def __init__(
        self,
        search_backend: SearchBackend,
        topk: int,
        allow_access: bool = True,
        *,
        snippet_chars: int | None = None,
    ):
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        self.backend = search_backend
        self.topk = topk
        self.allow_access = allow_access
        self.snippet_chars = snippet_chars

    # -- single turns ------------------------------------------------------------------------
    def execute(self, parsed: ParsedTurn) -> ToolResult:
        """Observation for one parsed turn.

        Returns:
          malformed turn → ``format_error_observation`` (kind "error", ok False);
          search → ``format_hits`` of one backend call; access → the document's contents
          (``'"Title"\\ntext'``, through ``neutralize_tags``) or an error naming the unknown
          id (ok False).

        Raises:
          ValueError: the turn is a valid ``<answer>`` (answers end the episode; the caller
            scores them) or not a ParsedTurn.
        """
        self._check(parsed)
        if parsed.error is not None:
            return ToolResult(format_error_observation(parsed.error), "error", False)
        if parsed.action == "search":
            return self._search_results([parsed.argument or ""])[0]
        return self._access(parsed.argument or "")

    def execute_batch(self, parsed: Sequence[ParsedTurn]) -> list[ToolResult]:
        """``[execute(p) for p in parsed]``, with all searches sent in ONE ``backend.search`` call.

        Rollouts hold hundreds of rows; one batched retrieval call per turn step keeps the host
        overhead flat. Access turns are looked up one by one (``get`` is a dict lookup locally).

        Raises:
          ValueError: any element is a valid ``<answer>`` turn (checked before any tool runs).
        """
        parsed = list(parsed)
        for p in parsed:
            self._check(p)
        results: list[ToolResult | None] = [None] * len(parsed)
        search_rows = [i for i, p in enumerate(parsed) if p.error is None and p.action == "search"]
        if search_rows:
            found = self._search_results([parsed[i].argument or "" for i in search_rows])
            for i, res in zip(search_rows, found):
                results[i] = res
        for i, p in enumerate(parsed):
            if results[i] is None:
                results[i] = self.execute(p)
        return results  # type: ignore[return-value]

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _check(parsed: ParsedTurn) -> None:
        if not isinstance(parsed, ParsedTurn):
            raise ValueError(f"expected a ParsedTurn, got {type(parsed).__name__}")
        if parsed.error is None and parsed.action == "answer":
            raise ValueError("an <answer> turn has no tool call; the caller scores answers")

    def _search_results(self, queries: list[str]) -> list[ToolResult]:
        queries = [_one_line(q) for q in queries]
        try:
            hits = self.backend.search(queries, self.topk)
            if len(hits) != len(queries):
                raise ToolError("bad response", f"{len(hits)} result lists for {len(queries)} queries")
        except ToolError as exc:
            obs = f"Search failed ({neutralize_tags(exc.reason)}). Try again, or answer with what you know."
            return [ToolResult(obs, "search", False) for _ in queries]
        return [ToolResult(format_hits(h, self.snippet_chars), "search", True) for h in hits]

    def _access(self, argument: str) -> ToolResult:
        if not self.allow_access:
            return ToolResult("Access is not available here; use <search>query</search>.", "access", False)
        doc_id = argument.strip()
        # the model may copy the observation's "[doc 17]" label instead of the bare id
        bare = _DOC_LABEL.sub("", doc_id).rstrip("]").strip()
        try:
            doc = self.backend.get(doc_id)
            if doc is None and bare and bare != doc_id:
                doc = self.backend.get(bare)
        except ToolError as exc:
            return ToolResult(f"Access failed ({neutralize_tags(exc.reason)}). Try again or search instead.", "access", False)
        if doc is None:
            return ToolResult(
                f"No document with id {_quote(doc_id)}. Use an id shown as [doc ID] in search results.",
                "access",
                False,
            )
        return ToolResult(neutralize_tags(doc.contents), "access", True)
