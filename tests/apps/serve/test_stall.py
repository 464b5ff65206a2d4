"""No request body, however it is built, holds up the server: the body checks take time
linear in its size and run off the event loop, so ``/api/health`` answers while a
pathological body at the size limit is being checked, and that body gets its 4xx at once."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import deadline  # noqa: E402
from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.limits import (  # noqa: E402
    MAX_BODY_BYTES,
    BadRequest,
    parse_json,
    parse_request,
)
from qkv.apps.serve.models import Registry, default_registry  # noqa: E402
from serve_helpers import one_thread, running_server  # noqa: E402

HEALTH_S = 1.0  # seconds /api/health may take while a bad body is checked (quiet machine)
ANSWER_S = 5.0  # seconds the bad body's own answer may take
CHECK_S = 0.5  # seconds the checks may take on one body of MAX_BODY_BYTES


def _fill(prefix: bytes, unit: bytes, suffix: bytes, size: int) -> bytes:
    """``prefix + unit * k + suffix``, as long as ``size`` allows."""
    return prefix + unit * ((size - len(prefix) - len(suffix)) // len(unit)) + suffix


def bodies(size: int) -> dict[str, tuple[bytes, str]]:
    """Bodies of at most ``size`` bytes that are slow for a naive checker: name → (body, what
    the 400 says). Those that are valid JSON are refused for ``"beam": 0``, after every check
    of the text."""
    field = b'{"model": "random", "beam": 0, "text": "'
    return {
        "escaped quotes": (_fill(b'"', b'\\"', b"", size), "the body must be JSON"),
        "escaped quotes in a field": (
            _fill(b'{"text": "', b'\\"', b"", size),
            "the body must be JSON",
        ),
        "escaped quotes, valid": (_fill(field, b'\\"', b'"}', size), "beam must be in [1, 8]"),
        "escaped backslashes": (_fill(b'"', b"\\\\", b"", size), "the body must be JSON"),
        "\\u escapes": (_fill(b'"', b"\\u0041", b'"', size), "must be a JSON object, got a string"),
        "\\u escapes, valid": (_fill(field, b"\\u0041", b'"}', size), "beam must be in [1, 8]"),
        "brackets in a string": (_fill(field, b"[{", b'"}', size), "beam must be in [1, 8]"),
        "deep nesting": (b"[" * size, "JSON nested too deep"),
        "deep nesting, closed": (b"[" * (size // 2) + b"]" * (size // 2), "JSON nested too deep"),
        "deep objects": (_fill(b"", b'{"a":', b"", size), "JSON nested too deep"),
    }


BODIES = bodies(MAX_BODY_BYTES)


def _check(body: bytes) -> tuple[str, float]:
    """What the server's checks of ``body`` (parse_json, then parse_request) refuse it for
    ("" if nothing), and how many seconds they take."""
    t0 = time.perf_counter()
    try:
        parse_request(parse_json(body))
        refusal = ""
    except BadRequest as err:
        refusal = str(err)
    return refusal, time.perf_counter() - t0


@pytest.mark.parametrize("name", list(BODIES))
def test_bodies_at_the_size_limit_are_checked_at_once(name):
    body, needle = BODIES[name]
    assert len(body) > MAX_BODY_BYTES - 8
    refusal, took = _check(body)
    assert needle in refusal, (name, refusal)
    assert took < deadline.scaled(CHECK_S), f"{name}: {took:.2f} s"


@pytest.mark.parametrize("name", ["escaped quotes", "escaped quotes, valid", "\\u escapes"])
def test_the_check_is_linear_in_the_body(name):
    """16 times the size limit in well under a few seconds: a quadratic check took ~13 s at
    a quarter of the limit, so ~16 hours here. (An absolute bound, far from both: a ratio of
    two times of a few ms is at the mercy of the machine's load.)"""
    refusal, took = _check(bodies(16 * MAX_BODY_BYTES)[name][0])
    assert took < deadline.scaled(4 * 16 * CHECK_S), f"{name}: {took:.2f} s"


@pytest.fixture(scope="module")
def port():
    reg = Registry()
    reg._entries = {"random": default_registry()._entries["random"]}
    with one_thread(), running_server(create_app(reg)) as p:
        yield p


def _request(port: int, method: str, path: str, body: bytes | None,
             timeout: float) -> tuple[int, bytes, float]:  # fmt: skip
    """``(status, body, seconds)`` of one request on a fresh connection; status 0 if no answer
    came within ``timeout`` seconds."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        status, data = r.status, r.read()
    except TimeoutError:
        status, data = 0, b"no answer"
    finally:
        conn.close()
    return status, data, time.perf_counter() - t0


@pytest.mark.parametrize("name", list(BODIES))
def test_health_answers_while_a_bad_body_is_checked(port, name):
    body, needle = BODIES[name]
    health_limit, answer_limit = deadline.scaled(HEALTH_S), deadline.scaled(ANSWER_S)
    answer: list[tuple[int, bytes, float]] = []
    bad = threading.Thread(
        target=lambda: answer.append(
            _request(port, "POST", "/api/attention", body, answer_limit + 1)
        ),
        daemon=True,
    )
    bad.start()
    checks = 0
    while bad.is_alive() or checks < 3:  # from the moment the body is sent to its answer
        status, _, took = _request(port, "GET", "/api/health", None, health_limit + 1)
        assert status == 200 and took < health_limit, (name, status, f"{took:.2f} s")
        checks += 1
    bad.join()
    status, data, took = answer[0]
    assert status == 400, (name, status, data[:200])
    assert needle in json.loads(data)["error"], (name, data[:200])
    assert took < answer_limit, (name, f"{took:.2f} s")
