// A BERT encoder (MiniLM: post-LayerNorm, exact GELU) in plain JavaScript on typed arrays: the
// "engine of our own" bench/web_engines.py times against ONNX Runtime Web. One sentence, no
// padding (every position may attend), fp32 storage, sums in JS numbers (fp64). It returns the
// last hidden state and keeps each layer's attention weights, what the explorer draws.
//
//   qkvJsEncoder.create(layout, buffer) → {forward(ids) → {hidden: Float32Array (T·d), weights}}
//
// layout: {config: {d_model, n_heads, d_ff, n_layers, eps}, tensors: {name: [offset, shape]}}
// over one Float32Array (qkv's BertModel state_dict names, PyTorch's Linear layout: W[out][in]).
"use strict";
(() => {
  // y (T, n) = x (T, k) · Wᵀ + b with W (n, k) row-major: each output a dot product of two
  // contiguous rows; 4 positions per pass share each row of W (a quarter of its loads)
  function linear(x, T, k, W, b, n) {
    const y = new Float32Array(T * n);
    let t = 0;
    for (; t + 4 <= T; t += 4) {
      const r0 = t * k, r1 = r0 + k, r2 = r1 + k, r3 = r2 + k;
      for (let o = 0; o < n; o++) {
        const w = o * k;
        let a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (let i = 0; i < k; i++) {
          const wi = W[w + i];
          a0 += x[r0 + i] * wi; a1 += x[r1 + i] * wi; a2 += x[r2 + i] * wi; a3 += x[r3 + i] * wi;
        }
        const bo = b[o];
        y[t * n + o] = a0 + bo; y[(t + 1) * n + o] = a1 + bo; y[(t + 2) * n + o] = a2 + bo; y[(t + 3) * n + o] = a3 + bo;
      }
    }
    for (; t < T; t++) {
      const r = t * k;
      for (let o = 0; o < n; o++) {
        const w = o * k;
        let a = 0;
        for (let i = 0; i < k; i++) a += x[r + i] * W[w + i];
        y[t * n + o] = a + b[o];
      }
    }
    return y;
  }

  // x ← LayerNorm(x + r) over each row of d (r may be null)
  function addNorm(x, r, T, d, g, b, eps) {
    for (let t = 0; t < T; t++) {
      const o = t * d;
      let mean = 0;
      for (let i = 0; i < d; i++) { const v = r ? x[o + i] + r[o + i] : x[o + i]; x[o + i] = v; mean += v; }
      mean /= d;
      let vr = 0;
      for (let i = 0; i < d; i++) { const c = x[o + i] - mean; vr += c * c; }
      const inv = 1 / Math.sqrt(vr / d + eps);
      for (let i = 0; i < d; i++) x[o + i] = (x[o + i] - mean) * inv * g[i] + b[i];
    }
  }

  // erf to ~1e-15 (JavaScript has none): a series near 0, a continued fraction's tail beyond
  function erf(x) {
    const s = x < 0 ? -1 : 1, a = Math.abs(x);
    if (a < 2.5) { // Maclaurin series: 2/√π Σ (−1)ⁿ x^(2n+1) / (n! (2n+1))
      let term = a, sum = a;
      const a2 = a * a;
      for (let n = 1; n < 60; n++) {
        term *= -a2 / n;
        const add = term / (2 * n + 1);
        sum += add;
        if (Math.abs(add) < 1e-17 * Math.abs(sum)) break;
      }
      return s * sum * 1.1283791670955126;
    }
    if (a > 6) return s;
    // erfc(a) = e^(−a²)/√π · 1/(a + 1/2/(a + 1/(a + 3/2/(a + …)))), evaluated from the tail
    let f = 0;
    for (let n = 60; n >= 1; n--) f = (n / 2) / (a + f);
    return s * (1 - Math.exp(-a * a) / 1.7724538509055159 / (a + f));
  }
  const gelu = (v) => 0.5 * v * (1 + erf(v * Math.SQRT1_2));

  function create(layout, buffer) {
    const data = buffer instanceof Float32Array ? buffer : new Float32Array(buffer);
    const P = (name) => {
      const e = layout.tensors[name];
      if (!e) throw new Error(`the weights lack ${name}`);
      const n = e[1].reduce((a, b) => a * b, 1);
      return data.subarray(e[0], e[0] + n);
    };
    const c = layout.config, d = c.d_model, h = c.n_heads, dk = d / h, ff = c.d_ff, eps = c.eps;
    const emb = { token: P("embeddings.token.weight"), type: P("embeddings.token_type.weight"),
      pos: P("embeddings.position.embedding.weight"), g: P("embeddings.norm.weight"), b: P("embeddings.norm.bias") };
    const layers = Array.from({ length: c.n_layers }, (_, l) => {
      const p = (s) => P(`encoder.layers.${l}.${s}`);
      return { wq: p("self_attn.w_q.weight"), bq: p("self_attn.w_q.bias"), wk: p("self_attn.w_k.weight"), bk: p("self_attn.w_k.bias"),
        wv: p("self_attn.w_v.weight"), bv: p("self_attn.w_v.bias"), wo: p("self_attn.w_o.weight"), bo: p("self_attn.w_o.bias"),
        g1: p("attn_norm.weight"), b1: p("attn_norm.bias"), wi: p("ff_in.weight"), bi: p("ff_in.bias"),
        wf: p("ff_out.weight"), bf: p("ff_out.bias"), g2: p("ff_norm.weight"), b2: p("ff_norm.bias") };
    });

    function forward(ids) {
      const T = ids.length;
      const x = new Float32Array(T * d); // (T, d)
      for (let t = 0; t < T; t++) for (let i = 0; i < d; i++) {
        x[t * d + i] = emb.token[ids[t] * d + i] + emb.type[i] + emb.pos[t * d + i];
      }
      addNorm(x, null, T, d, emb.g, emb.b, eps);
      const weights = [];
      const scale = 1 / Math.sqrt(dk);
      for (const L of layers) {
        const q = linear(x, T, d, L.wq, L.bq, d), k = linear(x, T, d, L.wk, L.bk, d), v = linear(x, T, d, L.wv, L.bv, d);
        const ctx = new Float32Array(T * d); // (T, h·d_k): the heads side by side
        const w = new Float32Array(h * T * T); // (h, T, T)
        const row = new Float64Array(T);
        for (let hd = 0; hd < h; hd++) {
          const off = hd * dk;
          for (let i = 0; i < T; i++) {
            let max = -Infinity;
            for (let j = 0; j < T; j++) {
              let s = 0;
              for (let e = 0; e < dk; e++) s += q[i * d + off + e] * k[j * d + off + e];
              s *= scale; row[j] = s; if (s > max) max = s;
            }
            let sum = 0;
            for (let j = 0; j < T; j++) { row[j] = Math.exp(row[j] - max); sum += row[j]; }
            const base = (hd * T + i) * T;
            for (let j = 0; j < T; j++) w[base + j] = row[j] / sum;
            for (let e = 0; e < dk; e++) {
              let a = 0;
              for (let j = 0; j < T; j++) a += w[base + j] * v[j * d + off + e];
              ctx[i * d + off + e] = a;
            }
          }
        }
        weights.push(w);
        addNorm(x, linear(ctx, T, d, L.wo, L.bo, d), T, d, L.g1, L.b1, eps);
        const mid = linear(x, T, d, L.wi, L.bi, ff); // (T, d_ff)
        for (let i = 0; i < mid.length; i++) mid[i] = gelu(mid[i]);
        addNorm(x, linear(mid, T, ff, L.wf, L.bf, d), T, d, L.g2, L.b2, eps);
      }
      return { hidden: x, weights };
    }
    return { forward };
  }

  const api = { create, erf };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else window.qkvJsEncoder = api;
})();
