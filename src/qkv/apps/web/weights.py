"""One weights file for a model's graphs, in the precision the package ships.

``torch.onnx.export`` writes each graph with its own fp32 copy of the weights. The shipped
translators store fp16 weights that ``qkv.translate.load`` widens to fp32, so every such
initializer is exactly an fp16 number: :func:`shared_fp16` stores it once as fp16 in a
shared external-data file (the same bytes for every graph that uses it: the page downloads
them once) and puts a ``Cast`` to fp32 in its place, so the graphs compute with the very
fp32 values PyTorch uses. Other large initializers (MiniLM's fp32 weights, the sinusoidal
table) go into the same file in fp32; small ones stay in the graph.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["shared_weights"]

SMALL = 4096  # elements: smaller initializers stay inside the graph


def shared_weights(graphs: dict[str, Path], folder: Path, data_name: str) -> int:
    """Rewrite each fp32 graph ``graphs[role]`` as ``folder/<role>.onnx`` over one external
    data file ``folder/data_name`` (fp16 where that is exact, else fp32); the fp32 files are
    removed. Returns that file's bytes."""
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
            if arr.dtype != np.float32 or arr.size < SMALL:
                keep.append(init)
                continue
            half = arr.astype(np.float16)
            exact = bool(np.array_equal(half.astype(np.float32), arr))
            raw = (half if exact else arr).tobytes()
            key = hashlib.sha256(raw).hexdigest()
            if key not in blobs:
                data.extend(b"\0" * (-len(data) % 64))  # aligned, as ONNX Runtime maps them
                blobs[key] = (len(data), len(raw))
                data.extend(raw)
            offset, length = blobs[key]
            dtype = onnx.TensorProto.FLOAT16 if exact else onnx.TensorProto.FLOAT
            t = onnx.TensorProto(name=init.name + (".fp16" if exact else ""), data_type=dtype,
                                 dims=list(arr.shape), data_location=onnx.TensorProto.EXTERNAL)  # fmt: skip
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            keep.append(t)
            if exact:
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
