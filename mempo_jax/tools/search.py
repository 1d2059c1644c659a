"""The search tools of the rollout: ``<search>`` and ``<access>`` over a retrieval backend.

docs/algorithm.md §2: the tool runs on the host (reference: ``ToolParser.parse`` →
``AsearcherSearchTool.execute``, a retrieval call); ``search_environment`` registers both tools
in a ``ToolEnvironment`` (``tools.environment``: the routing, the error observations of malformed
turns). The agent format wraps every observation returned here in ``<information>…</information>``.
Tool failures never raise into the rollout: a backend raising ``ToolError`` becomes an
observation with ``ok=False``. Every piece of text that comes from the tool or the corpus (titles,
passages, ids, echoed arguments) goes through ``neutralize_tags``, so it can never be encoded as a
protocol tag id.
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence

from mempo_jax.text.protocol import USAGE, neutralize_tags
from mempo_jax.tools.corpus import Document, Hit
from mempo_jax.tools.environment import ToolEnvironment, ToolResult

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
    """What the search tools need: ``BM25Index`` and ``RemoteSearchBackend`` implement it."""

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]: ...

    def get(self, doc_id: str) -> Document | None: ...


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


class SearchTool:
    """``<search>query</search>``: BM25 / dense retrieval, the hits as ``format_hits`` lines.

    Args:
      backend: ``search(queries, topk) -> list[list[Hit]]`` (``SearchBackend``).
      topk: hits per search (Search-R1 / MemPO reference: 3–5), ``>= 1``.
      snippet_chars: cut each hit's text; None (default) keeps it whole.

    Raises:
      ValueError: ``topk < 1``.
    """

    action = "search"
    usage = USAGE["search"]

    def __init__(self, backend: SearchBackend, topk: int, snippet_chars: int | None = None):
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        self.backend, self.topk, self.snippet_chars = backend, topk, snippet_chars

    def execute_batch(self, arguments: Sequence[str]) -> list[ToolResult]:
        """Every query in ONE ``backend.search`` call (rollouts hold hundreds of rows; one request
        per cycle keeps the host overhead flat); a ``ToolError`` answers every query with a
        failure observation (ok False)."""
        queries = [_one_line(q) for q in arguments]
        try:
            hits = self.backend.search(queries, self.topk)
            if len(hits) != len(queries):
                raise ToolError("bad response", f"{len(hits)} result lists for {len(queries)} queries")
        except ToolError as exc:
            obs = f"Search failed ({neutralize_tags(exc.reason)}). Try again, or answer with what you know."
            return [ToolResult(obs, "search", False) for _ in queries]
        return [ToolResult(format_hits(h, self.snippet_chars), "search", True) for h in hits]


class AccessTool:
    """``<access>document id</access>``: a document's contents (``'"Title"\\ntext'``, through
    ``neutralize_tags``), or an error naming the unknown id (ok False). The model may copy the
    observation's ``[doc 17]`` label instead of the bare id: both are looked up.

    Args:
      backend: ``get(id) -> Document | None`` (``SearchBackend``).
    """

    action = "access"
    usage = USAGE["access"]

    def __init__(self, backend: SearchBackend):
        self.backend = backend

    def execute_batch(self, arguments: Sequence[str]) -> list[ToolResult]:
        """One lookup per id (``get`` is a dict lookup locally)."""
        return [self._access(a) for a in arguments]

    def _access(self, argument: str) -> ToolResult:
        doc_id = argument.strip()
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


def search_environment(backend: SearchBackend, topk: int, allow_access: bool = True, *,
                       snippet_chars: int | None = None) -> ToolEnvironment:
    """The default environment (docs/algorithm.md §2): ``SearchTool`` and ``AccessTool`` over one
    backend; its actions are ``protocol.ACTIONS``.

    Args:
      backend, topk, snippet_chars: as ``SearchTool``.
      allow_access: whether ``AccessTool`` is registered (without it an ``<access>`` turn gets the
        environment's unknown-action error observation).

    Raises:
      ValueError: ``topk < 1``.
    """
    return ToolEnvironment([SearchTool(backend, topk, snippet_chars)] + ([AccessTool(backend)] if allow_access else []))


__all__ = ["AccessTool", "SearchBackend", "SearchTool", "ToolEnvironment", "ToolError", "ToolResult", "format_hits",
           "search_environment"]
