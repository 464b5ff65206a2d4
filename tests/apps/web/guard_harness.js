// Runs decode.js's RepeatGuard and answer.js's notes under node for
// tests/apps/web/test_guard_js.py: one JSON request on stdin, one JSON answer on stdout.
//
//   {"tokenizers": {name: tokenizer.json path}, "settings": {name: manifest translation.notes},
//    "banned": [[name, hist]], "notes": [[name, text]]}
//       -> {"banned": [[token, ...]], "notes": [{warnings, note}]}
"use strict";
const fs = require("fs");
const path = require("path");
const STATIC = path.join(__dirname, "../../../src/qkv/apps/web/static");
global.window = {};
const T = require(path.join(STATIC, "tokenize.js"));
require(path.join(STATIC, "decode.js"));
require(path.join(STATIC, "answer.js"));

const req = JSON.parse(fs.readFileSync(0, "utf8"));
const toks = {};
for (const [name, file] of Object.entries(req.tokenizers)) toks[name] = T.fromJson(JSON.parse(fs.readFileSync(file, "utf8")));
const guard = (name) => window.qkvDecode.RepeatGuard.forTokenizer(toks[name]);
process.stdout.write(JSON.stringify({
  banned: (req.banned || []).map(([name, hist]) => guard(name).banned(hist)),
  notes: (req.notes || []).map(([name, text]) => window.qkvAnswer.warnings(toks[name], text, req.settings[name])),
}));
