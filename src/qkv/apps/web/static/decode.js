// qkv in-page engine: decoding, as qkv.generate decodes for the explorer
// (qkv.inspect.translation.record_translation): greedy_search and beam_search of one
// sentence with the no_repeat_ngram guard and the RepeatGuard of qkv translate, over a
// qkvRuntime Model's decoder steps.
//
//   qkvDecode.greedy(model, enc, opts)  {hyp, steps}: ids up to </s>, each step's weights
//   qkvDecode.beam(model, enc, opts)    {hyp, beams: [[ids, score]]}: n_best = beam size
//   qkvDecode.replay(model, enc, hyp, headMask)  the decoder fed <s>, hyp[:-1] at once
//   qkvDecode.RepeatGuard.forTokenizer(tok)      qkv.generate.RepeatGuard of a byte-level BPE
//
// enc: the encoder's outputs (memory_k, memory_v); opts: maxNew (qkv.apps.serve.limits.
// target_limit), ngram (0: off), guard (a RepeatGuard, or null: off), headMask (the
// decoder's, (2·L, h)), beam, lengthPenalty.
"use strict";
(() => {
  // ---------- qkv.generate._repeat.RepeatGuard, line for line ----------
  // No pattern written three times in a row: a unit of 1-4 tokens ("est est est"), or inside
  // a word (from its token with a leading space on) a unit of 1-8 bytes of letters ("gigigi").
  // A token's bytes are held as a string of char codes 0-255 (one char per byte).
  const TIMES = 3, MAX_UNIT_TOKENS = 4, MAX_UNIT_BYTES = 8, WINDOW = 16, SPECIALS = 4;

  // the byte-level BPE alphabet (GPT-2's bytes_to_unicode) back to bytes
  function byteDecoder() {
    const keep = [];
    for (let b = 33; b <= 126; b++) keep.push(b);
    for (let b = 161; b <= 172; b++) keep.push(b);
    for (let b = 174; b <= 255; b++) keep.push(b);
    const chars = keep.slice();
    let n = 0;
    for (let b = 0; b < 256; b++) if (!keep.includes(b)) { keep.push(b); chars.push(256 + n); n++; }
    return new Map(chars.map((c, i) => [String.fromCharCode(c), keep[i]]));
  }

  // an ASCII letter or any byte of a non-ASCII character; never a digit, space or punctuation
  const letter = (b) => (b >= 65 && b <= 90) || (b >= 97 && b <= 122) || b >= 128;
  const allLetters = (s) => { for (let i = 0; i < s.length; i++) if (!letter(s.charCodeAt(i))) return false; return true; };
  const isDigits = (s) => s.length > 0 && /^[0-9]+$/.test(s);

  // whether `word` ends with a unit of letters written TIMES times in a row
  function endsInLoop(word) {
    const n = word.length;
    for (let p = 1; p <= MAX_UNIT_BYTES; p++) {
      if (n >= TIMES * p && allLetters(word.slice(n - p)) && word.slice(n - TIMES * p) === word.slice(n - p).repeat(TIMES)) return true;
    }
    return false;
  }

  // whether some prefix of `body` ends in a stutter (the token alone holds one)
  function hasLoop(body) {
    for (let k = TIMES; k <= body.length; k++) if (endsInLoop(body.slice(0, k))) return true;
    return false;
  }

  class RepeatGuard {
    // vocab: each token's byte-level string (Ġ for a leading space), by id
    constructor(vocab) {
      const dec = byteDecoder();
      this.startsWord = []; this.body = []; this.innerDigits = new Set();
      this.byPrefix = new Map(); this.cache = new Map();
      vocab.forEach((s, i) => {
        const chars = [...s];
        const raw = i >= SPECIALS && chars.every((c) => dec.has(c)) ? chars.map((c) => String.fromCharCode(dec.get(c))).join("") : "";
        const start = raw.startsWith(" ") || i < SPECIALS, body = raw.startsWith(" ") ? raw.slice(1) : raw;
        this.startsWord.push(start);
        this.body.push(body);
        if (isDigits(body) && !start) this.innerDigits.add(i);
        if (!start && body) {
          for (let k = 1; k <= body.length; k++) {
            const key = body.slice(0, k);
            if (!this.byPrefix.has(key)) this.byPrefix.set(key, []);
            this.byPrefix.get(key).push(i);
          }
        }
      });
      this.stutters = [];
      this.body.forEach((b, i) => { if (hasLoop(b)) this.stutters.push(i); });
    }

    // the guard of a byte-level BPE tokenizer (qkvTokenize), built once per tokenizer
    static forTokenizer(tok) {
      let guard = GUARDS.get(tok);
      if (!guard) {
        const vocab = [];
        for (let i = 0; i < tok.vocabSize; i++) vocab.push(tok.idToToken(i) ?? "");
        guard = new RepeatGuard(vocab);
        GUARDS.set(tok, guard);
      }
      return guard;
    }

    // the tokens a hypothesis that wrote `hist` (ids after <s>) may not write next
    banned(hist) {
      if (!hist.length) return [];
      const row = hist.slice(-WINDOW);
      return [...this.tokenLoops(row), ...this.wordLoops(row)];
    }

    // tokens that would end a unit of 1-4 tokens written 3 times: the last 3k - 1 tokens have
    // period k, so token row[L - k] would complete it
    tokenLoops(row) {
      const out = [], L = row.length;
      for (let k = 1; k <= MAX_UNIT_TOKENS; k++) {
        if (L < TIMES * k - 1) break;
        const tail = row.slice(L - TIMES * k + 1);
        let periodic = true;
        for (let i = k; i < tail.length && periodic; i++) periodic = tail[i] === tail[i - k];
        if (!periodic) continue;
        const unit = row.slice(L - k);
        if (Math.min(...unit) < SPECIALS || unit.every((u) => this.innerDigits.has(u))) continue;
        out.push(row[L - k]);
      }
      return out;
    }

    // word-inner tokens that would make the current word end in a stutter
    wordLoops(row) {
      let start = row.length - 1;
      while (start > 0 && !this.starts(row[start])) start--;
      const key = row.slice(start), id = key.join(",");
      let bad = this.cache.get(id);
      if (bad === undefined) {
        if (this.cache.size > 200000) this.cache.clear();
        bad = this.continuations(key.map((i) => this.body[i] ?? "").join(""));
        this.cache.set(id, bad);
      }
      return bad;
    }

    starts(token) { return token >= this.startsWord.length || this.startsWord[token]; }

    // for each unit length p: if `word` ends with a unit of letters, the 3p - run bytes that
    // continue its run to 3 units; every token starting with them
    continuations(word) {
      const out = new Set(this.stutters), n = word.length;
      for (let p = 1; p <= Math.min(MAX_UNIT_BYTES, n); p++) {
        const unit = word.slice(n - p);
        if (!allLetters(unit)) continue;
        let run = p; // the longest end of the word with period p
        while (run < n && word[n - 1 - run] === word[n - 1 - run + p]) run++;
        const need = Math.max(1, TIMES * p - run);
        const cont = unit.repeat(Math.floor(need / p) + 1).slice(0, need);
        for (const i of this.byPrefix.get(cont) || []) out.add(i);
      }
      return [...out].sort((a, b) => a - b);
    }
  }
  const GUARDS = new WeakMap();

  // The tokens that would write an n-gram twice (qkv.generate._ngram._repeats for one
  // hypothesis): a token is banned if it followed an earlier occurrence of the last n-1.
  function banned(hist, n) {
    const L = hist.length, out = [];
    if (n < 2 || L < n) return out;
    for (let s = 0; s + n - 1 <= L - 1; s++) {
      let same = true;
      for (let i = 0; i < n - 1 && same; i++) same = hist[s + i] === hist[L - n + 1 + i];
      if (same) out.push(hist[s + n - 1]);
    }
    return out;
  }

  // the first index of the largest value (torch.argmax)
  function argmax(row) {
    let best = 0;
    for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
    return best;
  }

  const memoryOf = (enc, N) => ({
    k: N === 1 ? enc.memory_k : enc.memory_k.gather(1, new Array(N).fill(0)),
    v: N === 1 ? enc.memory_v : enc.memory_v.gather(1, new Array(N).fill(0)),
  });

  // the ids up to and including </s> (qkv.inspect.translation._trim)
  function trim(ids, cfg) {
    const end = ids.indexOf(cfg.eos_id);
    return (end >= 0 ? ids.slice(0, end + 1) : ids).filter((t) => t !== cfg.pad_id);
  }

  const STEP_OUT = ["logits", "next_k", "next_v", "self.weights", "cross.weights"];

  // greedy_search (batch of one): the most likely token at every step, n-grams and
  // stutters banned
  async function greedy(model, enc, opts) {
    const cfg = model.cfg, memory = memoryOf(enc, 1);
    let past = model.emptyPast(1), tok = cfg.bos_id;
    const out = [], steps = [];
    for (let t = 0; t < opts.maxNew; t++) {
      const r = await model.step([[tok]], past, memory, opts.headMask, STEP_OUT);
      const logits = r.logits.data.slice(); // (V,)
      if (opts.ngram && t >= opts.ngram) for (const b of banned(out, opts.ngram)) logits[b] = -Infinity;
      if (opts.guard) for (const b of opts.guard.banned(out)) logits[b] = -Infinity;
      tok = argmax(logits);
      out.push(tok);
      steps.push({ self: r["self.weights"], cross: r["cross.weights"] }); // (L, 1, h, 1, ·)
      past = { k: r.next_k, v: r.next_v };
      if (tok === cfg.eos_id) break;
    }
    return { hyp: trim(out, cfg), steps };
  }

  function logSoftmax(row) {
    let max = -Infinity;
    for (const v of row) if (v > max) max = v;
    let sum = 0;
    for (const v of row) sum += Math.exp(v - max);
    const lse = max + Math.log(sum), out = new Float64Array(row.length);
    for (let i = 0; i < row.length; i++) out[i] = row[i] - lse;
    return out;
  }

  // the k largest of values (best first; ties: the lower index first) as [value, index]
  function topk(values, k) {
    const best = []; // ascending by value: best[0] is the worst kept
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (best.length === k && !(v > best[0][0])) continue;
      let j = 0;
      while (j < best.length && (best[j][0] < v || (best[j][0] === v && best[j][1] > i))) j++;
      best.splice(j, 0, [v, i]);
      if (best.length > k) best.shift();
    }
    return best.reverse();
  }

  // beam_search (batch of one, n_best = beam size) as qkv.generate.beam_search: a
  // hypothesis that ends scores log p / len ** lengthPenalty
  async function beam(model, enc, opts) {
    const cfg = model.cfg, K = opts.beam, lp = opts.lengthPenalty ?? 1.0, eos = cfg.eos_id;
    const memory = memoryOf(enc, K);
    let past = model.emptyPast(K);
    let ys = Array.from({ length: K }, () => []); // what each row wrote after <s>
    let scores = Array.from({ length: K }, (_, i) => (i === 0 ? 0 : -Infinity));
    let best = -Infinity, bestTokens = null, nFinal = 0;
    const ended = [];
    let last = Array(K).fill(cfg.bos_id), n = 0;
    for (let t = 0; t < opts.maxNew; t++) {
      const r = await model.step(last.map((x) => [x]), past, memory, opts.headMask, ["logits", "next_k", "next_v"]);
      const V = r.logits.dims[1];
      const cand = new Float64Array(K * V);
      for (let b = 0; b < K; b++) {
        const lp_ = logSoftmax(r.logits.data.subarray(b * V, (b + 1) * V));
        for (let v = 0; v < V; v++) cand[b * V + v] = lp_[v] + scores[b];
        if (opts.ngram) for (const x of banned(ys[b], opts.ngram)) cand[b * V + x] = -Infinity;
        if (opts.guard) for (const x of opts.guard.banned(ys[b])) cand[b * V + x] = -Infinity;
      }
      let top = topk(cand, 2 * K).map(([val, idx]) => ({ val, beam: Math.floor(idx / V), tok: idx % V }));
      const eosSeen = top.some((c) => c.tok === eos);
      let endedNow = eosSeen;
      if (eosSeen) {
        top.forEach((c, j) => {
          if (c.tok !== eos || j >= K || !(c.val > -Infinity) || nFinal >= K) return;
          nFinal += 1;
          const norm = c.val / Math.pow(t + 1, lp);
          const hyp = [...ys[c.beam], c.tok];
          ended.push([norm, hyp]);
          if (norm > best) { best = norm; bestTokens = hyp; }
        });
      }
      if (t + 1 >= opts.maxNew) {
        endedNow = true;
        if (bestTokens === null) { // out of length, nothing finished: the best open beam
          let j = -1;
          top.forEach((c, i) => { if (c.tok !== eos && (j < 0 || c.val > top[j].val)) j = i; });
          bestTokens = [...ys[top[j].beam], top[j].tok];
        }
        nFinal = K;
      }
      n = t + 1;
      if (endedNow && nFinal >= K) break;
      if (eosSeen) top = top.map((c) => (c.tok === eos ? { ...c, val: -Infinity } : c));
      const keep = top.map((c, i) => [c.val, i]).sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, K).map((x) => top[x[1]]);
      const rows = keep.map((c) => c.beam);
      ys = keep.map((c) => [...ys[c.beam], c.tok]);
      scores = keep.map((c) => c.val);
      last = keep.map((c) => c.tok);
      past = { k: r.next_k.gather(1, rows), v: r.next_v.gather(1, rows) };
    }
    if (bestTokens === null) bestTokens = ys[argmax(scores)].slice(0, n);
    const ranked = ended.map((e, i) => [e, i]).sort((a, b) => b[0][0] - a[0][0] || a[1] - b[1])
      .slice(0, K).map((x) => x[0]);
    const picks = ranked.length ? ranked : [[-Infinity, bestTokens]];
    const beams = picks.filter(([sc]) => sc > -Infinity).map(([sc, ids]) => [trim(ids, cfg), sc]);
    return { hyp: trim(picks[0][1], cfg), beams };
  }

  // the decoder fed <s>, hyp[:-1] at once (a causal forward over empty caches): every
  // layer's inputs, weights and step tensors, as qkv.apps.serve.compute replays a translation
  async function replay(model, enc, hyp, headMask) {
    const tgt = [model.cfg.bos_id, ...hyp.slice(0, -1)];
    return model.step([tgt], model.emptyPast(1), memoryOf(enc, 1), headMask);
  }

  window.qkvDecode = { greedy, beam, replay, banned, trim, RepeatGuard };
})();
