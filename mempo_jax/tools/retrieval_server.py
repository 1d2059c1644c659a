"""A Search-R1-compatible retrieval server over a local BM25 index (FastAPI + uvicorn).

docs/algorithm.md §7 (Search-R1 ``search_r1/search/retrieval_server.py`` contract)::

    POST /retrieve  {"queries": [str], "topk": int, "return_scores": bool}
      → {"result": [[{"document": {"id", "contents"}, "score": float}, …] per query]}
        (bare documents when return_scores is false; topk defaults to --topk; topk larger
        than the corpus is clamped; documents sharing no term with the query are left out)
    GET  /access?id=ID  and  POST /access {"id": ID}
      → {"document": {"id", "contents"}}; 404 {"detail": …} for an unknown id
    GET  /health → {"status": "ok", "num_docs": int}

Per-request caps (``create_app`` arguments): a body over
``max_body_bytes`` is answered 413 before it is parsed (declared ``Content-Length`` or counted
while a chunked body arrives); more than ``max_queries`` queries, or ``queries × min(topk,
num_docs)`` over ``max_results``, is answered 422. Each answer is ``{"detail": …}`` naming the
limit, e.g. ``"too many results per request: 300 queries × topk 100 = 30000 > max_results
16384; send fewer queries per request or a smaller topk"``.

The ``mempo-retrieve-server`` command (``mempo_jax.commands.retrieval_server``) serves it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

import fastapi
import pydantic

from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import load_corpus

DEFAULT_MAX_QUERIES = 4096  # queries per /retrieve request
DEFAULT_MAX_RESULTS = 16384  # queries × min(topk, num_docs) per request (~16 MB of 1 KB passages)
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # request body (4,096 queries of 1 KB)


class RetrieveRequest(pydantic.BaseModel):
    """Body of ``POST /retrieve`` (Search-R1 ``QueryRequest``)."""

    queries: list[str]
    topk: Optional[int] = pydantic.Field(default=None, ge=1)
    return_scores: bool = False


class _BodyLimit:
    """ASGI middleware: answer 413 to a request body over ``max_bytes``, before the app reads it.

    A declared ``Content-Length`` over the limit is refused at once; otherwise the body is
    buffered while counting (chunked bodies included) and replayed to the app. (FastAPI's own
    ``max_body_size`` answers a plain ``Content Too Large`` that does not state the limit.)
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send: Any, size: str) -> None:
        body = json.dumps({"detail": f"request body of {size} bytes is over the limit of {self.max_bytes} bytes "
                                     "(max_body_bytes); send fewer queries per request"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, declared.decode())
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await self._refuse(send, f"more than {self.max_bytes}")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}

        await self.app(scope, replay, send)


class AccessRequest(pydantic.BaseModel):
    """Body of ``POST /access``."""

    id: str


def create_app(index: BM25Index, default_topk: int = 3, *, max_queries: int = DEFAULT_MAX_QUERIES,
               max_results: int = DEFAULT_MAX_RESULTS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> fastapi.FastAPI:
    """The FastAPI application serving ``index`` (routes and caps in the module doc).

    Endpoints are plain ``def`` functions, so uvicorn runs concurrent requests in its thread
    pool; BM25 search only reads the index.

    Args:
      index: the BM25 index (any object with BM25Index's ``search``/``get``/``__len__``).
      default_topk: hits per query when a request omits ``topk``, ``>= 1``.
      max_queries: queries per ``/retrieve`` request (more: 422), ``>= 1``.
      max_results: ``len(queries) × min(topk, len(index))`` per request (more: 422), ``>= 1``.
      max_body_bytes: request body size, bytes (more: 413), ``>= 1``.

    Raises:
      ValueError: any argument ``< 1``.
    """
    limits = {"default_topk": default_topk, "max_queries": max_queries, "max_results": max_results,
              "max_body_bytes": max_body_bytes}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    app = fastapi.FastAPI(title="mempo_jax retrieval server", docs_url=None, redoc_url=None)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "num_docs": len(index)}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict[str, Any]:
        topk = req.topk if req.topk is not None else default_topk
        if len(req.queries) > max_queries:
            raise fastapi.HTTPException(status_code=422, detail=(
                f"too many queries per request: {len(req.queries)} > max_queries {max_queries}; "
                "send fewer queries per request"))
        served = len(req.queries) * min(topk, len(index))
        if served > max_results:
            raise fastapi.HTTPException(status_code=422, detail=(
                f"too many results per request: {len(req.queries)} queries × topk {min(topk, len(index))} = "
                f"{served} > max_results {max_results}; send fewer queries per request or a smaller topk"))
        results = index.search(req.queries, topk)
        if req.return_scores:
            out = [[{"document": h.document.to_row(), "score": h.score} for h in hits] for hits in results]
        else:
            out = [[h.document.to_row() for h in hits] for hits in results]
        return {"result": out}

    def access(doc_id: str) -> dict[str, Any]:
        doc = index.get(doc_id)
        if doc is None:
            raise fastapi.HTTPException(status_code=404, detail=f"unknown document id {doc_id[:64]!r}")
        return {"document": doc.to_row()}

    @app.get("/access")
    def access_get(id: str) -> dict[str, Any]:  # noqa: A002 - the query parameter is "id"
        return access(id)

    @app.post("/access")
    def access_post(req: AccessRequest) -> dict[str, Any]:
        return access(req.id)

    return app


def build_index(corpus: str | None, index_dir: str | None) -> BM25Index:
    """Load ``index_dir`` if it holds a saved index, else build from ``corpus`` (and save there).

    Raises:
      ValueError: neither a saved index nor a corpus file was given; corpus errors name file:line.
    """
    if index_dir and (pathlib.Path(index_dir) / "mempo_bm25.json").is_file():
        return BM25Index.load(index_dir)
    if not corpus:
        raise ValueError("--corpus is required unless --index names a saved index")
    index = BM25Index(load_corpus(corpus))
    if index_dir:
        index.save(index_dir)
    return index
