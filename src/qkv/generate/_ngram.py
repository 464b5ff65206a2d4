"""The ``no_repeat_ngram`` guard of greedy and beam search.

``no_repeat_ngram=n`` never writes an n-gram of tokens twice in one hypothesis, as production
decoders do (``no_repeat_ngram_size``): a small model out of its depth otherwise loops ("ses
cordes, ses cordes, ...") until the length limit. The guard works in Python on what each step
returns: greedy sets the banned logits to ``-inf`` before the compiled pick; beam search asks
the compiled top-k for a few more candidates and drops the banned ones (the others keep the
model's log-probabilities).

Shapes: ``hist (N, L)``, the tokens each hypothesis wrote so far; candidates ``(B, k)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
