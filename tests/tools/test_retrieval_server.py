"""The Search-R1 /retrieve server as a real uvicorn process on loopback, and the HTTP client
against it and against stub servers that are down, slow, failing or not speaking JSON."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading
import time

import httpx
import pytest

from mempo_jax.text.protocol import parse_turn, render_turn
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document, write_corpus_jsonl
from mempo_jax.tools.remote import RemoteSearchBackend
from mempo_jax.commands.retrieval_server import main
from mempo_jax.tools.retrieval_server import build_index
from mempo_jax.tools.search import ToolError, search_environment

from conftest import free_port, retrieval_server

WORDS = ["river", "mountain", "castle", "violin", "comet", "desert", "harbor", "glacier", "orchid", "falcon"]
# 10 documents; document i mentions WORDS[i] twice and its neighbour once, so rankings are known.
DOCS = [
    Document(str(i), f"{w.title()} article", f"The {w} is described here. A {w} is near a {WORDS[(i + 1) % 10]}.")
    for i, w in enumerate(WORDS)
]


@pytest.fixture(scope="module")
def local_index():
    return BM25Index(DOCS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m mempo_jax.commands.retrieval_server`` on a free loopback port; yields its URL."""
    tmp = tmp_path_factory.mktemp("server")
    write_corpus_jsonl(DOCS, tmp / "corpus.jsonl")
    with retrieval_server(tmp / "corpus.jsonl", tmp / "index", 10, "--topk", "3", timeout_s=45) as url:
        yield {"url": url, "index_dir": tmp / "index"}


def retrieve(url, queries, topk=None, return_scores=True):
    body = {"queries": queries, "return_scores": return_scores}
    if topk is not None:
        body["topk"] = topk
    resp = httpx.post(f"{url}/retrieve", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- the server ------------------------------------------------------------------------------------
def test_retrieve_with_scores(server, local_index):
    out = retrieve(server["url"], ["violin", "comet glacier"], topk=2)
    assert list(out) == ["result"] and len(out["result"]) == 2
    violin = out["result"][0]
    assert [h["document"]["id"] for h in violin] == ["3", "2"]  # own doc, then the neighbour's
    assert violin[0]["document"] == {"id": "3", "contents": '"Violin article"\n' + DOCS[3].text}
    assert violin[0]["score"] > violin[1]["score"] > 0
    want = local_index.search(["violin", "comet glacier"], topk=2)
    for got_hits, want_hits in zip(out["result"], want):
        assert [h["document"]["id"] for h in got_hits] == [h.document.id for h in want_hits]
        assert [h["score"] for h in got_hits] == pytest.approx([h.score for h in want_hits], rel=1e-6)


def test_retrieve_without_scores_bare_documents(server):
    scored = retrieve(server["url"], ["harbor", "orchid"], topk=3)
    bare = retrieve(server["url"], ["harbor", "orchid"], topk=3, return_scores=False)
    assert bare["result"] == [[h["document"] for h in hits] for hits in scored["result"]]
    assert set(bare["result"][0][0]) == {"id", "contents"}


def test_empty_hits_topk_clamp_and_default(server):
    url = server["url"]
    assert retrieve(url, ["the of and", "zzzunknown"], topk=3)["result"] == [[], []]
    assert retrieve(url, [], topk=3)["result"] == []
    everything = retrieve(url, ["article"], topk=1000)["result"][0]  # every title has "article"
    assert sorted(int(h["document"]["id"]) for h in everything) == list(range(10))
    assert len(retrieve(url, ["article"])["result"][0]) == 3  # --topk 3 when a request omits it
    for body in ({"queries": ["x"], "topk": 0}, {"topk": 3}, {"queries": "x"}):
        assert httpx.post(f"{url}/retrieve", json=body, timeout=10).status_code == 422


def test_access(server):
    url = server["url"]
    got = httpx.get(f"{url}/access", params={"id": "4"}, timeout=10)
    assert got.status_code == 200 and got.json() == {"document": DOCS[4].to_row()}
    got = httpx.post(f"{url}/access", json={"id": "9"}, timeout=10)
    assert got.status_code == 200 and got.json()["document"]["id"] == "9"
    assert httpx.get(f"{url}/access", params={"id": "10"}, timeout=10).status_code == 404
    assert httpx.post(f"{url}/access", json={"id": "nope"}, timeout=10).status_code == 404


def test_fifty_concurrent_requests(server, local_index):
    queries = [[WORDS[i % 10], WORDS[(i * 3) % 10]] for i in range(50)]
    expected = [[[h.document.id for h in hits] for hits in local_index.search(q, topk=4)] for q in queries]

    def one(q):
        with httpx.Client(timeout=20) as client:
            resp = client.post(f"{server['url']}/retrieve", json={"queries": q, "topk": 4, "return_scores": True})
            resp.raise_for_status()
            return [[h["document"]["id"] for h in hits] for hits in resp.json()["result"]]

    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        got = list(pool.map(one, queries))
    assert got == expected


def test_index_saved_and_reloaded(server, local_index):
    index = build_index(None, str(server["index_dir"]))  # the server built and saved it
    assert index.search(["falcon"], topk=2) == local_index.search(["falcon"], topk=2)
    with pytest.raises(ValueError, match="--corpus is required"):
        build_index(None, None)


def test_main_reports_bad_corpus(tmp_path, capsys):
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"id": "1", "contents": "x"}\n{"id": "2"}\n')
    assert main(["--corpus", str(bad), "--port", str(free_port())]) == 2
    assert f"{bad}:2: field 'contents' or 'text': missing" in capsys.readouterr().err


# -- the client against the real server --------------------------------------------------------------
def test_remote_backend_matches_local_index(server, local_index):
    with RemoteSearchBackend(server["url"] + "/retrieve", timeout_s=10, max_retries=0) as remote:
        queries = ["castle desert", "glacier", "the"]
        got = remote.search(queries, topk=3)
        want = local_index.search(queries, topk=3)
        assert [[h.document for h in hs] for hs in got] == [[h.document for h in hs] for hs in want]
        assert remote.get("7") == DOCS[7] and remote.get("77") is None
        turns = [parse_turn(render_turn("m", None, a, q)) for a, q in
                 [("search", "comet"), ("access", "5"), ("access", "55"), ("search", "orchid falcon")]]
        assert (search_environment(remote, topk=2).execute_batch(turns)
                == search_environment(local_index, topk=2).execute_batch(turns))


# -- the client against stub servers -------------------------------------------------------------------
class Stub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.mode, self.requests = mode, 0
        self.lock = threading.Lock()


class StubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.requests += 1
            n = self.server.requests
        mode = self.server.mode
        good = json.dumps({"result": [[{"document": DOCS[0].to_row(), "score": 1.5}]]}).encode()
        if mode == "slow":
            time.sleep(2.0)
            self._reply(200, good)
        elif mode == "500":
            self._reply(500, b'{"detail": "boom"}')
        elif mode == "html":
            self._reply(200, b"<html>not json</html>", "text/html")
        elif mode == "shape":
            self._reply(200, b'{"result": "nope"}')
        elif mode == "400":
            self._reply(400, b'{"detail": "bad"}')
        elif mode == "flaky":
            self._reply(503, b"busy") if n <= 2 else self._reply(200, good)

    do_GET = do_POST


@pytest.fixture
def stub(request):
    server = Stub(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _backend(url, **kw):
    return RemoteSearchBackend(url, **{"timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.02, **kw})


def test_server_down_is_an_error_observation():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backend = _backend(url)
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        backend.search(["x"], topk=3)
    assert err.value.reason == "unreachable"
    env = search_environment(backend, topk=3)
    turns = [parse_turn(render_turn("m", None, "search", "x")), parse_turn(render_turn("m", None, "access", "1"))]
    results = env.execute_batch(turns)
    assert [(r.kind, r.ok) for r in results] == [("search", False), ("access", False)]
    assert "unreachable" in results[0].observation and "127.0.0.1" not in results[0].observation
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize(
    "stub, reason, attempts",
    [("slow", "timeout", 2), ("500", "http 500", 3), ("html", "bad response", 3), ("shape", "bad response", 3),
     ("400", "http 400", 1)],
    indirect=["stub"],
)
def test_stub_failures(stub, reason, attempts):
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    retries = 1 if reason == "timeout" else 2
    backend = _backend(url, max_retries=retries)
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        backend.search(["q"], topk=3)
    elapsed = time.monotonic() - start
    assert err.value.reason == reason
    assert stub.requests == attempts
    assert elapsed < (retries + 1) * 0.5 + 1.0  # bounded: attempts × timeout + backoff + slack
    result = search_environment(backend, topk=3).execute(parse_turn(render_turn("m", None, "search", "q")))
    assert result.kind == "search" and not result.ok and reason in result.observation


@pytest.mark.parametrize("stub", ["flaky"], indirect=True)
def test_retry_recovers(stub):
    backend = _backend(f"http://127.0.0.1:{stub.server_address[1]}", max_retries=2)
    hits = backend.search(["q"], topk=1)
    assert stub.requests == 3
    assert hits[0][0].document == DOCS[0] and hits[0][0].score == 1.5
