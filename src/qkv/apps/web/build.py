"""``qkv web build DIR``: the explorer as a self-contained static site.

The site, written into a temporary sibling of ``DIR`` and renamed into place at the end::

    index.html            the explorer's own page (qkv/apps/serve/static/index.html): paths
                          made relative, a Content-Security-Policy allowing this origin only,
                          the in-page engine's scripts and static/site.js before app.js
    static/               the explorer's files, i18n/strings.json with the site's words added,
                          site.js (the engine the page talks to: site_static/site.js), site.css
                          (the site's own layout rules)
    site.json             the models in the menu's order (en-fr first, the page opens on it),
                          their download sizes, the limits, the saved answers
    saved/*.json          each model's first view of the notes' sentence, computed here
    models/, engine files the in-page engine's (qkv.apps.web.export), when it is installed
    .nojekyll             GitHub Pages serves the files as they are

>>> check_models("random,en-fr")
['random', 'en-fr']
>>> check_models("gpt2")
Traceback (most recent call last):
...
ValueError: must name models from en-fr, fr-en, minilm, random (comma-separated), got 'gpt2'
"""

from __future__ import annotations

import html
import importlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

from qkv.apps.serve import limits

__all__ = [
    "CSP",
    "MAX_FILE_BYTES",
    "MAX_SITE_BYTES",
    "SITE_MODELS",
    "build_site",
    "check_models",
    "check_target",
    "first_requests",
]

# the models the page can run: the shipped ones (a user's own model needs qkv serve), in the
# site's menu order. The page opens on the first: en-fr, the notes' translator (34 MB), rather
# than qkv serve's first, MiniLM (91 MB), so that a reader's first sentence of their own
# downloads the least a translation needs
SITE_MODELS = ("en-fr", "fr-en", "minilm", "random")
GENERATOR = "qkv web build"  # site.json's mark: a directory a new build may replace
# GitHub's limits with a margin: no file over 100 MB in a repository or an artifact, Pages
# sites up to 1 GB (the issue asks for ≤ 250 MB, so that a school network can fetch it)
MAX_FILE_BYTES = 95 * 10**6
MAX_SITE_BYTES = 250 * 10**6
# as qkv serve's (qkv.apps.serve.app.CSP), with 'self' as the default and WebAssembly allowed:
# the in-page engine compiles its runtime (a <meta> policy cannot set frame-ancestors)
CSP = ("default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self'; "
       "img-src 'self' data:; connect-src 'self'; font-src 'self'; worker-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'")  # fmt: skip

_SERVE_STATIC = files("qkv") / "apps" / "serve" / "static"
_SITE_STATIC = files("qkv") / "apps" / "web" / "site_static"
_STATIC_REF = re.compile(r'(src|href)="/static/([\w./-]+)"')


def check_models(value: str) -> list[str]:
    """``--models``: comma-separated names from :data:`SITE_MODELS`, each once."""
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    wrong = [n for n in names if n not in SITE_MODELS]
    if not names or wrong:
        raise ValueError(f"must name models from {', '.join(SITE_MODELS)} (comma-separated), "
                         f"got {value!r}")  # fmt: skip
    if len(set(names)) != len(names):
        raise ValueError(f"must name each model once, got {value!r}")
    return names


def check_target(value: str) -> Path:
    """``DIR``: a directory that does not exist yet (its nearest existing ancestor writable), an
    empty one, or a site an earlier build wrote (replaced whole). Writes nothing."""
    if not value:
        raise ValueError("must name a directory, got ''")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{value!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not _is_site(path):
        raise ValueError(f"{value!r} is a directory that holds other files (not a site built "
                         f"by {GENERATOR}): choose a new or empty directory")  # fmt: skip
    anc = path.resolve()
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir() or not os.access(anc, os.W_OK):
        raise ValueError(f"cannot create {value!r}: {str(anc)!r} is not writable")
    if path.resolve().parent == path.resolve():
        raise ValueError(f"cannot build into the root directory {value!r}")
    return path


def _is_site(path: Path) -> bool:
    try:
        meta = json.loads((path / "site.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("generator") == GENERATOR


# ---- the requests the page sends when it opens


def first_requests(model: str, translator: bool) -> list[dict]:
    """The ``/api/attention`` bodies the page sends when it opens on ``model`` (``?model=``;
    the first model of the menu without it): its sentence as written in index.html, and the
    probe app.js starts with; translating too for a translator (``&translate=1``, or the
    menu, which ticks "translate" for a trained translator). Read from the static files, so
    that they cannot drift apart."""
    index = (_SERVE_STATIC / "index.html").read_text(encoding="utf-8")
    app = (_SERVE_STATIC / "app.js").read_text(encoding="utf-8")
    text = re.search(r'<input id="text"[^>]*\svalue="([^"]*)"', index)
    probe = re.search(r'probeToken: "([^"]*)", probeCands: "([^"]*)"', app)
    if not text or not probe:
        raise RuntimeError("index.html's sentence or app.js's probe moved: update "
                           "qkv.apps.web.build.first_requests")  # fmt: skip
    candidates = [c.strip() for c in probe.group(2).split(",") if c.strip()][:8]  # as payload()
    body = {"text": html.unescape(text.group(1)), "model": model, "translate": False, "beam": 1,
            "head": 0, "ablate": [], "probe": {"token": probe.group(1), "candidates": candidates}}  # fmt: skip
    return [body, {**body, "translate": True}] if translator else [body]


def _answer(registry, body: dict) -> dict:
    """``POST /api/attention``'s answer to ``body``, as qkv serve computes it (no timing)."""
    from qkv.apps.serve.compute import attention

    req = limits.parse_request(body)
    return attention(registry.get(req.model), req)


def _dump(data: object) -> bytes:
    """JSON as qkv serve's answers are written (Starlette's JSONResponse)."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")  # fmt: skip


def _save_answers(root: Path, registry, names: list[str], say: Callable[[str], None]) -> list:
    """Each model's first view, written to ``root/saved/``: the list of site.json's
    ``saved``. The same request with the layer and head the answer selected (the address
    after the page showed it: a shared link) is saved too, pointing at the same file when its
    answer is the same."""
    (root / "saved").mkdir()
    out = []
    for name in names:
        info = next(m for m in registry.info() if m["name"] == name)
        for body in first_requests(name, info["translator"]):
            t0 = time.perf_counter()
            answer = _answer(registry, body)
            kind = "translate" if body["translate"] else "maps"
            file = f"saved/{name}-{kind}.json"
            data = _dump(answer)
            (root / file).write_bytes(data)
            out.append({"request": body, "file": file, "bytes": len(data)})
            step = answer.get("step") or {}
            if step.get("layer") is not None:
                linked = {**body, "layer": step["layer"], "head": step["head"]}
                again = _dump(_answer(registry, linked))
                if again != data:
                    file = f"saved/{name}-{kind}-linked.json"
                    (root / file).write_bytes(again)
                out.append({"request": linked, "file": file, "bytes": len(again)})
            say(f"saved {name} ({kind}): {len(data) / 1e3:.0f} kB, "
                f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    return out


# ---- the page and its files


def _page(engine_scripts: list[str]) -> str:
    """index.html for the site: relative paths, the site's policy, the engine's scripts."""
    page = (_SERVE_STATIC / "index.html").read_text(encoding="utf-8")
    page = _STATIC_REF.sub(lambda m: f'{m.group(1)}="static/{m.group(2)}"', page)
    if "/static/" in page or re.search(r'(src|href)="(https?:)?//', page):
        raise RuntimeError("index.html refers to a path the site cannot relate: update "
                           "qkv.apps.web.build._page")  # fmt: skip
    meta = (f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            '<link rel="icon" href="data:,">\n')  # fmt: skip  no /favicon.ico request
    app = '<script src="static/app.js" defer></script>'
    css = '<link rel="stylesheet" href="static/export.css">\n'
    ours = [*engine_scripts, "static/site.js"]
    scripts = "".join(f'<script src="{html.escape(s)}" defer></script>\n' for s in ours)
    if page.count(app) != 1 or page.count('<meta charset="utf-8">\n') != 1 or page.count(css) != 1:
        raise RuntimeError("index.html's head changed: update qkv.apps.web.build._page")
    page = page.replace('<meta charset="utf-8">\n', '<meta charset="utf-8">\n' + meta, 1)
    # the site's own rules after the explorer's stylesheets (site_static/site.css)
    page = page.replace(css, css + '<link rel="stylesheet" href="static/site.css">\n', 1)
    return page.replace(app, scripts + app, 1)


def _strings() -> bytes:
    """The explorer's i18n/strings.json with the site's own words (site_static/strings.json)
    added to each language."""
    strings = json.loads((_SERVE_STATIC / "i18n" / "strings.json").read_text(encoding="utf-8"))
    site = json.loads((_SITE_STATIC / "strings.json").read_text(encoding="utf-8"))
    for lang in strings["languages"]:
        missing = sorted(set(site["en"]) - set(site.get(lang, {})))
        if missing:
            raise RuntimeError(f"site_static/strings.json lacks {missing} in {lang!r}")
        strings[lang].update(site[lang])
    return _dump(strings)


def _copy_static(root: Path) -> None:
    static = root / "static"
    (static / "i18n").mkdir(parents=True)
    for item in _SERVE_STATIC.iterdir():
        if item.name.endswith((".js", ".css")):
            (static / item.name).write_bytes(item.read_bytes())
    (static / "i18n" / "strings.json").write_bytes(_strings())
    for name in ("site.js", "site.css"):
        (static / name).write_bytes((_SITE_STATIC / name).read_bytes())


def _export(root: Path, names: list[str], say: Callable[[str], None],
            engine: bool) -> tuple[list, dict]:  # fmt: skip
    """The in-page engine's scripts and the download size of each model it runs, from
    :mod:`qkv.apps.web.export` when it is installed; ``([], {})`` without it, or without
    ``engine`` (the site then shows the saved answers only). A model the engine does not
    run (not in its ``MODELS``) keeps its saved answers only."""
    if not engine:
        say("no in-page engine (engine=False): the site shows the saved answers only")
        return [], {}
    try:
        export = importlib.import_module("qkv.apps.web.export")
    except ModuleNotFoundError as err:
        if err.name != "qkv.apps.web.export":  # the engine is there, but lacks something: say it
            raise
        say("no in-page engine (qkv.apps.web.export): the site shows the saved answers only")
        return [], {}
    runs = [n for n in names if n in getattr(export, "MODELS", names)]
    if len(runs) < len(names):
        say(f"the in-page engine does not run {', '.join(n for n in names if n not in runs)}: "
            "their saved answers only")  # fmt: skip
    if not runs:
        return [], {}
    infos = export.export_site_models(root, runs, progress=say)
    scripts = list(export.ENGINE_SCRIPTS)
    lost = [s for s in scripts if not (root / s).is_file()]
    if lost:
        raise RuntimeError(f"the engine's export did not write its scripts {lost}")
    sizes = {i["name"]: int(i["bytes"]) for i in infos}
    if sorted(sizes) != sorted(runs):
        raise RuntimeError(f"the engine exported {sorted(sizes)}, asked for {sorted(runs)}")
    return scripts, sizes


def _runtime_bytes(root: Path, scripts: list[str]) -> int:
    """The engine's files fetched when it first runs (its WebAssembly): what the export wrote
    beside its scripts and the models."""
    ours = {"index.html", "site.json", ".nojekyll"}
    skip = ("static/", "saved/", "models/")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()
               and (rel := p.relative_to(root).as_posix()) not in ours
               and not rel.startswith(skip) and rel not in scripts)  # fmt: skip


def _sizes(root: Path) -> tuple[int, list[tuple[str, int]]]:
    """The site's bytes, and its files over :data:`MAX_FILE_BYTES`."""
    total, big = 0, []
    for p in root.rglob("*"):
        if p.is_file():
            n = p.stat().st_size
            total += n
            if n > MAX_FILE_BYTES:
                big.append((str(p.relative_to(root)), n))
    return total, big


def _write(root: Path, names: list[str], say: Callable[[str], None], engine: bool) -> dict:
    from qkv.apps.serve.models import default_registry

    registry = default_registry()
    absent = [n for n in names if n not in registry.names()]
    if absent:  # a shipped translator this install lacks
        raise ValueError(f"--models: this install has no {', '.join(absent)} "
                         f"(it has {', '.join(registry.names())})")  # fmt: skip
    ordered = [n for n in SITE_MODELS if n in names]  # the site's menu order (opens on the first)
    _copy_static(root)
    scripts, sizes = _export(root, ordered, say, engine)
    saved = _save_answers(root, registry, ordered, say)
    # loaded: whether the page has the model (none has, at first); bytes: its download
    info = {m["name"]: m for m in registry.info()}
    models = [{**info[n], "loaded": False, "bytes": sizes.get(n)} for n in ordered]
    first = models[0]
    manifest = {
        "generator": GENERATOR,
        "engine": bool(scripts),
        "runtime_bytes": _runtime_bytes(root, scripts) if scripts else 0,
        "models": models,
        # what the page opens on without ?model=: the menu's first model, a trained translator
        # translating (as picking it in the menu does)
        "opens": {"model": first["name"], "translate": first["translator"] and not first["random"]},
        # qkv serve's /api/health limits (qkv.apps.serve.app), which the in-page engine keeps
        "limits": {"tokens": limits.TOKEN_LIMIT, "translate_tokens": limits.TRANSLATE_LIMIT,
                   "body_bytes": limits.MAX_BODY_BYTES, "cells": limits.MAX_CELLS,
                   "beam": limits.MAX_BEAM, "long_tokens": limits.LONG_TOKEN_LIMIT,
                   "long_bytes": limits.MAX_LONG_BYTES, "pieces": limits.MAX_PIECES},
        "saved": saved,
    }  # fmt: skip
    (root / "site.json").write_bytes(_dump(manifest))
    (root / "index.html").write_text(_page(scripts), encoding="utf-8")
    (root / ".nojekyll").write_bytes(b"")
    total, big = _sizes(root)
    if big:
        raise ValueError("the site has files over GitHub's limit of "
                         f"{MAX_FILE_BYTES / 1e6:.0f} MB: "
                         + ", ".join(f"{p} ({n / 1e6:.1f} MB)" for p, n in big))  # fmt: skip
    if total > MAX_SITE_BYTES:
        raise ValueError(f"the site is {total / 1e6:.1f} MB, over its budget of "
                         f"{MAX_SITE_BYTES / 1e6:.0f} MB: build it with fewer --models")  # fmt: skip
    return {"bytes": total, "models": models, "engine": bool(scripts), "saved": len(saved)}


def build_site(out: str | os.PathLike, models: list[str] | None = None,
               progress: Callable[[str], None] = print, *, engine: bool = True) -> dict:  # fmt: skip
    """Write the explorer's static site into ``out`` (see the module's docstring).

    ``models``: names from :data:`SITE_MODELS` (default: all). ``out`` is checked first
    (:func:`check_target`); the site is written into a temporary sibling and renamed onto
    ``out`` when complete (an earlier site there is replaced), so a failed build leaves
    nothing behind. ``engine=False``: no in-page engine even where one is installed (the
    first views only; new sentences are refused with a message). Returns ``{"bytes", "models", "engine", "saved"}``.
    """
    target = check_target(os.fspath(out))
    names = check_models(",".join(models)) if models is not None else list(SITE_MODELS)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".building",
                                    dir=target.parent))  # fmt: skip
    except OSError as err:  # named by the user's path, not by the temporary one
        raise OSError(err.errno, f"cannot write {str(target)!r}: {err.strerror or err}") from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the site from a web server's user
        summary = _write(tmp, names, progress, engine)
        old = None
        if target.exists():  # an empty directory or an earlier site: out of the way first
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old",
                                        dir=target.parent))  # fmt: skip
            os.replace(target, old / "site")
        try:
            os.replace(tmp, target)
        except OSError:
            if old is not None:  # the earlier site back where it was
                os.replace(old / "site", target)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary
