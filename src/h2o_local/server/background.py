"""Run the app on loopback in a background thread (tests, benchmarks, embedding the server in a script)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def serve_in_background(app, *, host: str = "127.0.0.1", port: int = 0, startup_s: float = 30.0,
                        stop_s: float = 30.0) -> Iterator[int]:
    """Serve `app` (made by create_app) with uvicorn in a daemon thread, its connections limited as `h2o-local
    serve`'s (server/listener.py); yields the port (a free one when `port` is 0) once it listens,
    and stops the server on exit (RuntimeError if it has not stopped after stop_s: a request handler hangs). The
    socket is bound here and handed to uvicorn, so that no other process can take a free port between its choice
    and its use (a race that several servers started at once on one machine lost)."""
    from . import listener

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        server = listener.server(app, host=host, port=port, log_level="warning")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="h2o-local-uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        try:
            yield port
        finally:
            server.stop_soon()
            thread.join(timeout=stop_s)
            if thread.is_alive():  # uvicorn waits for every request handler: one is stuck
                server.force_exit = True
                raise RuntimeError(f"the server on {host}:{port} did not stop within {stop_s:g} s")
    finally:
        sock.close()
