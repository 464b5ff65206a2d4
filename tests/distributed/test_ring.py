"""Ring attention on real torch.distributed process groups (gloo, CPU) against one process.

Each test spawns 2 or 3 processes. Every process builds the same full q, k, v (same seed),
computes the single-process reference ``qkv.functional.scaled_dot_product_attention`` (itself
tested against PyTorch's SDPA in tests/test_functional.py) and PyTorch's own SDPA on the full
sequence, then runs ``ring_attention`` on its shard. Outputs must equal both references'
shards, and gradients the reference's, within 1e-5 (fp32).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
import zlib
from datetime import timedelta

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as TF
from hypothesis import given, settings
from torch import nn

import deadline
from qkv import ALiBi, MultiHeadAttention, RotaryEmbedding
from qkv.distributed import (
    RingAttentionError,
    chunk_sizes,
    positions,
    ring_attention,
    segments,
    shard,
    unshard,
)
from qkv.distributed import block as block_mod
from qkv.distributed.block import block_backward, block_forward
from qkv.distributed.context_parallel import ContextParallelAttention, make_context_parallel
from qkv.distributed.ring import _merge
from qkv.functional import attention_steps, scaled_dot_product_attention
from qkv.kernels._native import native_ops

TOL = 1e-5

# name: (T, h, h_kv, causal, window, layout, scale)
CASES = {
    "full": (24, 4, 4, False, None, "contiguous", None),
    "full-zigzag": (24, 4, 4, False, None, "zigzag", None),
    "causal-contiguous": (24, 4, 4, True, None, "contiguous", None),
    "causal-zigzag": (24, 4, 4, True, None, "zigzag", None),
    "gqa-causal-zigzag": (24, 4, 2, True, None, "zigzag", None),
    "mqa-full": (24, 4, 1, False, None, "contiguous", 0.3),
    "window-causal": (24, 4, 2, True, 5, "contiguous", None),
    "window-causal-zigzag": (24, 4, 4, True, 5, "zigzag", None),
    "window-bidirectional": (24, 4, 4, False, 4, "zigzag", None),
    "odd-causal-zigzag": (23, 4, 2, True, None, "zigzag", None),
    "odd-full-contiguous": (25, 4, 4, False, None, "contiguous", None),
    "odd-causal-contiguous": (29, 4, 4, True, 7, "contiguous", None),
    "tiny-zigzag-empty-chunk": (5, 2, 1, True, None, "zigzag", None),
}


def torch_mask(T: int, causal: bool, window: int | None) -> torch.Tensor:
    """The (T, T) bool mask (True = may attend) for PyTorch's own SDPA."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allowed = j <= i if causal else torch.ones(T, T, dtype=torch.bool)
    if window is not None:
        allowed = allowed & (j > i - window) & ((j <= i) if causal else (j < i + window))
    return allowed


# --- process launching ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set in each spawned rank by _entry: the parent's load scale (a child's own reading would
# count its siblings) and where the ranks leave their results and stages.
_SCALE = 1.0
_OUT_DIR = ""
_RANK = 0


def _scaled(base: float) -> float:
    """``base`` seconds, scaled like the parent's deadlines (see tests/deadline.py)."""
    return base * _SCALE


def _stage(what: str) -> None:
    """Record what this rank is doing, for the parent's message if it gives up waiting."""
    with open(os.path.join(_OUT_DIR, f"rank{_RANK}.stage"), "w") as f:
        f.write(what)


def _entry(rank, world, port, out_dir, scale, job, args):
    global _SCALE, _OUT_DIR, _RANK
    _SCALE, _OUT_DIR, _RANK = scale, out_dir, rank
    result = {}
    try:
        _stage("joining the process group")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=_scaled(60)),
        )  # fmt: skip
        torch.set_num_threads(1)
        _stage(f"running {job.__name__}")
        result = job(rank, world, *args)
    except BaseException as e:  # report everything to the parent
        result = {"error": type(e).__name__, "message": str(e), "tb": traceback.format_exc()}
    _stage("saving its result")
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if "error" in result:
        os._exit(1)  # like an uncaught exception: the process dies, sockets close
    _stage("leaving the process group")
    dist.destroy_process_group()


def _state(r: int, p, out_dir: str) -> str:
    """One rank's state for a message: alive or its exit code, and its last stage."""
    try:
        with open(os.path.join(out_dir, f"rank{r}.stage")) as f:
            stage = f.read()
    except OSError:
        stage = "starting (imports)"
    status = "alive" if p.is_alive() else f"exited {p.exitcode}"
    return f"rank {r} {status}, last stage: {stage}"


def launch(job, world: int, *args, limit: float = 90.0) -> list[dict]:
    """Run ``job(rank, world, *args)`` in ``world`` processes; return each rank's result dict.

    ``limit``: seconds on a quiet machine for all ranks to finish, stretched while the machine
    is busy (tests/deadline.py); past it the ranks are killed and the test is skipped (CPUs
    saturated) or fails (a hang), with each rank's last stage in the message.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        scale = deadline.scale()  # the children's timeouts: fixed when they start
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, out_dir, scale, job, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        wait = deadline.Deadline(limit, f"{world} ranks running {job.__name__}")
        while any(p.is_alive() for p in procs):
            if wait.expired():
                detail = "; ".join(_state(r, p, out_dir) for r, p in enumerate(procs))
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join()
                wait.give_up(detail)
            time.sleep(0.05)
        for p in procs:
            p.join()
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            results.append(
                torch.load(path) if os.path.exists(path)
                else {"error": "no result", "message": _state(r, procs[r], out_dir)}
            )  # fmt: skip
        return results


# --- jobs (run inside the spawned processes) -----------------------------------------------


def _equivalence_job(rank, world, names):
    errors = {}
    for name in names:
        _stage(f"case {name}")
        T, h, h_kv, causal, window, layout, scale = CASES[name]
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q, k, v, go = (
            torch.randn(2, n, T, 8, generator=g) for n in (h, h_kv, h_kv, h)
        )  # (B, h|h_kv, T, d)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = scaled_dot_product_attention(*full, causal=causal, window=window, scale=scale)
        ref_grads = torch.autograd.grad(ref, full, go)
        local = [shard(t, rank, world, layout=layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(
            *local, causal=causal, window=window, scale=scale, layout=layout,
            timeout=_scaled(30),
        )  # fmt: skip
        grads = torch.autograd.grad(out, local, shard(go, rank, world, layout=layout))
        torch_ref = TF.scaled_dot_product_attention(
            q, k, v, attn_mask=torch_mask(T, causal, window), scale=scale, enable_gqa=True
        )  # PyTorch's own attention on the whole sequence
        errs = [(out - shard(ref, rank, world, layout=layout)).abs().max().item()]
        errs.append((out - shard(torch_ref, rank, world, layout=layout)).abs().max().item())
        for got, want in zip(grads, ref_grads):
            errs.append((got - shard(want, rank, world, layout=layout)).abs().max().item())
        finite = bool(torch.isfinite(out).all()) and all(
            bool(torch.isfinite(t).all()) for t in grads
        )
        errors[name] = (errs, finite)
    return {"errors": errors}


class _TinyLM(nn.Module):
    def __init__(self, vocab=11, d=16, heads=4, kv_heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        rope = RotaryEmbedding(d // heads)
        self.attn = MultiHeadAttention(d, heads, n_kv_heads=kv_heads, position=rope)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)  # (B, T, d)
        x = x + self.attn(x, causal=True)
        return self.head(x)  # (B, T, vocab)


def _model_job(rank, world, layout):
    torch.manual_seed(0)
    model = _TinyLM()
    ids = torch.randint(0, 11, (2, 21))
    targets = torch.randint(0, 11, (2, 21))
    ref_loss = TF.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    keys_before = list(model.state_dict())
    cp = make_context_parallel(model, layout=layout)
    logits = cp(shard(ids, rank, world, layout=layout, dim=1))  # (B, T_local, vocab)
    loss = TF.cross_entropy(
        logits.flatten(0, 1), shard(targets, rank, world, layout=layout, dim=1).flatten(),
        reduction="sum",
    )  # fmt: skip
    grads = torch.autograd.grad(loss, list(cp.parameters()))
    total = loss.detach().clone()
    dist.all_reduce(total)
    for gr in grads:
        dist.all_reduce(gr)  # replicated parameters: sum the per-rank partial gradients
    return {
        "loss_err": (total - ref_loss).abs().item() / ref_loss.item(),
        "grad_err": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)),
        "wrapped": isinstance(cp.attn, ContextParallelAttention),
        "same_keys": keys_before == list(cp.state_dict()),
    }


def _bad_shard_job(rank, world):
    q = torch.randn(1, 2, 5 if rank == 0 else 2, 4)  # T=7 contiguous over 2 would be [4, 3]
    ring_attention(q, q, q, timeout=_scaled(20))
    return {}


def _failure_job(rank, world, mode):
    q = torch.randn(1, 2, 4, 8)
    if rank == 1:
        if mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        # "stall": alive, and never joins the ring while the others wait for it (3 s): it waits
        # for their results, however long a busy machine makes them take
        _stage("stalling until ranks 0 and 2 have given up")
        others = [os.path.join(_OUT_DIR, f"rank{r}.pt") for r in (0, 2)]
        stop = time.monotonic() + _scaled(60)
        while not all(os.path.exists(f) for f in others) and time.monotonic() < stop:
            time.sleep(0.05)
        return {"stalled": True}
    t0 = time.monotonic()
    try:
        ring_attention(q, q, q, causal=True, timeout=3, seq_len=4 * world)
    except RingAttentionError as e:
        return {"error": "RingAttentionError", "message": str(e), "after": time.monotonic() - t0}
    return {"after": time.monotonic() - t0}


# --- tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3])
def ring_results(request):
    world = request.param
    return world, launch(_equivalence_job, world, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_ring_equals_single_process(ring_results, name):
    world, results = ring_results
    for rank, res in enumerate(results):
        assert "errors" in res, f"rank {rank}: {res}"
        errs, finite = res["errors"][name]
        assert finite, f"{name}, world={world}, rank {rank}: NaN/inf"
        assert max(errs) <= TOL, (
            f"{name}, world={world}, rank {rank}: out, out vs torch, dq, dk, dv errors {errs}"
        )


def test_context_parallel_model_matches_one_process():
    for layout in ("zigzag", "contiguous"):
        results = launch(_model_job, 2, layout)
        for rank, res in enumerate(results):
            assert "error" not in res, res
            assert res["wrapped"] and res["same_keys"]
            assert res["loss_err"] <= 1e-6 and res["grad_err"] <= TOL, (layout, rank, res)


def test_mismatched_shards_raise_on_every_rank():
    results = launch(_bad_shard_job, 2)
    for res in results:
        assert res.get("error") == "ValueError", res
        assert "do not match a 'contiguous' split of T=7" in res["message"]


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_failing_rank_ends_the_others_with_clear_error(mode):
    scale = deadline.scale()
    results = launch(_failure_job, 3, mode, limit=40)  # a hang is reported by launch
    assert results[1].get("error" if mode == "raise" else "stalled") == (
        "ValueError" if mode == "raise" else True
    ), results[1]
    # timeout=3 s (stall), a dead peer fails at once: well before the process group's 60 s
    bound = 15 * max(scale, deadline.scale())
    for rank in (0, 2):
        res = results[rank]
        assert res.get("error") == "RingAttentionError", res
        assert f"rank {rank}/3 failed waiting" in res["message"]
        assert res["after"] < bound, res


# --- single-process pieces -------------------------------------------------------------------


def test_shard_layouts_and_positions():
    x = torch.arange(10)[None]  # (B=1, T=10)
    assert shard(x, 0, 2, layout="zigzag", dim=1).tolist() == [[0, 1, 2, 8, 9]]
    assert shard(x, 1, 2, layout="zigzag", dim=1).tolist() == [[3, 4, 5, 6, 7]]
    assert positions(10, 1, 2, "zigzag").tolist() == [3, 4, 5, 6, 7]
    assert chunk_sizes(10, 3) == [len(c) for c in torch.tensor_split(torch.arange(10), 3)]
    assert segments(5, 0, 3, "zigzag") == [(0, 1), (5, 0)]  # an empty chunk is allowed
    for layout in ("contiguous", "zigzag"):
        for T, world in ((10, 2), (23, 3), (5, 3)):
            y = torch.randn(2, 3, T, 4)
            parts = [shard(y, r, world, layout=layout) for r in range(world)]
            assert torch.equal(unshard(parts, layout=layout), y)
            got = torch.cat([positions(T, r, world, layout) for r in range(world)])
            assert sorted(got.tolist()) == list(range(T))
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="part 0 has length 3"):
        unshard([x[:, :3], x[:, 3:]], dim=1)


def test_merge_of_empty_rows_is_zero_not_nan():
    out = torch.zeros(1, 1, 2, 3)
    lse = torch.full((1, 1, 2), float("-inf"))
    _merge(out, lse, torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(out, torch.zeros(1, 1, 2, 3)) and torch.isinf(lse).all()
    _merge(out, lse, torch.ones(1, 1, 2, 3), torch.tensor([[[0.0, float("-inf")]]]))
    assert torch.equal(out[0, 0, 0], torch.ones(3)) and torch.equal(out[0, 0, 1], torch.zeros(3))


@pytest.mark.parametrize("kernel", ["fused", "ops"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 4), (False, 3)])
def test_one_process_tiled_blocks_match_torch_sdpa(monkeypatch, causal, window, kernel):
    monkeypatch.setattr(block_mod, "TILE_ELEMENTS", 50)  # ops: many tiles, some partly masked
    if kernel == "ops":
        monkeypatch.setattr(block_mod, "native_ops", lambda: None)
    g = torch.Generator().manual_seed(1)
    q, go = torch.randn(2, 4, 19, 8, generator=g), torch.randn(2, 4, 19, 8, generator=g)
    k, v = torch.randn(2, 2, 19, 8, generator=g), torch.randn(2, 2, 19, 8, generator=g)
    allowed = torch_mask(19, causal, window)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*ours, causal=causal, window=window)  # no process group: P = 1
    ref = TF.scaled_dot_product_attention(*theirs, attn_mask=allowed, enable_gqa=True)
    assert (out - ref).abs().max() <= TOL
    for a, b in zip(torch.autograd.grad(out, ours, go), torch.autograd.grad(ref, theirs, go)):
        assert (a - b).abs().max() <= TOL


def test_bad_inputs_raise_clear_errors():
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="same positions"):
        ring_attention(q, torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8))
    with pytest.raises(ValueError, match="multiple of k/v's heads"):
        ring_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))
    with pytest.raises(ValueError, match="window must be"):
        ring_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="dropout"):
        ContextParallelAttention(MultiHeadAttention(8, 2, dropout=0.1))


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("qkv.distributed.shard", "qkv.distributed.block"):
        mod = importlib.import_module(name)  # the module (the package exports a function `shard`)
        failed, tried = doctest.testmod(mod)
        assert tried > 0 and failed == 0, name


def test_context_parallel_attention_on_one_process_equals_the_module():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, n_kv_heads=2, position=RotaryEmbedding(4))
    cpa = ContextParallelAttention(mha, layout="zigzag")  # no process group: P = 1
    x = torch.randn(2, 9, 16)
    for causal, window in ((True, None), (False, None), (True, 3)):
        want = mha(x, causal=causal, window=window)
        assert (cpa(x, causal=causal, window=window) - want).abs().max() <= TOL
    assert list(cpa.state_dict()) == list(mha.state_dict())
    with pytest.raises(ValueError, match="does not support \\['mask'\\]"):
        cpa(x, mask=torch.ones(9, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="self-attention only"):
        cpa(x, x)
    with pytest.raises(ValueError, match="ALiBi"):
        ContextParallelAttention(MultiHeadAttention(16, 4, position=ALiBi(4)))


# --- the ring's blocks on the fused C++ kernel, against fp64 math ---------------------------


def _block_reference(q, k, v, q_start, k_start, causal, window, scale):
    """fp64 attention of the block, its mask from global positions (True = may attend)."""
    Tq, Tk = q.shape[2], k.shape[2]
    delta = (k_start + torch.arange(Tk))[None, :] - (q_start + torch.arange(Tq))[:, None]
    lo, hi = block_mod.band(causal, window)
    allowed = (delta >= lo) & (delta <= hi)  # (Tq, Tk)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    steps = attention_steps(q64, k64, v64, mask=allowed, scale=scale)
    return steps, (q64, k64, v64)


@pytest.mark.skipif(native_ops() is None, reason="the fused kernel is not built here")
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    Tq=st.integers(1, 70), Tk=st.integers(1, 70), q_start=st.integers(0, 120),
    k_start=st.integers(0, 120), causal=st.booleans(), window=st.none() | st.integers(1, 40),
    g=st.sampled_from([1, 2, 3]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)  # fmt: skip
def test_fused_blocks_equal_fp64_at_any_offset(Tq, Tk, q_start, k_start, causal, window, g, dtype):
    """block_forward/block_backward on the fused kernel (query rows at their global offset,
    the global lse given to the backward) against fp64 math with the same positions."""
    gen = torch.Generator().manual_seed(Tq * 1000 + Tk)
    q = torch.randn(2, 2 * g, Tq, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, Tk, 8, generator=gen).to(dtype) for _ in range(2))
    scale = 0.35
    assert block_mod._fused_ops(q, k, v, scale) is not None
    kw = dict(scale=scale, q_start=q_start, k_start=k_start, causal=causal, window=window)
    out, lse = block_forward(q, k, v, **kw)
    ref, ref_in = _block_reference(q, k, v, q_start, k_start, causal, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(lse == float("-inf"), ref.lse == float("-inf"))
    finite = ref.lse > float("-inf")
    assert torch.all((lse.double()[finite] - ref.lse[finite]).abs() <= 10 * tol)
    assert (out.double() - ref.output).abs().max() <= tol * 4
    go = torch.randn(out.shape, generator=gen).to(dtype)
    delta = (go.float() * out.float()).sum(-1)
    grads = block_backward(q, k, v, go, lse, delta, out=out, **kw)
    want = torch.autograd.grad(ref.output, ref_in, go.double())
    for a, b in zip(grads, want):
        bound = 4 * tol if dtype == torch.float32 else 0.05 * max(b.abs().max().item(), 1e-3)
        assert (a.double() - b).abs().max() <= bound


def test_ring_runs_the_fused_kernel_and_the_fallback_agrees(monkeypatch):
    """One process: the fused blocks and the PyTorch-ops blocks give the same fp32 answer."""
    if native_ops() is None:
        pytest.skip("the fused kernel is not built here")
    calls = []
    ops = native_ops()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(block_mod, "native_ops", lambda: Spy())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 40, 8, generator=g).requires_grad_() for _ in range(3))
    out = ring_attention(q, k, v, causal=True, window=9)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert "fwd_at" in calls and "bwd_at" in calls
    monkeypatch.setattr(block_mod, "native_ops", lambda: None)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out2 = ring_attention(q2, k2, v2, causal=True, window=9)
    grads2 = torch.autograd.grad(out2.sum(), (q2, k2, v2))
    assert (out - out2).abs().max() <= TOL
    for a, b in zip(grads, grads2):
        assert (a - b).abs().max() <= TOL
