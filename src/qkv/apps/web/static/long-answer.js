// qkv in-page engine: a long answer's fields (qkv.apps.serve.long), for maps of more than
// 320,000 weights: every head max-pooled, the selected head's map packed (`exact`), each
// query's largest weights (`top`), and step matrices of more than 128 rows packed.
//
//   qkvLongAnswer.fields(layers, layer, head)   {layers (pooled), exact, top}
//   qkvLongAnswer.packedSteps(t, qTok, kTok, scale)  the step view's `matrices`, packed
//   qkvLongAnswer.pack(rows, bits)              {enc: "u16", lo, step, data} or {enc: "bits", data}
//
// layers: as qkvAnswer's ({name, kind, heads, q_tokens, k_tokens, w: [h][Tq][Tk]}).
"use strict";
(() => {
  const TOP_K = 8, NULL = 65535, TOKEN_LIMIT = 128, MAX_CELLS = 320000, STEP_DIMS = 64;
  const A = window.qkvAnswer;

  // qkv.limits.encoder_limit
  const encoderLimit = (heads) => Math.max(8, Math.min(TOKEN_LIMIT, Math.floor(Math.sqrt(Math.floor(MAX_CELLS / Math.max(1, heads))))));

  function base64(bytes) {
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return btoa(s);
  }
  // numpy's rint: half to even
  const rint = (x) => { const f = Math.floor(x), d = x - f; return d > 0.5 ? f + 1 : d < 0.5 ? f : f % 2 === 0 ? f : f + 1; };

  // long.pack: rows (R × C numbers, -Infinity allowed) as uint16 codes lo + q·step, or bits
  function pack(rows, bits = false) {
    const flat = rows.flat();
    if (bits) {
      const out = new Uint8Array(Math.ceil(flat.length / 8));
      flat.forEach((v, i) => { if (v) out[i >> 3] |= 1 << (i & 7); });
      return { enc: "bits", data: base64(out) };
    }
    let lo = Infinity, hi = -Infinity;
    for (const v of flat) if (Number.isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; }
    if (lo === Infinity) { lo = 0; hi = 0; }
    const step = hi > lo ? (hi - lo) / (NULL - 1) : 1.0;
    const q = new Uint16Array(flat.length);
    flat.forEach((v, i) => { q[i] = Number.isFinite(v) ? Math.min(NULL - 1, Math.max(0, rint((v - lo) / step))) : NULL; });
    const bytes = new Uint8Array(q.length * 2);
    q.forEach((v, i) => { bytes[2 * i] = v & 255; bytes[2 * i + 1] = v >> 8; }); // little-endian
    return { enc: "u16", lo, step, data: base64(bytes) };
  }

  // max over k × k blocks (ceil mode) of one head's map
  function pooled(w, k) {
    const R = w.length, C = w[0].length, r = Math.ceil(R / k), c = Math.ceil(C / k);
    return Array.from({ length: r }, (_, a) => Array.from({ length: c }, (_, b) => {
      let m = -Infinity;
      for (let i = a * k; i < Math.min(R, (a + 1) * k); i++) for (let j = b * k; j < Math.min(C, (b + 1) * k); j++) if (w[i][j] > m) m = w[i][j];
      return m;
    }));
  }

  // long.long_fields
  function fields(layers, layer, head) {
    const size = encoderLimit(layers.reduce((a, l) => a + l.heads.length, 0));
    const out = layers.map((l) => {
      const Tq = l.w[0].length, Tk = Tq ? l.w[0][0].length : 0, k = Math.max(1, Math.ceil(Math.max(Tq, Tk) / size));
      const w = k === 1 ? l.w : l.w.map((hw) => pooled(hw, k));
      return { name: l.name, kind: l.kind, heads: l.heads, q_tokens: l.q_tokens, k_tokens: l.k_tokens,
        weights: w.map((hw) => hw.map((r) => r.map((x) => A.round(x)))), pooled: { k, rows: Tq, cols: Tk, how: "max" } };
    });
    const l = layers.find((x) => x.name === layer);
    const hi = l.heads.includes(head) ? l.heads.indexOf(head) : 0;
    const Tq = l.w[0].length, Tk = l.w[0][0].length, k = Math.min(TOP_K, Tk);
    const tops = l.w.map((hw) => hw.map((row) => row.map((v, j) => [v, j]).sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, k)));
    return {
      layers: out,
      exact: { layer, head: l.heads[hi], shape: [Tq, Tk], ...pack(l.w[hi]) },
      top: { layer, k, index: tops.map((h) => h.map((r) => r.map((x) => x[1]))),
        weights: tops.map((h) => h.map((r) => r.map((x) => A.round(x[0])))) },
    };
  }

  // long.packed_steps: t {key: rows}; scaled and masked as rules where they are exactly that
  function packedSteps(t, STEPS, qTok, kTok, scale) {
    const tokens = { q: qTok, k: kTok }, f32 = Math.fround(scale);
    const mask = t.mask && t.mask.every((r) => r.every((v) => v === 0 || v === 1)) ? t.mask : null;
    const same = (a, b) => a.every((r, i) => r.every((v, j) => v === b[i][j] || (Number.isNaN(v) && Number.isNaN(b[i][j]))));
    const out = [];
    for (const [key, rows, square] of STEPS) {
      let src = t[key];
      if (!src) continue;
      const shape = [src.length, src.length ? src[0].length : 0];
      if (!square) src = src.map((r) => r.slice(0, STEP_DIMS));
      const m = { key, shape, rows: tokens[rows], cols: square ? kTok : Array.from({ length: src[0].length }, (_, i) => String(i)) };
      if (key === "weights") Object.assign(m, { enc: "ref", of: "exact" });
      else if (key === "scaled" && same(src, t.scores.map((r) => r.map((v) => Math.fround(v * f32))))) Object.assign(m, { enc: "scaled", of: "scores", by: scale });
      else if (key === "masked" && mask && t.scaled && same(src, t.scaled.map((r, i) => r.map((v, j) => (mask[i][j] === 0 ? -Infinity : v))))) Object.assign(m, { enc: "masked", of: "scaled" });
      else Object.assign(m, pack(src, key === "mask" && mask !== null));
      out.push(m);
    }
    return out;
  }

  window.qkvLongAnswer = { fields, packedSteps, pack, encoderLimit, TOKEN_LIMIT };
})();
