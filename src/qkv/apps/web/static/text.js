// qkv in-page engine: a text cut to a token limit, or split into pieces that fit, exactly as
// the server cuts and splits it (qkv.apps.serve.answer.cut_to_limit and split_source over
// qkv.limits.split_to_fit, fit_text, split_sentences).
//
//   qkvText.cutToLimit(encode, text, limit)   {text, tokens, ids, cut}
//   qkvText.splitSource(encode, text, limit)  {pieces, cut}: at most MAX_PIECES pieces
//
// encode(text) → {tokens, ids}. Python indexes strings by code point, so the text is handled
// as an array of code points wherever an index is taken.
"use strict";
(() => {
  const MAX_PIECES = 8; // qkv.apps.serve.limits
  const CHARS_PER_TOKEN = 16; // qkv.limits
  // Python's str.isspace(): what strip(), split() and the regexes' \s take
  const SPACE = "\\s\\u001c-\\u001f\\u0085";
  const rstrip = (s) => s.replace(new RegExp(`[${SPACE}]+$`, "u"), "");
  const lstrip = (s) => s.replace(new RegExp(`^[${SPACE}]+`, "u"), "");
  const strip = (s) => lstrip(rstrip(s));
  const WORD = new RegExp(`[^${SPACE}]+`, "gu");
  const SENTENCE_END = new RegExp(`(?<=[.!?…。！？।॥။])[${SPACE}]+|(?<=[。！？])(?=[^${SPACE}])`, "u");
  const cps = (s) => Array.from(s);

  // answer.cut_to_limit: the longest prefix of text (whole words, else characters) that
  // encodes to at most limit tokens
  function cutToLimit(encode, text, limit) {
    const first = encode(text);
    if (first.tokens.length <= limit) return { text, ...first, cut: false };
    let units = text.match(new RegExp(`[^${SPACE}]+[${SPACE}]*`, "gu")) || [];
    if (units.length < 2) units = cps(text);
    let lo = 1, hi = units.length - 1;
    while (lo < hi) {
      const mid = Math.floor((lo + hi + 1) / 2);
      if (encode(units.slice(0, mid).join("")).tokens.length <= limit) lo = mid; else hi = mid - 1;
    }
    const one = new RegExp(`^[^${SPACE}]+[${SPACE}]*$`, "u");
    if (units.length > 1 && one.test(units[0]) && encode(units[0]).tokens.length > limit) {
      const c = cps(units[0]);
      return cutToLimit(encode, c.slice(0, Math.max(1, Math.floor(c.length / 2))).join(""), limit);
    }
    const short = rstrip(units.slice(0, lo).join(""));
    return { text: short, ...encode(short), cut: true };
  }

  // qkv.limits.fit_text: the longest prefix of text (whole words where it can) within limit
  function fitText(text, limit, count) {
    let cut = cps(text);
    let i = 0;
    for (const m of text.matchAll(WORD)) {
      if (i === limit) { cut = cps(text.slice(0, m.index)); break; }
      i += 1;
    }
    cut = cut.slice(0, CHARS_PER_TOKEN * limit);
    let n = count(cut.join(""));
    while (n > limit && cut.length) {
      const keep = Math.min(cut.length - 1, Math.max(1, Math.trunc((cut.length * limit) / n * 0.95)));
      const space = cut.slice(0, keep + 1).lastIndexOf(" ");
      cut = space > Math.floor(keep / 2) ? cut.slice(0, space) : cut.slice(0, keep);
      n = count(cut.join(""));
    }
    const out = rstrip(cut.join(""));
    return out === strip(text) ? text : out;
  }

  // qkv.limits.split_to_fit: the sentences, and word runs of a sentence too long alone
  function splitToFit(text, limit, count) {
    const out = [];
    for (const sentence of text.split(SENTENCE_END).filter((s) => s && strip(s)).map(strip)) {
      let rest = sentence;
      while (rest) {
        let piece = cps(fitText(rest, limit, count));
        if (!piece.length) { // one "word" longer than the limit: cut it by characters
          const r = cps(rest);
          piece = r.slice(0, Math.max(1, Math.floor(r.length / 2)));
          while (count(piece.join("")) > limit && piece.length > 1) piece = piece.slice(0, Math.floor(piece.length / 2));
        }
        out.push(piece.join(""));
        rest = lstrip(cps(rest).slice(piece.length).join(""));
      }
    }
    return out;
  }

  // answer.split_source: [text] when it fits, else its pieces (the first MAX_PIECES × limit ×
  // CHARS_PER_TOKEN characters split); cut when more was left out
  function splitSource(encode, text, limit) {
    const count = (s) => encode(s).tokens.length;
    if (count(text) <= limit) return { pieces: [text], cut: false };
    const bound = MAX_PIECES * limit * CHARS_PER_TOKEN, chars = cps(text);
    const pieces = splitToFit(chars.slice(0, bound).join(""), limit, count);
    const cut = pieces.length > MAX_PIECES || Boolean(strip(chars.slice(bound).join("")));
    return { pieces: pieces.length ? pieces.slice(0, MAX_PIECES) : [text], cut };
  }

  // answer.split_notice: the answer's notice for a text translated in pieces
  function splitNotice(translation, limit, cut) {
    const n = translation.pieces.length, shown = translation.piece + 1;
    const out = `The text is longer than the ${limit} source tokens the maps can show: it was ` +
      `translated in ${n} pieces (at sentence ends, then between words, as qkv translate ` +
      `splits a long line) and the translations joined; the maps show piece ${shown}.`;
    return out + (cut ? ` The text after piece ${n} was left out.` : "");
  }

  window.qkvText = { cutToLimit, splitSource, splitNotice, strip, MAX_PIECES };
})();
