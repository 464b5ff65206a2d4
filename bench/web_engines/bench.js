// bench/web_engines.py's page: MiniLM's forward on ONNX Runtime Web (the site's exported graph,
// as the site's runtime.js makes its session) and on encoder.js (plain JS, typed arrays), on
// the same ids, timed one after the other in this page. window.runBench(cfg) → the results.
"use strict";
(() => {
  const now = () => performance.now();
  async function bytes(url) {
    const r = await fetch(url);
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return new Uint8Array(await r.arrayBuffer());
  }
  // warm-up runs, then `reps` timed ones: every time (ms), and the last output
  async function timed(fn, warm, reps) {
    let out;
    for (let i = 0; i < warm; i++) out = await fn();
    const ms = [];
    for (let i = 0; i < reps; i++) { const t = now(); out = await fn(); ms.push(now() - t); }
    return { ms, out };
  }

  // cfg: {cases: [{T, ids}], reps: {T: n}, warm, layers, heads}
  async function runBench(cfg) {
    const res = { load: {}, runs: [] };
    // ONNX Runtime Web as runtime.js sets it up: WebAssembly with SIMD, one thread (the page
    // is not cross-origin isolated), the graph's weights as external data
    ort.env.wasm.wasmPaths = new URL("ort/", location.href).href;
    ort.env.wasm.numThreads = 1;
    ort.env.logLevel = "error";
    let t = now();
    const [graph, weights] = await Promise.all([bytes("models/minilm/encoder.onnx"), bytes("models/minilm/weights.bin")]);
    const session = await ort.InferenceSession.create(graph, { executionProviders: ["wasm"], graphOptimizationLevel: "basic",
      externalData: [{ path: "weights.bin", data: weights }] });
    res.load.ort_ms = now() - t;
    res.ort_outputs = session.outputNames;
    t = now();
    const [layout, raw] = await Promise.all([fetch("weights/layout.json").then((r) => r.json()), bytes("weights/minilm.f32")]);
    const js = window.qkvJsEncoder.create(layout, new Float32Array(raw.buffer));
    res.load.js_ms = now() - t;
    const mask = new ort.Tensor("float32", new Float32Array(cfg.layers * cfg.heads).fill(1), [cfg.layers, cfg.heads]);
    for (const c of cfg.cases) {
      const reps = cfg.reps[c.T], warm = cfg.warm;
      const src = new ort.Tensor("int64", BigInt64Array.from(c.ids, (v) => BigInt(v)), [1, c.T]);
      // every output, as the site asks (the page draws them all), then the hidden state alone
      const all = await timed(() => session.run({ src, head_mask: mask }), warm, reps);
      const hidden = await timed(() => session.run({ src, head_mask: mask }, ["memory"]), warm, reps);
      const mine = await timed(() => js.forward(c.ids), warm, reps);
      res.runs.push({
        T: c.T,
        ort_all_ms: all.ms, ort_hidden_ms: hidden.ms, js_ms: mine.ms,
        ort_hidden: Array.from(hidden.out.memory.data), ort_all_hidden: Array.from(all.out.memory.data),
        js_hidden: Array.from(mine.out.hidden),
        // the last layer's attention weights of both, (h, T, T): the explorer's maps
        ort_weights: Array.from(all.out.weights.data.subarray((cfg.layers - 1) * cfg.heads * c.T * c.T)),
        js_weights: Array.from(mine.out.weights[cfg.layers - 1]),
      });
    }
    await session.release();
    return res;
  }
  window.runBench = runBench;
  document.addEventListener("DOMContentLoaded", () => { document.getElementById("state").textContent = "ready"; });
})();
