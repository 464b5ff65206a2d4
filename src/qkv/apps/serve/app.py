"""The web app: the page, its static files, and the JSON API (Starlette, served by uvicorn).

Routes::

    GET  /                 the explorer page (static/index.html)
    GET  /static/...       app.js, app.css, i18n/strings.json
    GET  /api/health       200 {"models": [{"name", "label", "translator", "random", ...}], "limits"}
    POST /api/attention    {"text", "model", ...} → maps, steps, stats (qkv.apps.serve.compute)

Every error is JSON ``{"error": message}`` with a 4xx status (5xx only for a bug, and the
server keeps serving). Every response carries a strict Content-Security-Policy: scripts,
styles and data come from this server only; nothing is inlined, nothing leaves the machine.

>>> from starlette.testclient import TestClient
>>> client = TestClient(create_app())
>>> client.get("/api/health").status_code
200
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from qkv.apps.serve import limits
from qkv.apps.serve.compute import attention
from qkv.apps.serve.limits import BadRequest, parse_request
from qkv.apps.serve.models import Registry, UnknownModel, default_registry

__all__ = ["CSP", "STATIC", "create_app"]

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


def create_app(registry: Registry | None = None) -> Starlette:
    """The app over ``registry`` (default: :func:`~qkv.apps.serve.models.default_registry`)."""
    registry = registry or default_registry()

    async def index(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    async def health(_request: Request) -> Response:
        return JSONResponse({
            "models": registry.info(),
            "limits": {"tokens": limits.TOKEN_LIMIT, "translate_tokens": limits.TRANSLATE_LIMIT,
                       "body_bytes": limits.MAX_BODY_BYTES, "cells": limits.MAX_CELLS,
                       "beam": limits.MAX_BEAM},
        })  # fmt: skip

    async def api_attention(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            raw = await _body(request)
            try:
                body = json.loads(raw.decode("utf-8", errors="strict"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BadRequest(f"the body must be JSON: {err}") from None
            req = parse_request(body)
            entry = await run_in_threadpool(registry.get, req.model)
            out = await run_in_threadpool(attention, entry, req)
        except BadRequest as err:
            return error(str(err), err.status)
        except UnknownModel as err:
            return error(str(err.args[0]), 404)
        except (ValueError, KeyError, IndexError) as err:  # a model refused this input
            return error(f"{type(err).__name__}: {err}", 422)
        except Exception as err:  # a bug: say so, keep serving
            log.exception("POST /api/attention failed")
            return error(f"internal error ({type(err).__name__}); see the server log", 500)
        out["elapsed_ms"] = round(1000 * (time.perf_counter() - t0), 1)
        return JSONResponse(out)

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
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders), Middleware(GZipMiddleware, minimum_size=2048)],
        exception_handlers={404: not_found, 405: bad_method},
    )
