"""The in-page engine's RepeatGuard (decode.js) and translation notes (answer.js) under node,
against Python's: ``qkv.generate.RepeatGuard.banned`` on the same token histories (the same
tokens, in the same order) and ``qkv.apps.serve.decoding.notes`` on the same texts (the same
codes, fields and English note), for both shipped translators. One node run per module.
Skipped without node."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (CI has it)")
STRESS = HERE.parents[1] / "data" / "translate_stress.tsv"
MODELS = ("en-fr", "fr-en")

# Texts whose tokens make stutters, loops and their exceptions: each one's every prefix is a
# history. The fr-en model's own stutters ("Migigigiga", "gicicicic") are among them.
STUTTERS = [
    "Migigigiga and Pananananaa is walking.", "The gicicicic E Eight of people are reararararing.",
    "Micicicic and gentleman, edddd.", "A man is looking at Gigigigigiiii.",
    "Moooyyy and a well-ddddressed gentleman.", "est est est est", "a dog a dog a dog a dog",
    "1000000 and 4 4 4 4 people", "Ooooh ssss éééé çaçaça üüüü", "Le chien chien chien court.",
    "Briririasasase joue au football.", "AAA eXXXotica dooorway", "nanananana!!! ... ---",
]
# Notes beyond the stress set: names joined by "and", capitals, a long sentence, scripts
# and spaces Python and JavaScript class differently
EDGES = [
    "John and Maria walk their dog.", "Jean et Marie promènent leur chien.",
    "A GROUP OF MUSICIANS IS PLAYING ON THE STAGE.", "A dog at 7 o'clock? ¿Qué?",
    " ".join(["A man in a blue shirt is riding a bike down the street"] * 4) + ".",
    "Ein Mann und eine Frau gehen mit dem Hund.", "Un homme et une femme marchent avec le chien.",
    "The dog\u00a0and\u3000Kubernetes\u2028meet Zürich's Ǆemal. «Photosynthesis» and MP3 dog0 ²",
    "Deux chiens jouent dans la neige près de Trondheim et Kristiansand.", "",
    "Bà ấy đi bộ với con chó. আমি ভাত খাই। 我喜欢狗。", "x\u0301yz Ŀlama ǅungla",
]


def stress_texts() -> list[tuple[str, str]]:
    rows = []
    for line in STRESS.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            model, _notes, text, _where = line.split("\t")
            rows.append((model, text))
    return rows


def node(request: dict) -> dict:
    out = subprocess.run([NODE, str(HERE / "guard_harness.js")], input=json.dumps(request),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def translators():
    from qkv.translate import load

    return {name: load(name) for name in MODELS}


def histories(tr, rng: random.Random) -> list[list[int]]:
    """Every prefix of each STUTTERS text's tokens, and random runs of word-inner tokens
    (where letter stutters live), of tokens repeated with a period, and of digits."""
    from qkv.generate import RepeatGuard

    guard = RepeatGuard.for_tokenizer(tr.tokenizer)
    out = []
    for text in STUTTERS:
        ids = tr.tokenizer.encode(text)
        out += [ids[:k] for k in range(1, len(ids) + 1)]
    inner = [i for i, s in enumerate(guard.starts_word) if not s and guard.body[i]]
    short = [i for i in inner if len(guard.body[i]) <= 2]
    digits = sorted(guard.inner_digits)
    for _ in range(150):
        unit = [rng.choice(short) for _ in range(rng.randint(1, 3))]
        start = rng.choice(range(4, len(guard.body)))
        out.append([start, *(unit * rng.randint(1, 4))][: rng.randint(2, 18)])
        out.append([rng.choice(inner) for _ in range(rng.randint(1, 20))])
        out.append([rng.choice(range(len(guard.body))) for _ in range(rng.randint(1, 6))] + [rng.choice(digits)] * 3)
    return out


def test_repeat_guard_bans_what_python_bans(translators):
    from qkv.generate import RepeatGuard

    rng = random.Random(0)
    cases = [(name, h) for name in MODELS for h in histories(translators[name], rng)]
    paths = {name: str(tr.path / "tokenizer.json") for name, tr in translators.items()}
    got = node({"tokenizers": paths, "banned": cases})["banned"]
    n_banned = 0
    for (name, hist), ours in zip(cases, got, strict=True):
        guard = RepeatGuard.for_tokenizer(translators[name].tokenizer)
        pairs = guard.banned(torch.tensor([hist]))
        theirs = [] if pairs is None else pairs[1].tolist()
        assert ours == theirs, (name, hist)
        n_banned += bool(set(theirs) - set(guard._stutters))
    assert n_banned > 100  # the histories do reach the rules, not only the stutter tokens


def test_notes_as_the_server(translators):
    from types import SimpleNamespace

    from qkv.apps.serve.decoding import notes, page_settings

    loaded = {name: SimpleNamespace(translator=tr, tokenizer=tr.tokenizer, full_model=tr.model)
              for name, tr in translators.items()}  # fmt: skip
    cases = stress_texts() + [(name, text) for name in MODELS for text in EDGES + STUTTERS]
    got = node({"tokenizers": {name: str(tr.path / "tokenizer.json") for name, tr in translators.items()},
                "settings": {name: page_settings(loaded[name])["notes"] for name in MODELS},
                "notes": cases})["notes"]  # fmt: skip
    codes = set()
    for (name, text), ours in zip(cases, got, strict=True):
        theirs = notes(loaded[name], text)
        assert ours == theirs, (name, text)
        codes |= {w["code"] for w in theirs["warnings"]}
    assert codes == {"long", "pieces", "unseen", "numbers", "language", "question"}
