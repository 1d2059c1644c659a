"""A Search-R1-compatible retrieval server over a local BM25 index (``mempo-retrieve-server``)::

    python -m mempo_jax.commands.retrieval_server --corpus corpus.jsonl [--index DIR] \\
        --host 127.0.0.1 --port 8000

Serves ``mempo_jax.tools.retrieval_server.create_app`` with uvicorn. ``--index DIR``: load the
saved index when DIR holds one, otherwise build it from ``--corpus`` and save it there. Binds
127.0.0.1 by default (loopback only). ``--max_queries``, ``--max_results`` and
``--max_body_bytes`` are ``create_app``'s per-request caps. Exit status: 2 with one
``retrieval_server:`` line on stderr for a bad argument, corpus or index; 0 when the server stops.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import uvicorn

from mempo_jax.tools.retrieval_server import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUERIES, DEFAULT_MAX_RESULTS,
                                              build_index, create_app)


def main(argv: Sequence[str] | None = None) -> int:
    """Build or load the index and serve it; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="corpus: rows {id, contents} (Search-R1), {id, title, text}, or a HippoRAG "
                        "JSON array of {title, text} (JSONL, JSON array or parquet)")
    parser.add_argument("--index", help="folder of a saved BM25 index (built and saved if absent)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="hits per query when a request gives none")
    parser.add_argument("--max_queries", type=int, default=DEFAULT_MAX_QUERIES, help="queries per request (422 above)")
    parser.add_argument("--max_results", type=int, default=DEFAULT_MAX_RESULTS,
                        help="queries × topk per request (422 above)")
    parser.add_argument("--max_body_bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="request body size in bytes (413 above)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    try:
        for name, value in (("topk", args.topk), ("max_queries", args.max_queries), ("max_results", args.max_results),
                            ("max_body_bytes", args.max_body_bytes)):
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        index = build_index(args.corpus, args.index)
        app = create_app(index, args.topk, max_queries=args.max_queries, max_results=args.max_results,
                         max_body_bytes=args.max_body_bytes)
    except (ValueError, OSError) as exc:
        print(f"retrieval_server: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
