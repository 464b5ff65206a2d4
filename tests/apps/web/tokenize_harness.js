// Runs tokenize.js for tests/apps/web/test_tokenize_js.py. Under node: one JSON request on
// stdin, one JSON answer on stdout, so that a whole test module costs one node start; in a
// page (after tokenize.js): window.qkvTokenizeHarness(request) returns the answer.
//
//   {"unicode": {"cps": [...], "ref": {name: [cp...] | {cp: image}}, "ignore": {name: [cp...]}}}
//       -> {"unicode": {name: {"fixed": [mismatching cps], "base": [mismatching cps]}}}
//   {"tokenizers": {name: {"path": file (node) | "json": object, "options": {...}}
//                         | {"hashed": {...}}},
//    "encode": [[name, text, options?]], "decode": [[name, ids, options?]],
//    "labels": [[name, ids]], "idToToken": [[name, id]], "tokenToId": [[name, token]]}
//       -> {"load": {name: error | null}, "load_ms": {name: ms},
//           "encode": [{ids, tokens} | {error}], "decode": [string | {error}], "labels": [...],
//           "idToToken": [...], "tokenToId": [...]}
"use strict";
(function () {
  function unicode(T, req) {
    const out = {};
    for (const [name, ref] of Object.entries(req.ref)) {
      const cls = T._internal.CLASSES[name];
      const isMap = !Array.isArray(ref);
      const set = isMap ? null : new Set(ref);
      const ignore = new Set((req.ignore || {})[name] || []);
      const res = { fixed: [], base: [] };
      for (const cp of req.cps) {
        if (ignore.has(cp)) continue;
        const c = String.fromCodePoint(cp);
        const want = isMap ? (ref[cp] === undefined ? c : ref[cp]) : set.has(cp);
        if (cls.fixed(cp) !== want) res.fixed.push(cp);
        if (cls.base(cp) !== want) res.base.push(cp);
      }
      out[name] = res;
    }
    return out;
  }

  function guarded(fn) {
    try {
      return fn();
    } catch (e) {
      return { error: `${e.name}: ${e.message}` };
    }
  }

  function answer(T, req, readJson) {
    const res = {};
    if (req.unicode) res.unicode = unicode(T, req.unicode);
    if (!req.tokenizers) return res;
    const toks = {}, timing = {};
    for (const [name, spec] of Object.entries(req.tokenizers)) {
      const t0 = performance.now();
      toks[name] = guarded(() => spec.hashed ? T.hashed(spec.hashed)
        : T.fromJson(spec.json || readJson(spec.path), spec.options));
      timing[name] = performance.now() - t0;
    }
    const call = (name, fn) => (toks[name].error ? toks[name] : guarded(() => fn(toks[name])));
    res.load = Object.fromEntries(Object.entries(toks).map(([k, v]) => [k, v.error || null]));
    res.load_ms = timing;
    res.encode = (req.encode || []).map(([n, text, o]) => call(n, (t) => t.encode(text, o)));
    res.decode = (req.decode || []).map(([n, ids, o]) => call(n, (t) => t.decode(ids, o)));
    res.labels = (req.labels || []).map(([n, ids]) => call(n, (t) => t.labels(ids)));
    res.idToToken = (req.idToToken || []).map(([n, id]) => call(n, (t) => t.idToToken(id)));
    res.tokenToId = (req.tokenToId || []).map(([n, tok]) => call(n, (t) => t.tokenToId(tok)));
    return res;
  }

  if (typeof window !== "undefined") {
    window.qkvTokenizeHarness = (req) => answer(window.qkvTokenize, req);
  } else {
    const fs = require("fs");
    const path = require("path");
    const T = require(path.join(__dirname, "../../../src/qkv/apps/web/static/tokenize.js"));
    const req = JSON.parse(fs.readFileSync(0, "utf8"));
    const read = (file) => JSON.parse(fs.readFileSync(file, "utf8"));
    process.stdout.write(JSON.stringify(answer(T, req, read)));
  }
})();
