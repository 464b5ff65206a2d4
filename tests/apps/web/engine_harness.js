// The harness's engine: window.engine, over the site's models/ (engine_harness.html); the
// body's data-engine says it is there (a selector the tests wait for: the page's policy lets
// Playwright evaluate no string while it polls)
"use strict";
window.engine = window.qkvLocal.createEngine({ base: "models/" });
document.addEventListener("DOMContentLoaded", () => { document.body.dataset.engine = "1"; });
