// qkv explorer as a static site (qkv web build): the engine the page talks to. Loaded after
// the in-page engine's scripts (when the site has them) and before app.js; it sets
// window.QKV_ENGINE (engine.js, docs/web.md) to an engine that
//   - reads the site's words (static/i18n/strings.json) and its models (site.json: their
//     download sizes, said in the model menu before anything downloads; the menu's order,
//     en-fr first, and what the page opens on);
//   - answers a request the page makes when it opens (each model's first view of the notes'
//     sentence) from the answer saved at build time: no model loads for the first view;
//   - hands any other request to the in-page engine (window.qkvLocal.createEngine, made on
//     first use, so that the first view downloads none of it) when it runs the model, or
//     refuses with a message that says what the page holds and how to run qkv serve (a site
//     built without the engine, a model the engine does not run).
"use strict";
(() => {
  const STATUS = "status"; // app.js's status line: the model's download is said there

  // index.html opened as a file (a double click on a USB stick): the browser lets it read no
  // other file, and its words are among those, so this says it in English
  const FILE_NOTE = "This page needs a web server to read its files: in its folder, run " +
    "python -m http.server and open http://127.0.0.1:8000/ (or open the published site).";

  // JSON of one file of the site (relative: the site may live under any path)
  async function getJSON(path, E) {
    let r;
    try {
      r = await fetch(path);
      if (!r.ok) throw new E.EngineError(`${path}: HTTP ${r.status}`, 0);
      return await r.json();
    } catch (err) {
      if (err instanceof E.EngineError) throw err;
      throw new E.EngineError(location.protocol === "file:" ? FILE_NOTE : `${path}: ${err}`, 0);
    }
  }

  // a request as the fields the server reads (defaults filled in, in one order; the beam only
  // when translating, as qkv.apps.serve.compute reads it): two requests with equal keys get
  // equal answers. sameText: the same, whatever the layer and head
  const fields = (r) => [String(r.text), r.model ?? "minilm", !!r.translate, r.translate ? r.beam ?? 1 : 1,
    r.ablate ?? [], r.probe ? [r.probe.token, r.probe.candidates] : null, r.piece ?? 0];
  const key = (r) => JSON.stringify([...fields(r), r.layer ?? null, r.head ?? 0]);
  const sameText = (r) => JSON.stringify(fields(r));
  const megabytes = (n) => (n / 1e6).toFixed(n < 1e7 ? 1 : 0) + " MB";
  const fill = (s, vars) => String(s).replace(/\{(\w+)\}/g, (m, k) => (k in vars ? String(vars[k]) : m));

  function create(E) {
    let inner = null; // the in-page engine, made on first use
    const answers = new Map(); // file → its parsed answer (or the promise of it)

    // site.json and the words, each model's menu label with its size added in every language
    const site = Promise.all([getJSON("site.json", E), getJSON("static/i18n/strings.json", E)]).then(([meta, strings]) => {
      const models = meta.models.map((m) => {
        if (!meta.engine || m.bytes === null) return { ...m };
        const label = "site.model." + m.name;
        for (const lang of Object.keys(strings.languages)) {
          const own = strings[lang] || (strings[lang] = {}), en = strings.en;
          const base = m.label_key ? fill(own[m.label_key] || en[m.label_key] || m.label, { name: m.name }) : m.label;
          own[label] = fill(own["site.modelSize"] || en["site.modelSize"], { label: base, size: megabytes(m.bytes) });
        }
        return { ...m, label_key: label };
      });
      const saved = new Map(meta.saved.map((s) => [key(s.request), s]));
      const byText = new Map(meta.saved.map((s) => [sameText(s.request), s]));
      return { meta, strings, models, saved, byText };
    });
    // the page's words in the language it shows (app.js sets <html lang>)
    const words = (s, k, vars) => {
      const lang = document.documentElement.lang || "en";
      return fill((s.strings[lang] || {})[k] || s.strings.en[k], vars || {});
    };
    const load = (file) => {
      if (!answers.has(file)) answers.set(file, getJSON(file, E).catch((err) => { answers.delete(file); throw err; }));
      return answers.get(file);
    };
    // every saved answer fetched once the first one is shown: the menu's models keep opening
    // with the network off
    let prefetched = false;
    function prefetch(s) {
      if (prefetched) return;
      prefetched = true;
      setTimeout(() => { for (const x of s.meta.saved) load(x.file).catch(() => {}); }, 0);
    }
    async function local() {
      if (inner) return inner;
      const hook = window.qkvLocal;
      if (!hook || typeof hook.createEngine !== "function") throw new E.EngineError("the in-page engine did not load", 0);
      inner = await hook.createEngine({ base: "models/" });
      return inner;
    }
    // whether the in-page engine runs this request's model (site.json: its download size)
    const runs = (s, request) => s.meta.engine && s.models.some((x) => x.name === request.model && x.bytes !== null);
    let runtime = false; // whether the engine's runtime (its WebAssembly) came with an answer
    // a method of the in-page engine; what it downloads said in the status line the first
    // time (the model, and the runtime with the first model; app.js writes its own status
    // over it when the answer comes)
    async function run(method, request) {
      const s = await site;
      const m = s.models.find((x) => x.name === request.model);
      const status = document.getElementById(STATUS);
      const size = (m.loaded ? 0 : m.bytes) + (runtime ? 0 : s.meta.runtime_bytes || 0);
      if (size && status) status.textContent = words(s, "site.loading", { name: m.name, size: megabytes(size) });
      const engine = await local();
      const answer = await engine[method](request);
      m.loaded = runtime = true;
      return answer;
    }
    // the page opens on the menu's first model (site.json's models are in the site's order,
    // en-fr first); without ?model= it translates when site.json says so, as picking a
    // translator in the menu does. app.js reads the address after health(): a link's own
    // model and translate still win, and a link always names its model (compare.js writeURL)
    function opening(s) {
      const box = document.getElementById("translate");
      if (box && s.meta.opens && s.meta.opens.translate && !new URLSearchParams(location.search).has("model")) box.checked = true;
    }
    // a model the site lacks (a link from qkv serve --model NAME=DIR): 404, as the server says
    const ownModel = (s) => new E.EngineError(words(s, "site.ownModel", { models: s.models.map((m) => m.name).join(", ") }), 404);
    const refuse = (s, request) => new E.EngineError(words(s, "site.savedOnly", { name: request.model }), 0);

    return {
      get live() { return true; },
      strings() { return site.then((s) => s.strings); },
      health() { return site.then((s) => { opening(s); return { models: s.models, limits: s.meta.limits }; }); },
      saved() { return Promise.resolve(null); },
      async attention(request) {
        const s = await site;
        if (!s.models.some((m) => m.name === request.model)) throw ownModel(s);
        const t0 = performance.now();
        const hit = s.saved.get(key(request));
        if (hit) {
          const answer = structuredClone(await load(hit.file));
          answer.elapsed_ms = Math.round(10 * (performance.now() - t0)) / 10; // this answer's time here
          prefetch(s);
          return answer;
        }
        if (runs(s, request)) return run("attention", request);
        // not run here: another head of a saved sentence shows its weights (the saved maps hold
        // every head), its steps are said to be missing, as the server says for a model
        const near = s.byText.get(sameText(request));
        if (near) {
          const answer = structuredClone(await load(near.file));
          answer.step = null;
          answer.step_unavailable = words(s, "site.stepSaved");
          answer.elapsed_ms = Math.round(10 * (performance.now() - t0)) / 10;
          return answer;
        }
        throw refuse(s, request);
      },
      async lens(request) {
        const s = await site;
        if (!s.models.some((m) => m.name === request.model)) throw ownModel(s);
        if (runs(s, request)) return run("lens", request);
        throw refuse(s, request);
      },
    };
  }

  window.QKV_ENGINE = create;
})();
