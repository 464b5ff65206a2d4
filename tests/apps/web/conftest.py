"""Fixtures of the static site's tests: a site with the tiny random model, built once, served
by ``python -m http.server`` on 127.0.0.1, and a headless chromium."""

from __future__ import annotations

import pytest
from site_helpers import http_server

from serve_helpers import chromium


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A site of the random model alone, without the in-page engine: its first views only."""
    from qkv.apps.web.build import build_site

    out = tmp_path_factory.mktemp("site") / "live"
    build_site(out, ["random"], progress=lambda line: None, engine=False)
    return out


@pytest.fixture(scope="module")
def site_url(site):
    with http_server(site) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b
