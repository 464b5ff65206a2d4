"""``qkv serve`` against hostile web pages and clients, through a real HTTP client and a real
server on 127.0.0.1: cross-origin posts, DNS rebinding, hostile bodies, slow clients."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from qkv.apps.cli import build_parser  # noqa: E402
from qkv.apps.serve import limits  # noqa: E402
from qkv.apps.serve.app import CSP, RequestGuard, create_app, split_host  # noqa: E402
from qkv.apps.serve.models import Registry, default_registry  # noqa: E402
from serve_helpers import one_thread, running_server  # noqa: E402

PROXY = "qkv.example.org"  # the --allow-host of the server under test
BODY = json.dumps({"text": "The boy trains the puppy.", "model": "random"}).encode()
JSON = "application/json"


class CountingRegistry(Registry):
    """The random model only; counts the model look-ups (one per computation)."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = {"random": default_registry()._entries["random"]}
        self.calls = 0
        self.delay = 0.0  # seconds each look-up sleeps: a slow computation

    def get(self, name: str):
        self.calls += 1
        time.sleep(self.delay)
        return super().get(name)


@pytest.fixture(scope="module")
def reg() -> CountingRegistry:
    return CountingRegistry()


@pytest.fixture(scope="module")
def port(reg):
    with one_thread(), running_server(create_app(reg, allow_hosts=[PROXY])) as p:
        yield p


def call(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:  # fmt: skip
    """One request on a fresh connection; http.client adds ``Host: 127.0.0.1:PORT`` unless
    ``headers`` has one."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def post(port: int, body: bytes = BODY, **headers: str) -> tuple[int, dict]:
    headers = {k.replace("_", "-"): v for k, v in headers.items()}
    status, _, data = call(port, "POST", "/api/attention", body,
                           {"Content-Type": JSON, **headers})  # fmt: skip
    return status, json.loads(data)


def readable(message: str) -> bool:
    """A message for people: no traceback, no Python exception name."""
    return not any(w in message for w in ("Traceback", "Error:", "Exception"))


def test_same_origin_json_post_computes(port, reg):
    before = reg.calls
    own = f"http://127.0.0.1:{port}"
    status, d = post(port, content_type="application/json; charset=utf-8", origin=own)
    assert status == 200 and d["tokens"][0] == "[CLS]"  # what the page's own fetch sends
    status, d = post(port, host=f"localhost:{port}", origin=f"http://localhost:{port}")
    assert status == 200 and reg.calls == before + 2
    for host in (f"[::1]:{port}", f"LOCALHOST:{port}"):  # names of this machine, any case
        assert call(port, "GET", "/api/health", headers={"Host": host})[0] == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403),  # a form
        ({"Origin": "http://evil.example", "Content-Type": JSON}, 403),
        ({"Origin": "null", "Content-Type": JSON}, 403),  # sandboxed frame, file:// page
        ({"Origin": "http://127.0.0.1:1", "Content-Type": JSON}, 403),  # another local port
        ({"Origin": "https://127.0.0.1:{port}", "Content-Type": JSON}, 403),  # another scheme
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({}, 415),
        ({"Content-Type": "application/jsonx"}, 415),
    ],
)
def test_cross_origin_and_non_json_posts_compute_nothing(port, reg, headers, status):
    before = reg.calls
    headers = {k: v.format(port=port) for k, v in headers.items()}
    code, hdrs, data = call(port, "POST", "/api/attention", BODY, headers)
    error = json.loads(data)["error"]
    assert code == status and hdrs["content-type"] == JSON and readable(error)
    assert ("Origin" if status == 403 else "Content-Type: application/json") in error
    assert reg.calls == before  # refused before any model work


@pytest.mark.parametrize("host", ["attacker.rebind.example", "attacker.rebind.example:{port}",
                                  "127.0.0.1:1", "127.0.0.1", "localhost", "127.0.0.1:{port}x",
                                  "[::1]", "evil@127.0.0.1:{port}"])  # fmt: skip
def test_rebinding_host_is_refused(port, reg, host):
    before = reg.calls
    host = host.format(port=port)
    for method, path, body in (("GET", "/", None), ("GET", "/api/health", None),
                               ("GET", "/static/app.js", None),
                               ("POST", "/api/attention", BODY)):  # fmt: skip
        status, hdrs, data = call(port, method, path, body, {"Host": host, "Content-Type": JSON})
        assert status == 403, (method, path)
        assert "is not this server's address" in json.loads(data)["error"]
        assert hdrs["x-content-type-options"] == "nosniff"
    assert reg.calls == before


def test_missing_host_is_400(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /api/health HTTP/1.0\r\n\r\n")
        data = b"".join(iter(lambda: s.recv(4096), b""))
    assert data.startswith(b"HTTP/1.1 400") and b"needs a Host header" in data


def test_allow_host_accepts_the_proxy_name_and_its_origin(port, reg):
    before = reg.calls
    for host in (PROXY, f"{PROXY}:443", f"{PROXY.upper()}:8080"):
        assert call(port, "GET", "/", headers={"Host": host})[0] == 200
    assert post(port, host=PROXY, origin=f"https://{PROXY}")[0] == 200
    assert post(port, origin=f"http://{PROXY}:8080")[0] == 200  # an allowed host's origin
    assert post(port, host=PROXY, origin="https://other.example.org")[0] == 403
    assert post(port, host=f"x.{PROXY}")[0] == 403  # no sub-domains
    assert reg.calls == before + 2


def test_cli_allow_host_reaches_the_app(monkeypatch, capsys):
    from starlette.testclient import TestClient

    from qkv.apps.cli import main
    from qkv.apps.serve.server import TimedH11Protocol

    args = build_parser().parse_args(["serve", "--allow-host", "Proxy.Example",
                                      "--allow-host", "[::1]", "--allow-host", "10.0.0.2"])  # fmt: skip
    assert args.allow_host == ["proxy.example", "::1", "10.0.0.2"]
    for bad in ("http://proxy.example", "proxy.example:8080", "a b", "", "proxy..example"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allow-host", bad])
        assert "--allow-host" in capsys.readouterr().err
    seen = {}
    uvicorn = pytest.importorskip("uvicorn")
    from qkv.apps.serve import cli as serve_cli

    class Listening:  # nothing is bound: the address and port as the CLI would listen
        def __init__(self, host, port):
            self.address = (host, port)

        def getsockname(self):
            return self.address

        def close(self):
            seen["closed"] = True

    class Server:  # uvicorn's server, not started: what it was handed
        started = True

        def __init__(self, config):
            seen.update(app=config.app, host=config.host, port=config.port, http=config.http)

        def run(self, sockets):
            seen["sockets"] = sockets

    monkeypatch.setattr(serve_cli, "_listen", Listening)
    monkeypatch.setattr(uvicorn, "Server", Server)
    argv = ["serve", "--allow-host", "proxy.example", "--host", "0.0.0.0", "--port", "8123"]
    assert main(argv) == 0
    assert seen["http"] is TimedH11Protocol and (seen["host"], seen["port"]) == ("0.0.0.0", 8123)
    assert len(seen["sockets"]) == 1 and seen["closed"]
    client = TestClient(seen["app"])  # its connections reach "testserver", port 80
    for host, status in (("proxy.example", 200), ("0.0.0.0", 200), ("rebind.example", 403)):
        assert client.get("/api/health", headers={"Host": host}).status_code == status, host


@pytest.mark.parametrize(
    ("host", "server", "bound", "refused"),
    [
        ("192.168.1.5:8000", ("192.168.1.5", 8000), "0.0.0.0", None),  # the address reached
        ("myhost.lan:8000", ("192.168.1.5", 8000), "myhost.lan", None),  # the bound name
        ("myhost.lan:8000", ("192.168.1.5", 8000), None, 403),
        ("myhost.lan:8001", ("192.168.1.5", 8000), "myhost.lan", 403),
        ("[::1]:8000", ("::1", 8000), "::1", None),
        ("[::1]:80", ("::1", 80), None, None),
        ("localhost", ("127.0.0.1", 80), None, None),  # no port: port 80 only
        ("localhost", ("127.0.0.1", 8000), None, 403),
    ],
)
def test_the_host_rule(host, server, bound, refused):
    scope = {"type": "http", "method": "GET", "scheme": "http", "server": server,
             "headers": [(b"host", host.encode())]}  # fmt: skip
    got = RequestGuard(None, host=bound).refusal(scope)
    assert (got and got[0]) == refused


@pytest.mark.parametrize(("value", "want"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("LocalHost", ("localhost", None)),
    ("[::1]:80", ("::1", 80)), ("[::1]", ("::1", None)), ("a:b", None), ("[::1]x", None),
    (":80", None), ("x:123456", None), ("x:８０", None),
])  # fmt: skip
def test_split_host(value, want):
    assert split_host(value) == want


def test_every_response_carries_the_security_headers(port):
    assert "frame-ancestors 'none'" in CSP and "script-src 'self'" in CSP
    own = {"Origin": f"http://127.0.0.1:{port}"}
    cases = [("GET", "/", None, {}, 200), ("GET", "/static/app.js", None, {}, 200),
             ("GET", "/static/app.css", None, {}, 200), ("GET", "/api/health", None, own, 200),
             ("POST", "/api/attention", BODY, {**own, "Content-Type": JSON}, 200),
             ("GET", "/nope", None, {}, 404), ("GET", "/api/attention", None, {}, 405),
             ("POST", "/api/attention", BODY, {"Content-Type": "text/plain"}, 415),
             ("GET", "/", None, {"Host": "evil.example"}, 403),
             ("POST", "/api/attention", b"[", {"Content-Type": JSON}, 400)]  # fmt: skip
    for method, path, body, headers, status in cases:
        code, h, _ = call(port, method, path, body, headers)
        assert code == status, (method, path)
        assert h["content-security-policy"] == CSP, path  # the page's own policy, unbroken
        assert h["x-content-type-options"] == "nosniff" and h["referrer-policy"] == "no-referrer"
        assert h["x-frame-options"] == "DENY"


@pytest.mark.parametrize(
    ("body", "status", "needles"),
    [
        (b"[" * 100_000 + b"]" * 100_000, 400, ["JSON nested too deep"]),
        (b'{"a":' * 40_000 + b"1" + b"}" * 40_000, 400, ["JSON nested too deep"]),
        (b"[" * 100_000, 400, ["JSON nested too deep"]),
        (b"[" * 65 + b"]" * 65, 400, ["JSON nested too deep"]),
        (b'{"text": "a", "model": "random", "x": ' + b"[" * 60 + b"]" * 60 + b"}", 200, []),
        (b'{"text": "' + b"[{" * 5000 + b'", "model": "random"}', 200, []),  # brackets in text
        (
            b'{"text": "a", "model": "random", "beam": ' + b"7" * 5000 + b"}",
            400,
            ["beam must be an integer in [1, 8]", "5000 digits"],
        ),
        (
            b'{"text": "a", "model": "random", "head": -' + b"1" * 30 + b"}",
            400,
            ["head must be an integer", "30 digits"],
        ),
        (
            b'{"text": "a\\ud800b", "model": "random"}',
            400,
            ["text must be valid Unicode", "lone surrogate", "U+D800"],
        ),
        (b'{"text": "a", "model": "\\udfff"}', 400, ["model must be valid Unicode"]),
        (b'{"text": "a", "model": "random", "layer": "\\ud83d"}', 400, ["layer"]),
        (b'{"text": "a", "model": "random", "ablate": [["\\ud800", 0]]}', 400, ["ablate"]),
        (
            b'{"text": "it", "model": "random", "probe": {"token": "it", "candidates": ["\\ud800"]}}',
            400,
            ["probe.candidates"],
        ),
        (b'{"text": "a", "model": "random", "beam": NaN}', 400, ["NaN is not a JSON number"]),
        (b'{"text": "a", "model": "random", "beam": 1e999}', 400, ["beam", "got inf"]),
        (b'{"text": "a", "model": "random", "beam": 2.0}', 400, ["beam", "got 2.0"]),
        (b'{"text": null}', 400, ["text must be a string, got null"]),
        (b'{"text": "a", "translate": "yes"}', 400, ["translate must be true or false"]),
        (b"", 400, ["the body is empty"]),
        (b"\xff\xfe{}", 400, ["UTF-8"]),
        (b'{"text": "a",}', 400, ["the body must be JSON", "line 1, column"]),
        (b'"just a string"', 400, ["the body must be a JSON object, got a string"]),
        (b'{"text": "a", "ablate": [[' + b"9" * 300 + b"]]}", 400, ["ablate items"]),
    ],
)
def test_hostile_bodies_get_readable_4xx(port, body, status, needles):
    code, data = post(port, body)
    assert code == status, data
    if status != 200:
        assert all(n in data["error"] for n in needles), data
        assert readable(data["error"]) and len(data["error"]) < 300
    assert call(port, "GET", "/api/health")[0] == 200  # still serving


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """What ``sock`` receives until the server closes it (or ``limit`` seconds), and when."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - t0


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # opens and says nothing
        b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n",  # half its headers
        b"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
        b'application/json\r\nContent-Length: 100\r\n\r\n{"text"',  # half its body
    ],
)
def test_slow_clients_are_dropped_within_the_read_timeout(port, reg, monkeypatch, sent):
    monkeypatch.setattr(limits, "READ_TIMEOUT_S", 1.0)
    before = reg.calls
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(sent.replace(b"{port}", str(port).encode()))
        data, waited = _read_until_closed(s, limit=8.0)
    assert 0.8 <= waited < 4.0, waited  # closed by the server after ~1 s, not held
    if sent.startswith(b"GET"):
        assert data.startswith(b"HTTP/1.1 408") and b"within 1 s" in data
    assert reg.calls == before
    assert call(port, "GET", "/api/health")[0] == 200


def test_the_read_timeout_does_not_cut_a_slow_computation_or_many_clients(port, reg,
                                                                          monkeypatch):  # fmt: skip
    monkeypatch.setattr(limits, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(reg, "delay", 1.0)  # the answer takes longer than the read timeout
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(post(port)[0])) for _ in range(3)]
    for t in threads:
        t.start()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:  # meanwhile
        slow.sendall(b"GET / HTTP/1.1\r\n")
        for t in threads:
            t.join(timeout=30)
        assert _read_until_closed(slow, limit=5.0)[0].startswith(b"HTTP/1.1 408")
    assert results == [200, 200, 200]
