"""The web app: the page, its static files, and the JSON API (Starlette, served by uvicorn).

Routes::

    GET  /                 the explorer page (static/index.html)
    GET  /static/...       app.js, app.css, i18n/strings.json
    GET  /api/health       200 {"models": [{"name", "label", "translator", "random", ...}], "limits"}
    POST /api/attention    {"text", "model", ...} → maps, steps, stats (qkv.apps.serve.compute)
    POST /api/lens         the same body + "position", "top_k" → logit lens, head attributions

Every error is JSON ``{"error": message}`` with a 4xx status (5xx only for a bug, and the
server keeps serving). Every response carries a strict Content-Security-Policy: scripts,
styles and data come from this server only; nothing is inlined, nothing leaves the machine.

Any web page the user visits can send requests to 127.0.0.1, so :class:`RequestGuard`
refuses, before any work: a ``Host`` that is not this server's address (403: DNS
rebinding), a foreign ``Origin`` (403), and a POST whose Content-Type is not
``application/json`` (415: a form or a "simple" cross-origin fetch sends ``text/plain``
without a CORS preflight). ``allow_hosts`` names the hosts of a proxy in front.

>>> from starlette.testclient import TestClient
>>> client = TestClient(create_app())
>>> client.get("/api/health").status_code
200
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from qkv.apps.serve import limits
from qkv.apps.serve.compute import attention
from qkv.apps.serve.compute_lens import lens_answer, parse_lens
from qkv.apps.serve.limits import BadRequest, parse_json, parse_request
from qkv.apps.serve.models import Registry, UnknownModel, default_registry

__all__ = ["CSP", "LOCAL_NAMES", "STATIC", "RequestGuard", "create_app", "split_host"]

STATIC = Path(__file__).parent / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")  # fmt: skip
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]
log = logging.getLogger("qkv.apps.serve")
# Names of this machine a local client may use, whatever address the server is bound to.
LOCAL_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_PORTS = {"http": 80, "https": 443}


class SecurityHeaders:
    """Adds :data:`HEADERS` to every response (pure ASGI: no buffering of bodies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k not in names]
                message["headers"] = kept + HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def split_host(value: str) -> tuple[str, int | None] | None:
    """``"name:port"`` / ``"[v6]:port"`` / ``"name"`` → ``(lowercase name, port or None)``;
    ``None`` if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        name, sep, port = value.partition(":")
        port = port if sep else None
    if port is None:
        return (name, None) if name else None
    ok = name and port.isascii() and port.isdigit() and len(port) <= 5
    return (name, int(port)) if ok else None


def _show(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


class RequestGuard:
    """Refuses requests a web page other than the explorer's own could have sent (see above).

    Host must name this server: ``127.0.0.1``, ``localhost``, ``[::1]``, the address it is
    bound to (``host``) or the one the connection came in on, with the server's port (no
    port: port 80), or a host of ``allow_hosts`` with any port. Origin, when sent, must be this server
    (``scheme://host:port``) or ``http(s)://`` an allowed host. Browsers send no Origin on
    plain navigations and same-origin GETs, curl none at all; both pass.
    """

    def __init__(self, app: ASGIApp, allow_hosts: Iterable[str] = (),
                 host: str | None = None) -> None:  # fmt: skip
        self.app = app
        self.allow_hosts = frozenset(h.lower().strip("[]") for h in allow_hosts)
        self.own_names = LOCAL_NAMES | ({host.lower().strip("[]")} if host else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                return await error(refused[1], refused[0])(scope, receive, send)
        await self.app(scope, receive, send)

    def _ours(self, name: str, port: int | None, scope: Scope) -> bool:
        """Whether ``name:port`` is the address this connection reached."""
        server_name, server_port = scope.get("server") or (None, None)
        names = self.own_names | ({str(server_name).lower()} if server_name else set())
        return name in names and (server_port is None or port == server_port)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """``(status, message)`` if the request must be refused, else ``None``."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is None:
            return 400, "the request needs a Host header"
        parsed = split_host(host)
        if parsed is None or not (
            parsed[0] in self.allow_hosts
            or self._ours(parsed[0], 80 if parsed[1] is None else parsed[1], scope)
        ):
            return 403, (f"Host {_show(host)} is not this server's address; behind a proxy, "
                         "start it with --allow-host NAME")  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, scope):
            return 403, (f"cross-origin requests are refused (Origin {_show(origin)}); open "
                         "the explorer from this server's own address")  # fmt: skip
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "")
            if ctype.partition(";")[0].strip().lower() != "application/json":
                got = _show(ctype) if ctype else "none"
                return 415, f"POST needs Content-Type: application/json, got {got}"
        return None

    def _origin_ok(self, origin: str, scope: Scope) -> bool:
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            return False
        # An origin is scheme://host[:port], nothing more ("null" and paths are foreign).
        if (parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path
                or parts.query or parts.fragment or parts.username is not None):  # fmt: skip
            return False
        if parts.hostname in self.allow_hosts:
            return True
        if parts.scheme != scope.get("scheme", "http"):
            return False
        port = DEFAULT_PORTS[parts.scheme] if port is None else port
        return self._ours(parts.hostname, port, scope)


async def _body(request: Request) -> bytes:
    """The request body, refused (413) beyond :data:`~qkv.apps.serve.limits.MAX_BODY_BYTES`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.MAX_BODY_BYTES:
        raise BadRequest(f"request body must be at most {limits.MAX_BODY_BYTES} bytes, "
                         f"got {declared}", 413)  # fmt: skip
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.MAX_BODY_BYTES:
            raise BadRequest(f"request body must be at most {limits.MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(registry: Registry | None = None, *, allow_hosts: Iterable[str] = (),
               host: str | None = None) -> Starlette:  # fmt: skip
    """The app over ``registry`` (default: :func:`~qkv.apps.serve.models.default_registry`).

    ``host``: the address the server binds (``--host``), accepted in ``Host``/``Origin`` with
    the server's port; ``allow_hosts``: names of a proxy in front, accepted with any port.
    """
    registry = registry or default_registry()

    async def index(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    async def health(_request: Request) -> Response:
        return JSONResponse({
            "models": registry.info(),
            "limits": {"tokens": limits.TOKEN_LIMIT, "translate_tokens": limits.TRANSLATE_LIMIT,
                       "body_bytes": limits.MAX_BODY_BYTES, "cells": limits.MAX_CELLS,
                       "beam": limits.MAX_BEAM, "long_tokens": limits.LONG_TOKEN_LIMIT,
                       "long_bytes": limits.MAX_LONG_BYTES, "pieces": limits.MAX_PIECES},
        })  # fmt: skip

    async def answer(request: Request, parse, compute, route: str) -> Response:
        """``compute(entry, parse(body))`` in worker threads, every failure a JSON 4xx/5xx.
        Only the body's bytes are read on the event loop: checking them is CPU work (linear in
        the body, ≤ MAX_BODY_BYTES), done in a worker thread like the rest."""
        t0 = time.perf_counter()
        try:
            raw = await _body(request)
            req = await run_in_threadpool(lambda: parse(parse_json(raw)))
            entry = await run_in_threadpool(registry.get, req.model)
            out = await run_in_threadpool(compute, entry, req)
        except BadRequest as err:
            return error(str(err), err.status)
        except ClientDisconnect:  # gone mid-body (or closed by the read deadline): no one to answer
            return error("the client disconnected", 400)
        except UnknownModel as err:
            return error(str(err.args[0]), 404)
        except ValueError as err:  # a model refused this input, with its own message
            return error(f"the model could not take this input: {err}", 422)
        except (KeyError, IndexError):  # a lookup inside a model failed: no message for people
            log.warning("POST %s: model refused the input", route, exc_info=True)
            return error("the model could not take this input (details in the server log)", 422)
        except Exception as err:  # a bug: say so, keep serving
            log.exception("POST %s failed", route)
            return error(f"internal error ({type(err).__name__}); see the server log", 500)
        out["elapsed_ms"] = round(1000 * (time.perf_counter() - t0), 1)
        return JSONResponse(out)

    async def api_attention(request: Request) -> Response:
        return await answer(request, parse_request, attention, "/api/attention")

    async def api_lens(request: Request) -> Response:  # the Lens view (compute_lens)
        return await answer(request, parse_lens, lens_answer, "/api/lens")

    async def favicon(_request: Request) -> Response:
        return Response(status_code=204)

    async def not_found(_request: Request, _exc: Exception) -> Response:
        return error("not found", 404)

    async def bad_method(_request: Request, _exc: Exception) -> Response:
        return error("method not allowed", 405)

    routes = [
        Route("/", index),
        Route("/favicon.ico", favicon),
        Route("/api/health", health),
        Route("/api/attention", api_attention, methods=["POST"]),
        Route("/api/lens", api_lens, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(
        routes=routes,
        # Outermost first: refusals carry the security headers too, and cost no work.
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(RequestGuard, allow_hosts=allow_hosts, host=host),
            # level 1: a long answer (25 MB at 2,048 tokens) in 0.7 s, not 4 s, ~5% larger
            Middleware(GZipMiddleware, minimum_size=2048, compresslevel=1),
        ],
        exception_handlers={404: not_found, 405: bad_method},
    )
