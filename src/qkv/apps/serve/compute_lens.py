"""``POST /api/lens``: the Lens view's numbers (:func:`qkv.inspect.lens.lens`) for one request.

The body is ``POST /api/attention``'s (``text``, ``model``, ``translate``, ``beam``,
``ablate``; the rest is ignored) plus ``position`` (the position whose prediction is
attributed; default the last) and ``top_k`` (tokens per lens cell and per head, 1 to
:data:`MAX_TOP_K`). The text is cut and decoded exactly as ``/api/attention`` does, so the
positions are the columns of the maps the page already holds:

* a qkv translator (``translate: true``): the decoder teacher-forced on the translation,
  positions = the decoder inputs (``<s>``, y₁, …); position i predicts y_{i+1};
* a qkv causal LM or a transformers decoder-only model: the text's tokens, up to
  :func:`~qkv.apps.serve.long.map_limit` (2,048, or one short of the model's positions), as
  ``/api/attention`` answers a long text.

Heads switched off (``ablate``) are off for the run: their writes are zero. The answer's
size is bounded: (layers + 1) × positions × ``top_k`` tokens, and 2 × ``top_k`` per head;
the attribution is at one position whatever the length, and the lens is one forward pass
plus the unembedding of (layers + 1) × positions residuals, a block of positions at a time
(:func:`qkv.inspect.lens.lens`): nothing positions × positions beyond the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from qkv.apps.serve.answer import ablation_spec, cut_to_limit
from qkv.apps.serve.compute import decode_translation, translator_limit
from qkv.apps.serve.limits import (
    MAX_TEXT_CHARS,
    AttentionRequest,
    BadRequest,
    parse_request,
)
from qkv.apps.serve.long import map_limit, position_limit
from qkv.apps.serve.models import Entry
from qkv.capture.page import number
from qkv.inspect.lens import Lens, lens

__all__ = ["DEFAULT_TOP_K", "MAX_TOP_K", "NOTE", "LensRequest", "lens_answer", "parse_lens"]

MAX_TOP_K = 10
DEFAULT_TOP_K = 5
NOTE = ("direct effect through the final norm with its scale frozen at the actual final "
        "residual (the standard approximation); effects through later layers are not included")  # fmt: skip


@dataclass
class LensRequest:
    """A checked ``POST /api/lens`` body: the attention request, ``position``, ``top_k``."""

    req: AttentionRequest
    position: int | None  # None: the last position
    top_k: int

    @property
    def model(self) -> str:
        return self.req.model


def _small_int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}], got {v!r}"[:120])
    return v


def parse_lens(body: object) -> LensRequest:
    """Check a ``/api/lens`` body; one :class:`BadRequest` naming the field on any problem."""
    req = parse_request(body)  # a dict from here on
    return LensRequest(req, _small_int(body, "position", None, 0, 10_000),
                       _small_int(body, "top_k", DEFAULT_TOP_K, 1, MAX_TOP_K))  # fmt: skip


@dataclass
class _Run:
    """What the lens runs for one request, and how its answer names things."""

    model: object
    args: tuple  # model(*args, **kwargs)
    kwargs: dict
    tokens: list[str]  # the positions' labels (the columns of /api/attention's maps)
    labels: Callable[[list[int]], list[str]]  # token ids → labels
    text: str  # the text, cut as /api/attention cuts it
    cut: bool
    heads_off: AbstractContextManager  # the request's heads switched off, for the run
    limit: int  # the most positions this model's text may have
    extra: dict  # more fields of the answer (the translation, the model's positions)


def _qkv_translator(entry: Entry, req: AttentionRequest, text: str) -> _Run:
    from qkv.capture.record import attention_modules
    from qkv.inspect.ablate import heads_off
    from qkv.inspect.translation import piece_labels

    loaded, model = entry.loaded, entry.loaded.full_model
    if not req.translate:
        raise BadRequest(f"translate must be true: the lens reads {entry.name!r}'s decoder, "
                         f"which needs the translation")  # fmt: skip
    limit = translator_limit(model)
    text, _, _, cut = cut_to_limit(loaded.encode, text, limit)
    spec = ablation_spec(req, {n: m.n_heads for n, m in attention_modules(model)})
    with torch.no_grad(), heads_off(model, spec):
        d = decode_translation(entry, text, req.beam)
    tok = loaded.tokenizer
    labels = lambda ids: [piece_labels(tok, [i])[0] for i in ids]  # noqa: E731
    inputs = (torch.tensor([d["src"]]), torch.tensor([d["tgt_in"]]))
    return _Run(model, inputs, {}, d["inputs"], labels, text, cut, heads_off(model, spec), limit,
                {"translation": {"text": d["text"], "target_tokens": d["produced"]}})  # fmt: skip


def _decoder_only(entry: Entry, req: AttentionRequest, text: str) -> _Run:
    loaded = entry.loaded
    if req.translate:
        raise BadRequest(f"model {entry.name!r} does not translate; send translate: false")
    if loaded.hf is not None:
        from qkv.hf import heads_off
        from qkv.inspect.hf_models import head_counts

        counts = head_counts(loaded)
        model, labels = loaded.hf.model, loaded.hf.tokenizer.convert_ids_to_tokens
        positions = position_limit(model, loaded.hf)
    else:
        from qkv.capture.record import attention_modules
        from qkv.inspect.ablate import heads_off
        from qkv.inspect.translation import piece_labels

        model = loaded.full_model
        counts = {n: m.n_heads for n, m in attention_modules(model)}
        labels = lambda ids: [piece_labels(loaded.tokenizer, [i])[0] for i in ids]  # noqa: E731
        positions = position_limit(loaded.full_model or loaded.model)
    # the long limit of /api/attention's maps (2,048 or the model's positions): the same
    # positions as the answer on the page, however long its text
    limit = map_limit(positions)
    text, tokens, inputs, cut = cut_to_limit(loaded.encode, text, limit)
    spec = ablation_spec(req, counts)
    args, kwargs = inputs, {}
    if loaded.hf is not None:  # transformers: its own keyword arguments
        args, kwargs = (), {"input_ids": inputs[0], "attention_mask": inputs[1]}
    return _Run(model, args, kwargs, tokens, labels, text, cut, heads_off(model, spec), limit,
                {"positions": positions})  # fmt: skip


def _kind(entry: Entry) -> str:
    """``"translator"``, ``"decoder"`` or a refusal naming what the model is."""
    loaded = entry.loaded
    if loaded.hf is not None:
        if loaded.hf.kind == "decoder":
            return "decoder"
        why = f"a transformers {loaded.hf.kind}"
    else:
        from qkv.models import CausalLM, Seq2SeqTransformer

        full = loaded.full_model
        if isinstance(full, Seq2SeqTransformer) and loaded.tokenizer is not None:
            return "translator"
        if isinstance(full, CausalLM) and loaded.tokenizer is not None:
            return "decoder"
        why = "a random-weight post-LN toy" if entry.random else "an encoder"
    raise BadRequest(f"model: the lens reads a decoder (qkv's translators, qkv causal LMs, "
                     f"transformers decoder-only models); {entry.name!r} is {why}")  # fmt: skip


def _json(out: Lens, labels) -> dict:
    """The answer's ``lens`` and ``dla`` fields, tokens as labels, numbers rounded."""
    ids = out.top_ids.tolist()  # [L + 1][T][k]
    used = {i for a in ids for r in a for i in r} | {out.target}
    used |= {i for h in out.heads for i, _ in h.up + h.down}
    names = dict(zip(sorted(used), labels(sorted(used)), strict=True))
    table = {"layers": out.layers, "top_k": out.top_ids.shape[-1],
             "tokens": [[[names[i] for i in r] for r in a] for a in ids],
             "probs": [[[number(p) for p in r] for r in a] for a in out.top_probs.tolist()]}  # fmt: skip
    pair = lambda xs: [[names[i], number(v)] for i, v in xs]  # noqa: E731
    dla = None
    if out.why_not is None:
        dla = {"heads": [{"layer": h.layer, "head": h.head, "target": number(h.target),
                          "up": pair(h.up), "down": pair(h.down)} for h in out.heads],
               "others": [{"name": n, "target": number(v)} for n, v in out.others],
               "check": number(out.check, 6), "note": NOTE}  # fmt: skip
    return {"lens": table, "position": out.position, "predicted": names[out.target],
            "logit": number(out.logit), "dla": dla, "dla_unavailable": out.why_not}  # fmt: skip


def lens_answer(entry: Entry, lr: LensRequest) -> dict:
    """Answer one ``/api/lens`` request with the (loaded) model of ``entry``."""
    req = lr.req
    text = req.text[:MAX_TEXT_CHARS]
    lock = entry.lock if entry.lock is not None else nullcontext()
    with lock, torch.no_grad():
        kind = _kind(entry)
        build = _qkv_translator if kind == "translator" else _decoder_only
        run = build(entry, req, text)
        T = len(run.tokens)  # the positions: the columns of the page's maps
        position = T - 1 if lr.position is None else lr.position
        if position >= T:
            raise BadRequest(f"position must be in [0, {T - 1}] for this text, got {position}")
        with run.heads_off:
            out = lens(run.model, *run.args, position=position, top_k=lr.top_k, **run.kwargs)
    cut = run.cut or len(req.text) > MAX_TEXT_CHARS
    return {"model": entry.name, "random": entry.random, "limit": run.limit, "text": run.text,
            "tokens": run.tokens, "truncated": cut, **run.extra, **_json(out, run.labels)}  # fmt: skip
