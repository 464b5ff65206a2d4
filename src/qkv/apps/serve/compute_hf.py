"""``POST /api/attention`` for a transformers model directory (:mod:`qkv.inspect.hf_models`).

The maps, head statistics, pronoun probe, switching heads off (:func:`qkv.hf.heads_off`:
their output zeroed before the output projection) and, for a seq2seq model, the greedy
translation with its cross-attention are computed as for qkv's own models, from the model's
exact per-head weights (:func:`qkv.hf.capture_attention`).

The step-by-step view recomputes Q, K and V inside qkv's own attention modules and is not
offered: ``step`` is ``null`` and ``step_unavailable`` gives the reason (the page shows the
head's weights instead). Beam search is not offered either (``beam`` > 1 is a 400): the
captured maps follow one row.
"""

from __future__ import annotations

from qkv.apps.serve.compute import _num, _pick_layer, _probe, _stats, cut_to_limit, maps_json
from qkv.apps.serve.limits import (
    AttentionRequest,
    BadRequest,
    encoder_limit,
    target_limit,
    translate_limit,
)
from qkv.apps.serve.models import Entry
from qkv.hf import heads_off
from qkv.inspect.hf_models import head_counts, translate_hf

__all__ = ["STEP_UNAVAILABLE", "hf_attention"]

STEP_UNAVAILABLE = ("The step-by-step view recomputes Q, K and V inside qkv's own attention "
                    "modules; this transformers model shows its exact attention weights "
                    "instead.")  # fmt: skip


def _check_head(req: AttentionRequest, names: list[str], counts: dict[str, int]) -> str:
    layer = _pick_layer(names, req)
    if not 0 <= req.head < counts[layer]:
        raise BadRequest(f"head must be in [0, {counts[layer] - 1}], got {req.head}")
    return layer


def _ablation_spec(req: AttentionRequest, counts: dict[str, int]) -> dict[str, list[int]]:
    spec: dict[str, list[int]] = {}
    for layer, head in req.ablate:
        if layer not in counts:
            raise BadRequest(f"ablate: no layer named {layer!r}; have {list(counts)}")
        if not 0 <= head < counts[layer]:
            raise BadRequest(f"ablate: head {head} out of range for {layer!r} "
                             f"({counts[layer]} heads)")  # fmt: skip
        spec.setdefault(layer, []).append(head)
    return spec


def hf_attention(entry: Entry, req: AttentionRequest, text: str) -> dict:
    """Answer ``req`` with the transformers model of ``entry`` (model lock held)."""
    loaded = entry.loaded
    hf = loaded.hf
    counts = head_counts(loaded)
    enc = {n: h for n, h in counts.items() if "encoder" in n.split(".")}
    if req.translate:
        if hf.kind != "encoder-decoder":
            raise BadRequest(f"model {entry.name!r} ({hf.kind}) does not translate; "
                             f"pick an encoder-decoder model")  # fmt: skip
        if req.beam > 1:
            raise BadRequest(f"beam must be 1 for a transformers model (greedy decoding), "
                             f"got {req.beam}")  # fmt: skip
        cross = {n: h for n, h in counts.items() if n not in enc and _kind(loaded, n) == "cross"}
        dec = sum(counts.values()) - sum(enc.values()) - sum(cross.values())
        limit = translate_limit(sum(enc.values()), dec, sum(cross.values()))
        text, tokens, _, cut = cut_to_limit(loaded.encode, text, limit)
        layer = _check_head(req, list(counts), counts)
        spec = _ablation_spec(req, counts)
        with heads_off(hf.model, spec):
            d = translate_hf(loaded, text, max_new_tokens=target_limit(len(tokens)))
        maps = d["maps"]
        extra = {"translation": {"source_tokens": d["source_tokens"],
                                 "target_tokens": d["produced"], "decoder_inputs": d["inputs"],
                                 "text": d["text"], "beam": 1, "steps": len(d["produced"])}}  # fmt: skip
        if spec:
            base = translate_hf(loaded, text, max_new_tokens=target_limit(len(tokens)))
            extra["ablation"] = {"heads": [[k, h] for k, hs in spec.items() for h in hs],
                                 "baseline": {"translation": base["text"],
                                              "probe": _probe(base["maps"], req)}}  # fmt: skip
    else:
        shown = enc if hf.kind == "encoder-decoder" else counts
        limit = encoder_limit(sum(shown.values()))
        text, tokens, inputs, cut = cut_to_limit(loaded.encode, text, limit)
        layer = _check_head(req, list(shown), shown)
        spec = _ablation_spec(req, shown)
        with heads_off(hf.model, spec):
            maps = loaded.maps(*inputs, tokens=tokens)
            hidden = loaded.hidden(*inputs) if spec else None  # (1, T, d)
        extra = {}
        if spec:
            base = loaded.hidden(*inputs)  # (1, T, d)
            change = float((hidden - base).norm() / base.norm().clamp_min(1e-12))
            base_maps = loaded.maps(*inputs, tokens=tokens)
            extra["ablation"] = {"heads": [[k, h] for k, hs in spec.items() for h in hs],
                                 "hidden_change": _num(change, 4),
                                 "baseline": {"probe": _probe(base_maps, req)}}  # fmt: skip
    return {
        "limit": limit, "text": text, "tokens": tokens, "truncated": cut,
        "layers": maps_json(maps), "stats": _stats(maps), "probe": _probe(maps, req),
        "step": None, "step_unavailable": f"{layer}, head {req.head}: {STEP_UNAVAILABLE}",
        **extra,
    }  # fmt: skip


def _kind(loaded, name: str) -> str:
    """``"cross"``, ``"causal"`` or ``"self"`` of attention module ``name``."""
    from qkv.hf import attention_modules
    from qkv.hf.capture import module_kind

    return module_kind(name, dict(attention_modules(loaded.hf.model))[name])
