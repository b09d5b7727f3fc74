"""How the server listens: uvicorn, with connections that cannot hold it.

uvicorn sets no timer on a connection before its first request, its keep-alive timer stops at any byte, and its
`limit_concurrency` counts open sockets: 511 idle connections (or one header byte every few seconds) made every
request a 503. Here a connection must send a complete request head within `head_timeout_s` of opening it or of
its last answer, else it is closed (as a reverse proxy's client header timeout); of the connections waiting for a
head at most `max_idle` stay open, a new one closing the one that has waited longest; and what counts against
--max-connections is requests in progress (app.RequestLimit), not sockets."""
from __future__ import annotations

import collections
import resource
from typing import Any, Dict

from .settings import ServerSettings


def protocol_class(head_timeout_s: float, max_idle: int) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with a deadline for each request head and a
    bound on the connections waiting for one (these connections' own, not shared with another listener)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    waiting: "collections.OrderedDict[Any, None]" = collections.OrderedDict()  # oldest first

    class HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._seen_cycle = None
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._note_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._note_head()  # a pipelined request may have started
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self._await_head()

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self._head_timer is not None:
                return
            self._head_timer = self.loop.call_later(head_timeout_s, self._close_waiting)
            waiting[self] = None
            while len(waiting) > max_idle:
                next(iter(waiting))._close_waiting()

        def _note_head(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle and not cycle.response_complete:
                self._seen_cycle = cycle
                self._stop_waiting()

        def _stop_waiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            waiting.pop(self, None)

        def _close_waiting(self) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


def options(app: Any) -> Dict[str, Any]:
    """uvicorn's options (uvicorn.run's and uvicorn.Config's keywords) that serve `app` (made by create_app) with
    its settings' connection limits."""
    settings: ServerSettings = app.state.server.settings
    raise_open_files_limit()
    # after Ctrl-C or SIGTERM the requests end at their next step (server()); a handler still running after 2 s is
    # cancelled
    return {"limit_concurrency": None, "http": protocol_class(settings.head_timeout_s, settings.max_connections),
            "timeout_graceful_shutdown": 2}


def server(app: Any, **config: Any) -> Any:
    """A uvicorn server for `app` (made by create_app) with `options(app)`, that on Ctrl-C or SIGTERM first tells
    the scheduler to end every request at its next step or prompt chunk (HTTP 503), so that it stops within about
    a chunk's time whatever it is reading (uvicorn alone waits for every request to finish)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.server.scheduler.stop_soon()
            super().handle_exit(sig, frame)

        def stop_soon(self) -> None:
            """handle_exit's effect from another thread (serve_in_background's exit)."""
            app.state.server.scheduler.stop_soon()
            self.should_exit = True

    return Server(uvicorn.Config(app, **options(app), **config))


def serve(app: Any, **config: Any) -> None:
    """Serve `app` until Ctrl-C or SIGTERM (`h2o-local serve`)."""
    server(app, **config).run()


def raise_open_files_limit() -> None:
    """The soft limit of open files raised to the hard one (as servers do): idle connections are bounded here, but
    the default soft limit (often 1,024) is near what the requests and the idle connections may take together."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536),
                                                        hard))
    except (ValueError, OSError):
        pass
