"""Decode attention at memory speed: a few queries over a long GQA KV cache, against the peers.

    python bench/decode_attention.py              # the full grid (~10 min on 2 cores)
    python bench/decode_attention.py --quick      # Tk in {1024, 16384}, Tq = 1
    python bench/decode_attention.py --Tk 65536 --Tq 1 --dtypes bf16 --threads 2

q ``(1, 32, Tq, 128)`` over a cache k, v ``(1, 8, Tk, 128)`` (GQA 4:1, no mask: every query
sees every key), fp32 and bf16, 1 and 2 threads. Side by side, interleaved (each round calls
every method once; the best round counts):

- ``qkv auto``: :func:`qkv.functional.scaled_dot_product_attention` as a user calls it
  (dispatch included; the path it takes is printed);
- ``torch gqa``: ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``;
- ``torch rows``: the same on the grouped-rows layout (the 4 query heads of one kv head as
  4·Tq query rows of one head, q viewed as ``(1, 8, 4·Tq, 128)``; no copy);
- ``onnxruntime``: ONNX ``Attention`` (opset 23), the model built here with onnx.helper
  (the GQA layout if it runs, else grouped rows; checked against torch before timing);
- ``openvino``: ``ScaledDotProductAttention`` (opset 13), grouped rows, f32 precision hint
  for fp32 inputs, bf16 tensors for bf16 (checked against torch before timing).

A peer that is not installed or cannot run a case is skipped with the reason printed.

``--dtypes int8``: qkv reads an int8 cache (``qkv.KVCache(dtype=torch.int8)``: int8 rows and
a scale each, through :func:`qkv.kernels.decode.decode_attention`), fp32 queries; the peers
run fp32 on the same (dequantized) values, what a user without an int8 cache reads. Its
bandwidth fraction counts the int8 bytes. The targets are checked on fp32 and bf16 only.

Every result is also given as a fraction of the machine's read bandwidth, measured in the same
run at the same thread count: ``sum`` over a 1 GiB fp32 tensor that has been written first (a
fresh ``torch.empty`` maps the kernel's shared zero page and reads at about twice the true
speed), timed inside each case's interleaved rounds like one more method, because a shared
machine's bandwidth drifts from minute to minute. Beside it, the same tensor through a plain
read loop that prefetches ahead (``bench/read_peak.cpp``, built on first use): the streaming
limit a kernel can reach, and with it the most any method reading K + V once could be ahead
of the fastest peer ("limit vs peer"). Bytes moved = K + V (q and the output are a few KiB).
K and V sit in a ``qkv.KVCache`` as a generating model holds them (2 MiB pages from 16 MiB up,
where Linux offers them), the read buffer on the same kind of pages; every method reads the
same tensors. ``--pages 4k``: plain tensors on 4 KiB pages instead.
Writes bench/results/decode_attention.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from _measure import machine_header, peak_reader, written  # noqa: E402
from qkv import KVCache, _pages  # noqa: E402
from qkv.cache import dequantize_rows  # noqa: E402
from qkv.functional import explain_dispatch, scaled_dot_product_attention  # noqa: E402
from qkv.kernels.decode import decode_attention  # noqa: E402

H, H_KV, D = 32, 8, 128
G = H // H_KV
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("torch gqa", "torch rows", "onnxruntime", "openvino")
METHODS = ("qkv auto", *PEERS)


def cached(k: torch.Tensor, v: torch.Tensor, huge: bool,
           dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """k, v as a generating model holds them: in a qkv.KVCache (its buffers on 2 MiB pages
    where Linux offers them), or as plain tensors (4 KiB pages); ``dtype=torch.int8``: the
    packed rows of an int8 cache."""
    if huge or dtype is not None:
        return KVCache(capacity=k.shape[2], dtype=dtype).update(k, v)
    return k, v


# ---- peers (each returns a callable, or a string saying why it cannot run)


def _onnx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: int):
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError as e:
        return f"not installed ({e.name})"
    low = q.dtype == torch.bfloat16
    elem = TensorProto.BFLOAT16 if low else TensorProto.FLOAT

    def feed(t: torch.Tensor):  # shares the torch tensor's memory
        if low:
            bits = t.view(torch.int16).numpy().view(np.uint16)
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, elem)
        return ort.OrtValue.ortvalue_from_numpy(t.numpy())

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    errors = []
    # the GQA layout first (32 query heads over 8 kv heads), then grouped rows
    for qq in (q, q.view(1, H_KV, G * q.shape[2], D)):
        inputs = [
            helper.make_tensor_value_info(n, elem, list(t.shape))
            for n, t in (("Q", qq), ("K", k), ("V", v))
        ]
        out = helper.make_tensor_value_info("Y", elem, None)
        node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], scale=D**-0.5)
        graph = helper.make_graph([node], "decode", inputs, [out])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = min(model.ir_version, 10)
        try:
            sess = ort.InferenceSession(
                model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
            )
            feeds = {"Q": feed(qq), "K": feed(k), "V": feed(v)}
            y = sess.run_with_ort_values(["Y"], feeds)[0].numpy()
            y = (
                torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
                if low
                else torch.from_numpy(y)
            )
            ref = TF.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            if not torch.allclose(y.view(q.shape).float(), ref.float(), atol=3e-2 if low else 1e-4):
                raise RuntimeError("wrong answer")
        except Exception as e:  # not implemented for this layout/version
            errors.append(str(e).splitlines()[0][:140])
            continue
        del onnx
        return lambda: sess.run_with_ort_values(["Y"], feeds)
    return "Attention op failed: " + " | ".join(errors)


def _openvino_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: int):
    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError as e:
        return f"not installed ({e.name})"
    qq = q.view(1, H_KV, G * q.shape[2], D)  # grouped rows
    low = q.dtype == torch.bfloat16
    et = ov.Type.bf16 if low else ov.Type.f32
    params = [ops.parameter(list(t.shape), et, name=n) for n, t in (("q", qq), ("k", k), ("v", v))]
    node = ops.scaled_dot_product_attention(*params, causal=False)
    model = ov.Model([node], params, "decode")
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "bf16" if low else "f32",
    }
    try:
        compiled = ov.Core().compile_model(model, "CPU", config)
        req = compiled.create_infer_request()

        def wrap(t: torch.Tensor):  # shares the torch tensor's memory
            if low:
                return ov.Tensor(t.view(torch.int16).numpy(), list(t.shape), ov.Type.bf16)
            return ov.Tensor(t.numpy(), shared_memory=True)

        tensors = [wrap(t) for t in (qq, k, v)]
        req.infer(tensors)
        y = np.array(req.get_output_tensor(0).data)  # bf16 comes back as 16-bit words
        y = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16) if low else torch.from_numpy(y)
        ref = TF.scaled_dot_product_attention(q, k, v, enable_gqa=True).view(y.shape)
        if not torch.allclose(y.float(), ref.float(), atol=3e-2 if low else 1e-4):
            return "wrong answer"
    except Exception as e:
        return f"failed: {str(e).splitlines()[0][:100]}"
    return lambda: req.infer(tensors)


def methods(q, k, v, threads: int, int8: tuple | None = None) -> dict[str, object]:
    """int8: the packed rows (k8, v8) qkv reads instead of k, v (their dequantized values)."""
    qr = q.view(1, H_KV, G * q.shape[2], D)  # (1, h_kv, G·Tq, d): grouped rows, a view
    mine = (lambda: decode_attention(q, *int8)) if int8 else (
        lambda: scaled_dot_product_attention(q, k, v))  # fmt: skip
    return {
        "qkv auto": mine,
        "torch gqa": lambda: TF.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "torch rows": lambda: TF.scaled_dot_product_attention(qr, k, v),
        "onnxruntime": _onnx_attention(q, k, v, threads),
        "openvino": _openvino_sdpa(q, k, v, threads),
    }


def interleaved(fns: dict[str, object], rounds: int, first: dict[str, int]) -> dict[str, float]:
    """Best time of each callable over ``rounds`` rounds, each calling every one once; a
    callable named in ``first`` takes part in only that many rounds (the 1 GiB reads: what
    they measure needs a few rounds, and short calls need many rounds to find their best).

    Each round calls them in a new random order (seeded), so that no method always runs right
    after the same other one (which may have left K/V in the cache, or evicted them: the 1 GiB
    read does). Rotating one fixed order would not do that: it keeps every method's
    predecessor.
    """
    runnable = {n: f for n, f in fns.items() if callable(f)}
    for f in runnable.values():  # warm-up (first-call set-up, caches)
        f()
    best = dict.fromkeys(runnable, float("inf"))
    order = random.Random(0)
    for i in range(rounds):
        names = [n for n in runnable if i < first.get(n, rounds)]
        order.shuffle(names)
        for name in names:
            f = runnable[name]
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--Tk", type=int, nargs="+", default=[512, 1024, 16384, 65536])
    p.add_argument("--Tq", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of the long calls (default 5); short ones (K+V times Tq up to 256 MiB) "
        "run at least 60: their order is shuffled each round, and a call of a few MB needs "
        "many rounds before every method has run after one that evicted its K/V (with 5, a "
        "1024-key call measured up to 2.5x slower than with 60); the reads take part in 5",
    )
    p.add_argument(
        "--pages", choices=["kvcache", "4k"], default="kvcache",
        help="K/V (and the read buffer) in a qkv.KVCache, i.e. on 2 MiB pages where Linux "
        "offers them (default), or plain tensors on 4 KiB pages",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "decode_attention"))
    args = p.parse_args()
    if args.quick:
        args.Tk, args.Tq = [1024, 16384], [1]
    torch.manual_seed(0)
    huge = args.pages == "kvcache"
    peak = peak_reader()  # built once (a string saying why not, where it cannot be)
    header = [
        *machine_header().splitlines(),
        f"q (1, {H}, Tq, {D}) over k, v (1, {H_KV}, Tk, {D}), no mask",
        "K/V and the 1 GiB read buffer: " + (
            f"in a qkv.KVCache (2 MiB pages where >= {_pages.MIN_BYTES >> 20} MiB; Linux "
            f"huge pages: {_pages.huge_pages_mode()})" if huge else "plain tensors (4 KiB pages)"
        ),
    ]
    print("\n".join(header), flush=True)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        # the bandwidth of a shared machine drifts from minute to minute: every case times a
        # streaming read of 1 GiB in its own interleaved rounds and is compared with that
        x = written(huge)
        section = []
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            int8 = dtype == torch.int8
            dtype = torch.float32 if int8 else dtype  # int8: the peers' (and q's) dtype
            for Tk in args.Tk:
                k, v = cached(  # (B, h_kv, Tk, d), written
                    torch.randn(1, H_KV, Tk, D).to(dtype), torch.randn(1, H_KV, Tk, D).to(dtype),
                    huge,
                )
                packed = None
                if int8:  # qkv's int8 cache; the peers read its values in fp32
                    packed = cached(k, v, huge, torch.int8)
                    k, v = cached(dequantize_rows(packed[0]), dequantize_rows(packed[1]), huge)
                ours = packed or (k, v)
                nbytes = sum(t.numel() * t.element_size() for t in ours)
                for Tq in args.Tq:
                    q = torch.randn(1, H, Tq, D).to(dtype)  # (B, h, Tq, d)
                    with torch.no_grad():
                        path = "decode, int8 rows" if int8 else explain_dispatch(q, k, v).backend
                        fns = methods(q, k, v, threads, packed)
                        fns["read"] = x.sum
                        if callable(peak):
                            fns["peak read"] = lambda read=peak, x=x: read(x)
                        long_call = nbytes * Tq > 2**28
                        rounds = (args.rounds or 5) if long_call else max(args.rounds or 60, 60)
                        best = interleaved(fns, rounds, {"read": 5, "peak read": 5})
                    bw = x.numel() * 4 / best.pop("read")
                    peak_bw = x.numel() * 4 / best.pop("peak read", float("nan"))
                    row = {"threads": threads, "dtype": dname, "Tk": Tk, "Tq": Tq,
                           "path": path, "bw_GBs": bw / 1e9, "peak_GBs": peak_bw / 1e9}  # fmt: skip
                    for m in METHODS:
                        t = best.get(m)
                        row[f"{m} ms"] = t * 1e3 if t else float("nan")
                        row[f"{m} %bw"] = 100 * nbytes / t / bw if t else float("nan")
                        if t is None:
                            row[f"{m} note"] = str(fns[m])
                    peers = [best[m] for m in PEERS if m in best]
                    row["vs fastest peer"] = min(peers) / best["qkv auto"]
                    # the most any kernel reading K+V once at the plain loop's peak could get
                    row["peak vs fastest peer"] = min(peers) * peak_bw / nbytes
                    section.append(row)
                    cells = " ".join(
                        f"{m} {row[f'{m} ms']:.2f}ms/{row[f'{m} %bw']:.0f}%" for m in best
                    )
                    print(f"{threads}t {dname} Tk={Tk} Tq={Tq} [{path}] read {bw / 1e9:.1f} "
                          f"(peak {peak_bw / 1e9:.1f}) GB/s "
                          f"{cells} | qkv vs fastest peer {row['vs fastest peer']:.2f}×", flush=True)  # fmt: skip
                del k, v
        del x
        bws = [r["bw_GBs"] for r in section]
        peaks = [r["peak_GBs"] for r in section]
        header.append(f"read bandwidth, {threads} thread(s): {min(bws):.1f}-{max(bws):.1f} GB/s "
                      f"(torch `sum`), {min(peaks):.1f}-{max(peaks):.1f} GB/s (prefetching loop, "
                      f"{peak if isinstance(peak, str) else 'bench/read_peak.cpp'}); measured in "
                      "each case's rounds")  # fmt: skip
        print(header[-1], flush=True)
        rows += section
    notes = sorted({f"{m}: {r[f'{m} note']}" for r in rows for m in METHODS if f"{m} note" in r})
    write(rows, header, notes, Path(args.out))


def targets(rows: list[dict]) -> list[str]:
    out = []

    def line(name: str, sel: list[dict], ok) -> None:
        if not sel:
            return
        good = sum(bool(ok(r)) for r in sel)
        out.append(f"| {name} | {good}/{len(sel)} cases |")

    rows = [r for r in rows if r["dtype"] != "int8"]  # int8 rows read other bytes than peers
    long = [r for r in rows if r["Tk"] >= 16384]
    line("≥ 70 % of read bandwidth, Tq = 1, Tk ≥ 16384",
         [r for r in long if r["Tq"] == 1], lambda r: r["qkv auto %bw"] >= 70)  # fmt: skip
    line("≥ 1.5× the fastest peer, Tk ≥ 16384", long, lambda r: r["vs fastest peer"] >= 1.5)
    line("(≥ 1.5× the fastest peer within reach at the peak read, Tk ≥ 16384)", long,
         lambda r: r["peak vs fastest peer"] >= 1.5)  # fmt: skip
    line("faster than every peer, Tk ≥ 1024, Tq ≤ 16",
         [r for r in rows if r["Tk"] >= 1024], lambda r: r["vs fastest peer"] > 1.0)  # fmt: skip
    line("Tq = 1, Tk ≤ 512: no slower than torch SDPA (either layout)",
         [r for r in rows if r["Tk"] <= 512 and r["Tq"] == 1],
         lambda r: r["qkv auto ms"] <= min(r["torch gqa ms"], r["torch rows ms"]))  # fmt: skip
    return out or ["| (the targets are for fp32 and bf16: none in this run) | — |"]


def write(rows: list[dict], header: list[str], notes: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}, key=str))
        w.writeheader()
        w.writerows(rows)
    cols = " | ".join(f"{m}" for m in METHODS)
    lines = [*(f"- {h}" for h in header), "",
             "Each cell: best time (ms) / K+V bytes ÷ time as % of the read bandwidth (read: 1 GiB `sum`, best of the same rounds). "
             "peak: the same 1 GiB through a prefetching read loop; limit vs peer: the fastest peer's time ÷ the time to read K+V at that peak, "
             "the most any kernel that reads K+V once could be ahead of it.", "",
             f"| threads | dtype | Tk | Tq | path | read GB/s | peak GB/s | {cols} | qkv vs fastest peer | limit vs peer |",
             "|" + "---|" * (9 + len(METHODS))]  # fmt: skip
    for r in rows:
        cells = " | ".join(
            "—" if r[f"{m} ms"] != r[f"{m} ms"] else f"{r[f'{m} ms']:.2f} / {r[f'{m} %bw']:.0f}%"
            for m in METHODS
        )
        lines.append(f"| {r['threads']} | {r['dtype']} | {r['Tk']} | {r['Tq']} | {r['path']} | "
                     f"{r['bw_GBs']:.1f} | {r['peak_GBs']:.1f} | {cells} | "
                     f"**{r['vs fastest peer']:.2f}×** | {r['peak vs fastest peer']:.2f}× |")  # fmt: skip
    lines += ["", "Targets:", "", "| target | met |", "|---|---|", *targets(rows)]
    if notes:
        lines += ["", "Peers that did not run:", "", *(f"- {n}" for n in notes)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-12:]))
    print(f"wrote {out.with_suffix('.md')} and .csv")


if __name__ == "__main__":
    main()
