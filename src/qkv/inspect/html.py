"""A self-contained interactive HTML viewer: head view, model view, alignment, head statistics.

One file, no network: CSS and JS inline, the maps as JSON inside a
``<script type="application/json">`` with ``<``, ``>``, ``&`` escaped as ``\\u003c``…, so a token
like ``</script>`` cannot break out; the page puts token text on screen with ``textContent``
only, so ``<script>alert(1)</script>`` shows as text.

Views:

* **head view**: a line from each query token (left) to each key token (right) per selected
  head, ``stroke-opacity`` = weight, one colour per head; a layer selector; hovering a token
  keeps only its lines. Lines carry ``data-layer data-head data-q data-k data-w``.
* **model view**: a thumbnail per layer × head; click one to open it in the head view.
* **alignment view**: the ``(Tq, Tk)`` matrix of the layer (cross-attention: target × source),
  cells ``rect.cell`` with ``data-q data-k data-w`` and ``fill-opacity`` = weight.
* side panel: :func:`~qkv.capture.stats.head_stats` of the layer's heads.
* a step selector when decoding steps are given (attention at each step over the KV cache).
* **Download** (SVG, PNG, JSON, CSV) of what the view shows: the explorer's own
  ``export.js`` (``qkv serve``'s package data, inlined), so the files are the explorer's. The
  head view's picture has the heads ticked; the alignment view's is the matrix it draws, the
  mean of the heads ticked (``"head": "0+2"`` in the JSON and CSV when there are several).
  Heads have the explorer's colours on screen and in the files.

>>> write_html(maps, "attention.html", steps=capture_steps(...))  # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

from qkv.atomic import atomic_write_text
from qkv.capture.maps import AttentionMaps, merge_steps
from qkv.capture.page import static_text
from qkv.capture.stats import head_stats

__all__ = ["render_html", "write_html"]


def _json_for_script(data: object) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>``, ``&`` or JS line separators left raw."""
    s = json.dumps(data, ensure_ascii=False, allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        s = s.replace(ch, esc)
    return s


def render_html(
    maps: AttentionMaps | None = None,
    *,
    steps: list[AttentionMaps] | None = None,
    title: str = "qkv attention",
    decimals: int = 4,
) -> str:
    """The page as a string. Give ``maps`` (one pass), ``steps`` (decoding), or both."""
    if maps is None and not steps:
        raise ValueError("give maps= or steps=")
    whole = maps if maps is not None else merge_steps(steps)
    views = [whole.to_dict(decimals)]
    if steps and len(steps) > 1:
        views += [s.to_dict(decimals) for s in steps]
    data = {
        "title": title,
        "views": views,
        "view_names": ["whole sequence"]
        + [f"decoding step {s.step}" for s in (steps or [])][: len(views) - 1],
        "stats": [s.to_dict() for s in head_stats(whole)],
    }
    export_js = static_text("export.js")  # the explorer's downloads, as they are
    if re.search(r"</script", export_js, re.I):
        raise ValueError("export.js must not contain </script")
    fill = {"__TITLE__": html.escape(title), "__DATA__": _json_for_script(data),
            "__EXPORT_CSS__": static_text("export.css"), "__EXPORT_JS__": export_js}  # fmt: skip
    return re.sub("__TITLE__|__DATA__|__EXPORT_CSS__|__EXPORT_JS__", lambda m: fill[m.group()],
                  _TEMPLATE)  # one pass: nothing filled in is read again  # fmt: skip


def write_html(
    maps: AttentionMaps | None, path: str | os.PathLike, **kwargs
) -> Path:  # fmt: skip
    """Write :func:`render_html` to ``path`` (temporary file, then rename)."""
    path = Path(path)
    page = render_html(maps, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, page)


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>__TITLE__</title>
<style>
body{font-family:"Noto Sans","Noto Sans Myanmar","Noto Sans Bengali","Noto Sans CJK SC",sans-serif;margin:0;display:flex;color:#222}
main{flex:1;padding:12px;overflow:auto} aside{width:360px;padding:12px;background:#f6f6f6;font-size:12px;overflow:auto}
.bar{margin-bottom:8px;display:flex;gap:8px;flex-wrap:wrap;align-items:center}
.tab{border:1px solid #888;background:#fff;padding:3px 10px;cursor:pointer}.tab.on{background:#333;color:#fff}
.hchk{display:inline-flex;align-items:center;gap:2px;font-size:12px}
text.tok{font-size:13px;cursor:pointer} text.tok.hl{font-weight:bold}
#model-view{display:grid;gap:6px} canvas.thumb{border:1px solid #ccc;cursor:pointer;width:72px;height:72px;image-rendering:pixelated}
table{border-collapse:collapse} td,th{padding:2px 5px;border-bottom:1px solid #ddd;text-align:right}
.hidden{display:none !important}
__EXPORT_CSS__
</style></head><body>
<main>
<div id="downloads"></div>
<h3 id="title"></h3>
<div class="bar">
 <button class="tab on" id="tab-head" data-view="head">head view</button>
 <button class="tab" id="tab-model" data-view="model">model view</button>
 <button class="tab" id="tab-align" data-view="align">alignment</button>
 <label>step <select id="step"></select></label>
 <label>layer <select id="layer"></select></label>
 <span id="heads"></span>
</div>
<svg id="head-view" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="model-view" class="hidden"></div>
<svg id="align-view" class="hidden" xmlns="http://www.w3.org/2000/svg"></svg>
</main>
<aside><b>head statistics</b> <span id="stats-layer"></span>
<table id="stats"><thead><tr><th>head</th><th>entropy</th><th>dist</th><th>prev</th><th>next</th><th>self</th><th>first</th><th>punct</th></tr></thead><tbody></tbody></table>
<p>entropy in nats; dist = mean |query − key| positions; prev/next/self/first = mean weight on
the previous, next, same and first token; punct = on punctuation and special tokens.</p></aside>
<script type="application/json" id="qkv-data">__DATA__</script>
<script>__EXPORT_JS__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("qkv-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const S = {view: "head", step: 0, layer: 0, heads: null, hover: null};
const $ = (id) => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const L = () => D.views[S.step].layers[S.layer];
const COLORS = window.qkvExport.HEAD_COLORS;  // export.js's: the files' colours
const colour = (hi) => COLORS[hi % COLORS.length];
function fillSelect(sel, names, value) {
  sel.replaceChildren(...names.map((n, i) => { const o = document.createElement("option");
    o.value = i; o.textContent = n; return o; }));
  sel.value = value;
}
function setup() {
  $("title").textContent = D.title;
  fillSelect($("step"), D.view_names, 0);
  $("step").parentElement.classList.toggle("hidden", D.views.length < 2);
  $("step").onchange = () => { S.step = +$("step").value; S.layer = 0; S.heads = null; layers(); };
  $("layer").onchange = () => { S.layer = +$("layer").value; S.heads = null; S.hover = null; draw(); };
  document.querySelectorAll(".tab").forEach((b) => b.onclick = () => show(b.dataset.view));
  layers();
}
function layers() {
  const ls = D.views[S.step].layers;
  fillSelect($("layer"), ls.map((l) => `${l.name} (${l.kind})`), S.layer);
  draw();
}
function show(view) {
  S.view = view;
  const cross = D.views[S.step].layers.findIndex((l) => l.kind === "cross");
  if (view === "align" && L().kind !== "cross" && cross >= 0) {
    S.layer = cross; S.heads = null; $("layer").value = cross; }
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("on", b.dataset.view === view));
  $("head-view").classList.toggle("hidden", view !== "head");
  $("model-view").classList.toggle("hidden", view !== "model");
  $("align-view").classList.toggle("hidden", view !== "align");
  draw();
}
function headBoxes() {
  const l = L();
  if (S.heads === null) S.heads = new Set(l.heads);
  $("heads").replaceChildren(...l.heads.map((h) => {
    const lab = document.createElement("label"); lab.className = "hchk";
    const c = document.createElement("input"); c.type = "checkbox"; c.checked = S.heads.has(h);
    c.dataset.head = h; c.className = "head-toggle";
    c.onchange = () => { c.checked ? S.heads.add(h) : S.heads.delete(h); draw(); };
    const sw = document.createElement("span"); sw.textContent = "■ h" + h;
    sw.style.color = colour(l.heads.indexOf(h));
    lab.append(c, sw); return lab; }));
}
function drawHead() {
  const l = L(), svg = $("head-view"), rowH = 22, x0 = 160, x1 = 460;
  const n = Math.max(l.q_tokens.length, l.k_tokens.length);
  svg.setAttribute("width", 640); svg.setAttribute("height", 30 + n * rowH);
  svg.replaceChildren();
  const y = (i) => 30 + i * rowH;
  l.heads.forEach((h, hi) => {
    if (!S.heads.has(h)) return;
    l.weights[hi].forEach((row, q) => row.forEach((w, k) => {
      if (w <= 0) return;
      svg.append(el("line", {class: "attn", x1: x0 + 6, y1: y(q) - 4, x2: x1 - 6, y2: y(k) - 4,
        stroke: colour(hi), "stroke-width": 2, "stroke-opacity": w,
        "data-layer": S.layer, "data-head": h, "data-q": q, "data-k": k, "data-w": w,
        visibility: "visible"}));
    }));
  });
  const tok = (side, i, t, x, anchor) => {
    const e = el("text", {class: "tok tok-" + side, x, y: y(i), "text-anchor": anchor,
      "data-i": i}, t);
    e.addEventListener("mouseenter", () => setHover({side, i}));
    e.addEventListener("mouseleave", () => setHover(null));
    svg.append(e);
  };
  l.q_tokens.forEach((t, i) => tok("q", i, t, x0, "end"));
  l.k_tokens.forEach((t, i) => tok("k", i, t, x1, "start"));
  svg.append(el("text", {x: x0, y: 14, "text-anchor": "end", "font-size": 11}, "query"));
  svg.append(el("text", {x: x1, y: 14, "font-size": 11}, "key"));
  setHover(S.hover);
}
function setHover(hv) {  // hover a token: keep only its lines (no redraw, elements stay)
  S.hover = hv;
  const svg = $("head-view");
  svg.querySelectorAll("line.attn").forEach((ln) => {
    const show = !hv || +(hv.side === "q" ? ln.dataset.q : ln.dataset.k) === hv.i;
    ln.setAttribute("visibility", show ? "visible" : "hidden"); });
  svg.querySelectorAll("text.tok").forEach((t) => t.classList.toggle("hl",
    !!hv && t.classList.contains("tok-" + hv.side) && +t.dataset.i === hv.i));
}
function drawModel() {
  const ls = D.views[S.step].layers, box = $("model-view");
  const cols = Math.max(...ls.map((l) => l.heads.length));
  box.style.gridTemplateColumns = `160px repeat(${cols}, 76px)`;
  box.replaceChildren();
  ls.forEach((l, li) => {
    const name = document.createElement("div"); name.textContent = l.name + " (" + l.kind + ")";
    name.style.fontSize = "11px"; box.append(name);
    l.heads.forEach((h, hi) => {
      const w = l.weights[hi], c = document.createElement("canvas");
      c.className = "thumb"; c.width = w[0].length; c.height = w.length;
      c.dataset.layer = li; c.dataset.head = h; c.title = `${l.name} head ${h}`;
      const ctx = c.getContext("2d"), img = ctx.createImageData(c.width, c.height);
      w.forEach((row, q) => row.forEach((v, k) => { const p = 4 * (q * c.width + k);
        img.data[p] = 255 - 200 * v; img.data[p + 1] = 255 - 180 * v; img.data[p + 2] = 255 - 60 * v;
        img.data[p + 3] = 255; }));
      ctx.putImageData(img, 0, 0);
      c.onclick = () => { S.layer = li; S.heads = new Set([h]); $("layer").value = li; show("head"); };
      box.append(c);
    });
    for (let i = l.heads.length; i < cols; i++) box.append(document.createElement("div"));
  });
}
function drawAlign() {
  const l = L(), svg = $("align-view"), cw = 34, x0 = 150, y0 = 110;
  const on = l.heads.map((h, hi) => hi).filter((hi) => S.heads.has(l.heads[hi]));
  svg.setAttribute("width", x0 + cw * l.k_tokens.length + 20);
  svg.setAttribute("height", y0 + cw * l.q_tokens.length + 20);
  svg.replaceChildren();
  l.q_tokens.forEach((t, q) => {
    svg.append(el("text", {class: "tok tok-q", x: x0 - 6, y: y0 + cw * q + cw / 2 + 4,
      "text-anchor": "end", "data-i": q}, t));
    l.k_tokens.forEach((_, k) => {
      const w = on.length ? on.reduce((s, hi) => s + l.weights[hi][q][k], 0) / on.length : 0;
      svg.append(el("rect", {class: "cell", x: x0 + cw * k, y: y0 + cw * q, width: cw - 2,
        height: cw - 2, fill: "#1f4e9c", "fill-opacity": w, "data-q": q, "data-k": k,
        "data-w": w}));
    });
  });
  l.k_tokens.forEach((t, k) => { const x = x0 + cw * k + cw / 2, yy = y0 - 6;
    svg.append(el("text", {class: "tok tok-k", x, y: yy, transform: `rotate(-60 ${x} ${yy})`,
      "data-i": k}, t)); });
}
function drawStats() {
  const l = D.views[0].layers.find((x) => x.name === L().name) ? L().name : null;
  $("stats-layer").textContent = l ? "— " + l : "";
  const f = (v) => v === null ? "–" : v.toFixed(2);
  $("stats").tBodies[0].replaceChildren(...D.stats.filter((s) => s.layer === l).map((s) => {
    const tr = document.createElement("tr"); tr.dataset.head = s.head;
    for (const v of [String(s.head), f(s.entropy), f(s.distance), f(s.prev), f(s.next),
                     f(s.self), f(s.first), f(s.punct)]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td); }
    return tr; }));
}
// the explorer's download buttons (export.js) for what this view draws: its S-like state
function downloads() {
  const ls = D.views[S.step].layers, l = L(), on = l.heads.filter((h) => S.heads.has(h));
  let layer = l, head = on.length ? on[0] : l.heads[0];
  if (S.view === "align" && on.length > 1) {  // the mean of the heads ticked, as drawn
    head = on.join("+");
    const w = l.weights.filter((_, hi) => S.heads.has(l.heads[hi]));
    const mean = w[0].map((row, q) => row.map((_, k) =>
      Math.round(1e4 * w.reduce((s, m) => s + m[q][k], 0) / w.length) / 1e4));
    layer = Object.assign({}, l, {heads: [head], weights: [mean]});
  }
  const data = {model: "", text: D.title, tokens: ls[0].k_tokens,
                layers: ls.map((x) => (x === l ? layer : x))};
  const state = {data, view: S.view, layer: l.name, head, heads: new Set(on),
                 pinned: null, off: new Set(), step: 0};
  const box = $("downloads"); box.replaceChildren();
  window.qkvExport.attach(box, {S: state});
}
function draw() {
  headBoxes(); drawStats();
  if (S.view === "head") drawHead(); else if (S.view === "model") drawModel(); else drawAlign();
  downloads();
}
setup();
document.body.dataset.ready = "1";
</script></body></html>
"""
