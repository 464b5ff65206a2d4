"""Convert a :class:`qkv.models.Seq2SeqTransformer` exactly into CTranslate2's ``TransformerSpec``.

The spec is a tree of named weights; this module is the table that maps ours onto theirs:

==============================================  ================================================
CTranslate2 (``spec.``)                          qkv (``model.``)
==============================================  ================================================
``encoder.embeddings[0].weight``                 ``encoder.embed.embedding.weight``
``encoder.position_encodings.encodings``         our position table (sinusoidal sin/cos
                                                 interleaved, or the learned one)
``encoder.layer[i].self_attention.layer_norm``   ``encoder.layers[i].res_attn.norm``
``encoder.layer[i].self_attention.linear[0]``    ``w_q``, ``w_k``, ``w_v`` fused (rows q | k | v)
``encoder.layer[i].self_attention.linear[1]``    ``w_o``
``encoder.layer[i].ffn.layer_norm``              ``encoder.layers[i].res_ffn.norm``
``encoder.layer[i].ffn.linear_0`` / ``linear_1``  ``ffn.w_1`` / ``ffn.w_2``
``encoder.layer_norm``                           ``encoder.norm``
``decoder.layer[i].attention.linear[0]``         cross-attention ``w_q``
``decoder.layer[i].attention.linear[1]``         cross-attention ``w_k``, ``w_v`` fused
``decoder.layer[i].attention.linear[2]``         cross-attention ``w_o``
``decoder.projection``                           ``decoder.out`` (tied to the embedding)
==============================================  ================================================

Both scale the embeddings by ``√d_model`` before adding positions; the layer-norm epsilon is
PyTorch's 1e-5 (CTranslate2's default is 1e-6, so it is set in the config). Token ids are
written as the strings ``"<blank>" "<s>" "</s>"`` for pad/bos/eos and ``"t{i}"`` otherwise,
so a list of ids converts to tokens one to one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def available() -> str | None:
    """``None`` when ctranslate2 can be imported, else the reason it cannot."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        return f"ctranslate2 is not installed ({e}); pip install 'qkv[bench]'"
    return None


def vocabulary(cfg, size: int | None = None) -> list[str]:
    """Token strings for ids ``0 .. size-1`` (default: the target vocabulary)."""
    special = {cfg.pad_id: "<blank>", cfg.bos_id: "<s>", cfg.eos_id: "</s>"}
    size = cfg.tgt_vocab_size if size is None else size
    return [special.get(i, f"t{i}") for i in range(size)]


def tokens(ids: list[int], vocab: list[str]) -> list[str]:
    return [vocab[i] for i in ids]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().contiguous().numpy()


def _linear(spec, *linears) -> None:
    spec.weight = _np(torch.cat([lin.weight for lin in linears]))
    if linears[0].bias is not None:
        spec.bias = _np(torch.cat([lin.bias for lin in linears]))


def _norm(spec, ln) -> None:
    spec.gamma, spec.beta = _np(ln.weight), _np(ln.bias)


def _positions(embedder, n: int, d: int) -> np.ndarray:
    from qkv.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

    pos = embedder.position
    if isinstance(pos, SinusoidalPositionalEncoding):
        return _np(pos.table(n))  # (n, d_model)
    if isinstance(pos, LearnedPositionalEmbedding):
        return _np(pos.embedding.weight[:n])
    raise ValueError(f"CTranslate2 conversion supports sinusoidal/learned positions, got {pos}")


def to_spec(model):
    """The ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    if cfg.n_kv_heads not in (None, cfg.n_heads):
        raise ValueError("CTranslate2's TransformerSpec has no grouped-query encoder-decoder")
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads,
        pre_norm=cfg.norm_first, activation=act[cfg.activation],
    )  # fmt: skip
    spec.config.layer_norm_epsilon = model.encoder.layers[0].res_attn.norm.eps
    enc, dec = model.encoder, model.decoder
    spec.encoder.embeddings[0].weight = _np(enc.embed.embedding.weight)
    spec.encoder.position_encodings.encodings = _positions(enc.embed, cfg.max_len, cfg.d_model)
    for s, layer in zip(spec.encoder.layer, enc.layers):
        a = layer.self_attn
        _linear(s.self_attention.linear[0], a.w_q, a.w_k, a.w_v)
        _linear(s.self_attention.linear[1], a.w_o)
        _norm(s.self_attention.layer_norm, layer.res_attn.norm)
        _linear(s.ffn.linear_0, layer.ffn.w_1)
        _linear(s.ffn.linear_1, layer.ffn.w_2)
        _norm(s.ffn.layer_norm, layer.res_ffn.norm)
    spec.decoder.embeddings.weight = _np(dec.embed.embedding.weight)
    spec.decoder.position_encodings.encodings = _positions(dec.embed, cfg.max_len, cfg.d_model)
    for s, layer in zip(spec.decoder.layer, dec.layers):
        a, c = layer.self_attn, layer.cross_attn
        _linear(s.self_attention.linear[0], a.w_q, a.w_k, a.w_v)
        _linear(s.self_attention.linear[1], a.w_o)
        _norm(s.self_attention.layer_norm, layer.res_self.norm)
        _linear(s.attention.linear[0], c.w_q)
        _linear(s.attention.linear[1], c.w_k, c.w_v)
        _linear(s.attention.linear[2], c.w_o)
        _norm(s.attention.layer_norm, layer.res_cross.norm)
        _linear(s.ffn.linear_0, layer.ffn.w_1)
        _linear(s.ffn.linear_1, layer.ffn.w_2)
        _norm(s.ffn.layer_norm, layer.res_ffn.norm)
    if cfg.norm_first:
        _norm(spec.encoder.layer_norm, enc.norm)
        _norm(spec.decoder.layer_norm, dec.norm)
    _linear(spec.decoder.projection, dec.out)
    spec.register_source_vocabulary(vocabulary(cfg, cfg.src_vocab_size))
    spec.register_target_vocabulary(vocabulary(cfg))
    return spec


def convert(model, out_dir: str | Path) -> Path:
    """Write ``model`` as a CTranslate2 model directory (float32 weights); return its path."""
    spec = to_spec(model)
    spec.validate()
    spec.optimize(quantization=None)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    return Path(out_dir)
