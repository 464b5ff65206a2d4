// bf16 K/V on AMX tiles (Intel server cores): one segment with both products as tile
// multiplies (run_segment_amx), for calls with many query rows per kv head. Compiled where
// the level has the AMX instructions (QKV_AMX: the avx512_bf16 build) and run where the CPU
// and the OS grant the tiles (amx_permitted; bf16_path in decode_cpu.cpp chooses it).
// Stores its scores through decode_qk_avx512.h, shares the softmax (decode_softmax.h) and
// the pairs' column order (unpermute_pairs, decode_pv_avx512.h).
#pragma once

#include <ATen/native/CPUBlas.h>  // brgemm_release: the tiles left as oneDNN expects

#include "decode_pv_avx512.h"  // unpermute_pairs
#include "decode_qk_avx512.h"  // transpose16, store_score_rows
#include "amx_tiles.h"
#include "decode_softmax.h"

namespace {

// -------------------------------------------------------------------------------------------
// bf16 K/V on AMX tiles (Intel server cores): both products as tile multiplies, which also
// serve many query rows (G·Tq up to 64 and more: beams, drafts) at memory speed, where the
// vector loops above run out of arithmetic. Per block of 64 keys:
//   * Sᵀ = K Qᵀ per tile of 16 keys: K is the A operand, read straight from the cache
//     (16 keys x 32 dims per tile load), Qᵀ the B operand, packed once per segment in
//     pairs of dims (rows of Mt = min(R, 16) queries; more rows in groups of Mt); Sᵀ is
//     transposed back to rows of 16 keys, where visibility and the softmax work as above;
//   * acc += P V: P (bf16 rows of 64 keys) is the A operand; V is the B operand, its key
//     pairs interleaved per 32 columns into a block buffer (the order of pv_pairs, put right
//     by unpermute_pairs at the end); acc (Rpad x dvp) lives in memory and is loaded and
//     stored per tile of 16 columns.
// Needs d and dv multiples of 32. Tiles: 0 Sᵀ, 1 K / V, 2 Qᵀ, 3 and 6 acc, 4 V, 5 and 7 P.
#if defined(QKV_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QKV_AMX 1

// Rows of the AMX path: groups of Mt query rows, padded to Rpad.
struct AmxRows {
  int64_t Mt, groups, Rpad;
  explicit AmxRows(int64_t R)
      : Mt(std::min<int64_t>(R, 16)), groups((R + Mt - 1) / Mt), Rpad(groups * Mt) {}
};

// Scratch of the AMX path (bytes, 64-aligned): Qᵀ packed, Sᵀ of one tile, P, V of one block.
static inline int64_t amx_scratch_bytes(int64_t R, int64_t d, int64_t dv) {
  const AmxRows g(R);
  return g.Rpad * d * 2 + 4 * 16 * 64 + g.Rpad * kBlock * 2 + kBlock * dv * 2 + kBlock * d * 2 +
         5 * 64;
}

static void run_segment_amx(const Problem<BFloat16>& P, int64_t n, int64_t k0, int64_t k1,
                            float* m, float* l, float* acc, int64_t dvp, const Scratch& sc,
                            char* amx) {
  const int64_t R = P.R, d = P.d, dv = P.dv, nc = d / 32, ct_n = dv / 16;
  const AmxRows g(R);
  const int64_t Mt = g.Mt;
  auto align = [](char* p) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); };
  uint32_t* qt = reinterpret_cast<uint32_t*>(align(amx));  // [group][chunk][pair][row]
  float* st = reinterpret_cast<float*>(align(reinterpret_cast<char*>(qt + g.Rpad * d / 2)));
  BFloat16* pb = reinterpret_cast<BFloat16*>(st + 4 * 16 * 16);  // P: Rpad x kBlock
  uint32_t* vb = reinterpret_cast<uint32_t*>(
      align(reinterpret_cast<char*>(pb + g.Rpad * kBlock)));  // V: [half][col tile][pair][16]
  BFloat16* kbuf = reinterpret_cast<BFloat16*>(align(reinterpret_cast<char*>(vb + kBlock * dv / 2)));
  // Qᵀ in pairs of dims: qt[((grp·nc + c)·16 + p)·Mt + i] = dims (32c + 2p, +1) of row grp·Mt + i
  const uint32_t* Q = reinterpret_cast<const uint32_t*>(P.q + n * R * d);
  for (int64_t grp = 0; grp < g.groups; ++grp)
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t i = 0; i < Mt; ++i) {
          const int64_t r = grp * Mt + i;
          qt[((grp * nc + c) * 16 + p) * Mt + i] = r < R ? Q[r * (d / 2) + c * 16 + p] : 0u;
        }
  std::memset(static_cast<void*>(pb), 0, g.Rpad * kBlock * sizeof(BFloat16));
  row_ranges(P, n, sc);
  for (int64_t r = 0; r < R; ++r) m[r] = kNegInf, l[r] = 0.f;
  TileConfig cfg;
  auto tile = [&](int t, int rows, int colsb) { cfg.rows[t] = rows, cfg.colsb[t] = colsb; };
  tile(0, 16, int(Mt * 4));  // Sᵀ: 16 keys x Mt rows (fp32)
  tile(1, 16, 64);           // K: 16 keys x 32 dims; V: 16 key pairs x 16 columns
  tile(2, 16, int(Mt * 4));  // Qᵀ: 16 dim pairs x Mt rows
  tile(4, 16, 64);           // V, second half of the block
  for (int t : {3, 6}) tile(t, int(Mt), 64);  // acc: Mt rows x 16 columns
  for (int t : {5, 7}) tile(t, int(Mt), 64);  // P: Mt rows x 32 keys
  _tile_loadconfig(&cfg);
  const float c2 = P.c2;
  const int64_t kb_bytes = P.k2s * int64_t(sizeof(BFloat16));

  for (int64_t kb = k0; kb < k1; kb += kBlock) {
    const int64_t nk = std::min(kBlock, k1 - kb);
    // ---- S (R x kBlock), log2 units, -inf where not visible
    // kpf: the same tile two blocks ahead, prefetched into L2 a line per row as each chunk of
    // this one is multiplied (spread over the arithmetic, as the vector path does)
    const BFloat16 *kp[4], *kpf[4] = {};
    int64_t ks[4], jobs = 0;
    for (int64_t t = 0; t < 4; ++t) {
      const int64_t t0 = t * kTile, nt = std::clamp<int64_t>(nk - t0, 0, kTile), kt = kb + t0;
      ks[t] = kb_bytes, kp[t] = nt ? P.krow(n, kt) : nullptr;
      if (nt == 0) {
        for (int64_t r = 0; r < R; ++r)
          _mm512_storeu_ps(sc.S + r * kBlock + t0, _mm512_set1_ps(kNegInf));
        continue;
      }
      jobs = (t + 1) * g.groups;
      if (nt < kTile || P.rows) {  // a partial or gathered tile: its rows copied (keys past
        // nt come out -inf whatever the stale rows hold)
        BFloat16* buf = kbuf + t0 * d;
        for (int64_t j = 0; j < nt; ++j) copy_row(buf + j * d, P.krow(n, kt + j), d);
        kp[t] = buf, ks[t] = d * int64_t(sizeof(BFloat16));
      } else if (kt + 2 * kBlock + kTile <= k1) {
        kpf[t] = P.krow(n, kt + 2 * kBlock);
      }
    }
    // jobs (key tile, row group), up to 4 at once in independent accumulators (tiles 0, 3,
    // 5, 6) when all tiles have one shape (Mt = 16), else one at a time
    const int64_t batch = Mt == 16 ? 4 : 1;
    for (int64_t j0 = 0; j0 < jobs; j0 += batch) {
      const int64_t nj = std::min(batch, jobs - j0);
      auto kq = [&](int64_t slot, int64_t c, const void*& a, int64_t& as, const void*& b) {
        const int64_t t = (j0 + slot) / g.groups, grp = (j0 + slot) % g.groups;
        a = kp[t] + 32 * c, as = ks[t], b = qt + (grp * nc + c) * 16 * Mt;
        if (grp == 0 && kpf[t])
          for (int64_t j = 0; j < kTile; ++j) pf_line(kpf[t] + j * P.k2s + 32 * c);
      };
      _tile_zero(0);
      if (nj > 1) _tile_zero(3);
      if (nj > 2) _tile_zero(5);
      if (nj > 3) _tile_zero(6);
      // job `slot`, chunk c: K into tile A, Qᵀ into tile B, summed into tile C (tile numbers
      // are immediates of the instructions, hence a macro rather than a loop)
#define QKV_S_JOB(slot, A, B, C) \
  kq(slot, c, a, as, b);         \
  _tile_loadd(A, a, as);         \
  _tile_loadd(B, b, Mt * 4);     \
  _tile_dpbf16ps(C, A, B)
      for (int64_t c = 0; c < nc; ++c) {
        const void *a, *b;
        int64_t as;
        QKV_S_JOB(0, 1, 2, 0);
        if (nj < 2) continue;
        QKV_S_JOB(1, 4, 7, 3);
        if (nj < 3) continue;
        QKV_S_JOB(2, 1, 2, 5);
        if (nj < 4) continue;
        QKV_S_JOB(3, 4, 7, 6);
      }
#undef QKV_S_JOB
      _tile_stored(0, st, 64);
      if (nj > 1) _tile_stored(3, st + 256, 64);
      if (nj > 2) _tile_stored(5, st + 512, 64);
      if (nj > 3) _tile_stored(6, st + 768, 64);
      for (int64_t slot = 0; slot < nj; ++slot) {
        const int64_t t = (j0 + slot) / g.groups, grp = (j0 + slot) % g.groups;
        const int64_t t0 = t * kTile, nt = std::min(kTile, nk - t0), kt = kb + t0;
        __m512 x[16];
        for (int j = 0; j < 16; ++j) x[j] = _mm512_loadu_ps(st + 256 * slot + 16 * j);
        transpose16(x);  // x[i]: the 16 keys' scores of row grp·Mt + i
        store_score_rows(x, grp * Mt, Mt, R, kt, nt, t0, sc, c2);
      }
    }
    // ---- online softmax: P in bf16 rows of kBlock keys (rows past R stay 0)
    softmax_block<true>(sc.S, reinterpret_cast<float*>(pb), R, m, l, acc, dvp);
    // ---- V of the block, key pairs interleaved (rows past nk: zeros, as their P)
    const bool pf_v = nk == kBlock && !P.rows && kb + 3 * kBlock <= k1;
    const bool two = nk > 32;  // keys in the block's second half
    for (int64_t jp = 0; jp < (two ? kBlock / 2 : 16); ++jp) {
      const int64_t j = 2 * jp, half = jp / 16, p = jp % 16;
      const BFloat16* x0 = j < nk ? P.vrow(n, kb + j) : nullptr;
      const BFloat16* x1 = j + 1 < nk ? P.vrow(n, kb + j + 1) : nullptr;
      if (pf_v) {
        const char* f0 = reinterpret_cast<const char*>(P.vrow(n, kb + 2 * kBlock + j));
        const int64_t vbytes = P.v2s * int64_t(sizeof(BFloat16));
        for (int64_t c = 0; c < dv * 2; c += 64) pf_line(f0 + c), pf_line(f0 + vbytes + c);
      }
      for (int64_t c = 0; c < dv; c += 32) {
        const __m512i a = x0 ? _mm512_loadu_si512(x0 + c) : _mm512_setzero_si512();
        const __m512i b = x1 ? _mm512_loadu_si512(x1 + c) : _mm512_setzero_si512();
        const int64_t ct = c / 16;  // lo half -> tile ct, hi half -> ct + 1
        _mm512_storeu_si512(vb + ((half * ct_n + ct) * 16 + p) * 16, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(vb + ((half * ct_n + ct + 1) * 16 + p) * 16, _mm512_unpackhi_epi16(a, b));
      }
    }
    // ---- acc += P V, two tiles of 16 columns at a time
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const BFloat16* pg = pb + grp * Mt * kBlock;
      _tile_loadd(7, pg, kBlock * 2);
      if (two) _tile_loadd(5, pg + 32, kBlock * 2);
      float* og = acc + grp * Mt * dvp;
      for (int64_t ct = 0; ct < ct_n; ct += 2) {
        _tile_loadd(6, og + 16 * ct, dvp * 4);
        _tile_loadd(3, og + 16 * (ct + 1), dvp * 4);
        _tile_loadd(1, vb + ct * 256, 64);
        _tile_loadd(4, vb + (ct + 1) * 256, 64);
        _tile_dpbf16ps(6, 7, 1);
        _tile_dpbf16ps(3, 7, 4);
        if (two) {
          _tile_loadd(1, vb + (ct_n + ct) * 256, 64);
          _tile_loadd(4, vb + (ct_n + ct + 1) * 256, 64);
          _tile_dpbf16ps(6, 5, 1);
          _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(6, og + 16 * ct, dvp * 4);
        _tile_stored(3, og + 16 * (ct + 1), dvp * 4);
      }
    }
  }
  // leave the tiles as oneDNN expects to find them (it keeps its own configuration)
  at::native::cpublas::brgemm_release(true);
  unpermute_pairs(acc, R, dvp);
}
#endif  // AMX

}  // namespace
