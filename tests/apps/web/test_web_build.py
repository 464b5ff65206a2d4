"""``qkv web build DIR``: its arguments checked before anything is written (exit 2, one line),
a site written whole or not at all, its page and policy, and its saved answers equal to what
``qkv serve`` answers to the same requests."""

from __future__ import annotations

import json
import re

import pytest

from qkv.apps.cli import main
from qkv.apps.web import build


def _quiet(line: str) -> None:
    pass


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(["web", "build", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("models, said", [
    ("gpt2", "must name models from en-fr, fr-en, minilm, random"),
    ("random,random", "must name each model once"),
    (",", "must name models from"),
    ("", "must name models from"),
])  # fmt: skip
def test_bad_models_exit_2_in_one_line_and_write_nothing(tmp_path, capsys, models, said):
    code, out, err = _run([str(tmp_path / "site"), "--models", models], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("qkv web build: error: argument --models: ")
    assert said in err
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_is_a_file_or_holds_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = _run([str(tmp_path / "notes.txt"), "--models", "random"], capsys)
    assert code == 2 and "exists and is not a directory" in err and err.count("\n") == 1
    code, _, err = _run([str(tmp_path), "--models", "random"], capsys)
    assert code == 2 and "holds other files" in err and err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_command_builds_the_site_and_says_so(tmp_path, capsys):
    site = tmp_path / "docs" / "live"  # its parent made too
    code, out, err = _run([str(site), "--models", "random"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert all(line.startswith("qkv web build: ") for line in lines)
    assert "saved random (maps)" in out and "site written" in lines[-1]
    for name in ("index.html", ".nojekyll", "site.json", "static/app.js", "static/site.js",
                 "static/i18n/strings.json", "saved/random-maps.json"):  # fmt: skip
        assert (site / name).is_file(), name
    assert [p.name for p in site.parent.iterdir()] == ["live"]  # no temporary left


def test_a_new_build_replaces_an_earlier_site_whole(tmp_path):
    site = tmp_path / "live"
    build.build_site(site, ["random"], progress=_quiet, engine=False)
    (site / "stale.json").write_text("{}")
    build.build_site(site, ["random"], progress=_quiet, engine=False)
    assert not (site / "stale.json").exists() and (site / "index.html").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["live"]


def test_a_failed_build_leaves_nothing_and_keeps_the_earlier_site(tmp_path, monkeypatch):
    site = tmp_path / "live"
    build.build_site(site, ["random"], progress=_quiet, engine=False)
    before = sorted(p.relative_to(site).as_posix() for p in site.rglob("*"))

    def broken(registry, body):
        raise RuntimeError("the model broke")

    monkeypatch.setattr(build, "_answer", broken)
    with pytest.raises(RuntimeError, match="the model broke"):
        build.build_site(site, ["random"], progress=_quiet, engine=False)
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["live"]
    with pytest.raises(RuntimeError):
        build.build_site(tmp_path / "new", ["random"], progress=_quiet, engine=False)
    assert [p.name for p in tmp_path.iterdir()] == ["live"]


def test_a_site_over_its_budget_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "MAX_SITE_BYTES", 100_000)
    with pytest.raises(ValueError, match=r"the site is 0\.\d MB, over its budget of 0 MB"):
        build.build_site(tmp_path / "live", ["random"], progress=_quiet, engine=False)
    monkeypatch.setattr(build, "MAX_FILE_BYTES", 50_000)
    with pytest.raises(ValueError, match=r"files over GitHub's limit.*random-translate\.json"):
        build.build_site(tmp_path / "live", ["random"], progress=_quiet, engine=False)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def random_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("built") / "live"
    build.build_site(site, ["random"], progress=_quiet, engine=False)
    return site


def test_the_page_is_the_explorer_s_own_with_the_site_s_policy(random_site):
    from qkv.apps.serve.app import STATIC

    page = (random_site / "index.html").read_text(encoding="utf-8")
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert csp and csp.group(1) == build.CSP
    rules = dict(r.strip().split(" ", 1) for r in csp.group(1).split(";"))
    assert rules["default-src"] == "'self'" and rules["connect-src"] == "'self'"
    assert rules["script-src"] == "'self' 'wasm-unsafe-eval'"  # no inline script, no eval
    assert "/static/" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    scripts = re.findall(r'<script src="([^"]+)" defer>', page)
    served = re.findall(r'<script src="/static/([^"]+)" defer>', (STATIC / "index.html").read_text())
    assert scripts == [f"static/{s}" for s in served[:-1]] + ["static/site.js", "static/app.js"]
    # the rest of the page is the explorer's, unchanged
    own = (STATIC / "index.html").read_text(encoding="utf-8")
    assert page[page.index("<body>"):] == own[own.index("<body>"):]
    for name in ("app.js", "engine.js", "app.css"):
        assert (random_site / "static" / name).read_bytes() == (STATIC / name).read_bytes()


def test_the_site_s_words_are_the_explorer_s_and_its_own(random_site):
    from qkv.apps.serve.app import STATIC

    served = json.loads((STATIC / "i18n" / "strings.json").read_text(encoding="utf-8"))
    site = json.loads((random_site / "static/i18n/strings.json").read_text(encoding="utf-8"))
    assert site["languages"] == served["languages"]
    for lang in served["languages"]:
        own = {k: v for k, v in site[lang].items() if k.startswith("site.")}
        assert {k: v for k, v in site[lang].items() if not k.startswith("site.")} == served[lang]
        assert sorted(own) == sorted(k for k in site["en"] if k.startswith("site."))
        for key, text in own.items():  # the same placeholders as the English
            assert re.findall(r"\{\w+\}", text) == re.findall(r"\{\w+\}", site["en"][key]), key


def test_saved_answers_are_qkv_serve_s_answers(random_site):
    """Each saved request, sent to qkv serve's app: the same JSON (but its timing)."""
    from starlette.testclient import TestClient

    from qkv.apps.serve.app import create_app

    meta = json.loads((random_site / "site.json").read_text(encoding="utf-8"))
    assert [m["name"] for m in meta["models"]] == ["random"] and meta["engine"] is False
    assert {(s["request"]["translate"], "layer" in s["request"]) for s in meta["saved"]} == {
        (False, False), (False, True), (True, False), (True, True)}  # fmt: skip
    client = TestClient(create_app())
    for saved in meta["saved"]:
        answer = client.post("/api/attention", json=saved["request"]).json()
        answer.pop("elapsed_ms")
        assert json.loads((random_site / saved["file"]).read_text(encoding="utf-8")) == answer
