// qkv in-page engine: decoding, as qkv.generate decodes for the explorer
// (qkv.inspect.translation.record_translation): greedy_search and beam_search of one
// sentence with the no_repeat_ngram guard, over a qkvRuntime Model's decoder steps.
//
//   qkvDecode.greedy(model, enc, opts)  {hyp, steps}: ids up to </s>, each step's weights
//   qkvDecode.beam(model, enc, opts)    {hyp, beams: [[ids, score]]}: n_best = beam size
//   qkvDecode.replay(model, enc, hyp, headMask)  the decoder fed <s>, hyp[:-1] at once
//
// enc: the encoder's outputs (memory_k, memory_v); opts: maxNew (qkv.apps.serve.limits.
// target_limit), ngram (0: off), headMask (the decoder's, (2·L, h)), beam, lengthPenalty.
"use strict";
(() => {
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

  // greedy_search (batch of one): the most likely token at every step, n-grams banned
  async function greedy(model, enc, opts) {
    const cfg = model.cfg, memory = memoryOf(enc, 1);
    let past = model.emptyPast(1), tok = cfg.bos_id;
    const out = [], steps = [];
    for (let t = 0; t < opts.maxNew; t++) {
      const r = await model.step([[tok]], past, memory, opts.headMask, STEP_OUT);
      const logits = r.logits.data.slice(); // (V,)
      if (opts.ngram && t >= opts.ngram) for (const b of banned(out, opts.ngram)) logits[b] = -Infinity;
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

  window.qkvDecode = { greedy, beam, replay, banned, trim };
})();
