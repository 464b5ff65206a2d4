"""The step view's notes on a transformers model, in a real browser (Debian's chromium via
Playwright) against a real server: gpt-oss's sink logit (``step.sink``), and a call the
adapter handed back to transformers (``step.fallback``), each said in the reader's language."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import hf_tiny
from serve_helpers import (
    one_thread,
    open_page,
    playwright_or_skip,
    post_json,
    running_server,
)
from serve_helpers import page_ready as _ready

os.environ["HF_HUB_OFFLINE"] = "1"
playwright_or_skip()
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
STRINGS = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())
TEXT = "the boy sees the dog"
WORDS = "the a boy girl dog puppy trains runs sees . , it was tired street".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def _gpt_oss_dir(path: Path) -> Path:
    """A tiny random gpt-oss (learned sink logits far from 0) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")  # fmt: skip
    model = hf_tiny.gpt_oss(len(vocab))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from qkv.apps.serve.app import create_app
    from qkv.apps.serve.models import Registry

    reg = Registry()
    reg.add_dir("oss", _gpt_oss_dir(tmp_path_factory.mktemp("oss") / "oss"))
    with one_thread(), running_server(create_app(reg)) as port:
        yield f"http://127.0.0.1:{port}"



def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"step_notes_{name}.png"))


@pytest.mark.filterwarnings("ignore:attn_implementation='qkv'")
def test_the_sink_and_a_fallback_are_said_in_the_step_view(server, browser, monkeypatch):
    step = post_json(server, text=TEXT, model="oss")["step"]
    assert step["fallback"] is None and step["sink"] is not None
    page, errors, dialogs, outside = open_page(browser, f"{server}/?model=oss&text={TEXT}")
    note = page.text_content("#step-sink")
    assert note == STRINGS["en"]["step.sink"].format(sink=step["sink"])
    assert page.query_selector("#step-fallback") is None  # qkv ran every call
    _shot(page, "sink")
    page.select_option("#lang", "zh")
    assert page.text_content("#step-sink") == STRINGS["zh"]["step.sink"].format(sink=step["sink"])

    # every call handed back to transformers (as a mask it cannot take would be): replayed,
    # and the page says why, with the reason as data (not translated)
    import qkv.hf.attention

    monkeypatch.setattr(qkv.hf.attention, "fallback_reason",
                        lambda *a, **k: ("a reason from the test", "eager"))  # fmt: skip
    step = post_json(server, text=TEXT, model="oss")["step"]
    assert "a reason from the test" in step["fallback"]
    page.click("#run")
    _ready(page)
    zh = STRINGS["zh"]["step.fallback"].format(why=step["fallback"])
    assert page.text_content("#step-fallback") == zh
    assert page.get_attribute("#step-fallback span", "translate") == "no"
    page.select_option("#lang", "en")
    assert page.text_content("#step-fallback") == STRINGS["en"]["step.fallback"].format(
        why=step["fallback"]
    )
    _shot(page, "fallback")
    assert dialogs == [] and errors == [] and outside == []
    page.close()
