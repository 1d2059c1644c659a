"""Client of a Search-R1-compatible retrieval server, with BM25Index's search()/get() contract.

MEMPO_SPEC §7: ``POST {url}/retrieve`` with ``{"queries", "topk", "return_scores": true}``;
documents are ``{"id", "contents"}`` rows (split into title and text by
``Document.from_contents``). ``GET {url}/access?id=…`` reads one document (this project's
server; 404 = unknown id).

Failures — server down, timeout, HTTP 5xx, a reply that is not the expected JSON — are retried
``max_retries`` times with exponential backoff, then raised as ``ToolError``; ``ToolEnvironment``
turns that into an error observation (``ToolResult.ok`` False), so a rollout never crashes on
the network. Worst-case time of one call ≈ ``(max_retries + 1) · timeout_s + backoff_s ·
(2^max_retries − 1)``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import httpx

from mempo_jax.tools.corpus import Document, Hit
from mempo_jax.tools.search import ToolError


class _Unexpected(Exception):
    """An HTTP status the caller does not accept (4xx): not retried."""


def _expect(resp: httpx.Response, statuses: tuple[int, ...] = (200,)) -> None:
    if resp.status_code not in statuses:
        raise _Unexpected(resp.status_code)


def _document(row: Any) -> Document:
    if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("contents"), str):
        raise ValueError(f"document must be an object with 'id' and 'contents', got {str(row)[:80]}")
    return Document.from_contents(str(row["id"]), row["contents"])


class RemoteSearchBackend:
    """HTTP search backend (same ``search``/``get`` contract as ``BM25Index``).

    Args:
      url: server base URL, e.g. ``"http://127.0.0.1:8000"`` (a trailing ``/retrieve`` is
        accepted, as Search-R1 configs write it).
      timeout_s: per-request connect/read/write timeout, seconds (> 0).
      max_retries: retries after the first attempt (>= 0).
      backoff_s: sleep before retry i is ``backoff_s · 2^i`` seconds (>= 0).

    Raises:
      ValueError: bad arguments.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, max_retries: int = 2, backoff_s: float = 0.1):
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0; got {timeout_s}, {max_retries}, {backoff_s}")
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.url = base
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self._client = httpx.Client(timeout=httpx.Timeout(self.timeout_s))

    def close(self) -> None:
        """Close the pooled HTTP connections."""
        self._client.close()

    def __enter__(self) -> "RemoteSearchBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------------
    def _call(self, send: Callable[[], httpx.Response], parse: Callable[[httpx.Response], Any]) -> Any:
        """``parse(send())`` with at most ``max_retries`` retries.

        Retried: timeouts, connection errors, HTTP 5xx/429, and replies ``parse`` rejects
        (non-JSON or the wrong shape: ``ValueError``/``TypeError``/``KeyError``). Other HTTP
        statuses that ``parse`` does not accept fail at once.

        Raises:
          ToolError: reason ``"timeout" | "unreachable" | "http NNN" | "bad response"``.
        """
        reason, detail = "unreachable", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = send()
            except httpx.TimeoutException as exc:
                reason, detail = "timeout", f"{type(exc).__name__} after {self.timeout_s}s"
                continue
            except httpx.TransportError as exc:
                reason, detail = "unreachable", f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                reason, detail = f"http {resp.status_code}", resp.text[:200]
                continue
            try:
                return parse(resp)
            except _Unexpected as exc:
                raise ToolError(f"http {resp.status_code}", f"{self.url}: {resp.text[:200]}") from exc
            except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
                reason, detail = "bad response", f"{type(exc).__name__}: {str(exc)[:160]}"
        raise ToolError(reason, f"{self.url}: {detail} ({self.max_retries + 1} attempts)")

    # -- the backend contract ---------------------------------------------------------------
    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-k hits per query from ``POST /retrieve`` (return_scores = true).

        Returns:
          ``len(queries)`` lists of Hits in server order (the server clamps topk).

        Raises:
          ValueError: ``topk < 1`` or ``queries`` is a single string.
          ToolError: the server failed after retries (see module doc).
        """
        if isinstance(queries, str):
            raise ValueError("queries must be a list of strings, not one string")
        queries = [str(q) for q in queries]
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        if not queries:
            return []
        body = {"queries": queries, "topk": topk, "return_scores": True}

        def parse(resp: httpx.Response) -> list[list[Hit]]:
            _expect(resp)
            result = resp.json()["result"]
            if not isinstance(result, list) or len(result) != len(queries):
                raise ValueError(f"'result' must be a list of {len(queries)} lists")
            return [[Hit(_document(h["document"]), float(h["score"])) for h in hits] for hits in result]

        return self._call(lambda: self._client.post(f"{self.url}/retrieve", json=body), parse)

    def get(self, doc_id: str) -> Document | None:
        """The document from ``GET /access?id=…``, or None on 404.

        Raises:
          ToolError: the server failed after retries.
        """
        def parse(resp: httpx.Response) -> Document | None:
            _expect(resp, (200, 404))
            return None if resp.status_code == 404 else _document(resp.json()["document"])

        send = lambda: self._client.get(f"{self.url}/access", params={"id": str(doc_id)})  # noqa: E731
        return self._call(send, parse)
