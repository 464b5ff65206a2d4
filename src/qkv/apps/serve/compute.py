"""The one computation behind ``POST /api/attention``: a model and a text → one JSON answer.

Everything the page shows comes from :func:`attention`: the per-head maps of every layer,
the step-by-step intermediates of one (layer, head) (``qkv.functional.attention_steps`` on
the module's real inputs), head statistics, the pronoun probe, the translation with its
per-step maps, and — when heads are switched off — the baseline to compare with. The
caller holds the model's lock (:class:`qkv.apps.serve.models.Entry`).

This module answers for qkv's own models; a transformers model's request is handed, once,
to :func:`qkv.apps.serve.compute_hf.hf_attention`. What both answers share (the token
limit cut, a translation's source split into pieces as ``qkv translate`` splits a long line,
the layer/head checks, the maps' fields, the step matrices) is in
:mod:`qkv.apps.serve.answer`.

Shapes: a layer's ``weights`` are ``[h][Tq][Tk]``; for a translation ``Tq`` runs over the
decoding steps (row ``s`` of a decoder layer is step ``s``), so the page slices rows for
its step slider.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from qkv.apps.serve.answer import (
    ablation_heads,
    ablation_spec,
    choose_layer,
    cut_to_limit,
    maps_fields,
    pieces_fields,
    probe_json,
    split_notice,
    split_source,
    step_matrices,
)
from qkv.apps.serve.decoding import notes, translator_of
from qkv.apps.serve.limits import (
    MAX_TEXT_CHARS,
    AttentionRequest,
    BadRequest,
    encoder_limit,
    target_limit,
    translate_limit,
)
from qkv.apps.serve.long import map_limit, position_limit
from qkv.apps.serve.models import Entry
from qkv.attention import MultiHeadAttention
from qkv.capture.maps import merge_steps
from qkv.capture.page import maps_json, number
from qkv.capture.record import attention_modules, capture, recording
from qkv.functional import attention_steps
from qkv.inspect.ablate import heads_off
from qkv.inspect.translation import label_cross_queries
from qkv.positional import ALiBi, RotaryEmbedding

__all__ = ["attention", "cut_to_limit", "decode_translation", "maps_json", "step_detail",
           "translator_limit"]

Call = tuple[tuple, dict, Tensor]  # a module call: args, kwargs, output


@contextmanager
def grab_call(model: nn.Module, layer: str) -> Iterator[list[Call]]:
    """Record the args, kwargs and output of every call of attention module ``layer``."""
    calls: list[Call] = []
    module = dict(attention_modules(model))[layer]

    def hook(_m, args, kwargs, out):
        calls.append((args, dict(kwargs), out[0] if isinstance(out, tuple) else out))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def step_detail(
    module: MultiHeadAttention, call: Call, head: int, q_tokens: list[str], k_tokens: list[str]
) -> dict:
    """The notes' walk through one call of ``module`` for ``head``: x, Q, K, V, QKᵀ, scaled,
    masked, softmax, output, concat (all heads), W_O — recomputed from the call's inputs with
    ``attention_steps``; ``check`` is the largest difference from the module's real output."""
    args, kwargs, real = call
    x = args[0]  # (1, Tq, d_model)
    context = args[1] if len(args) > 1 else kwargs.get("context")
    src = x if context is None else context
    q = module.split_heads(module.w_q(x), module.n_heads)  # (1, h, Tq, d_k)
    k, v = module.project_kv(src, kwargs.get("value"))  # (1, h_kv, Tk, d_k)
    if context is None and isinstance(module.position, RotaryEmbedding):
        q, k = module.position(q, k, 0, 0)
    bias = kwargs.get("attn_bias")
    if isinstance(module.position, ALiBi):
        alibi = module.position.bias(q.shape[2], k.shape[2], device=x.device, dtype=x.dtype)
        bias = alibi if bias is None else bias + alibi
    s = attention_steps(q, k, v, mask=kwargs.get("mask"), bias=bias,
                        causal=bool(kwargs.get("causal", False)), window=kwargs.get("window"))  # fmt: skip
    out = s.output  # (1, h, Tq, d_k)
    if module.head_mask is not None:
        out = out * module._head_scale(out)
    concat = module.merge_heads(out)  # (1, Tq, h·d_k)
    y = module.w_o(concat)  # (1, Tq, d_model)
    mask = s.mask
    if mask is None:
        mask = torch.ones(s.scores.shape[-2:], dtype=torch.bool)
    else:
        mask = mask.expand(s.scores.shape)[0, head]  # (Tq, Tk)
    h = head
    kind = "cross" if context is not None else "causal" if kwargs.get("causal") else "self"
    mats = step_matrices(
        {"x": x[0], "context": None if context is None else context[0], "q": s.q[0, h],
         "k": s.k[0, h], "v": s.v[0, h], "scores": s.scores[0, h], "scaled": s.scaled[0, h],
         "mask": mask, "masked": s.masked[0, h], "weights": s.weights[0, h],
         "output": out[0, h], "concat": concat[0], "wo": y[0]},
        q_tokens, k_tokens, s.scale,
    )  # fmt: skip
    return {
        "kind": kind, "head": head, "n_heads": module.n_heads, "d_k": module.d_k,
        "d_model": module.d_model, "scale": number(s.scale, 6), "matrices": mats,
        "check": float((y - real).abs().max()) if real.shape == y.shape else None,
        "head_off": bool(module.head_mask is not None and float(module.head_mask[head]) == 0.0),
    }  # fmt: skip


def _selection(model, req: AttentionRequest):
    """The request's layer (name, module) and its head switches, checked against the model."""
    modules = attention_modules(model)
    counts = {n: m.n_heads for n, m in modules}
    layer = choose_layer(req, counts)
    return layer, dict(modules)[layer], ablation_spec(req, counts)


def _encoder(entry: Entry, req: AttentionRequest, text: str) -> dict:
    loaded = entry.loaded
    model = loaded.model
    limit = encoder_limit(sum(m.n_heads for _, m in attention_modules(model)))
    positions = position_limit(loaded.full_model or model)
    if req.long:  # up to 2,048 tokens, or the model's positions (qkv.apps.serve.long)
        limit = map_limit(positions)
    text, tokens, inputs, cut = cut_to_limit(loaded.encode, text, limit)
    layer, module, spec = _selection(model, req)
    with torch.no_grad():
        with heads_off(model, spec):
            with grab_call(model, layer) as calls, recording(model) as rec:
                hidden = loaded.hidden(*inputs)  # (1, T, d)
            step = step_detail(module, calls[0], req.head, tokens, tokens)
        maps = rec.steps(tokens)[0]
        out = {"limit": limit, "positions": positions, "text": text, "tokens": tokens,
               "truncated": cut, **maps_fields(maps, req),
               "step": {"layer": layer, **step}}  # fmt: skip
        if spec:
            base_maps = capture(model, *inputs, tokens=tokens)
            base = loaded.hidden(*inputs)
            change = float((hidden - base).norm() / base.norm().clamp_min(1e-12))
            out["ablation"] = {"heads": ablation_heads(spec), "hidden_change": number(change, 4),
                               "baseline": {"probe": probe_json(base_maps, req)}}  # fmt: skip
    return out


def decode_translation(entry: Entry, text: str, beam: int) -> dict:
    """Decode ``text`` (model lock held): ids, labels, the per-step maps and the output text."""
    loaded = entry.loaded
    model = loaded.full_model
    if loaded.tokenizer is not None:  # a qkv.models translator
        from qkv.inspect.translation import piece_labels, record_translation

        tok = loaded.tokenizer
        S = len(tok.encode(text)[: model.cfg.max_len // 2 - 1]) + 1
        # the guards of qkv translate: the page shows what the command writes, no stutter
        tr = translator_of(loaded)
        hyp, steps, beams = record_translation(model, tok, text, beam=beam,
                                               max_new_tokens=target_limit(S),
                                               no_repeat_ngram=tr.no_repeat_ngram,
                                               repeat_guard=tr.repeat_guard)  # fmt: skip
        ids = tok.encode(text)[: model.cfg.max_len // 2 - 1] + [tok.eos_id]
        tgt_in = [model.cfg.bos_id, *hyp[:-1]]
        return {"src": ids, "tgt_in": tgt_in, "steps": steps, "text": tok.decode(hyp),
                "source_tokens": piece_labels(tok, ids), "inputs": piece_labels(tok, tgt_in),
                "produced": piece_labels(tok, hyp),
                "beams": [{"text": tok.decode(b), "score": number(sc, 4), "chosen": b == hyp}
                          for b, sc in beams]}  # fmt: skip
    from qkv.inspect.tiny import simple_tokenize, token_id  # the random tiny seq2seq

    src_tokens = ["<s>", *simple_tokenize(text), "</s>"]  # the caller cut it to its limit
    src = [token_id(t, model.vocab_size) for t in src_tokens]
    with torch.no_grad(), recording(model) as rec:
        out = model.greedy(torch.tensor([src]), max_len=target_limit(len(src)))
    ids = out[0].tolist()  # <s>, y1, ..., (</s>): the decoder was fed ids[:-1]
    label = lambda t: "</s>" if t == 4 else f"#{t}"  # noqa: E731  random ids: no vocabulary
    inputs = ["<s>"] + [label(t) for t in ids[1:-1]]
    produced = [label(t) for t in ids[1:]]
    steps = label_cross_queries(rec.steps(tokens=inputs, source_tokens=src_tokens), produced)
    text = " ".join(t for t in produced if t != "</s>")
    return {"src": src, "tgt_in": ids[:-1], "steps": steps, "text": text,
            "source_tokens": src_tokens, "inputs": inputs, "produced": produced}  # fmt: skip


def translator_limit(model: nn.Module) -> int:
    """Source tokens a qkv translator may read (:func:`translate_limit` of its encoder,
    decoder self- and cross-attention heads)."""
    heads = {"self": 0, "dec": 0, "cross": 0}
    for name, m in attention_modules(model):
        key = "cross" if "cross" in name else "dec" if "decoder" in name else "self"
        heads[key] += m.n_heads
    return translate_limit(heads["self"], heads["dec"], heads["cross"])


def _translation(entry: Entry, req: AttentionRequest, text: str) -> dict:
    loaded = entry.loaded
    if not entry.translator or loaded.full_model is None:
        raise BadRequest(f"model {entry.name!r} does not translate; pick a translator")
    model = loaded.full_model
    encode = loaded.encode
    if loaded.tokenizer is None:  # random: the source is <s> words </s>
        from qkv.inspect.tiny import simple_tokenize

        encode = lambda t: (["<s>", *simple_tokenize(t), "</s>"], ())  # noqa: E731
    limit = translator_limit(model)
    # a text longer than the maps' limit: translated piece by piece, as qkv translate does
    pieces, cut = split_source(encode, text, limit)
    shown = min(req.piece, len(pieces) - 1)
    text, _, _, cut_piece = cut_to_limit(encode, pieces[shown], limit)
    pieces[shown] = text
    beam = req.beam if loaded.tokenizer is not None else 1
    layer, module, spec = _selection(model, req)

    def joined(shown_text: str, beam: int) -> list[str]:  # every piece's translation
        return [shown_text if i == shown else decode_translation(entry, p, beam)["text"]
                for i, p in enumerate(pieces)]  # fmt: skip

    with torch.no_grad(), heads_off(model, spec):
        d = decode_translation(entry, text, beam)
        outputs = joined(d["text"], beam)
        merged = merge_steps(d["steps"])
        src, tgt = torch.tensor([d["src"]]), torch.tensor([d["tgt_in"]])
        with grab_call(model, layer) as calls:
            model(src, tgt)  # teacher-forced replay of the output: the step-by-step inputs
        kind = merged.kinds[merged.layers.index(layer)]
        enc = kind == "self" and not layer.startswith("decoder")
        q_tok = d["source_tokens"] if enc else d["inputs"] if kind != "cross" else d["produced"]
        k_tok = d["source_tokens"] if (enc or kind == "cross") else d["inputs"]
        step = step_detail(module, calls[0], req.head, q_tok, k_tok)
    out = {
        "limit": limit, "text": text, "tokens": d["source_tokens"], "truncated": cut or cut_piece,
        **maps_fields(merged, req),
        "step": {"layer": layer, **step},
        "translation": {"source_tokens": d["source_tokens"], "target_tokens": d["produced"],
                        "decoder_inputs": d["inputs"], "text": " ".join(outputs), "beam": beam,
                        "steps": len(d["steps"]), "beams": d.get("beams", []),
                        "length_penalty": 1.0, **pieces_fields(pieces, outputs, shown),
                        **notes(loaded, " ".join(pieces))},
    }  # fmt: skip
    if beam > 1:
        with torch.no_grad(), heads_off(model, spec):
            greedy = decode_translation(entry, text, 1)["text"]
            out["translation"]["greedy_text"] = " ".join(joined(greedy, 1))
    if spec:
        with torch.no_grad():
            base = decode_translation(entry, text, beam)
            before = joined(base["text"], beam)
        out["ablation"] = {"heads": ablation_heads(spec),
                           "baseline": {"translation": " ".join(before),
                                        "probe": probe_json(merge_steps(base["steps"]), req)}}  # fmt: skip
    return out


def attention(entry: Entry, req: AttentionRequest) -> dict:
    """Answer one request with the model of ``entry`` (loaded); holds the model's lock."""
    text = req.text[:MAX_TEXT_CHARS]
    cut_chars = len(req.text) > MAX_TEXT_CHARS
    lock = entry.lock if entry.lock is not None else nullcontext()
    with lock, torch.no_grad():
        if entry.loaded.hf is not None:  # a transformers model: qkv.hf captures its maps
            from qkv.apps.serve.compute_hf import hf_attention

            out = hf_attention(entry, req, text)
        else:
            out = (_translation if req.translate else _encoder)(entry, req, text)
    out.setdefault("step_unavailable", None)  # why the step-by-step view is not offered
    limit = out.pop("limit")
    out["truncated"] = bool(out["truncated"] or cut_chars)
    out["notice"] = (f"The text was cut to its first {len(out['tokens'])} tokens (limit {limit})."
                     if out["truncated"] else None)  # fmt: skip
    if "translation" in out and out["translation"]["pieces"]:
        out["notice"] = split_notice(out["translation"], limit, out["truncated"])
    return {"model": entry.name, "random": entry.random, "limit": limit, **out}
