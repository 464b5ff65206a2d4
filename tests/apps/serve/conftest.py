"""Fixtures of the explorer's browser tests: a real server on 127.0.0.1 and a headless
chromium, each started once per test module."""

from __future__ import annotations

import pytest

from serve_helpers import chromium, one_thread, registry, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real uvicorn server in a thread: random + a tiny translator (no MiniLM: the API
    tests cover it)."""
    from qkv.apps.serve.app import create_app

    reg = registry(tmp_path_factory.mktemp("serve-browser"), minilm=False)
    with one_thread(), running_server(create_app(reg)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b
