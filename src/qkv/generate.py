"""Decoding: greedy and beam search for :class:`~qkv.models.Seq2SeqTransformer` (batched), and
:func:`generate` to continue prompts of a :class:`~qkv.models.CausalLM`.

Both encode the source once and decode incrementally, one token per sentence (and beam) per
step. A :class:`~qkv.models.Seq2SeqTransformer` in eval mode runs through
:class:`~qkv.models.incremental.IncrementalDecoder` (fused projections, the memory's keys and
values computed once per sentence, caches preallocated and written in place, beams
reordered by index); any other model through ``model.decode(..., cache=model.new_cache())``.
``use_cache=False`` recomputes the whole prefix every step: the slow reference that the cached
paths must equal, token for token.

``no_repeat_ngram=n`` (greedy and beam search) never writes an n-gram of tokens twice in one
hypothesis, as production decoders do (``no_repeat_ngram_size``): a small model out of its
depth otherwise loops ("ses cordes, ses cordes, ...") until the length limit. The guard works
in Python on what each step returns: greedy sets the banned logits to ``-inf`` before the
compiled pick; beam search asks the compiled top-k for a few more candidates and drops the
banned ones (the others keep the model's log-probabilities).

Shapes: ``src (B, S)`` → generated ids ``(B, T)`` (after ``<s>``; ``</s>`` then ``<pad>``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from qkv.kernels._native import decode_ops, native_module
from qkv.models.incremental import IncrementalDecoder, hypothesis_rows

__all__ = ["greedy_search", "beam_search", "translate", "generate"]


def _limits(model, src: Tensor, max_new_tokens: int | None) -> Tensor:
    """Tokens each sentence may generate ``(B,)``: ``max_new_tokens``, or by default
    ``2·len(source) + 10`` (its own length, not the padded one, so batching changes nothing)."""
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return torch.full((src.shape[0],), max_new_tokens, device=src.device)
    lengths = (src != model.cfg.pad_id).sum(1)
    return (2 * lengths + 10).clamp(max=model.cfg.max_len - 1)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the call, then the caller's modes back: generating must not
    leave a model that is being trained in eval mode. A model already in eval mode is left
    as it is (switching walks every submodule twice: ~1 ms per call for a translator)."""
    training = [m for m in model.modules() if m.training]
    if training:
        model.eval()
    try:
        yield
    finally:
        for m in training:
            m.train()


def _check_src(src: Tensor) -> None:
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype not in (torch.int64, torch.int32):
        shape = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        raise TypeError(f"src must be an integer tensor (B, S), got {shape}")


def _check_min(min_new_tokens: int) -> None:
    if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")


def _check_ngram(n: int) -> None:
    if not isinstance(n, int) or n < 0 or n == 1:
        raise ValueError(f"no_repeat_ngram must be 0 (off) or an int >= 2, got {n!r}")


def _repeats(hist: Tensor, n: int) -> tuple[Tensor, Tensor] | None:
    """The tokens that would repeat an n-gram: ``hist (N, L)`` holds what each hypothesis
    wrote so far; a token is banned for row ``r`` if it followed an earlier occurrence of the
    row's last ``n - 1`` tokens. Returns ``(rows, tokens)`` (pairs, possibly repeated), or
    ``None`` when nothing is banned (most steps). A few small tensor operations per step."""
    L = hist.shape[1]
    if n < 2 or L < n:
        return None
    suffix = hist[:, L - n + 1 :]  # (N, n-1): the n-gram's start if the next token completes it
    windows = hist[:, : L - 1].unfold(1, n - 1, 1)  # (N, L-n+1, n-1), started at 0..L-n
    rows, starts = (windows == suffix[:, None, :]).all(-1).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return None
    return rows, hist[rows, starts + n - 1]


def _drop_banned(top: Tensor, idx: Tensor, banned: tuple[Tensor, Tensor], offsets: Tensor,
                 V: int, k: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ``k`` best of beam search's candidates ``top, idx (B, k + extra)`` that are not
    banned: ``banned`` pairs (row, token), rows ``offsets (B, 1) + beam``. Best first, ties
    in the kernel's order."""
    keys = banned[0] * V + banned[1]  # row·V + token
    top = top.masked_fill(torch.isin(offsets * V + idx, keys), float("-inf"))
    top, order = top.sort(dim=1, descending=True, stable=True)
    return top[:, :k], idx.gather(1, order[:, :k])


class _Steps:
    """Next-token logits ``(N, V)`` step by step, for ``N = B·beams`` hypotheses: the
    incremental decoder where it runs the model, else ``model.decode`` with its cache."""

    def __init__(self, model, src: Tensor, beams: int, max_steps: int, cache_dtype=None):
        self.model, self.beams = model, beams
        mask = model.src_mask(src)  # (B, 1, 1, S), True = may attend
        self.fast = IncrementalDecoder.for_model(model)
        if self.fast is not None:
            memory = self.fast.encode(src, mask)  # (B, S, d_model)
            # every beam starts from the same <s>: the first step runs one row per sentence
            self.state = self.fast.start(memory, mask, beams=1, max_steps=max_steps,
                                         cache_dtype=cache_dtype)  # fmt: skip
        else:  # the general path: one row per hypothesis
            memory = model.encode(src, mask)  # (B, S, d_model)
            self.memory = memory.repeat_interleave(beams, dim=0)  # (B·beams, S, d_model)
            self.mask = mask.repeat_interleave(beams, dim=0)
            self.cache = model.new_cache()

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens (N,)`` → logits ``(N, V)``."""
        if self.fast is not None:
            K = self.beams
            if K > 1 and self.state.t == 0:  # identical rows: decode one, then copy
                logits = self.fast.step(self.state, tokens[::K])  # (B, V)
                self.state.expand(K)
                return logits.repeat_interleave(K, dim=0)  # (B·K, V)
            return self.fast.step(self.state, tokens)
        return self.model.decode(tokens[:, None], self.memory, self.mask, cache=self.cache)[:, -1]

    def reorder(self, rows: Tensor) -> None:
        if self.fast is not None:
            self.state.reorder(rows)
        else:
            self.cache.reorder(rows)

    def close(self) -> None:
        """The search is over: the incremental decoder's caches go back to its pool."""
        if self.fast is not None:
            self.state.release()

    def keep(self, sentences: Tensor) -> None:
        """Only the sentences ``sentences (B',)`` still run, with all their beams."""
        if self.fast is not None:
            self.state.keep(sentences)
        else:
            rows = hypothesis_rows(sentences, self.beams)
            self.cache.reorder(rows)
            self.memory, self.mask = self.memory[rows], self.mask[rows]


@torch.inference_mode()
def greedy_search(
    model,
    src: Tensor,
    *,
    max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    use_cache: bool = True,
    ignore_eos: bool = False,
    cache_dtype: torch.dtype | None = None,
    no_repeat_ngram: int = 0,
) -> Tensor:
    """Most likely next token at every step. Returns ids ``(B, T)``, pad after ``</s>``.

    ``min_new_tokens``: ``</s>`` cannot be chosen before that many tokens (the next most
    likely token is). ``ignore_eos`` keeps going for exactly ``max_new_tokens``, ``</s>`` or
    not (benchmarks). ``cache_dtype``: storage dtype of the self-attention caches (e.g.
    ``torch.bfloat16`` for an fp32 model, or ``torch.int8``: rows of int8 values and a scale,
    see :mod:`qkv.cache`; the default keeps the model's dtype). ``no_repeat_ngram=n`` (>= 2):
    no n-gram of tokens is written twice (the next most likely token is); 0: off.

    >>> out = greedy_search(model, torch.tensor([[5, 6, 2]]))  # doctest: +SKIP
    """
    _check_src(src)
    _check_min(min_new_tokens)
    _check_ngram(no_repeat_ngram)
    cfg = model.cfg
    limits = _limits(model, src, max_new_tokens)  # (B,)
    T_max = int(limits.max())
    if use_cache:
        return _greedy_cached(model, src, limits, T_max, min_new_tokens, ignore_eos, cache_dtype,
                              no_repeat_ngram)  # fmt: skip
    B, dev = src.shape[0], src.device
    ys = torch.full((B, T_max + 1), cfg.pad_id, dtype=torch.long, device=dev)
    ys[:, 0] = cfg.bos_id
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    mask = model.src_mask(src)
    memory = model.encode(src, mask)  # (B, S, d_model)
    n = 0
    for t in range(T_max):
        logits = model.decode(ys[:, : t + 1], memory, mask)[:, -1]
        if no_repeat_ngram and (banned := _repeats(ys[:, 1 : t + 1], no_repeat_ngram)):
            logits[banned] = float("-inf")
        nxt = _argmax(logits, cfg.eos_id if t < min_new_tokens else -1)  # (B,)
        n = t + 1
        if ignore_eos:
            ys[:, n] = nxt
            continue
        nxt = nxt.masked_fill(done, cfg.pad_id)
        done |= (nxt == cfg.eos_id) | (n >= limits)
        ys[:, n] = nxt
        if bool(done.all()):
            break
    return ys[:, 1 : n + 1]


def _greedy_cached(model, src: Tensor, limits: Tensor, T_max: int, min_new_tokens: int,
                   ignore_eos: bool, cache_dtype, no_repeat_ngram: int = 0) -> Tensor:  # fmt: skip
    """greedy_search with the cache: a sentence that finished leaves the batch (later steps
    skip its rows). The tokens are kept step-major, so each step's are one contiguous row
    that the next step reads as it is."""
    cfg = model.cfg
    B, dev = src.shape[0], src.device
    eos = -1 if ignore_eos else cfg.eos_id
    out = torch.full((T_max + 1, B), cfg.pad_id, dtype=torch.long, device=dev)
    out[0] = cfg.bos_id
    module = native_module() if dev.type == "cpu" else None
    steps = _Steps(model, src, 1, T_max, cache_dtype)
    # the sentences still running (None: all), their limits, their next input
    alive, lim, tokens = None, limits, out[0]
    lim_min = int(lim.min())
    n = 0
    try:
        for t in range(T_max):
            logits = steps(tokens)  # (B_alive, V)
            if no_repeat_ngram and t >= no_repeat_ngram:
                written = out[1 : t + 1] if alive is None else out[1 : t + 1, alive]  # (t, B_alive)
                if banned := _repeats(written.t(), no_repeat_ngram):
                    logits[banned] = float("-inf")  # this step's output: the next rewrites it
            n = t + 1
            block = cfg.eos_id if t < min_new_tokens else -1
            if alive is None and module is not None and logits.dtype == torch.float32:
                tokens = out[n]  # written in place; ended: how many chose </s>
                ended = module.greedy_pick(logits.contiguous(), block, eos, tokens)
            else:
                tokens = _argmax(logits, block)  # (B_alive,)
                out[n, slice(None) if alive is None else alive] = tokens
                ended = int((tokens == eos).sum()) if eos >= 0 else 0
            if ignore_eos or (not ended and n < lim_min):
                continue
            fin = tokens == eos
            if n >= lim_min:
                fin |= n >= lim
            if bool(fin.all()):
                break
            if bool(fin.any()):
                keep = (~fin).nonzero().flatten()
                steps.keep(keep)
                alive = keep if alive is None else alive[keep]
                lim, tokens = lim[keep], tokens[keep]
                lim_min = int(lim.min())
    finally:
        steps.close()
    return out[1 : n + 1].t().contiguous()


def _argmax(logits: Tensor, block: int) -> Tensor:
    """The most likely token of each row of ``logits (N, V)``, token ``block`` (if >= 0) never
    chosen unless every token is ``-inf``: ``argmax`` after ``logits[:, block] = -inf``. On the
    CPU one pass of the compiled kernel (torch's argmax is ~10x slower over a vocabulary)."""
    fp32_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if fp32_cpu and (ops := decode_ops()) is not None:
        return ops.argmax_rows(logits.contiguous(), block)
    if block >= 0:
        logits = logits.clone()
        logits[:, block] = float("-inf")
    return logits.argmax(-1)


def _candidates(
    logits: Tensor, scores: Tensor, beams: int, k: int, block: int
) -> tuple[Tensor, Tensor]:
    """The ``k`` best continuations of each sentence: ``log_softmax(logits) + scores`` over
    its ``beams`` hypotheses ``(B·beams, V)``, token ``block`` (if >= 0) at ``-inf``.

    Returns values ``(B, k)``, best first, and flat indices ``beam·V + token``. On the CPU
    one fused pass of the compiled kernel (the log-probabilities are never written);
    elsewhere ``log_softmax`` and ``topk``.
    """
    logits = logits.float()
    if logits.device.type == "cpu" and (ops := decode_ops()) is not None:
        return ops.beam_topk(logits.contiguous(), scores.float().contiguous(), beams, k, block)
    logp = logits.log_softmax(-1)  # (B·beams, V)
    if block >= 0:
        logp[:, block] = float("-inf")
    cand = logp.add_(scores[:, None]).view(-1, beams * logp.shape[-1])  # in place: no copy
    return cand.topk(k, dim=1)


@torch.inference_mode()
def beam_search(
    model,
    src: Tensor,
    *,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    use_cache: bool = True,
    cache_dtype: torch.dtype | None = None,
    n_best: int = 1,
    no_repeat_ngram: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Beam search; a finished hypothesis scores ``log p / len ** length_penalty``.

    A sentence stops when ``beam_size`` hypotheses have ended with ``</s>`` (an ``</s>``
    counts only among the ``beam_size`` best candidates of a step) or at its length limit
    (then, if none ended, the best open hypothesis is taken). ``min_new_tokens``: no
    hypothesis ends before that many tokens. Sentences are searched together (one batch of
    ``B·beam_size`` rows per step). Returns the best hypothesis per sentence, ids ``(B, T)``;
    with ``n_best > 1``, the ``n_best`` best hypotheses that ended (best first) and their
    scores: ``(ids (B, n_best, T), scores (B, n_best))``, padded with ``pad_id`` and ``-inf``
    where fewer ended. ``no_repeat_ngram=n`` (>= 2): no hypothesis writes an n-gram of tokens
    twice (its log-probability stays what the model gives; the n-gram is just never taken).
    """
    _check_src(src)
    _check_min(min_new_tokens)
    _check_ngram(no_repeat_ngram)
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    cfg, K, dev = model.cfg, beam_size, src.device
    limits = _limits(model, src, max_new_tokens)  # (B,)
    T_max = int(limits.max())
    B = src.shape[0]
    if use_cache:
        steps = _Steps(model, src, K, T_max, cache_dtype)
    else:
        rsrc = src.repeat_interleave(K, dim=0)  # (B·K, S)
        mask = model.src_mask(rsrc)
        memory = model.encode(rsrc, mask)  # (B·K, S, d_model)
    ys = torch.full((B * K, T_max + 1), cfg.pad_id, dtype=torch.long, device=dev)
    ys[:, 0] = cfg.bos_id
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    best = torch.full((B,), float("-inf"), device=dev)
    best_tokens: list[Tensor | None] = [None] * B
    ended: list[list[tuple[float, Tensor]]] = [[] for _ in range(B)]  # (score, ids) per sentence
    n_final = torch.zeros(B, dtype=torch.long, device=dev)
    # a finished sentence leaves the batch: ys, scores, limits and the decoder's state hold
    # only the sentences still running, alive[i] is row block i's sentence
    alive, alive_limits = torch.arange(B, device=dev), limits
    offsets = (torch.arange(B, device=dev) * K)[:, None]  # (B_alive, 1): first row of each
    first_k = (torch.arange(2 * K, device=dev) < K)[None, :]  # (1, 2K)
    eos, lim_min = cfg.eos_id, int(limits.min())
    n = 0
    # Most steps end no hypothesis and no sentence: the checks for those are skipped then
    # (each is a few small tensor operations, which add up to the cost of a step's attention).
    for t in range(T_max):
        if use_cache:
            logits = steps(ys[:, t])  # (B_alive·K, V)
        else:
            logits = model.decode(ys[:, : t + 1], memory, mask)[:, -1]
        V = logits.shape[-1]
        block = eos if t < min_new_tokens else -1
        banned = _repeats(ys[:, 1 : t + 1], no_repeat_ngram) if no_repeat_ngram else None
        # a sentence with m banned (hypothesis, token) pairs needs 2K + m candidates to keep 2K
        extra = int(torch.bincount(banned[0] // K).max()) if banned else 0
        top, idx = _candidates(logits, scores.view(-1), K, 2 * K + extra, block)  # (B_alive, 2K+m)
        if banned:
            top, idx = _drop_banned(top, idx, banned, offsets, V, 2 * K)  # (B_alive, 2K)
        beam, tok = idx // V, idx % V
        # </s> blocked: it can only appear as a -inf filler candidate, which never counts
        hit = None if block >= 0 else tok == eos
        eos_seen = hit is not None and bool(hit.any())
        ended_now = eos_seen  # a hypothesis or a sentence may have ended at this step
        if eos_seen:
            is_eos = hit & first_k & (top > float("-inf"))
            norm = top / float(t + 1) ** length_penalty
            for i, j in is_eos.nonzero().tolist():
                b = int(alive[i])
                if n_final[b] >= K:
                    continue
                n_final[b] += 1
                hyp = torch.cat([ys[i * K + beam[i, j], 1 : t + 1], tok[i, j : j + 1]])  # a copy
                ended[b].append((float(norm[i, j]), hyp))
                if norm[i, j] > best[b]:
                    best[b], best_tokens[b] = norm[i, j], hyp
        if t + 1 >= lim_min:
            ended_now = True
            for i in (t + 1 >= alive_limits).nonzero().flatten().tolist():
                b = int(alive[i])
                if best_tokens[b] is None:  # out of length, nothing finished: the best open beam
                    j = int(top[i].masked_fill(tok[i] == eos, float("-inf")).argmax())
                    best_tokens[b] = torch.cat([ys[i * K + beam[i, j], 1 : t + 1],
                                                tok[i, j : j + 1]])  # fmt: skip
                n_final[b] = K
        n = t + 1
        finished = n_final[alive] >= K if ended_now else None  # (B_alive,)
        if finished is not None and bool(finished.all()):
            break
        if eos_seen:
            top = top.masked_fill(hit, float("-inf"))
        scores, keep = top.topk(K, dim=1)  # (B_alive, K) best non-</s> continuations
        rows = (offsets + beam.gather(1, keep)).view(-1)  # (B_alive·K,)
        ys[:, : t + 1] = ys[rows, : t + 1]
        ys[:, t + 1] = tok.gather(1, keep).view(-1)
        if use_cache:
            steps.reorder(rows)
        if finished is not None and bool(finished.any()):
            live = (~finished).nonzero().flatten()
            hyps = hypothesis_rows(live, K)
            ys, scores = ys[hyps], scores[live]
            alive, alive_limits = alive[live], alive_limits[live]
            offsets, lim_min = offsets[: len(alive)], int(alive_limits.min())
            if use_cache:
                steps.keep(live)
            else:
                memory, mask = memory[hyps], mask[hyps]
    if use_cache:
        steps.close()
    out = []
    for b in range(B):
        if best_tokens[b] is None:  # nothing finished: the best open beam
            i = int((alive == b).nonzero()[0, 0])
            best_tokens[b] = ys[i * K + int(scores[i].argmax()), 1 : n + 1]
        out.append(best_tokens[b])
    if n_best > 1:
        return _n_best(ended, out, n_best, cfg.pad_id)
    T = max(len(o) for o in out)
    result = torch.full((B, T), cfg.pad_id, dtype=torch.long, device=dev)
    for b, o in enumerate(out):
        result[b, : len(o)] = o
    return result


def _n_best(
    ended: list[list[tuple[float, Tensor]]], best: list[Tensor], n: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """The ``n`` best ended hypotheses per sentence, best first (the chosen one when none
    ended): ``(ids (B, n, T), scores (B, n))``, padded with ``pad_id`` / ``-inf``."""
    B = len(best)
    picks = []
    for b in range(B):
        ranked = sorted(ended[b], key=lambda e: -e[0])[:n]  # stable: ties keep their order
        picks.append(ranked or [(float("-inf"), best[b])])  # none ended: the open one, unscored
    T = max(len(ids) for p in picks for _, ids in p)
    ids = torch.full((B, n, T), pad_id, dtype=torch.long, device=best[0].device)
    scores = torch.full((B, n), float("-inf"))
    for b, p in enumerate(picks):
        for i, (sc, hyp) in enumerate(p):
            ids[b, i, : len(hyp)] = hyp
            scores[b, i] = sc
    return ids, scores


@torch.inference_mode()
def translate(
    model,
    tokenizer,
    sentences: list[str],
    *,
    beam_size: int = 1,
    length_penalty: float = 1.0,
    max_tokens: int = 4000,
    progress: bool = False,
    cache_dtype: torch.dtype | None = None,
    no_repeat_ngram: int = 0,
) -> list[str]:
    """Translate ``sentences`` (batched by length, in order). ``beam_size=1`` is greedy;
    ``cache_dtype`` and ``no_repeat_ngram`` as :func:`greedy_search`'s. Each output has at most
    ``2·len(source) + 10`` tokens."""
    from tqdm import tqdm

    if isinstance(sentences, str):
        raise TypeError("sentences must be a list of str, not a single str")
    dev = next(model.parameters()).device
    limit = model.cfg.max_len // 2 - 1  # source tokens before </s>; the output fits the rest
    ids = tokenizer.encode_batch(list(sentences))
    if any(len(s) > limit for s in ids):  # qkv.translate.Translator splits such text instead
        n = sum(len(s) > limit for s in ids)
        warnings.warn(f"{n} sentence(s) longer than {limit} tokens were cut to {limit}",
                      stacklevel=2)  # fmt: skip
    ids = [s[:limit] + [tokenizer.eos_id] for s in ids]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    batches, cur = [], []
    for i in order:
        if cur and len(ids[i]) * (len(cur) + 1) * max(beam_size, 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    with _evaluating(model):
        for batch in tqdm(batches, desc="translate", disable=not progress, leave=False):
            S = max(len(ids[i]) for i in batch)
            src = torch.full((len(batch), S), model.cfg.pad_id, dtype=torch.long)
            for r, i in enumerate(batch):
                src[r, : len(ids[i])] = torch.tensor(ids[i])
            src = src.to(dev)
            if beam_size == 1:
                hyp = greedy_search(model, src, cache_dtype=cache_dtype,
                                    no_repeat_ngram=no_repeat_ngram)  # fmt: skip
            else:
                hyp = beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty,
                                  cache_dtype=cache_dtype, no_repeat_ngram=no_repeat_ngram)  # fmt: skip
            for r, i in enumerate(batch):
                out[i] = tokenizer.decode(hyp[r].tolist())
    return out


@torch.inference_mode()
def generate(
    lm,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    cache_dtype: torch.dtype | None = None,
    prefill_chunk: int = 512,
) -> Tensor:
    """Continue each prompt of a :class:`~qkv.models.CausalLM`: ``prompt (B, T)`` → new ids
    ``(B, n)``, ``n <= max_new_tokens``.

    The prompt fills the KV caches in chunks of ``prefill_chunk`` tokens (the model's own
    forward); the new tokens come one per step from the prepared decoder
    (:class:`~qkv.models.lm_decoder.LMDecoder`; the model's forward where it does not apply,
    e.g. with an inspection hook set). ``temperature=0`` is greedy; above 0 tokens are
    sampled from ``softmax(logits / temperature)``, over the ``top_k`` most likely if given
    (``generator`` makes it reproducible). With ``eos_id`` a sequence ends at that token
    (then ``pad_id``), and generation stops when all have ended. ``cache_dtype``: storage
    dtype of the caches (``torch.bfloat16`` halves what each step reads).

    >>> out = generate(lm, torch.tensor([[5, 6, 7]]), max_new_tokens=8)  # doctest: +SKIP
    """
    from qkv.models.lm_decoder import LMDecoder

    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.dtype not in (
        torch.int64, torch.int32) or prompt.shape[1] == 0:  # fmt: skip
        shape = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise TypeError(f"prompt must be an integer tensor (B, T) with T >= 1, got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
    cfg = lm.cfg
    B, T = prompt.shape
    if cfg.positional != "rope" and T + max_new_tokens > cfg.max_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) > the model's "
                         f"max_len={cfg.max_len} positions")  # fmt: skip

    def pick(logits: Tensor) -> Tensor:  # (B, V) -> (B,)
        if temperature == 0:
            return _argmax(logits, -1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

    with _evaluating(lm):
        caches = lm.new_cache(capacity=T + max_new_tokens, dtype=cache_dtype)
        for s in range(0, T, prefill_chunk):
            logits = lm(prompt[:, s : s + prefill_chunk], cache=caches)[:, -1]  # (B, V)
        fast = LMDecoder.for_model(lm)
        state = fast.start(caches) if fast is not None else None
        out = torch.full((B, max_new_tokens), cfg.pad_id, dtype=torch.long, device=prompt.device)
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        n = 0
        for n in range(1, max_new_tokens + 1):
            tok = pick(logits).masked_fill(done, cfg.pad_id)  # (B,)
            out[:, n - 1] = tok
            if eos_id is not None:
                done |= tok == eos_id
                if bool(done.all()):
                    break
            if n == max_new_tokens:
                break
            if fast is not None:
                logits = fast.step(state, tok)
            else:
                logits = lm(tok[:, None], cache=caches)[:, -1]
    return out[:, :n]
