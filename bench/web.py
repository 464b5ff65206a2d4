"""qkv in the browser: the static site (``qkv web build``) in headless chromium against
``qkv serve`` answering the same requests on the same machine, in the same run.

    python bench/web.py                                        # builds a site of all four models
    python bench/web.py --site /tmp/live --models en-fr,random --rounds 3 --out bench/results/web.md

The site is served by ``python -m http.server`` and ``qkv serve`` runs beside it, both on
127.0.0.1 on ports the system picks; both are stopped at the end, also on errors. Each round
opens every page in a fresh browser context (no cache) and starts a fresh ``qkv serve`` (so
that its first request of each model includes loading it, as the page's includes its
download). Measured:

1. the first view (the notes' sentence, saved in the site): navigation start to the first
   frame after the page is ready with its map drawn, and the bytes it downloaded until then
   (the Performance API's ``transferSize``); every request outside the site's origin counted;
2. per model (a page opened on it, translating for a translator, beam 1 = greedy): a new
   sentence's answer, its download included (click on Run to the first frame after the page
   is ready), the size the page states before the download (the model menu, the status
   line), then a second new sentence; the same two requests (recorded from the page's engine)
   posted to ``qkv serve``'s ``/api/attention`` once the page is closed, timed from sending to
   the parsed JSON, then the second again 3 times (the server's best: its first answers of
   a model come slower); the ratios page/server;
3. the fair peer of 2: the same front-end served by ``qkv serve`` (its own explorer page,
   answering over HTTP), opened on the same model once the site's page is closed, asked the
   same two sentences, click to painted as in the site's page; both pages then ask the
   second sentence 3 more times (each page's best); the ratios site page / served page;
4. the site's total size and its largest file.

Verdicts are those of the median over the rounds, with the number of rounds that met the
target beside them: a miss in any round shows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from _measure import machine_header
from qkv.atomic import atomic_write_text

MODELS = ("en-fr", "fr-en", "minilm", "random")
TRANSLATORS = ("en-fr", "fr-en", "random")  # translated, greedy (beam 1)
# two new sentences per source language (neither is the site's saved one), ≤ 20 tokens each
SENTENCES = {
    "en": ("A dog runs in the snow.", "My sister reads a long book by the window every night."),
    "fr": ("Un chien court dans la neige.", "Ma sœur lit un long livre près de la fenêtre chaque soir."),
}
SOURCE = {"fr-en": "fr"}  # the others read English
CHROMIUM = "/usr/bin/chromium"
MB = 1e6
STEP_S = 120  # any one page step or request (MiniLM's 91 MB download on a busy machine)
START_S = 120  # a server to start
BUILD_S = 1800  # the site's build (four models exported and checked)
WARM = 3  # the server asked the second sentence again, this many times (its best kept)

# targets (the issue "qkv in the browser")
FIRST_VIEW_S, FIRST_VIEW_MB = 1.0, 40.0
FIRST_ANSWER_S = 3.0
NEXT_S, NEXT_RATIO, NEXT_TOKENS = 1.0, 1.5, 20
SITE_MB, FILE_MB = 250.0, 95.0

# in every page, before its scripts: when the page becomes ready (data-ready 0 → 1) the first
# frame after it is timed (performance.now(): ms since navigation start), with the map's
# canvases then; the status line's texts; and every request the page's engine answers (the
# site's engine wrapped where site.js sets window.QKV_ENGINE), so the server gets the same
INIT_JS = r"""(() => {
  const q = (window.__qkv = { ready: [], status: [], calls: [] });
  const mark = () => {
    const maps = document.querySelectorAll("#views canvas").length;
    requestAnimationFrame(() => setTimeout(() => q.ready.push({ at: performance.now(), maps }), 0));
  };
  new MutationObserver((records) => {
    const rs = records.filter((r) => r.type === "attributes" && r.attributeName === "data-ready");
    rs.forEach((r, i) => {  // each record's new value is the next one's old value
      const now = i + 1 < rs.length ? rs[i + 1].oldValue : document.body.dataset.ready;
      if (now === "1" && r.oldValue !== "1") mark();
    });
    const s = document.getElementById("status");
    if (s && s.textContent !== q.lastStatus) {
      q.lastStatus = s.textContent;
      q.status.push({ at: performance.now(), text: s.textContent });
    }
  }).observe(document, { subtree: true, childList: true, characterData: true, attributes: true,
                         attributeOldValue: true, attributeFilter: ["data-ready"] });
  let chosen;
  Object.defineProperty(window, "QKV_ENGINE", { configurable: true, get: () => chosen, set: (make) => {
    chosen = (E) => {
      const e = typeof make === "function" ? make(E) : make;
      const inner = e.attention.bind(e);
      e.attention = async (request) => {
        const c = { request: structuredClone(request), start: performance.now() };
        q.calls.push(c);
        try {
          const a = await inner(request);
          Object.assign(c, { end: performance.now(), tokens: a.tokens,
                             translation: a.translation ? a.translation.text : null });
          return a;
        } catch (err) { Object.assign(c, { end: performance.now(), error: String(err) }); throw err; }
      };
      return e;
    };
  } });
})();"""


class BenchError(RuntimeError):
    """A step that failed: said in the results, the run goes on where it can."""


# --- processes: each stopped on leaving, also on errors ----------------------------------------


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def started(cmd: list[str], ready: str, what: str, env: dict | None = None) -> Iterator[re.Match]:
    """``cmd`` running until the block ends; yields the match of ``ready`` in its output (its
    port). Its output is read all along (a full pipe would stall it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    out: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        end = time.monotonic() + START_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"{what} did not start within {START_S} s: {''.join(out)[-500:]}") from None
            if line is None:
                raise BenchError(f"{what} stopped at start: {''.join(out)[-500:]}")
            out.append(line)
            if m := re.search(ready, line):
                break
        yield m
    finally:
        _stop(proc)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextmanager
def site_server(site: Path) -> Iterator[str]:
    cmd = [sys.executable, "-u", "-m", "http.server", "0", "-b", "127.0.0.1", "-d", str(site)]
    with started(cmd, r" port (\d+) ", "python -m http.server") as m:
        yield f"http://127.0.0.1:{m.group(1)}"


@contextmanager
def qkv_serve() -> Iterator[int]:
    """A fresh ``qkv serve`` on 127.0.0.1 (no model preloaded), ready to answer; its port."""
    cmd = [sys.executable, "-u", "-m", "qkv", "serve", "--host", "127.0.0.1", "--port", "0"]
    with started(cmd, r"qkv serve: http://127\.0\.0\.1:(\d+)/", "qkv serve", _env()) as m:
        port = int(m.group(1))
        end = time.monotonic() + START_S
        while True:  # uvicorn listens a moment after the line
            try:
                if _request(port, "GET", "/api/health", None, 10)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > end:
                raise BenchError(f"qkv serve on port {port} did not answer /api/health")
            time.sleep(0.1)
        yield port


def _request(port: int, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post_attention(port: int, body: dict) -> tuple[float, dict]:
    """Seconds from sending ``body`` to ``/api/attention`` to its parsed answer, and the answer."""
    t = time.perf_counter()
    status, data = _request(port, "POST", "/api/attention", body, STEP_S)
    answer = json.loads(data)
    seconds = time.perf_counter() - t
    if status != 200:
        raise BenchError(f"qkv serve answered {status}: {answer.get('error', '')[:200]}")
    return seconds, answer


def build(out: Path, models: list[str]) -> float:
    """``qkv web build out --models …``; its seconds."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "qkv", "web", "build", str(out), "--models", ",".join(models)]
    # its own process group: the build traces each model in a child process, stopped with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=BUILD_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"qkv web build took over {BUILD_S} s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    if proc.returncode != 0:
        raise BenchError(f"qkv web build failed ({proc.returncode}): {out[-800:]}")
    return time.perf_counter() - t


# --- the page ------------------------------------------------------------------------------------


class Page:
    """A page of the site in a fresh context: the responses it got (with their sizes) and every
    request outside the site's origin."""

    def __init__(self, browser, url: str, query: str = "", init: str = "") -> None:
        self.origin = url
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.responses: list[tuple[str, int]] = []  # (path, body bytes: Content-Length)
        self.outside: list[str] = []
        self.context.on("request", self._request)
        self.context.on("response", self._response)
        self.context.add_init_script(INIT_JS + init)
        try:
            self.page = self.context.new_page()
            self.page.set_default_timeout(STEP_S * 1000)
            self.page.goto(f"{url}/{query}")
            self.wait_ready(0)
        except BaseException:
            self.context.close()
            raise

    def _request(self, r) -> None:
        if not r.url.startswith(self.origin + "/") and not r.url.startswith("data:"):
            self.outside.append(r.url)

    def _response(self, r) -> None:
        self.responses.append((urlsplit(r.url).path, int(r.headers.get("content-length", 0))))

    def q(self) -> dict:
        return self.page.evaluate("window.__qkv")

    def wait_ready(self, n: int) -> dict:
        """The (n+1)-th time the page became ready and a frame followed: ``{at, maps}``."""
        self.page.wait_for_function(f"() => window.__qkv.ready.length > {n}", timeout=STEP_S * 1000)
        return self.q()["ready"][n]

    def first_view(self) -> tuple[float, float, int]:
        """Navigation start to the first map's frame (s), the bytes fetched for it (Performance
        API: every file asked for until the saved answer came, not the other saved answers the
        site fetches once it is shown), the map's canvases."""
        q = self.q()
        ready = q["ready"][0]
        until = q["calls"][0]["end"] if q["calls"] and "end" in q["calls"][0] else ready["at"]
        sent = self.page.evaluate("""(until) => performance.getEntriesByType('navigation')
            .concat(performance.getEntriesByType('resource'))
            .filter((e) => e.startTime <= until)
            .reduce((s, e) => s + e.transferSize, 0)""", until)  # fmt: skip
        return ready["at"] / 1000, sent, ready["maps"]

    def ask(self, text: str) -> dict:
        """``text`` typed and Run clicked: seconds to the first frame after the answer is shown,
        the request the engine got and its answer, the bytes downloaded, what the status said."""
        q = self.q()
        n, calls, seen = len(q["ready"]), len(q["calls"]), len(self.responses)
        t0 = self.page.evaluate("""(text) => { const t0 = performance.now();
            document.querySelector('#text').value = text; document.querySelector('#run').click();
            return t0; }""", text)  # fmt: skip
        ready = self.wait_ready(n)
        q = self.q()
        new = [c for c in q["calls"][calls:] if c["request"]["text"] == text]
        if not new:
            raise BenchError(f"the page asked its engine nothing for {text!r}")
        call = new[-1]
        if ready["maps"] == 0:
            raise BenchError(f"the answer to {text!r} was shown with no map drawn")
        if "error" in call:
            raise BenchError(f"the page's engine refused {text!r}: {call['error'][:200]}")
        return {
            "seconds": (ready["at"] - t0) / 1000,
            "engine_s": (call["end"] - call["start"]) / 1000,
            "request": call["request"],
            "tokens": call["tokens"],
            "translation": call["translation"],
            "maps": ready["maps"],
            "got": list(self.responses[seen:]),
            "status": [s["text"] for s in q["status"] if t0 <= s["at"] <= ready["at"]],
        }

    def best_of(self, text: str, times: int) -> float:
        """``text`` asked ``times`` more (the engine and the page warmed): the best seconds."""
        return min(self.ask(text)["seconds"] for _ in range(times))

    def close(self) -> None:
        self.context.close()


@contextmanager
def chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        try:
            yield b
        finally:
            b.close()


# --- one round -----------------------------------------------------------------------------------


def first_view(browser, url: str) -> dict:
    page = Page(browser, url)
    try:
        seconds, sent, maps = page.first_view()
        if maps == 0:
            raise BenchError("the first view was ready with no map drawn")
        return {"seconds": seconds, "bytes": sent, "maps": maps, "outside": list(page.outside)}
    finally:
        page.close()


def model_round(browser, url: str, port: int, model: str) -> dict:
    """A page opened on ``model`` (its saved first view), two new sentences; then, the page
    closed (an open page keeps drawing and would slow the server down), the same two
    requests to ``qkv serve`` (the first one loading the model there)."""
    translate = model in TRANSLATORS
    texts = SENTENCES[SOURCE.get(model, "en")]
    page = open_on(browser, url, model, translate)
    try:
        label = page.page.text_content(f"#model option[value='{model}']") or ""
        asked = [page.ask(text) for text in texts]
        page_warm = page.best_of(texts[1], WARM)
        outside = list(page.outside)
    finally:
        page.close()
    for x in asked:
        if x["request"].get("beam", 1) != 1 or bool(x["request"].get("translate")) != translate:
            raise BenchError(f"the page's request is not greedy, translate={translate}: {x['request']}")
    pairs = [(x, *post_attention(port, x["request"])) for x in asked]
    (a, s1, _), (b, s2, _) = pairs
    # the server's first answers of a model come slower than its later ones (~1 s against
    # 0.1 s for MiniLM here): the second sentence again, the best of WARM repeats
    warm = min(post_attention(port, b["request"])[0] for _ in range(WARM))
    same = all(x["tokens"] == r["tokens"]
               and x["translation"] == (r["translation"]["text"] if r.get("translation") else None)
               for x, _, r in pairs)  # fmt: skip
    served = served_round(browser, port, model, translate, texts)
    same = same and [x["tokens"] for x in served["asked"]] == [x["tokens"] for x in asked]
    return {"label": label, "first": a, "second": b, "server_first": s1, "server_second": s2,
            "server_warm": warm, "same": same, "outside": outside, "page_warm": page_warm,
            "served_second": served["asked"][1], "served_warm": served["warm"]}  # fmt: skip


def open_on(browser, url: str, model: str, translate: bool, init: str = "") -> Page:
    page = Page(browser, url, f"?model={model}" + ("&translate=1" if translate else ""), init)
    p = page.page
    if p.input_value("#model") != model or p.is_checked("#translate") != translate:
        page.close()
        raise BenchError(f"the page at {url} did not open on {model} (translate={translate})")
    return page


def served_round(browser, port: int, model: str, translate: bool, texts: tuple[str, str]) -> dict:
    """The explorer as ``qkv serve`` serves it (its page, its HTTP engine, the same front-end
    files), asked the same sentences as the site's page: what a reader of the served explorer
    waits for, from the click to the painted maps."""
    # the served page's HttpEngine through window.QKV_ENGINE, so that INIT_JS records its calls
    served = "\nwindow.QKV_ENGINE = (E) => new E.HttpEngine();"
    page = open_on(browser, f"http://127.0.0.1:{port}", model, translate, served)
    try:
        asked = [page.ask(text) for text in texts]
        return {"asked": asked, "warm": page.best_of(texts[1], WARM)}
    finally:
        page.close()


# --- the report ----------------------------------------------------------------------------------


def site_sizes(site: Path) -> tuple[int, tuple[int, str]]:
    files = [f for f in site.rglob("*") if f.is_file()]
    largest = max(files, key=lambda f: f.stat().st_size)
    return sum(f.stat().st_size for f in files), (largest.stat().st_size, str(largest.relative_to(site)))


def _said_mb(text: str) -> str:
    m = re.search(r"(\d+(?:\.\d+)?) MB", text)
    return f"{m.group(1)} MB" if m else "none"


class Row:
    """One figure over the rounds against its target."""

    def __init__(self, values: list[float], limit: float) -> None:
        self.values, self.limit = values, limit

    def cell(self, fmt: str) -> str:
        if not self.values:
            return "no value"
        med = statistics.median(self.values)
        if len(self.values) == 1:
            return fmt.format(med)
        return f"{fmt.format(med)} ({fmt.format(min(self.values))}–{fmt.format(max(self.values))})"

    def verdict(self) -> str:
        if not self.values:
            return "**not met** (not measured)"
        k = sum(v <= self.limit for v in self.values)
        ok = statistics.median(self.values) <= self.limit
        return f"{'met' if ok else '**not met**'} ({k}/{len(self.values)} rounds)"


def report(args, rounds: list[dict], site: Path, built_s: float | None, header: str,
           browser_version: str, started_at: datetime, loads: tuple) -> str:  # fmt: skip
    total, (largest, largest_name) = site_sizes(site)
    n = len(rounds)
    lines = [
        "# qkv in the browser: the static site against `qkv serve`",
        "",
        f"Command: `python bench/web.py {' '.join(args.argv)}`".rstrip() + "  ",
        f"Date: {started_at:%Y-%m-%d %H:%M} UTC; load average (1 min) {loads[0]:.1f} at start, "
        f"{loads[1]:.1f} at the end  ",
        f"Browser: Debian's chromium {browser_version}, headless (Playwright)  ",
        "Site: " + (f"built by `qkv web build` for this run ({built_s:.0f} s)" if built_s is not None
                    else f"`{args.site}`") + f", models {', '.join(args.models)}; served by "
        "`python -m http.server` on 127.0.0.1; `qkv serve` on 127.0.0.1 beside it",
        "",
        "```",
        header,
        "```",
        "",
        f"{n} round(s); each opens every page in a fresh browser context (no cache) and starts a "
        "fresh `qkv serve`, whose first request of a model includes loading it; the explorer on "
        "`qkv serve` is opened on each model after the site's page is closed and the same requests "
        "were posted (the model loaded there). Figures: median "
        "(best–worst); a verdict is the median's, with the rounds that met the target. Page times: "
        "in the page's clock, from navigation start (first view) or the click on Run to the first "
        "frame after the answer is drawn (\"of which the engine\": the in-page engine's answer alone, "
        "before drawing); `qkv serve`: from sending the same request (recorded from the page's "
        "engine, sent once the page is closed) to its parsed JSON answer. First view bytes: "
        "every file asked for until the saved answer came (Performance API `transferSize`); "
        "downloads with a first answer: the responses' `Content-Length` from the click to the answer.",
        "",
        "## Targets",
        "",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
    ]
    fv = [r["first_view"] for r in rounds if "error" not in r["first_view"]]
    lines.append(f"| first view painted (s) | {Row([x['seconds'] for x in fv], FIRST_VIEW_S).cell('{:.2f}')} "
                 f"| ≤ {FIRST_VIEW_S:g} s | {Row([x['seconds'] for x in fv], FIRST_VIEW_S).verdict()} |")
    fv_mb = Row([x["bytes"] / MB for x in fv], FIRST_VIEW_MB)
    lines.append(f"| first view downloaded (MB) | {fv_mb.cell('{:.2f}')} | ≤ {FIRST_VIEW_MB:g} MB | {fv_mb.verdict()} |")
    outside = sorted({u for r in rounds for u in r.get("outside", [])})
    lines.append(f"| requests outside the site's origin | {len(outside)} | 0 | "
                 f"{'met' if not outside else '**not met**: ' + ', '.join(outside[:5])} |")
    for m in args.models:
        ok = [r["models"][m] for r in rounds if "error" not in r["models"].get(m, {"error": 1})]
        failed = [r["models"][m]["error"] for r in rounds if "error" in r["models"].get(m, {"error": "not run"})]
        if failed:
            lines.append(f"| {m}: failed rounds | {len(failed)}/{n}: {failed[0][:160]} | none | **not met** |")
        first = Row([x["first"]["seconds"] for x in ok], FIRST_ANSWER_S)
        lines.append(f"| {m}: first answer with its download (s) | {first.cell('{:.2f}')} | ≤ {FIRST_ANSWER_S:g} s | {first.verdict()} |")
        said = [x for x in ok if "MB" in x["label"] and any("MB" in s for s in x["first"]["status"])]
        lines.append(f"| {m}: size said before the download | menu: {_said_mb(ok[0]['label']) if ok else '–'}; "
                     f"status: {_said_mb(next((s for s in ok[0]['first']['status'] if 'MB' in s), '')) if ok else '–'} "
                     f"| said | {'met' if ok and len(said) == len(ok) else '**not met**'} ({len(said)}/{len(ok)} rounds) |")
        toks = max((len(x["second"]["tokens"]) for x in ok), default=0)
        nxt = Row([x["second"]["seconds"] for x in ok], NEXT_S)
        lines.append(f"| {m}: a new sentence ({toks} tokens) after that (s) | {nxt.cell('{:.2f}')} | ≤ {NEXT_S:g} s "
                     f"| {nxt.verdict() if toks <= NEXT_TOKENS else '**not met** (over 20 tokens)'} |")
        peer = Row([x["second"]["seconds"] / x["served_second"]["seconds"] for x in ok], NEXT_RATIO)
        lines.append(f"| {m}: that sentence, page / the explorer on `qkv serve` (click to painted, both) "
                     f"| {peer.cell('{:.2f}×')} | ≤ {NEXT_RATIO:g}× | {peer.verdict()} |")
        peer = Row([x["page_warm"] / x["served_warm"] for x in ok], NEXT_RATIO)
        lines.append(f"| {m}: the same, both pages warmed (best of {WARM} more) "
                     f"| {peer.cell('{:.2f}×')} | ≤ {NEXT_RATIO:g}× | {peer.verdict()} |")
        ratio = Row([x["second"]["seconds"] / x["server_second"] for x in ok], NEXT_RATIO)
        lines.append(f"| {m}: that sentence, page (click to painted) / `qkv serve`'s HTTP answer alone "
                     f"| {ratio.cell('{:.2f}×')} | ≤ {NEXT_RATIO:g}× | {ratio.verdict()} |")
        warm = Row([x["second"]["seconds"] / x["server_warm"] for x in ok], NEXT_RATIO)
        lines.append(f"| {m}: the same, `qkv serve`'s answer warmed (best of {WARM} more) | "
                     f"{warm.cell('{:.2f}×')} | ≤ {NEXT_RATIO:g}× | {warm.verdict()} |")
    lines.append(f"| the whole site (MB) | {total / MB:.1f} | ≤ {SITE_MB:g} MB | {'met' if total <= SITE_MB * MB else '**not met**'} |")
    lines.append(f"| its largest file (MB) | {largest / MB:.1f} (`{largest_name}`) | ≤ {FILE_MB:g} MB "
                 f"| {'met' if largest <= FILE_MB * MB else '**not met**'} |")
    lines += [
        "",
        "## Per model (medians)",
        "",
        "| model | menu says | downloaded with the first answer | first answer: page | `qkv serve` (its load included) "
        "| page / server | next sentence: tokens | page | of which the engine | `qkv serve`'s HTTP answer | page / server "
        f"| engine / server | `qkv serve` warmed (best of {WARM} more) | same tokens and translation as the server |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    med = statistics.median
    for m in args.models:
        ok = [r["models"][m] for r in rounds if "error" not in r["models"].get(m, {"error": 1})]
        if not ok:
            lines.append(f"| {m} | failed in every round |" + " |" * 12)
            continue
        got = med([sum(b for _, b in x["first"]["got"]) for x in ok]) / MB
        lines.append(
            f"| {m} | {ok[0]['label']} | {got:.1f} MB | {med([x['first']['seconds'] for x in ok]):.2f} s "
            f"| {med([x['server_first'] for x in ok]):.2f} s "
            f"| {med([x['first']['seconds'] / x['server_first'] for x in ok]):.2f}× "
            f"| {len(ok[0]['first']['tokens'])}, {len(ok[0]['second']['tokens'])} "
            f"| {med([x['second']['seconds'] for x in ok]):.3f} s | {med([x['second']['engine_s'] for x in ok]):.3f} s "
            f"| {med([x['server_second'] for x in ok]):.3f} s "
            f"| {med([x['second']['seconds'] / x['server_second'] for x in ok]):.2f}× "
            f"| {med([x['second']['engine_s'] / x['server_second'] for x in ok]):.2f}× "
            f"| {med([x['server_warm'] for x in ok]):.3f} s "
            f"| {sum(x['same'] for x in ok)}/{len(ok)} rounds |"
        )
    lines += [
        "",
        "## The site's page against the explorer on `qkv serve` (medians)",
        "",
        "The same front-end files, the same request, from the click on Run to the first frame "
        "after the maps are drawn: the site's page computes the answer in the page, the served "
        "page asks `qkv serve` over HTTP (its model already loaded by the requests above).",
        "",
        "| model | tokens | site's page | of which its engine | explorer on `qkv serve` | page / served page "
        f"| site's page warmed (best of {WARM} more) | served page warmed | page / served page, warmed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.models:
        ok = [r["models"][m] for r in rounds if "error" not in r["models"].get(m, {"error": 1})]
        if ok:
            lines.append(
                f"| {m} | {len(ok[0]['second']['tokens'])} | {med([x['second']['seconds'] for x in ok]):.3f} s "
                f"| {med([x['second']['engine_s'] for x in ok]):.3f} s "
                f"| {med([x['served_second']['seconds'] for x in ok]):.3f} s "
                f"| {med([x['second']['seconds'] / x['served_second']['seconds'] for x in ok]):.2f}× "
                f"| {med([x['page_warm'] for x in ok]):.3f} s | {med([x['served_warm'] for x in ok]):.3f} s "
                f"| {med([x['page_warm'] / x['served_warm'] for x in ok]):.2f}× |"
            )
    lines += ["", "Sentences: " + "; ".join(f"{k}: “{a}”, “{b}”" for k, (a, b) in SENTENCES.items())
              + ". Tokens: the answer's `tokens` (a translator's source with `</s>`).", "",
              "## Every round", "", "| round | first view | " + " | ".join(args.models) + " |",
              "|---|---|" + "---|" * len(args.models)]  # fmt: skip
    for i, r in enumerate(rounds, 1):
        f = r["first_view"]
        cells = [f"error: {f['error'][:100]}" if "error" in f else f"{f['seconds']:.2f} s, {f['bytes'] / MB:.2f} MB"]
        for m in args.models:
            x = r["models"].get(m, {"error": "not run"})
            cells.append(f"error: {x['error'][:100]}" if "error" in x else
                         f"first {x['first']['seconds']:.2f} s / serve {x['server_first']:.2f} s; "
                         f"next {x['second']['seconds']:.3f} s / serve {x['server_second']:.3f} s "
                         f"(warmed {x['server_warm']:.3f} s); served page {x['served_second']['seconds']:.3f} s; "
                         f"warmed: page {x['page_warm']:.3f} s, served page {x['served_warm']:.3f} s")  # fmt: skip
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, help="a site built by qkv web build (default: build one)")
    p.add_argument("--models", default=",".join(MODELS), help="models to measure, from " + ",".join(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    args.argv = argv
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if not names or bad or len(set(names)) != len(names):
        p.error(f"--models must name models from {','.join(MODELS)}, each once, got {args.models!r}")
    args.models = names
    if args.rounds < 1:
        p.error(f"--rounds must be ≥ 1, got {args.rounds}")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: its folder {args.out.parent} does not exist")
    if args.site is not None:
        meta = args.site / "site.json"
        if not meta.is_file():
            p.error(f"--site must be a folder qkv web build wrote (with site.json), got {args.site}")
        runs = {m["name"] for m in json.loads(meta.read_text())["models"] if m.get("bytes") is not None}
        if missing := [m for m in names if m not in runs]:
            p.error(f"--site {args.site} cannot run {missing} in the page (built without them or "
                    "without the engine); it runs: " + (",".join(sorted(runs)) or "none"))  # fmt: skip
    if not os.path.exists(CHROMIUM):
        p.error(f"{CHROMIUM} is not installed (scripts/setup-system.sh installs it)")
    return args


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # a stop (SIGTERM) unwinds like Ctrl-C: every server and the browser are stopped
    signal.signal(signal.SIGTERM, _interrupted)
    started_at = datetime.now(UTC)
    load0 = os.getloadavg()[0]
    header = machine_header()
    print(header, flush=True)
    tmp = None
    try:
        built_s = None
        site = args.site
        if site is None:
            tmp = Path(tempfile.mkdtemp(prefix="qkv-web-bench-"))
            site = tmp / "site"
            print(f"building the site ({','.join(args.models)}) …", flush=True)
            built_s = build(site, args.models)
            print(f"built in {built_s:.0f} s", flush=True)
        rounds = []
        with site_server(site) as url, chromium() as browser:
            version = browser.version
            for i in range(args.rounds):
                r: dict = {"models": {}, "outside": []}
                with qkv_serve() as port:
                    try:
                        r["first_view"] = first_view(browser, url)
                        r["outside"] += r["first_view"]["outside"]
                    except Exception as e:  # noqa: BLE001 — said in the results
                        r["first_view"] = {"error": f"{type(e).__name__}: {e}"}
                    for m in args.models:
                        try:
                            r["models"][m] = model_round(browser, url, port, m)
                            r["outside"] += r["models"][m]["outside"]
                        except Exception as e:  # noqa: BLE001 — said in the results
                            r["models"][m] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                        x = r["models"][m]
                        print(f"round {i + 1} {m}: " + (x["error"] if "error" in x else
                              f"first {x['first']['seconds']:.2f} s (serve {x['server_first']:.2f} s), "
                              f"next {x['second']['seconds']:.3f} s (serve {x['server_second']:.3f} s, "
                              f"warmed {x['server_warm']:.3f} s), served page {x['served_second']['seconds']:.3f} s; "
                              f"warmed: page {x['page_warm']:.3f} s, served page {x['served_warm']:.3f} s"),
                              flush=True)  # fmt: skip
                rounds.append(r)
        text = report(args, rounds, site, built_s, header, version, started_at, (load0, os.getloadavg()[0]))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
