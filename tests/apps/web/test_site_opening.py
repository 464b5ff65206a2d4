"""What the static site opens on: en-fr, the notes' translator, translating the notes' sentence,
first in the model menu, whatever order ``--models`` names; links that name a model (``?model=``,
with or without ``translate=1``) open on it as before. A site of en-fr and the random model,
without the in-page engine (its first views are saved), from ``python -m http.server``.
Screenshot: tests/artifacts/site_opening.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from site_helpers import SENTENCE, http_server, open_site

from serve_helpers import playwright_or_skip

playwright_or_skip()  # skips the module without chromium or Playwright (fails on CI)

ARTIFACTS = Path(__file__).resolve().parents[3] / "tests" / "artifacts"
FRENCH = "Le garçon entraîne le chiot."  # en-fr's translation of the notes' sentence


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from qkv.apps.web.build import build_site

    out = tmp_path_factory.mktemp("opening") / "live"
    build_site(out, ["random", "en-fr"], progress=lambda line: None, engine=False)  # random named first
    with http_server(out) as url:
        yield out, url


def _shown(page) -> tuple[str, bool, list[str]]:
    return (page.input_value("#model"), page.is_checked("#translate"),
            page.eval_on_selector_all("#model option", "os => os.map(o => o.value)"))  # fmt: skip


def test_site_json_lists_en_fr_first_and_opens_on_it_translating(two_models):
    site, _ = two_models
    meta = json.loads((site / "site.json").read_text(encoding="utf-8"))
    assert [m["name"] for m in meta["models"]] == ["en-fr", "random"]
    assert meta["opens"] == {"model": "en-fr", "translate": True}


def test_without_a_model_in_the_address_it_opens_on_en_fr_s_translation(two_models, browser):
    site, url = two_models
    o = open_site(browser, url)
    try:
        page = o.page
        assert _shown(page) == ("en-fr", True, ["en-fr", "random"])
        assert page.input_value("#text") == SENTENCE
        # from the answer saved at build time (translating), no other first view fetched first
        saved = [p for p in o.paths if p.startswith("/saved/")]
        assert saved[0] == "/saved/en-fr-translate.json", saved
        # the step view opens on a cross-attention head: the French as its rows
        rows = page.locator("#view-step .card canvas").first.get_attribute("data-rows")
        assert rows == "7", rows  # "Le garçon entraîne le chiot ." and </s>
        page.click(".tab[data-view='trans']")
        assert FRENCH in page.text_content("#view-trans")
        # the address the page writes names what it shows: a shared link opens on the same
        assert "model=en-fr" in page.url and "translate=1" in page.url
        page.click(".tab[data-view='step']")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "site_opening.png"))
        o.clean()
    finally:
        o.close()


@pytest.mark.parametrize(("query", "model", "translate"), [
    ("?model=random", "random", False),
    ("?model=random&translate=1", "random", True),
    ("?model=en-fr", "en-fr", False),  # a link to en-fr's maps of the source alone
    ("?model=en-fr&translate=1&view=trans", "en-fr", True),
])  # fmt: skip
def test_a_link_naming_a_model_opens_on_it_as_before(two_models, browser, query, model, translate):
    site, url = two_models
    o = open_site(browser, url, query)
    try:
        page = o.page
        assert _shown(page) == (model, translate, ["en-fr", "random"])
        kind = "translate" if translate else "maps"
        assert f"/saved/{model}-{kind}.json" in o.paths, o.paths
        assert page.text_content("#status").endswith("ms")  # an answer, not a refusal
        if model == "en-fr" and translate:
            assert FRENCH in page.text_content("#view-trans")
        o.clean()
    finally:
        o.close()


def test_a_site_without_en_fr_opens_on_its_first_model(tmp_path):
    """The random model alone: it opens on it, not translating (its weights are random, so
    the menu does not tick "translate" for it either)."""
    from qkv.apps.web.build import build_site

    build_site(tmp_path / "live", ["random"], progress=lambda line: None, engine=False)
    meta = json.loads((tmp_path / "live" / "site.json").read_text(encoding="utf-8"))
    assert meta["opens"] == {"model": "random", "translate": False}
