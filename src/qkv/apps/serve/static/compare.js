// qkv explorer: compare. Sentence A (the text field) beside sentence B (another sentence, or
// the same one with the heads switched off in "Heads at work") in every view, with B − A of the
// selected layer and head; and the page's state in its address (history.replaceState), so that
// a link reopens the comparison. app.js asks the engine for B as for A (engine.js; qkv serve:
// POST /api/attention, whose limits and checks apply to B as they do to A) and calls
// create(...)'s functions from its views. Tokens and sentences are data: textContent and
// canvas text only, never markup.
// The offline page (qkv view, notebooks) runs no model: it does not offer compare.
"use strict";
(() => {
  const MAX_URL = 8000; // characters of the address's query (a server refuses long request lines)
  const MAX_HASH = 200000; // characters of its #fragment, which holds longer texts (never sent)
  const MAX_TEXT = 20000; // characters of a text taken from a link (the server's MAX_TEXT_CHARS)
  const MAX_OFF = 512; // heads switched off taken from a link (the server's MAX_ABLATE)
  const DECIMALS = 1000; // B − A of two answers with 3 decimals: 3 decimals

  function create(app) {
    const { S, $, el, t, elt, data, heatmap, viewWidth } = app;
    const { div } = window.qkvExport;
    // on, mode "text" (B: the second text field) or "off" (B: A's text, S.off switched off; A:
    // all heads on); the last bodies sent; B's answer or its error
    const C = { on: false, mode: "text", sentA: null, sentB: null, dataB: null, errB: null, tooLong: false };

    const on = () => !S.offline && C.on;
    const offList = () => [...S.off].map((k) => { const i = k.lastIndexOf("|"); return [k.slice(0, i), +k.slice(i + 1)]; });
    const layerIn = (d, name) => (d ? d.layers.find((l) => l.name === name) : undefined);
    const tag = (side) => el("span", "side-tag " + side, side === "diff" ? "B − A" : side.toUpperCase());

    // ---------- the controls ----------
    function bar() {
      if (S.offline) return;
      $("#compare").checked = C.on;
      $("#compare-bar").hidden = !C.on;
      $("#a-tag").hidden = !C.on;
      document.body.classList.toggle("comparing", C.on);
      $("#cmp-text").checked = C.mode === "text"; $("#cmp-off").checked = C.mode === "off";
      $("#text2").disabled = C.mode !== "text";
      $("#off-count").textContent = t("compare.offCount", { n: S.off.size });
      const hint = C.mode === "text" && !$("#text2").value.trim() ? "compare.needText2" : C.mode === "off" && !S.off.size ? "compare.noneOff" : "";
      $("#compare-hint").textContent = hint ? t(hint) : "";
      $("#url-note").hidden = !C.tooLong;
    }
    function wire() {
      $("#compare").addEventListener("change", () => {
        C.on = $("#compare").checked;
        if (C.on && C.mode === "text" && !$("#text2").value.trim()) $("#text2").value = $("#text").value; // edit a word of A
        bar(); app.refresh();
      });
      for (const r of [$("#cmp-text"), $("#cmp-off")]) r.addEventListener("change", () => { C.mode = r.value; bar(); app.refresh(); });
      $("#text2").addEventListener("keydown", (e) => { if (e.key === "Enter") app.refresh(); });
      $("#text2").addEventListener("input", bar);
      bar();
    }

    // ---------- the two requests ----------
    // [A's body, B's body or null]: B is A's body with its own text, or A's heads off (and A
    // then has every head on)
    function requests(body) {
      let a = body, b = null;
      if (on() && C.mode === "text" && $("#text2").value.trim()) b = Object.assign({}, body, { text: $("#text2").value });
      else if (on() && C.mode === "off") { b = body; a = Object.assign({}, body, { ablate: [] }); }
      C.sentA = a; C.sentB = b;
      return [a, b];
    }
    // B's answer: {d}, {err} (engine.js's EngineError: status 0 when no answer came), or null
    // (not asked)
    function accept(res) {
      C.dataB = null; C.errB = null;
      if (!res) return;
      const err = res.err;
      if (err && !err.status) C.errB = t("error.request", { err });
      else if (err) C.errB = err.message || t("error.status", { status: err.status });
      else C.dataB = res.d;
    }
    // for the notice bar (app.js accept(), after S.data is the new answer)
    function notes() {
      if (!on()) return [];
      if (C.errB) return [["compare.errorB", { err: C.errB }]];
      const d = C.dataB, out = [];
      if (d && d.truncated) out.push(["compare.cutB", { n: d.tokens.length, limit: d.limit }]);
      if (d && S.data && d.tokens.length !== S.data.tokens.length) out.push(["compare.counts", { a: S.data.tokens.length, b: d.tokens.length }]);
      return out;
    }
    function status(d) {
      return on() && C.dataB ? ["compare.status", { a: d.tokens.length, b: C.dataB.tokens.length, ms: Math.round(d.elapsed_ms + C.dataB.elapsed_ms) }] : null;
    }

    // ---------- what the views show ----------
    // the line above each side: its tag and sentence, and which heads are on
    function sideHead(side) {
      const h = el("div", "side-head"); h.append(tag(side));
      const sent = side === "a" ? C.sentA : C.sentB;
      const text = sent ? sent.text : side === "a" ? $("#text").value : $("#text2").value;
      const txt = data("span", "txt", text); txt.title = text; // (cut to the width: all of it on hover)
      h.append(txt);
      if (C.mode === "off") h.append(el("span", "heads", side === "a" ? t("compare.allOn") : t("compare.headsOff", { n: (sent ? sent.ablate : offList()).length })));
      return h;
    }
    // why B has nothing to show: its error, no sentence B yet, or not there yet
    function missingB() {
      if (C.errB) return elt("p", "err", "compare.errorB", { err: C.errB });
      if (C.mode === "text" && !$("#text2").value.trim()) return el("p", "hint", t("compare.needText2"));
      return el("p", "hint", t("compare.loading"));
    }
    // A and B side by side: make(answer, "a" | "b") draws one side
    function pair(make) {
      const row = el("div", "cmp-pair");
      for (const side of ["a", "b"]) {
        const d = side === "a" ? S.data : C.dataB;
        const col = el("div", "cmp-side"); col.dataset.side = side;
        col.append(sideHead(side), d ? make(d, side) : missingB());
        row.append(col);
      }
      return row;
    }
    // B − A position by position (3 decimals); a label "a/b" where the two tokens differ. wa, wb:
    // the two heads' weights when not the JSON maps' (long answers: their exact heads, maps.js)
    function diffOf(A, B, head, wa, wb) {
      wa = wa || A.weights[Math.max(0, A.heads.indexOf(head))]; wb = wb || B.weights[Math.max(0, B.heads.indexOf(head))];
      const sub = (a, b) => (a === null || b === null ? null : Math.round((b - a) * DECIMALS) / DECIMALS);
      let values;
      if (wa.get) {
        const a = wa.data, b = wb.data, out = new Float64Array(a.length); // (the same shape: NaN is −∞)
        for (let k = 0; k < a.length; k++) out[k] = a[k] !== a[k] || b[k] !== b[k] ? NaN : Math.round((b[k] - a[k]) * DECIMALS) / DECIMALS;
        values = window.qkvMaps.matrix(wa.R, wa.C, out);
      } else values = wa.map((row, i) => row.map((a, j) => sub(a, wb[i][j])));
      const both = (x, y) => x.map((a, i) => (a === y[i] ? a : `${a}/${y[i]}`));
      return { values, rows: both(A.q_tokens, B.q_tokens), cols: both(A.k_tokens, B.k_tokens) };
    }
    const sameShape = (A, B) => A.q_tokens.length === B.q_tokens.length && A.k_tokens.length === B.k_tokens.length;
    const size = (L) => (L.q_tokens.length === L.k_tokens.length ? String(L.q_tokens.length) : `${L.q_tokens.length}×${L.k_tokens.length}`);
    function scaleNote(m) { // the difference's colours: blue (B lower), white (the same), red (B higher)
      const sc = el("div", "scale cmp-legend");
      const cv = el("canvas"); cv.width = 120; cv.height = 10;
      const g = cv.getContext("2d");
      for (let x = 0; x < 120; x++) { g.fillStyle = div((x / 119) * 2 * m - m, m); g.fillRect(x, 0, 1, 10); }
      sc.append(el("span", "", app.fmt(-m)), cv, el("span", "", app.fmt(m)), el("span", "", t("compare.legend")));
      return sc;
    }

    // A, B and B − A of one layer and head (default: the selected ones), with their downloads
    function card(name, head) {
      name = name || S.layer; head = head === undefined ? S.head : head;
      const c = el("div", "card cmp-card"); c.id = "compare-card"; c.dataset.layer = name; c.dataset.head = head;
      c.append(elt("h3", "", "compare.cardTitle", { layer: name, head }));
      const A = layerIn(S.data, name), B = layerIn(C.dataB, name);
      if (!A) return c;
      if (!B) { c.append(missingB()); return c; }
      const wa = app.weightsOf(S.data, A, head), wb = app.weightsOf(C.dataB, B, head); // (long answers: the exact heads)
      if (!wa || !wb) { c.append(el("p", "hint", t("compare.loading"))); return c; }
      const same = sameShape(A, B);
      if (!same) { const p = el("p", "cmp-counts", t("compare.counts", { a: size(A), b: size(B) })); p.id = "compare-counts"; c.append(p); }
      else c.append(el("p", "hint", t("compare.positions")));
      const w = Math.max(200, Math.floor((viewWidth() - 40) / (same ? 3 : 2)) - 24);
      const box = (side, values, rows, cols, prob) => {
        const b = el("div", "cmp-map"); b.dataset.which = side;
        const h = el("h4"); h.append(tag(side)); b.append(h, heatmap(values, rows, cols, { maxWidth: w, maxCell: 30, prob }));
        return b;
      };
      const maps = el("div", "cmp-maps");
      maps.append(box("a", wa, A.q_tokens, A.k_tokens, true), box("b", wb, B.q_tokens, B.k_tokens, true));
      c.append(maps);
      if (!same) return c;
      const df = diffOf(A, B, head, wa, wb);
      const d = box("diff", df.values, df.rows, df.cols, false);
      d.append(el("p", "hint", t("compare.legend")));
      maps.append(d);
      const ctx = { S: Object.assign({}, S, { view: "diff", layer: name, head, heads: new Set([head]), pinned: null }), t, short: app.short,
        diff: { a: A, b: B, head, values: df.values, rows: df.rows, cols: df.cols, textA: C.sentA.text, textB: C.sentB.text,
          offA: C.sentA.ablate, offB: C.sentB.ablate, tokensB: C.dataB.tokens } };
      if (!wa.get) window.qkvExport.attach(c, ctx); // SVG/PNG of A, B and B − A; JSON; CSV of B − A (≤ 128 tokens)
      return c;
    }

    // step by step: B's walk when it is for the selected layer and head
    function stepB() {
      const st = C.dataB && C.dataB.step;
      return on() && st && st.layer === S.layer && st.head === S.head ? st : null;
    }

    // model view: A's grid beside B's (B's switched-off heads dimmed), B − A of every head under them
    function model(root, grid) {
      const half = Math.floor((viewWidth() - 16) / 2);
      const offOf = (side) => (C.mode === "off" && side === "a" ? new Set() : S.off);
      root.append(pair((d, side) => grid(d.layers, { off: offOf(side), avail: half - 110, labW: 100 })));
      if (C.dataB) root.append(diffGrid(grid));
      root.append(card());
    }
    function diffGrid(grid) {
      const c = el("div", "card cmp-grid"); c.id = "compare-grid";
      let m = 0;
      const ls = S.data.layers.map((A) => {
        const B = layerIn(C.dataB, A.name);
        if (!B || !sameShape(A, B)) return Object.assign({}, A, { weights: A.heads.map(() => null), missing: t("compare.gridShape") });
        const ws = A.heads.map((h) => diffOf(A, B, h).values);
        for (const w of ws) for (const r of w) for (const v of r) if (v !== null) m = Math.max(m, Math.abs(v));
        return Object.assign({}, A, { weights: ws });
      });
      const rgb = new Map();
      const colour = (v) => { // "#rrggbb" of export.js's div() as [r, g, b]
        const hx = div(v, m);
        if (!rgb.has(hx)) rgb.set(hx, [1, 3, 5].map((i) => parseInt(hx.slice(i, i + 2), 16)));
        return rgb.get(hx);
      };
      const paint = (w, i0, i1, j0, j1) => { // the largest change under a pixel, with its sign
        let v = 0;
        for (let i = i0; i < i1; i++) for (let j = j0; j < j1; j++) if (w[i][j] !== null && Math.abs(w[i][j]) > Math.abs(v)) v = w[i][j];
        return colour(v);
      };
      c.append(el("h3", "", t("compare.gridTitle")));
      const A = layerIn(S.data, S.layer) || S.data.layers[0], B = layerIn(C.dataB, A.name);
      if (B && !sameShape(A, B)) c.append(el("p", "cmp-counts", t("compare.counts", { a: size(A), b: size(B) })));
      if (ls.some((L) => !L.missing)) c.append(scaleNote(m), grid(ls, { avail: viewWidth() - 190, labW: 160, cls: "thumb-diff", paint }));
      return c;
    }

    // translation: A's output and maps at the step beside B's (row(d, name, width): app.js's
    // cross-attention and decoder bars; the two sides wrap one under the other when narrow),
    // then A, B and B − A
    function trans(root, cl, row) {
      const head = cl.heads[Math.max(0, cl.heads.indexOf(S.head))];
      const w = Math.max(240, Math.min(600, Math.floor((viewWidth() - 16) / 2) - 20));
      const p = pair((d) => {
        const box = el("div", "cmp-trans");
        if (!d.translation || !layerIn(d, cl.name)) { box.append(el("p", "hint", t("trans.none"))); return box; }
        const line = el("p", "intro"); line.append(el("strong", "", t("trans.label")), data("span", "", d.translation.text));
        box.append(line, row(d, cl.name, w));
        return box;
      });
      p.classList.add("cmp-trans-pair");
      root.append(p, card(cl.name, head));
    }

    // heads at work: B's probe verdict under A's
    function probe(p) {
      const pr = C.dataB && C.dataB.probe;
      if (!pr || pr.error) return;
      const votes = Object.entries(pr.votes).map(([c, n]) => `${c} ×${n}`).join(", ");
      const v = pr.deciding ? elt("p", "verdict", "work.decide", { deciding: pr.deciding, n: pr.n_heads, votes })
        : elt("p", "verdict", "work.noDecide", { n: pr.n_heads, token: pr.token });
      v.id = "probe-verdict-b"; v.prepend(tag("b"), " ");
      p.append(v);
    }
    // comparing with heads off: B is the answer with heads off (its "what changed")
    const ablated = () => (on() && C.mode === "off" ? C.dataB : null);

    // ---------- the address ----------
    // model, text, translate, beam, view, lang, layer, head, off, compare, text2
    function readURL(q) {
      const cut = (s) => String(s).slice(0, MAX_TEXT);
      if (q.has("text")) $("#text").value = cut(q.get("text"));
      if (q.has("text2")) $("#text2").value = cut(q.get("text2"));
      if (["1", "2", "4", "8"].includes(q.get("beam"))) $("#beam").value = q.get("beam");
      for (const item of (q.get("off") || "").split(",").slice(0, MAX_OFF)) {
        const i = item.lastIndexOf(":"), h = item.slice(i + 1);
        if (i > 0 && /^\d{1,4}$/.test(h)) S.off.add(item.slice(0, i) + "|" + +h);
      }
      const layer = q.get("layer"), head = q.get("head");
      if (layer || head || S.off.size) {
        S.urlSel = { layer: layer ? layer.slice(0, 200) : null, head: /^\d{1,4}$/.test(head || "") ? +head : 0 };
        S.head = S.urlSel.head; S.heads = new Set([S.head]);
      }
      const c = q.get("compare");
      if (c && c !== "0") { C.on = true; C.mode = c === "off" || c === "text" ? c : q.get("text2") ? "text" : "off"; }
    }
    function writeURL() {
      bar();
      const q = new URLSearchParams();
      q.set("model", $("#model").value);
      q.set("text", C.sentA ? C.sentA.text : $("#text").value);
      if ($("#translate").checked) q.set("translate", "1");
      if ($("#beam").value !== "1") q.set("beam", $("#beam").value);
      q.set("view", S.view);
      if (S.lang !== "en") q.set("lang", S.lang);
      if (S.data && S.layer) { q.set("layer", S.layer); q.set("head", String(S.head)); }
      if (S.off.size) q.set("off", offList().map(([l, h]) => `${l}:${h}`).join(","));
      if (C.on) {
        q.set("compare", C.mode);
        if (C.mode === "text") q.set("text2", C.sentB ? C.sentB.text : $("#text2").value);
      }
      // texts too long for the query go in the #fragment: the browser keeps it in a link but
      // never sends it to the server (app.js start() reads it back); cut as a link is read
      let hash = "";
      if (q.toString().length > MAX_URL) {
        const h = new URLSearchParams();
        for (const k of ["text", "text2"]) if (q.has(k)) { h.set(k, q.get(k).slice(0, MAX_TEXT)); q.delete(k); }
        hash = "#" + h.toString();
      }
      C.tooLong = hash.length > MAX_HASH;
      if (C.tooLong) hash = "";
      if (q.toString().length > MAX_URL) q.delete("off");
      $("#url-note").hidden = !C.tooLong;
      const url = "?" + q.toString().replace(/%3A/g, ":").replace(/%2C/g, ",") + hash; // (both mean themselves in a query)
      if (url !== location.search + location.hash) history.replaceState(null, "", url);
    }

    return { on, bar, wire, requests, accept, notes, status, layerIn, pair, card, stepB, model, trans, probe, ablated, readURL, writeURL,
      dataB: () => C.dataB };
  }

  window.qkvCompare = { create };
})();
