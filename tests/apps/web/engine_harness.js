// The harness's engine: window.engine, over the site's models/ (engine_harness.html)
"use strict";
window.engine = window.qkvLocal.createEngine({ base: "models/" });
