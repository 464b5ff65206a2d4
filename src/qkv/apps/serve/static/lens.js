// qkv explorer: the Lens view. What each layer of a decoder would predict (logit lens: the
// residual stream after each layer through the final norm and unembedding) and what each head
// writes toward the prediction (direct logit attribution), beside the head's attention map.
// Its numbers come from POST /api/lens (qkv.apps.serve.compute_lens), asked when the view is
// shown, for the text, model, translation and heads off of the answer on screen (S.data).
// Tokens are data: only textContent shows them, never innerHTML.
"use strict";
(() => {
  const TOP_K = 5;

  function create(ctx) {
    const { S, el, t, elt, data, heatmap, short, viewWidth, fmt, selectHead, renderView, showTip, hideTip } = ctx;
    const { seq, div } = window.qkvExport;
    let got = { key: null, d: null, err: null }; // the last /api/lens answer and what it was for
    let position = null; // the attributed position; null: the last
    let base = null; // the request without its position: another text or model resets it

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
        const r = await fetch("/api/lens", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
        const d = await r.json();
        if (got.key !== key) return; // a newer request took its place
        if (r.ok) { got.d = d; S.lens = d; } else got.err = d.error || t("error.status", { status: r.status });
      } catch (err) { if (got.key === key) got.err = String(err); }
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
      if (b !== base) { base = b; position = null; }
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

    // layers × positions: each cell the lens's top token (colour: its probability); hover: top k
    function table(d) {
      const c = el("div", "card lens-card");
      c.append(el("h3", "", t("lens.tableTitle")));
      const wrap = el("div", "lens-wrap"), tb = el("table", "lens-table");
      const head = el("tr"); head.append(el("th", "", t("lens.layer")));
      d.tokens.forEach((tok, j) => {
        const th = data("th", j === d.position ? "pos sel" : "pos", tok);
        th.dataset.pos = j; th.title = t("lens.pickPosition"); th.addEventListener("click", () => pick(j));
        head.append(th);
      });
      tb.append(head);
      d.lens.layers.forEach((name, i) => {
        const tr = el("tr"); tr.dataset.layer = name;
        tr.append((name === "embeddings" ? el : data)("th", "", rowName(name)));
        d.lens.tokens[i].forEach((cell, j) => {
          const p = d.lens.probs[i][j][0];
          const td = data("td", j === d.position ? "sel" : "", cell[0]);
          td.style.background = seq(p); td.style.color = p > 0.6 ? "#fff" : "#1d2330";
          td.dataset.pos = j; td.dataset.p = p;
          td.addEventListener("mousemove", (ev) => showTip(ev, [t("lens.tip", { layer: rowName(name), token: d.tokens[j] }),
            ...cell.map((x, r) => `${r + 1}. ${x}  ${fmt(d.lens.probs[i][j][r])}`)].join("\n")));
          td.addEventListener("mouseleave", hideTip);
          td.addEventListener("click", () => pick(j));
          tr.append(td);
        });
        tb.append(tr);
      });
      wrap.append(tb); c.append(wrap);
      const sc = el("div", "scale"), bar = el("canvas"); bar.width = 120; bar.height = 10;
      const g = bar.getContext("2d");
      for (let x = 0; x < 120; x++) { g.fillStyle = seq(x / 119); g.fillRect(x, 0, 1, 10); }
      sc.append(el("span", "", "0"), bar, el("span", "", "1"), el("span", "", t("lens.scale")));
      c.append(sc);
      return c;
    }
    function pick(j) { if (position === j) return; position = j; hideTip(); renderView(); }

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
      const L = (S.data.layers || []).find((l) => l.name === S.layer), hi = L ? L.heads.indexOf(S.head) : -1;
      if (!L || hi < 0 || L.pooled || !L.weights[hi] || d.position >= L.q_tokens.length) return box;
      box.append(elt("h4", "", "lens.mapTitle", { i: d.position }));
      box.append(heatmap(L.weights[hi], L.q_tokens, L.k_tokens, { maxWidth: Math.min(420, viewWidth() - 420), prob: true, highlightRow: d.position }));
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
