// qkv explorer: matrices of any size, and how they are painted. A matrix is {R, C, data, lo, hi,
// nulls, get(i, j)}: made from an answer's nested arrays (JSON maps, ≤ 128 tokens) or decoded
// from a long answer's packed ones (qkv/apps/serve/long.py: uint16 in base64, a bitset, or a rule
// over another matrix), decoded once, when first drawn. null (−∞) is NaN in data. Painting is
// one ImageData over the map's pixels (never a rectangle per cell): a pixel over several cells
// shows the largest weight under it (other matrices: the value of largest magnitude, with its
// sign), so that a peak is never averaged away; hover looks up the one cell under the pointer.
"use strict";
(() => {
  const NULL = 65535; // the uint16 code of −∞ (long.py's _NULL)
  const GREY = [187, 187, 187]; // −∞

  function finish(R, C, data) {
    let lo = Infinity, hi = -Infinity, nulls = false;
    for (let k = 0; k < data.length; k++) {
      const v = data[k];
      if (v !== v) nulls = true; else { if (v < lo) lo = v; if (v > hi) hi = v; }
    }
    if (lo === Infinity) lo = hi = 0;
    return { R, C, data, lo, hi, nulls, get: (i, j) => { const v = data[i * C + j]; return v !== v ? null : v; } };
  }
  // nested arrays [R][C] (null: −∞) as a matrix, in float64: the tooltip shows the JSON's number
  function rows(values) {
    const R = values.length, C = R ? values[0].length : 0, data = new Float64Array(R * C);
    for (let i = 0; i < R; i++) { const row = values[i]; for (let j = 0; j < C; j++) data[i * C + j] = row[j] === null ? NaN : row[j]; }
    return finish(R, C, data);
  }
  function bytes(b64) {
    const bin = atob(b64), out = new Uint8Array(bin.length);
    for (let k = 0; k < bin.length; k++) out[k] = bin.charCodeAt(k);
    return out;
  }
  // a packed matrix p of R × C; find(key) → the decoded matrix a rule refers to ("scores",
  // "scaled", "mask", "exact"). The result is kept on p: decoded once.
  function decode(p, R, C, find) {
    if (p._M) return p._M;
    const n = R * C;
    let data;
    if (p.enc === "u16") {
      const raw = bytes(p.data), dv = new DataView(raw.buffer);
      data = new Float32Array(n);
      for (let k = 0; k < n; k++) { const q = dv.getUint16(2 * k, true); data[k] = q === NULL ? NaN : p.lo + q * p.step; }
    } else if (p.enc === "bits") {
      const raw = bytes(p.data);
      data = new Float32Array(n);
      for (let k = 0; k < n; k++) data[k] = (raw[k >> 3] >> (k & 7)) & 1;
    } else if (p.enc === "scaled") { // scores × by
      const s = find(p.of).data;
      data = new Float32Array(n);
      for (let k = 0; k < n; k++) data[k] = s[k] * p.by;
    } else if (p.enc === "masked") { // scaled where the mask is 1, −∞ elsewhere
      const s = find(p.of).data, mk = find("mask").data;
      data = new Float32Array(n);
      for (let k = 0; k < n; k++) data[k] = mk[k] ? s[k] : NaN;
    } else if (p.enc === "ref") return (p._M = find(p.of));
    else throw new Error("unknown packing " + p.enc);
    return (p._M = finish(R, C, data));
  }

  // paint M into the 2-D context g over device pixels (x0, y0, w, h); opt: {prob, m (the
  // diverging scale's ±max), seqRGB, divRGB, rowsShown (rows after it faded)}
  function paint(g, M, x0, y0, w, h, opt) {
    if (w < 1 || h < 1) return;
    const img = g.createImageData(w, h), px = img.data, { R, C, data } = M, prob = !!opt.prob;
    const span = (n, N) => { // the cells [a, b) under each of N pixels over n cells
      const a = new Int32Array(N), b = new Int32Array(N);
      for (let p = 0; p < N; p++) { a[p] = Math.floor(p * n / N); b[p] = Math.max(a[p] + 1, Math.floor((p + 1) * n / N)); }
      return [a, b];
    };
    const [ra, rb] = span(R, h), [ca, cb] = span(C, w);
    // a short answer's cell covers many pixels: its colour is worked out once per run of
    // pixels over the same cells, and a pixel row over the same rows as the one above is a
    // copy of it (per pixel, the colour arrays alone were most of a map's time and garbage)
    for (let y = 0; y < h; y++) {
      if (y > 0 && ra[y] === ra[y - 1] && rb[y] === rb[y - 1]) { px.copyWithin(4 * y * w, 4 * (y - 1) * w, 4 * y * w); continue; }
      const faded = opt.rowsShown !== undefined && ra[y] > opt.rowsShown;
      let r = 0, gr = 0, b = 0;
      for (let x = 0; x < w; x++) {
        if (x === 0 || ca[x] !== ca[x - 1] || cb[x] !== cb[x - 1]) {
          let v = NaN;
          for (let i = ra[y]; i < rb[y]; i++) {
            const base = i * C;
            for (let j = ca[x]; j < cb[x]; j++) {
              const c = data[base + j];
              if (c === c && (v !== v || (prob ? c > v : Math.abs(c) > Math.abs(v)))) v = c;
            }
          }
          const rgb = v !== v ? GREY : prob ? opt.seqRGB(v) : opt.divRGB(v, opt.m);
          [r, gr, b] = faded ? rgb.map((c) => 255 - 0.15 * (255 - c)) : rgb;
        }
        const k = 4 * (y * w + x);
        px[k] = r; px[k + 1] = gr; px[k + 2] = b; px[k + 3] = 255;
      }
    }
    g.putImageData(img, x0, y0);
  }

  // M as nested arrays of at most `size` cells a side, each the largest value (prob) or the value
  // of largest magnitude of its kr × kc block (as painted), with every block's first row and
  // column label: what the downloads of a long answer hold
  function pool(M, rowLabels, colLabels, size, prob) {
    const kr = Math.max(1, Math.ceil(M.R / size)), kc = Math.max(1, Math.ceil(M.C / size));
    const values = [];
    for (let a = 0; a < M.R; a += kr) {
      const row = [];
      for (let b = 0; b < M.C; b += kc) {
        let v = NaN;
        for (let i = a; i < Math.min(M.R, a + kr); i++) for (let j = b; j < Math.min(M.C, b + kc); j++) {
          const c = M.data[i * M.C + j];
          if (c === c && (v !== v || (prob ? c > v : Math.abs(c) > Math.abs(v)))) v = c;
        }
        row.push(v !== v ? null : Math.round(v * 1000) / 1000);
      }
      values.push(row);
    }
    const every = (xs, k) => xs.filter((_, i) => i % k === 0);
    return { values, rows: every(rowLabels, kr), cols: every(colLabels, kc), kr, kc };
  }

  window.qkvMaps = { rows, decode, paint, pool, matrix: finish };
})();
