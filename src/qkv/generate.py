"""Decoding for :class:`~qkv.models.Seq2SeqTransformer`: greedy and beam search, batched.

Both encode the source once and decode incrementally with a
:class:`~qkv.models.DecoderCache` (each step feeds one token per sentence; the cross-attention
keys/values of the memory are projected on the first step only). ``use_cache=False`` recomputes
the whole prefix every step: the slow reference that the cached path must equal.

Shapes: ``src (B, S)`` → generated ids ``(B, T)`` (after ``<s>``; ``</s>`` then ``<pad>``).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = ["greedy_search", "beam_search", "translate"]


def _limits(model, src: Tensor, max_new_tokens: int | None) -> Tensor:
    """Tokens each sentence may generate ``(B,)``: ``max_new_tokens``, or by default
    ``2·len(source) + 10`` (its own length, not the padded one, so batching changes nothing)."""
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return torch.full((src.shape[0],), max_new_tokens, device=src.device)
    lengths = (src != model.cfg.pad_id).sum(1)
    return (2 * lengths + 10).clamp(max=model.cfg.max_len - 1)


def _check_src(src: Tensor) -> None:
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype not in (torch.int64, torch.int32):
        shape = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        raise TypeError(f"src must be an integer tensor (B, S), got {shape}")


@torch.no_grad()
def greedy_search(
    model,
    src: Tensor,
    *,
    max_new_tokens: int | None = None,
    use_cache: bool = True,
    ignore_eos: bool = False,
) -> Tensor:
    """Most likely next token at every step. Returns ids ``(B, T)``, pad after ``</s>``.

    ``ignore_eos`` keeps going for exactly ``max_new_tokens`` (benchmarks).

    >>> out = greedy_search(model, torch.tensor([[5, 6, 2]]))  # doctest: +SKIP
    """
    _check_src(src)
    cfg = model.cfg
    limits = _limits(model, src, max_new_tokens)  # (B,)
    mask = model.src_mask(src)  # (B, 1, 1, S), True = may attend
    memory = model.encode(src, mask)  # (B, S, d_model)
    B = src.shape[0]
    ys = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    cache = model.new_cache() if use_cache else None
    for t in range(int(limits.max())):
        inp = ys[:, -1:] if use_cache else ys
        logits = model.decode(inp, memory, mask, cache=cache)[:, -1]  # (B, V)
        nxt = logits.argmax(-1)
        if not ignore_eos:
            nxt = nxt.masked_fill(done, cfg.pad_id)
            done |= (nxt == cfg.eos_id) | (t + 1 >= limits)
        ys = torch.cat([ys, nxt[:, None]], dim=1)
        if not ignore_eos and bool(done.all()):
            break
    return ys[:, 1:]


@torch.no_grad()
def beam_search(
    model,
    src: Tensor,
    *,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    max_new_tokens: int | None = None,
    n_best: int = 1,
) -> Tensor | tuple[Tensor, Tensor]:
    """Beam search; a finished hypothesis scores ``log p / len ** length_penalty``.

    A sentence stops when ``beam_size`` hypotheses have ended with ``</s>`` (an ``</s>``
    counts only among the ``beam_size`` best candidates of a step) or at its length limit
    (then, if none ended, the best open hypothesis is taken). Returns the best hypothesis per
    sentence, ids ``(B, T)``; with ``n_best > 1``, the ``n_best`` best hypotheses that ended
    (best first) and their scores: ``(ids (B, n_best, T), scores (B, n_best))``, padded with
    ``pad_id`` and ``-inf`` where fewer ended.
    """
    _check_src(src)
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    cfg, K, dev = model.cfg, beam_size, src.device
    limits = _limits(model, src, max_new_tokens)  # (B,)
    B = src.shape[0]
    src = src.repeat_interleave(K, dim=0)  # (B·K, S)
    mask = model.src_mask(src)
    memory = model.encode(src, mask)  # (B·K, S, d_model)
    cache = model.new_cache()
    ys = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    best = torch.full((B,), float("-inf"), device=dev)
    best_tokens: list[Tensor | None] = [None] * B
    ended: list[list[tuple[float, Tensor]]] = [[] for _ in range(B)]  # (score, ids) per sentence
    n_final = torch.zeros(B, dtype=torch.long, device=dev)
    offsets = (torch.arange(B, device=dev) * K)[:, None]  # (B, 1)
    for t in range(int(limits.max())):
        logp = model.decode(ys[:, -1:], memory, mask, cache=cache)[:, -1].log_softmax(-1)
        V = logp.shape[-1]
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top, idx = cand.topk(2 * K, dim=1)  # (B, 2K)
        beam, tok = idx // V, idx % V
        is_eos = (tok == cfg.eos_id) & (torch.arange(2 * K, device=dev) < K)[None, :]
        is_eos &= top > float("-inf")
        norm = top / float(t + 1) ** length_penalty
        for b, j in is_eos.nonzero().tolist():
            if n_final[b] >= K:
                continue
            n_final[b] += 1
            row = int(offsets[b, 0] + beam[b, j])
            hyp = torch.cat([ys[row, 1:], tok[b, j : j + 1]])
            ended[b].append((float(norm[b, j]), hyp))
            if norm[b, j] > best[b]:
                best[b], best_tokens[b] = norm[b, j], hyp
        for b in (t + 1 >= limits).nonzero().flatten().tolist():
            if best_tokens[b] is None:  # out of length, nothing finished: the best open beam
                j = int(top[b].masked_fill(tok[b] == cfg.eos_id, float("-inf")).argmax())
                best_tokens[b] = torch.cat(
                    [ys[int(offsets[b, 0] + beam[b, j]), 1:], tok[b, j : j + 1]]
                )
            n_final[b] = K
        if bool((n_final >= K).all()):
            break
        top = top.masked_fill(tok == cfg.eos_id, float("-inf"))
        keep_scores, keep = top.topk(K, dim=1)  # (B, K) best non-</s> continuations
        rows = (offsets + beam.gather(1, keep)).view(-1)  # (B·K,)
        scores = keep_scores.masked_fill((n_final >= K)[:, None], float("-inf"))
        ys = torch.cat([ys[rows], tok.gather(1, keep).view(-1, 1)], dim=1)
        cache.reorder(rows)
    out = []
    for b in range(B):
        if best_tokens[b] is None:  # nothing finished: the best open beam
            best_tokens[b] = ys[b * K + int(scores[b].argmax()), 1:]
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


@torch.no_grad()
def translate(
    model,
    tokenizer,
    sentences: list[str],
    *,
    beam_size: int = 1,
    length_penalty: float = 1.0,
    max_tokens: int = 4000,
    progress: bool = False,
) -> list[str]:
    """Translate ``sentences`` (batched by length, in order). ``beam_size=1`` is greedy."""
    from tqdm import tqdm

    if isinstance(sentences, str):
        raise TypeError("sentences must be a list of str, not a single str")
    model.eval()
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
    for batch in tqdm(batches, desc="translate", disable=not progress, leave=False):
        S = max(len(ids[i]) for i in batch)
        src = torch.full((len(batch), S), model.cfg.pad_id, dtype=torch.long)
        for r, i in enumerate(batch):
            src[r, : len(ids[i])] = torch.tensor(ids[i])
        src = src.to(dev)
        if beam_size == 1:
            hyp = greedy_search(model, src)
        else:
            hyp = beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty)
        for r, i in enumerate(batch):
            out[i] = tokenizer.decode(hyp[r].tolist())
    return out
