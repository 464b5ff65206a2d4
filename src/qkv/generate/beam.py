"""Beam search for a :class:`~qkv.models.Seq2SeqTransformer`: ``beam_size`` hypotheses per
sentence, scored ``log p / len ** length_penalty`` when they end; sentences searched together,
a sentence whose search ended leaves the batch; the best hypothesis or the ``n_best``.

Shapes: ``src (B, S)`` → ids ``(B, T)``, or ``(ids (B, n_best, T), scores (B, n_best))``;
logits ``(B·beam_size, V)`` per step, sentence-major, beams inner.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.generate._common import _check_min, _check_src, _limits
from qkv.generate._ngram import _check_ngram, _drop_banned
from qkv.generate._repeat import RepeatGuard, banned_tokens
from qkv.generate._steps import _Steps
from qkv.kernels._native import decode_ops
from qkv.models.incremental import hypothesis_rows

__all__ = ["beam_search"]


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
    repeat_guard: RepeatGuard | None = None,
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
    ``repeat_guard``: as :func:`~qkv.generate.greedy_search`'s, the same way.
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
        banned = banned_tokens(ys[:, 1 : t + 1], no_repeat_ngram, repeat_guard)
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
