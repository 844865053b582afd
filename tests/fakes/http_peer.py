"""A stdlib HTTP server on 127.0.0.1 and a free port, in a thread: the peer that tests of
our HTTP clients talk to (a server we do not ship, so a double is fine).

    with local_http_server(MyHandler) as url:    # "http://127.0.0.1:<port>"
        ...

Handler threads are daemons, and on exit the server is shut down, closed and its thread
joined.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["local_http_server"]


@contextlib.contextmanager
def local_http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` until the block ends; yields the server's base URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)
