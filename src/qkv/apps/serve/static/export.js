// qkv explorer: download what a view shows. The picture as SVG, built here from the numbers
// (one <rect> per weight, token labels, colour scale), or as PNG (that SVG drawn into a canvas
// at 3× its pixels, for print); the numbers as JSON (tokens, layer, head, the weights exactly
// as the API returned them, and what the view shows) or CSV (key tokens across, one row per
// query token). app.js calls qkvExport.attach(root, ctx) after it draws a view, and draws
// with this file's head colours and colour scales.
// Token text reaches the page only as textContent, and the SVG only through xml().
"use strict";
(() => {
  const MAX_SIDE = 128; // picture cells per matrix side; a larger matrix: k×k block means, noted
  const THUMB = 24; // model-view thumbnails: at most 24×24 cells, each the max under it (as on screen)
  const MAX_LINES = 50000; // head-view lines in one SVG; beyond, the weakest are left out, noted
  const PNG_SCALE = 3; // print resolution: 3 device pixels per CSS pixel (288 dpi)
  const MAX_PNG_PIXELS = 40e6; // a canvas a tab can still hold; a larger picture gets a lower scale
  const MAX_BYTES = 32 * 1024 * 1024; // one download; a larger one is refused with a message
  const FONT = "'Noto Sans', 'Noto Sans Myanmar', 'Noto Sans Bengali', 'Noto Sans CJK SC', 'DejaVu Sans', sans-serif";
  const HEAD_COLORS = ["#2557c7", "#d9480f", "#2b8a3e", "#ae3ec9", "#c92a2a", "#1098ad",
    "#e67700", "#5f3dc4", "#087f5b", "#a61e4d", "#364fc7", "#5c940d", "#862e9c", "#0b7285",
    "#d6336c", "#495057"]; // app.js draws with these too: a head's colour on screen and on paper
  const EN = { // used when strings.json lacks a key (an older strings file, a test page)
    "export.download": "Download",
    "export.svg": "The picture on screen as SVG (vector, with token labels and colour scale)",
    "export.png": "The picture as PNG at print resolution (3× the pixels)",
    "export.json": "The numbers as JSON: tokens, layer, head, weights and what this view shows",
    "export.csv": "The weights of this layer and head as CSV: key tokens across, one row per query token",
    "export.tooBig": "Too large to download ({size}; the limit is {limit}).",
    "export.failed": "Download failed: {error}",
    "export.saved": "Saved {name}",
    "grid.head": "head {head}",
    "grid.thumbTitle": "{layer}, head {head}",
    "map.grey": "grey = −∞",
    "compare.legend": "blue: B lower than A · white: the same · red: B higher than A",
    "svg.random": "{model} (random weights)",
    "svg.tokens": "tokens:",
    "svg.probe": "“{token}” → {candidates}: {deciding} of {n} heads decide",
    "svg.dla": "{layer}, head {head}: {v} on “{pred}” (position {i})",
    "svg.up": "up: {tokens}",
    "svg.down": "down: {tokens}",
    "svg.lens": "logit lens: probability of each cell's top token",
    "svg.lensSpan": "logit lens: probability of each cell's top token (positions {a}–{b} of {n})",
    "svg.blocks": "each cell: the mean of {k}×{k} values ({r} × {c}; labels: every block's first token)",
    "svg.weakest": "the {n} weakest lines (weight < {w}) are left out",
  };
  // the words of a picture, in the page's language (strings.json, else EN): the view being
  // drawn sets `pic` (describe), so that the panels need no context of their own
  let pic = null;
  const word = (key, vars) => say(pic || {}, key, vars);

  // ---------- small helpers ----------
  // XML 1.0 cannot hold C0 controls (but tab, newline, return), lone surrogates, U+FFFE/FFFF
  const NOT_XML = /[^\t\n\r\u0020-\uD7FF\uE000-\uFFFD\u{10000}-\u{10FFFF}]/gu;
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function xml(s) { return String(s).replace(NOT_XML, "\uFFFD").replace(/[&<>"']/g, (c) => ESC[c]); }
  const num = (v) => String(Math.round(v * 100) / 100); // coordinates: 2 decimals are plenty
  const num3 = (v) => String(Math.round(v * 1000) / 1000); // opacities
  function clip(s, n) { s = String(s); return s.length > n ? s.slice(0, n - 1) + "…" : s; }
  // numbers as the page prints them (app.js uses these too): a minus sign (U+2212), and a value
  // that rounds to zero is 0 ("0.00", never "-0.00" or "-.00"); null is −∞ (a masked score)
  function fixed(v, d) { const s = v.toFixed(d); return /^-[0.]*$/.test(s) ? s.slice(1) : s.replace(/^-/, "\u2212"); }
  function fmt(v) { return v === null || v === undefined ? "−∞" : fixed(v, Math.abs(v) >= 100 ? 1 : 3); }
  // a value written in its heat-map cell: 2 decimals (0 for |v| >= 10 and for integer maps)
  function cellText(v, ints) { return v === null || v === undefined ? "−∞" : fixed(v, Math.abs(v) >= 10 || ints ? 0 : 2); }
  // the colour scales as [r, g, b] (maps.js paints pixels with them) and as "#rrggbb"
  function seqRGB(v) { // 0..1 → white..blue
    const t = Math.max(0, Math.min(1, v));
    return [255 - 218 * t, 255 - 168 * t, 255 - 56 * t];
  }
  function divRGB(v, m) { // -m..m → blue..white..red
    const t = m > 0 ? Math.max(-1, Math.min(1, v / m)) : 0;
    return t >= 0 ? [255, 255 - 170 * t, 255 - 190 * t] : [255 + 200 * t, 255 + 130 * t, 255];
  }
  function seq(v) { return rgb(...seqRGB(v)); } // (app.js uses this one)
  function div(v, m) { return rgb(...divRGB(v, m)); } // (app.js uses this one)
  function rgb(r, g, b) { return "#" + [r, g, b].map((x) => Math.round(x).toString(16).padStart(2, "0")).join(""); }
  function range(values) {
    let lo = Infinity, hi = -Infinity;
    for (const row of values) for (const v of row) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    return lo === Infinity ? [0, 0] : [lo, hi];
  }
  let measure = null;
  function textWidth(s, size) { // layout only: the label's width in the picture's font
    if (!measure) measure = document.createElement("canvas").getContext("2d");
    measure.font = `${size}px ${FONT}`;
    return measure.measureText(String(s)).width;
  }
  // the font size (px, ≤ 9) at which a cell's widest value fits a cell of `cell` pixels, or 0
  // when that would be under 6 px (then the cells show colours only); width(s): s's width at 9 px
  function cellFont(cell, width, prob, ints) {
    const widest = ints ? "00" : prob ? "0.00" : "\u22120.00";
    const size = Math.min(9, Math.floor(9 * (cell - 3) / width(widest)));
    return size >= 6 ? size : 0;
  }
  function sizeText(n) { return n >= 1048576 ? (n / 1048576).toFixed(1) + " MB" : Math.ceil(n / 1024) + " KB"; }

  // k×k block means (nulls skipped): a matrix larger than MAX_SIDE cells a side, drawn smaller
  function blocks(values, rows, cols) {
    const R = values.length, C = R ? values[0].length : 0;
    const k = Math.max(1, Math.ceil(Math.max(R, C) / MAX_SIDE));
    if (k === 1) return { values, rows, cols, k };
    const out = [];
    for (let i = 0; i < R; i += k) {
      const row = [];
      for (let j = 0; j < C; j += k) {
        let s = 0, n = 0;
        for (let a = i; a < Math.min(R, i + k); a++) for (let b = j; b < Math.min(C, j + k); b++) if (values[a][b] !== null) { s += values[a][b]; n++; }
        row.push(n ? s / n : null);
      }
      out.push(row);
    }
    return { values: out, rows: rows.filter((_, i) => i % k === 0), cols: cols.filter((_, j) => j % k === 0), k };
  }

  // ---------- SVG panels: {w, h, body}, body drawn at (0, 0) ----------
  let gradients = []; // <linearGradient>s of the picture being built
  function gradient(stops) {
    const id = "qkv-g" + gradients.length;
    gradients.push(`<linearGradient id="${id}">` + stops.map(([o, c]) => `<stop offset="${o}" stop-color="${c}"/>`).join("") + "</linearGradient>");
    return id;
  }

  // one matrix as on screen (app.js heatmap()): cells, token labels, numbers in big cells, scale
  function heatPanel(o) {
    const b = blocks(o.values, o.rows, o.cols);
    const values = b.values, R = values.length, C = R ? values[0].length : 0;
    const prob = !!o.prob, feat = !!o.features;
    const [lo, hi] = range(values); const m = Math.max(Math.abs(lo), Math.abs(hi));
    const cell = Math.max(2, Math.min(o.maxCell || 26, Math.floor(o.maxWidth / Math.max(1, C))));
    const cellH = feat ? Math.max(12, Math.min(20, cell)) : cell;
    const fs = 11, stepR = Math.ceil((fs + 1) / cellH), stepC = Math.ceil((fs + 1) / cell);
    const rows = b.rows.map((r) => clip(r, 14)), cols = b.cols.map((c) => clip(c, 10));
    const labW = 6 + Math.max(0, ...rows.filter((_, i) => i % stepR === 0).map((r) => textWidth(r, fs)));
    const colW = Math.max(0, ...cols.filter((_, j) => j % stepC === 0).map((c) => textWidth(c, fs)));
    const labH = 8 + colW * Math.sin(Math.PI / 3);
    const top = o.title ? 22 : 0;
    const x0 = labW, y0 = top + labH;
    const parts = [`<g class="heatmap" data-key="${xml(o.key || "")}" data-rows="${R}" data-cols="${C}">`];
    if (o.title) parts.push(`<text x="0" y="14" font-size="13" font-weight="600" fill="#1d2330">${xml(o.title)}</text>`);
    parts.push(`<g class="cells" transform="translate(${num(x0)},${num(y0)})" shape-rendering="crispEdges">`); // a <rect> per value
    for (let i = 0; i < R; i++) {
      const dim = o.rowsShown !== undefined && i > o.rowsShown ? ' fill-opacity="0.15"' : "";
      for (let j = 0; j < C; j++) {
        const v = values[i][j];
        const fill = v === null ? "#bbbbbb" : prob ? seq(v) : div(v, m);
        parts.push(`<rect x="${j * cell}" y="${i * cellH}" width="${cell}" height="${cellH}" fill="${fill}"${dim}/>`);
      }
    }
    parts.push(`</g><g transform="translate(${num(x0)},${num(y0)})" fill="none">`, // outline, the step's row
      `<rect width="${C * cell}" height="${R * cellH}" stroke="#ccd" stroke-width="0.5"/>`);
    if (o.highlightRow !== undefined && o.highlightRow < R) {
      parts.push(`<rect x="1" y="${o.highlightRow * cellH + 1}" width="${C * cell - 2}" height="${cellH - 2}" stroke="#e67700" stroke-width="2"/>`);
    }
    parts.push("</g>");
    const cfs = cellFont(cell, (v) => textWidth(v, 9), prob, o.ints); // the values' font: fits the cells
    if (!feat && b.k === 1 && cfs && C <= 24 && R <= 40) { // exact values in big cells
      parts.push(`<g font-size="${cfs}" text-anchor="middle">`);
      for (let i = 0; i < R; i++) for (let j = 0; j < C; j++) {
        const v = values[i][j]; const x = prob ? v : (m ? Math.abs(v) / m : 0);
        const dim = o.rowsShown !== undefined && i > o.rowsShown;
        const s = cellText(v, o.ints);
        parts.push(`<text x="${num(x0 + (j + 0.5) * cell)}" y="${num(y0 + (i + 0.5) * cellH)}" dominant-baseline="central" fill="${dim ? "#aaa" : v !== null && x > 0.6 ? "#fff" : "#222"}">${xml(s)}</text>`);
      }
      parts.push("</g>");
    }
    parts.push(`<g class="rows" font-size="${fs}" fill="#222" text-anchor="end">`);
    rows.forEach((r, i) => { if (i % stepR === 0) parts.push(`<text class="tok-q" x="${num(x0 - 4)}" y="${num(y0 + (i + 0.5) * cellH)}" dominant-baseline="central">${xml(r)}</text>`); });
    parts.push(`</g><g class="cols" font-size="${fs}" fill="#222">`);
    cols.forEach((c, j) => { if (j % stepC === 0) parts.push(`<text class="tok-k" transform="translate(${num(x0 + (j + 0.5) * cell)},${num(y0 - 4)}) rotate(-60)" dominant-baseline="central">${xml(c)}</text>`); });
    parts.push("</g>");
    // the colour scale, as under the map on screen
    const sy = y0 + R * cellH + 8;
    const id = prob ? gradient([[0, seq(0)], [1, seq(1)]]) : gradient([[0, div(-m, m)], [0.5, "#ffffff"], [1, div(m, m)]]);
    const lo0 = prob ? "0" : fmt(-m), hi1 = prob ? "1" : fmt(m);
    const lw = textWidth(lo0, 10) + 4;
    parts.push(`<g class="scale" font-size="10" fill="#667" transform="translate(0,${num(sy)})">`,
      `<text x="0" y="9">${xml(lo0)}</text><rect x="${num(lw)}" y="0" width="120" height="10" fill="url(#${id})" stroke="#ccd" stroke-width="0.5"/>`,
      `<text x="${num(lw + 124)}" y="9">${xml(hi1)}</text>`);
    const notes = [];
    if (values.some((row) => row.includes(null))) notes.push(word("map.grey"));
    if (b.k > 1) notes.push(word("svg.blocks", { k: b.k, r: o.values.length, c: o.values[0].length }));
    if (notes.length) parts.push(`<text x="${num(lw + 132 + textWidth(hi1, 10))}" y="9">${xml(notes.join("; "))}</text>`);
    parts.push("</g></g>");
    const w = Math.max(x0 + C * cell + colW * 0.5, lw + 140 + textWidth(notes.join("; "), 10), o.title ? textWidth(o.title, 13) : 0);
    return { w: Math.ceil(w), h: Math.ceil(sy + 14), body: parts.join("\n"), downsampled: b.k };
  }

  // head view (app.js renderHead): queries left, keys right, a line per weight, blocks per key
  function linesPanel(L, active, q) {
    const RH = 24, W = 240, fs = 13, R = L.q_tokens.length, C = L.k_tokens.length;
    const qs = L.q_tokens.map((x) => clip(x, 24)), ks = L.k_tokens.map((x) => clip(x, 24));
    const lw = 8 + Math.max(0, ...qs.map((x) => textWidth(x, fs))), rw = 12 + Math.max(0, ...ks.map((x) => textWidth(x, fs)));
    const pinned = q !== null && q !== undefined;
    let lines = [];
    for (const [, hi] of active) for (let i = 0; i < R; i++) {
      if (pinned && i !== q) continue;
      for (let j = 0; j < C; j++) { const v = L.weights[hi][i][j]; if (v) lines.push([v, hi, i, j]); }
    }
    let note = "";
    if (lines.length > MAX_LINES) {
      lines.sort((a, b) => b[0] - a[0]);
      note = word("svg.weakest", { n: lines.length - MAX_LINES, w: fmt(lines[MAX_LINES - 1][0]) });
      lines = lines.slice(0, MAX_LINES);
    }
    const parts = [`<g class="headview" font-size="${fs}" fill="#1d2330">`];
    qs.forEach((x, i) => {
      if (pinned && i === q) parts.push(`<rect x="0" y="${i * RH + 2}" width="${num(lw)}" height="${RH - 4}" rx="3" fill="#ffd25a"/>`);
      parts.push(`<text class="tok-q" x="${num(lw - 6)}" y="${i * RH + RH / 2}" text-anchor="end" dominant-baseline="central">${xml(x)}</text>`);
    });
    ks.forEach((x, j) => parts.push(`<text class="tok-k" x="${num(lw + W + 6)}" y="${j * RH + RH / 2}" dominant-baseline="central">${xml(x)}</text>`));
    parts.push(`<g class="lines" stroke-width="${pinned ? 3 : 2}">`);
    for (const [v, hi, i, j] of lines) {
      parts.push(`<line x1="${num(lw)}" y1="${i * RH + RH / 2}" x2="${num(lw + W)}" y2="${j * RH + RH / 2}" stroke="${HEAD_COLORS[hi % HEAD_COLORS.length]}" stroke-opacity="${num3(Math.min(1, v))}"/>`);
    }
    parts.push("</g><g class=\"blocks\">");
    const bx = lw + W + rw;
    for (let j = 0; j < C; j++) active.forEach(([, hi], a) => {
      const w = L.weights[hi];
      const v = pinned ? w[q][j] : w.reduce((s, r) => s + r[j], 0) / R;
      parts.push(`<rect x="${num(bx + a * 13)}" y="${j * RH + 4}" width="12" height="16" fill="${HEAD_COLORS[hi % HEAD_COLORS.length]}" fill-opacity="${num3(Math.max(0.04, Math.min(1, v)))}"/>`);
    });
    parts.push("</g>");
    const H = Math.max(R, C) * RH;
    const ly = H + 16; // legend: the heads drawn, in their colours
    parts.push(`<g class="legend" font-size="11">`);
    active.forEach(([h, hi], a) => parts.push(`<rect x="${a * 64}" y="${ly - 10}" width="12" height="12" fill="${HEAD_COLORS[hi % HEAD_COLORS.length]}"/><text x="${a * 64 + 16}" y="${ly}">${xml(word("grid.head", { head: h }))}</text>`));
    if (note) parts.push(`<text x="0" y="${ly + 18}" fill="#667">${xml(note)}</text>`);
    parts.push("</g></g>");
    return { w: Math.ceil(Math.max(bx + active.length * 13, active.length * 64)), h: ly + (note ? 24 : 6), body: parts.join("\n") };
  }

  // model view (app.js renderModel): a thumbnail per layer × head, colour = √weight
  function gridPanel(ls, ctx) {
    const S = ctx.S, H = Math.max(...ls.map((l) => l.heads.length)), TS = 56, GAP = 6, fs = 11;
    const labs = ls.map((l) => short(ctx, l.name));
    const lw = 10 + Math.max(...labs.map((x) => textWidth(x, fs)));
    const parts = [`<g class="grid" font-size="${fs}" fill="#1d2330">`];
    for (let h = 0; h < H; h++) parts.push(`<text x="${num(lw + h * (TS + GAP) + TS / 2)}" y="12" text-anchor="middle" fill="#667">${xml(word("grid.head", { head: h }))}</text>`);
    ls.forEach((L, li) => {
      const y = 20 + li * (TS + GAP);
      parts.push(`<text x="${num(lw - 8)}" y="${y + TS / 2}" text-anchor="end" dominant-baseline="central">${xml(labs[li])}</text>`);
      L.heads.forEach((h, hi) => {
        const w = L.weights[hi], R = w.length, C = R ? w[0].length : 0;
        const nr = Math.min(THUMB, R), nc = Math.min(THUMB, C), ch = TS / Math.max(1, nr), cw = TS / Math.max(1, nc);
        const x = lw + hi * (TS + GAP);
        const off = S.off.has(L.name + "|" + h) ? ' opacity="0.35"' : "";
        parts.push(`<g class="thumb" data-layer="${li}" data-head="${xml(h)}" transform="translate(${num(x)},${y})"${off} shape-rendering="crispEdges">`);
        for (let a = 0; a < nr; a++) for (let b = 0; b < nc; b++) { // the max of the cells under a thumbnail cell, as on screen
          const i0 = Math.floor(a * R / nr), i1 = Math.max(i0 + 1, Math.floor((a + 1) * R / nr));
          const j0 = Math.floor(b * C / nc), j1 = Math.max(j0 + 1, Math.floor((b + 1) * C / nc));
          let v = 0; for (let i = i0; i < i1; i++) for (let j = j0; j < j1; j++) v = Math.max(v, w[i][j] || 0);
          parts.push(`<rect x="${num(b * cw)}" y="${num(a * ch)}" width="${num(cw)}" height="${num(ch)}" fill="${seq(Math.sqrt(Math.min(1, v)))}"/>`);
        }
        const sel = L.name === S.layer && h === S.head;
        parts.push(`<rect width="${TS}" height="${TS}" fill="none" stroke="${sel ? "#2557c7" : "#ccd"}" stroke-width="${sel ? 3 : 1}"/></g>`);
      });
    });
    const gh = 20 + ls.length * (TS + GAP);
    parts.push("</g>");
    return { w: Math.ceil(lw + H * (TS + GAP)), h: gh, body: parts.join("\n") };
  }

  // the decoder's self-attention bars of one step (app.js renderTrans)
  function barsPanel(title, toks, w) {
    const fs = 12, lw = 8 + Math.max(0, ...toks.map((x) => textWidth(clip(x, 16), fs)));
    const parts = [`<g class="bars" font-size="${fs}" fill="#1d2330"><text x="0" y="14" font-size="13" font-weight="600">${xml(title)}</text>`];
    toks.forEach((x, j) => {
      const y = 24 + j * 20;
      parts.push(`<text class="tok-k" x="${num(lw - 6)}" y="${y + 10}" text-anchor="end" dominant-baseline="central">${xml(clip(x, 16))}</text>`,
        `<rect x="${num(lw)}" y="${y + 4}" width="${num(180 * w[j])}" height="12" fill="#2557c7"/>`,
        `<text x="${num(lw + 186)}" y="${y + 10}" dominant-baseline="central" fill="#667">${xml(fmt(w[j]))}</text>`);
    });
    parts.push("</g>");
    return { w: Math.ceil(Math.max(lw + 240, textWidth(title, 13))), h: 28 + toks.length * 20, body: parts.join("\n") };
  }

  function textPanel(lines, size, color) {
    const parts = [`<g class="text" font-size="${size}" fill="${color || "#1d2330"}">`];
    lines.forEach((l, i) => parts.push(`<text x="0" y="${(i + 1) * (size + 5) - 4}">${xml(l)}</text>`));
    parts.push("</g>");
    return { w: Math.ceil(Math.max(0, ...lines.map((l) => textWidth(l, size)))), h: lines.length * (size + 5), body: parts.join("\n") };
  }
  function wrapWords(words, width, size) { // token lists as lines no wider than width
    const out = []; let line = "";
    for (const w of words) {
      const next = line ? line + " " + w : w;
      if (line && textWidth(next, size) > width) { out.push(line); line = w; } else line = next;
    }
    if (line) out.push(line);
    return out;
  }

  // panels in rows no wider than maxW (the step view's cards wrap the same way)
  function compose(title, panels, maxW) {
    const M = 16, GAP = 18;
    let x = M, y = M, rowH = 0, W = 0;
    const placed = [];
    for (const p of panels) {
      if (p.newRow || (x > M && x + p.w > maxW)) { x = M; y += rowH + GAP; rowH = 0; }
      placed.push(`<g transform="translate(${x},${y})">\n${p.body}\n</g>`);
      x += p.w + GAP; rowH = Math.max(rowH, p.h); W = Math.max(W, x - GAP + M);
      if (p.fullRow) { x = maxW; }
    }
    const H = Math.ceil(y + rowH + M);
    W = Math.ceil(W);
    const svg = ['<?xml version="1.0" encoding="UTF-8"?>',
      `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="${xml(FONT)}">`,
      `<title>${xml(title)}</title>`, `<defs>${gradients.join("")}</defs>`,
      `<rect width="${W}" height="${H}" fill="#ffffff"/>`, ...placed, "</svg>", ""].join("\n");
    return { svg, W, H };
  }

  // ---------- what each view shows ----------
  const layerOf = (S) => { const ls = S.data.layers; return ls.find((l) => l.name === S.layer) || ls[0]; };
  function short(ctx, name) { return ctx.short ? ctx.short(name) : name; }
  function matTitle(ctx, key) { return (ctx.t && ctx.t("title." + key)) || key; } // as app.js titles its cards

  // The translation view shows the cross-attention layer matching the selection (app.js
  // renderTrans picks it the same way) and the decoder self-attention layer beside it.
  function transLayers(S) {
    const ls = S.data.layers, cross = ls.filter((l) => l.kind === "cross"), dec = ls.filter((l) => l.kind === "causal");
    let cl = cross.find((l) => l.name.replace("cross_attn", "") === String(S.layer).replace(/(self|cross)_attn/, "")) || cross[cross.length - 1];
    if (S.layer && cross.some((l) => l.name === S.layer)) cl = cross.find((l) => l.name === S.layer);
    const dl = cl && (dec.find((l) => l.name === cl.name.replace("cross_attn", "self_attn")) || dec[dec.length - 1]);
    return { cl, dl };
  }

  // {L, hi, head, view, shown, panels, maxW}: the main layer and head (JSON, CSV, file name),
  // the view's other numbers (JSON "shown"), and the picture's panels
  function describe(ctx) {
    const S = ctx.S, d = S.data, view = S.view;
    pic = ctx;
    const named = (layer, head) => word("grid.thumbTitle", { layer, head });
    let L = layerOf(S), head = S.head;
    const heat = (M, h, extra) => { // one head's weights; a head the layer lacks: its first (as app.js)
      const i = Math.max(0, M.heads.indexOf(h));
      return heatPanel(Object.assign({ values: M.weights[i], rows: M.q_tokens, cols: M.k_tokens, prob: true, maxWidth: 600, maxCell: 44, key: "weights", title: named(M.name, M.heads[i]) }, extra || {}));
    };
    const out = { view, shown: {}, panels: [], maxW: 1200 };
    if (view === "step") {
      const st = d.step;
      if (st && st.layer === S.layer && st.head === S.head) {
        out.shown = { step: st };
        out.panels = st.matrices.map((m) => heatPanel({ key: m.key, values: m.values, rows: m.rows, cols: m.cols, maxWidth: 340,
          prob: m.key === "weights" || m.key === "mask", features: ["x", "context", "q", "k", "v", "output", "concat", "wo"].includes(m.key),
          ints: m.key === "mask", title: `${matTitle(ctx, m.key)}  ${m.shape[0]}×${m.shape[1]}` }));
        out.maxW = 1150;
      } else out.panels = [heat(L, head)];
    } else if (view === "head") {
      const active = L.heads.map((h, hi) => [h, hi]).filter(([h]) => S.heads.has(h));
      out.shown = { heads_on: active.map(([h, hi]) => ({ head: h, colour: HEAD_COLORS[hi % HEAD_COLORS.length], weights: L.weights[hi] })),
        pinned_query: S.pinned, lines: "one per (query, key, head on): stroke-opacity = weight; blocks: the key's weight (pinned query) or its mean over queries" };
      out.panels = [linesPanel(L, active, S.pinned)];
    } else if (view === "model") {
      out.shown = { layers: d.layers, heads_off: [...S.off], thumbnails: `max over the cells under each of at most ${THUMB}×${THUMB} cells, colour = √weight` };
      const words = wrapWords([word("svg.tokens"), ...d.tokens.map((x) => clip(x, 24))], 1000, 11);
      out.panels = [gridPanel(d.layers, ctx), Object.assign(textPanel(words, 11, "#667"), { newRow: true })];
    } else if (view === "trans" && d.translation) {
      const tr = d.translation, { cl, dl } = transLayers(S);
      const step = Math.min(S.step, tr.target_tokens.length - 1);
      L = cl; head = cl.heads[Math.max(0, cl.heads.indexOf(S.head))];
      out.panels = [Object.assign(textPanel([`${d.text} → ${tr.text}`], 13), { fullRow: true }), heat(cl, head, { highlightRow: step, rowsShown: step })];
      out.shown = { translation: tr, step };
      if (dl) {
        const dh = dl.heads[Math.max(0, dl.heads.indexOf(S.head))], w = (dl.weights[dl.heads.indexOf(dh)][step] || []).slice(0, step + 1);
        out.shown.decoder_self = { layer: dl.name, head: dh, query: dl.q_tokens[step], keys: dl.k_tokens.slice(0, w.length), weights: w };
        out.panels.push(barsPanel(`${named(dl.name, dh)}: ${clip(dl.q_tokens[step], 16)}`, dl.k_tokens.slice(0, w.length), w));
      }
    } else if (view === "diff" && ctx.diff) { // compare.js: A, B and B − A of one layer and head
      const df = ctx.diff;
      L = df.a; head = df.head;
      out.shown = { compare: { a: { text: df.textA, heads_off: df.offA },
        b: { text: df.textB, heads_off: df.offB, tokens: df.tokensB, q_tokens: df.b.q_tokens, k_tokens: df.b.k_tokens,
          weights: df.b.weights[Math.max(0, df.b.heads.indexOf(head))] },
        diff: { rows: df.rows, cols: df.cols, values: df.values,
          note: "B − A, position by position (3 decimals); a label A/B where the two tokens differ" } } };
      out.matrix = { rows: df.rows, cols: df.cols, values: df.values }; // the CSV: B − A
      const size = { maxWidth: 400, maxCell: 30 }; // the three in a row
      out.panels = [heat(df.a, head, { title: `A: ${named(df.a.name, head)}`, ...size }), heat(df.b, head, { title: `B: ${named(df.b.name, head)}`, ...size }),
        heatPanel({ key: "diff", values: df.values, rows: df.rows, cols: df.cols, title: `B − A: ${named(L.name, head)}`, ...size }),
        Object.assign(textPanel([`B − A: ${word("compare.legend")}`, `A: ${clip(df.textA, 120)}`,
          `B: ${clip(df.textB, 120)}`], 11, "#667"), { newRow: true })];
      out.maxW = 1500;
    } else if (view === "work" && d.probe && !d.probe.error && d.probe.rows.length) {
      const pr = d.probe;
      out.shown = { probe: pr, ablation: d.ablation || null, heads_off: [...S.off] };
      out.panels = [textPanel([word("svg.probe", { token: pr.token, candidates: pr.candidates.join(", "), deciding: pr.deciding, n: pr.n_heads })], 13),
        Object.assign(heatPanel({ key: "probe", values: pr.rows.map((r) => pr.candidates.map((c) => r.scores[c] ?? null)), rows: pr.rows.map((r) => `${short(ctx, r.layer)} h${r.head}`),
          cols: pr.candidates, prob: true, maxWidth: 60 * pr.candidates.length, maxCell: 60 }), { newRow: true }),
        heat(L, head)];
    } else if (view === "lens" && S.lens && S.lens.lens) { // lens.js: the logit lens, the selected head's attribution
      const lz = S.lens, tb = lz.lens, at = lz.dla && lz.dla.heads.find((h) => h.layer === L.name && h.head === head);
      out.shown = { lens: lz };
      out.matrix = { corner: "layer \\ position", rows: tb.layers, cols: lz.tokens, values: tb.probs.map((r) => r.map((c) => c[0])) }; // the CSV: top-1 probabilities
      // a long text: the pictures hold the table's window of positions (lens.js), the CSV all
      const [a, b] = S.lensWindow || [0, lz.tokens.length], cut = (xs) => xs.slice(a, b);
      const lensTitle = S.lensWindow ? word("svg.lensSpan", { a, b: b - 1, n: lz.tokens.length }) : word("svg.lens");
      out.panels = [heatPanel({ key: "lens", values: out.matrix.values.map(cut), rows: tb.layers, cols: cut(lz.tokens), prob: true, maxWidth: 900, maxCell: 30, title: lensTitle }),
        Object.assign(textPanel(tb.layers.flatMap((n, i) => wrapWords([`${n}:`, ...cut(tb.tokens[i]).map((c) => clip(c[0], 12))], 1100, 11)), 11, "#334"), { newRow: true })];
      const k = L.pooled ? L.pooled.k : 1; // (a long answer's maps: pooled in k × k blocks)
      const amounts = (xs) => xs.map(([x, v]) => `${x} ${fmt(v)}`).join(", ");
      if (at) out.panels.push(Object.assign(textPanel([word("svg.dla", { layer: L.name, head, v: fmt(at.target), pred: lz.predicted, i: lz.position }),
        word("svg.up", { tokens: amounts(at.up) }), word("svg.down", { tokens: amounts(at.down) })], 11, "#334"), { newRow: true }), heat(L, head, { highlightRow: Math.floor(lz.position / k) }));
      else out.panels.push(Object.assign(heat(L, head), { newRow: true }));
      out.maxW = 1200;
    } else {
      out.shown = view === "work" ? { probe: d.probe || null, ablation: d.ablation || null, heads_off: [...S.off] } : {};
      out.panels = [heat(L, head)];
    }
    out.L = L; out.hi = Math.max(0, L.heads.indexOf(head)); out.head = L.heads[out.hi];
    return out;
  }

  // ---------- the four formats ----------
  function fileName(S, desc, ext) {
    const part = (s) => String(s).replace(/[^A-Za-z0-9._-]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 60) || "x";
    return ["qkv", part(S.data.model || "page"), part(desc.L.name), "h" + desc.head, desc.view].join("_") + "." + ext;
  }
  function toSVG(ctx) {
    gradients = [];
    const desc = describe(ctx);
    const S = ctx.S;
    const model = S.data.model || "";
    const sub = `${S.data.random ? word("svg.random", { model }) : model} · ${desc.L.name} · ${word("grid.head", { head: desc.head })}`;
    const head = textPanel([sub], 11, "#667");
    head.fullRow = true;
    const doc = compose(`qkv ${desc.view}: ${sub}`, [head, ...desc.panels], desc.maxW);
    return { desc, ...doc };
  }
  function toJSON(ctx) {
    const S = ctx.S, d = S.data, desc = describe(ctx), L = desc.L;
    const out = { qkv_export: 1, view: desc.view, model: d.model, random: !!d.random, text: d.text, tokens: d.tokens,
      truncated: !!d.truncated, notice: d.notice || null, layer: L.name, kind: L.kind, head: desc.head,
      q_tokens: L.q_tokens, k_tokens: L.k_tokens, weights: L.weights[desc.hi], // exactly as the API returned them
      shown: desc.shown, picture: { colour_scale: "weights: white (0) → blue (1); other matrices (and B − A): blue (−max) → white (0) → red (max); grey = −∞", rows: "queries", columns: "keys" } };
    return { desc, text: JSON.stringify(out) + "\n" };
  }
  // a text cell (a token label) starting with = + - @ tab or CR would be run as a formula by a
  // spreadsheet (OWASP: CSV injection): a leading ' makes it text; numbers are never changed
  function csvField(v) {
    let s = v === null || v === undefined ? "" : String(v);
    if (typeof v === "string" && /^[=+\-@\t\r]/.test(s)) s = "'" + s;
    return /[",\r\n]/.test(s) || s !== s.trim() ? '"' + s.replace(/"/g, '""') + '"' : s;
  }
  function toCSV(ctx) { // as qkv.capture.export.to_csv: key tokens across, a query per row
    const desc = describe(ctx), L = desc.L;
    const m = desc.matrix || { rows: L.q_tokens, cols: L.k_tokens, values: L.weights[desc.hi] };
    const lines = [[m.corner || "query \\ key", ...m.cols].map(csvField).join(",")];
    m.rows.forEach((q, i) => lines.push([q, ...m.values[i]].map(csvField).join(",")));
    return { desc, text: lines.join("\r\n") + "\r\n" };
  }

  // PNG: the SVG drawn into a canvas at PNG_SCALE, with its resolution (pHYs) set to match
  async function toPNG(ctx) {
    const { desc, svg, W, H } = toSVG(ctx);
    const scale = Math.min(PNG_SCALE, Math.sqrt(MAX_PNG_PIXELS / (W * H)));
    const img = new Image(); // a data: URL: the page's CSP allows data: images, not blob:
    img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svg);
    await img.decode();
    const cv = document.createElement("canvas");
    cv.width = Math.max(1, Math.round(W * scale)); cv.height = Math.max(1, Math.round(H * scale));
    const g = cv.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, cv.width, cv.height);
    g.drawImage(img, 0, 0, cv.width, cv.height);
    const blob = await new Promise((ok, no) => cv.toBlob((b) => (b ? ok(b) : no(new Error("the browser could not encode the PNG"))), "image/png"));
    return { desc, blob: await withDpi(blob, 96 * scale) };
  }
  let crcTable = null;
  function crc32(bytes) {
    if (!crcTable) crcTable = Array.from({ length: 256 }, (_, n) => { let c = n; for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1; return c >>> 0; });
    let c = 0xffffffff;
    for (const b of bytes) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  }
  async function withDpi(blob, dpi) { // a pHYs chunk after IHDR: prints at the on-screen size
    const buf = new Uint8Array(await blob.arrayBuffer());
    const ppm = Math.round(dpi / 0.0254);
    const chunk = new Uint8Array(21), v = new DataView(chunk.buffer);
    v.setUint32(0, 9); chunk.set([0x70, 0x48, 0x59, 0x73], 4); v.setUint32(8, ppm); v.setUint32(12, ppm); chunk[16] = 1;
    v.setUint32(17, crc32(chunk.subarray(4, 17)));
    const at = 8 + 25; // signature, then IHDR (length, type, 13 bytes, CRC)
    return new Blob([buf.subarray(0, at), chunk, buf.subarray(at)], { type: "image/png" });
  }

  function save(name, blob) {
    const a = document.createElement("a");
    a.download = name; a.href = URL.createObjectURL(blob); a.hidden = true;
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 60000);
  }

  async function download(ctx, format, msg) {
    const tr = (key, vars) => say(ctx, key, vars);
    try {
      let blob, desc;
      if (format === "png") ({ desc, blob } = await toPNG(ctx));
      else {
        const r = format === "svg" ? toSVG(ctx) : format === "json" ? toJSON(ctx) : toCSV(ctx);
        desc = r.desc;
        const type = { svg: "image/svg+xml", json: "application/json", csv: "text/csv" }[format];
        blob = new Blob([r.svg || r.text], { type: type + ";charset=utf-8" });
      }
      if (blob.size > MAX_BYTES) { msg.textContent = tr("export.tooBig", { size: sizeText(blob.size), limit: sizeText(MAX_BYTES) }); msg.className = "export-msg err"; return; }
      const name = fileName(ctx.S, desc, format);
      save(name, blob);
      msg.textContent = tr("export.saved", { name }); msg.className = "export-msg";
      setTimeout(() => { if (msg.textContent === tr("export.saved", { name })) msg.textContent = ""; }, 4000);
    } catch (err) {
      console.warn(err);
      msg.textContent = tr("export.failed", { error: err && err.message ? err.message : String(err) }); msg.className = "export-msg err";
    }
  }

  function say(ctx, key, vars) {
    const s = (ctx.t && ctx.t(key, vars)) || EN[key] || key;
    return vars ? s.replace(/\{(\w+)\}/g, (m, k) => (k in vars ? String(vars[k]) : m)) : s;
  }

  // the button group at the top of a view
  function attach(root, ctx) {
    if (!ctx || !ctx.S || !ctx.S.data || !ctx.S.data.layers || !ctx.S.data.layers.length) return;
    const bar = document.createElement("div");
    bar.className = "export-bar"; bar.setAttribute("role", "group");
    const label = document.createElement("span");
    label.className = "export-label"; label.textContent = say(ctx, "export.download");
    bar.setAttribute("aria-label", label.textContent);
    const msg = document.createElement("span");
    msg.className = "export-msg"; msg.setAttribute("role", "status");
    bar.append(label);
    for (const f of ["svg", "png", "json", "csv"]) {
      const b = document.createElement("button");
      b.type = "button"; b.className = "export"; b.dataset.format = f;
      b.textContent = f.toUpperCase(); b.translate = false; // a format's name, in every language
      b.title = say(ctx, "export." + f);
      b.addEventListener("click", async () => {
        bar.querySelectorAll("button").forEach((x) => { x.disabled = true; });
        await download(ctx, f, msg);
        bar.querySelectorAll("button").forEach((x) => { x.disabled = false; });
      });
      bar.append(b);
    }
    bar.append(msg);
    root.prepend(bar);
  }

  window.qkvExport = { attach, xml, toSVG, toJSON, toCSV, MAX_SIDE, MAX_BYTES, HEAD_COLORS, seq, div,
    range, seqRGB, divRGB, fmt, cellText, cellFont, textWidth, FONT };
})();
