"""``POST /api/attention`` for a transformers model directory (:mod:`qkv.inspect.hf_models`).

The maps, head statistics, pronoun probe, switching heads off (:func:`qkv.hf.heads_off`:
their output zeroed before the output projection) and, for a seq2seq model, the translation
with its cross-attention are computed as for qkv's own models, from the model's exact
per-head weights (:func:`qkv.hf.capture_attention`). ``beam`` > 1 runs transformers' own beam
search (:func:`qkv.inspect.hf_models.translate_hf`): the answer's ``translation.beams`` is
the table qkv's translators fill (the hypotheses, best first, with their scores and the
chosen one), and the maps are those of the chosen hypothesis, replayed with teacher forcing.
A decoder-only model does not translate (a 400), so it has no beam either.

The step-by-step view replays the chosen module's call from the query, key and value it
handed to the attention function (:mod:`qkv.hf.steps`): Q, K, V, QKᵀ, scaled, mask,
softmax, output, the heads concatenated and the module's own output projection when it has
one; ``check`` is the replay's distance from the module's real output. For a translation the
call is the teacher-forced replay of the output. A call transformers computed itself (see
:mod:`qkv.hf.attention`) is replayed from what it was given, with ``step.fallback`` saying
why transformers ran it; one that cannot be (a mask that is not a tensor or does not fit the
scores, key/value heads that pair with no query head) has ``step`` ``null`` and
``step_unavailable`` saying why.
"""

from __future__ import annotations

import torch

from qkv.apps.serve.answer import (
    ablation_heads,
    ablation_spec,
    choose_layer,
    cut_to_limit,
    maps_fields,
    pieces_fields,
    probe_json,
    split_source,
    step_matrices,
)
from qkv.apps.serve.limits import (
    AttentionRequest,
    BadRequest,
    encoder_limit,
    target_limit,
    translate_limit,
)
from qkv.apps.serve.long import map_limit, position_limit
from qkv.apps.serve.models import Entry
from qkv.capture.page import number
from qkv.hf import attention_modules, heads_off
from qkv.hf.capture import module_kind
from qkv.hf.steps import record_call, walk
from qkv.inspect.hf_models import head_counts, translate_hf

__all__ = ["STEP_UNAVAILABLE", "hf_attention"]

STEP_UNAVAILABLE = ("the module made no attention call in this run, so there is no "
                    "step-by-step replay; the head's exact weights are shown instead.")  # fmt: skip


STEP_NOTE = (
    "Q, K and V as the model hands them to its attention function: after its own "
    "projections, and rotary positions where it uses them"
)


def hf_step(calls, layer: str, kind: str, head: int, q_tokens: list[str], k_tokens: list[str],
            spec: dict[str, list[int]]) -> tuple[dict | None, str | None]:  # fmt: skip
    """``(step, why not)``: the step-by-step JSON of the first recorded call (the shape of
    :func:`qkv.apps.serve.compute.step_detail`), or None and the ``step_unavailable`` text.
    Called inside ``heads_off(spec)``, so the replay zeroes the same heads as the model."""
    if not calls:
        return None, f"{layer}, head {head}: {STEP_UNAVAILABLE}"
    call = calls[0]
    if call.unavailable is not None:
        return None, (f"{layer}, head {head}: transformers computed this call itself "
                      f"({call.fallback}) and it cannot be replayed: {call.unavailable}; the "
                      f"head's exact weights are shown instead.")  # fmt: skip
    w = walk(call, head)
    if w["mask"] is None:
        w["mask"] = torch.ones_like(w["scores"], dtype=torch.bool)
    mats = step_matrices({**w, "x": w["hidden"]}, q_tokens, k_tokens, w["scale"])
    h, d = call.query.shape[1], call.query.shape[-1]
    step = {"layer": layer, "kind": kind, "head": head, "n_heads": h, "d_k": d,
            "d_model": int(w["hidden"].shape[-1]) if w["hidden"] is not None else h * d,
            "scale": number(w["scale"], 6), "matrices": mats, "check": w["check"],
            "head_off": head in spec.get(layer, []), "note": STEP_NOTE,
            "fallback": w["fallback"]}  # fmt: skip
    if w["sink"] is not None:  # gpt-oss: the weights leave sigmoid(sink - lse) to the sink
        step["sink"] = number(w["sink"], 6)
    return step, None


def hf_attention(entry: Entry, req: AttentionRequest, text: str) -> dict:
    """Answer ``req`` with the transformers model of ``entry`` (model lock held)."""
    loaded = entry.loaded
    hf = loaded.hf
    counts = head_counts(loaded)
    enc = {n: h for n, h in counts.items() if "encoder" in n.split(".")}
    if req.translate:
        if hf.kind != "encoder-decoder":  # nothing is generated, so there is no beam either
            raise BadRequest(f"model {entry.name!r} ({hf.kind}) does not translate (nor search "
                             f"with a beam); pick an encoder-decoder model")  # fmt: skip
        cross = {n: h for n, h in counts.items() if n not in enc and _kind(loaded, n) == "cross"}
        dec = sum(counts.values()) - sum(enc.values()) - sum(cross.values())
        limit = translate_limit(sum(enc.values()), dec, sum(cross.values()))
        # a text longer than the maps' limit: translated piece by piece, as qkv translate does
        pieces, cut = split_source(loaded.encode, text, limit)
        shown = min(req.piece, len(pieces) - 1)
        text, tokens, _, cut_piece = cut_to_limit(loaded.encode, pieces[shown], limit)
        pieces[shown], cut = text, cut or cut_piece
        layer = choose_layer(req, counts)
        spec = ablation_spec(req, counts)
        new_tokens = target_limit(len(tokens))

        def joined(shown_text: str, beam: int) -> list[str]:  # every piece's translation
            return [shown_text if i == shown else translate_hf(
                        loaded, p, max_new_tokens=target_limit(len(loaded.encode(p)[0])),
                        beam=beam)["text"] for i, p in enumerate(pieces)]  # fmt: skip

        with heads_off(hf.model, spec):
            d = translate_hf(loaded, text, max_new_tokens=new_tokens, beam=req.beam)
            outputs = joined(d["text"], req.beam)
            greedy = (" ".join(joined(translate_hf(loaded, text, max_new_tokens=new_tokens)["text"], 1))
                      if req.beam > 1 else None)  # fmt: skip
            _, (ids, mask) = loaded.encode(text)
            with record_call(hf.model, layer) as calls:  # teacher-forced replay of the output
                hf.model(input_ids=ids, attention_mask=mask,
                         decoder_input_ids=torch.tensor([d["input_ids"]]))  # fmt: skip
            kind = _kind(loaded, layer)
            src_side = layer in enc  # an encoder layer: source tokens on both sides
            q_tok = (d["source_tokens"] if src_side else d["produced"] if kind == "cross"
                     else d["inputs"])  # fmt: skip
            k_tok = d["source_tokens"] if (src_side or kind == "cross") else d["inputs"]
            step, why = hf_step(calls, layer, "self" if src_side else kind, req.head, q_tok,
                                k_tok, spec)  # fmt: skip
        maps = d["maps"]
        tr = {"source_tokens": d["source_tokens"], "target_tokens": d["produced"],
              "decoder_inputs": d["inputs"], "text": " ".join(outputs), "beam": req.beam,
              "steps": len(d["produced"]), "beams": _beams(loaded, d["beams"]),
              "length_penalty": d["length_penalty"], **pieces_fields(pieces, outputs, shown)}  # fmt: skip
        if greedy is not None:
            tr["greedy_text"] = greedy
        extra = {"translation": tr}
        if spec:
            base = translate_hf(loaded, text, max_new_tokens=new_tokens, beam=req.beam)
            before = joined(base["text"], req.beam)
            extra["ablation"] = {"heads": ablation_heads(spec),
                                 "baseline": {"translation": " ".join(before),
                                              "probe": probe_json(base["maps"], req)}}  # fmt: skip
    else:
        shown = enc if hf.kind == "encoder-decoder" else counts
        limit = encoder_limit(sum(shown.values()))
        positions = position_limit(hf.model, hf)
        if req.long:  # up to 2,048 tokens, or the model's positions (qkv.apps.serve.long)
            limit = map_limit(positions)
        text, tokens, inputs, cut = cut_to_limit(loaded.encode, text, limit)
        layer = choose_layer(req, shown)
        spec = ablation_spec(req, shown)
        with heads_off(hf.model, spec):
            with record_call(hf.model, layer) as calls:
                maps = loaded.maps(*inputs, tokens=tokens)
            hidden = loaded.hidden(*inputs) if spec else None  # (1, T, d)
            kind = "self" if hf.kind == "encoder-decoder" else _kind(loaded, layer)
            step, why = hf_step(calls, layer, kind, req.head, tokens, tokens, spec)
        extra = {"positions": positions}
        if spec:
            base = loaded.hidden(*inputs)  # (1, T, d)
            change = float((hidden - base).norm() / base.norm().clamp_min(1e-12))
            base_maps = loaded.maps(*inputs, tokens=tokens)
            extra["ablation"] = {"heads": ablation_heads(spec),
                                 "hidden_change": number(change, 4),
                                 "baseline": {"probe": probe_json(base_maps, req)}}  # fmt: skip
    return {
        "limit": limit, "text": text, "tokens": tokens, "truncated": cut,
        **maps_fields(maps, req),
        "step": step,
        "step_unavailable": why,
        **extra,
    }  # fmt: skip


def _beams(loaded, beams: list[tuple[list[int], float]]) -> list[dict]:
    """The ``translation.beams`` table: each hypothesis beam search returned, best first (the
    first is the translation), its text, score and tokens (without the start token)."""
    tok = loaded.hf.tokenizer
    return [{"text": tok.decode(ids[1:], skip_special_tokens=True), "score": number(sc, 4),
             "chosen": i == 0, "tokens": tok.convert_ids_to_tokens(ids[1:])}
            for i, (ids, sc) in enumerate(beams)]  # fmt: skip


def _kind(loaded, name: str) -> str:
    """``"cross"``, ``"causal"`` or ``"self"`` of attention module ``name``."""
    return module_kind(name, dict(attention_modules(loaded.hf.model))[name])
