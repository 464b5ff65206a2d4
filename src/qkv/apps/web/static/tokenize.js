/* qkvTokenize: the shipped models' tokenizers in the page, giving the ids Python gives.
 *
 * A plain script (no modules, no dependencies) that sets window.qkvTokenize, and under node
 * module.exports. It reads a HuggingFace tokenizer.json object and follows the code path
 * qkv's Python API takes for that kind of model:
 *
 *   byte-level BPE (en-fr, fr-en)   qkv.data.Tokenizer: NFC, a space in front, byte-level
 *                                   BPE; decode stops at </s> and drops the space again;
 *                                   labels(ids) are qkv.inspect.translation.piece_labels
 *   BERT WordPiece (MiniLM)         transformers' tokenizer as qkv.inspect.minilm calls it:
 *                                   [CLS] … [SEP], cut to maxLength; labels are the tokens
 *   hashed({vocabSize})             the tiny random model (qkv.inspect.tiny): words and
 *                                   punctuation marks, ids by CRC-32 of the lower-cased word
 *
 * Every tokenizer has encode(text) -> {ids, tokens}, decode(ids) -> string,
 * idToToken(id), tokenToId(token) and labels(ids), the token labels /api/attention sends.
 *
 * Unicode: the reference implementations carry their own Unicode tables (HF tokenizers' Rust
 * crates, Python 3.11's Unicode 14), older than the JavaScript engine's. unicodeFixes(), at
 * the end, lists the code points where the two disagree (characters assigned since),
 * generated from the references and checked code point by code point by
 * tests/apps/web/test_tokenize_js.py.
 */
(function (root) {
  "use strict";

  // ---- Unicode classes ------------------------------------------------------------------

  // Code points where a reference's class differs from the JS engine's \p{...}: see
  // unicodeFixes() at the end of the file
  const UNICODE_FIXES = unicodeFixes();

  function parseRanges(spec) {
    const out = [];
    for (const part of (spec || "").split(",")) {
      if (!part) continue;
      const [a, b] = part.split("-");
      out.push([parseInt(a, 16), parseInt(b === undefined ? a : b, 16)]);
    }
    return out;
  }

  function inRanges(ranges, cp) {
    let lo = 0, hi = ranges.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (cp < ranges[mid][0]) hi = mid - 1;
      else if (cp > ranges[mid][1]) lo = mid + 1;
      else return true;
    }
    return false;
  }

  // every class and map below by name, uncorrected ("base") and corrected: the tests
  // compare the corrected ones with the references, the table generator reads the base ones
  const CLASSES = {};

  /** A predicate on code points: the JS regex class `re`, corrected by UNICODE_FIXES[name]. */
  function charClass(name, re) {
    const fix = UNICODE_FIXES[name] || {};
    const plus = parseRanges(fix["+"]), minus = parseRanges(fix["-"]);
    const base = (cp) => re.test(String.fromCodePoint(cp));
    const memo = new Uint8Array(0x10000); // the BMP's answers: 0 not asked yet, 1 no, 2 yes
    const fixed = function (cp) {
      if (cp < 0x10000 && memo[cp]) return memo[cp] === 2;
      const yes = inRanges(plus, cp) || (!inRanges(minus, cp) && base(cp));
      if (cp < 0x10000) memo[cp] = yes ? 2 : 1;
      return yes;
    };
    CLASSES[name] = { base, fixed };
    return fixed;
  }

  /** A map on code points: the JS function `fn`, corrected by UNICODE_FIXES[name]["="]
   * ({hex code point: its image as a string}). */
  function charMap(name, fn) {
    const fix = (UNICODE_FIXES[name] || {})["="] || {};
    const table = new Map(Object.keys(fix).map((k) => [parseInt(k, 16), fix[k]]));
    const base = (cp) => fn(String.fromCodePoint(cp));
    const fixed = function (cp) {
      const t = table.get(cp);
      return t === undefined ? base(cp) : t;
    };
    CLASSES[name] = { base, fixed };
    return fixed;
  }

  // HF tokenizers (Rust): char::is_whitespace (White_Space), unicode_categories 0.1.1
  // (is_other: Cc Cf Co; is_punctuation; is_mark_nonspacing), char::to_lowercase per char
  // (no final sigma), the unicode-normalization crate.
  const rust = {
    whitespace: charClass("rust.whitespace", /^\p{White_Space}$/u),
    other: charClass("rust.other", /^(?![\0\t\n\r])[\p{Cc}\p{Cf}\p{Co}]$/u),
    punctuation: charClass("rust.punctuation", /^(?![\x21-\x7e])\p{P}$/u), // ASCII: below
    nonspacing: charClass("rust.nonspacing", /^\p{Mn}$/u),
    lower: charMap("rust.lower", (c) => c.toLowerCase()),
    nfd: charMap("rust.nfd", (c) => c.normalize("NFD")),
  };
  // Python 3.11 (Unicode 14): re's \w, unicodedata.category P* or S*, str.isspace
  const py = {
    word: charClass("py.word", /^[\p{L}\p{N}_]$/u),
    punctOrSymbol: charClass("py.punctOrSymbol", /^[\p{P}\p{S}]$/u),
    space: charClass("py.space",
      /^[\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$/u),
    lower: charMap("py.lower", (c) => c.toLowerCase()),
  };

  function codePoints(s) {
    const out = [];
    for (const ch of s) out.push(ch.codePointAt(0));
    return out;
  }

  /** cps[start:end] as a string, in chunks: a spread of a whole long text would pass more
   * arguments than an engine takes. */
  function fromCodePoints(cps, start = 0, end = cps.length) {
    let out = "";
    for (let i = start; i < end; i += 8192) {
      out += String.fromCodePoint(...cps.slice(i, Math.min(end, i + 8192)));
    }
    return out;
  }

  function checkText(text, what) {
    if (typeof text !== "string") {
      throw new TypeError(`${what} must be a string, got ${text === null ? "null" : typeof text}`);
    }
    // a lone surrogate has no UTF-8 form: neither Python's tokenizers nor the server take it
    const bad = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/.exec(text);
    if (bad) {
      throw new TypeError(`${what} must be well-formed Unicode, got a lone surrogate ` +
        `U+${bad[0].charCodeAt(0).toString(16).toUpperCase()} at index ${bad.index}`);
    }
  }

  function checkIds(ids) {
    if (!Array.isArray(ids) || !ids.every(Number.isInteger)) {
      throw new TypeError(`ids must be an array of integers, got ${show(ids)}`);
    }
  }

  /** A value in an error message: JSON, cut short. */
  function show(v) {
    const s = v === undefined ? "undefined" : JSON.stringify(v);
    return s.length > 120 ? s.slice(0, 117) + "..." : s;
  }

  /** One clear error for a tokenizer.json this port does not read. */
  function fail(field, expected, got) {
    throw new TypeError(`tokenizer.json: ${field} must be ${expected}, got ${show(got)}`);
  }

  // ---- Pieces shared by both tokenizer.json kinds --------------------------------------

  /** tokenizer.json's added tokens: the text is split on them first (leftmost, longest),
   * before any normalisation, as HF's AddedVocabulary does for `normalized: false` ones. */
  function addedTokens(json) {
    const list = json.added_tokens || [];
    if (!Array.isArray(list)) fail("added_tokens", "a list", list);
    for (const t of list) {
      if (typeof t !== "object" || t === null || typeof t.content !== "string" ||
          !Number.isInteger(t.id)) {
        fail("an added token", "{content: string, id: integer, …}", t);
      }
      for (const opt of ["normalized", "lstrip", "rstrip", "single_word"]) {
        if (t[opt]) {
          fail(`added token ${show(t.content)}'s ${opt}`, "false (all qkvTokenize reads)", t[opt]);
        }
      }
    }
    return list.map((t) => ({ content: t.content, id: t.id, special: !!t.special }));
  }

  /** `text` as [[piece, added token or null]], split on the added tokens. */
  function splitAdded(text, added) {
    const out = [];
    let start = 0, i = 0;
    while (i < text.length) {
      let best = null;
      for (const t of added) {
        const longer = !best || t.content.length > best.content.length;
        if (t.content && longer && text.startsWith(t.content, i)) best = t;
      }
      if (best) {
        if (i > start) out.push([text.slice(start, i), null]);
        out.push([best.content, best]);
        i += best.content.length;
        start = i;
      } else {
        i += 1;
      }
    }
    if (start < text.length) out.push([text.slice(start), null]);
    return out;
  }

  function vocabMaps(vocab, added) {
    if (typeof vocab !== "object" || vocab === null || Array.isArray(vocab)) {
      fail("model.vocab", "an object {token: id}", vocab);
    }
    const toId = new Map(), toToken = new Map();
    for (const [tok, id] of Object.entries(vocab)) {
      toId.set(tok, id);
      toToken.set(id, tok);
    }
    for (const t of added) { // added tokens win, as in HF (id_to_token asks them first)
      toId.set(t.content, t.id);
      toToken.set(t.id, t.content);
    }
    return { toId, toToken };
  }

  /** A Map with a size bound: encode() caches one result per word. */
  function boundedCache(limit) {
    const map = new Map();
    return {
      get: (k) => map.get(k),
      set(k, v) {
        if (map.size >= limit) map.clear();
        map.set(k, v);
      },
    };
  }

  // ---- Byte-level BPE (qkv.data.Tokenizer) ----------------------------------------------

  // GPT-2's byte ↔ character alphabet: printable bytes stand for themselves, the others are
  // shifted to U+0100… so that every byte is a visible character ("Ġ" is the space).
  const BYTE_TO_CHAR = [], CHAR_TO_BYTE = new Map();
  (function () {
    let n = 0;
    for (let b = 0; b < 256; b++) {
      const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      const ch = String.fromCodePoint(printable ? b : 256 + n++);
      BYTE_TO_CHAR.push(ch);
      CHAR_TO_BYTE.set(ch, b);
    }
  })();

  const UTF8 = new TextEncoder();
  // ignoreBOM: a leading U+FEFF is text here, not a byte-order mark to drop
  const FROM_UTF8 = new TextDecoder("utf-8", { ignoreBOM: true });

  /** HF ByteLevel's split (the GPT-2 pattern, \s being White_Space as in Oniguruma). */
  function byteLevelSplit(s) {
    const out = [];
    const cps = codePoints(s);
    const n = cps.length;
    const isL = onig.letter, isN = onig.number, isS = onig.space;
    const other = (c) => !isS(c) && !isL(c) && !isN(c);
    let i = 0;
    while (i < n) {
      const c = cps[i];
      let j = i;
      // 's 't 're 've 'm 'll 'd: the first alternatives, tried in that order
      if (c === 0x27 && i + 1 < n) {
        const a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : -1;
        if (a === 0x73 || a === 0x74 || a === 0x6d || a === 0x64) j = i + 2; // s t m d
        else if ((a === 0x72 || a === 0x76) && b === 0x65) j = i + 3; // re ve
        else if (a === 0x6c && b === 0x6c) j = i + 3; // ll
      }
      if (j === i) {
        const k = c === 0x20 && i + 1 < n ? i + 1 : i; // " ?" in front of a run
        const d = cps[k];
        if (k < n && isL(d)) { j = k + 1; while (j < n && isL(cps[j])) j++; }
        else if (k < n && isN(d)) { j = k + 1; while (j < n && isN(cps[j])) j++; }
        else if (k < n && other(d)) { j = k + 1; while (j < n && other(cps[j])) j++; }
        else { // \s+(?!\S) | \s+: a space run, leaving its last space to the word after it
          j = i + 1;
          while (j < n && isS(cps[j])) j++;
          if (j < n && j - i > 1) j -= 1;
        }
      }
      out.push(fromCodePoints(cps, i, j));
      i = j;
    }
    return out;
  }

  // Oniguruma's classes as HF's ByteLevel regex sees them
  const onig = {
    letter: charClass("onig.letter", /^\p{L}$/u),
    number: charClass("onig.number", /^\p{N}$/u),
    space: charClass("onig.space", /^\p{White_Space}$/u),
  };

  /** BPE merges by rank, lowest first, leftmost among equals: HF's Word::merge_all, a heap
   * of (rank, position) with stale entries skipped, so a long word costs n log n. */
  function bpeWord(symbols, ranks) {
    const n = symbols.length;
    if (n < 2) return symbols.slice();
    const sym = symbols.slice(); // null once merged into its left neighbour
    const next = Array.from({ length: n }, (_, i) => (i + 1 < n ? i + 1 : -1));
    const prev = Array.from({ length: n }, (_, i) => i - 1);
    const heap = []; // [rank, position], a binary min-heap
    const less = (a, b) => a[0] < b[0] || (a[0] === b[0] && a[1] < b[1]);
    const push = (item) => {
      heap.push(item);
      for (let i = heap.length - 1; i > 0;) {
        const p = (i - 1) >> 1;
        if (!less(heap[i], heap[p])) break;
        [heap[i], heap[p]] = [heap[p], heap[i]];
        i = p;
      }
    };
    const pop = () => {
      const top = heap[0], last = heap.pop();
      if (heap.length) {
        heap[0] = last;
        for (let i = 0; ;) {
          const l = 2 * i + 1, r = l + 1;
          let m = i;
          if (l < heap.length && less(heap[l], heap[m])) m = l;
          if (r < heap.length && less(heap[r], heap[m])) m = r;
          if (m === i) break;
          [heap[i], heap[m]] = [heap[m], heap[i]];
          i = m;
        }
      }
      return top;
    };
    const pair = (i) => {
      if (i < 0 || next[i] < 0) return;
      const r = ranks.get(sym[i] + " " + sym[next[i]]);
      if (r !== undefined) push([r, i]);
    };
    for (let i = 0; i + 1 < n; i++) pair(i);
    while (heap.length) {
      const [r, i] = pop();
      const j = sym[i] === null ? -1 : next[i];
      if (j < 0 || ranks.get(sym[i] + " " + sym[j]) !== r) continue; // stale
      sym[i] += sym[j];
      sym[j] = null;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      pair(prev[i]);
      pair(i);
    }
    return sym.filter((t) => t !== null);
  }

  const QKV_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"];

  function byteLevelBpe(json) {
    const model = json.model;
    const pre = json.pre_tokenizer || {};
    if (pre.type !== "ByteLevel" || pre.add_prefix_space || pre.use_regex === false) {
      fail("pre_tokenizer", "ByteLevel with add_prefix_space false and use_regex true", pre);
    }
    const norm = json.normalizer;
    if (norm && norm.type !== "NFC") {
      fail("normalizer", "NFC or null for a BPE tokenizer", norm);
    }
    if ((json.decoder || {}).type !== "ByteLevel") {
      fail("decoder", "ByteLevel for a BPE tokenizer", json.decoder);
    }
    for (const opt of ["dropout", "continuing_subword_prefix", "end_of_word_suffix"]) {
      if (model[opt]) fail(`model.${opt}`, "null", model[opt]);
    }
    for (const opt of ["byte_fallback", "ignore_merges"]) {
      if (model[opt]) fail(`model.${opt}`, "false", model[opt]);
    }
    const added = addedTokens(json);
    const { toId, toToken } = vocabMaps(model.vocab, added);
    QKV_SPECIALS.forEach((name, i) => {
      if (toId.get(name) !== i) {
        fail(`the id of ${name}`, `${i} (qkv's specials: <pad> <s> </s> <unk>)`, toId.get(name));
      }
    });
    const ranks = new Map();
    (model.merges || []).forEach((m, r) => {
      const pair = Array.isArray(m) ? m : String(m).split(" ");
      ranks.set(pair[0] + " " + pair[1], r); // a repeated pair: the last rank, as HF's map
    });
    const unk = model.unk_token == null ? null : model.unk_token;
    const cache = boundedCache(20000);
    const specialIds = new Set(added.filter((t) => t.special).map((t) => t.id));

    function encodeWord(word, ids, tokens) {
      let hit = cache.get(word);
      if (hit === undefined) {
        const chars = Array.from(UTF8.encode(word), (b) => BYTE_TO_CHAR[b]);
        hit = [];
        for (const tok of bpeWord(chars, ranks)) {
          const id = toId.get(tok);
          if (id !== undefined) hit.push([id, tok]);
          else if (unk !== null && toId.has(unk)) hit.push([toId.get(unk), unk]);
          else fail("model.unk_token", `a token (${show(tok)} is not in the vocabulary)`, unk);
        }
        cache.set(word, hit);
      }
      for (const [id, tok] of hit) { ids.push(id); tokens.push(tok); }
    }

    /** HF's decode(ids, skip_special_tokens): ids → byte-level tokens → UTF-8 (lossy). */
    function hfDecode(ids, skipSpecial) {
      const bytes = [];
      for (const id of ids) {
        const tok = toToken.get(id);
        if (tok === undefined || (skipSpecial && specialIds.has(id))) continue;
        const own = [];
        let ok = true;
        for (const ch of tok) {
          const b = CHAR_TO_BYTE.get(ch);
          if (b === undefined) { ok = false; break; }
          own.push(b);
        }
        bytes.push(...(ok ? own : UTF8.encode(tok)));
      }
      return FROM_UTF8.decode(new Uint8Array(bytes));
    }

    return {
      kind: "bpe",
      vocabSize: toId.size,
      bosId: 1, eosId: 2, padId: 0, unkId: 3,

      /** qkv Tokenizer.encode: no specials; a space in front, so that the first word is
       * tokenised as every other. */
      encode(text) {
        checkText(text, "text");
        const ids = [], tokens = [];
        for (const [piece, tok] of splitAdded(" " + text, added)) {
          if (tok) { ids.push(tok.id); tokens.push(tok.content); continue; }
          const normal = norm ? piece.normalize("NFC") : piece;
          for (const word of byteLevelSplit(normal)) encodeWord(word, ids, tokens);
        }
        return { ids, tokens };
      },

      /** qkv Tokenizer.decode: stops at the first </s>, drops <pad>, <s> (and every special),
       * and the space encode() put in front. */
      decode(ids) {
        checkIds(ids);
        const kept = [];
        for (const i of ids) {
          if (i === 2) break;
          if (i !== 0 && i !== 1) kept.push(i);
        }
        const text = hfDecode(kept, true);
        return text.startsWith(" ") ? text.slice(1) : text;
      },

      /** qkv.inspect.translation.piece_labels: one readable label per id. */
      labels(ids) {
        checkIds(ids);
        return pieceLabels(ids, (part) => hfDecode(part, false));
      },

      idToToken: (id) => (toToken.has(id) ? toToken.get(id) : null),
      tokenToId: (tok) => (toId.has(tok) ? toId.get(tok) : null),
    };
  }

  /** Python's str.strip(): its own whitespace (str.isspace), not JavaScript's trim(). */
  function pyStrip(s) {
    const cps = codePoints(s);
    let a = 0, b = cps.length;
    while (a < b && py.space(cps[a])) a++;
    while (b > a && py.space(cps[b - 1])) b--;
    return fromCodePoints(cps, a, b);
  }

  function pieceLabel(text) {
    if (text.startsWith(" ")) return text.slice(1) || "␣";
    const cps = codePoints(text);
    if (cps.length && cps.every(py.punctOrSymbol)) return text; // "." not "##."
    return "##" + text;
  }

  function pieceLabels(ids, decode) {
    const specials = { 0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>" };
    const out = [];
    let j = 0;
    while (j < ids.length) {
      if (ids[j] in specials) { out.push(specials[ids[j]]); j += 1; continue; }
      let text = decode(ids.slice(j, j + 1)), end = j + 1, whole = false;
      // part of a character: the fewest following pieces (≤ 4 bytes a character) completing it
      while (text.includes("\ufffd") && end < Math.min(j + 4, ids.length) && !(ids[end] in specials)) {
        end += 1;
        const t = decode(ids.slice(j, end));
        if (!t.includes("\ufffd")) { text = t; whole = true; break; }
      }
      if (!whole) end = j + 1;
      out.push(pieceLabel(text));
      for (let k = j + 1; k < end; k++) out.push(`(${pyStrip(text) || "␣"})`);
      j = end;
    }
    return out;
  }

  // ---- BERT WordPiece (all-MiniLM-L6-v2) -------------------------------------------------

  function isChineseChar(cp) {
    return (cp >= 0x4e00 && cp <= 0x9fff) || (cp >= 0x3400 && cp <= 0x4dbf) ||
      (cp >= 0x20000 && cp <= 0x2a6df) || (cp >= 0x2a700 && cp <= 0x2b73f) ||
      (cp >= 0x2b740 && cp <= 0x2b81f) || (cp >= 0x2b920 && cp <= 0x2ceaf) ||
      (cp >= 0xf900 && cp <= 0xfaff) || (cp >= 0x2f800 && cp <= 0x2fa1f);
  }

  /** HF's BertNormalizer, in its order: clean, CJK, strip accents, lowercase. */
  function bertNormalize(s, opt) {
    let cps = codePoints(s);
    if (opt.clean) {
      const out = [];
      for (const c of cps) {
        if (c === 0 || c === 0xfffd) continue;
        const tnr = c === 9 || c === 10 || c === 13; // controls BERT counts as spaces
        if (!tnr && rust.other(c)) continue;
        out.push(tnr || rust.whitespace(c) ? 0x20 : c);
      }
      cps = out;
    }
    if (opt.chinese) cps = cps.flatMap((c) => (isChineseChar(c) ? [0x20, c, 0x20] : [c]));
    if (opt.stripAccents) {
      const out = [];
      for (const c of cps) {
        for (const d of codePoints(rust.nfd(c))) if (!rust.nonspacing(d)) out.push(d);
      }
      cps = out;
    }
    let text = fromCodePoints(cps);
    if (opt.lowercase) text = cps.map(rust.lower).join("");
    return text;
  }

  /** HF's BertPreTokenizer: split on whitespace (dropped), isolate each punctuation mark. */
  function bertSplit(s) {
    const out = [];
    let cur = [];
    const flush = () => { if (cur.length) out.push(fromCodePoints(cur)); cur = []; };
    for (const c of codePoints(s)) {
      if (rust.whitespace(c)) flush();
      else if (isAsciiPunct(c) || rust.punctuation(c)) { flush(); out.push(String.fromCodePoint(c)); }
      else cur.push(c);
    }
    flush();
    return out;
  }

  function isAsciiPunct(c) {
    return (c >= 0x21 && c <= 0x2f) || (c >= 0x3a && c <= 0x40) || (c >= 0x5b && c <= 0x60) ||
      (c >= 0x7b && c <= 0x7e);
  }

  function wordPiece(json, options) {
    const model = json.model;
    const n = json.normalizer || {};
    if (n.type !== "BertNormalizer") {
      fail("normalizer", "BertNormalizer for a WordPiece tokenizer", json.normalizer);
    }
    if ((json.pre_tokenizer || {}).type !== "BertPreTokenizer") {
      fail("pre_tokenizer", "BertPreTokenizer for a WordPiece tokenizer", json.pre_tokenizer);
    }
    const dec = json.decoder || {};
    if (dec.type !== "WordPiece") {
      fail("decoder", "WordPiece for a WordPiece tokenizer", json.decoder);
    }
    const opt = {
      clean: n.clean_text !== false,
      chinese: n.handle_chinese_chars !== false,
      lowercase: n.lowercase !== false,
    };
    // strip_accents: null follows lowercase (BertNormalizer's rule)
    opt.stripAccents = n.strip_accents == null ? opt.lowercase : !!n.strip_accents;
    const added = addedTokens(json);
    const { toId, toToken } = vocabMaps(model.vocab, added);
    const prefix = model.continuing_subword_prefix == null ? "##" : model.continuing_subword_prefix;
    const maxChars = model.max_input_chars_per_word == null ? 100 : model.max_input_chars_per_word;
    const unk = model.unk_token;
    if (!toId.has(unk)) fail("model.unk_token", "a token of the vocabulary", unk);
    const [cls, sep] = templateSpecials(json, toId);
    const specialIds = new Set(added.filter((t) => t.special).map((t) => t.id));
    const maxLength = lengthOption(options.maxLength, "options.maxLength");
    const cache = boundedCache(20000);

    /** WordPiece: greedy longest match from the left; a word with no split is [UNK]. */
    function pieces(word) {
      let hit = cache.get(word);
      if (hit !== undefined) return hit;
      const cps = codePoints(word);
      hit = [];
      if (cps.length > maxChars) {
        hit = [unk];
      } else {
        let start = 0;
        while (start < cps.length) {
          let end = cps.length, found = null;
          while (start < end) {
            const sub = (start > 0 ? prefix : "") + fromCodePoints(cps, start, end);
            if (toId.has(sub)) { found = sub; break; }
            end -= 1;
          }
          if (found === null) { hit = [unk]; break; }
          hit.push(found);
          start = end;
        }
      }
      cache.set(word, hit);
      return hit;
    }

    function cleanup(s) {
      return s.replaceAll(" .", ".").replaceAll(" ?", "?").replaceAll(" !", "!")
        .replaceAll(" ,", ",").replaceAll(" ' ", "'").replaceAll(" n't", "n't")
        .replaceAll(" 'm", "'m").replaceAll(" do not", " don't").replaceAll(" 's", "'s")
        .replaceAll(" 've", "'ve").replaceAll(" 're", "'re");
    }

    return {
      kind: "wordpiece",
      vocabSize: toId.size,
      clsId: toId.get(cls), sepId: toId.get(sep), unkId: toId.get(unk),

      /** transformers' tokenizer(text, truncation=True, max_length=maxLength):
       * [CLS] pieces [SEP], the pieces cut so that the whole fits maxLength. */
      encode(text, callOptions) {
        checkText(text, "text");
        const limit = callOptions && "maxLength" in callOptions
          ? lengthOption(callOptions.maxLength, "maxLength") : maxLength;
        let tokens = [];
        for (const [piece, tok] of splitAdded(text, added)) {
          if (tok) { tokens.push(tok.content); continue; }
          for (const word of bertSplit(bertNormalize(piece, opt))) tokens.push(...pieces(word));
        }
        if (limit !== null) tokens = tokens.slice(0, Math.max(0, limit - 2));
        tokens = [cls, ...tokens, sep];
        return { ids: tokens.map((t) => toId.get(t)), tokens };
      },

      /** transformers' decode(ids): the WordPiece decoder, specials kept (as Python's
       * default), `skipSpecialTokens` to drop them. */
      decode(ids, decodeOptions) {
        checkIds(ids);
        const skip = !!(decodeOptions && decodeOptions.skipSpecialTokens);
        const toks = ids.filter((i) => toToken.has(i) && !(skip && specialIds.has(i)))
          .map((i) => toToken.get(i));
        return toks.map((t, i) => {
          if (i > 0) t = t.startsWith(prefix) ? t.slice(prefix.length) : " " + t;
          return dec.cleanup === false ? t : cleanup(t);
        }).join("");
      },

      /** The API's token labels for MiniLM: the WordPiece tokens themselves. */
      labels(ids) {
        return ids.map((i) => (toToken.has(i) ? toToken.get(i) : null));
      },

      idToToken: (id) => (toToken.has(id) ? toToken.get(id) : null),
      tokenToId: (tok) => (toId.has(tok) ? toId.get(tok) : null),
    };
  }

  function lengthOption(v, what) {
    if (v === undefined || v === null) return null;
    if (!Number.isInteger(v) || v < 2) {
      throw new TypeError(`${what} must be an integer >= 2 or null, got ${show(v)}`);
    }
    return v;
  }

  /** [CLS] and [SEP] from a TemplateProcessing post-processor `[CLS] $A [SEP]`. */
  function templateSpecials(json, toId) {
    const pp = json.post_processor || {};
    const single = pp.single || [];
    const ok = pp.type === "TemplateProcessing" && single.length === 3 && single[0].SpecialToken &&
      single[1].Sequence && single[1].Sequence.id === "A" && single[2].SpecialToken;
    if (!ok) {
      fail("post_processor", 'TemplateProcessing "[CLS] $A [SEP]"', json.post_processor);
    }
    const names = [single[0].SpecialToken.id, single[2].SpecialToken.id];
    for (const t of names) {
      if (!toId.has(t)) fail("post_processor's special token", "a token of the vocabulary", t);
    }
    return names;
  }

  // ---- The tiny random model (qkv.inspect.tiny) -----------------------------------------

  const CRC_TABLE = (function () {
    const t = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      t[n] = c >>> 0;
    }
    return t;
  })();

  function crc32(bytes) { // zlib.crc32
    let c = 0xffffffff;
    for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  }

  const TINY_SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "<s>", "</s>"];

  /** simple_tokenize: Python's re.findall(r"\w+|[^\w\s]", text). */
  function simpleTokenize(text) {
    const out = [];
    const cps = codePoints(text);
    let i = 0;
    while (i < cps.length) {
      const c = cps[i];
      if (py.word(c)) {
        let j = i + 1;
        while (j < cps.length && py.word(cps[j])) j++;
        out.push(fromCodePoints(cps, i, j));
        i = j;
      } else {
        if (!py.space(c)) out.push(String.fromCodePoint(c)); // re's \s is str.isspace()
        i += 1;
      }
    }
    return out;
  }

  /** Python's str.lower(): JavaScript's, but for characters Python's Unicode 14 has no case
   * for (each is a token of its own: they are not \w there). */
  function pyLower(s) {
    const cps = codePoints(s), map = CLASSES["py.lower"];
    if (!cps.some((c) => map.fixed(c) !== map.base(c))) return s.toLowerCase();
    return cps.map(map.fixed).join("");
  }

  function hashed(options) {
    const vocabSize = (options || {}).vocabSize === undefined ? 1000 : options.vocabSize;
    if (!Number.isInteger(vocabSize) || vocabSize <= TINY_SPECIALS.length) {
      const least = TINY_SPECIALS.length;
      throw new TypeError(`vocabSize must be an integer > ${least}, got ${show(vocabSize)}`);
    }
    const tokenToId = (tok) => {
      const s = TINY_SPECIALS.indexOf(tok);
      if (s >= 0) return s;
      const n = TINY_SPECIALS.length;
      return n + (crc32(UTF8.encode(pyLower(tok))) % (vocabSize - n));
    };
    const label = (id) => (id === 4 ? "</s>" : `#${id}`); // random ids: no vocabulary
    return {
      kind: "hashed",
      vocabSize,
      /** The words and punctuation marks (no [CLS]/<s>: the caller adds them) and their ids. */
      encode(text) {
        checkText(text, "text");
        const tokens = simpleTokenize(text);
        return { ids: tokens.map(tokenToId), tokens };
      },
      /** What the server shows for the random translator's output ids (after <s>). */
      labels: (ids) => ids.map(label),
      decode: (ids) => ids.map(label).filter((t) => t !== "</s>").join(" "),
      tokenToId,
      idToToken: (id) => (id >= 0 && id < TINY_SPECIALS.length ? TINY_SPECIALS[id] : null),
    };
  }

  // ---- Entry points ---------------------------------------------------------------------

  /** The tokenizer of a parsed tokenizer.json: byte-level BPE (qkv's translators) or BERT
   * WordPiece (MiniLM). options.maxLength: WordPiece's truncation (qkv: the model's max_len,
   * 512 for MiniLM); none by default. */
  function fromJson(json, options) {
    if (typeof json !== "object" || json === null || Array.isArray(json)) {
      const what = Array.isArray(json) ? "an array" : json === null ? "null" : typeof json;
      throw new TypeError(`json must be a parsed tokenizer.json object, got ${what}`);
    }
    const type = (json.model || {}).type;
    if (type === "BPE") return byteLevelBpe(json);
    if (type === "WordPiece") return wordPiece(json, options || {});
    throw new TypeError(`json.model.type must be "BPE" (byte-level) or "WordPiece" (BERT), ` +
      `got ${show(type)}`);
  }

  const api = {
    fromJson,
    hashed,
    // the pieces below exist for the tests, which compare them with the references
    _internal: { CLASSES, bertNormalize, bertSplit, byteLevelSplit, simpleTokenize, crc32 },
  };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  root.qkvTokenize = api;

  // ---- Unicode corrections --------------------------------------------------------------

  /** Where each reference's Unicode class or map differs from the JS engine's: "+" ranges
   * the reference counts in and the engine may not, "-" ranges the engine counts in and the
   * reference does not (hex, "a-b" or "a"), "=" images of single code points. */
  function unicodeFixes() {
    // BEGIN UNICODE_FIXES (written by tests/apps/web/unicode_ref.py)
    return {
      "rust.other": {
        "-": "890-891,8e2,110cd,13430-1343f",
      },
      "rust.punctuation": {
        "+": "166d,111c9",
        "-": "61d,9fd,a76,c77,c84,1b4e-1b4f,1b7d-1b7f,2e43-2e4f,2e52-2e5d,10d6e,10ead,10ed0," +
          "10f55-10f59,10f86-10f89,113d4-113d5,113d7-113d8,1144b-1144f,1145a-1145b,1145d," +
          "11660-1166c,116b9,1183b,11944-11946,119e2,11a3f-11a46,11a9a-11a9c,11a9e-11aa2," +
          "11b00-11b09,11be1,11c41-11c45,11c70-11c71,11ef7-11ef8,11f43-11f4f,11fff,12ff1-12ff2," +
          "16d6d-16d6f,16e97-16e9a,16fe2,1e5ff,1e95e-1e95f",
      },
      "rust.nonspacing": {
        "+": "1734,1171e",
        "-": "7fd,897-89f,8ca-8e1,9fe,afa-aff,b55,c04,c3c,d00,d3b-d3c,d81,eba,ece,180f,1885-1886," +
          "1abf-1add,1ae0-1aeb,1df6-1dfb,a82c,a8c5,a8ff,a9bd,10d24-10d27,10d69-10d6d,10eab-10eac," +
          "10efa-10eff,10f46-10f50,10f82-10f85,11070,11073-11074,110c2,111c9,111cf,1123e,11241," +
          "1133b,113bb-113c0,113ce,113d0,113d2,113e1-113e2,11438-1143f,11442-11444,11446,1145e," +
          "1182f-11837,11839-1183a,1193b-1193c,1193e,11943,119d4-119d7,119da-119db,119e0," +
          "11a01-11a0a,11a33-11a38,11a3b-11a3e,11a47,11a51-11a56,11a59-11a5b,11a8a-11a96," +
          "11a98-11a99,11b60,11b62-11b64,11b66,11c30-11c36,11c38-11c3d,11c3f,11c92-11ca7," +
          "11caa-11cb0,11cb2-11cb3,11cb5-11cb6,11d31-11d36,11d3a,11d3c-11d3d,11d3f-11d45,11d47," +
          "11d90-11d91,11d95,11d97,11ef3-11ef4,11f00-11f01,11f36-11f3a,11f40,11f42,11f5a,13440," +
          "13447-13455,1611e-16129,1612d-1612f,16f4f,16fe4,1cf00-1cf2d,1cf30-1cf46,1e000-1e006," +
          "1e008-1e018,1e01b-1e021,1e023-1e024,1e026-1e02a,1e08f,1e130-1e136,1e2ae,1e2ec-1e2ef," +
          "1e4ec-1e4ef,1e5ee-1e5ef,1e6e3,1e6e6,1e6ee-1e6ef,1e6f5,1e944-1e94a",
      },
      "onig.letter": {
        "+": "1c89-1c8a,a7cb-a7cd,a7da-a7dc,105c0-105f3,10d4a-10d65,10d6f-10d85,10ec2-10ec4," +
          "1123f-11240,11380-11389,1138b,1138e,11390-113b5,113b7,113d1,113d3,11bc0-11be0,11f02," +
          "11f04-11f10,11f12-11f33,1342f,13441-13446,13460-143fa,16100-1611d,16d40-16d6c,18cff," +
          "1b132,1b155,1df25-1df2a,1e030-1e06d,1e4d0-1e4eb,1e5d0-1e5ed,1e5f0,2b739,2ebf0-2ee5d," +
          "31350-323af",
        "-": "88f,c5c,cdc,a7ce-a7cf,a7d2,a7d4,a7f1,10940-10959,10ec5-10ec7,11db0-11ddb,16ea0-16eb8," +
          "16ebb-16ed3,16ff2-16ff3,187f8-187ff,18d09-18d1e,18d80-18df2,1e6c0-1e6de,1e6e0-1e6e2," +
          "1e6e4-1e6e5,1e6e7-1e6ed,1e6f0-1e6f4,1e6fe-1e6ff,2b73a-2b73f,2cea2-2cead,323b0-33479",
      },
      "onig.number": {
        "+": "10d40-10d49,116d0-116e3,11bf0-11bf9,11f50-11f59,16130-16139,16d70-16d79,1ccf0-1ccf9," +
          "1d2c0-1d2d3,1e4f0-1e4f9,1e5f1-1e5fa",
        "-": "11de0-11de9,16ff4-16ff6",
      },
      "py.word": {
        "-": "88f,c5c,cdc,1c89-1c8a,a7cb-a7cf,a7d2,a7d4,a7da-a7dc,a7f1,105c0-105f3,10940-10959," +
          "10d40-10d65,10d6f-10d85,10ec2-10ec7,1123f-11240,11380-11389,1138b,1138e,11390-113b5," +
          "113b7,113d1,113d3,116d0-116e3,11bc0-11be0,11bf0-11bf9,11db0-11ddb,11de0-11de9,11f02," +
          "11f04-11f10,11f12-11f33,11f50-11f59,1342f,13441-13446,13460-143fa,16100-1611d," +
          "16130-16139,16d40-16d6c,16d70-16d79,16ea0-16eb8,16ebb-16ed3,16ff2-16ff6,187f8-187ff," +
          "18cff,18d09-18d1e,18d80-18df2,1b132,1b155,1ccf0-1ccf9,1d2c0-1d2d3,1df25-1df2a," +
          "1e030-1e06d,1e4d0-1e4eb,1e4f0-1e4f9,1e5d0-1e5ed,1e5f0-1e5fa,1e6c0-1e6de,1e6e0-1e6e2," +
          "1e6e4-1e6e5,1e6e7-1e6ed,1e6f0-1e6f4,1e6fe-1e6ff,2b739-2b73f,2cea2-2cead,2ebf0-2ee5d," +
          "31350-33479",
      },
      "py.punctOrSymbol": {
        "-": "1b4e-1b4f,1b7f,20c1,2427-2429,2b96,2ffc-2fff,31e4-31e5,31ef,fbc3-fbd2,fd90-fd91," +
          "fdc8-fdce,10d6e,10d8e-10d8f,10ed0-10ed8,113d4-113d5,113d7-113d8,11b00-11b09,11be1," +
          "11f43-11f4f,16d6d-16d6f,1cc00-1ccef,1ccfa-1ccfc,1cd00-1ceb3,1ceba-1ced0,1cee0-1cef0," +
          "1e5ff,1f6d8,1f6dc,1f774-1f77f,1f7d9,1f8b2-1f8bb,1f8c0-1f8c1,1f8d0-1f8d8,1fa54-1fa57," +
          "1fa75-1fa77,1fa87-1fa8a,1fa8e-1fa8f,1faad-1faaf,1fabb-1fabf,1fac6,1fac8,1facd-1facf," +
          "1fada-1fadc,1fadf,1fae8-1faea,1faef,1faf7-1faf8,1fbcb-1fbef,1fbfa",
      },
      "rust.lower": {
        "=": {
          "1c89": "\u1c8a", "a7cb": "\u0264", "a7cc": "\ua7cd", "a7ce": "\ua7cf",
          "a7d2": "\ua7d3", "a7d4": "\ua7d5", "a7da": "\ua7db", "a7dc": "\u019b",
          "10d50": "\ud803\udd70", "10d51": "\ud803\udd71", "10d52": "\ud803\udd72",
          "10d53": "\ud803\udd73", "10d54": "\ud803\udd74", "10d55": "\ud803\udd75",
          "10d56": "\ud803\udd76", "10d57": "\ud803\udd77", "10d58": "\ud803\udd78",
          "10d59": "\ud803\udd79", "10d5a": "\ud803\udd7a", "10d5b": "\ud803\udd7b",
          "10d5c": "\ud803\udd7c", "10d5d": "\ud803\udd7d", "10d5e": "\ud803\udd7e",
          "10d5f": "\ud803\udd7f", "10d60": "\ud803\udd80", "10d61": "\ud803\udd81",
          "10d62": "\ud803\udd82", "10d63": "\ud803\udd83", "10d64": "\ud803\udd84",
          "10d65": "\ud803\udd85", "16ea0": "\ud81b\udebb", "16ea1": "\ud81b\udebc",
          "16ea2": "\ud81b\udebd", "16ea3": "\ud81b\udebe", "16ea4": "\ud81b\udebf",
          "16ea5": "\ud81b\udec0", "16ea6": "\ud81b\udec1", "16ea7": "\ud81b\udec2",
          "16ea8": "\ud81b\udec3", "16ea9": "\ud81b\udec4", "16eaa": "\ud81b\udec5",
          "16eab": "\ud81b\udec6", "16eac": "\ud81b\udec7", "16ead": "\ud81b\udec8",
          "16eae": "\ud81b\udec9", "16eaf": "\ud81b\udeca", "16eb0": "\ud81b\udecb",
          "16eb1": "\ud81b\udecc", "16eb2": "\ud81b\udecd", "16eb3": "\ud81b\udece",
          "16eb4": "\ud81b\udecf", "16eb5": "\ud81b\uded0", "16eb6": "\ud81b\uded1",
          "16eb7": "\ud81b\uded2", "16eb8": "\ud81b\uded3",
        },
      },
      "rust.nfd": {
        "=": {
          "105c9": "\ud801\uddc9", "105e4": "\ud801\udde4", "11383": "\ud804\udf83",
          "11385": "\ud804\udf85", "1138e": "\ud804\udf8e", "11391": "\ud804\udf91",
          "113c5": "\ud804\udfc5", "113c7": "\ud804\udfc7", "113c8": "\ud804\udfc8",
          "11938": "\ud806\udd38", "16121": "\ud818\udd21", "16122": "\ud818\udd22",
          "16123": "\ud818\udd23", "16124": "\ud818\udd24", "16125": "\ud818\udd25",
          "16126": "\ud818\udd26", "16127": "\ud818\udd27", "16128": "\ud818\udd28",
          "16d68": "\ud81b\udd68", "16d69": "\ud81b\udd69", "16d6a": "\ud81b\udd6a",
        },
      },
      "py.lower": {
        "=": {
          "1c89": "\u1c89", "a7cb": "\ua7cb", "a7cc": "\ua7cc", "a7ce": "\ua7ce",
          "a7d2": "\ua7d2", "a7d4": "\ua7d4", "a7da": "\ua7da", "a7dc": "\ua7dc",
          "10d50": "\ud803\udd50", "10d51": "\ud803\udd51", "10d52": "\ud803\udd52",
          "10d53": "\ud803\udd53", "10d54": "\ud803\udd54", "10d55": "\ud803\udd55",
          "10d56": "\ud803\udd56", "10d57": "\ud803\udd57", "10d58": "\ud803\udd58",
          "10d59": "\ud803\udd59", "10d5a": "\ud803\udd5a", "10d5b": "\ud803\udd5b",
          "10d5c": "\ud803\udd5c", "10d5d": "\ud803\udd5d", "10d5e": "\ud803\udd5e",
          "10d5f": "\ud803\udd5f", "10d60": "\ud803\udd60", "10d61": "\ud803\udd61",
          "10d62": "\ud803\udd62", "10d63": "\ud803\udd63", "10d64": "\ud803\udd64",
          "10d65": "\ud803\udd65", "16ea0": "\ud81b\udea0", "16ea1": "\ud81b\udea1",
          "16ea2": "\ud81b\udea2", "16ea3": "\ud81b\udea3", "16ea4": "\ud81b\udea4",
          "16ea5": "\ud81b\udea5", "16ea6": "\ud81b\udea6", "16ea7": "\ud81b\udea7",
          "16ea8": "\ud81b\udea8", "16ea9": "\ud81b\udea9", "16eaa": "\ud81b\udeaa",
          "16eab": "\ud81b\udeab", "16eac": "\ud81b\udeac", "16ead": "\ud81b\udead",
          "16eae": "\ud81b\udeae", "16eaf": "\ud81b\udeaf", "16eb0": "\ud81b\udeb0",
          "16eb1": "\ud81b\udeb1", "16eb2": "\ud81b\udeb2", "16eb3": "\ud81b\udeb3",
          "16eb4": "\ud81b\udeb4", "16eb5": "\ud81b\udeb5", "16eb6": "\ud81b\udeb6",
          "16eb7": "\ud81b\udeb7", "16eb8": "\ud81b\udeb8",
        },
      },
    };
    // END UNICODE_FIXES
  }
})(typeof window !== "undefined" ? window : globalThis);
