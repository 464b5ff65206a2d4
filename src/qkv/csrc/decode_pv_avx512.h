// acc += P V on the AVX-512 levels: bf16 values on key pairs (vdpbf16ps, pv_pairs; its column
// order put back by unpermute_pairs, which the AMX path uses too), fp32/bf16/int8 values in
// register blocks of up to 4 rows x 64 columns per tile (pv_tile), and a whole block at once
// for many rows with its prefetch spread over the calls (pv_spread). Called by a segment's
// block loop (decode_segment.h) after the softmax.
#pragma once

#include "decode_qk_avx512.h"  // load16, lanes

namespace {

#ifdef QKV_AVX512
#ifdef __AVX512BF16__
// acc += P V for one tile of 16 bf16 value rows (vp, row stride vs), P in bf16 (row r at
// p + r·kBlock), with vdpbf16ps on key pairs: for each 32-column chunk the rows j, j+1 are
// interleaved (vpunpcklwd/hwd: fp32 lane 4L+i then holds column 8L+i, resp. 8L+4+i, of the
// chunk) and each query row adds p_j·v_j + p_{j+1}·v_{j+1} in one instruction. The chunk's
// "lo" half goes to acc[c, c+16), "hi" to acc[c+16, c+32): unpermute_pairs restores the order.
static inline void pv_pairs(const BFloat16* vp, int64_t vs, int64_t dv, const BFloat16* p,
                            int64_t R, float* acc, int64_t dvp, const BFloat16* pf) {
  auto pair = [&](int64_t r, int jp) {  // (p_2jp, p_2jp+1) of row r, broadcast
    int32_t w;
    std::memcpy(&w, p + r * kBlock + 2 * jp, sizeof(w));
    return (__m512bh)_mm512_set1_epi32(w);
  };
  for (int64_t c = 0; c < dv; c += 32) {
    const __mmask32 cm = dv - c >= 32 ? ~__mmask32(0) : __mmask32((1u << (dv - c)) - 1u);
    __m512bh lo[8], hi[8];
    if (pf)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * vs + c);
    for (int jp = 0; jp < 8; ++jp) {
      const __m512i x = _mm512_maskz_loadu_epi16(cm, vp + (2 * jp) * vs + c);
      const __m512i y = _mm512_maskz_loadu_epi16(cm, vp + (2 * jp + 1) * vs + c);
      lo[jp] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[jp] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {  // four rows: eight independent chains
      float* o = acc + r * dvp + c;
      __m512 a[8];
      for (int i = 0; i < 4; ++i)
        a[2 * i] = _mm512_loadu_ps(o + i * dvp), a[2 * i + 1] = _mm512_loadu_ps(o + i * dvp + 16);
      for (int jp = 0; jp < 8; ++jp)
        for (int i = 0; i < 4; ++i) {
          const __m512bh w = pair(r + i, jp);
          a[2 * i] = _mm512_dpbf16_ps(a[2 * i], lo[jp], w);
          a[2 * i + 1] = _mm512_dpbf16_ps(a[2 * i + 1], hi[jp], w);
        }
      for (int i = 0; i < 4; ++i)
        _mm512_storeu_ps(o + i * dvp, a[2 * i]), _mm512_storeu_ps(o + i * dvp + 16, a[2 * i + 1]);
    }
    for (; r < R; ++r) {  // one row: four chains
      float* o = acc + r * dvp + c;
      __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16);
      __m512 b0 = _mm512_setzero_ps(), b1 = b0;
      for (int jp = 0; jp < 8; jp += 2) {
        const __m512bh w0 = pair(r, jp), w1 = pair(r, jp + 1);
        a0 = _mm512_dpbf16_ps(a0, lo[jp], w0), a1 = _mm512_dpbf16_ps(a1, hi[jp], w0);
        b0 = _mm512_dpbf16_ps(b0, lo[jp + 1], w1), b1 = _mm512_dpbf16_ps(b1, hi[jp + 1], w1);
      }
      _mm512_storeu_ps(o, _mm512_add_ps(a0, b0)), _mm512_storeu_ps(o + 16, _mm512_add_ps(a1, b1));
    }
  }
}
#else
static inline void pv_pairs(const BFloat16*, int64_t, int64_t, const BFloat16*, int64_t, float*,
                            int64_t, const BFloat16*) {}  // never called: kPairs is false without AVX512_BF16
#endif
#endif  // QKV_AVX512

#ifdef QKV_AVX512
// acc += P V for nj value rows (a tile of 16 or a whole block; vp, row stride vs; fp32 or bf16
// widened), P in fp32 (row r at p + r·kBlock). Register-blocked: up to 4 rows x 4 column chunks (16
// accumulators) stay in registers over the 16 keys, so each value chunk is loaded once per
// 4 rows and each weight broadcast once per 64 columns (the row-at-a-time loop broadcast
// every weight once per 16 columns and reloaded acc per 16 keys: twice the memory ops).
// kPf: also prefetch into L2, spread over the arithmetic, for each key j: 1, the chunk's
// lines of row j of the tile two blocks ahead (pf); 2, the one line at pf + j·vs. A template
// flag, not a runtime test: with a branch in the loop GCC 12 keeps a copy of the accumulators
// on the stack, 16 stores per key, and the loop runs at half speed.
template <int kRows, int kCols, int kPf, typename T>
[[gnu::noinline]] static void pv_block(const T* vp, int64_t vs, int64_t c, __mmask16 last,
                            const float* p, float* o, int64_t dvp, const T* pf, int nj) {
  __m512 a[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) a[i][u] = _mm512_loadu_ps(o + i * dvp + c + 16 * u);
  for (int j = 0; j < nj; ++j) {
    if constexpr (kPf == 1)  // c is a multiple of 64 columns: chunk u starts a new 64-byte line
                        // exactly when 16·u·sizeof(T) is a multiple of 64
      for (int u = 0; u < kCols; ++u)
        if ((16 * u * sizeof(T)) % 64 == 0) pf_line(pf + j * vs + c + 16 * u);
    if constexpr (kPf == 2) pf_line(pf + j * vs);
    __m512 v[kCols];
    for (int u = 0; u < kCols; ++u)
      v[u] = u + 1 < kCols ? load16(vp + j * vs + c + 16 * u)
                           : load16(vp + j * vs + c + 16 * u, last);
    for (int i = 0; i < kRows; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * kBlock + j]);
      for (int u = 0; u < kCols; ++u) a[i][u] = _mm512_fmadd_ps(v[u], w, a[i][u]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) _mm512_storeu_ps(o + i * dvp + c + 16 * u, a[i][u]);
}

template <int kRows, bool kPf, typename T>
static inline void pv_rows(const T* vp, int64_t vs, int64_t dv, const float* p, float* o,
                           int64_t dvp, const T* pf, int nj) {
  int64_t c = 0;
  for (; c + 64 <= dv; c += 64) pv_block<kRows, 4, kPf>(vp, vs, c, 0xffff, p, o, dvp, pf, nj);
  const int64_t rest = dv - c;  // 0..63 columns: 1-4 chunks, the last one masked
  if (rest <= 0) return;
  const __mmask16 last = lanes(rest - (rest - 1) / 16 * 16);
  switch ((rest + 15) / 16) {
    case 1: pv_block<kRows, 1, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    case 2: pv_block<kRows, 2, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    case 3: pv_block<kRows, 3, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    default: pv_block<kRows, 4, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
  }
}

template <bool kPf, typename T>
static inline void pv_groups(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                             float* acc, int64_t dvp, const T* pf, int nj) {
  int64_t r = 0;
  if (R >= 4) {  // the first row group prefetches (when kPf), the others do not
    pv_rows<4, kPf>(vp, vs, dv, p, acc, dvp, pf, nj);
    for (r = 4; r + 4 <= R; r += 4)
      pv_rows<4, false>(vp, vs, dv, p + r * kBlock, acc + r * dvp, dvp, pf, nj);
    if (r == R) return;
    return pv_groups<false>(vp, vs, dv, p + r * kBlock, R - r, acc + r * dvp, dvp, pf, nj);
  }
  switch (R) {
    case 1: pv_rows<1, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    case 2: pv_rows<2, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    case 3: pv_rows<3, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    default: break;
  }
}

// pv_block for call q of a block: calls q = 0, stride, 2·stride, ... prefetch line q / stride
// of every value row of the block two ahead (pf + j·vs + 64·(q / stride) bytes) while there
// are lines left; the others fetch nothing.
template <int kRows, int kCols, typename T>
static inline void pv_call(const T* vp, int64_t vs, int64_t c, __mmask16 last, const float* p,
                           float* o, int64_t dvp, const T* pf, int nj, int64_t q, int64_t lines,
                           int64_t stride) {
  if (pf && q % stride == 0 && q / stride < lines) {
    const char* line = reinterpret_cast<const char*>(pf) + 64 * (q / stride);
    pv_block<kRows, kCols, 2>(vp, vs, c, last, p, o, dvp, reinterpret_cast<const T*>(line), nj);
  } else
    pv_block<kRows, kCols, 0>(vp, vs, c, last, p, o, dvp, static_cast<const T*>(nullptr), nj);
}

template <int kRows, typename T>
static inline void pv_rows_spread(const T* vp, int64_t vs, int64_t dv, const float* p, float* o,
                                  int64_t dvp, const T* pf, int nj, int64_t& q, int64_t lines,
                                  int64_t stride) {
  int64_t c = 0;
  for (; c + 64 <= dv; c += 64, ++q)
    pv_call<kRows, 4>(vp, vs, c, 0xffff, p, o, dvp, pf, nj, q, lines, stride);
  const int64_t rest = dv - c;
  if (rest <= 0) return;
  const __mmask16 last = lanes(rest - (rest - 1) / 16 * 16);
  switch ((rest + 15) / 16) {
    case 1: pv_call<kRows, 1>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    case 2: pv_call<kRows, 2>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    case 3: pv_call<kRows, 3>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    default: pv_call<kRows, 4>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
  }
  ++q;
}

// acc += P V for a whole block of kBlock value rows (vs apart) with many query rows (the
// arithmetic-bound case), the prefetch of the block two ahead (pf) spread over all its calls
// (row groups x column chunks): each fetches at most one line per key, so the DRAM requests
// keep pace with the arithmetic. (Issued all by the first row group, as pv_tile does, they
// came in a burst that filled the line-fill buffers, stalling the loads from L2, and then
// nothing was fetched for the rest of the block: Tk = 16384, 16 rows, fp32, 1 thread,
// same process, 18.6 -> 15.3 ms.)
template <typename T>
static void pv_spread(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R, float* acc,
                      int64_t dvp, const T* pf) {
  const int64_t lines = (dv * int64_t(sizeof(T)) + 63) / 64;
  const int64_t calls = (R + 3) / 4 * ((dv + 63) / 64);
  const int64_t stride = std::max<int64_t>(1, calls / std::max<int64_t>(lines, 1));  // dv = 0
  constexpr int nj = kBlock;
  int64_t q = 0, r = 0;
  for (; r + 4 <= R; r += 4)
    pv_rows_spread<4>(vp, vs, dv, p + r * kBlock, acc + r * dvp, dvp, pf, nj, q, lines, stride);
  const float* pr = p + r * kBlock;
  float* ar = acc + r * dvp;
  switch (R - r) {
    case 1: pv_rows_spread<1>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    case 2: pv_rows_spread<2>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    case 3: pv_rows_spread<3>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    default: break;
  }
}

template <typename T>
static inline void pv_tile(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                           float* acc, int64_t dvp, const T* pf) {
  constexpr int nj = kTile;
  if (pf)
    pv_groups<true>(vp, vs, dv, p, R, acc, dvp, pf, nj);
  else
    pv_groups<false>(vp, vs, dv, p, R, acc, dvp, pf, nj);
}
#endif  // QKV_AVX512

// The column order of pv_pairs back to the natural one, in each 32-column chunk of acc's rows.
static inline void unpermute_pairs(float* acc, int64_t R, int64_t dvp) {
  float tmp[32];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < dvp; c += 32) {
      float* a = acc + r * dvp + c;
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 4; ++i) tmp[8 * L + i] = a[4 * L + i], tmp[8 * L + 4 + i] = a[16 + 4 * L + i];
      std::memcpy(a, tmp, sizeof(tmp));
    }
}

}  // namespace
