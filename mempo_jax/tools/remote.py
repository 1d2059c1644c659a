"""Client of a Search-R1-compatible retrieval server, with BM25Index's search()/get() contract.

docs/algorithm.md §7: ``POST {url}/retrieve`` with ``{"queries", "topk", "return_scores": true}``;
documents are ``{"id", "contents"}`` rows (split into title and text by
``Document.from_contents``). ``GET {url}/access?id=…`` reads one document (this project's
server; 404 = unknown id).

A rollout must survive any server, so every failure of a call — server
down, timeout, HTTP 4xx/5xx, a reply over the byte cap, a gzip bomb or a bad gzip body, an
unsupported ``Content-Encoding``, JSON nested too deeply, a number too large for a float, any
shape or type other than the documented one — ends as ``ToolError`` (never another exception),
which the search tools (``tools.search``) turn into an error observation (``ToolResult.ok`` False).

Limits of one call (one HTTP request and its retries):

* ``deadline_s``: total wall-clock budget of the call, retries and backoff included. The
  request runs in a worker thread and the caller waits at most ``deadline_s`` (a server that
  drips one byte every 2 s cannot hold it longer); each attempt's connect/read/write timeout is
  ``min(timeout_s, time left)``, and the worker stops reading at the deadline.
* ``max_response_bytes``: a reply body is read as a stream and counted *after* decompression
  (gzip / deflate only; other encodings are refused), so neither a 200 MB chunked reply nor a
  gzip bomb is held in memory; one network chunk inflates to at most ~1,000× its size
  (deflate's ratio limit) before the count stops it.
* ``batch_results``: ``search`` sends at most ``max(1, batch_results // topk)`` queries per
  request (one call each), which keeps requests under the server's per-request caps
  (``retrieval_server.DEFAULT_MAX_RESULTS``).

Retried (``max_retries`` times, backoff ``backoff_s · 2^i``): timeouts, connection errors, HTTP
5xx/429 and replies that do not parse. Not retried: other HTTP statuses and replies over the
byte cap.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Sequence

import httpx

from mempo_jax.tools.corpus import Document, Hit
from mempo_jax.tools.search import ToolError

DEFAULT_MAX_RESPONSE_BYTES = 32 * 2**20  # decompressed bytes of one reply
DEFAULT_BATCH_RESULTS = 4096  # queries × topk per /retrieve request
_ERROR_BODY_BYTES = 2048  # of a non-200 reply, read for the error detail
_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})  # one layer at most


class _Fail(Exception):
    """One failed attempt: ``reason`` is the ToolError category, ``retry`` whether to try again."""

    def __init__(self, reason: str, detail: str, retry: bool):
        super().__init__(detail)
        self.reason, self.detail, self.retry = reason, detail, retry


def _document(row: Any) -> Document:
    """A ``{"id": str | int, "contents": str}`` row as a Document.

    Raises:
      ValueError: any other shape or type.
    """
    if not isinstance(row, dict):
        raise ValueError(f"document must be an object, got {type(row).__name__}")
    doc_id, contents = row.get("id"), row.get("contents")
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise ValueError(f"document 'id' must be a string or an integer, got {type(doc_id).__name__}")
    if not isinstance(contents, str):
        raise ValueError(f"document 'contents' must be a string, got {type(contents).__name__}")
    return Document.from_contents(str(doc_id), contents)


def _score(value: Any) -> float:
    """A finite JSON number as a float.

    Raises:
      ValueError: not a number (``bool`` included), or not finite / too large for a float.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'score' must be a number, got {type(value).__name__}")
    try:
        out = float(value)
    except OverflowError:  # a 400-digit integer
        raise ValueError(f"'score' is too large for a float ({len(str(abs(value)))} digits)") from None
    if not math.isfinite(out):
        raise ValueError(f"'score' must be finite, got {out}")
    return out


def _field(data: Any, name: str) -> Any:
    if not isinstance(data, dict) or name not in data:
        raise ValueError(f"reply must be a JSON object with {name!r}, got {type(data).__name__}")
    return data[name]


class RemoteSearchBackend:
    """HTTP search backend (same ``search``/``get`` contract as ``BM25Index``).

    Args:
      url: server base URL, e.g. ``"http://127.0.0.1:8000"`` (a trailing ``/retrieve`` is
        accepted, as Search-R1 configs write it).
      timeout_s: per-request connect/read/write timeout, seconds (> 0).
      max_retries: retries after the first attempt (>= 0).
      backoff_s: sleep before retry i is ``backoff_s · 2^i`` seconds (>= 0).
      deadline_s: total budget of one call, retries included, seconds (> 0).
      max_response_bytes: cap on one reply body after decompression, bytes (>= 1).
      batch_results: queries × topk per ``/retrieve`` request (>= 1).

    Raises:
      ValueError: bad arguments.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, max_retries: int = 2, backoff_s: float = 0.1, *,
                 deadline_s: float = 30.0, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 batch_results: int = DEFAULT_BATCH_RESULTS):
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0; got {timeout_s}, {max_retries}, {backoff_s}")
        if deadline_s <= 0 or max_response_bytes < 1 or batch_results < 1:
            raise ValueError(f"need deadline_s > 0, max_response_bytes >= 1, batch_results >= 1; got "
                             f"{deadline_s}, {max_response_bytes}, {batch_results}")
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.url = base
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.deadline_s = float(deadline_s)
        self.max_response_bytes = int(max_response_bytes)
        self.batch_results = int(batch_results)
        # gzip/deflate only: other codecs (brotli, zstd, stacked layers) have no useful ratio bound
        self._client = httpx.Client(timeout=httpx.Timeout(self.timeout_s), headers={"Accept-Encoding": "gzip, deflate"})

    def close(self) -> None:
        """Close the pooled HTTP connections."""
        self._client.close()

    def __enter__(self) -> "RemoteSearchBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------------
    def _read(self, resp: httpx.Response, cap: int, truncate: bool, deadline: float, cancel: threading.Event) -> bytes:
        """The decompressed body, at most ``cap`` bytes; stops at the deadline.

        Raises:
          _Fail: over ``cap`` (unless ``truncate``), an unsupported encoding, past the deadline.
        """
        encoding = resp.headers.get("content-encoding", "").strip().lower()
        if encoding not in _ENCODINGS:
            raise _Fail("bad response", f"unsupported Content-Encoding {encoding[:40]!r}", True)
        declared = resp.headers.get("content-length", "")
        if not truncate and not encoding and declared.isdigit() and int(declared) > cap:
            raise _Fail("reply too large", f"Content-Length {declared} > {cap} bytes", False)
        parts, size = [], 0
        for chunk in resp.iter_bytes():
            if cancel.is_set() or time.monotonic() > deadline:
                raise _Fail("timeout", f"reply not complete within the {self.deadline_s}s deadline", False)
            size += len(chunk)
            if size > cap:
                if truncate:
                    parts.append(chunk[: len(chunk) - (size - cap)])
                    break
                raise _Fail("reply too large", f"reply over {cap} bytes (after decompression)", False)
            parts.append(chunk)
        return b"".join(parts)

    def _attempt(self, method: str, path: str, accept: tuple[int, ...], parse: Callable[[int, Any], Any],
                 kwargs: dict[str, Any], deadline: float, cancel: threading.Event) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Fail("timeout", f"no reply within the {self.deadline_s}s deadline", False)
        timeout = httpx.Timeout(min(self.timeout_s, left))
        try:
            with self._client.stream(method, f"{self.url}{path}", timeout=timeout, **kwargs) as resp:
                status = resp.status_code
                if status != 200:
                    snippet = self._read(resp, _ERROR_BODY_BYTES, True, deadline, cancel)
                    snippet = snippet.decode("utf-8", "replace")[:200]
                    if status >= 500 or status == 429:
                        raise _Fail(f"http {status}", snippet, True)
                    if status not in accept:
                        raise _Fail(f"http {status}", snippet, False)
                    data = None
                else:
                    data = json.loads(self._read(resp, self.max_response_bytes, False, deadline, cancel))
                return parse(status, data)
        except _Fail:
            raise
        except httpx.TimeoutException as exc:
            raise _Fail("timeout", f"{type(exc).__name__} after {timeout.read}s", True) from None
        except httpx.TransportError as exc:  # connect / read / write / protocol errors
            raise _Fail("unreachable", f"{type(exc).__name__}: {str(exc)[:160]}", True) from None
        except Exception as exc:  # noqa: BLE001 - httpx.DecodingError (bad gzip), JSON (RecursionError,
            # ValueError), shape and type errors of parse, MemoryError: never out of a rollout
            raise _Fail("bad response", f"{type(exc).__name__}: {str(exc)[:160]}", True) from None

    def _attempts(self, method: str, path: str, accept: tuple[int, ...], parse: Callable[[int, Any], Any],
                  kwargs: dict[str, Any], deadline: float, cancel: threading.Event) -> Any:
        """``parse(status, json)`` of the first good attempt; raises ToolError after the last."""
        fail, tried = _Fail("timeout", f"no reply within the {self.deadline_s}s deadline", False), 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline or cancel.wait(pause):
                    break
            tried += 1
            try:
                return self._attempt(method, path, accept, parse, kwargs, deadline, cancel)
            except _Fail as exc:
                fail = exc
                if not exc.retry or cancel.is_set():
                    break
        raise ToolError(fail.reason, f"{self.url}{path}: {fail.detail} ({tried} attempts)")

    def _call(self, method: str, path: str, accept: tuple[int, ...], parse: Callable[[int, Any], Any],
              **kwargs: Any) -> Any:
        """One call: ``_attempts`` in a worker thread, waited on for at most ``deadline_s``.

        Raises:
          ToolError: reason ``"timeout" | "unreachable" | "http NNN" | "bad response" |
            "reply too large"``; nothing else (any other exception of the worker is reported
            as ``"bad response"``).
        """
        deadline = time.monotonic() + self.deadline_s
        cancel = threading.Event()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = self._attempts(method, path, accept, parse, kwargs, deadline, cancel)
            except ToolError as exc:
                box["error"] = exc
            except BaseException as exc:  # noqa: BLE001 - the caller gets a ToolError, always
                box["error"] = ToolError("bad response", f"{self.url}{path}: {type(exc).__name__}: {str(exc)[:160]}")

        worker = threading.Thread(target=work, name="mempo-retriever-call", daemon=True)
        worker.start()
        worker.join(self.deadline_s)
        if worker.is_alive():  # the worker stops at its next chunk or when its read times out
            cancel.set()
            raise ToolError("timeout", f"{self.url}{path}: no complete reply within the {self.deadline_s}s deadline")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # -- the backend contract ---------------------------------------------------------------
    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-k hits per query from ``POST /retrieve`` (return_scores = true).

        Queries are sent ``max(1, batch_results // topk)`` per request (one call each).

        Returns:
          ``len(queries)`` lists of at most ``topk`` Hits in server order (the server clamps
          topk; extra hits of a misbehaving server are dropped).

        Raises:
          ValueError: ``topk < 1`` or ``queries`` is a single string.
          ToolError: a request failed (see module doc); the reply of any shape other than
            ``{"result": [[{"document": {"id", "contents"}, "score": number}, …] per query]}``
            is ``"bad response"``.
        """
        if isinstance(queries, str):
            raise ValueError("queries must be a list of strings, not one string")
        queries = [str(q) for q in queries]
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        per_request = max(1, self.batch_results // topk)
        out: list[list[Hit]] = []
        for start in range(0, len(queries), per_request):
            chunk = queries[start:start + per_request]

            def parse(status: int, data: Any, n: int = len(chunk)) -> list[list[Hit]]:
                result = _field(data, "result")
                if not isinstance(result, list) or len(result) != n:
                    raise ValueError(f"'result' must be a list of {n} lists")
                rows = []
                for hits in result:
                    if not isinstance(hits, list):
                        raise ValueError(f"each 'result' entry must be a list, got {type(hits).__name__}")
                    rows.append([Hit(_document(_field(h, "document")), _score(_field(h, "score"))) for h in hits[:topk]])
                return rows

            body = {"queries": chunk, "topk": topk, "return_scores": True}
            out += self._call("POST", "/retrieve", (200,), parse, json=body)
        return out

    def get(self, doc_id: str) -> Document | None:
        """The document from ``GET /access?id=…``, or None on 404.

        Raises:
          ToolError: the call failed (see module doc), or the reply is not
            ``{"document": {"id", "contents"}}``.
        """
        def parse(status: int, data: Any) -> Document | None:
            return None if status == 404 else _document(_field(data, "document"))

        return self._call("GET", "/access", (200, 404), parse, params={"id": str(doc_id)})
