"""One weights file for a model's graphs, in the precision the package ships.

``torch.onnx.export`` writes each graph with its own fp32 copy of the weights. The shipped
translators store fp16 weights that ``qkv.translate.load`` widens to fp32, so every such
initializer is exactly an fp16 number: :func:`shared_fp16` stores it once as fp16 in a
shared external-data file (the same bytes for every graph that uses it: the page downloads
them once) and puts a ``Cast`` to fp32 in its place, so the graphs compute with the very
fp32 values PyTorch uses. Initializers that are not exact fp16 (the sinusoidal table) or
small stay in the graph as they are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["shared_fp16"]

SMALL = 4096  # elements: smaller initializers stay inside the graph


def shared_fp16(graphs: dict[str, Path], folder: Path, data_name: str) -> int:
    """Rewrite each fp32 graph ``graphs[kind]`` as ``folder/<kind>.onnx`` over one external
    data file ``folder/data_name``; the fp32 files are removed. Returns that file's bytes."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    blobs: dict[str, tuple[int, int]] = {}  # sha256 of the fp16 bytes -> (offset, length)
    data = bytearray()
    for kind, path in graphs.items():
        model = onnx.load(str(path))
        graph = model.graph
        keep, casts = [], []
        for init in graph.initializer:
            arr = numpy_helper.to_array(init)
            half = arr.astype(np.float16) if arr.dtype == np.float32 else None
            if half is None or arr.size < SMALL or not np.array_equal(half.astype(np.float32), arr):
                keep.append(init)
                continue
            raw = half.tobytes()
            key = hashlib.sha256(raw).hexdigest()
            if key not in blobs:
                data.extend(b"\0" * (-len(data) % 64))  # aligned, as ONNX Runtime maps them
                blobs[key] = (len(data), len(raw))
                data.extend(raw)
            offset, length = blobs[key]
            t = onnx.TensorProto(name=init.name + ".fp16", data_type=onnx.TensorProto.FLOAT16,
                                 dims=list(arr.shape), data_location=onnx.TensorProto.EXTERNAL)  # fmt: skip
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            keep.append(t)
            casts.append(helper.make_node("Cast", [t.name], [init.name], to=onnx.TensorProto.FLOAT,
                                          name=f"widen/{init.name}"))  # fmt: skip
        del graph.initializer[:]
        graph.initializer.extend(keep)
        nodes = casts + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.save(model, str(folder / f"{kind}.onnx"))
        path.unlink()
    tmp = folder / (data_name + ".part")
    tmp.write_bytes(bytes(data))
    tmp.replace(folder / data_name)
    return len(data)
