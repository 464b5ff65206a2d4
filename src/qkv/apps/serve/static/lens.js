// qkv explorer: the Lens view. What each layer of a decoder would predict (logit lens: the
// residual stream after each layer through the final norm and unembedding) and what each head
// writes toward the prediction (direct logit attribution), beside the head's attention map.
// Its numbers come from the engine's lens() (engine.js; qkv serve: POST /api/lens,
// qkv.apps.serve.compute_lens), asked when the view is shown, for the text, model, translation
// and heads off of the answer on screen (S.data).
// A long text (up to 2,048 positions) shows a window of WINDOW positions as the table, under
// a canvas strip of every position: a table of them all would be thousands of cells a layer.
// Tokens are data: only textContent shows them, never innerHTML.
"use strict";
(() => {
  const TOP_K = 5;
  const WINDOW = 20; // positions in a long text's table (about a screen's width of tokens)

  function create(ctx) {
    // LONG_ROWS: more positions than this (a long answer's), the table is a window
    const { S, el, t, elt, data, heatmap, short, viewWidth, fmt, selectHead, renderView, showTip, hideTip, weightsOf, LONG_ROWS, engine } = ctx;
    const { seq, seqRGB, div } = window.qkvExport;
    const Maps = window.qkvMaps;
    let got = { key: null, d: null, err: null }; // the last lens answer and what it was for
    let position = null; // the attributed position; null: the last
    let base = null; // the request without its position: another text or model resets it
    let win = null; // a long text's window: its first position; null: around the attributed one

    // the lens applies to a decoder (a translation, not the random toy's, or causal maps
    // only) on qkv serve: the offline page cannot run the model
    const applies = (d) => !S.offline && !!d && !d.random && (d.translation ? true : (d.layers || []).length > 0 && d.layers.every((l) => l.kind === "causal"));

    function request(pos) {
      const d = S.data, tr = d.translation;
      const body = { text: d.text, model: d.model, translate: !!tr, beam: tr ? tr.beam : 1,
        ablate: d.ablation ? d.ablation.heads : [], top_k: TOP_K };
      if (pos !== null) body.position = pos;
      return body;
    }
    async function load(body, key) {
      try {
        const d = await engine.lens(body);
        if (got.key !== key) return; // a newer request took its place
        got.d = d; S.lens = d;
      } catch (err) { // an EngineError: the server's message (or its status), or why no answer came
        if (got.key !== key) return;
        got.err = err.status ? err.message || t("error.status", { status: err.status }) : String(err);
      }
      if (S.view === "lens") renderView();
    }

    // a layer's row label: "embeddings" in the reader's words, block names as they are
    const rowName = (name) => (name === "embeddings" ? t("lens.embeddings") : short(name));
    // a cell naming a part of the attribution other than a head, in the reader's words
    function partName(name) {
      if (name.endsWith(" bias") && !name.startsWith("final ")) return elt("td", "", "lens.bias", { layer: short(name.slice(0, -5)) });
      if (name.endsWith(" mlp")) return elt("td", "", "lens.mlp", { layer: short(name.slice(0, -4)) });
      return el("td", "", t(name === "embeddings" ? "lens.embeddings" : "lens.finalBias"));
    }

    function render(root) {
      const state = (s) => { root.dataset.state = s; };
      if (S.offline) { root.append(el("p", "intro", t("lens.offline"))); return state("offline"); }
      if (!applies(S.data)) { root.append(el("p", "intro", t("lens.notApplicable"))); return state("none"); }
      const b = JSON.stringify(request(null));
      if (b !== base) { base = b; position = null; win = null; }
      const body = request(position), key = JSON.stringify(body);
      if (got.key !== key) { got = { key, d: null, err: null }; S.lens = null; load(body, key); }
      if (got.err) { root.append(elt("p", "err", "lens.error", { err: got.err })); return state("error"); }
      if (!got.d) { root.append(el("p", "intro", t("lens.loading"))); return state("loading"); }
      const d = got.d;
      root.append(el("p", "intro", t("lens.intro", { k: d.lens.top_k })));
      if (d.truncated) root.append(el("p", "hint", t("lens.cut", { n: d.tokens.length })));
      root.append(table(d));
      root.append(attribution(d));
      state("ready");
    }

    // layers × positions: each cell the lens's top token (colour: its probability); hover: top k.
    // A long text: the window's positions, under the strip of all of them and a slider
    function table(d) {
      const c = el("div", "card lens-card"); c.id = "lens-table";
      c.append(el("h3", "", t("lens.tableTitle")));
      const n = d.tokens.length, wrap = el("div", "lens-wrap");
      S.lensWindow = null; // (what the downloads draw of a long text)
      if (n <= LONG_ROWS) wrap.append(grid(d, d.tokens.map((_, j) => j)));
      else {
        const strip = el("div", "lens-strip"), bar = el("div", "row2 win-bar"), lab = el("span");
        const sl = el("input"); sl.type = "range"; sl.id = "lens-win"; sl.min = 0; sl.max = n - WINDOW; sl.step = 1;
        sl.setAttribute("aria-label", t("lens.slider")); lab.id = "lens-win-label";
        // the window's parts are drawn again when it moves; the slider stays (it may be dragged)
        const show = (a) => {
          win = Math.max(0, Math.min(n - WINDOW, Math.round(a))); hideTip();
          S.lensWindow = [win, win + WINDOW];
          sl.value = win; lab.textContent = t("lens.window", { a: win, b: win + WINDOW - 1, n });
          strip.replaceChildren(el("p", "hint", t("lens.overview", { n })), overview(d, show));
          wrap.replaceChildren(grid(d, Array.from({ length: WINDOW }, (_, k) => win + k)));
        };
        sl.addEventListener("input", () => show(+sl.value));
        bar.append(sl, lab); c.append(strip, bar);
        show(win === null ? d.position - WINDOW / 2 : win);
      }
      c.append(wrap);
      const sc = el("div", "scale"), bar = el("canvas"); bar.width = 120; bar.height = 10;
      const g = bar.getContext("2d");
      for (let x = 0; x < 120; x++) { g.fillStyle = seq(x / 119); g.fillRect(x, 0, 1, 10); }
      sc.append(el("span", "", "0"), bar, el("span", "", "1"), el("span", "", t("lens.scale")));
      c.append(sc);
      return c;
    }
    // the table of positions js (a long text: with their numbers, far in it tokens do not say where)
    function grid(d, js) {
      const tb = el("table", "lens-table");
      if (d.tokens.length > LONG_ROWS) {
        const idx = el("tr", "idx"); idx.append(el("th"));
        for (const j of js) idx.append(el("th", "", j));
        tb.append(idx);
      }
      const head = el("tr"); head.append(el("th", "", t("lens.layer")));
      for (const j of js) {
        const th = data("th", j === d.position ? "pos sel" : "pos", d.tokens[j]);
        th.dataset.pos = j; th.title = t("lens.pickPosition"); th.addEventListener("click", () => pick(j));
        head.append(th);
      }
      tb.append(head);
      d.lens.layers.forEach((name, i) => {
        const tr = el("tr"); tr.dataset.layer = name;
        tr.append((name === "embeddings" ? el : data)("th", "", rowName(name)));
        for (const j of js) {
          const cell = d.lens.tokens[i][j], p = d.lens.probs[i][j][0];
          const td = data("td", j === d.position ? "sel" : "", cell[0]);
          td.style.background = seq(p); td.style.color = p > 0.6 ? "#fff" : "#1d2330";
          td.dataset.pos = j; td.dataset.p = p;
          td.addEventListener("mousemove", (ev) => showTip(ev, [t("lens.tip", { layer: rowName(name), token: d.tokens[j] }),
            ...cell.map((x, r) => `${r + 1}. ${x}  ${fmt(d.lens.probs[i][j][r])}`)].join("\n")));
          td.addEventListener("mouseleave", hideTip);
          td.addEventListener("click", () => pick(j));
          tr.append(td);
        }
        tb.append(tr);
      });
      return tb;
    }
    function pick(j) { if (position === j) return; position = j; hideTip(); renderView(); }

    // a long text: every layer × position on one canvas (a pixel: the highest top-token
    // probability under it), the table's window outlined and the attributed position marked;
    // hover: the top token of the cell under the pointer; click: show(a) moves the window there
    function overview(d, show) {
      const n = d.tokens.length, R = d.lens.layers.length;
      const top = new Float64Array(R * n);
      d.lens.probs.forEach((row, i) => row.forEach((p, j) => { top[i * n + j] = p[0]; }));
      const rh = Math.max(4, Math.min(12, Math.floor(120 / R))), W = Math.max(200, viewWidth() - 40), H = rh * R;
      const cv = el("canvas", "lens-overview"), dpr = window.devicePixelRatio || 1;
      cv.width = Math.round(W * dpr); cv.height = Math.round(H * dpr); cv.style.width = W + "px"; cv.style.height = H + "px";
      cv.dataset.positions = n;
      const g = cv.getContext("2d");
      Maps.paint(g, Maps.matrix(R, n, top), 0, 0, cv.width, cv.height, { prob: true, seqRGB });
      g.scale(dpr, dpr);
      const x = (j) => (j * W) / n;
      g.strokeStyle = "#e67700"; g.lineWidth = 2;
      g.strokeRect(x(win) + 1, 1, Math.max(2, x(win + WINDOW) - x(win) - 2), H - 2);
      g.fillStyle = "#111"; g.fillRect(Math.min(W - 2, x(d.position)), 0, 2, H);
      const at = (ev) => { const r = cv.getBoundingClientRect(); return [Math.floor(((ev.clientY - r.top) / r.height) * R), Math.floor(((ev.clientX - r.left) / r.width) * n)]; };
      cv.addEventListener("mousemove", (ev) => {
        const [i, j] = at(ev);
        if (i < 0 || j < 0 || i >= R || j >= n) return hideTip();
        showTip(ev, t("lens.overviewTip", { layer: rowName(d.lens.layers[i]), i: j, token: d.tokens[j], top: d.lens.tokens[i][j][0], p: fmt(d.lens.probs[i][j][0]) }));
      });
      cv.addEventListener("mouseleave", hideTip);
      cv.addEventListener("click", (ev) => show(at(ev)[1] - WINDOW / 2));
      return cv;
    }

    // the heads' direct effects on the predicted token, the selected head's tokens and its map
    function attribution(d) {
      const c = el("div", "card lens-card"); c.id = "lens-dla";
      c.append(el("h3", "", t("lens.dlaTitle")));
      c.append(elt("p", "", "lens.dlaIntro", { i: d.position, token: d.tokens[d.position], pred: d.predicted, logit: fmt(d.logit) }));
      if (!d.dla) { c.append(elt("p", "hint", "lens.unavailable", { why: d.dla_unavailable })); return c; }
      const heads = d.dla.heads, layers = [...new Set(heads.map((h) => h.layer))];
      const H = Math.max(...heads.map((h) => h.head)) + 1;
      const m = Math.max(1e-9, ...heads.map((h) => Math.abs(h.target)));
      const grid = el("table", "lens-heads"); grid.id = "lens-heads";
      grid.append(elt("caption", "", "lens.grid", { pred: d.predicted }));
      const hr = el("tr"); hr.append(el("th"));
      for (let h = 0; h < H; h++) hr.append(el("th", "", h));
      grid.append(hr);
      for (const name of layers) {
        const tr = el("tr"); tr.append(data("th", "", short(name)));
        for (let h = 0; h < H; h++) {
          const x = heads.find((y) => y.layer === name && y.head === h);
          const td = el("td", x && name === S.layer && h === S.head ? "sel" : "", x ? fmt(x.target) : "");
          if (x) {
            td.style.background = div(x.target, m); td.dataset.layer = name; td.dataset.head = h;
            td.title = t("lens.pickHead"); td.addEventListener("click", () => selectHead(name, h));
          }
          tr.append(td);
        }
        grid.append(tr);
      }
      const row = el("div", "row2 lens-row");
      row.append(grid);
      const sel = heads.find((h) => h.layer === S.layer && h.head === S.head);
      if (sel) row.append(pushes(sel, d), headMap(d));
      else row.append(el("p", "hint", t("lens.pickLayer")));
      c.append(row, others(d));
      c.append(elt("p", "hint", "lens.note", { check: d.dla.check }));
      return c;
    }
    function pushes(h, d) {
      const box = el("div", "lens-push"); box.id = "lens-push";
      box.append(elt("h4", "", "lens.headTitle", { layer: short(h.layer), head: h.head }));
      box.append(elt("p", "hint", "lens.target", { pred: d.predicted, v: fmt(h.target) }));
      const m = Math.max(1e-9, ...[...h.up, ...h.down].map(([, v]) => Math.abs(v)));
      for (const [key, list] of [["lens.up", h.up], ["lens.down", h.down]]) {
        const bars = el("div", "bars"); bars.dataset.dir = key.slice(5);
        bars.append(el("div", "hint", t(key)));
        for (const [tok, v] of list) {
          const r = el("div"), bar = el("span", "bar"); bar.style.width = Math.round(120 * Math.abs(v) / m) + "px";
          if (v < 0) bar.style.background = "#c92a2a";
          r.append(data("span", "t", tok), bar, el("span", "num", fmt(v))); bars.append(r);
        }
        box.append(bars);
      }
      return box;
    }
    function headMap(d) { // the head's weights, the attributed position's row outlined
      const box = el("div", "lens-map");
      const L = (S.data.layers || []).find((l) => l.name === S.layer);
      // a long answer's maps are pooled: its selected head is exact (asked for when selected)
      const w = L && L.heads.includes(S.head) ? weightsOf(S.data, L, S.head) : null;
      if (!w || d.position >= L.q_tokens.length) return box;
      box.append(elt("h4", "", "lens.mapTitle", { i: d.position }));
      box.append(heatmap(w, L.q_tokens, L.k_tokens, { maxWidth: Math.min(420, viewWidth() - 420), prob: true, highlightRow: d.position }));
      return box;
    }
    function others(d) { // embeddings, biases, MLPs: their direct effect on the predicted token
      const tb = el("table", "probe lens-others");
      tb.append(elt("caption", "", "lens.others", { pred: d.predicted }));
      for (const o of d.dla.others) {
        const tr = el("tr"); tr.append(partName(o.name), el("td", "", fmt(o.target))); tb.append(tr);
      }
      return tb;
    }

    return { render, applies };
  }
  window.qkvLens = { create };
})();
