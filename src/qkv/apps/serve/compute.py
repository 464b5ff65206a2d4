"""The one computation behind ``POST /api/attention``: a model and a text → one JSON answer.

Everything the page shows comes from :func:`attention`: the per-head maps of every layer,
the step-by-step intermediates of one (layer, head) (``qkv.functional.attention_steps`` on
the module's real inputs), head statistics, the pronoun probe, the translation with its
per-step maps, and — when heads are switched off — the baseline to compare with. The
caller holds the model's lock (:class:`qkv.apps.serve.models.Entry`).

Shapes: a layer's ``weights`` are ``[h][Tq][Tk]``; for a translation ``Tq`` runs over the
decoding steps (row ``s`` of a decoder layer is step ``s``), so the page slices rows for
its step slider.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from qkv.apps.serve.limits import (
    DECIMALS,
    MAX_TEXT_CHARS,
    STEP_DIMS,
    AttentionRequest,
    BadRequest,
    encoder_limit,
    target_limit,
    translate_limit,
)
from qkv.apps.serve.models import Entry
from qkv.attention import MultiHeadAttention
from qkv.functional import attention_steps
from qkv.inspect import AttentionMaps, capture, head_stats, heads_off, merge_steps, pronoun_probe
from qkv.inspect.capture import attention_modules, recording
from qkv.inspect.translation import label_cross_queries
from qkv.positional import ALiBi, RotaryEmbedding

__all__ = ["attention", "cut_to_limit", "maps_json", "step_detail"]

Call = tuple[tuple, dict, Tensor]  # a module call: args, kwargs, output


def _round(t: Tensor, decimals: int = DECIMALS) -> list:
    """Nested lists with ``decimals`` decimals; non-finite values become ``None``."""
    t = t.detach().double().round(decimals=decimals)
    if bool(torch.isfinite(t).all()):
        return t.tolist()
    return [_round(r, decimals) for r in t] if t.dim() > 1 else [
        float(x) if math.isfinite(x) else None for x in t.tolist()
    ]  # fmt: skip


def _num(x: float | None, decimals: int = DECIMALS) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), decimals)


def cut_to_limit(
    encode: Callable[[str], tuple[list[str], tuple]], text: str, limit: int
) -> tuple[str, list[str], tuple, bool]:
    """The longest prefix of ``text`` (whole words, else characters) that ``encode``s to at
    most ``limit`` tokens: ``(text, tokens, inputs, cut)``. About log₂(words) encodes."""
    tokens, inputs = encode(text)
    if len(tokens) <= limit:
        return text, tokens, inputs, False
    units = re.findall(r"\S+\s*", text)
    if len(units) < 2:
        units = list(text)
    lo, hi = 1, len(units) - 1  # find the largest n with encode(units[:n]) within the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode("".join(units[:mid]))[0]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if len(units) > 1 and re.match(r"\S+\s*$", units[0]) and len(encode(units[0])[0]) > limit:
        return cut_to_limit(encode, units[0][: max(1, len(units[0]) // 2)], limit)
    short = "".join(units[:lo]).rstrip()
    tokens, inputs = encode(short)
    return short, tokens, inputs, True


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


def _matrix(key: str, t: Tensor, rows: list[str], cols: list[str] | None = None) -> dict:
    """A 2-D tensor as ``{"key", "shape", "rows", "cols", "values"}``; at most STEP_DIMS
    columns of a feature matrix are sent (``shape`` keeps the full size)."""
    full = list(t.shape)
    if cols is None:  # feature dimensions
        t = t[:, :STEP_DIMS]
        cols = [str(i) for i in range(t.shape[1])]
    return {"key": key, "shape": full, "rows": rows, "cols": cols, "values": _round(t)}


# the step-by-step view's matrices in order, with what labels their rows (and columns):
# "q"/"k" rows are the query/key tokens; a square one has key columns, the rest features
_STEPS = (("x", "q", False), ("context", "k", False), ("q", "q", False), ("k", "k", False),
          ("v", "k", False), ("scores", "q", True), ("scaled", "q", True), ("mask", "q", True),
          ("masked", "q", True), ("weights", "q", True), ("output", "q", False),
          ("concat", "q", False), ("wo", "q", False))  # fmt: skip


def step_matrices(t: dict[str, Tensor | None], q_tokens: list[str],
                  k_tokens: list[str]) -> list[dict]:  # fmt: skip
    """The ``matrices`` of a step answer from 2-D tensors by key (see ``_STEPS``); a key that
    is missing or None is left out (no cross context, no output projection)."""
    tokens = {"q": q_tokens, "k": k_tokens}
    return [_matrix(key, t[key].double() if key == "mask" else t[key], tokens[rows],
                    k_tokens if square else None)
            for key, rows, square in _STEPS if t.get(key) is not None]  # fmt: skip


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
        q_tokens, k_tokens,
    )  # fmt: skip
    return {
        "kind": kind, "head": head, "n_heads": module.n_heads, "d_k": module.d_k,
        "d_model": module.d_model, "scale": _num(s.scale, 6), "matrices": mats,
        "check": float((y - real).abs().max()) if real.shape == y.shape else None,
        "head_off": bool(module.head_mask is not None and float(module.head_mask[head]) == 0.0),
    }  # fmt: skip


def maps_json(maps: AttentionMaps) -> list[dict]:
    """The ``layers`` field: name, kind, heads, tokens and ``weights [h][Tq][Tk]``."""
    return [
        {
            "name": maps.layers[i],
            "kind": maps.kinds[i],
            "heads": maps.heads[i],
            "q_tokens": maps.q_tokens[i],
            "k_tokens": maps.k_tokens[i],
            "weights": _round(maps.weights[i]),
        }  # fmt: skip
        for i in range(len(maps))
    ]


def _stats(maps: AttentionMaps) -> list[dict]:
    return [{k: (_num(v) if isinstance(v, float) else v) for k, v in s.to_dict().items()}
            for s in head_stats(maps)]  # fmt: skip


def _probe(maps: AttentionMaps, req: AttentionRequest) -> dict | None:
    """Top heads of the pronoun probe and a verdict that says so when no head decides."""
    if req.probe_token is None:
        return None
    try:
        rows = pronoun_probe(maps, req.probe_token, req.probe_candidates)
    except ValueError as err:
        return {"error": str(err), "rows": []}
    deciding = [r for r in rows if r.margin >= 0.1 and r.scores[r.best] >= 0.2]
    votes: dict[str, int] = {}
    for r in deciding:
        votes[r.best] = votes.get(r.best, 0) + 1
    return {
        "token": req.probe_token, "candidates": req.probe_candidates,
        "rows": [{"layer": r.layer, "head": r.head, "best": r.best, "margin": _num(r.margin),
                  "scores": {c: _num(v) for c, v in r.scores.items()}} for r in rows[:12]],
        "deciding": len(deciding), "votes": votes, "n_heads": len(rows),
    }  # fmt: skip


def _ablation_spec(model: nn.Module, pairs: list[tuple[str, int]]) -> dict[str, list[int]]:
    mods = dict(attention_modules(model))
    spec: dict[str, list[int]] = {}
    for layer, head in pairs:
        if layer not in mods:
            raise BadRequest(f"ablate: no layer named {layer!r}; have {list(mods)}")
        if not 0 <= head < mods[layer].n_heads:
            raise BadRequest(f"ablate: head {head} out of range for {layer!r} "
                             f"({mods[layer].n_heads} heads)")  # fmt: skip
        spec.setdefault(layer, []).append(head)
    return spec


def _pick_layer(names: list[str], req: AttentionRequest) -> str:
    if req.layer is None:  # default: the last cross-attention layer when translating
        cross = [n for n in names if "cross" in n]
        return cross[-1] if req.translate and cross else names[0]
    if req.layer not in names:
        raise BadRequest(f"layer must be one of {names}, got {req.layer!r}")
    return req.layer


def _selection(model, req: AttentionRequest):
    """The request's layer (name, module) and its head switches, checked against the model."""
    modules = attention_modules(model)
    layer = _pick_layer([n for n, _ in modules], req)
    module = dict(modules)[layer]
    if not 0 <= req.head < module.n_heads:
        raise BadRequest(f"head must be in [0, {module.n_heads - 1}], got {req.head}")
    return layer, module, _ablation_spec(model, req.ablate)


def _encoder(entry: Entry, req: AttentionRequest, text: str) -> dict:
    loaded = entry.loaded
    model = loaded.model
    limit = encoder_limit(sum(m.n_heads for _, m in attention_modules(model)))
    text, tokens, inputs, cut = cut_to_limit(loaded.encode, text, limit)
    layer, module, spec = _selection(model, req)
    with torch.no_grad():
        with heads_off(model, spec):
            with grab_call(model, layer) as calls, recording(model) as rec:
                hidden = loaded.hidden(*inputs)  # (1, T, d)
            step = step_detail(module, calls[0], req.head, tokens, tokens)
        maps = rec.steps(tokens)[0]
        out = {"limit": limit, "text": text, "tokens": tokens, "truncated": cut, "layers": maps_json(maps),
               "stats": _stats(maps), "probe": _probe(maps, req),
               "step": {"layer": layer, **step}}  # fmt: skip
        if spec:
            base_maps = capture(model, *inputs, tokens=tokens)
            base = loaded.hidden(*inputs)
            change = float((hidden - base).norm() / base.norm().clamp_min(1e-12))
            out["ablation"] = {"heads": [[k, h] for k, hs in spec.items() for h in hs],
                               "hidden_change": _num(change, 4),
                               "baseline": {"probe": _probe(base_maps, req)}}  # fmt: skip
    return out


def _decode(entry: Entry, text: str, beam: int) -> dict:
    """Decode ``text`` (model lock held): ids, labels, the per-step maps and the output text."""
    loaded = entry.loaded
    model = loaded.full_model
    if loaded.tokenizer is not None:  # a qkv.models translator
        from qkv.inspect.translation import piece_labels, record_translation
        from qkv.translate import NO_REPEAT_NGRAM

        tok = loaded.tokenizer
        S = len(tok.encode(text)[: model.cfg.max_len // 2 - 1]) + 1
        # the repetition guard of qkv translate: the page shows what the command writes
        hyp, steps, beams = record_translation(model, tok, text, beam=beam,
                                               max_new_tokens=target_limit(S),
                                               no_repeat_ngram=NO_REPEAT_NGRAM)  # fmt: skip
        ids = tok.encode(text)[: model.cfg.max_len // 2 - 1] + [tok.eos_id]
        tgt_in = [model.cfg.bos_id, *hyp[:-1]]
        return {"src": ids, "tgt_in": tgt_in, "steps": steps, "text": tok.decode(hyp),
                "source_tokens": piece_labels(tok, ids), "inputs": piece_labels(tok, tgt_in),
                "produced": piece_labels(tok, hyp),
                "beams": [{"text": tok.decode(b), "score": _num(sc, 4), "chosen": b == hyp}
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


def _translation(entry: Entry, req: AttentionRequest, text: str) -> dict:
    loaded = entry.loaded
    if not entry.translator or loaded.full_model is None:
        raise BadRequest(f"model {entry.name!r} does not translate; pick a translator")
    model = loaded.full_model
    encode = loaded.encode
    if loaded.tokenizer is None:  # random: the source is <s> words </s>
        from qkv.inspect.tiny import simple_tokenize

        encode = lambda t: (["<s>", *simple_tokenize(t), "</s>"], ())  # noqa: E731
    heads = {"self": 0, "dec": 0, "cross": 0}
    for name, m in attention_modules(model):
        key = "cross" if "cross" in name else "dec" if "decoder" in name else "self"
        heads[key] += m.n_heads
    limit = translate_limit(heads["self"], heads["dec"], heads["cross"])
    text, _, _, cut = cut_to_limit(encode, text, limit)
    beam = req.beam if loaded.tokenizer is not None else 1
    layer, module, spec = _selection(model, req)
    with torch.no_grad(), heads_off(model, spec):
        d = _decode(entry, text, beam)
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
        "limit": limit, "text": text, "tokens": d["source_tokens"], "truncated": cut, "layers": maps_json(merged),
        "stats": _stats(merged), "probe": _probe(merged, req),
        "step": {"layer": layer, **step},
        "translation": {"source_tokens": d["source_tokens"], "target_tokens": d["produced"],
                        "decoder_inputs": d["inputs"], "text": d["text"], "beam": beam,
                        "steps": len(d["steps"]), "beams": d.get("beams", []),
                        "length_penalty": 1.0, **_warnings(loaded, text)},
    }  # fmt: skip
    if beam > 1:
        with torch.no_grad(), heads_off(model, spec):
            out["translation"]["greedy_text"] = _decode(entry, text, 1)["text"]
    if spec:
        with torch.no_grad():
            base = _decode(entry, text, beam)
        out["ablation"] = {"heads": [[k, h] for k, hs in spec.items() for h in hs],
                           "baseline": {"translation": base["text"],
                                        "probe": _probe(merge_steps(base["steps"]), req)}}  # fmt: skip
    return out


def _warnings(loaded, text: str) -> dict:
    """``warnings``: why ``text`` is far from a qkv translator's training data (codes with
    their numbers; the page says them in the reader's language), and ``note``: the same in
    English for API clients, or ``None``."""
    if loaded.tokenizer is None:  # the random tiny model: nothing was learned from any data
        return {"warnings": [], "note": None}
    from qkv.translate import source_warnings, warning_text

    found = source_warnings(loaded.tokenizer, text)
    return {"warnings": found, "note": " ".join(map(warning_text, found)) or None}


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
    return {"model": entry.name, "random": entry.random, "limit": limit, **out}
