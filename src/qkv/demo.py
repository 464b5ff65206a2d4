"""``qkv demo``: attention on a short sentence, one step at a time, with the library's numbers.

Every tensor printed here is computed by qkv itself: ``TokenEmbedding``,
``SinusoidalPositionalEncoding``, the projections of a ``MultiHeadAttention`` and
``qkv.functional.attention_steps``, and the last step checks that the pieces put together by
hand equal the module's own forward pass.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from qkv.attention import MultiHeadAttention
from qkv.functional import attention_steps
from qkv.positional import SinusoidalPositionalEncoding, TokenEmbedding

DEFAULT_TEXT = "The boy trains the puppy ."


def walk(
    text: str = DEFAULT_TEXT,
    *,
    d_model: int = 8,
    n_heads: int = 2,
    causal: bool = False,
    seed: int = 0,
    out: Callable[[str], None] = print,
) -> dict[str, torch.Tensor]:
    """Print each step of multi-head self-attention over ``text``; return the tensors."""
    torch.manual_seed(seed)
    words = text.split()
    if not words:
        raise ValueError("text must contain at least one word")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = torch.tensor([[vocab[w] for w in words]])  # (B=1, T)
    T, d_k = len(words), d_model // n_heads

    def show(title: str, t: torch.Tensor, note: str = "") -> None:
        out(f"\n== {title}  shape {list(t.shape)}" + (f"  ({note})" if note else ""))
        out(str(t.detach()))

    torch.set_printoptions(precision=3, sci_mode=False, linewidth=120)
    out(f"Sentence: {text!r} → {T} tokens {words}; d_model={d_model}, h={n_heads}, d_k={d_k}")
    embed, pos = TokenEmbedding(len(vocab), d_model), SinusoidalPositionalEncoding(d_model)
    mha = MultiHeadAttention(d_model, n_heads).eval()
    with torch.no_grad():
        e = embed(ids)  # (1, T, d_model)
        show("1. token embeddings × √d_model", e[0])
        x = pos(e)  # (1, T, d_model)
        show("2. + sinusoidal positional encoding", x[0], "x, the input to attention")
        q = mha.split_heads(mha.w_q(x), n_heads)  # (1, h, T, d_k)
        k, v = mha.project_kv(x)  # (1, h, T, d_k)
        show("3. Q = x W_Q, split into heads", q[0], "(h, T, d_k)")
        show("   K = x W_K", k[0])
        show("   V = x W_V", v[0])
        steps = attention_steps(q, k, v, causal=causal)
        show("4. scores Q Kᵀ", steps.scores[0], f"{T}×{T} = {T * T} scores per head")
        show(f"5. scaled by 1/√d_k = {steps.scale:.4f}", steps.scaled[0])
        if causal:
            show("6. causal mask (True = may attend)", steps.mask)
            show("   masked scores", steps.masked[0], "-inf where a token would see the future")
        show("7. softmax → attention weights", steps.weights[0], "each row sums to 1")
        for i, w in enumerate(words):
            top = steps.weights[0, :, i].argmax(-1).tolist()
            out(
                f"   {w!r:>10} attends most to: "
                + ", ".join(f"head {h}→{words[j]!r}" for h, j in enumerate(top))
            )
        show("8. weighted sum of V", steps.output[0], "(h, T, d_k)")
        concat = mha.merge_heads(steps.output)  # (1, T, d_model)
        show("9. heads concatenated", concat[0], "(T, h·d_k)")
        y = mha.w_o(concat)  # (1, T, d_model)
        show("10. output projection W_O", y[0], "(T, d_model)")
        same = torch.allclose(y, mha(x, causal=causal), atol=1e-6)
        out(f"\nStep by step equals MultiHeadAttention.forward: {same}")
    return {"ids": ids, "x": x, "q": q, "k": k, "v": v, "weights": steps.weights, "y": y}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="walk through attention on a short sentence")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--d-model", type=int, default=8)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(
        func=lambda a: (
            walk(a.text, d_model=a.d_model, n_heads=a.heads, causal=a.causal, seed=a.seed) and 0
        )
    )
