// Which keys a query row may see, beyond Structure's causal/window ranges (flash_softmax.h):
// a bool mask read in place (MaskView), a block mask (BlockView), and the row groups that
// narrow a block's matmuls to the keys its rows see.
#pragma once

#include "flash_memory.h"

namespace {

// A bool mask (True = may attend) as a strided view (Nb, h_kv, G, Tq, Tk) with unit stride
// over keys (Python passes the broadcast view, never a copy); kv head n = b·h_kv + hk.
struct MaskView {
  const uint8_t* base = nullptr;
  int64_t h_kv = 1, s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const uint8_t* row(int64_t n, int64_t g, int64_t i, int64_t ks) const {
    if (!base) return nullptr;
    return base + (n / h_kv) * s0 + (n % h_kv) * s1 + g * s2 + i * s3 + ks;
  }
  static MaskView of(const std::optional<Tensor>& mask) {
    MaskView v;
    if (!mask.has_value() || !mask->defined()) return v;
    const Tensor& t = *mask;
    TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 5 && t.stride(4) == 1,
                "qkv flash: mask must be a bool (Nb, h_kv, G, Tq, Tk) view with unit key stride");
    v.base = reinterpret_cast<const uint8_t*>(t.const_data_ptr<bool>());
    v.h_kv = t.size(1), v.s0 = t.stride(0), v.s1 = t.stride(1), v.s2 = t.stride(2);
    v.s3 = t.stride(3);
    return v;
  }
};

// Sizes in the kernel's layout: q (N, G, Tq, d), k (N, Tk, d), v (N, Tk, dv).
struct Dims {
  int64_t N, G, Tq, d, Tk, dv;
  static Dims of(const Tensor& q, const Tensor& k, const Tensor& v) {
    return {q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), v.size(2)};
  }
};

// A block mask (qkv.masks.BlockMask): per (batch, query head, query block, key block) -1 for
// an empty block (skipped), -2 for a full one (no masking), else the index of its bool tile
// (bq x bk, True = may attend). The kernel's blocks are the mask's blocks. A tile row whose
// keys are one contiguous span [lo, hi) (spans, (P, bq, 2); -1 if not) narrows the row's key
// range instead: no mask bytes read, as on a causal diagonal.
struct BlockView {
  const int32_t* idx = nullptr;
  int64_t s[5] = {0, 0, 0, 0, 0}, h_kv = 1;
  const uint8_t* tiles = nullptr;
  const int32_t* spans = nullptr;
  int64_t ld = 0, tile = 0;
  // the mask bytes of row r of tile t, or nullptr after narrowing [c0, c1) to its span
  const uint8_t* row(int32_t t, int64_t r, int64_t& c0, int64_t& c1) const {
    const int32_t* sp = spans + (t * tile / ld + r) * 2;
    if (sp[0] < 0) return tile_row(t, r);
    c0 = std::max<int64_t>(c0, sp[0]), c1 = std::min<int64_t>(c1, sp[1]);
    return nullptr;
  }
  int32_t state(int64_t n, int64_t g, int64_t qb, int64_t j) const {
    if (!idx) return -2;
    return idx[(n / h_kv) * s[0] + (n % h_kv) * s[1] + g * s[2] + qb * s[3] + j * s[4]];
  }
  const uint8_t* tile_row(int32_t t, int64_t r) const { return tiles + t * tile + r * ld; }
  static BlockView of(const std::optional<Tensor>& blocks, const std::optional<Tensor>& tiles,
                      const std::optional<Tensor>& spans, int64_t nqb, int64_t nkb) {
    BlockView b;
    if (!blocks.has_value() || !blocks->defined()) return b;
    TORCH_CHECK(blocks->scalar_type() == at::kInt && blocks->dim() == 5 &&
                    blocks->size(3) == nqb && blocks->size(4) == nkb,
                "qkv flash: blocks must be an int32 (Nb, h_kv, G, q blocks, k blocks) view "
                "matching block_q, block_k");
    TORCH_CHECK(tiles.has_value() && tiles->scalar_type() == at::kBool && tiles->dim() == 3 &&
                    tiles->is_contiguous(),
                "qkv flash: tiles must be a contiguous bool (P, bq, bk) tensor");
    b.idx = blocks->const_data_ptr<int32_t>();
    for (int x = 0; x < 5; ++x) b.s[x] = blocks->stride(x);
    b.h_kv = blocks->size(1);
    b.tiles = reinterpret_cast<const uint8_t*>(tiles->const_data_ptr<bool>());
    b.ld = tiles->size(2), b.tile = tiles->size(1) * tiles->size(2);
    TORCH_CHECK(spans.has_value() && spans->scalar_type() == at::kInt && spans->is_contiguous() &&
                    spans->numel() == tiles->size(0) * tiles->size(1) * 2,
                "qkv flash: spans must be a contiguous int32 (P, bq, 2) tensor");
    b.spans = spans->const_data_ptr<int32_t>();
    return b;
  }
};

// Rows per group of the narrowed matmuls (see row_groups): 16 and 32 measured alike
// (dense time / masked time 1.03-1.23 on documents and sink+window at T=16384), 32 makes
// half the calls and gives the backward's dV, dK updates twice the reduction length.
constexpr int64_t kGroup = 32;

// The key ranges [glo, ghi) (16-aligned, within [0, nk)) that groups of kGroup rows of a
// query block (rows from qs) see in the key block [ks, ks + nk): the union of their rows'
// ranges (causal/window structure, spans of a block mask's partial tile; a row read through
// mask bytes counts whole). Returns the number of groups, 1 (glo = 0, ghi = nk: all rows at
// once) when no group would be narrower than the block.
static inline int64_t row_groups(const Structure& st, const BlockView& bv, int32_t bst, int64_t qs,
                          int64_t rows, int64_t ks, int64_t nk, int64_t* glo, int64_t* ghi) {
  glo[0] = 0, ghi[0] = nk;
  const bool edge = st.lo(qs + rows - 1) > ks || st.hi(qs) < ks + nk;
  if ((bst < 0 && !edge) || rows <= kGroup) return 1;
  const int64_t ng = (rows + kGroup - 1) / kGroup;
  bool narrower = false;
  for (int64_t gi = 0; gi < ng; ++gi) {
    int64_t lo = nk, hi = 0;
    for (int64_t r = gi * kGroup; r < std::min(rows, (gi + 1) * kGroup); ++r) {
      int64_t c0 = std::clamp<int64_t>(st.lo(qs + r) - ks, 0, nk);
      int64_t c1 = std::clamp<int64_t>(st.hi(qs + r) - ks, 0, nk);
      if (bst >= 0) bv.row(bst, r, c0, c1);
      if (c1 > c0) lo = std::min(lo, c0), hi = std::max(hi, c1);
    }
    if (hi <= lo) {
      lo = hi = 0;
    } else {
      lo = lo / 16 * 16, hi = std::min<int64_t>(nk, (hi + 15) / 16 * 16);
    }
    glo[gi] = lo, ghi[gi] = hi;
    narrower |= lo > 0 || hi < nk;
  }
  if (!narrower) {
    glo[0] = 0, ghi[0] = nk;
    return 1;
  }
  return ng;
}

// f(r0, nr, c, nc) for each of the ng row groups that sees a key: rows [r0, r0 + nr) and
// key columns [c, c + nc) of the block (one group of all rows when ng == 1)
template <typename F>
static inline void for_each_group(int64_t ng, int64_t rows, const int64_t* glo,
                                  const int64_t* ghi, F&& f) {
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t r0 = gi * kGroup, nr = ng == 1 ? rows : std::min(kGroup, rows - r0);
    const int64_t c = glo[gi], nc = ghi[gi] - c;
    if (nc > 0) f(r0, nr, c, nc);  // else every row of the group sees no key here: p = 0
  }
}

}  // namespace
