"""qkv.block_mask against a brute-force reference built here.

The reference is the mask itself, written out densely: the truth table of ``mask_fn`` (or
the definition of the document / prefix-LM / sink + window masks) over every (query, key)
pair, then cut into blocks with plain Python loops: a block is empty when none of its pairs
inside the sequence may attend, full when all of them may, partial otherwise, and a partial
block's tile is that block of the table, False outside the sequence. The BlockMask's index,
tiles, spans, counts, sparsity and ``to_dense`` are checked against it over random shapes
(edge blocks, odd block sizes, several chunks, per batch entry and head). The kernels reading
block masks are tested in tests/kernels/test_flash_variants.py.
"""

import doctest
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import qkv.block_mask
from qkv.block_mask import (
    BlockMask,
    create_block_mask,
    document_mask,
    prefix_lm_mask,
    sliding_window_mask,
)

EMPTY, FULL = -1, -2  # the index codes the module docstring documents
EXAMPLES = settings(max_examples=30, deadline=None)


# --- the reference ------------------------------------------------------------------------


def reference_blocks(dense: torch.Tensor, bq: int, bk: int):
    """Per block of ``dense (b, h, Tq, Tk)``: ``"empty"``, ``"full"`` or the partial block's
    tile ``(bq, bk)`` (False outside the sequence), by loops over the blocks."""
    b, h, Tq, Tk = dense.shape
    nqb, nkb = -(-Tq // bq), -(-Tk // bk)
    out = {}
    for bi in range(b):
        for hi in range(h):
            for qb in range(nqb):
                for kb in range(nkb):
                    block = dense[bi, hi, qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
                    if not block.any():
                        out[bi, hi, qb, kb] = "empty"
                    elif block.all():
                        out[bi, hi, qb, kb] = "full"
                    else:
                        tile = torch.zeros(bq, bk, dtype=torch.bool)
                        tile[: block.shape[0], : block.shape[1]] = block
                        out[bi, hi, qb, kb] = tile
    return out


def reference_spans(tile: torch.Tensor) -> list[list[int]]:
    """Per tile row: ``[lo, hi)`` of its True columns when they are contiguous (``[0, 0]``
    for a row with none), else ``[-1, -1]``; in plain Python."""
    spans = []
    for row in tile.tolist():
        cols = [j for j, x in enumerate(row) if x]
        if not cols:
            spans.append([0, 0])
        elif cols == list(range(cols[0], cols[-1] + 1)):
            spans.append([cols[0], cols[-1] + 1])
        else:
            spans.append([-1, -1])
    return spans


def loop_dense(bm: BlockMask) -> torch.Tensor:
    """``bm`` expanded block by block from its index and tiles (the reference of to_dense)."""
    bq, bk = bm.block_size
    b, h, nqb, nkb = bm.index.shape
    out = torch.zeros(b, h, nqb * bq, nkb * bk, dtype=torch.bool)
    for (bi, hi, qb, kb), code in zip(
        torch.cartesian_prod(*(torch.arange(n) for n in (b, h, nqb, nkb))).view(-1, 4).tolist(),
        bm.index.flatten().tolist(),
    ):
        rows, cols = slice(qb * bq, (qb + 1) * bq), slice(kb * bk, (kb + 1) * bk)
        if code == FULL:
            out[bi, hi, rows, cols] = True
        elif code >= 0:
            out[bi, hi, rows, cols] = bm.tiles[code]
        else:
            assert code == EMPTY, code
    return out[..., : bm.Tq, : bm.Tk]


def assert_matches(bm: BlockMask, dense: torch.Tensor, *, one_tile_per_block: bool) -> None:
    """Everything ``bm`` says equals the reference of ``dense (b, h, Tq, Tk)``."""
    bq, bk = bm.block_size
    b, h, Tq, Tk = dense.shape
    assert (bm.Tq, bm.Tk) == (Tq, Tk)
    assert bm.index.dtype == torch.int32 and bm.tiles.dtype == torch.bool
    assert bm.index.shape == (b, h, -(-Tq // bq), -(-Tk // bk))
    assert bm.tiles.shape[1:] == (bq, bk)
    ref = reference_blocks(dense, bq, bk)
    counts = {"empty": 0, "full": 0, "partial": 0}
    used = []
    for pos, want in ref.items():
        code = int(bm.index[pos])
        if isinstance(want, str):
            assert code == (EMPTY if want == "empty" else FULL), (pos, want, code)
            counts[want] += 1
        else:
            assert 0 <= code < bm.tiles.shape[0], (pos, code)
            assert torch.equal(bm.tiles[code], want), pos
            counts["partial"] += 1
            used.append(code)
    assert sorted(set(used)) == list(range(bm.tiles.shape[0]))  # every tile is used
    if one_tile_per_block:  # create_block_mask: tiles 0, 1, ... in block order
        assert sorted(used) == list(range(len(used)))
    assert bm.counts() == counts
    n = sum(counts.values())
    assert bm.sparsity() == pytest.approx(counts["empty"] / n)
    assert torch.equal(bm.to_dense(), dense)
    assert bm.shape == (bm.B or 1, bm.H or 1, Tq, Tk)
    assert bm.spans.shape == (bm.tiles.shape[0], bq, 2)
    for t in range(bm.tiles.shape[0]):
        assert bm.spans[t].tolist() == reference_spans(bm.tiles[t]), t


# --- create_block_mask ----------------------------------------------------------------------


def _length(draw, bs: int) -> int:
    """A sequence length of 1 to 6 blocks of ``bs``, its last block cut anywhere."""
    return (draw(st.integers(1, 6)) - 1) * bs + draw(st.integers(1, bs))


@st.composite
def mask_fn_case(draw):
    """(mask_fn, B, H, Tq, Tk, block_size, the mask's truth table (B|1, H|1, Tq, Tk))."""
    bq = draw(st.sampled_from([1, 3, 8, 13, 16, 32]))
    bk = draw(st.sampled_from([1, 5, 8, 16, 24, 32]))
    Tq, Tk = _length(draw, bq), _length(draw, bk)
    B, H = draw(st.none() | st.integers(1, 2)), draw(st.none() | st.integers(1, 3))
    Bm, Hm = B or 1, H or 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["table", "formula", "rows", "constant"]))
    i, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    if kind == "table":
        # random per (batch, head, block): empty, full or random pairs, on 8x8 cells (so
        # blocks of every size see all three); the fn looks the pairs up
        cells = torch.randint(0, 3, (Bm, Hm, -(-Tq // 8), -(-Tk // 8)), generator=g)
        cells = cells.repeat_interleave(8, 2).repeat_interleave(8, 3)[..., :Tq, :Tk]
        noise = torch.rand(Bm, Hm, Tq, Tk, generator=g) < 0.5
        table = (cells == 1) | ((cells == 2) & noise)

        def fn(b, h, q, kv):
            return table[b, h, q, kv]

        return fn, B, H, Tq, Tk, (bq, bk), table
    if kind == "formula":  # causal with an offset, a window, the batch entry and head
        off, w = draw(st.integers(-5, 5)), draw(st.integers(1, 40))

        def fn(b, h, q, kv):
            return ((kv <= q + off) & (q - kv < w + h)) | (kv == b)

        b_ = torch.arange(Bm)[:, None, None, None]
        h_ = torch.arange(Hm)[None, :, None, None]
        table = ((j <= i + off) & (i - j < w + h_)) | (j == b_)
        return fn, B, H, Tq, Tk, (bq, bk), table.expand(Bm, Hm, Tq, Tk)
    if kind == "rows":  # an fn whose answer broadcasts: (rows, 1)
        m = draw(st.integers(1, 4))

        def fn(b, h, q, kv):
            return q % m == 0

        return fn, B, H, Tq, Tk, (bq, bk), (i % m == 0).expand(Bm, Hm, Tq, Tk)
    value = draw(st.booleans())  # a 0-dim answer

    def fn(b, h, q, kv):
        return torch.tensor(value)

    return fn, B, H, Tq, Tk, (bq, bk), torch.full((Bm, Hm, Tq, Tk), value)


@EXAMPLES
@given(mask_fn_case(), st.sampled_from([None, 64, 3 * 8 * 8, 1 << 19]))
def test_create_block_mask_equals_the_brute_force_blocks(case, chunk):
    """Index, tiles, spans, counts and to_dense against the reference, with mask_fn evaluated
    in one chunk or in chunks of a block or a few (``_CHUNK_ELEMENTS`` shrunk)."""
    fn, B, H, Tq, Tk, bs, table = case
    with mock.patch.object(qkv.block_mask, "_CHUNK_ELEMENTS", chunk or (1 << 30)):
        bm = create_block_mask(fn, B, H, Tq, Tk, block_size=bs)
    assert (bm.B, bm.H, bm.block_size) == (B, H, bs)
    assert_matches(bm, table, one_tile_per_block=True)


def test_create_block_mask_calls_mask_fn_with_int32_indices_that_broadcast():
    seen = []

    def fn(b, h, q, kv):
        seen.append((b.dtype, b.shape, h.shape, q.dtype, q.shape[1], kv.dtype, kv.shape[0]))
        return kv <= q

    create_block_mask(fn, 2, 3, 20, 30, block_size=8)
    assert len(seen) == 6  # one chunk per (batch, head) at this size
    assert set(seen) == {(torch.int32, (), (), torch.int32, 1, torch.int32, 1)}


# --- the shortcuts --------------------------------------------------------------------------


def _block_size(draw):
    return (draw(st.sampled_from([1, 4, 8, 13, 16, 32])), draw(st.sampled_from([2, 8, 11, 16, 32])))


@st.composite
def shortcut_case(draw):
    """(BlockMask from a shortcut, the definition's truth table (B|1, 1, T, T), the same
    definition as a mask_fn with its B)."""
    kind = draw(st.sampled_from(["document", "prefix", "sink_window"]))
    bs = _block_size(draw)
    T = draw(st.integers(1, 120))
    B = draw(st.none() | st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if kind == "document":
        ids = torch.randint(0, 4, (B or 1, T), generator=g)
        if draw(st.booleans()):
            ids = ids.sort(dim=1).values  # packed documents; unsorted ids are valid too
        causal = draw(st.booleans())
        window = draw(st.none() | st.integers(1, 50)) if causal else None
        bm = document_mask(ids if B else ids[0], causal=causal, window=window, block_size=bs)
        table = ids[:, :, None] == ids[:, None, :]
        if causal:
            table = table & (j <= i)
        if window is not None:
            table = table & (i - j < window)

        def fn(b, h, q, kv):
            m = ids[b, q] == ids[b, kv]
            if causal:
                m = m & (kv <= q)
            return m & (q - kv < window) if window is not None else m

        return bm, table[:, None], fn, B
    if kind == "prefix":
        L = torch.randint(0, T + 2, (B or 1,), generator=g)
        bm = prefix_lm_mask(L if B else int(L[0]), T, block_size=bs)
        table = (j <= i) | (j < L[:, None, None])

        def fn(b, h, q, kv):
            return (kv <= q) | (kv < L[b])

        return bm, table[:, None], fn, B
    w, s = draw(st.integers(1, 60)), draw(st.integers(0, 10))
    bm = sliding_window_mask(T, w, sinks=s, block_size=bs)
    table = (j <= i) & ((i - j < w) | (j < s))

    def fn(b, h, q, kv):
        return (kv <= q) & ((q - kv < w) | (kv < s))

    return bm, table[None, None], fn, None


@EXAMPLES
@given(shortcut_case())
def test_shortcuts_equal_the_brute_force_blocks(case):
    """document_mask, prefix_lm_mask and sliding_window_mask classify each block as the dense
    definition does (tiles may be shared by blocks with the same pattern), and give the same
    blocks as create_block_mask with that definition as mask_fn."""
    bm, table, fn, B = case
    assert (bm.B, bm.H) == (B, None)
    assert_matches(bm, table, one_tile_per_block=False)
    assert bm.tiles.shape[0] <= bm.counts()["partial"]
    general = create_block_mask(fn, B, None, bm.Tq, bm.Tk, block_size=bm.block_size)
    assert bm.counts() == general.counts()
    assert torch.equal(bm.index.clamp(max=0), general.index.clamp(max=0))  # the same states


def test_documents_of_one_block_each_leave_only_the_diagonal():
    """Four documents of 16 tokens in 16-blocks, not causal: 4 full blocks, 12 empty."""
    bm = document_mask(torch.arange(4).repeat_interleave(16), causal=False, block_size=16)
    assert bm.counts() == {"empty": 12, "full": 4, "partial": 0}
    assert torch.equal(bm.index[0, 0], torch.where(torch.eye(4, dtype=torch.bool), FULL, EMPTY))


def test_block_mask_counts_and_sparsity():
    """Causal at T=1024 in 128-blocks: 8 diagonal tiles... all the same pattern."""
    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 1024, 1024)
    assert bm.counts() == {"empty": 28, "full": 28, "partial": 8}
    assert abs(bm.sparsity() - 28 / 64) < 1e-9
    short = sliding_window_mask(1024, 128)  # shortcut: one tile per distinct pattern
    assert short.tiles.shape[0] <= 2 and short.counts()["empty"] == 64 - 8 - 7
    assert torch.equal(short.to_dense()[0, 0], torch.ones(1024, 1024).tril().triu(-127).bool())


@pytest.mark.parametrize("T, bs", [(512, 64), (500, (32, 64)), (300, 24)])
def test_create_block_mask_over_many_chunks_equals_the_dense_mask(monkeypatch, T, bs):
    """Chunks of a few blocks (edges padded, odd block widths reduced byte-wise), a mask_fn
    returning a broadcast shape, and per-(batch, head) masks: all equal the dense mask."""
    monkeypatch.setattr(qkv.block_mask, "_CHUNK_ELEMENTS", 3 * 64 * 64)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ids = torch.randint(0, 5, (T,), generator=torch.Generator().manual_seed(T)).sort().values

    def fn(b, h, q, kv):
        return ((ids[q] == ids[kv]) & (kv <= q + h)) | (kv < b)

    bm = create_block_mask(fn, 2, 2, T, T, block_size=bs)
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(2)[None, :, None, None]
    dense = ((ids[:, None] == ids[None, :]) & (j <= i + h)) | (j < b)  # (2, 2, T, T)
    assert torch.equal(bm.to_dense(), dense)
    rows = create_block_mask(lambda b, h, q, kv: q % 3 == 0, None, None, T, T,
                             block_size=bs)  # fmt: skip
    assert torch.equal(rows.to_dense()[0, 0], (i % 3 == 0).expand(T, T))


# --- BlockMask itself -----------------------------------------------------------------------


@st.composite
def hand_made(draw):
    """A BlockMask built directly from a random index and random tiles."""
    bq, bk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    Tq, Tk = _length(draw, bq), _length(draw, bk)
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    P = draw(st.integers(0, 5))
    shape = (b, h, -(-Tq // bq), -(-Tk // bk))
    index = torch.randint(-2, P, shape, generator=g, dtype=torch.int32)
    tiles = torch.rand(P, bq, bk, generator=g) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    return BlockMask(b, h, Tq, Tk, (bq, bk), index, tiles)


@EXAMPLES
@given(hand_made())
def test_to_dense_and_spans_of_any_index_and_tiles(bm):
    """to_dense equals the block-by-block expansion; spans equal each tile row's run of keys."""
    assert torch.equal(bm.to_dense(), loop_dense(bm))
    assert [reference_spans(t) for t in bm.tiles] == bm.spans.tolist()
    idx = bm.index.flatten().tolist()
    want = {"empty": idx.count(EMPTY), "full": idx.count(FULL), "partial": sum(x >= 0 for x in idx)}
    assert bm.counts() == want
    assert f"empty={want['empty']}, full={want['full']}, partial={want['partial']}" in repr(bm)


def test_doctests():
    failed, tried = doctest.testmod(qkv.block_mask)
    assert tried > 0 and failed == 0


# --- bad arguments --------------------------------------------------------------------------


def causal_fn(b, h, q, kv):
    return kv <= q


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((0, None, 8, 8), {}, "B must be an int >= 1 or None"),
        ((True, None, 8, 8), {}, "B must be an int >= 1 or None"),
        ((None, 2.0, 8, 8), {}, "H must be an int >= 1 or None"),
        ((None, None, 0, 8), {}, "Tq must be an int >= 1"),
        ((None, None, 8, -1), {}, "Tk must be an int >= 1"),
        ((None, None, 8, 8.0), {}, "Tk must be an int >= 1"),
        ((None, None, 8, 8), {"block_size": 0}, "block_size must be an int >= 1 or a pair"),
        ((None, None, 8, 8), {"block_size": (8,)}, "block_size must be an int >= 1 or a pair"),
        ((None, None, 8, 8), {"block_size": (8, 0)}, "block_size must be an int >= 1 or a pair"),
    ],
)
def test_create_block_mask_rejects_bad_sizes(args, kw, match):
    with pytest.raises(ValueError, match=match):
        create_block_mask(causal_fn, *args, **kw)


def test_mask_fn_answers_are_checked():
    with pytest.raises(TypeError, match="mask_fn must return bool"):
        create_block_mask(lambda b, h, q, kv: q - kv, None, None, 8, 8)
    with pytest.raises(ValueError, match="mask_fn must return a bool tensor that broadcasts"):
        create_block_mask(lambda b, h, i, j: torch.ones(3, dtype=torch.bool), None, None, 8, 8)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: document_mask([0, 0, 1]), "document_ids must be an integer tensor"),
        (lambda: document_mask(torch.zeros(4)), "document_ids must be an integer tensor"),
        (lambda: document_mask(torch.zeros(4, dtype=torch.bool)), "document_ids must be an int"),
        (lambda: document_mask(torch.zeros(3, 4, 5, dtype=torch.long)), "document_ids must be"),
        (lambda: document_mask(torch.zeros(0, dtype=torch.long)), "at least one token"),
        (lambda: document_mask(torch.zeros(4, dtype=torch.long), window=0), "window must be"),
        (lambda: document_mask(torch.zeros(4, dtype=torch.long), causal=False, window=2),
         "window is causal"),
        (lambda: prefix_lm_mask(2.5, 8), "prefix_length must be an int or an integer tensor"),
        (lambda: prefix_lm_mask(torch.ones(2, 2, dtype=torch.long), 8), "prefix_length must"),
        (lambda: prefix_lm_mask(2, 0), "Tq must be an int >= 1"),
        (lambda: sliding_window_mask(12, 0), "window must be an int >= 1"),
        (lambda: sliding_window_mask(12, None), "window must be an int >= 1, got None"),
        (lambda: sliding_window_mask(12, 4, sinks=-1), "sinks must be an int >= 0"),
        (lambda: sliding_window_mask(12, 4, sinks=True), "sinks must be an int >= 0"),
        (lambda: sliding_window_mask(12, 4, block_size=(4, 4, 4)), "block_size must be"),
    ],
)  # fmt: skip
def test_shortcuts_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
