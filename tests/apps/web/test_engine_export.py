"""qkv.apps.web.export without a browser: its arguments checked before anything is written,
and its parity check failing on graphs that do not compute what PyTorch computes."""

from __future__ import annotations

import json

import pytest
from engine_helpers import build


def test_bad_names_refused_before_anything_is_written(tmp_path):
    from qkv.apps.web.export import export_site_models

    out = tmp_path / "site"
    with pytest.raises(ValueError, match=r"names must be among .*got \['gpt-2'\]"):
        export_site_models(out, ["random", "gpt-2"], progress=lambda line: None)
    with pytest.raises(TypeError, match="names must be a list"):
        export_site_models(out, "random", progress=lambda line: None)  # type: ignore[arg-type]
    assert not out.exists()


def test_parity_check_fails_on_wrong_weights(tmp_path_factory):
    """The export's check passes on what it wrote and fails once the weights are changed."""
    from qkv.apps.web.export import _loaded, check_parity

    site = build(tmp_path_factory, ["random"])
    folder = site / "models" / "random"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert json.loads((site / "models" / "index.json").read_text()) == {"models": ["random"]}
    _, loaded, specs, _, _ = _loaded("random")
    assert check_parity(folder, manifest, specs, loaded) < 1e-4
    data = bytearray((folder / "weights.bin").read_bytes())
    data[:4096] = bytes(4096)  # the first weights zeroed
    (folder / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="differs from PyTorch"):
        check_parity(folder, manifest, specs, loaded)


def test_engine_globals_clash_with_no_page_global():
    """The engine's scripts run in the explorer's page: none may set a window object of the
    page's own scripts (long.js's qkvLong was once overwritten so)."""
    import re
    from pathlib import Path

    from qkv.apps.web.export import ENGINE_SCRIPTS, STATIC

    src = Path(__file__).parents[3] / "src" / "qkv" / "apps"
    sets = re.compile(r"(?:window|root)\.(qkv\w+)\s*=")
    page = {g for f in (src / "serve" / "static").glob("*.js") for g in sets.findall(f.read_text())}
    for d in ("site_static",):
        page |= {g for f in (src / "web" / d).glob("*.js") for g in sets.findall(f.read_text())}
    ours = {g for s in ENGINE_SCRIPTS[1:] for g in sets.findall((STATIC / Path(s).name).read_text())}
    assert {"qkvLocal", "qkvRuntime", "qkvTokenize"} <= ours
    assert "qkvLong" in page and not ours & page, ours & page
