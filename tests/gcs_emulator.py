"""A local Cloud Storage API on the loopback for the ``gs://`` run-folder tests: ``gcp-storage-emulator``
(in-memory), with the object generation headers that Cloud Storage sends and the emulator leaves out.

Cloud Storage answers every object read with ``x-goog-generation`` and ``x-goog-metageneration``;
tensorstore's OCDBT driver (orbax's checkpoint arrays) keeps the generation of the manifest it
read and updates the manifest with ``ifGenerationMatch`` on it, so without the header a second
manifest update fails (``Malformed StorageGeneration``). ``start`` adds the two headers to the
emulator's download handler, and drops the emulator's tracebacks for clients that hang up early
(``BrokenPipeError``), and lets its socket queue ``LISTEN_BACKLOG`` connections, not 5; everything
else is the emulator's own (preconditions are not enforced: one writer per object, as in these
tests; one request at a time).

``emulator_env(url)`` is the environment that points the clients at it: ``STORAGE_EMULATOR_HOST``
(gcsfs, hence ``etils.epath``), ``TENSORSTORE_GCS_HTTP_URL`` with a fixed test token
(``GOOGLE_AUTH_TOKEN_FOR_TESTING``), and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (gcsfs would
first ask the gRPC storage-control API, which the emulator does not serve, for the bucket type).

Run alone (for measurements): ``python tests/gcs_emulator.py --port 9123 --bucket bkt`` serves until
killed and prints the environment to export.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


LISTEN_BACKLOG = 128  # pending connections the emulator's socket queues


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulator_env(url: str) -> dict[str, str]:
    """Environment variables that send gcsfs / ``etils.epath`` and tensorstore to the emulator at ``url``."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _with_generation_headers(download):
    def handler(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status.value in (200, 206):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    handler.wrapped = download
    return handler


def _patch_downloads() -> None:
    """Wrap the emulator's object-download handler (once) with ``_with_generation_headers``: in its
    module (``objects.get`` calls it for ``alt=media``) and in the routing table."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if hasattr(objects.download, "wrapped"):
        return
    original = objects.download
    objects.download = _with_generation_headers(original)
    for _regex, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            if fn is original:
                handlers[method] = objects.download


def start(port: int, bucket: str):
    """Start the in-memory emulator on ``127.0.0.1:port`` with ``bucket`` created; returns the
    server (``.stop()`` ends it)."""
    from gcp_storage_emulator.server import create_server

    _patch_downloads()
    srv = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    srv.start()
    httpd = srv._api._httpd
    # http.server listens with a backlog of 5: gcsfs opens many connections at once (a recursive
    # get), and a connection past the backlog waits out TCP's SYN retries (1 s, 3 s, 7 s, ...), up
    # to a minute of idle time per copied run folder. On Linux a second listen() sets the backlog.
    httpd.socket.listen(LISTEN_BACKLOG)
    report = httpd.handle_error

    def handle_error(request, client_address):  # a client that hung up early is no error
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            report(request, client_address)

    httpd.handle_error = handle_error
    return srv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=9123)
    p.add_argument("--bucket", default="bkt")
    a = p.parse_args()
    srv = start(a.port, a.bucket)
    for k, v in emulator_env(f"http://127.0.0.1:{a.port}").items():
        print(f"export {k}={v}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
