// qkv explorer: one request → every view. Tokens are data: only textContent and canvas
// fillText ever show them, never innerHTML.
"use strict";
(() => {
  const $ = (s) => document.querySelector(s);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = String(text);
    return e;
  };
  // head colours, colour scales, numbers (fmt: 3 decimals, cellText: a cell's 2) and label
  // widths: export.js's (loaded first), so that the screen and a downloaded picture agree
  const { HEAD_COLORS, seqRGB, divRGB, fmt, cellText, cellFont, textWidth, FONT } = window.qkvExport;
  const Maps = window.qkvMaps; // maps.js: matrices of any size, painted as ImageData
  const LONG_ROWS = 128; // a map of more tokens is a long answer's (qkv.limits.TOKEN_LIMIT)
  const LABEL_PX = 11, SIN60 = Math.sin(Math.PI / 3); // token labels: their font size; columns turn 60°
  const S = { data: null, strings: null, lang: "en", view: "step", layer: null, head: 0,
    heads: new Set(), pinned: null, step: 0, off: new Set(), offline: false, busy: false,
    pending: false, timer: null, probeToken: "it", probeCands: "animal, street", models: [],
    error: null, notice: null, status: null, urlSel: null, win: 0, piece: 0, pieceOf: null };
  let cmp = null; // compare.js: A beside B (made in start(), once app.js's helpers exist)
  let lg = null; // long.js: a long answer's packed maps, head window and downloads (idem)
  let lens = null; // lens.js: the Lens view (made in start() too)
  let engine = null; // engine.js: where every answer comes from (chosen in start(), once)

  // ---------- heat maps on canvas ----------
  const tip = () => $("#tip");
  function showTip(ev, text) {
    const t = tip(); t.textContent = text; t.hidden = false;
    t.style.left = Math.min(ev.clientX + 14, window.innerWidth - 300) + "px";
    t.style.top = (ev.clientY + 14) + "px";
  }
  function hideTip() { tip().hidden = true; }

  // heatmap(values, rows, cols, {maxWidth, maxCell, prob, features, ints, highlightRow,
  // rowsShown}): values [R][C] (JSON) or a maps.js matrix (a long answer's, decoded). Painted as
  // one ImageData (maps.js); a map wider than its room at 2 px a cell is drawn smaller than its
  // cells (a pixel: the largest value under it), and hover shows the exact cell under the pointer.
  // Token labels: rows at the left, columns rotated above, with room for the longest label (its
  // height above, its tail right of the last column); where cells are narrower than the font,
  // every k-th label (hover a cell: the tooltip names its row and column)
  function heatmap(values, rows, cols, opt) {
    const wrap = el("div", "hm");
    const M = values.get ? values : Maps.rows(values);
    const R = M.R, C = M.C, prob = !!opt.prob;
    const m = Math.max(Math.abs(M.lo), Math.abs(M.hi));
    const feat = !!opt.features; // columns are feature dimensions, not tokens
    const rowText = R <= LONG_ROWS ? rows.map((r) => clip(r, 10)) : null;
    const colText = !feat && C <= LONG_ROWS ? cols.map((c) => clip(c, 10)) : null;
    const colW = colText ? Math.max(0, ...colText.map((c) => textWidth(c, LABEL_PX))) : 0;
    const labW = rowText ? 70 : 0, labH = colText ? Math.ceil(colW * SIN60 + LABEL_PX) : 0;
    const padR = colText ? Math.ceil(colW / 2 + LABEL_PX / 2) : 0; // the last label's tail
    const room = Math.max(1, opt.maxWidth - labW - padR);
    const fit = Math.floor(room / Math.max(1, C));
    const cell = fit >= 2 ? Math.min(opt.maxCell || 26, fit) : room / Math.max(1, C);
    let cellH = feat ? Math.max(12, Math.min(20, cell)) : cell;
    if (R > LONG_ROWS) cellH = Math.min(cellH, Math.max(600, opt.maxWidth) / R); // a long answer's rows fit too
    // every k-th label, so that two never overlap (rotated 60°: their gap is cell · sin 60°)
    const everyR = Math.max(1, Math.ceil((LABEL_PX + 1) / cellH)), everyC = Math.max(1, Math.ceil((LABEL_PX + 1) / (cell * SIN60)));
    const padY = rowText ? Math.max(0, Math.ceil(LABEL_PX / 2 - cellH / 2)) : 0; // the first and last row labels' overhang
    const top = Math.max(labH, padY);
    const cv = el("canvas");
    const W = Math.round(labW + cell * C + (colText ? Math.max(0, padR - cell / 2) : 0)), H = Math.round(top + cellH * R + padY);
    const dpr = window.devicePixelRatio || 1;
    cv.width = W * dpr; cv.height = H * dpr; cv.style.width = W + "px"; cv.style.height = H + "px";
    const g = cv.getContext("2d");
    Maps.paint(g, M, Math.round(labW * dpr), Math.round(top * dpr), Math.round(cell * C * dpr), Math.round(cellH * R * dpr),
      { prob, m, seqRGB, divRGB, rowsShown: opt.rowsShown });
    g.scale(dpr, dpr);
    if (opt.highlightRow !== undefined && opt.highlightRow < R) {
      g.strokeStyle = "#e67700"; g.lineWidth = 2;
      g.strokeRect(labW + 1, top + opt.highlightRow * cellH + 1, C * cell - 2, cellH - 2);
    }
    const cfs = cellFont(cell, (v) => textWidth(v, 9), prob, opt.ints);
    if (!feat && cfs && C <= 24 && R <= 40) { // exact values in big cells, in a font that fits them
      g.font = `${cfs}px sans-serif`; g.textAlign = "center"; g.textBaseline = "middle";
      for (let i = 0; i < R; i++) for (let j = 0; j < C; j++) {
        const v = M.get(i, j); const x = prob ? v : (m ? Math.abs(v) / m : 0);
        const dim = opt.rowsShown !== undefined && i > opt.rowsShown;
        g.fillStyle = dim ? "#aaa" : v !== null && x > 0.6 ? "#fff" : "#222";
        g.fillText(cellText(v, opt.ints), labW + (j + 0.5) * cell, top + (i + 0.5) * cell);
      }
    }
    g.fillStyle = "#222"; g.font = `${LABEL_PX}px ${FONT}`;
    if (rowText) {
      g.textAlign = "right"; g.textBaseline = "middle";
      rowText.forEach((r, i) => { if (i % everyR === 0) g.fillText(r, labW - 4, top + (i + 0.5) * cellH); });
    }
    if (colText) {
      g.textAlign = "left"; g.textBaseline = "middle";
      colText.forEach((c, j) => {
        if (j % everyC) return;
        g.save(); g.translate(labW + (j + 0.5) * cell, top - 4); g.rotate(-Math.PI / 3);
        g.fillText(c, 0, 0); g.restore();
      });
    }
    // which labels are drawn (the browser tests read them): every k-th row and column, 0: none
    cv.dataset.rowLabels = rowText ? everyR : 0; cv.dataset.colLabels = colText ? everyC : 0;
    const long = R > LONG_ROWS || C > LONG_ROWS; // the tip names positions: many cells share a pixel
    cv.addEventListener("mousemove", (ev) => {
      const r = cv.getBoundingClientRect();
      const j = Math.floor((ev.clientX - r.left - labW) / cell), i = Math.floor((ev.clientY - r.top - top) / cellH);
      if (i < 0 || j < 0 || i >= R || j >= C) return hideTip();
      const v = M.get(i, j);
      showTip(ev, t((feat ? "map.tipFeature" : "map.tip") + (long ? "At" : ""), { row: rows[i], col: cols[j], v: fmt(v), i, j }));
      tip().dataset.cell = `${i},${j}`; // (the browser tests read which cell it is)
    });
    cv.addEventListener("mouseleave", hideTip);
    cv.dataset.rows = R; cv.dataset.cols = C;
    wrap.appendChild(cv);
    const sc = el("div", "scale");
    sc.append(el("span", "", prob ? "0" : fmt(-m)), scaleBar(prob), el("span", "", prob ? "1" : fmt(m)));
    if (M.nulls) sc.append(el("span", "", t("map.grey")));
    wrap.appendChild(sc);
    if (long) wrap.appendChild(el("p", "hint", t("map.pooledPixels", { r: R, c: C })));
    return wrap;
  }
  // the colour bar under a map: its pixels span 0..1 or −m..m whatever m is, so each scale's
  // are worked out once (120 fillRects with colour strings per map were a tenth of a step view)
  const BARS = {};
  function scaleBar(prob) {
    const bar = el("canvas"); bar.width = 120; bar.height = 10;
    const g = bar.getContext("2d");
    if (!BARS[prob]) {
      const img = g.createImageData(120, 10);
      for (let x = 0; x < 120; x++) {
        const rgb = prob ? seqRGB(x / 119) : divRGB((x / 119) * 2 - 1, 1);
        for (let y = 0; y < 10; y++) { const k = 4 * (y * 120 + x); for (let c = 0; c < 3; c++) img.data[k + c] = Math.round(rgb[c]); img.data[k + 3] = 255; }
      }
      BARS[prob] = img;
    }
    g.putImageData(BARS[prob], 0, 0);
    return bar;
  }
  function short(name) { return String(name).replace("encoder.layers.", t("short.enc") + " ").replace("decoder.layers.", t("short.dec") + " ").replace(/\.(self_attn|cross_attn|attn)$/, (m, k) => " " + t(k === "cross_attn" ? "kind.cross" : "kind.self")); }
  function clip(s, n) { s = String(s); return s.length > n ? s.slice(0, n - 1) + "…" : s; }

  // ---------- data helpers ----------
  const layers = () => (S.data ? S.data.layers : []);
  const layerIdx = () => Math.max(0, layers().findIndex((l) => l.name === S.layer));
  const curLayer = () => layers()[layerIdx()];
  // every word on the page comes from i18n/strings.json: the reader's language, else English;
  // "{name}" placeholders are filled from vars
  const t = (key, vars) => {
    const s = (S.strings && ((S.strings[S.lang] || {})[key] || (S.strings.en || {})[key])) || "";
    return vars ? s.replace(/\{(\w+)\}/g, (m, k) => (k in vars ? String(vars[k]) : m)) : s;
  };
  // t() as nodes, each filled-in value in a translate="no" span: tokens, model output and
  // names are data, not words of the page (a translation tool, and the i18n test, skip them)
  // (a value {i18n: key} is a word of the page: that string, in the reader's language)
  function tn(key, vars) {
    const s = t(key), out = [], re = /\{(\w+)\}/g;
    let last = 0, m;
    while ((m = re.exec(s))) {
      out.push(document.createTextNode(s.slice(last, m.index)));
      const val = m[1] in vars ? vars[m[1]] : m[0], word = !!val && typeof val.i18n === "string";
      const v = el("span", "", word ? t(val.i18n) || val.i18n : val); v.translate = word; out.push(v);
      last = re.lastIndex;
    }
    out.push(document.createTextNode(s.slice(last)));
    return out;
  }
  const elt = (tag, cls, key, vars) => { const e = el(tag, cls); e.append(...tn(key, vars || {})); return e; };
  const data = (tag, cls, text) => { const e = el(tag, cls, text); e.translate = false; return e; };
  const kindName = (k) => t("kind." + k) || k;
  const title = (key) => t("title." + key) || key;

  // ---------- side panel ----------
  function renderSide() {
    const ls = $("#layer"), hs = $("#head");
    ls.replaceChildren(...layers().map((l) => { const o = el("option", "", t("layer.option", { name: l.name, kind: kindName(l.kind) })); o.value = l.name; return o; }));
    ls.value = S.layer || "";
    const L = curLayer();
    hs.replaceChildren(...(L ? L.heads : []).map((h) => { const o = el("option", "", h); o.value = h; return o; }));
    hs.value = String(S.head);
    const body = $("#stats tbody"); body.replaceChildren();
    if (!S.data) return;
    for (const s of S.data.stats.filter((s) => s.layer === S.layer)) {
      const tr = el("tr", s.head === S.head ? "sel" : "");
      tr.dataset.head = s.head;
      tr.append(el("td", "", s.head), ...["entropy", "distance", "prev", "first", "punct"].map((k) => el("td", "", s[k] === null ? "–" : s[k].toFixed(2))));
      tr.addEventListener("click", () => selectHead(S.layer, s.head));
      body.appendChild(tr);
    }
  }

  function selectHead(layer, head) {
    const changed = layer !== S.layer || head !== S.head;
    S.layer = layer; S.head = head; S.heads = new Set([head]); S.pinned = null;
    renderSide(); renderView();
    // a long answer holds one head exact (and the head view's lines of one layer): ask for this one
    if (changed && !S.offline && (lg.isLong(S.data) || (S.view === "step" && !(S.data && S.data.step_unavailable)))) refresh();
  }

  // ---------- views ----------
  function viewWidth() { return Math.max(300, $("#views").clientWidth - 30); }

  function renderStep(root) {
    const st = S.data.step;
    if (!st || st.layer !== S.layer || st.head !== S.head) {
      const why = S.data.step_unavailable;
      if (S.offline || why) {
        const L = curLayer(); const hi = L.heads.indexOf(S.head);
        const note = t(why ? "step.unavailable" : "step.offline");
        root.append(el("p", "intro", t("step.weightsOnly", { layer: S.layer, head: S.head, note })));
        const w = lg.weightsOf(S.data, L, S.head);
        if (!w) { root.append(el("p", "intro", t("step.loading"))); return; }
        const c = el("div", "card"); c.append(el("h3", "", title("weights")), el("p", "", t("step.weights")), heatmap(w, L.q_tokens, L.k_tokens, { maxWidth: viewWidth() - 20, prob: true }));
        root.append(c); return;
      }
      root.append(el("p", "intro", t("step.loading"))); return;
    }
    const scale = t(Math.abs(st.scale - 1 / Math.sqrt(st.d_k)) < 1e-5 ? "step.scaleDk" : "step.scale");
    // st.note is the one server note (compute_hf.STEP_NOTE), in the table as step.hfNote
    const intro = el("p", "intro", t("step.intro", { layer: st.layer, kind: kindName(st.kind), head: st.head, n: st.n_heads, d_model: st.d_model, d_k: st.d_k, scale, value: st.scale }) + (st.head_off ? t("step.headOff") : "") + (st.note ? ` (${t("step.hfNote")})` : ""));
    root.append(intro);
    // a transformers call handed back to transformers and replayed (fallback), gpt-oss's sink
    if (st.fallback) { const f = elt("p", "hint step-note", "step.fallback", { why: st.fallback }); f.id = "step-fallback"; root.append(f); }
    if (st.sink !== undefined && st.sink !== null) { const k = el("p", "hint step-note", t("step.sink", { sink: st.sink })); k.id = "step-sink"; root.append(k); }
    // compare (compare.js): A, B and B − A of this head first, then every step of A beside B's
    const stB = cmp.on() ? cmp.stepB() : null;
    if (cmp.on()) root.append(cmp.card());
    const cards = el("div", stB ? "cards pairs" : "cards");
    const w = stB ? Math.max(200, Math.floor((viewWidth() - 36) / 2) - 18)
      : Math.max(280, Math.floor((viewWidth() - 24) / Math.max(1, Math.floor(viewWidth() / 300))) - 18);
    for (const m of st.matrices) {
      cards.appendChild(stepCard(m, w, stB ? "a" : "", S.data));
      if (stB) { const mb = stB.matrices.find((x) => x.key === m.key); cards.appendChild(mb ? stepCard(mb, w, "b", cmp.dataB()) : el("div")); }
    }
    root.append(cards);
  }
  // one matrix of the step-by-step walk; side "a"/"b" when two answers are compared
  function stepCard(m, w, side, d) {
    const c = el("div", "card"); c.dataset.key = m.key;
    if (side) c.dataset.side = side;
    const h = el("h3", "", title(m.key));
    if (side) h.prepend(el("span", "side-tag " + side, side.toUpperCase()));
    const cut = m.shape[1] > m.cols.length ? t("step.firstCols", { n: m.cols.length }) : "";
    h.append(el("span", "shape", `  ${m.shape[0]}×${m.shape[1]}${cut}`));
    const p = el("p", "expl", t("step." + m.key)); p.lang = S.lang;
    const feat = ["x", "context", "q", "k", "v", "output", "concat", "wo"].includes(m.key);
    c.append(h, p, heatmap(lg.stepValues(d, m), m.rows, m.cols, { maxWidth: w, prob: m.key === "weights" || m.key === "mask", features: feat, ints: m.key === "mask" }));
    return c;
  }

  function renderHead(root) {
    const L = curLayer(); if (!L) return;
    const chips = el("div", "head-chips");
    chips.append(el("span", "", t("head.heads")));
    L.heads.forEach((h, hi) => {
      const b = el("button", "chip" + (S.heads.has(h) ? " on" : ""), h);
      b.style.background = HEAD_COLORS[hi % HEAD_COLORS.length]; b.dataset.head = h;
      b.title = t("head.chipTitle", { head: h });
      b.addEventListener("click", () => { S.heads.has(h) ? S.heads.delete(h) : S.heads.add(h); renderView(); });
      chips.append(b);
    });
    const all = el("button", "", t("head.all")); all.addEventListener("click", () => { S.heads = new Set(L.heads); renderView(); });
    const top = el("select"); top.id = "top-heads"; top.title = t("head.topTitle");
    [["", "head.top"], ["prev", "head.byPrev"], ["first", "head.byFirst"], ["punct", "head.byPunct"], ["focus", "head.byFocus"]]
      .forEach(([k, v]) => { const o = el("option", "", t(v)); o.value = k; top.append(o); });
    top.addEventListener("change", () => {
      const k = top.value; if (!k) return;
      const st = S.data.stats.filter((x) => x.layer === L.name);
      const score = (x) => (k === "focus" ? -(x.entropy ?? 99) : (x[k] ?? -1));
      S.heads = new Set(st.sort((a, b) => score(b) - score(a)).slice(0, 3).map((x) => x.head)); renderView();
    });
    chips.append(all, top, el("span", "hint", "  " + t("head.hint")));
    root.append(chips);
    // compare (compare.js): A's lines beside B's, then A, B and B − A of the selected head
    const win = lg.windowBar(L); if (win) root.append(win);
    if (cmp.on()) root.append(cmp.pair((d) => headPanel(cmp.layerIn(d, L.name), 150, d)), cmp.card());
    else root.append(headPanel(L, 240, S.data));
  }
  // the lines of one layer's heads that are on (S.heads), W pixels between the two columns; d:
  // the answer L is from. A long answer's: the window of HEAD_WINDOW queries from S.win, each
  // with its strongest keys per head (the answer's "top"), the keys they reach listed in order
  function headPanel(L, W, d) {
    if (!L) return el("div");
    const lines = lg.headLines(L, d || S.data);
    if (!lines) return el("p", "hint", t("step.loading"));
    const { qs, ks, weight } = lines; // token positions shown; weight(hi, i, j) by position
    const R = qs.length, C = ks.length;
    const hv = el("div", "headview");
    const left = data("div", "toks left"), right = data("div", "toks right"), blocks = el("div", "blocks");
    const cv = el("canvas"); const RH = 24, H = Math.max(R, C) * RH;
    const pinned = qs.includes(S.pinned) ? S.pinned : null; // (B may be shorter)
    cv.width = W; cv.height = H; cv.style.width = W + "px"; cv.style.height = H + "px";
    const label = (d, i) => { if (lines.long) d.append(el("span", "pos", i)); return d; };
    qs.forEach((i) => {
      const tk = L.q_tokens[i];
      const d = label(el("div", pinned === i ? "pinned" : ""), i); d.append(tk); d.dataset.i = i; d.title = tk;
      d.addEventListener("mouseenter", () => draw(i));
      d.addEventListener("mouseleave", () => draw(pinned));
      d.addEventListener("click", () => { S.pinned = S.pinned === i ? null : i; renderView(); });
      left.append(d);
    });
    ks.forEach((j) => { const d = label(el("div"), j); d.append(L.k_tokens[j]); d.dataset.j = j; d.title = L.k_tokens[j]; right.append(d); blocks.append(el("div")); });
    const active = L.heads.map((h, hi) => [h, hi]).filter(([h]) => S.heads.has(h));
    function draw(q) {
      const on = q !== null && q !== undefined;
      const g = cv.getContext("2d"); g.clearRect(0, 0, W, H);
      left.querySelectorAll(":scope > div").forEach((x) => x.classList.toggle("hot", on && +x.dataset.i === q));
      for (const [, hi] of active) {
        g.strokeStyle = HEAD_COLORS[hi % HEAD_COLORS.length];
        qs.forEach((i, r) => {
          if (on && i !== q) return;
          ks.forEach((j, c) => {
            const v = weight(hi, i, j); if (!v) return;
            g.globalAlpha = Math.min(1, v); g.lineWidth = on ? 3 : 2;
            g.beginPath(); g.moveTo(0, r * RH + RH / 2); g.lineTo(W, c * RH + RH / 2); g.stroke();
          });
        });
      }
      g.globalAlpha = 1;
      blocks.querySelectorAll(":scope > div").forEach((row, c) => {
        row.replaceChildren();
        const j = ks[c];
        for (const [h, hi] of active) {
          const s = el("span");
          const v = on ? weight(hi, q, j) : qs.reduce((a, i) => a + weight(hi, i, j), 0) / R;
          s.style.background = HEAD_COLORS[hi % HEAD_COLORS.length]; s.style.opacity = Math.max(0.04, Math.min(1, v));
          s.title = t("head.blockTitle", { head: h, v: fmt(v) }); s.dataset.head = h; s.dataset.v = v;
          row.append(s);
        }
      });
    }
    hv.append(left, cv, right, blocks);
    draw(pinned);
    return hv;
  }

  function renderModel(root) {
    const ls = layers(); if (!ls.length) return;
    const H = Math.max(...ls.map((l) => l.heads.length));
    root.append(el("p", "intro", t("grid.intro", { layers: ls.length, heads: H })));
    // compare (compare.js): A's grid beside B's, B − A of every head under them
    const P = ls[0].pooled; // a long answer: every map pooled, the selected head exact below
    if (P) root.append(el("p", "hint", t("grid.pooled", { k: P.k, rows: P.rows, cols: P.cols })));
    if (cmp.on()) cmp.model(root, modelGrid);
    else root.append(modelGrid(ls, { off: S.off, avail: viewWidth() - 170, labW: 160 }));
    if (P && !cmp.on()) {
      const L = curLayer(), w = lg.weightsOf(S.data, L, S.head);
      const c = el("div", "card exact-card"); c.id = "exact-card";
      c.append(elt("h3", "", "grid.exactTitle", { layer: L.name, head: S.head }), el("p", "hint", t("grid.exactHint")));
      c.append(w ? heatmap(w, L.q_tokens, L.k_tokens, { maxWidth: Math.min(720, viewWidth() - 20), prob: true }) : el("p", "hint", t("step.loading")));
      root.append(c);
    }
  }
  // every layer × head of ls as a thumbnail (click: open it step by step). opt: off (the
  // heads shown dimmed), avail (pixels for the thumbnails), labW (the labels' column), cls (the
  // thumbnails' class), paint(w, i0, i1, j0, j1) → [r, g, b] of the pixel over rows i0..i1-1,
  // columns j0..j1-1 (default: the √ of their largest weight, white → blue)
  function modelGrid(ls, opt) {
    const H = Math.max(...ls.map((l) => l.heads.length)), cls = opt.cls || "thumb";
    const availH = Math.max(300, $("#views").clientHeight - 60);
    const size = Math.max(26, Math.min(110, Math.floor(opt.avail / H) - 4, Math.floor(availH / ls.length) - 4));
    const grid = el("div", "grid");
    grid.style.gridTemplateColumns = `${opt.labW}px repeat(${H}, ${size + 2}px)`; // labels: "解码器 2 交叉注意力"
    grid.append(el("div"));
    for (let h = 0; h < H; h++) grid.append(el("div", "colh", t("grid.head", { head: h })));
    ls.forEach((L, li) => {
      const lab = el("div", "lab", short(L.name)); lab.title = t("layer.option", { name: L.name, kind: kindName(L.kind) }); grid.append(lab);
      L.heads.forEach((h, hi) => {
        const w = L.weights[hi];
        if (!w) { const e = el("div", "nothumb", "≠"); e.title = L.missing || ""; e.style.height = size + "px"; grid.append(e); return; }
        const cv = el("canvas", cls + (L.name === S.layer && h === S.head ? " sel" : "") + (opt.off && opt.off.has(L.name + "|" + h) ? " off" : ""));
        cv.width = size; cv.height = size; cv.dataset.layer = li; cv.dataset.head = h; cv.title = t("grid.thumbTitle", { layer: L.name, head: h });
        const R = w.length, C = R ? w[0].length : 0;
        const g = cv.getContext("2d"); const img = g.createImageData(size, size);
        for (let y = 0; y < size; y++) for (let x = 0; x < size; x++) { // downsampled: max of the cells under a pixel
          const i0 = Math.floor(y * R / size), i1 = Math.max(i0 + 1, Math.floor((y + 1) * R / size));
          const j0 = Math.floor(x * C / size), j1 = Math.max(j0 + 1, Math.floor((x + 1) * C / size));
          const k = 4 * (y * size + x);
          if (opt.paint) { const c = opt.paint(w, i0, i1, j0, j1); img.data[k] = c[0]; img.data[k + 1] = c[1]; img.data[k + 2] = c[2]; img.data[k + 3] = 255; continue; }
          let v = 0; for (let i = i0; i < i1; i++) for (let j = j0; j < j1; j++) v = Math.max(v, w[i][j]);
          v = Math.sqrt(Math.min(1, v)); // √: faint weights stay visible
          img.data[k] = 255 - 218 * v; img.data[k + 1] = 255 - 168 * v; img.data[k + 2] = 255 - 56 * v; img.data[k + 3] = 255;
        }
        g.putImageData(img, 0, 0);
        cv.addEventListener("click", () => { S.view = "step"; setTabs(); selectHead(L.name, h); if (!S.offline && !S.data.step_unavailable) refresh(); });
        grid.append(cv);
      });
      for (let h = L.heads.length; h < H; h++) grid.append(el("div"));
    });
    return grid;
  }

  // the beam's final hypotheses, best first, scored as beam search ranks them
  function beamTable(tr) {
    const tb = el("table", "beams"); tb.id = "beams";
    const cap = el("caption", "", t("beams.caption", { n: tr.beams.length, lp: tr.length_penalty }));
    tb.append(cap);
    const head = el("tr"); ["#", t("beams.score"), t("beams.hyp")].forEach((h) => head.append(el("th", "", h))); tb.append(head);
    tr.beams.forEach((b, i) => {
      const row = el("tr", b.chosen ? "chosen" : "");
      const hyp = el("td"); hyp.append(data("span", "", b.text), b.chosen ? "  " + t("beams.chosen") : "");
      row.append(el("td", "", String(i + 1)), el("td", "num", fmt(b.score)), hyp);
      tb.append(row);
    });
    return tb;
  }

  // a text longer than the maps' limit was translated in pieces (as qkv translate splits a
  // line): each piece and its translation; a click shows that piece's maps
  function piecesTable(tr) {
    const box = el("div", "pieces"); box.id = "pieces";
    box.append(el("p", "hint", t("trans.pieces", { n: tr.pieces.length, piece: tr.piece + 1 })));
    const tb = el("table", "beams");
    const head = el("tr"); ["#", t("trans.pieceSource"), t("trans.pieceOutput")].forEach((h) => head.append(el("th", "", h))); tb.append(head);
    tr.pieces.forEach((p, i) => {
      const row = el("tr", i === tr.piece ? "chosen" : "pick"); row.dataset.piece = i;
      row.append(el("td", "", String(i + 1)), data("td", "", p.source), data("td", "", p.text));
      if (i !== tr.piece) {
        row.title = t("trans.pieceTitle", { i: i + 1 });
        row.addEventListener("click", () => { S.piece = i; S.pieceOf = $("#text").value; S.step = 0; refresh(); });
      }
      tb.append(row);
    });
    box.append(tb);
    return box;
  }

  function renderTrans(root) {
    const tr = S.data.translation;
    if (!tr) { root.append(el("p", "intro", t("trans.none"))); return false; } // (nothing to download)
    const n = tr.target_tokens.length;
    S.step = Math.min(S.step, n - 1);
    const line = el("p", "intro"); line.append(el("strong", "", t("trans.label")), data("span", "", tr.text));
    if (!cmp.on()) root.append(line); // (comparing: each side shows its own output)
    if (tr.beam > 1) root.append(elt("p", "hint", "trans.beamHint", { beam: tr.beam, greedy: tr.greedy_text }));
    if (tr.beams && tr.beams.length > 1) root.append(beamTable(tr));
    if (tr.pieces && tr.pieces.length > 1 && !cmp.on()) root.append(piecesTable(tr));
    const ctl = el("div", "row2");
    const slider = el("input"); slider.type = "range"; slider.min = 0; slider.max = n - 1; slider.value = S.step; slider.id = "step-slider";
    slider.addEventListener("input", () => { S.step = +slider.value; renderView(); });
    const lab = elt("span", "", "trans.step", { i: S.step + 1, n, token: tr.target_tokens[S.step] }); lab.id = "step-label";
    const play = el("button", "", t(S.timer ? "trans.pause" : "trans.play")); play.id = "play";
    play.title = t("trans.playTitle");
    play.addEventListener("click", () => {
      if (S.timer) { clearInterval(S.timer); S.timer = null; renderView(); return; }
      if (S.step >= n - 1) S.step = -1;
      S.timer = setInterval(() => {
        if (S.view !== "trans" || !S.data.translation || S.step >= S.data.translation.target_tokens.length - 1) { clearInterval(S.timer); S.timer = null; }
        else S.step += 1;
        renderView();
      }, 700);
    });
    ctl.append(play, slider, lab); root.append(ctl);
    const toks = data("div", "tokens-line");
    tr.target_tokens.forEach((tk, i) => toks.append(el("span", i === S.step ? "cur" : i > S.step ? "future" : "", tk)));
    root.append(toks);
    const cross = layers().filter((l) => l.kind === "cross"), dec = layers().filter((l) => l.kind === "causal");
    let cl = cross.find((l) => l.name.replace("cross_attn", "") === S.layer.replace(/(self|cross)_attn/, "")) || cross[cross.length - 1];
    if (S.layer && cross.some((l) => l.name === S.layer)) cl = cross.find((l) => l.name === S.layer);
    // compare (compare.js): A's maps beside B's, each with its output, then this head's A, B, B − A
    if (cmp.on()) cmp.trans(root, cl, transRow);
    // 330 px beside the map for the decoder's self-attention; a narrow window puts it below
    else root.append(transRow(S.data, cl.name, Math.min(600, viewWidth() < 640 ? viewWidth() : viewWidth() - 330)));
  }
  // the cross-attention of layer `name` in answer d (rows: the steps; S.step outlined) and its
  // decoder's self-attention at that step beside it (below it where there is no room)
  function transRow(d, name, maxWidth) {
    const row = el("div", "row2");
    const cl = d.layers.find((l) => l.name === name), dec = d.layers.filter((l) => l.kind === "causal");
    if (!cl) return row;
    const hi = Math.max(0, cl.heads.indexOf(S.head)), step = Math.min(S.step, cl.q_tokens.length - 1);
    const a = el("div", "panel"); a.append(el("h3", "", t("trans.cross", { layer: short(cl.name), head: cl.heads[hi] })), el("p", "hint", t("trans.crossHint")));
    a.append(heatmap(cl.weights[hi], cl.q_tokens, cl.k_tokens, { maxWidth, maxCell: 44, prob: true, highlightRow: step, rowsShown: step }));
    row.append(a);
    const dl = dec.find((l) => l.name === cl.name.replace("cross_attn", "self_attn")) || dec[dec.length - 1];
    if (dl) {
      const b = el("div", "panel"); const dhi = Math.max(0, dl.heads.indexOf(S.head));
      b.append(el("h3", "", t("trans.self", { layer: short(dl.name), head: dl.heads[dhi] })), elt("p", "hint", "trans.selfHint", { i: step + 1, token: dl.q_tokens[step] }));
      const bars = el("div", "bars"); const w = dl.weights[dhi][step] || [];
      for (let j = 0; j <= step && j < w.length; j++) {
        const r = el("div"); const bar = el("span", "bar"); bar.style.width = Math.round(180 * w[j]) + "px";
        r.append(data("span", "t", dl.k_tokens[j]), bar, el("span", "", fmt(w[j]))); bars.append(r);
      }
      b.append(bars); row.append(b);
    }
    return row;
  }

  function renderWork(root) {
    const d = S.data;
    if (S.offline) { root.append(el("p", "intro", t("work.offline"))); return; }
    const p = el("div", "card");
    p.append(el("h3", "", t("work.probeTitle")));
    const f = el("div", "row2");
    const tok = el("input", "small"); tok.id = "probe-token"; tok.value = S.probeToken;
    const cands = el("input"); cands.id = "probe-cands"; cands.value = S.probeCands;
    const go = el("button", "", t("work.probe")); go.id = "probe-run";
    go.addEventListener("click", () => { S.probeToken = tok.value.trim(); S.probeCands = cands.value; refresh(); });
    const ex = elt("button", "", "work.useExample", { text: "The animal didn't cross the street because it was tired." }); ex.id = "probe-example";
    ex.addEventListener("click", () => { $("#text").value = "The animal didn't cross the street because it was tired."; S.probeToken = "it"; S.probeCands = "animal, street"; refresh(); });
    const ctl = elt("button", "", "work.control", { text: "…because it was wide." }); ctl.id = "probe-control";
    ctl.addEventListener("click", () => { $("#text").value = "The animal didn't cross the street because it was wide."; S.probeToken = "it"; S.probeCands = "animal, street"; refresh(); });
    tok.translate = false; cands.translate = false;
    f.append(el("span", "", t("work.token")), tok, el("span", "", t("work.candidates")), cands, go, ex, ctl);
    p.append(f, el("p", "hint", t("work.probeHint")));
    const pr = d.probe;
    if (!pr) p.append(el("p", "hint", t("work.give")));
    else if (pr.error) p.append(elt("p", "err", "work.probeError", { token: S.probeToken, candidates: S.probeCands }));
    else {
      const votes = Object.entries(pr.votes).map(([c, n]) => `${c} ×${n}`).join(", ");
      const vv = pr.deciding ? elt("p", "verdict", "work.decide", { deciding: pr.deciding, n: pr.n_heads, votes })
        : elt("p", "verdict", "work.noDecide", { n: pr.n_heads, token: pr.token });
      vv.id = "probe-verdict"; p.append(vv);
      const tb = el("table", "probe"); const hr = el("tr");
      [t("work.layer"), t("work.head")].forEach((x) => hr.append(el("th", "", x)));
      pr.candidates.forEach((x) => hr.append(data("th", "", x)));
      [t("work.best"), t("work.margin")].forEach((x) => hr.append(el("th", "", x)));
      tb.append(hr);
      for (const r of pr.rows) {
        const tr = el("tr"); tr.append(data("td", "", r.layer), el("td", "", r.head), ...pr.candidates.map((c) => el("td", "", fmt(r.scores[c]))), data("td", "", r.best), el("td", "", fmt(r.margin)));
        tb.append(tr);
      }
      p.append(tb);
    }
    if (cmp.on()) cmp.probe(p); // compare.js: B's verdict
    root.append(p);
    const s = el("div", "card");
    s.append(el("h3", "", t("work.switchTitle")));
    const ls = layers().filter((l, i, a) => a.findIndex((m) => m.name === l.name) === i);
    const H = Math.max(...ls.map((l) => l.heads.length));
    const sw = el("div", "switches"); sw.style.gridTemplateColumns = `200px repeat(${H}, 44px)`;
    for (const L of ls) {
      const lab = data("div", "", L.name); sw.append(lab);
      for (const h of L.heads) {
        const l = el("label"); const cb = el("input"); cb.type = "checkbox"; cb.className = "switch";
        cb.checked = !S.off.has(L.name + "|" + h); cb.dataset.layer = L.name; cb.dataset.head = h;
        cb.addEventListener("change", () => { const k = L.name + "|" + h; cb.checked ? S.off.delete(k) : S.off.add(k); cmp.bar(); });
        l.append(cb, document.createTextNode(h)); sw.append(l);
      }
    }
    s.append(sw);
    const apply = el("button", "", t("work.rerun")); apply.id = "ablate-run";
    apply.addEventListener("click", refresh);
    const reset = el("button", "", t("work.allOn")); reset.addEventListener("click", () => { S.off.clear(); refresh(); });
    s.append(apply, document.createTextNode(" "), reset);
    const ab = cmp.ablated() || d; // comparing with heads off: B is the answer with heads off
    if (ab.ablation) {
      const c = el("div", "changed"); c.id = "changes";
      c.append(el("div", "", t("work.changed", { n: ab.ablation.heads.length })));
      if (ab.translation) {
        c.append(elt("div", "before", "work.before", { text: ab.ablation.baseline.translation }));
        c.append(elt("div", "", "work.after", { text: ab.translation.text }));
      }
      if (ab.ablation.hidden_change !== undefined) c.append(el("div", "", t("work.moved", { pct: (100 * ab.ablation.hidden_change).toFixed(1) })));
      const bp = ab.ablation.baseline.probe;
      if (bp && !bp.error && ab.probe && !ab.probe.error) {
        const key = (r) => `${r.layer}|${r.head}`; const before = new Map(bp.rows.map((r) => [key(r), r]));
        const top = ab.probe.rows.slice(0, 3).map((r) => { const b = before.get(key(r)); return t("work.deltaRow", { layer: r.layer, head: r.head, scores: pr.candidates.map((x) => `${x} ${b ? fmt(b.scores[x]) : "?"} → ${fmt(r.scores[x])}`).join(", ") }); });
        c.append(elt("div", "", "work.probeDelta", { rows: top.join(" · ") }));
        c.append(el("div", "before", t("work.deciding", { before: bp.deciding, after: ab.probe.deciding })));
      }
      s.append(c);
    }
    root.append(s);
  }

  const RENDER = { step: renderStep, head: renderHead, model: renderModel, trans: renderTrans, work: renderWork, lens: (root) => lens.render(root) };
  function renderView() {
    for (const v of Object.keys(RENDER)) $("#view-" + v).hidden = v !== S.view;
    if (!S.offline) cmp.writeURL(); // the page's state in its address (compare.js)
    const root = $("#view-" + S.view); root.replaceChildren();
    if (!S.data) { if (S.error) root.append(elt("p", "err", ...S.error)); return; }
    let drawn = true; // a view returns false when it has nothing to show (then nothing to download)
    try { drawn = RENDER[S.view](root) !== false; } catch (err) { root.append(elt("p", "err", "view.renderError", { err })); console.error(err); }
    if (drawn) window.qkvExport.attach(root, { S: lg.isLong(S.data) ? lg.exportState() : S, t, short }); // export.js: download buttons
    document.body.dataset.view = S.view;
  }
  function setTabs() {
    document.querySelectorAll(".tab").forEach((b) => {
      b.classList.toggle("active", b.dataset.view === S.view);
      b.textContent = t(b.dataset.i18n) || b.textContent;
    });
  }
  // the page in S.lang: index.html's words (data-i18n, data-i18n-aria, "KEY.title" tooltips),
  // the model menu, the status line and the notice
  function applyLang() {
    document.documentElement.lang = S.lang;
    if (!S.offline) document.title = t("app.title");
    document.querySelectorAll("[data-i18n]").forEach((e) => {
      e.textContent = t(e.dataset.i18n) || e.textContent;
      const tip = t(e.dataset.i18n + ".title"); if (tip) e.title = tip;
    });
    document.querySelectorAll("[data-i18n-aria]").forEach((e) => e.setAttribute("aria-label", t(e.dataset.i18nAria) || e.getAttribute("aria-label")));
    $("#model").querySelectorAll("option").forEach((o) => { const m = S.models.find((x) => x.name === o.value); if (m) o.textContent = modelLabel(m); });
    showStatus(...(S.status || []));
    if (S.notice) showNotice(...S.notice);
    setTabs();
  }
  // the built-in models' labels are in the table; a --model DIR is shown by its name
  const modelLabel = (m) => (m.label_key ? t(m.label_key, { name: m.name }) : m.label);

  // ---------- requests ----------
  function payload() {
    const body = { text: $("#text").value, model: $("#model").value, translate: $("#translate").checked,
      beam: +$("#beam").value, head: S.head, ablate: [...S.off].map((k) => { const i = k.lastIndexOf("|"); return [k.slice(0, i), +k.slice(i + 1)]; }) };
    const link = !S.data && S.urlSel; // the layer and head a link asked for, with its heads off
    if (link) { if (link.layer) body.layer = link.layer; body.head = link.head; }
    else if (S.layer && S.data && S.data.model === body.model && !!S.data.translation === body.translate && layers().some((l) => l.name === S.layer)) body.layer = S.layer;
    else { body.head = 0; body.ablate = []; S.off.clear(); } // another model: its heads are all on
    if (body.translate && S.piece && S.pieceOf === body.text) body.piece = S.piece; // a split text's piece
    const cands = S.probeCands.split(",").map((x) => x.trim()).filter(Boolean);
    if (S.probeToken && cands.length) body.probe = { token: S.probeToken, candidates: cands.slice(0, 8) };
    return body;
  }
  async function refresh() {
    if (S.offline) return;
    if (S.busy) { S.pending = true; return; }
    // an empty text: nothing to ask the server; said in place of the maps, as an error is (the
    // previous ones belong to another text, and maybe another model)
    if (!$("#text").value.trim()) { cmp.accept(null); fail(["error.emptyText"]); return; }
    S.busy = true; document.body.dataset.ready = "0"; showStatus("status.computing");
    const sel = [S.layer, S.head]; // the selection this request is for (a long text takes seconds)
    // comparing (compare.js): a second request for B, the same endpoint with its own text or heads off
    const [body, bodyB] = cmp.requests(payload());
    // each side: {d} (the answer) or {err} (an EngineError: status 0 when no answer came)
    const ask = (b) => engine.attention(b).then((d) => ({ d }), (err) => ({ err }));
    try {
      const [a, b] = await Promise.all([ask(body), bodyB && ask(bodyB)]);
      if (a.err && a.err.status === 400 && S.urlSel && !S.data) { S.urlSel = null; S.off.clear(); S.pending = true; } // a link's layer or heads that this model lacks: ask without them
      else if (a.err) { cmp.accept(null); fail(errorNote(a.err)); }
      else { cmp.accept(b); accept(a.d, sel); showStatus(...(cmp.status(a.d) || ["status.done", { n: a.d.tokens.length, ms: a.d.elapsed_ms }])); }
    } catch (err) { cmp.accept(null); fail(["error.request", { err }]); }
    S.busy = false;
    if (S.pending) { S.pending = false; return refresh(); }
    document.body.dataset.ready = "1";
  }
  // a translation note's fields as its string's values (qkv.translate_notes.note_text): the
  // first unseen words listed, the languages named in the reader's language
  const warnVars = (w) => ({ ...w,
    ...(Array.isArray(w.words) ? { words: w.words.slice(0, 4).join(", ") + (w.words.length > 4 ? ", ..." : "") } : {}),
    ...(w.looks ? { looks: { i18n: "lang." + w.looks } } : {}), ...(w.reads ? { reads: { i18n: "lang." + w.reads } } : {}) });
  // an EngineError as a note: the server's message (or its status), or why no answer came
  function errorNote(err) {
    return err.status ? ["error.server", { err: err.message || t("error.status", { status: err.status }) }] : ["error.request", { err }];
  }
  // notes: [key, vars] pairs (or a server's text), kept so that a change of language redraws them
  function showNotice(notes, isErr) {
    S.notice = notes && notes.length ? [notes, isErr] : null;
    const n = $("#notice"); n.replaceChildren(); n.hidden = !S.notice; n.className = isErr ? "random" : "";
    (notes || []).forEach((x, i) => n.append(...(i ? [" "] : []), ...(typeof x === "string" ? [x] : tn(x[0], x[1] || {}))));
  }
  function showStatus(key, vars) { S.status = key ? [key, vars] : null; $("#status").textContent = key ? t(key, vars) : ""; }
  // a failed request: the previous answer's maps go (they belong to another text or model)
  function fail(note) {
    if (S.timer) { clearInterval(S.timer); S.timer = null; }
    S.data = null; S.error = note; showStatus(null); showNotice([note], true);
    renderSide(); renderView();
  }
  // sel: the [layer, head] selected when d was asked for
  function accept(d, sel) {
    if (S.timer) { clearInterval(S.timer); S.timer = null; }
    S.data = d; S.error = null; S.urlSel = null;
    const names = d.layers.map((l) => l.name);
    // a layer or head picked while d was computed stays picked (its exact map or steps: asked next)
    const moved = !!sel && names.includes(S.layer) && (S.layer !== sel[0] || S.head !== sel[1]);
    if (moved && (lg.isLong(d) || S.view === "step")) S.pending = true;
    if (!names.includes(S.layer)) { S.layer = d.step ? d.step.layer : names[0]; S.head = d.step ? d.step.head : 0; S.heads = new Set([S.head]); }
    if (d.step && !moved) { S.layer = d.step.layer; S.head = d.step.head; }
    if (![...S.heads].length) S.heads = new Set([S.head]);
    const notes = [];
    if (d.random) notes.push(["notice.random"]);
    // a model whose positions stop before 2,048 tokens (qkv.apps.serve.long.map_limit) says so
    const ownCap = d.positions && d.limit < d.positions && d.limit < 2048;
    const pieces = (d.translation && d.translation.pieces) || [];
    if (pieces.length > 1) notes.push([d.truncated ? "notice.splitCut" : "notice.split", { n: pieces.length, limit: d.limit, piece: d.translation.piece + 1, cmd: "qkv translate" }]);
    else if (d.truncated) notes.push([ownCap ? "notice.cutPositions" : d.notice_key || "notice.cut", { n: d.tokens.length, limit: d.limit, positions: d.positions }]);
    else if (d.notice) notes.push(d.notice);
    for (const w of (d.translation && d.translation.warnings) || []) notes.push(["warn." + w.code, warnVars(w)]);
    if (lg.isLong(d)) notes.push(["notice.long", { n: d.tokens.length, k: d.layers[0].pooled.k }]);
    notes.push(...cmp.notes()); // compare: B cut, B failed, A and B of different lengths
    showNotice(notes, !!d.random);
    $("#tabs .tab[data-view='trans']").disabled = false;
    $("#tabs .tab[data-view='lens']").hidden = !lens.applies(d); // a decoder's answers only
    renderSide(); renderView();
  }

  // ---------- start ----------
  async function start() {
    engine = window.qkvEngine.choose(); // qkv serve's API, the answer saved in the page, or window.QKV_ENGINE
    S.offline = !engine.live; // a saved answer (qkv view, notebooks): no model runs, no controls
    lg = window.qkvLong.create({ S, el, t, LONG_ROWS, renderView });
    cmp = window.qkvCompare.create({ S, $, el, t, elt, data, heatmap, short, viewWidth, fmt, refresh, weightsOf: lg.weightsOf });
    lens = window.qkvLens.create({ S, el, t, elt, data, heatmap, short, viewWidth, fmt, selectHead, renderView, showTip, hideTip, weightsOf: lg.weightsOf, LONG_ROWS, engine });
    document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => {
      S.view = b.dataset.view; setTabs(); renderView();
      if (S.view === "step" && S.data && !S.offline && !S.data.step_unavailable && (!S.data.step || S.data.step.layer !== S.layer || S.data.step.head !== S.head)) refresh();
    }));
    $("#layer").addEventListener("change", () => { const L = layers().find((l) => l.name === $("#layer").value); selectHead(L.name, L.heads.includes(S.head) ? S.head : L.heads[0]); });
    $("#head").addEventListener("change", () => selectHead(S.layer, +$("#head").value));
    let resized = null; // one redraw when the window stops changing (a long answer's takes ~0.2 s)
    window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(renderView, 120); });
    if (S.offline) {
      const [strings, saved] = await Promise.all([engine.strings(), engine.saved()]);
      S.strings = strings;
      $("#bar").hidden = true;
      fillLang();
      accept(saved); applyLang();
      document.body.dataset.ready = "1";
      return;
    }
    const [strings, health] = await Promise.all([engine.strings(), engine.health()]);
    S.strings = strings; S.models = health.models;
    fillLang();
    const ms = $("#model");
    ms.replaceChildren(...health.models.map((m) => { const o = el("option", "", modelLabel(m)); o.value = m.name; return o; }));
    const q = new URLSearchParams(location.search);
    for (const [k, v] of new URLSearchParams(location.hash.slice(1))) if (k === "text" || k === "text2") q.set(k, v); // long texts (compare.js writeURL)
    if (q.get("model")) ms.value = q.get("model");
    if (q.get("text")) $("#text").value = q.get("text");
    if (q.get("translate") === "1") $("#translate").checked = true;
    if (q.get("view") && RENDER[q.get("view")]) S.view = q.get("view");
    if (q.get("lang") && strings.languages[q.get("lang")]) S.lang = q.get("lang");
    cmp.readURL(q); // beam, layer, head, heads off, compare, text2
    $("#lang").value = S.lang; applyLang();
    $("#run").addEventListener("click", refresh);
    $("#text").addEventListener("keydown", (e) => { if (e.key === "Enter") refresh(); });
    ms.addEventListener("change", () => { const m = S.models.find((x) => x.name === ms.value); $("#translate").checked = !!(m && m.translator && m.name !== "random"); refresh(); });
    $("#translate").addEventListener("change", refresh);
    $("#beam").addEventListener("change", () => { if ($("#translate").checked) refresh(); });
    cmp.wire();
    await refresh();
  }
  function fillLang() {
    const ls = $("#lang");
    ls.replaceChildren(...Object.entries(S.strings.languages).map(([k, v]) => { const o = el("option", "", v); o.value = k; return o; }));
    ls.value = S.lang;
    ls.addEventListener("change", () => { S.lang = ls.value; applyLang(); renderSide(); renderView(); });
  }
  document.addEventListener("DOMContentLoaded", () => { start().catch((err) => { showNotice([S.strings ? ["error.start", { err }] : String(err)], true); console.error(err); }); });
})();
