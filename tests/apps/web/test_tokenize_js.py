"""The explorer's in-page tokenizers (``qkv/apps/web/static/tokenize.js``) against Python's.

Every model the explorer runs, on the notes' sentences in their five scripts, French, edge
cases and a few hundred random strings (fixed seed): the ids, tokens and labels the page
computes must be those of the code path ``qkv serve`` takes (qkv's ``Tokenizer`` and
``piece_labels`` for the translators, transformers' tokenizer as ``loaded_from_bert`` calls
it for MiniLM, ``TinyEncoder.tokenize`` and the server's decoding for the random model), and
decoding must give Python's text. All strings go to node in one request per module
(``tokenize_harness.js``). Skipped without node.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import unicode_ref

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (CI has it)")

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
SHIPPED = ROOT / "src/qkv/models/shipped"
TRANSLATORS = ("en-fr", "fr-en")

NOTES = [
    "The boy trains the puppy.",
    "Le garçon entraîne le chiot.",
    "The animal didn't cross the street because it was too tired.",
    "ကောင်လေးက ခွေးကလေးကို လေ့ကျင့်ပေးတယ်။",  # Burmese
    "Cậu bé huấn luyện chú chó con.",  # Vietnamese
    "ছেলেটি কুকুরছানাকে প্রশিক্ষণ দেয়।",  # Bengali
    "男孩训练小狗。",  # Chinese
    "L'animal n'a pas traversé la rue parce qu'il était trop fatigué.",
    "Deux chiens jouent dans la neige.",
]
EDGES = [
    "",
    " ",
    "   ",
    "\t\n\r\n",
    "a  b\t\tc\n\nd   ",
    "  leading and trailing  ",
    "café",  # NFC
    "cafe\u0301",  # NFD: the same word
    "Ångström e\u0301le\u0300ve ñandú",
    "I'm sure they'll say we've won, it's John's, you're right, he'd go",
    "IT'S SHOUTING'S CASE'LL",
    "1234567 3.14159 1,000,000 ٣٤٥ ১২৩ ၁၂၃ 一二三 ½ Ⅻ",
    "!!!??? ... --- ((([[[ ]]]))) «quoted» “quotes” ¿qué? ¡sí!",
    "$5 + 3 = 8 < 9 > 2 ^ ~ ` | @ # % & * _",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🥰",
    "control\x00chars\x01here\x7f and \x85 zero\u200bwidth \ufeffbom \ufffd repl",
    "\ufeffstarts with a BOM",
    "private \ue000 use \U000f0000",
    "ΟΔΟΣ Σίσυφος ΣΑΣ İstanbul ß ﬁ",
    "x" * 101,  # WordPiece: more than max_input_chars_per_word → [UNK]
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 3,
    "<s> and </s> and <pad> <unk> [CLS] [SEP] [MASK] [PAD] [UNK]",
    "a<s>b</s>c[CLS]d",
    "日本語のテキストとカタカナ、한국어 텍스트",
    "Русский текст и ελληνικά και العربية و עברית",
    "mixed中文English混合123数字",
    "tabs\tinside\twords and a\u00a0no-break\u3000ideographic space",
    "\u2028line\u2029para",
]
LONG = " ".join(["The boy trains the puppy again and again."] * 80)  # > 512 WordPiece tokens

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~«»“”‘’¿¡…—–·•",
    "     \t\n\r\u00a0\u3000\u2009",
    "àâäçéèêëîïôöùûüÿœæÀÂÇÉÈÊËÎÏÔÖÙÛÜŸŒÆñÑ",
    "\u0300\u0301\u0302\u0303\u0308\u0327\u0323\u0309",
    "ကခဂငစဆဇညတထဒနပဖဗဘမယရလဝသဟအ\u102b\u102c\u102d\u102e\u102f\u1030\u1031\u1032\u1036\u1037\u1038\u1039\u103a\u103b\u103c\u103d\u103e၊။",
    "ạảấầẩẫậắằẳẵặẹẻẽếềểễệỉịọỏốồổỗộớờởỡợụủứừửữựỳỵỷỹđĐơưƠƯ",
    "অআইঈউঊঋএঐওঔকখগঘঙচছজঝঞটঠডঢণতথদধনপফবভমযরলশষসহ\u09be\u09bf\u09c0\u09c1\u09c7\u09cb\u09cd\u0981\u0982।",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年男孩训练小狗。，、！？",
    "あいうえおかきくけこアイウエオカキクケコ한국어텍스트",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДΑΒΓΔΣσςαβγ",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "😀😂🥰👍🏽👨‍👩‍👧🇫🇷❤️\ufe0f\u200d",
    "\x00\x01\x07\x1b\x7f\x85\u200b\u200e\ufeff\ufffd\ue000",
    "'s't're've'm'll'd",
    "<s></s><pad><unk>[CLS][SEP][MASK]",
]


def random_strings(n: int, seed: int = 20261129) -> list[str]:
    """``n`` strings of 0-40 pieces drawn from the pools above and, now and then, any code
    point at all (unassigned and supplementary ones included; no surrogates)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.08:
                cp = rng.randrange(0x110000 - 0x800)
                parts.append(chr(cp + 0x800 if cp >= 0xD800 else cp))
            else:
                pool = rng.choice(POOLS)
                k = rng.randint(1, 4) if pool.startswith("<s>") else 1
                start = rng.randrange(len(pool))
                parts.append(pool[start : start + (5 if k > 1 else 1)])
        out.append("".join(parts))
    return out


TEXTS = NOTES + EDGES + random_strings(300)


def node(request: dict) -> dict:
    out = subprocess.run([NODE, str(HERE / "tokenize_harness.js")], input=json.dumps(request),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


# ---- the references: the code paths qkv serve takes -------------------------------------


def translator(name: str):
    from qkv.data.tokenizer import Tokenizer

    return Tokenizer.load(SHIPPED / name)


def minilm_encode():
    """MiniLM's encode as qkv serve runs it (``loaded_from_bert``), without its weights."""
    from qkv.inspect.minilm import loaded_from_bert
    from qkv.loading import read_hf_tokenizer
    from qkv.pretrained.load import read_bert_config, resolve

    directory = resolve("all-MiniLM-L6-v2")
    tok = read_hf_tokenizer(directory)
    config = read_bert_config(directory / "config.json")
    encode = loaded_from_bert(SimpleNamespace(tokenizer=tok, config=config)).encode
    return directory, tok, config.max_len, encode


def random_ids(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    """Id lists of any kind: specials, any piece (split characters too), unknown ids."""
    out = []
    for _ in range(n):
        ids = [rng.choice([rng.randrange(vocab), rng.randrange(4), rng.randrange(256, 600)])
               for _ in range(rng.randint(0, 12))]  # fmt: skip
        if rng.random() < 0.1:
            ids.append(vocab + 17)  # no such id: HF's decode skips it
        out.append(ids)
    return out


def vocab_lookups(ask, name: str, hf, rng: random.Random) -> None:
    """idToToken and tokenToId against HF's ``Tokenizer`` (``hf``): every special, 200 ids
    drawn, ids and tokens it does not have."""
    n = hf.get_vocab_size()
    for i in [*range(5), *rng.sample(range(n), 200), n, n + 100, -1]:
        ask("idToToken", [name, i], hf.id_to_token(i) if i >= 0 else None)
        token = hf.id_to_token(i) if 0 <= i < n else f"no such token {i}"
        ask("tokenToId", [name, token], hf.token_to_id(token))


@pytest.fixture(scope="module")
def case():
    """Python's answers and, from one node run, the page's."""
    rng = random.Random(7)
    directory, mtok, max_len, mencode = minilm_encode()
    kinds = ("encode", "decode", "labels", "idToToken", "tokenToId")
    want: dict[str, list] = {kind: [] for kind in kinds}
    req: dict = {"tokenizers": {}, **{kind: [] for kind in kinds}}

    def ask(kind: str, call: list, expected) -> None:
        req[kind].append(call)
        want[kind].append(expected)

    for name in TRANSLATORS:
        tok = translator(name)
        req["tokenizers"][name] = {"path": str(SHIPPED / name / "tokenizer.json")}
        from qkv.inspect.translation import piece_labels

        for text in TEXTS:
            ids = tok.encode(text)
            tokens = [tok.hf.id_to_token(i) for i in ids]
            ask("encode", [name, text], {"ids": ids, "tokens": tokens})
            ask("decode", [name, ids], tok.decode(ids))
            ask("labels", [name, ids + [tok.eos_id]], piece_labels(tok, ids + [tok.eos_id]))
        for ids in random_ids(rng, tok.vocab_size, 150):
            ask("decode", [name, ids], tok.decode(ids))
            ask("labels", [name, ids], piece_labels(tok, ids))
        vocab_lookups(ask, name, tok.hf, rng)

    req["tokenizers"]["minilm"] = {"path": str(directory / "tokenizer.json"),
                                   "options": {"maxLength": max_len}}  # fmt: skip
    for text in [*TEXTS, LONG]:
        if text.strip():  # the server's path refuses an empty text; the tokenizer does not
            tokens, (ids, _) = mencode(text)
            ids = ids[0].tolist()
        else:
            ids = mtok(text, truncation=True, max_length=max_len)["input_ids"]
            tokens = mtok.convert_ids_to_tokens(ids)
        ask("encode", ["minilm", text], {"ids": ids, "tokens": tokens})
        ask("decode", ["minilm", ids], mtok.decode(ids))
        ask("decode", ["minilm", ids, {"skipSpecialTokens": True}],
            mtok.decode(ids, skip_special_tokens=True))  # fmt: skip
        ask("labels", ["minilm", ids], tokens)
    for ids in random_ids(rng, mtok.vocab_size, 100):
        ask("decode", ["minilm", ids], mtok.decode(ids))
    vocab_lookups(ask, "minilm", mtok.backend_tokenizer, rng)

    from qkv.inspect.tiny import TinyEncoder

    enc = TinyEncoder()
    req["tokenizers"]["random"] = {"hashed": {"vocabSize": enc.vocab_size}}
    for text in TEXTS:
        tokens, ids = enc.tokenize(text)
        ask("encode", ["random", text], {"ids": ids[0].tolist(), "tokens": tokens})
    got = node(req)
    assert got["load"] == {name: None for name in req["tokenizers"]}, got["load"]
    return SimpleNamespace(req=req, want=want, got=got)


def mismatches(case, kind: str, model: str, adjust=lambda call, got: got) -> list:
    """The calls of ``kind`` on ``model`` whose JS answer differs from Python's."""
    out, n = [], 0
    for call, want, got in zip(case.req[kind], case.want[kind], case.got[kind], strict=True):
        if call[0] == model:
            n += 1
            got = adjust(call, got)
            if got != want:
                out.append({"call": call[1:], "python": want, "js": got})
    assert n > 0, f"no {kind} call for {model}"
    return out


def random_model(call, got):
    """The tiny encoder's input is ``[CLS] words [SEP]``: the page adds those (ids 1, 2)."""
    if "error" in got:
        return got
    return {"ids": [1, *got["ids"], 2], "tokens": ["[CLS]", *got["tokens"], "[SEP]"]}


@pytest.mark.parametrize("model", [*TRANSLATORS, "minilm", "random"])
def test_encode_gives_pythons_ids_and_tokens(case, model):
    adjust = random_model if model == "random" else (lambda call, got: got)
    bad = mismatches(case, "encode", model, adjust)
    assert not bad, f"{len(bad)} texts differ, first: {bad[:3]}"


@pytest.mark.parametrize("model", [*TRANSLATORS, "minilm"])
def test_decode_gives_pythons_text(case, model):
    bad = mismatches(case, "decode", model)
    assert not bad, f"{len(bad)} id lists differ, first: {bad[:3]}"


@pytest.mark.parametrize("model", [*TRANSLATORS, "minilm"])
@pytest.mark.parametrize("kind", ["idToToken", "tokenToId"])
def test_vocabulary_lookups_are_hfs(case, model, kind):
    bad = mismatches(case, kind, model)
    assert not bad, f"{len(bad)} lookups differ, first: {bad[:3]}"


@pytest.mark.parametrize("model", [*TRANSLATORS, "minilm"])
def test_labels_are_the_apis_tokens(case, model):
    bad = mismatches(case, "labels", model)
    assert not bad, f"{len(bad)} id lists differ, first: {bad[:3]}"


def test_cases_cover_what_they_claim(case):
    """The checks above see every script, the NFC/NFD pair, the long-word and the cut."""
    enc = {(c[0], c[1]): w for c, w in zip(case.req["encode"], case.want["encode"], strict=True)}
    assert enc[("en-fr", "café")]["ids"] == enc[("en-fr", "cafe\u0301")]["ids"]  # NFC
    assert enc[("minilm", "x" * 101)]["tokens"] == ["[CLS]", "[UNK]", "[SEP]"]
    assert len(enc[("minilm", LONG)]["ids"]) == 512  # cut to max_len
    for text in NOTES:
        assert "<unk>" not in enc[("en-fr", text)]["tokens"]
    labels = [w for c, w in zip(case.req["labels"], case.want["labels"], strict=True)
              if c[0] == "en-fr"]  # fmt: skip
    assert any(label.startswith("(") for ls in labels for label in ls)  # split characters


def test_random_model_translation_labels_and_text():
    """The random translator's output ids read as the server shows them."""
    import torch

    from qkv.apps.serve.compute import decode_translation
    from qkv.apps.serve.models import default_registry

    entry = default_registry().get("random")
    texts = ["The boy trains the puppy.", "男孩训练小狗。", "a b c d e f g"]
    with torch.no_grad():
        answers = [decode_translation(entry, t, 1) for t in texts]
    outputs = []  # the output ids after <s>: the decoder's inputs after <s>, and the last
    for d in answers:
        last = d["produced"][-1]
        outputs.append(d["tgt_in"][1:] + [4 if last == "</s>" else int(last[1:])])
    req = {"tokenizers": {"random": {"hashed": {"vocabSize": entry.loaded.full_model.vocab_size}}},
           "encode": [["random", t] for t in texts], "decode": [["random", o] for o in outputs],
           "labels": [["random", o] for o in outputs]}  # fmt: skip
    got = node(req)
    for d, enc, text, labels in zip(answers, got["encode"], got["decode"], got["labels"],
                                    strict=True):  # fmt: skip
        assert ["<s>", *enc["tokens"], "</s>"] == d["source_tokens"]
        assert [3, *enc["ids"], 4] == d["src"]
        assert labels == d["produced"]
        assert text == d["text"]


BAD = {
    "a list": [],
    "a Unigram model": {"model": {"type": "Unigram", "vocab": []}},
    "BPE without the byte-level pre-tokenizer": {"model": {"type": "BPE", "vocab": {}},
                                                  "pre_tokenizer": {"type": "Whitespace"}},
    "BPE without qkv's specials": {
        "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "decoder": {"type": "ByteLevel"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}},
}  # fmt: skip


def test_bad_input_is_one_clear_error(tmp_path):
    """Unsupported files and bad arguments: one error naming the argument and what it got."""
    paths = {}
    for i, (what, obj) in enumerate(BAD.items()):
        paths[what] = tmp_path / f"{i}.json"
        paths[what].write_text(json.dumps(obj))
    en = str(SHIPPED / "en-fr/tokenizer.json")
    got = node({"tokenizers": {**{w: {"path": str(p)} for w, p in paths.items()},
                               "en": {"path": en}, "bad-vocab": {"hashed": {"vocabSize": 3}}},
                "encode": [["en", 42], ["en", "ok \ud800 no"], ["en", None]],
                "decode": [["en", [1, "x"]]]})  # fmt: skip
    assert "json must be a parsed tokenizer.json object, got an array" in got["load"]["a list"]
    assert 'json.model.type must be "BPE"' in got["load"]["a Unigram model"]
    assert '"Unigram"' in got["load"]["a Unigram model"]
    assert got["load"]["BPE without the byte-level pre-tokenizer"] == (
        "TypeError: tokenizer.json: pre_tokenizer must be ByteLevel with add_prefix_space false "
        'and use_regex true, got {"type":"Whitespace"}'
    )
    assert got["load"]["BPE without qkv's specials"] == (
        "TypeError: tokenizer.json: the id of <pad> must be 0 (qkv's specials: <pad> <s> </s> "
        "<unk>), got undefined"
    )
    assert "vocabSize must be an integer > 5, got 3" in got["load"]["bad-vocab"]
    assert got["encode"][0] == {"error": "TypeError: text must be a string, got number"}
    assert "lone surrogate U+D800 at index 3" in got["encode"][1]["error"]
    assert got["encode"][2] == {"error": "TypeError: text must be a string, got null"}
    assert got["decode"][0]["error"].startswith("TypeError: ids must be an array of integers")


@pytest.fixture(scope="module")
def sample() -> tuple[list[int], dict]:
    """Planes 0-1 code point by code point, every 16th above, and the references' classes."""
    cps = unicode_ref.code_points(16)
    return cps, unicode_ref.classes(cps)


def _check_classes(cps: list[int], ref: dict) -> None:
    diff = unicode_ref.compare(cps, ref)
    bad = {name: [hex(c) for c in r["fixed"][:10]] for name, r in diff.items() if r["fixed"]}
    assert not bad, (
        f"tokenize.js's Unicode classes differ from the references: {bad} "
        "(python tests/apps/web/unicode_ref.py rewrites its UNICODE_FIXES)"
    )
    # the corrections are needed: without them the JS engine's own tables differ
    assert any(r["base"] for r in diff.values())


def test_unicode_classes_match_the_references(sample):
    """Each class and map tokenize.js uses equals the reference's."""
    _check_classes(*sample)


@pytest.mark.slow
def test_unicode_classes_match_the_references_everywhere():
    cps = unicode_ref.code_points()
    _check_classes(cps, unicode_ref.classes(cps))


def subset(ref: dict, keep: set[int]) -> dict:
    """``ref`` (from :func:`unicode_ref.classes`) on the code points ``keep`` only."""
    out = {}
    for name, v in ref.items():
        if name == unicode_ref.IGNORED:
            out[name] = {k: [c for c in cs if c in keep] for k, cs in v.items()}
        elif isinstance(v, list):
            out[name] = [c for c in v if c in keep]
        else:
            out[name] = {str(c): img for c, img in v.items() if c in keep}
    return out


def test_a_browser_gives_the_same_answers(case, sample):
    """tokenize.js in chromium (its own JavaScript engine and Unicode tables): the same
    answers as Python's, and the same Unicode classes, for all the texts above."""
    from serve_helpers import chromium

    req = dict(case.req)
    req["tokenizers"] = {
        name: {**{k: v for k, v in spec.items() if k != "path"},
               **({"json": json.loads(Path(spec["path"]).read_text(encoding="utf-8"))}
                  if "path" in spec else {})}
        for name, spec in case.req["tokenizers"].items()
    }  # fmt: skip
    cps = sample[0][::7]  # a seventh of the sample: the page's own tables, not every entry
    ref = subset(sample[1], set(cps))
    req["unicode"] = {"cps": cps, "ignore": ref.pop(unicode_ref.IGNORED), "ref": ref}
    with chromium() as browser:
        page = browser.new_page()
        page.set_content("<!doctype html><meta charset='utf-8'><title>tokenize</title>")
        page.add_script_tag(path=str(ROOT / "src/qkv/apps/web/static/tokenize.js"))
        page.add_script_tag(path=str(HERE / "tokenize_harness.js"))
        got = page.evaluate("(req) => window.qkvTokenizeHarness(req)", req)
    bad = {name: r["fixed"][:10] for name, r in got["unicode"].items() if r["fixed"]}
    assert not bad, f"chromium's Unicode classes differ from the references: {bad}"
    assert got["load"] == {name: None for name in req["tokenizers"]}
    for kind in ("encode", "decode", "labels", "idToToken", "tokenToId"):
        adjust = lambda call, g: random_model(call, g) if call[0] == "random" else g  # noqa: E731
        bad = [(call, want, adjust(call, g))
               for call, want, g in zip(case.req[kind], case.want[kind], got[kind], strict=True)
               if adjust(call, g) != want]  # fmt: skip
        assert not bad, f"{kind}: {len(bad)} calls differ in chromium, first: {bad[:2]}"
