"""Sentence embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2.

    sentences ─ tokenizer (pad, truncate) ─ encoder ─ last_hidden_state (B, T, d)
              ─ mean over real tokens (B, d) ─ ÷ ‖·‖₂ (B, d)

Sentences are encoded in batches sorted by length (less padding), and returned in the
order given.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

__all__ = ["cosine_similarity_matrix", "encode", "mean_pool"]


def mean_pool(last_hidden_state: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Mean of ``last_hidden_state (B, T, d)`` over real tokens → ``(B, d)``.

    ``attention_mask (B, T)`` is HuggingFace's: **1 = real token, 0 = padding** (``None``:
    every token is real). A row with no real token gives zeros.

    >>> mean_pool(torch.ones(1, 3, 2), torch.tensor([[1, 1, 0]]))
    tensor([[1., 1.]])
    """
    if last_hidden_state.dim() != 3:
        raise ValueError(
            f"last_hidden_state must be (B, T, d), got {tuple(last_hidden_state.shape)}"
        )
    if attention_mask is None:
        return last_hidden_state.mean(dim=1)
    if attention_mask.shape != last_hidden_state.shape[:2]:
        raise ValueError(
            f"attention_mask must be (B, T)={tuple(last_hidden_state.shape[:2])}, got "
            f"{tuple(attention_mask.shape)}"
        )
    w = attention_mask.to(last_hidden_state.dtype).unsqueeze(-1)  # (B, T, 1)
    summed = (last_hidden_state * w).sum(dim=1)  # (B, d)
    return summed / w.sum(dim=1).clamp(min=1e-9)  # (B, d)


def _normalize(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # (N, d), rows of unit length


def cosine_similarity_matrix(a: Tensor, b: Tensor | None = None) -> Tensor:
    """Cosine similarities ``(N, M)`` between rows of ``a (N, d)`` and ``b (M, d)`` (default a)."""
    b = a if b is None else b
    return _normalize(a.float()) @ _normalize(b.float()).T  # (N, M)


@torch.inference_mode()
def encode(
    model: nn.Module,
    tokenizer,
    sentences: str | list[str],
    *,
    batch_size: int = 32,
    max_length: int | None = None,
    normalize: bool = True,
    progress: bool = False,
) -> Tensor:
    """Embed ``sentences`` with an encoder called like HuggingFace's ``BertModel``.

    Args:
        model: returns ``.last_hidden_state (B, T, d)`` from ``model(input_ids,
            attention_mask=...)`` (a qkv :class:`~qkv.pretrained.BertModel` or HF's).
        tokenizer: a HuggingFace tokenizer.
        sentences: one string or a list.
        batch_size: sentences per forward pass.
        max_length: truncate to this many tokens; default the model's ``max_seq_length``
            (``sentence_bert_config.json``, 256 for all-MiniLM-L6-v2) or the tokenizer's limit.
        normalize: L2-normalise (sentence-transformers' ``Normalize`` module).
        progress: show a progress bar.

    Returns:
        ``(N, d)`` float32 embeddings on the CPU, in the order of ``sentences``.
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    if not sentences or not all(isinstance(s, str) for s in sentences):
        raise ValueError("sentences must be a non-empty string or list of strings")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_length is None:
        max_length = getattr(model, "max_seq_length", None) or min(
            getattr(tokenizer, "model_max_length", 512), 512
        )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))  # longest first
    chunks = []
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="encode"):
        idx = order[start : start + batch_size]
        batch = tokenizer(
            [sentences[i] for i in idx], padding=True, truncation=True, max_length=max_length,
            return_tensors="pt",
        )  # fmt: skip
        ids = batch["input_ids"].to(device)  # (b, T)
        attn = batch["attention_mask"].to(device)  # (b, T), 1 = real token
        hidden = model(ids, attention_mask=attn).last_hidden_state  # (b, T, d)
        emb = mean_pool(hidden.float(), attn)  # (b, d)
        chunks.append(_normalize(emb) if normalize else emb)
    model.train(was_training)
    out = torch.cat(chunks).cpu()  # (N, d) in sorted order
    result = torch.empty_like(out)
    result[torch.tensor(order)] = out
    return result
