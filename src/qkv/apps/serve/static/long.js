// qkv explorer: a long answer, more tokens than every map holds as JSON (qkv/apps/serve/long.py):
// its maps pooled, the selected head exact, the step-by-step matrices packed, and each query's
// strongest keys for the selected layer. app.js asks this file for the values to draw (decoded
// once, by maps.js), the head view's window of queries and what the downloads see (the pooled
// maps, and the step matrices pooled the same way). Tokens are data: textContent only.
"use strict";
(() => {
  const HEAD_WINDOW = 48, HEAD_KEYS = 96; // the head view: queries shown, keys listed at most

  function create(app) {
    const { S, el, t, LONG_ROWS } = app;
    const Maps = window.qkvMaps;
    const isLong = (d) => !!(d && d.exact);
    // a step matrix's values: JSON, or decoded from its packing (rules refer to its siblings)
    function stepValues(d, m) {
      if (m.values) return m.values;
      const find = (key) => (key === "exact" ? exactOf(d) : stepValues(d, d.step.matrices.find((x) => x.key === key)));
      return Maps.decode(m, m.rows.length, m.cols.length, find);
    }
    function exactOf(d) { const e = d && d.exact; return e ? Maps.decode(e, e.shape[0], e.shape[1]) : null; }
    // what the downloads see of a long answer: S with its maps as the API sent them (pooled; a
    // label per block: its first token) and its step matrices pooled the same way, when asked for
    function exportState() {
      const d = S.data;
      if (!d._export) {
        const every = (xs, k) => xs.filter((_, i) => i % k === 0);
        const layers = d.layers.map((L) => Object.assign({}, L, { q_tokens: every(L.q_tokens, L.pooled.k), k_tokens: every(L.k_tokens, L.pooled.k) }));
        d._export = Object.assign({}, d, { layers, step: null });
        let step = null;
        Object.defineProperty(d._export, "step", { get: () => { // decoded only for a download that shows it
          if (!step && d.step) step = Object.assign({}, d.step, { matrices: d.step.matrices.map((m) => {
            const p = Maps.pool(stepValues(d, m).get ? stepValues(d, m) : Maps.rows(m.values), m.rows, m.cols, LONG_ROWS, m.key === "weights" || m.key === "mask");
            return { key: m.key, shape: m.shape, rows: p.rows, cols: p.cols, values: p.values, pooled: [p.kr, p.kc] };
          }) });
          return step;
        } });
      }
      const k = d.layers[0].pooled.k; // (a pinned query: the block it is in)
      return Object.create(S, { data: { value: d._export }, pinned: { value: S.pinned === null ? null : Math.floor(S.pinned / k) } });
    }
    // one head's weights in layer L of answer d: the JSON map, or a long answer's exact head
    // (null for its other heads: their maps are pooled)
    function weightsOf(d, L, head) {
      const hi = Math.max(0, L.heads.indexOf(head));
      if (!L.pooled) return L.weights[hi];
      return d.exact.layer === L.name && d.exact.head === L.heads[hi] ? exactOf(d) : null;
    }
    // {qs, ks, weight, long} of headPanel: every token of a JSON map; of a long answer, the window
    // and the keys its queries' strongest weights reach (the HEAD_KEYS strongest); null: the
    // answer's lines are another layer's (a new answer is on its way)
    function headLines(L, d) {
      const all = (n) => Array.from({ length: n }, (_, i) => i);
      if (!L.pooled) return { qs: all(L.q_tokens.length), ks: all(L.k_tokens.length), weight: (hi, i, j) => L.weights[hi][i][j], long: false };
      const top = d.top;
      if (!top || top.layer !== L.name) return null;
      const n = L.q_tokens.length, a = Math.max(0, Math.min(S.win, n - HEAD_WINDOW));
      const qs = all(Math.min(HEAD_WINDOW, n)).map((r) => a + r);
      const weight = (hi, i, j) => { const k = top.index[hi][i].indexOf(j); return k < 0 ? 0 : top.weights[hi][i][k]; };
      const best = new Map(); // key → its strongest line (from the pinned query only, when one is)
      const from = qs.includes(S.pinned) ? [S.pinned] : qs;
      for (const hi of L.heads.keys()) if (S.heads.has(L.heads[hi])) for (const i of from) top.index[hi][i].forEach((j, k) => best.set(j, Math.max(best.get(j) || 0, top.weights[hi][i][k])));
      const ks = [...best.entries()].sort((x, y) => y[1] - x[1]).slice(0, HEAD_KEYS).map(([j]) => j).sort((x, y) => x - y);
      return { qs, ks, weight, long: true, a, n, k: top.k };
    }
    // a long answer's head view: which queries are shown (a slider over the text)
    function windowBar(L) {
      const lines = headLines(L, S.data);
      if (!lines || !lines.long) return null;
      const bar = el("div", "row2 win-bar");
      const sl = el("input"); sl.type = "range"; sl.id = "win-slider"; sl.min = 0; sl.max = Math.max(0, lines.n - HEAD_WINDOW); sl.step = 1; sl.value = lines.a;
      sl.addEventListener("change", () => { S.win = +sl.value; S.pinned = null; app.renderView(); });
      const lab = el("span", "", t("head.window", { a: lines.a, b: lines.a + lines.qs.length - 1, n: lines.n, k: lines.k })); lab.id = "win-label";
      bar.append(sl, lab);
      return bar;
    }


    return { isLong, stepValues, exactOf, weightsOf, exportState, headLines, windowBar };
  }

  window.qkvLong = { create };
})();
