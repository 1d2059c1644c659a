"""A Search-R1-compatible retrieval server over a local BM25 index (FastAPI + uvicorn).

MEMPO_SPEC §7 (Search-R1 ``search_r1/search/retrieval_server.py`` contract)::

    POST /retrieve  {"queries": [str], "topk": int, "return_scores": bool}
      → {"result": [[{"document": {"id", "contents"}, "score": float}, …] per query]}
        (bare documents when return_scores is false; topk defaults to --topk; topk larger
        than the corpus is clamped; documents sharing no term with the query are left out)
    GET  /access?id=ID  and  POST /access {"id": ID}
      → {"document": {"id", "contents"}}; 404 {"detail": …} for an unknown id
    GET  /health → {"status": "ok", "num_docs": int}

Run::

    python -m mempo_jax.tools.retrieval_server --corpus corpus.jsonl [--index DIR] \\
        --host 127.0.0.1 --port 8000

``--index DIR``: load the saved index when DIR holds one, otherwise build it from ``--corpus``
and save it there. Binds 127.0.0.1 by default (loopback only).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Optional, Sequence

import fastapi
import pydantic

from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import load_corpus_jsonl

MAX_QUERIES = 4096  # per request
MAX_TOPK = 1000


class RetrieveRequest(pydantic.BaseModel):
    """Body of ``POST /retrieve`` (Search-R1 ``QueryRequest``)."""

    queries: list[str] = pydantic.Field(max_length=MAX_QUERIES)
    topk: Optional[int] = pydantic.Field(default=None, ge=1, le=MAX_TOPK)
    return_scores: bool = False


class AccessRequest(pydantic.BaseModel):
    """Body of ``POST /access``."""

    id: str


def create_app(index: BM25Index, default_topk: int = 3) -> fastapi.FastAPI:
    """The FastAPI application serving ``index`` (routes in the module doc).

    Endpoints are plain ``def`` functions, so uvicorn runs concurrent requests in its thread
    pool; BM25 search only reads the index.

    Args:
      index: the BM25 index (any object with BM25Index's ``search``/``get``/``__len__``).
      default_topk: hits per query when a request omits ``topk``, ``>= 1``.

    Raises:
      ValueError: ``default_topk < 1``.
    """
    if default_topk < 1:
        raise ValueError(f"default_topk must be >= 1, got {default_topk}")
    app = fastapi.FastAPI(title="mempo_jax retrieval server", docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "num_docs": len(index)}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict[str, Any]:
        topk = req.topk if req.topk is not None else default_topk
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
    index = BM25Index(load_corpus_jsonl(corpus))
    if index_dir:
        index.save(index_dir)
    return index


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see module doc). Returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="corpus JSONL with rows {id, contents}")
    parser.add_argument("--index", help="folder of a saved BM25 index (built and saved if absent)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="hits per query when a request gives none")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    try:
        index = build_index(args.corpus, args.index)
    except (ValueError, OSError) as exc:
        print(f"retrieval_server: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(create_app(index, args.topk), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
