// qkv in-page engine: the models' ONNX Runtime Web sessions. A model folder (written by
// qkv.apps.web.export) holds manifest.json, its graphs over one weights.bin (encoder.onnx:
// the encoder view; for a translator the source's encoder and decoder.onnx, the cached
// decoder step) and tokenizer.json; load() fetches them once, from the page's own origin.
//
//   qkvRuntime.load(url)        a Model: manifest, tokenizer, encode(), step()
//   qkvRuntime.Tensor           {data, dims}: what the graphs take and give (row-major)
//
// Shapes (onnx_graphs.py): L layers, N rows (hypotheses), h heads, S source, P cached and
// T new target positions. The runtime is ort.wasm.min.js, WebAssembly with SIMD, one thread
// unless the page is cross-origin isolated (GitHub Pages cannot be).
"use strict";
(() => {
  // the site's root: this file is <root>/engine/runtime.js, the runtime <root>/ort/
  const ROOT = new URL("../", document.currentScript.src).href;

  class Tensor {
    constructor(data, dims) { this.data = data; this.dims = dims; }
    get size() { return this.dims.reduce((a, b) => a * b, 1); }
    // the element strides of each axis
    strides() {
      const s = new Array(this.dims.length).fill(1);
      for (let i = this.dims.length - 2; i >= 0; i--) s[i] = s[i + 1] * this.dims[i + 1];
      return s;
    }
    // the sub-tensor at leading indices (a view: no copy)
    at(...index) {
      const st = this.strides();
      let off = 0;
      index.forEach((v, i) => { off += v * st[i]; });
      const dims = this.dims.slice(index.length);
      const n = dims.reduce((a, b) => a * b, 1);
      return new Tensor(this.data.subarray(off, off + n), dims);
    }
    // nested arrays of a 2-D tensor (rows)
    rows() {
      const [r, c] = this.dims;
      return Array.from({ length: r }, (_, i) => Array.from(this.data.subarray(i * c, (i + 1) * c)));
    }
    // the rows `index` of axis `axis` (beam search follows its hypotheses)
    gather(axis, index) {
      const outer = this.dims.slice(0, axis).reduce((a, b) => a * b, 1);
      const inner = this.dims.slice(axis + 1).reduce((a, b) => a * b, 1);
      const n = this.dims[axis];
      const out = new this.data.constructor(outer * index.length * inner);
      for (let o = 0; o < outer; o++) {
        index.forEach((r, j) => {
          out.set(this.data.subarray((o * n + r) * inner, (o * n + r + 1) * inner), (o * index.length + j) * inner);
        });
      }
      const dims = this.dims.slice();
      dims[axis] = index.length;
      return new Tensor(out, dims);
    }
  }

  function ortTensor(t) {
    if (t.data instanceof BigInt64Array) return new ort.Tensor("int64", t.data, t.dims);
    if (t.data instanceof Uint8Array) return new ort.Tensor("bool", t.data, t.dims);
    return new ort.Tensor("float32", t.data, t.dims);
  }
  const ids = (rows) => new Tensor(BigInt64Array.from(rows.flat(), (v) => BigInt(v)), [rows.length, rows[0].length]);
  const ones = (dims) => new Tensor(new Float32Array(dims.reduce((a, b) => a * b, 1)).fill(1), dims);

  async function fetchOk(url) {
    const r = await fetch(url);
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return r;
  }

  // ONNX Runtime's WebAssembly runs one call at a time: two runs interleaved at their awaits
  // (the page asks for A and B at once when comparing) corrupt its memory. Every session
  // call goes through this chain.
  let chain = Promise.resolve();
  function exclusive(fn) {
    const p = chain.then(fn, fn);
    chain = p.catch(() => {});
    return p;
  }

  // A one-node graph (y = Identity(x), opset 17): making a session of it fetches and
  // compiles ONNX Runtime's WebAssembly, which otherwise starts only once a model's files
  // have all arrived; load() runs both at once.
  const WARM = "CAg6OgoQCgF4EgF5IghJZGVudGl0eRIEd2FybVoPCgF4EgoKCAgBEgQKAggBYg8KAXkSCgoICAESBAoCCAFCBAoAEBE=";
  let ready = null;
  function runtime() {
    if (ready) return ready;
    ort.env.wasm.wasmPaths = ROOT + "ort/";
    // threads need SharedArrayBuffer, which only a cross-origin isolated page has
    ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
    ort.env.logLevel = "error";
    const bytes = Uint8Array.from(atob(WARM), (c) => c.charCodeAt(0));
    ready = exclusive(() => ort.InferenceSession.create(bytes, { executionProviders: ["wasm"] }))
      .then((s) => exclusive(() => s.release()));
    ready.catch(() => { ready = null; }); // tried again with the next model
    return ready;
  }

  class Model {
    constructor(manifest, tokenizer, sessions, bytes) {
      this.manifest = manifest;
      this.tokenizer = tokenizer;
      this.sessions = sessions; // role ("encoder", "source", "decoder") -> session; lens: () => Promise
      this.bytes = bytes; // downloaded
      this.cfg = manifest.translation || manifest.encoder; // the decoder's sizes, if any
    }

    // an encoder graph: ids [S] → {memory, x, q, k, ..., memory_k, memory_v} (Tensors);
    // role "encoder" (the encoder view) or "source" (a translation's source)
    async encode(src, headMask, role = "encoder") {
      const c = role === "source" ? this.manifest.translation : this.manifest.encoder;
      const feeds = { src: ids([src]), head_mask: headMask || ones([c.n_encoder_layers, c.n_heads]) };
      return this.run(this.sessions[role], feeds);
    }

    // decoder: tokens [N][T] over caches → {logits, next_k, next_v, self.*, cross.*};
    // `outputs`: the names wanted (default: all)
    async step(tokens, past, memory, headMask, outputs) {
      const c = this.cfg, N = tokens.length, S = memory.k.dims[3];
      const feeds = {
        tgt: ids(tokens), memory_mask: new Tensor(new Uint8Array(N * S).fill(1), [N, 1, 1, S]),
        past_k: past.k, past_v: past.v, memory_k: memory.k, memory_v: memory.v,
        head_mask: headMask || ones([2 * c.n_decoder_layers, c.n_heads]),
      };
      return this.run(this.sessions.decoder, feeds, outputs);
    }

    // a translator's lens graph (lens_graph.py): src [S], tgt [T], position, the mask of every
    // attention module (L_all, h)
    async lens(src, tgt, position, headMask) {
      const feeds = { src: ids([src]), tgt: ids([tgt]),
        position: new Tensor(BigInt64Array.from([BigInt(position)]), []), head_mask: headMask };
      return this.run(await this.sessions.lens(), feeds);
    }

    // empty self-attention caches for N rows
    emptyPast(N) {
      const c = this.cfg, dims = [c.n_decoder_layers, N, c.n_kv_heads, 0, c.d_k];
      return { k: new Tensor(new Float32Array(0), dims), v: new Tensor(new Float32Array(0), dims) };
    }

    async run(session, feeds, outputs) {
      const given = {};
      for (const name of session.inputNames) given[name] = ortTensor(feeds[name]);
      const out = await exclusive(() => session.run(given, outputs));
      const res = {};
      for (const [name, t] of Object.entries(out)) {
        res[name] = new Tensor(t.data, t.dims.map(Number));
      }
      return res;
    }
  }

  // the model's tokenizer (tokenize.js): its tokenizer.json, or the random model's hashing
  function tokenizer(manifest, json) {
    const T = window.qkvTokenize;
    if (manifest.tokenizer === "hashed") return T.hashed({ vocabSize: manifest.translation.vocab_size });
    const positions = manifest.encoder.positions;
    return T.fromJson(json, manifest.tokenizer === "wordpiece" && positions ? { maxLength: positions } : {});
  }

  // url: the model's folder ("models/en-fr/")
  async function load(url) {
    const warm = runtime();
    const manifest = await (await fetchOk(url + "manifest.json")).json();
    const bytes = async (f) => new Uint8Array(await (await fetchOk(url + f)).arrayBuffer());
    const files = [...new Set(Object.values(manifest.graphs))];
    const hasTok = manifest.files.includes("tokenizer.json");
    const [, weights, tok, ...graphs] = await Promise.all([
      warm, bytes("weights.bin"), hasTok ? fetchOk(url + "tokenizer.json").then((r) => r.json()) : null,
      ...files.map(bytes),
    ]);
    const options = {
      executionProviders: ["wasm"], graphOptimizationLevel: "basic",
      externalData: [{ path: "weights.bin", data: weights }],
    };
    // a session per file, made when first needed: the lens's only when the Lens view asks
    const made = {};
    const session = (f) => {
      if (!made[f]) made[f] = exclusive(() => ort.InferenceSession.create(graphs[files.indexOf(f)], options));
      return made[f];
    };
    const sessions = {};
    for (const [role, f] of Object.entries(manifest.graphs)) {
      if (role !== "lens") sessions[role] = await session(f);
    }
    if (manifest.graphs.lens) sessions.lens = () => session(manifest.graphs.lens);
    const size = weights.length + graphs.reduce((a, g) => a + g.length, 0) + (tok ? JSON.stringify(tok).length : 0);
    return new Model(manifest, tokenizer(manifest, tok), sessions, size);
  }

  window.qkvRuntime = { load, runtime, Tensor, ids, ones };
})();
