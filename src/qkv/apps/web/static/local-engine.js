// qkv in-page engine: the explorer's engine (docs/web.md, "The engine") over the models
// exported by qkv.apps.web.export, run in the page with ONNX Runtime Web. attention()
// answers /api/attention's JSON as qkv.apps.serve.compute does, for a translation
// (_translation) and for the maps of one forward pass (_encoder): the same decoding
// (qkvDecode), maps, statistics, probe and step matrices (qkvAnswer), heads switched off
// through the graphs' head_mask input.
//
//   qkvLocal.createEngine({base: "models/"[, models: [...]]})  an engine over the site's models
//       (models/index.json) or those named: live,
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
  const A = window.qkvAnswer, D = window.qkvDecode, X = window.qkvText;
  // qkv.apps.serve.limits (GET /api/health's "limits"; the tests compare them)
  const LIMITS = { tokens: 128, translate_tokens: 48, body_bytes: 262144, cells: 320000, beam: 8, long_tokens: 2048,
    long_bytes: 67108864, pieces: 8 };
  const TARGET_LIMIT = 80; // target_limit's cap
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

  // answer.choose_layer / ablation_spec over a section's layers (all with n_heads heads)
  function selection(section, req) {
    const names = section.layers, h = section.n_heads;
    const list = `[${names.map((n) => `'${n}'`).join(", ")}]`;
    let layer = req.layer;
    if (layer === null) {
      const cross = names.filter((n) => n.includes("cross"));
      layer = req.translate && cross.length ? cross[cross.length - 1] : names[0];
    } else if (!names.includes(layer)) {
      throw bad(`layer must be one of ${list}, got '${layer}'`);
    }
    if (req.head < 0 || req.head >= h) throw bad(`head must be in [0, ${h - 1}], got ${req.head}`);
    return { layer, spec: ablationSpec(section, req) };
  }

  // answer.ablation_spec: the heads the request switches off, {layer: [heads]}, checked
  function ablationSpec(section, req) {
    const names = section.layers, h = section.n_heads;
    const spec = new Map();
    for (const [l, head] of req.ablate) {
      if (!names.includes(l)) throw bad(`ablate: no layer named '${l}'; have [${names.map((n) => `'${n}'`).join(", ")}]`);
      if (head < 0 || head >= h) throw bad(`ablate: head ${head} out of range for '${l}' (${h} heads)`);
      if (!spec.has(l)) spec.set(l, []);
      spec.get(l).push(head);
    }
    return spec;
  }

  // the graphs' head_mask inputs ((L_enc, h) and the decoder's (2·L_dec, h), layers in
  // model order) for the heads `spec` switches off
  function headMasks(section, spec) {
    const T = window.qkvRuntime.Tensor, h = section.n_heads;
    const make = (layers) => {
      const data = new Float32Array(Math.max(1, layers.length) * h).fill(1);
      layers.forEach((l, i) => (spec.get(l) || []).forEach((hd) => { data[i * h + hd] = 0; }));
      return new T(data, [layers.length, h]);
    };
    return { enc: make(section.layers.filter((l) => !l.startsWith("decoder."))),
      dec: make(section.layers.filter((l) => l.startsWith("decoder."))) };
  }

  const targetLimit = (S) => Math.min(TARGET_LIMIT, Math.floor((S * 3) / 2) + 8);
  // the encoder view's tokens and ids (the server's Loaded.encode of each model)
  function encoderInput(m, text) {
    const tok = m.tokenizer, kind = m.manifest.tokenizer;
    if (kind === "hashed") { // qkv.inspect.tiny.TinyEncoder.tokenize
      const r = tok.encode(text);
      return { tokens: ["[CLS]", ...r.tokens, "[SEP]"], ids: [1, ...r.ids, 2] };
    }
    if (kind === "wordpiece") { const r = tok.encode(text); return { tokens: r.tokens, ids: r.ids }; }
    const t = m.manifest.translation; // a translator's encoder (loaded_from_seq2seq)
    const ids = [...tok.encode(text).ids.slice(0, t.max_len - 1), t.eos_id];
    return { tokens: tok.labels(ids), ids };
  }

  // a translation's source tokens and ids (compute.decode_translation)
  function sourceInput(m, text) {
    const tok = m.tokenizer, t = m.manifest.translation;
    if (m.manifest.tokenizer === "hashed") { // <s> words </s>
      const r = tok.encode(text);
      return { tokens: ["<s>", ...r.tokens, "</s>"], ids: [t.bos_id, ...r.ids, t.eos_id] };
    }
    const ids = [...tok.encode(text).ids.slice(0, Math.floor(t.max_len / 2) - 1), t.eos_id];
    return { tokens: tok.labels(ids), ids };
  }

  const range = (n) => Array.from({ length: n }, (_, i) => i);

  // compute.decode_translation: ids, labels, each layer's merged map, the output text
  async function decodeTranslation(m, text, beam, masks) {
    const t = m.manifest.translation, tok = m.tokenizer, random = m.manifest.tokenizer === "hashed";
    const source = sourceInput(m, text), src = source.ids;
    const enc = await m.encode(src, masks.enc, "source");
    const opts = { maxNew: targetLimit(src.length), ngram: t.no_repeat_ngram, headMask: masks.dec, beam,
      lengthPenalty: 1.0, guard: t.repeat_guard ? D.RepeatGuard.forTokenizer(tok) : null };
    let hyp, beams = [], self, cross;
    if (beam <= 1) {
      const g = await D.greedy(m, enc, opts);
      hyp = g.hyp;
      // each step's row of every decoder layer, (L, 1, h, 1, Tk): the causal ones padded
      self = (i, hd) => g.steps.map((s, j) => Array.from(s.self.at(i, 0, hd, 0).data).concat(Array(g.steps.length - 1 - j).fill(0)));
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
    const sourceTokens = source.tokens;
    const inputs = random ? ["<s>", ...tok.labels(hyp.slice(0, -1))] : tok.labels([t.bos_id, ...hyp.slice(0, -1)]);
    const produced = tok.labels(hyp);
    const heads = range(t.n_heads), layers = [];
    for (let i = 0; i < t.n_encoder_layers; i++) {
      layers.push({ name: `encoder.layers.${i}.self_attn`, kind: "self", heads, q_tokens: sourceTokens,
        k_tokens: sourceTokens, w: heads.map((hd) => enc.weights.at(i, 0, hd).rows()) });
    }
    for (let i = 0; i < t.n_decoder_layers; i++) {
      layers.push({ name: `decoder.layers.${i}.self_attn`, kind: "causal", heads, q_tokens: inputs,
        k_tokens: inputs, w: heads.map((hd) => self(i, hd)) });
      layers.push({ name: `decoder.layers.${i}.cross_attn`, kind: "cross", heads, q_tokens: produced,
        k_tokens: sourceTokens, w: heads.map((hd) => cross(i, hd)) });
    }
    return { src, enc, hyp, text: tok.decode(hyp), beams, layers, sourceTokens, inputs, produced };
  }

  // compute.step_detail from the graphs' tensors of one layer: t.x, t.context (or null) and
  // the step tensors (L, 1, h, ...) of its kind, at layer index i
  function stepDetail(section, t, i, head, kind, qTok, kTok, off) {
    const two = (k) => t[k].at(i, 0, head).rows();
    const wo = t.wo.at(i, 0).data, real = t.real.at(i, 0).data;
    let check = 0;
    for (let j = 0; j < wo.length; j++) check = Math.max(check, Math.abs(wo[j] - real[j]));
    const mats = { x: t.x.at(i, 0).rows(), context: t.context ? t.context.rows() : null, q: two("q"), k: two("k"),
      v: two("v"), scores: two("scores"), scaled: two("scaled"), mask: two("mask"), masked: two("masked"),
      weights: two("weights"), output: two("output"), concat: t.concat.at(i, 0).rows(), wo: t.wo.at(i, 0).rows() };
    return { kind, head, n_heads: section.n_heads, d_k: section.d_k, d_model: section.d_model,
      scale: A.number(1 / Math.sqrt(section.d_k), 6), matrices: A.stepMatrices(mats, qTok, kTok, 1 / Math.sqrt(section.d_k)),
      check, head_off: off };
  }

  // a long answer's every map passes through the page's memory: 6 tensors (weights, scores,
  // scaled, mask, masked and the step's) of layers × heads × T² numbers each, at most this
  const MAX_PAGE_CELLS = 40e6;
  const TOO_LONG = "this text is too long for the page's memory; qkv serve answers it";

  // compute._encoder: the maps of one forward pass of the encoder (or encoder-only model)
  async function encoderAnswer(m, req, text) {
    const e = m.manifest.encoder;
    const c = X.cutToLimit((s) => encoderInput(m, s), text, e.limit);
    const cells = e.n_encoder_layers * e.n_heads * c.tokens.length ** 2;
    if (6 * cells > MAX_PAGE_CELLS) throw new EngineError(TOO_LONG, 422);
    const { layer, spec } = selection(e, req);
    const out = await m.encode(c.ids, headMasks(e, spec).enc);
    const heads = range(e.n_heads);
    const layers = e.layers.map((name, i) => ({ name, kind: "self", heads, q_tokens: c.tokens, k_tokens: c.tokens,
      w: heads.map((hd) => out.weights.at(i, 0, hd).rows()) }));
    const i = e.layers.indexOf(layer);
    const steps = Object.fromEntries(["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights", "output",
      "concat", "wo", "real"].map((k) => [k, out[k]]));
    const step = stepDetail(e, steps, i, req.head, "self", c.tokens, c.tokens, (spec.get(layer) || []).includes(req.head));
    const answer = { raw: layers.map((l) => l.w), limit: e.limit, positions: e.positions, text: c.text, tokens: c.tokens,
      truncated: c.cut, ...(cells > LIMITS.cells ? window.qkvLongAnswer.fields(layers, layer, req.head) : { layers: layers.map(A.layerJson) }),
      stats: A.stats(layers), probe: A.probe(layers, req), step: { layer, ...step } };
    if (spec.size) {
      const base = await m.encode(c.ids, null);
      let diff = 0, norm = 0;
      out.memory.data.forEach((v, j) => { diff += (v - base.memory.data[j]) ** 2; norm += base.memory.data[j] ** 2; });
      const baseLayers = e.layers.map((name, j) => ({ name, kind: "self", heads, q_tokens: c.tokens, k_tokens: c.tokens,
        w: heads.map((hd) => base.weights.at(j, 0, hd).rows()) }));
      answer.ablation = { heads: [...spec].flatMap(([l, hs]) => hs.map((hd) => [l, hd])),
        hidden_change: A.number(Math.sqrt(diff) / Math.max(Math.sqrt(norm), 1e-12), 4),
        baseline: { probe: A.probe(baseLayers, req) } };
    }
    return answer;
  }

  // compute._translation
  async function translation(m, req, full) {
    const t = m.manifest.translation;
    if (!t) throw bad(`model '${m.manifest.name}' does not translate; pick a translator`);
    const limit = t.limit, random = m.manifest.tokenizer === "hashed";
    // a text longer than the maps' limit: translated piece by piece, as qkv translate does
    const encode = (s) => (random ? sourceInput : encoderInput)(m, s);
    const { pieces, cut } = X.splitSource(encode, full, limit);
    const shown = Math.min(req.piece, pieces.length - 1);
    const c = X.cutToLimit(encode, pieces[shown], limit);
    const text = pieces[shown] = c.text;
    const beam = random ? 1 : req.beam;
    const { layer, spec } = selection(t, req);
    const masks = headMasks(t, spec);
    const d = await decodeTranslation(m, text, beam, masks);
    // every piece's translation (the shown one's is d's)
    const joined = async (shownText, b, hm) => {
      const outs = [];
      for (let i = 0; i < pieces.length; i++) outs.push(i === shown ? shownText : (await decodeTranslation(m, pieces[i], b, hm)).text);
      return outs;
    };
    const outputs = await joined(d.text, beam, masks);
    // the step view: the layer's call replayed (teacher-forced), as compute.step_detail
    const idx = Number(layer.split(".")[2]);
    const off = (spec.get(layer) || []).includes(req.head);
    let step;
    if (layer.startsWith("encoder.")) {
      step = stepDetail(t, d.enc, idx, req.head, "self", d.sourceTokens, d.sourceTokens, off);
    } else {
      const r = await D.replay(m, d.enc, d.hyp, masks.dec);
      const isCross = layer.endsWith("cross_attn"), p = isCross ? "cross." : "self.";
      const tt = Object.fromEntries(["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights", "output",
        "concat", "wo", "real"].map((k) => [k, r[p + k]]));
      tt.context = isCross ? d.enc.memory.at(0) : null;
      step = stepDetail(t, tt, idx, req.head, isCross ? "cross" : "causal", isCross ? d.produced : d.inputs,
        isCross ? d.sourceTokens : d.inputs, off);
    }
    const out = {
      raw: d.layers.map((l) => l.w), limit, text, tokens: d.sourceTokens, truncated: cut || c.cut,
      layers: d.layers.map(A.layerJson), stats: A.stats(d.layers), probe: A.probe(d.layers, req),
      step: { layer, ...step },
      translation: { source_tokens: d.sourceTokens, target_tokens: d.produced, decoder_inputs: d.inputs,
        text: outputs.join(" "), beam, steps: d.hyp.length, beams: d.beams, length_penalty: 1.0,
        ...(pieces.length < 2 ? { pieces: [], piece: 0 }
          : { pieces: pieces.map((p, i) => ({ source: p, text: outputs[i] })), piece: shown }),
        ...(random ? { warnings: [], note: null } : A.warnings(m.tokenizer, pieces.join(" "), t.notes)) },
    };
    if (beam > 1) {
      const greedy = (await decodeTranslation(m, text, 1, masks)).text;
      out.translation.greedy_text = (await joined(greedy, 1, masks)).join(" ");
    }
    if (spec.size) {
      const none = headMasks(t, new Map());
      const base = await decodeTranslation(m, text, beam, none);
      out.ablation = { heads: [...spec].flatMap(([l, hs]) => hs.map((hd) => [l, hd])),
        baseline: { translation: (await joined(base.text, beam, none)).join(" "), probe: A.probe(base.layers, req) } };
    }
    return out;
  }

  // ---------- the Lens (qkv.apps.serve.compute_lens) ----------
  const pyRepr = (v) => (typeof v === "boolean" ? (v ? "True" : "False") : typeof v === "string"
    ? `'${v}'` : v === null ? "None" : Array.isArray(v) || typeof v === "object" ? JSON.stringify(v) : String(v));

  // parse_lens: the attention request, position (default: the last), top_k
  function parseLens(body) {
    const req = parse(body);
    const small = (key, dflt, lo, hi) => {
      const v = key in body ? body[key] : dflt;
      if (v === null || v === undefined) return null;
      if (typeof v !== "number" || !Number.isInteger(v) || v < lo || v > hi) {
        throw bad(`${key} must be an integer in [${lo}, ${hi}], got ${pyRepr(v)}`.slice(0, 120));
      }
      return v;
    };
    return { req, position: small("position", null, 0, 10000), topK: small("top_k", 5, 1, 10) };
  }

  // compute_lens.lens_answer for a translator: the decoder teacher-forced on the translation
  async function lensAnswer(m, lr) {
    const req = lr.req, mf = m.manifest, t = mf.translation;
    if (!mf.lens) {
      const what = mf.random ? "a random-weight post-LN toy" : "an encoder";
      throw bad("model: the lens reads a decoder (qkv's translators, qkv causal LMs, transformers " +
        `decoder-only models); '${mf.name}' is ${what}`);
    }
    if (!req.translate) throw bad(`translate must be true: the lens reads '${mf.name}''s decoder, which needs the translation`);
    const chars = Array.from(req.text), cutChars = chars.length > MAX_TEXT_CHARS;
    const c = X.cutToLimit((s) => encoderInput(m, s), cutChars ? chars.slice(0, MAX_TEXT_CHARS).join("") : req.text, t.limit);
    const spec = ablationSpec(t, req), masks = headMasks(t, spec);
    const d = await decodeTranslation(m, c.text, req.beam, masks);
    const T = d.inputs.length, position = lr.position === null ? T - 1 : lr.position;
    if (position >= T) throw bad(`position must be in [0, ${T - 1}] for this text, got ${position}`);
    const all = new window.qkvRuntime.Tensor(Float32Array.from([...masks.enc.data, ...masks.dec.data]),
      [masks.enc.dims[0] + masks.dec.dims[0], t.n_heads]);
    const o = await m.lens(d.src, [t.bos_id, ...d.hyp.slice(0, -1)], position, all);
    const k = lr.topK, K = mf.lens.top_k, num = (x) => Number(x);
    const target = num(o.target.data[0]);
    const lensIds = o.lens_ids.dims[0], rowIds = (a, j) => Array.from(o.lens_ids.data.subarray((a * T + j) * K, (a * T + j) * K + k), num);
    const rowProbs = (a, j) => Array.from(o.lens_probs.data.subarray((a * T + j) * K, (a * T + j) * K + k));
    const topOf = (name, j) => Array.from(o[name].data.subarray(j * K, j * K + k));
    const heads = mf.lens.heads;
    // every id the answer names, labelled one at a time (compute_lens._json)
    const used = new Set([target]);
    for (let a = 0; a < lensIds; a++) for (let j = 0; j < T; j++) rowIds(a, j).forEach((i) => used.add(i));
    heads.forEach((_, j) => { topOf("up_ids", j).forEach((i) => used.add(num(i))); topOf("down_ids", j).forEach((i) => used.add(num(i))); });
    const names = new Map([...used].map((i) => [i, m.tokenizer.labels([i])[0]]));
    const range_ = (n) => Array.from({ length: n }, (_, i) => i);
    const pair = (ids, vals) => ids.map((i, j) => [names.get(num(i)), A.number(vals[j])]);
    return {
      model: mf.name, random: mf.random, limit: t.limit, text: c.text, tokens: d.inputs, truncated: Boolean(c.cut || cutChars),
      translation: { text: d.text, target_tokens: d.produced },
      lens: { layers: mf.lens.layers, top_k: k,
        tokens: range_(lensIds).map((a) => range_(T).map((j) => rowIds(a, j).map((i) => names.get(i)))),
        probs: range_(lensIds).map((a) => range_(T).map((j) => rowProbs(a, j).map((p) => A.number(p)))) },
      position, predicted: names.get(target), logit: A.number(o.logit.data[0]),
      dla: { heads: heads.map(([layer, head], j) => ({ layer, head, target: A.number(o.head_target.data[j]),
        up: pair(topOf("up_ids", j), topOf("up", j)), down: pair(topOf("down_ids", j), topOf("down", j)) })),
        others: mf.lens.others.map((name, j) => ({ name, target: A.number(o.others.data[j]) })),
        check: A.number(o.check.data[0], 6), note: mf.lens.note },
      dla_unavailable: null,
    };
  }

  function createEngine(options) {
    const base = (options && options.base) || "models/";
    // the models: options.models, else those the site holds (models/index.json, written by
    // qkv.apps.web.export)
    let index = null;
    const listed = () => {
      if (options && options.models) return Promise.resolve(options.models);
      if (!index) {
        index = fetch(base + "index.json").then((r) => (r.ok ? r.json() : { models: [] })).then((j) => j.models);
        index.catch(() => { index = null; });
      }
      return index;
    };
    const loading = new Map(); // name -> Promise<Model>
    const loaded = new Set();
    const model = (name) => {
      if (!loading.has(name)) {
        const p = window.qkvRuntime.load(base + name + "/");
        p.then(() => loaded.add(name), () => loading.delete(name)); // a failed download may be tried again
        loading.set(name, p);
      }
      return loading.get(name);
    };
    const manifests = new Map(); // name -> Promise<manifest.json, or null when the site lacks it>
    const manifest = (name) => {
      if (!manifests.has(name)) {
        manifests.set(name, fetch(base + name + "/manifest.json").then((r) => (r.ok ? r.json() : null), () => {
          manifests.delete(name); // the network failed: asked again next time
          return null;
        }));
      }
      return manifests.get(name);
    };
    // the listed models whose manifests the site holds
    const present = async () => (await Promise.all((await listed()).map(manifest))).filter(Boolean);
    // the server's 404 for a model it does not offer
    const known = async (name) => {
      const have = (await present()).map((mf) => mf.name);
      if (!have.includes(name)) {
        throw new EngineError(`model must be one of [${have.map((n) => `'${n}'`).join(", ")}], got '${name}'`, 404);
      }
    };
    return {
      get live() { return true; },
      strings() { return Promise.reject(new EngineError("the in-page engine has no strings: the site gives them", 0)); },
      saved() { return Promise.resolve(null); },
      async health() {
        const all = await present();
        return {
          models: all.map((mf) => ({ name: mf.name, label: mf.label, label_key: mf.label_key, translator: mf.translator,
            random: mf.random, loaded: loaded.has(mf.name) })),
          limits: { ...LIMITS },
        };
      },
      async attention(body) {
        const t0 = performance.now();
        const req = parse(body);
        await known(req.model);
        let m;
        try {
          m = await model(req.model);
        } catch (err) {
          throw new EngineError(`could not load model ${req.model}: ${err.message || err}`, 0);
        }
        const chars = Array.from(req.text), cutChars = chars.length > MAX_TEXT_CHARS;
        const text = cutChars ? chars.slice(0, MAX_TEXT_CHARS).join("") : req.text;
        const out = await (req.translate ? translation : encoderAnswer)(m, req, text);
        this.lastLayers = out.raw; // every weight unrounded, for tests against PyTorch
        delete out.raw;
        out.step_unavailable = null;
        const limit = out.limit;
        delete out.limit;
        out.truncated = Boolean(out.truncated || cutChars);
        out.notice = out.truncated ? `The text was cut to its first ${out.tokens.length} tokens (limit ${limit}).` : null;
        if (out.translation && out.translation.pieces.length) out.notice = X.splitNotice(out.translation, limit, out.truncated);
        return { model: req.model, random: m.manifest.random, limit, ...out,
          elapsed_ms: Math.round(10 * (performance.now() - t0)) / 10 };
      },
      async lens(body) {
        const t0 = performance.now();
        const lr = parseLens(body);
        await known(lr.req.model);
        let m;
        try {
          m = await model(lr.req.model);
        } catch (err) {
          throw new EngineError(`could not load model ${lr.req.model}: ${err.message || err}`, 0);
        }
        const out = await lensAnswer(m, lr);
        return { ...out, elapsed_ms: Math.round(10 * (performance.now() - t0)) / 10 };
      },
      // a model's download and sessions (the page may start them before the first request)
      load: model,
    };
  }

  window.qkvLocal = { createEngine, parse };
})();
