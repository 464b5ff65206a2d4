"""The notes' walk through attention on a short sentence, one step at a time, with the
library's numbers (rendered by ``qkv explain`` and the tour).

The sentence is split by :func:`qkv.data.words.split_words` (spaces and punctuation, one token per
Chinese or Japanese character, Burmese syllables, ...). Each word's embedding is a fixed random
vector drawn from a hash of the word and the seed, so one word has one embedding in every
sentence of a run (source and target of a cross-attention walk share them) and two different
words never share one by position.

Every tensor printed here is computed by qkv itself: ``TokenEmbedding``,
``SinusoidalPositionalEncoding``, the projections of a ``MultiHeadAttention`` and
``qkv.functional.attention_steps``, and the last step checks that the pieces put together by
hand equal the module's own forward pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from qkv.apps.cli_args import note
from qkv.attention import MultiHeadAttention
from qkv.data.words import count_words, first_words, split_words
from qkv.functional import attention_steps
from qkv.limits import MAX_TOKENS
from qkv.positional import SinusoidalPositionalEncoding, TokenEmbedding

DEFAULT_TEXT = "The boy trains the puppy ."


@dataclass
class Step:
    """One printed step: a title, the tensor, and a short note."""

    title: str
    tensor: torch.Tensor
    note: str = ""
    rows: list[str] | None = None  # labels of the last-but-one dim (tokens), None = indices
    cols: list[str] | None = None  # labels of the last dim (key tokens for score matrices)
    name: str = ""  # what the step is, for renderers: "softmax", "mask", ...


@dataclass
class Walk:
    """Every step of one attention call on a sentence, computed once for every renderer."""

    header: str
    words: list[str]
    source_words: list[str] | None
    steps: list[Step]
    attends: list[str]  # "'boy' attends most to: head 0→'the', ..."
    same: bool  # the pieces put together equal MultiHeadAttention.forward
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def word_vectors(words: list[str], d_model: int, seed: int = 0) -> torch.Tensor:
    """One fixed ``N(0, 1)`` vector per word ``(len(words), d_model)``, drawn from a hash of
    ``(seed, word)``: the same word gets the same vector in every sentence and every call.

    >>> a, b = word_vectors(["The", "Le"], 4), word_vectors(["Le"], 4)
    >>> bool((a[1] == b[0]).all()), bool((a[0] == a[1]).all())
    (True, False)
    """
    out = torch.empty(len(words), d_model)
    g = torch.Generator()
    for i, w in enumerate(words):
        h = hashlib.blake2b(f"{seed}\0{w}".encode("utf-8", "surrogatepass"), digest_size=8)
        g.manual_seed(int.from_bytes(h.digest(), "little") >> 1)
        out[i] = torch.randn(d_model, generator=g)
    return out


def walk_steps(
    text: str = DEFAULT_TEXT,
    *,
    d_model: int = 8,
    n_heads: int = 2,
    causal: bool = False,
    source: str | None = None,
    seed: int = 0,
) -> Walk:
    """Compute each step of multi-head attention over ``text`` (cross-attention to ``source``).

    Self-attention when ``source`` is None; otherwise queries come from ``text`` and keys and
    values from ``source``. ``causal``: the causal mask (True = may attend), bottom-right aligned.
    Tokens come from :func:`~qkv.data.words.split_words`; embeddings from :func:`word_vectors`
    (one per word, the same in ``text`` and ``source``). Steps are numbered 1, 2, ... in order;
    sub-steps (K, V, the masked scores) are indented and unnumbered.
    """
    torch.manual_seed(seed)
    words = split_words(text)
    src_words = None if source is None else split_words(source)
    if not words or (src_words is not None and not src_words):
        raise ValueError("text (and source, when given) must contain at least one word")
    if n_heads < 1 or d_model % n_heads or d_model % 2:
        raise ValueError(f"d_model must be even and divisible by heads, got {d_model}, {n_heads}")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + (src_words or [])))}
    ids = torch.tensor([[vocab[w] for w in words]])  # (B=1, T)
    T, d_k = len(words), d_model // n_heads
    Tk = T if src_words is None else len(src_words)
    steps: list[Step] = []

    def show(title: str, t: torch.Tensor, note: str = "", rows=None, cols=None, *, sub=False,
             name="") -> None:  # fmt: skip
        if not sub:
            title = f"{sum(not s.title.startswith(' ') for s in steps) + 1}. {title}"
        else:
            title = f"   {title}"
        steps.append(Step(title, t.detach().clone(), note, rows, cols, name))

    kind = "self-attention" if src_words is None else f"cross-attention to {src_words}"
    header = (f"Sentence: {text!r} → {T} tokens {words}; d_model={d_model}, h={n_heads}, "
              f"d_k={d_k}" + ("" if src_words is None else f"; {kind}")
              + f". Random weights (seed {seed}), no trained model: the numbers show how "
              "attention computes, not what a trained head attends to")  # fmt: skip
    embed, pos = TokenEmbedding(len(vocab), d_model), SinusoidalPositionalEncoding(d_model)
    mha = MultiHeadAttention(d_model, n_heads).eval()
    with torch.no_grad():
        embed.weight.copy_(word_vectors(list(vocab), d_model, seed))  # (V, d_model)
        e = embed(ids)  # (1, T, d_model)
        show("token embeddings × √d_model", e[0], rows=words)
        x = pos(e)  # (1, T, d_model)
        show("+ sinusoidal positional encoding", x[0], "x, the input to attention", words)
        ctx = None
        if src_words is not None:
            ctx = pos(embed(torch.tensor([[vocab[w] for w in src_words]])))  # (1, Tk, d_model)
            show("source: embeddings + positions", ctx[0], "memory, the keys' input", src_words,
                 sub=True)  # fmt: skip
        q = mha.split_heads(mha.w_q(x), n_heads)  # (1, h, T, d_k)
        k, v = mha.project_kv(x if ctx is None else ctx)  # (1, h, Tk, d_k)
        src = "x" if ctx is None else "memory"
        keys = words if src_words is None else src_words
        show("Q = x W_Q, split into heads", q[0], "one T × d_k matrix per head", words)
        show(f"K = {src} W_K", k[0], rows=keys, sub=True)
        show(f"V = {src} W_V", v[0], rows=keys, sub=True)
        st = attention_steps(q, k, v, causal=causal)
        show("scores Q Kᵀ", st.scores[0], f"{T}×{Tk} = {T * Tk} scores per head", words, keys)
        show(f"scaled by 1/√d_k = {st.scale:.4f}", st.scaled[0], "", words, keys)
        if causal:
            show("causal mask (True = may attend)", st.mask, "", words, keys, name="mask")
            show("masked scores", st.masked[0], "-inf where a token would see the future",
                 words, keys, sub=True)  # fmt: skip
        show("softmax → attention weights", st.weights[0], "each row sums to 1", words, keys,
             name="softmax")  # fmt: skip
        attends = [
            f"   {w!r:>10} attends most to (random weights): "
            + ", ".join(f"head {h}→{keys[j]!r}" for h, j in enumerate(top))
            for w, top in zip(words, st.weights[0].argmax(-1).T.tolist())
        ]
        show("weighted sum of V", st.output[0], "one T × d_k matrix per head", words)
        concat = mha.merge_heads(st.output)  # (1, T, d_model)
        show("heads concatenated", concat[0], "T × h·d_k", words)
        y = mha.w_o(concat)  # (1, T, d_model)
        show("output projection W_O", y[0], "T × d_model", words)
        same = torch.allclose(y, mha(x, context=ctx, causal=causal), atol=1e-6)
    tensors = {"ids": ids, "x": x, "q": q, "k": k, "v": v, "weights": st.weights, "y": y}
    return Walk(header, words, src_words, steps, attends, same, tensors)


def fit_words(value: str, name: str, command: str) -> str:
    """``value`` cut to ``MAX_TOKENS["explain"]`` tokens of :func:`split_words`, with a note
    on stderr when it was cut (the walk prints T × T numbers per head)."""
    limit = MAX_TOKENS["explain"]
    cut, was_cut = first_words(value, limit)
    if was_cut:
        total = count_words(value) if len(value) <= 64 * limit else None
        of = f" (of {total})" if total else ""
        note(f"--{name} cut to its first {count_words(cut)} tokens{of}; the walk prints "
             f"T × T numbers per head, at most {limit} tokens", command)  # fmt: skip
    return cut
