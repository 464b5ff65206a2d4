"""Fixtures of the explorer's browser tests: a real server on 127.0.0.1 and a headless
chromium, each started once per test module."""

from __future__ import annotations

import pytest

from serve_helpers import chromium, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """random + a tiny translator (no MiniLM: the API tests cover it)."""
    with serving(tmp_path_factory, "serve-browser", minilm=False) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b
