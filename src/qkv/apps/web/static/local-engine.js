// qkv in-page engine: the explorer's engine (docs/web.md, "The engine") over the models
// exported by qkv.apps.web.export, run in the page with ONNX Runtime Web. attention()
// answers /api/attention's JSON for a translation as qkv.apps.serve.compute._translation
// does: the same decoding (qkvDecode), the same maps, statistics, probe and step matrices
// (qkvAnswer), heads switched off through the graphs' head_mask input.
//
//   qkvLocal.createEngine({base: "models/", models: ["en-fr", ...]})  an engine: live,
//       health(), attention(request), lens(request), saved() → null; strings() rejects
//       (the site's wrapper gives the page its words)
"use strict";
(() => {
  // engine.js's EngineError (status: an HTTP status, or 0), looked up when first needed: the
  // page may load engine.js after these scripts
  class LocalError extends Error {
    constructor(message, status) { super(message); this.name = "EngineError"; this.status = status; }
  }
  const EngineError = function (message, status) {
    const E = (window.qkvEngine && window.qkvEngine.EngineError) || LocalError;
    return new E(message, status);
  };
  const A = window.qkvAnswer, D = window.qkvDecode;
  const LIMITS = { tokens: 128, translate_tokens: 48, beam: 8, pieces: 8, target: 80 };
  const MAX_TEXT_CHARS = 20000;

  const bad = (message) => new EngineError(message, 400);
  const kind = (v) => (v === null ? "null" : Array.isArray(v) ? "list" : typeof v === "boolean" ? "bool"
    : typeof v === "number" ? (Number.isInteger(v) ? "int" : "float") : typeof v === "string" ? "str" : "object");
  function int(body, key, dflt, lo, hi) {
    const v = key in body ? body[key] : dflt;
    if (typeof v !== "number" || !Number.isInteger(v)) throw bad(`${key} must be an integer in [${lo}, ${hi}], got ${kind(v)}`);
    if (v < lo || v > hi) throw bad(`${key} must be in [${lo}, ${hi}], got ${v}`);
    return v;
  }

  // qkv.apps.serve.limits.parse_request: one 400 naming the field
  function parse(body) {
    if (!body || typeof body !== "object" || Array.isArray(body)) throw bad(`the body must be a JSON object, got ${kind(body)}`);
    if (typeof body.text !== "string") throw bad(`text must be a string, got ${kind(body.text)}`);
    if (!body.text.trim()) throw bad("text must contain at least one non-space character");
    const translate = body.translate ?? false;
    if (typeof translate !== "boolean") throw bad(`translate must be true or false, got ${kind(translate)}`);
    const ablate = body.ablate || [];
    if (!Array.isArray(ablate) || ablate.length > 512) throw bad("ablate must be a list of at most 512 [layer, head] pairs");
    for (const item of ablate) {
      if (!Array.isArray(item) || item.length !== 2 || typeof item[0] !== "string" || !Number.isInteger(item[1])) {
        throw bad(`ablate items must be [layer name, head index], got ${JSON.stringify(item)}`);
      }
    }
    const model = body.model ?? "minilm";
    if (typeof model !== "string") throw bad(`model must be a string, got ${kind(model)}`);
    const layer = body.layer ?? null;
    if (layer !== null && typeof layer !== "string") throw bad(`layer must be a string, got ${kind(layer)}`);
    let probe = null;
    if (body.probe !== undefined && body.probe !== null) {
      const p = body.probe, c = p && p.candidates;
      if (!p || typeof p !== "object" || typeof p.token !== "string" || !p.token || !Array.isArray(c) ||
          c.length < 1 || c.length > 8 || !c.every((x) => typeof x === "string" && x.length > 0 && x.length <= 100)) {
        throw bad("probe needs a token and 1 to 8 candidate words");
      }
      probe = { token: p.token, candidates: c };
    }
    return { text: body.text, model, translate, beam: int(body, "beam", 1, 1, LIMITS.beam), layer,
      head: int(body, "head", 0, 0, 1024), ablate, probe, piece: int(body, "piece", 0, 0, LIMITS.pieces - 1) };
  }

  // answer.choose_layer / ablation_spec over the manifest's layers (all with n_heads heads)
  function selection(m, req) {
    const names = m.manifest.layers, h = m.cfg.n_heads;
    let layer = req.layer;
    if (layer === null) {
      const cross = names.filter((n) => n.includes("cross"));
      layer = req.translate && cross.length ? cross[cross.length - 1] : names[0];
    } else if (!names.includes(layer)) {
      throw bad(`layer must be one of [${names.map((n) => `'${n}'`).join(", ")}], got '${layer}'`);
    }
    if (req.head < 0 || req.head >= h) throw bad(`head must be in [0, ${h - 1}], got ${req.head}`);
    const spec = new Map();
    for (const [l, head] of req.ablate) {
      if (!names.includes(l)) throw bad(`ablate: no layer named '${l}'; have [${names.map((n) => `'${n}'`).join(", ")}]`);
      if (head < 0 || head >= h) throw bad(`ablate: head ${head} out of range for '${l}' (${h} heads)`);
      if (!spec.has(l)) spec.set(l, []);
      spec.get(l).push(head);
    }
    return { layer, spec };
  }

  // the graphs' head_mask inputs for the heads `spec` switches off
  function headMasks(m, spec) {
    const c = m.cfg, names = m.manifest.layers, T = window.qkvRuntime.Tensor;
    const make = (prefix, n) => {
      const layers = names.filter((x) => x.startsWith(prefix));
      const data = new Float32Array(n * c.n_heads).fill(1);
      layers.forEach((l, i) => (spec.get(l) || []).forEach((hd) => { data[i * c.n_heads + hd] = 0; }));
      return new T(data, [n, c.n_heads]);
    };
    return { enc: make("encoder.", c.n_encoder_layers), dec: make("decoder.", 2 * c.n_decoder_layers) };
  }

  const targetLimit = (S) => Math.min(LIMITS.target, Math.floor((S * 3) / 2) + 8);

  // compute.decode_translation: ids, labels, each layer's merged map, the output text
  async function decodeTranslation(m, text, beam, masks) {
    const c = m.cfg, tok = m.tokenizer;
    const src = [...tok.encode(text).ids.slice(0, Math.floor(c.max_len / 2) - 1), c.eos_id];
    const enc = await m.encode(src, masks.enc);
    const opts = { maxNew: targetLimit(src.length), ngram: m.manifest.no_repeat_ngram, headMask: masks.dec,
      beam, lengthPenalty: 1.0 };
    let hyp, beams = [], self, cross;
    const L = c.n_decoder_layers, h = c.n_heads;
    if (beam <= 1) {
      const g = await D.greedy(m, enc, opts);
      hyp = g.hyp;
      // each step's row of every decoder layer: (L, 1, h, 1, Tk)
      self = (i, hd) => g.steps.map((s, t) => { const r = Array.from(s.self.at(i, 0, hd, 0).data); return r.concat(Array(hyp.length - 1 - t).fill(0)); });
      cross = (i, hd) => g.steps.map((s) => Array.from(s.cross.at(i, 0, hd, 0).data));
    } else {
      const b = await D.beam(m, enc, opts);
      hyp = b.hyp;
      beams = b.beams.map(([ids, sc]) => ({ text: tok.decode(ids), score: A.number(sc, 4),
        chosen: ids.length === hyp.length && ids.every((x, i) => x === hyp[i]) }));
      const r = await D.replay(m, enc, hyp, masks.dec);
      self = (i, hd) => r["self.weights"].at(i, 0, hd).rows();
      cross = (i, hd) => r["cross.weights"].at(i, 0, hd).rows();
    }
    const sourceTokens = tok.labels(src), inputs = tok.labels([c.bos_id, ...hyp.slice(0, -1)]);
    const produced = tok.labels(hyp);
    const heads = Array.from({ length: h }, (_, i) => i);
    const layers = [];
    for (let i = 0; i < c.n_encoder_layers; i++) {
      layers.push({ name: `encoder.layers.${i}.self_attn`, kind: "self", heads, q_tokens: sourceTokens,
        k_tokens: sourceTokens, w: heads.map((hd) => enc.weights.at(i, 0, hd).rows()) });
    }
    for (let i = 0; i < L; i++) {
      layers.push({ name: `decoder.layers.${i}.self_attn`, kind: "causal", heads, q_tokens: inputs,
        k_tokens: inputs, w: heads.map((hd) => self(i, hd)) });
      layers.push({ name: `decoder.layers.${i}.cross_attn`, kind: "cross", heads, q_tokens: produced,
        k_tokens: sourceTokens, w: heads.map((hd) => cross(i, hd)) });
    }
    return { src, enc, hyp, text: tok.decode(hyp), beams, layers, sourceTokens, inputs, produced };
  }

  // compute.step_detail from the graphs' tensors of one layer: t.x, t.context (or null) and
  // the step tensors (L, 1, h, ...) of its kind, at layer index i
  function stepDetail(m, t, i, head, kind, qTok, kTok, off) {
    const c = m.cfg, two = (k) => t[k].at(i, 0, head).rows();
    const wo = t.wo.at(i, 0).data, real = t.real.at(i, 0).data;
    let check = 0;
    for (let j = 0; j < wo.length; j++) check = Math.max(check, Math.abs(wo[j] - real[j]));
    const mats = { x: t.x.at(i, 0).rows(), context: t.context ? t.context.rows() : null, q: two("q"), k: two("k"),
      v: two("v"), scores: two("scores"), scaled: two("scaled"), mask: two("mask"), masked: two("masked"),
      weights: two("weights"), output: two("output"), concat: t.concat.at(i, 0).rows(), wo: t.wo.at(i, 0).rows() };
    return { kind, head, n_heads: c.n_heads, d_k: c.d_k, d_model: c.d_model, scale: A.number(1 / Math.sqrt(c.d_k), 6),
      matrices: A.stepMatrices(mats, qTok, kTok), check, head_off: off };
  }

  // compute._translation
  async function translation(m, req, text) {
    const limit = m.manifest.limit;
    const count = m.tokenizer.encode(text).ids.slice(0, m.cfg.max_len - 1).length + 1;
    if (count > limit) {
      throw new EngineError(`the text has ${count} source tokens; the page translates up to ${limit} ` +
        "(qkv serve translates a longer text in pieces)", 422);
    }
    const { layer, spec } = selection(m, req);
    const masks = headMasks(m, spec);
    const d = await decodeTranslation(m, text, req.beam, masks);
    // the step view: the layer's call replayed (teacher-forced), as compute.step_detail
    const idx = Number(layer.split(".")[2]);
    const off = (spec.get(layer) || []).includes(req.head);
    let step;
    if (layer.startsWith("encoder.")) {
      step = stepDetail(m, d.enc, idx, req.head, "self", d.sourceTokens, d.sourceTokens, off);
    } else {
      const r = await D.replay(m, d.enc, d.hyp, masks.dec);
      const isCross = layer.endsWith("cross_attn"), p = isCross ? "cross." : "self.";
      const t = Object.fromEntries(["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights", "output",
        "concat", "wo", "real"].map((k) => [k, r[p + k]]));
      t.context = isCross ? d.enc.memory.at(0) : null;
      step = stepDetail(m, t, idx, req.head, isCross ? "cross" : "causal", isCross ? d.produced : d.inputs,
        isCross ? d.sourceTokens : d.inputs, off);
    }
    const out = {
      raw: d.layers.map((l) => l.w), limit, text, tokens: d.sourceTokens, truncated: false, layers: d.layers.map(A.layerJson),
      stats: A.stats(d.layers), probe: A.probe(d.layers, req), step: { layer, ...step },
      translation: { source_tokens: d.sourceTokens, target_tokens: d.produced, decoder_inputs: d.inputs,
        text: d.text, beam: req.beam, steps: d.hyp.length, beams: d.beams, length_penalty: 1.0, pieces: [],
        piece: 0, ...A.warnings(m.tokenizer, text) },
    };
    if (req.beam > 1) {
      out.translation.greedy_text = (await decodeTranslation(m, text, 1, masks)).text;
    }
    if (spec.size) {
      const base = await decodeTranslation(m, text, req.beam, headMasks(m, new Map()));
      out.ablation = { heads: [...spec].flatMap(([l, hs]) => hs.map((hd) => [l, hd])),
        baseline: { translation: base.text, probe: A.probe(base.layers, req) } };
    }
    return out;
  }

  function createEngine(options) {
    const base = (options && options.base) || "models/";
    const names = (options && options.models) || ["en-fr", "fr-en"];
    const loading = new Map(); // name -> Promise<Model>
    const model = (name) => {
      if (!loading.has(name)) {
        const p = window.qkvRuntime.load(base + name + "/");
        p.catch(() => loading.delete(name)); // a failed download may be tried again
        loading.set(name, p);
      }
      return loading.get(name);
    };
    const loaded = new Set();
    return {
      get live() { return true; },
      strings() { return Promise.reject(new EngineError("the in-page engine has no strings: the site gives them", 0)); },
      saved() { return Promise.resolve(null); },
      health() {
        return Promise.resolve({
          models: names.map((n) => ({ name: n, label: `translator ${n}`, label_key: "model.translator", translator: true,
            random: false, loaded: loaded.has(n) })),
          limits: { tokens: LIMITS.tokens, translate_tokens: LIMITS.translate_tokens, beam: LIMITS.beam, pieces: LIMITS.pieces },
        });
      },
      async attention(body) {
        const t0 = performance.now();
        const req = parse(body);
        if (!names.includes(req.model)) {
          throw new EngineError(`model must be one of [${names.map((n) => `'${n}'`).join(", ")}], got '${req.model}'`, 404);
        }
        let m;
        try {
          m = await model(req.model);
        } catch (err) {
          throw new EngineError(`could not load model ${req.model}: ${err.message || err}`, 0);
        }
        loaded.add(req.model);
        if (!req.translate) throw new EngineError("the in-page engine answers translations only (translate: true)", 0);
        const text = req.text.slice(0, MAX_TEXT_CHARS);
        const out = await translation(m, req, text);
        this.lastLayers = out.raw; // every weight unrounded, for tests against PyTorch
        delete out.raw;
        out.step_unavailable = null;
        const limit = out.limit;
        delete out.limit;
        out.truncated = out.truncated || req.text.length > MAX_TEXT_CHARS;
        out.notice = out.truncated ? `The text was cut to its first ${out.tokens.length} tokens (limit ${limit}).` : null;
        return { model: req.model, random: false, limit, ...out, elapsed_ms: Math.round(10 * (performance.now() - t0)) / 10 };
      },
      lens() { return Promise.reject(new EngineError("the in-page engine does not compute the lens yet (qkv serve does)", 0)); },
      // the model's download and session load, for a page that says what is loading
      load: model,
    };
  }

  window.qkvLocal = { createEngine, parse };
})();
