"""Issue 12 items 6, 7, 9: the retriever client survives any server, the server caps requests.

Every hostile reply comes from a real HTTP server on 127.0.0.1 (stdlib ``http.server`` in a
thread); the caps are checked on the real FastAPI app served by uvicorn on a loopback port.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import threading
import time
import zlib

import httpx
import pytest
import uvicorn

from mempo_jax.text.protocol import parse_turn, render_turn
from mempo_jax.commands import retrieval_server as retrieval_command
from mempo_jax.tools import retrieval_server
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document, write_corpus_jsonl
from mempo_jax.tools.remote import DEFAULT_MAX_RESPONSE_BYTES, RemoteSearchBackend
from mempo_jax.tools.search import ToolError, search_environment

DOC = Document("7", "Violin", "The violin is a string instrument.")
ROW = DOC.to_row()
MB = 2**20


def _hits_json(score: str = "1.5", document: str | None = None) -> bytes:
    document = json.dumps(ROW) if document is None else document
    return ('{"result": [[{"document": ' + document + ', "score": ' + score + "}]]}").encode()


@functools.cache
def _gzip_bomb(decompressed: int = 64 * MB) -> bytes:
    """``decompressed`` zero bytes as ~1/1000 of that in gzip (run-length deflate: fast)."""
    comp = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS, 9, zlib.Z_RLE)  # gzip container
    zeros = bytes(MB)
    return b"".join(comp.compress(zeros) for _ in range(decompressed // MB)) + comp.flush()


# mode -> (status, headers, body); "drip" and "chunked" stream (see Handler).
_NESTED = b'{"result": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
REPLIES = {
    "nested": (200, {}, _NESTED),
    "bad_gzip": (200, {"Content-Encoding": "gzip"}, b"this is not gzip data at all"),
    "gzip_twice": (200, {"Content-Encoding": "gzip, gzip"}, gzip.compress(gzip.compress(_hits_json()))),
    "brotli": (200, {"Content-Encoding": "br"}, b"\x0b\x02\x80hello\x03"),
    "big_int_score": (200, {}, _hits_json("1" + "0" * 400)),
    "inf_score": (200, {}, _hits_json("1e400")),
    "nan_score": (200, {}, _hits_json("NaN")),
    "string_score": (200, {}, _hits_json('"1.5"')),
    "bool_score": (200, {}, _hits_json("true")),
    "no_score": (200, {}, b'{"result": [[{"document": ' + json.dumps(ROW).encode() + b"}]]}"),
    "top_list": (200, {}, b"[[1, 2]]"),
    "top_string": (200, {}, b'"result"'),
    "top_null": (200, {}, b"null"),
    "result_dict": (200, {}, b'{"result": {"0": []}}'),
    "result_wrong_len": (200, {}, b'{"result": [[], []]}'),
    "hits_not_list": (200, {}, b'{"result": [{"document": 1}]}'),
    "hit_not_dict": (200, {}, b'{"result": [["x"]]}'),
    "doc_string": (200, {}, _hits_json(document='"just text"')),
    "doc_id_list": (200, {}, _hits_json(document='{"id": [1], "contents": "x"}')),
    "doc_id_bool": (200, {}, _hits_json(document='{"id": true, "contents": "x"}')),
    "doc_id_empty": (200, {}, _hits_json(document='{"id": "", "contents": "x"}')),
    "contents_int": (200, {}, _hits_json(document='{"id": "1", "contents": 5}')),
    "bad_utf8": (200, {}, b'{"result": [[{"document": {"id": "1", "contents": "\xff\xfe"}, "score": 1}]]}'),
    "huge_int": (200, {}, _hits_json("9" * 5000)),  # over Python's int-string digit limit
    "html": (200, {"Content-Type": "text/html"}, b"<html>not json</html>"),
    "redirect": (302, {"Location": "http://127.0.0.1:1/elsewhere"}, b""),
    "huge_content_length": (200, {"Content-Length": str(200 * MB)}, b"{"),
}
STREAMED = {"drip", "chunked", "gzip_bomb"}
ALL_MODES = sorted(REPLIES) + sorted(STREAMED)


class Hostile(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), Handler)
        self.mode, self.requests, self.sent = mode, 0, 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _stream(self, headers: dict, chunks):
        """Send a chunked reply; stops quietly when the client hangs up."""
        self.send_response(200)
        for k, v in {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                with self.server.lock:
                    self.server.sent += len(chunk)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.requests += 1
        mode = self.server.mode
        if mode == "drip":  # one byte every 0.25 s for 8 s (a valid reply, for one who waits)
            body = _hits_json()

            def paced():
                for i in range(min(len(body), 32)):
                    time.sleep(0.25)
                    yield body[i:i + 1]

            self._stream({}, paced())
            return
        if mode == "chunked":  # 200 MB of JSON string, 64 KB at a time
            self._stream({}, [b'{"result": "'] + [b"a" * 65536] * 3200)
            return
        if mode == "gzip_bomb":  # 64 MB of zeros (over the 32 MiB default cap) in ~65 KB of gzip
            bomb = _gzip_bomb()
            self._stream({"Content-Encoding": "gzip"}, [bomb[i:i + 16384] for i in range(0, len(bomb), 16384)])
            return
        status, headers, body = REPLIES[mode]
        self.send_response(status)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if mode == "huge_content_length":
            self.close_connection = True

    do_GET = do_POST


@pytest.fixture
def hostile(request):
    server = Hostile(request.param)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _client(url, **kw):
    return RemoteSearchBackend(url, **{"timeout_s": 5.0, "max_retries": 0, "backoff_s": 0.01, "deadline_s": 10.0, **kw})


EXPECTED_REASON = {"drip": "timeout", "chunked": "reply too large", "gzip_bomb": "reply too large",
                   "huge_content_length": "reply too large", "redirect": "http 302"}


# -- item 6: every failure is a ToolError, and an error observation in a rollout ----------------------
@pytest.mark.parametrize("hostile", ALL_MODES, indirect=True)
def test_hostile_reply_is_a_tool_error_and_an_error_observation(hostile):
    # 1 s for the dripping server (the deadline is what ends it); the others answer at once, and a
    # short deadline on a loaded machine would turn their reason into a timeout
    deadline = 1.0 if hostile.mode == "drip" else 10.0
    backend = _client(hostile.url, deadline_s=deadline)
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        backend.search(["violin"], topk=3)
    assert err.value.reason == EXPECTED_REASON.get(hostile.mode, "bad response"), err.value
    with pytest.raises(ToolError):
        backend.get("7")
    turns = [parse_turn(render_turn("m", None, "search", "violin")), parse_turn(render_turn("m", None, "access", "7"))]
    results = search_environment(backend, topk=3).execute_batch(turns)
    assert [(r.kind, r.ok) for r in results] == [("search", False), ("access", False)]
    assert results[0].observation.startswith("Search failed (") and "127.0.0.1" not in results[0].observation
    assert time.monotonic() - start < 4 * deadline + 3.0  # four calls, each within its deadline


def test_good_reply_still_parses_with_int_ids_and_extra_hits_cut_to_topk():
    server = Hostile("x")
    body = json.dumps({"result": [[{"document": {"id": 7, "contents": ROW["contents"]}, "score": 2},
                                   {"document": ROW, "score": 1.0}, {"document": ROW, "score": 0.5}]]}).encode()
    REPLIES["x"] = (200, {}, body)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        hits = _client(server.url).search(["violin"], topk=2)
    finally:
        server.shutdown()
        server.server_close()
        del REPLIES["x"]
    assert [(h.document, h.score) for h in hits[0]] == [(DOC, 2.0), (DOC, 1.0)]


# -- item 7: total deadline, byte cap counted after decompression ---------------------------------
@pytest.mark.parametrize("hostile", ["drip"], indirect=True)
def test_dripping_server_cannot_hold_a_call_past_the_deadline(hostile):
    # per-read timeout 5 s never fires (a byte every 0.25 s); the whole reply would take 8 s
    backend = _client(hostile.url, timeout_s=5.0, deadline_s=1.0, max_retries=3)
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        backend.search(["violin"], topk=1)
    elapsed = time.monotonic() - start
    assert err.value.reason == "timeout" and "deadline" in str(err.value)
    assert 0.9 < elapsed < 1.6, elapsed


@pytest.mark.parametrize("hostile", ["chunked"], indirect=True)
def test_200_mb_chunked_reply_is_cut_at_the_byte_cap(hostile):
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        _client(hostile.url, deadline_s=30.0).search(["violin"], topk=1)
    assert err.value.reason == "reply too large" and str(DEFAULT_MAX_RESPONSE_BYTES) in str(err.value)
    time.sleep(0.2)
    assert hostile.sent < DEFAULT_MAX_RESPONSE_BYTES + 16 * MB  # the client stopped reading, not 200 MB
    assert hostile.requests == 1  # a reply over the cap is not retried
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("hostile", ["gzip_bomb"], indirect=True)
def test_gzip_bomb_is_counted_after_decompression(hostile):
    backend = _client(hostile.url, max_response_bytes=4 * MB)
    with pytest.raises(ToolError) as err:
        backend.search(["violin"], topk=1)
    assert err.value.reason == "reply too large" and "after decompression" in str(err.value)


def test_client_sends_at_most_batch_results_per_request():
    seen = []

    class Echo(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((len(req["queries"]), req["topk"]))
            body = json.dumps({"result": [[{"document": {"id": q, "contents": q}, "score": 1.0}] for q in req["queries"]]})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        queries = [f"q{i}" for i in range(11)]
        hits = _client(f"http://127.0.0.1:{server.server_address[1]}", batch_results=9).search(queries, topk=3)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [(3, 3), (3, 3), (3, 3), (2, 3)]  # 9 // 3 = 3 queries per request
    assert [h[0].document.id for h in hits] == queries


def test_client_arguments_are_checked():
    for kw in ({"deadline_s": 0}, {"max_response_bytes": 0}, {"batch_results": 0}):
        with pytest.raises(ValueError):
            RemoteSearchBackend("http://127.0.0.1:1", **kw)


# -- item 9: the server's caps, on the real app -------------------------------------------------------
WORDS = ["river", "mountain", "castle", "violin", "comet", "desert", "harbor", "glacier", "orchid", "falcon"]
DOCS = [Document(str(i), w.title(), f"The {w} is here.") for i, w in enumerate(WORDS)]


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """``retrieval_command.main`` with small caps (the CLI flags), served by uvicorn on loopback."""
    tmp = tmp_path_factory.mktemp("capped")
    write_corpus_jsonl(DOCS, tmp / "c.jsonl")
    apps = []
    real_run = uvicorn.run
    uvicorn.run = lambda app, **kw: apps.append(app)
    try:
        assert retrieval_command.main(["--corpus", str(tmp / "c.jsonl"), "--max_queries", "6", "--max_results", "12",
                                      "--max_body_bytes", "2000"]) == 0
    finally:
        uvicorn.run = real_run
    server = uvicorn.Server(uvicorn.Config(apps[0], host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def _post(url, body, **kw):
    return httpx.post(f"{url}/retrieve", timeout=10, **({"json": body} if body is not None else kw))


def test_server_caps_queries_times_topk(capped):
    assert _post(capped, {"queries": ["violin"] * 6, "topk": 2}).status_code == 200  # 12 results: at the cap
    resp = _post(capped, {"queries": ["violin"] * 5, "topk": 3})
    assert resp.status_code == 422
    assert resp.json()["detail"] == ("too many results per request: 5 queries × topk 3 = 15 > max_results 12; "
                                     "send fewer queries per request or a smaller topk")
    resp = _post(capped, {"queries": ["violin"] * 7, "topk": 1})
    assert resp.status_code == 422 and "7 > max_queries 6" in resp.json()["detail"]
    # topk is clamped to the corpus (10 documents) before the cap: 1 query × topk 1000 = 10 results
    resp = _post(capped, {"queries": ["violin"], "topk": 1000})
    assert resp.status_code == 200 and len(resp.json()["result"][0]) == 1


def test_server_caps_the_body_size(capped):
    big = {"queries": ["violin " * 300], "topk": 1}  # ~2.1 KB, one query
    resp = _post(capped, big)
    assert resp.status_code == 413
    assert "over the limit of 2000 bytes (max_body_bytes)" in resp.json()["detail"]

    def chunks():  # no Content-Length: a chunked body, counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i:i + 500]

    resp = _post(capped, None, content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and "2000 bytes" in resp.json()["detail"]
    small = json.dumps({"queries": ["violin"], "topk": 1}).encode()
    resp = _post(capped, None, content=iter([small[:10], small[10:]]), headers={"Content-Type": "application/json"})
    assert resp.status_code == 200 and resp.json()["result"][0][0]["id"] == "3"
    assert httpx.get(f"{capped}/access", params={"id": "3"}, timeout=10).status_code == 200


def test_client_batches_under_the_server_cap(capped):
    queries = [WORDS[i % 10] for i in range(10)]
    assert _post(capped, {"queries": queries, "topk": 2}).status_code == 422  # 20 results in one request
    with RemoteSearchBackend(capped, batch_results=12, max_retries=0) as remote:
        got = remote.search(queries, topk=2)  # 6 queries per request
    want = BM25Index(DOCS).search(queries, topk=2)
    assert [[h.document for h in hs] for hs in got] == [[h.document for h in hs] for hs in want]


def test_server_rejects_bad_caps(tmp_path, capsys):
    write_corpus_jsonl(DOCS, tmp_path / "c.jsonl")
    assert retrieval_command.main(["--corpus", str(tmp_path / "c.jsonl"), "--max_results", "0"]) == 2
    assert "--max_results must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_body_bytes"):
        retrieval_server.create_app(BM25Index(DOCS), max_body_bytes=0)
