// qkv in-page engine: the /api/attention answer from a model's outputs, field by field as
// qkv serve builds it (qkv.apps.serve.compute, answer, qkv.capture.page and stats):
//
//   qkvAnswer.round(x), number(x, d)   the JSON's rounding (3 decimals, null for ±inf/NaN)
//   qkvAnswer.layerJson(...)           one entry of `layers`
//   qkvAnswer.stats(layers)            `stats`: every head's scores (head_scores)
//   qkvAnswer.probe(layers, req)       `probe`: the pronoun probe, or null
//   qkvAnswer.stepMatrices(t, q, k)    the step-by-step view's `matrices`
//   qkvAnswer.warnings(tok, text, s)   a translation's `warnings` and `note`
//
// A layer here is {name, kind, heads, q_tokens, k_tokens, w: [h][Tq][Tk] numbers (unrounded)}.
"use strict";
(() => {
  const STEP_DIMS = 64; // feature columns sent per step matrix (qkv.apps.serve.limits)

  // torch.round(decimals=3) on the float64 value: half to even; non-finite: null
  function round(x, decimals = 3) {
    if (!Number.isFinite(x)) return null;
    const p = 10 ** decimals, r = x * p, f = Math.floor(r), d = r - f;
    const n = d > 0.5 ? f + 1 : d < 0.5 ? f : f % 2 === 0 ? f : f + 1;
    return n / p;
  }
  // Python's round(float(x), d), None when not finite (qkv.capture.page.number)
  function number(x, decimals = 3) {
    if (x === null || x === undefined || !Number.isFinite(x)) return null;
    return Number(x.toFixed(decimals));
  }
  const roundRows = (rows) => rows.map((r) => r.map((x) => round(x)));

  function layerJson(l) {
    return { name: l.name, kind: l.kind, heads: l.heads, q_tokens: l.q_tokens, k_tokens: l.k_tokens,
      weights: l.w.map(roundRows) };
  }

  // ---------- head statistics (qkv.capture.stats) ----------
  const SPECIAL = new Set(["[CLS]", "[SEP]", "[PAD]", "[MASK]", "<s>", "</s>", "<pad>", "<bos>", "<eos>",
    "<unk>", "[UNK]", "<|endoftext|>"]);
  // Python's str.strip() whitespace
  const strip = (s) => s.replace(/^[\s\u001c-\u001f\u0085]+|[\s\u001c-\u001f\u0085]+$/gu, "");
  function isSpecial(token) {
    const t = strip(token);
    return SPECIAL.has(t) || (t.length > 0 && /^\p{P}+$/u.test(t));
  }
  const mean = (vals, ok) => {
    let s = 0, n = 0;
    vals.forEach((v, i) => { if (ok[i]) { s += v; n += 1; } });
    return n ? s / n : NaN;
  };

  // head_scores of one head's map w [Tq][Tk]
  function headScores(w, kTokens, qOffset, cross) {
    const Tq = w.length, Tk = Tq ? w[0].length : 0;
    const special = kTokens.map(isSpecial);
    const total = w.map((r) => r.reduce((a, b) => a + b, 0));
    const live = total.map((t) => t > 0);
    const ent = w.map((r) => -r.reduce((a, x) => a + (x === 0 ? 0 : x * Math.log(x)), 0));
    const dist = w.map((r, i) => r.reduce((a, x, j) => a + x * Math.abs(i + qOffset - j), 0));
    const at = (d) => {
      const vals = [], ok = [];
      w.forEach((r, i) => {
        const p = i + qOffset + d;
        ok.push(p >= 0 && p < Tk && live[i]);
        vals.push(r[Math.min(Math.max(p, 0), Tk - 1)]);
      });
      return [vals, ok];
    };
    const [prev, prevOk] = at(-1), [next, nextOk] = at(1), [self, selfOk] = at(0);
    return {
      entropy: mean(ent, live),
      distance: cross ? NaN : mean(dist, live),
      prev: cross ? NaN : mean(prev, prevOk),
      next: cross ? NaN : mean(next, nextOk),
      self: cross ? NaN : mean(self, selfOk),
      first: mean(w.map((r) => r[0]), live),
      punct: mean(w.map((r) => r.reduce((a, x, j) => a + (special[j] ? x : 0), 0)), live),
    };
  }

  function stats(layers) {
    const out = [];
    for (const l of layers) {
      l.heads.forEach((h, hi) => {
        const s = headScores(l.w[hi], l.k_tokens, l.q_offset || 0, l.kind === "cross");
        const row = { layer: l.name, head: h, kind: l.kind };
        for (const [k, v] of Object.entries(s)) row[k] = number(v);
        out.push(row);
      });
    }
    return out;
  }

  // ---------- the pronoun probe (qkv.capture.stats.pronoun_probe, answer.probe_json) ----------
  const normalizeToken = (t) => t.replace(/^##/, "").replace(/^[▁Ġ]+/u, "").toLowerCase();
  const positions = (tokens, word) => {
    const want = normalizeToken(word);
    return tokens.flatMap((t, i) => (normalizeToken(t) === want ? [i] : []));
  };
  function probe(layers, req) {
    const p = req.probe;
    if (!p || !p.token) return null;
    const rows = [];
    for (const l of layers) {
      const q = positions(l.q_tokens, p.token);
      const kPos = p.candidates.map((c) => [String(c), positions(l.k_tokens, c)]);
      if (!q.length || !kPos.every(([, ps]) => ps.length)) continue;
      l.heads.forEach((h, hi) => {
        const scores = {};
        for (const [c, ps] of kPos) scores[c] = ps.reduce((a, j) => a + Math.fround(l.w[hi][q[0]][j]), 0);
        const ranked = Object.entries(scores).map((e, i) => [...e, i]).sort((a, b) => b[1] - a[1] || a[2] - b[2]);
        const margin = ranked[0][1] - (ranked.length > 1 ? ranked[1][1] : 0);
        rows.push({ layer: l.name, head: h, scores, best: ranked[0][0], margin });
      });
    }
    if (!rows.length) {
      const toks = layers.length ? layers[0].q_tokens : [];
      return { error: `no captured layer has query ${pyRepr(p.token)} and keys [${p.candidates.map(pyRepr).join(", ")}]; ` +
        `tokens were [${toks.map(pyRepr).join(", ")}]`, rows: [] };
    }
    rows.sort((a, b) => b.scores[b.best] - a.scores[a.best]);
    const deciding = rows.filter((r) => r.margin >= 0.1 && r.scores[r.best] >= 0.2);
    const votes = {};
    for (const r of deciding) votes[r.best] = (votes[r.best] || 0) + 1;
    return {
      token: p.token, candidates: p.candidates,
      rows: rows.slice(0, 12).map((r) => ({ layer: r.layer, head: r.head, best: r.best, margin: number(r.margin),
        scores: Object.fromEntries(Object.entries(r.scores).map(([c, v]) => [c, number(v)])) })),
      deciding: deciding.length, votes, n_heads: rows.length,
    };
  }
  const pyRepr = (s) => (String(s).includes("'") && !String(s).includes('"') ? `"${s}"` : `'${String(s).replace(/'/g, "\\'")}'`);

  // ---------- the step-by-step view (answer.step_matrices) ----------
  // t: {key: rows (arrays)} for the keys of STEPS; a missing key is left out
  const STEPS = [["x", "q", false], ["context", "k", false], ["q", "q", false], ["k", "k", false],
    ["v", "k", false], ["scores", "q", true], ["scaled", "q", true], ["mask", "q", true],
    ["masked", "q", true], ["weights", "q", true], ["output", "q", false], ["concat", "q", false],
    ["wo", "q", false]];
  function stepMatrices(t, qTokens, kTokens, scale) {
    if (qTokens.length > 128) return window.qkvLongAnswer.packedSteps(t, STEPS, qTokens, kTokens, scale); // TOKEN_LIMIT
    const tokens = { q: qTokens, k: kTokens };
    return STEPS.filter(([key]) => t[key]).map(([key, rows, square]) => {
      const m = t[key], shape = [m.length, m.length ? m[0].length : 0];
      const cut = square ? m : m.map((r) => r.slice(0, STEP_DIMS));
      const cols = square ? kTokens : Array.from({ length: cut.length ? cut[0].length : 0 }, (_, i) => String(i));
      return { key, shape, rows: tokens[rows], cols, values: roundRows(cut) };
    });
  }

  // ---------- a translation's notes (qkv.apps.serve.decoding.notes) ----------
  // `s`: the manifest's translation.notes (qkv.apps.serve.decoding.page_settings): the
  // thresholds, word lists and English sentences of qkv.translate and qkv.translate_notes
  const SENTENCE_END = /(?<=[.!?…。！？।॥။])\s+|(?<=[。！？])(?=\S)/u;
  const PY_SPACE = "\\t-\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
  const WORD = /[\p{L}\p{Nl}\p{No}]+/gu; // Python's [^\W\d_]+: letters, numbers that are not digits
  const NUMBER = /(?<![\p{L}\p{Nl}\p{No}])\p{Nd}/u; // a digit not glued to a letter
  const SENTENCE_START = new RegExp(`(?:^|[.!?…:;][${PY_SPACE}]+)["'«“(\\[]*$`, "u");
  const AND = new RegExp(`^[${PY_SPACE}]+(?:and|et|und|&)[${PY_SPACE}]+$`, "iu");
  const pySplit = (s) => strip(s).split(/[\s\u001c-\u001f\u0085]+/u).filter(Boolean);
  // Python's str.isupper() of one character, and of a word (cased, nothing lower or title case)
  const upperChar = (c) => /\p{Uppercase}/u.test(c);
  const upperWord = (w) => !/[\p{Lowercase}\p{Lt}]/u.test(w) && /\p{Uppercase}/u.test(w);
  const format = (template, fields) => template.replace(/\{(\w+)\}/g, (_, k) => String(fields[k]));

  // qkv.translate_notes.unseen_words: the words that look unseen by the model, each once
  function unseenWords(tok, text, s) {
    const matches = [...text.matchAll(WORD)];
    const unseen = [], split = [];
    matches.forEach((m, j) => {
      const word = m[0], ids = tok.encode(word).ids, n = ids.length;
      const single = n > 1 && ids.some((i) => [...strip(tok.decode([i]))].length === 1);
      const inside = !SENTENCE_START.test(text.slice(0, m.index));
      const name = inside && n > 1 && upperChar([...word][0]) && !upperWord(word);
      if (n >= s.unseen_pieces || (n === s.unseen_pieces - 1 && single) || name) {
        const first = j >= 2 ? matches[j - 2] : null; // "John and Maria": John is a name too
        if (name && first && upperChar([...first[0]][0]) && AND.test(text.slice(first.index + first[0].length, m.index))) {
          unseen.push(first[0]);
        }
        unseen.push(word);
      }
      if (n >= s.unseen_pieces - 1) split.push(word);
    });
    const u = [...new Set(unseen)], sp = [...new Set(split)];
    return u.length >= s.unseen_words ? u : sp.length >= s.many_pieces_words ? sp : [];
  }

  // qkv.translate_notes._looks_like: the language the text looks written in when not `src`
  function looksLike(text, s) {
    const words = [...text.matchAll(WORD)].map((m) => m[0].toLowerCase());
    const hits = {};
    for (const [lang, list] of Object.entries(s.language_words)) {
      const vocab = new Set(list);
      hits[lang] = words.filter((w) => vocab.has(w)).length;
    }
    let other = null;
    for (const lang of Object.keys(hits)) if (lang !== s.src && (other === null || hits[lang] > hits[other])) other = lang;
    return other !== null && hits[other] >= s.language_min_hits && hits[other] > 2 * (hits[s.src] || 0) ? other : null;
  }

  // qkv.translate.warning_text: a note's English sentence
  function noteText(w, s) {
    const f = { ...w };
    if (Array.isArray(f.words)) f.words = f.words.slice(0, 4).join(", ") + (f.words.length > 4 ? ", ..." : "");
    for (const k of ["looks", "reads"]) if (k in f) f[k] = s.language_names[f[k]] ?? f[k];
    return format(s.text[w.code], f);
  }

  // qkv.translate.source_warnings, then qkv.translate_notes.source_notes (no "unseen" where
  // "pieces" says it already): {warnings, note}
  function warnings(tok, text, s) {
    const out = [];
    const sentences = text.split(SENTENCE_END).filter((x) => x && strip(x));
    const words = Math.max(0, ...sentences.map((x) => pySplit(x).length));
    if (words > s.long_words) out.push({ code: "long", words });
    const nWords = pySplit(text).length, nTokens = tok.encode(text).ids.length;
    const pieces = nWords && nTokens >= 6 && nTokens > s.pieces_per_word * nWords;
    if (pieces) out.push({ code: "pieces", per_word: number(nTokens / nWords, 1) });
    const looks = s.src in s.language_words ? looksLike(text, s) : null;
    if (looks !== null) out.push({ code: "language", looks, reads: s.src });
    const unseen = pieces ? [] : unseenWords(tok, text, s);
    if (unseen.length) out.push({ code: "unseen", words: unseen });
    if (NUMBER.test(text)) out.push({ code: "numbers" });
    if (text.includes("?") || text.includes("¿")) out.push({ code: "question" });
    return { warnings: out, note: out.map((w) => noteText(w, s)).join(" ") || null };
  }

  window.qkvAnswer = { round, number, layerJson, stats, headScores, probe, stepMatrices, warnings, isSpecial, STEP_DIMS };
})();
