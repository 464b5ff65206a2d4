// qkv explorer: the engine, the one place the page's data comes from. The views never ask
// anything else: app.js (its words, the model menu, the maps) and lens.js (the Lens) call the
// engine chosen once at start-up by choose(), and get the JSON of qkv serve's API
// (docs/serve.md, "The API"), or an EngineError. docs/web.md describes the contract.
//
//   HttpEngine     qkv serve's HTTP API, on the page's own origin
//   StaticEngine   the answer saved in the page (qkv view, notebooks: <script id="qkv-data">);
//                  it runs no model
//   window.QKV_ENGINE  the hook for another engine (one that runs the models in the page): an
//                  engine, or a function (qkvEngine) → engine, set by a script that runs
//                  before app.js starts (a file the page loads: the CSP runs no inline script)
"use strict";
(() => {
  // An engine's one error: status, the HTTP status of an error answer ({"error": message}: the
  // message), or 0 when no answer came (the network failed, the answer was not JSON, or the
  // engine cannot do it). Shown as its message: "{err}" in the page's strings.
  class EngineError extends Error {
    constructor(message, status) { super(message); this.name = "EngineError"; this.status = status; }
    toString() { return this.message || "HTTP " + this.status; }
  }

  // ---------- qkv serve ----------
  // GET or POST (body: JSON) one path of the server; its JSON answer, or an EngineError
  async function call(path, body) {
    const init = body === undefined ? undefined
      : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    let r;
    try {
      r = await fetch(path, init);
      const d = await r.json();
      if (!r.ok) throw new EngineError((d && d.error) || "", r.status);
      return d;
    } catch (err) {
      if (err instanceof EngineError) throw err;
      if (r && !r.ok) throw new EngineError("", r.status); // an error answer that is not JSON: its status
      throw new EngineError(String(err), 0); // no answer, or an answer that is not JSON
    }
  }
  class HttpEngine {
    get live() { return true; } // it runs models: every request gets its own answer
    strings() { return call("/static/i18n/strings.json"); }
    health() { return call("/api/health"); }
    attention(request) { return call("/api/attention", request); }
    lens(request) { return call("/api/lens", request); }
    saved() { return Promise.resolve(null); }
  }

  // ---------- a saved answer ----------
  // blob: {"response": an /api/attention answer, "strings": i18n/strings.json}
  // (qkv.capture.page.render_page)
  class StaticEngine {
    constructor(blob) { this.blob = blob; }
    get live() { return false; }
    strings() { return Promise.resolve(this.blob.strings); }
    saved() { return Promise.resolve(this.blob.response); }
    health() { return this.refuse(); }
    attention() { return this.refuse(); }
    lens() { return this.refuse(); }
    refuse() { return Promise.reject(new EngineError("this page holds a saved answer and runs no model (qkv serve does)", 0)); }
  }

  // ---------- the choice: once, when app.js starts ----------
  const METHODS = ["strings", "health", "attention", "lens", "saved"];
  function check(engine) {
    const lacks = !engine || typeof engine !== "object" ? ["an object"] : METHODS.filter((m) => typeof engine[m] !== "function");
    if (lacks.length || typeof engine.live !== "boolean") throw new Error("window.QKV_ENGINE is not an engine: it lacks " + (lacks.join(", ") || "live"));
    return engine;
  }
  function choose() {
    const hook = window.QKV_ENGINE;
    if (hook) return check(typeof hook === "function" ? hook(window.qkvEngine) : hook);
    const saved = document.getElementById("qkv-data");
    if (saved) return new StaticEngine(JSON.parse(saved.textContent));
    return new HttpEngine();
  }

  window.qkvEngine = { choose, HttpEngine, StaticEngine, EngineError, METHODS };
})();
