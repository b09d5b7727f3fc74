"""The OpenAI-compatible server on FastAPI: `create_app(llm, ...)` puts the routes (`routes.router`), the chat page's
static files, the body limit, OpenAI-shaped errors and one `Scheduler` (the thread that decodes every request)
around a `Llama`.

Errors are OpenAI-shaped JSON ({"error": {"message", "type", "param", "code"}}): 400 for a request that is malformed
or does not fit, 413 for an oversized body, 429 when every slot is busy and the waiting line is full.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llama import Llama
from .preparing import CLIENT, EmbeddingWork, GrammarChecks, WorkPool
from .protocol import APIError, error_response
from . import anthropic_messages, embeddings, ollama, openai_responses
from .routes import STATIC_DIR, router
from .state import ServerState
from .scheduler import Scheduler
from .settings import ServerSettings


def _longest_token_bytes(llm: Llama) -> int:
    """The most bytes one token stands for (special tokens' text included): text longer than n times this cannot
    be n tokens or fewer."""
    return max(len(llm.token_to_piece(t, special=True)) for t in range(llm.n_vocab()))


def create_app(llm: Llama, settings: Optional[ServerSettings] = None, **overrides: Any) -> FastAPI:
    """The app serving `llm` (which it owns from now on: one thread decodes for all requests). `settings` (or
    keyword overrides of its fields: `max_waiting=4`, `session_mib=0`, `model_id="x"`, ...; see `ServerSettings`)
    say how; `slots`, `host` and `port` are the caller's (the slots are `llm.n_seq_max`)."""
    settings = (settings or ServerSettings()).model_copy(update=overrides) if overrides else (settings or ServerSettings())
    ServerSettings.model_validate(settings.model_dump())  # overrides are checked as the fields are
    scheduler = Scheduler(llm, max_waiting=settings.max_waiting, session_bytes=int(settings.session_mib * 2**20))
    max_prompt_tokens = settings.max_prompt_tokens or max(llm.n_ctx_train(), scheduler.cells_per_slot)
    state = ServerState(
        llm=llm, scheduler=scheduler, settings=settings, model_id=settings.model_id or os.path.basename(llm.model_path),
        max_prompt_tokens=max_prompt_tokens,
        max_prompt_bytes=max_prompt_tokens * _longest_token_bytes(llm),
        max_tokens=settings.max_tokens or llm.n_ctx_train(),
        default_keep=llm.keep if isinstance(llm.keep, int) else 0,
        prepare=WorkPool("preparing", workers=2, max_held=settings.slots + settings.max_waiting),
        grammars=GrammarChecks(WorkPool("checking grammars for", workers=1, max_held=settings.slots)),
        embedding=EmbeddingWork(settings.max_waiting))
    # what the chat template takes (its tool-call format, system role, argument form, call ids), probed once now
    # rather than inside the first request that needs it
    template = llm.chat_template
    for probe in ("tool_format", "supports_system_role", "takes_object_arguments", "takes_nine_character_ids"):
        getattr(template, probe)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="h2o_local", description="OpenAI-compatible API with a bounded (H2O) KV cache",
                  lifespan=lifespan)
    app.state.server = state
    app.add_middleware(JSONBodies)
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ClientAddress)
    app.add_middleware(RequestLimit, max_requests=settings.max_connections)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    if _is_loopback(settings.host):  # added last: it runs first, before the key check and the body
        app.add_middleware(HostCheck, listen_host=settings.host, allowed_hosts=settings.allowed_hosts)
    if settings.cors_origins:  # outside the key check: a browser's preflight carries no key
        origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
        # any request header, as llama-server: browser SDKs send their own (OpenAI's x-stainless-*, Anthropic's
        # x-api-key and anthropic-version); the origins are what is checked
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"])
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)
    app.include_router(router)
    app.include_router(ollama.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic_messages.router)
    app.include_router(embeddings.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


async def _invalid_request(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"the body is not valid JSON ({detail} at character {first['loc'][-1]})".replace(" ()", ""))
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)


async def _http_error(request: Request, exc: StarletteHTTPException):
    if request.url.path.startswith("/api/"):  # Ollama's routes: its error shape, which its clients show
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, status_code=exc.status_code)
    return error_response(exc.status_code, str(exc.detail),
                          kind="invalid_request_error" if exc.status_code < 500 else "server_error")


async def _api_error(request: Request, exc: APIError):
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_body_bytes`, whether it says its length (Content-Length)
    or streams it in chunks without one (counted as it arrives; the body is read before any answer starts)."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        message = f"the request body is larger than {limit} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await error_response(413, message, code="body_too_large")(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(413, message)  # answered by the app's error handler
            return event

        await self.app(scope, counted_receive, send)


class RequestLimit:
    """ASGI middleware: 503 for an HTTP request while `max_requests` others are in progress (received and not yet
    answered to their end). Connections that sent no request do not count: idle sockets cannot switch the server
    off (the listener closes them, server/listener.py)."""

    def __init__(self, app, max_requests: int):
        self.app, self.max_requests, self.in_progress = app, max_requests, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.in_progress >= self.max_requests:
            response = error_response(503, f"the server is answering {self.in_progress} requests, the most it takes "
                                           f"at once (--max-connections); try again shortly", kind="server_error",
                                      code="server_busy", headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


class ClientAddress:
    """ASGI middleware: the request's client address in `preparing.CLIENT`, for the shares of the preparing lines."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            CLIENT.set((scope.get("client") or ("",))[0] or "")
        await self.app(scope, receive, send)


class JSONBodies:
    """ASGI middleware: a POST body sent without a JSON content type (curl -d sends a form's) is read as JSON, as
    llama-server and Ollama read theirs; what is not JSON is then the usual 400. Not for a browser's request (it
    says its Origin): a page on another site may send a form there without asking first (no CORS preflight), and
    that must stay a 400, not a generation."""

    FORM = (b"", b"application/x-www-form-urlencoded")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind in self.FORM and b"origin" not in headers:
                rest = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope = {**scope, "headers": rest + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <key>` or, as Anthropic's clients send
    it, `x-api-key: <key>`, with one of the server's keys (several: comma-separated, as llama-server's --api-key;
    compared in constant time); otherwise 401 with an OpenAI-shaped error, before the body is read. The key a request
    gave salts its saved conversations (`scope["state"]["api_key_id"]`): clients with different keys never continue
    each other's. The chat page's static files and /health are public (they hold no data; the page asks for the
    key and sends it with its API calls; container health probes carry none, as llama-server's)."""

    PUBLIC = ("/health", "/v1/health")

    def __init__(self, app, api_key: str):
        self.app = app
        self.keys = [k.strip().encode() for k in api_key.split(",") if k.strip()]

    def key_id(self, headers: Dict[bytes, bytes]) -> Optional[int]:
        """The index of the key the headers carry (None: none of them)."""
        given = headers.get(b"authorization", b"")
        bearer = given[7:] if given[:7].lower() == b"bearer " else None
        other = headers.get(b"x-api-key")
        found = None
        for i, key in enumerate(self.keys):  # every key compared: the time says nothing of which matched
            if (bearer is not None and secrets.compare_digest(bearer, key)) or \
                    (other is not None and secrets.compare_digest(other, key)):
                found = i if found is None else found
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _is_page(scope):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        found = self.key_id(headers)
        if found is not None:
            scope.setdefault("state", {})["api_key_id"] = found
        elif scope["path"] not in self.PUBLIC:
            message = "a valid API key is needed: send 'Authorization: Bearer KEY'" \
                if not headers.get(b"authorization") and headers.get(b"x-api-key") is None else "the API key is not valid"
            response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class HostCheck:
    """ASGI middleware for a server on a loopback address: 403 for a request whose `Host` is not a name of this
    machine (localhost and *.localhost, a loopback address, the address listened on, the host name) nor one of
    `allowed_hosts` ("*": any). A web page of another site can rebind its own name to 127.0.0.1 (DNS rebinding)
    and then call this server as if it were that site, same-origin, reading the answers; its requests still carry
    its own name as `Host`. Ollama refuses them the same way."""

    def __init__(self, app, listen_host: str, allowed_hosts: Optional[str] = None):
        self.app = app
        extra = {h.strip().lower().rstrip(".") for h in (allowed_hosts or "").split(",") if h.strip()}
        self.any = "*" in extra
        self.names = {"localhost", socket.gethostname().lower(), listen_host.lower().strip("[]")} | extra

    def allows(self, host_header: bytes) -> bool:
        if self.any:
            return True
        try:
            host = host_header.decode("ascii").strip().lower()
        except UnicodeDecodeError:
            return False
        if host.startswith("["):  # [::1]:8000
            host = host[1:host.find("]")] if "]" in host else ""
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        host = host.rstrip(".")
        return bool(host) and (host in self.names or host.endswith(".localhost") or _is_loopback(host))

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if not self.allows(dict(scope["headers"]).get(b"host", b"")):
            response = error_response(403, "this server answers requests for this machine's names only (the Host "
                                           "header names another): start it with --allowed-hosts NAME to answer "
                                           "more", code="host_not_allowed")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_page(scope) -> bool:
    return scope["method"] in ("GET", "HEAD") and (scope["path"] == "/" or scope["path"].startswith("/static/"))
