// int8 K/V on int16 pairs: whether a build and CPU take them (QKV_DECODE_INT8,
// int8_on_int16) and P·V of a block of int8 value rows on them, the VNNI loops of the AVX-512
// levels (pv_i16) or the avx2 level's (pv_i16_avx2, decode_avx2.h) behind one call,
// pv_int16_pairs. The scores' int16 forms live with the other scores (I16Dots in
// decode_qk_avx512.h, dots_i16_avx2 in decode_avx2.h). Called by a segment's block loop
// (decode_segment.h).
#pragma once

#include "decode_qk_avx512.h"  // QKV_I16_DOTS
#include "decode_avx2.h"       // weights_i16, pv_i16_avx2

namespace {

// int8 K/V on int16 pairs (the default where the AVX-512 builds may issue VNNI, and on the
// avx2 level), or widened to fp32: QKV_DECODE_INT8=int16|widen (the tests run both). The
// avx512 build on a CPU without VNNI widens unless told int16 (then vpmaddwd + vpaddd).
static bool int8_on_int16() {
  static const bool on = [] {
    const std::string want = path_setting("QKV_DECODE_INT8", {"auto", "int16", "widen"});
#if defined(QKV_I16_DOTS)
    return want == "int16" || (want == "auto" && qkv_simd::vnni512_allowed());
#elif defined(QKV_I16_AVX2)
    return want != "widen";
#else
    return false;
#endif
  }();
  return on;
}

#ifdef QKV_I16_DOTS

// acc += P V for kR rows, columns [c, c + 64), from the int16 weight pairs w (row stride
// kBlock / 2) of one block of int8 value rows vr (zero rows past its keys), multiplied in
// exact int32 sums by vpdpwssd on key pairs: the rows 2i, 2i + 1 are interleaved byte by byte
// (vpunpck{l,h}bw per 128-bit lane, then widened to int16 pairs), so one instruction adds
// p_2i·v_2i + p_2i+1·v_2i+1 for 16 columns, where widening every value to fp32 took two
// instructions before the FMAs. Lanes of the "lo" half hold columns 0-7 and 16-23 of each
// 32, "hi" 8-15 and 24-31: put back in order when the sums are added to acc. The row count
// is fixed and every loop over the accumulators unrolled, so that they stay in registers
// (with a run-time count GCC kept them on the stack: a load and a store around each
// vpdpwssd). pf: every line of pf's rows (pfs apart) prefetched, two rows per step.
template <int kR, bool kVnni>
[[gnu::noinline]] static void pv_i16_rows(const int8_t* const* vr, int64_t c, const int32_t* w,
                                          const float* wscale, float* o, int64_t dvp,
                                          const int8_t* pf, int64_t pfs) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  __m512i a[kR][4];
#pragma GCC unroll 16
  for (int i = 0; i < kR * 4; ++i) a[i / 4][i % 4] = _mm512_setzero_si512();
  for (int64_t jp = 0; jp < kBlock / 2; ++jp) {
    if (pf)
      for (int64_t b = 2 * jp * pfs; b < (2 * jp + 2) * pfs; b += 64) pf_line(pf + b);
    const int8_t* x = vr[2 * jp] + c;
    const int8_t* y = vr[2 * jp + 1] + c;
    __m512i v[4];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h));
      const __m256i ya = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32 * h));
      v[2 * h] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(xa, ya));
      v[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(xa, ya));
    }
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      const __m512i p = _mm512_set1_epi32(w[r * (kBlock / 2) + jp]);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) qkv_simd::dpwssd<kVnni>(a[r][u], p, v[u]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r) {
    float* orow = o + r * dvp + c;
    const __m512 s = _mm512_set1_ps(wscale[r]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 lo = _mm512_cvtepi32_ps(a[r][2 * h]), hi = _mm512_cvtepi32_ps(a[r][2 * h + 1]);
      float* oh = orow + 32 * h;
      _mm512_storeu_ps(oh, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), s, _mm512_loadu_ps(oh)));
      _mm512_storeu_ps(oh + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), s, _mm512_loadu_ps(oh + 16)));
    }
  }
}

// acc += P V for one block of int8 value rows (vr[j]: row of key j, its scale already folded
// into P, zero rows past the block's keys), P quantized per row to int16 (at most 1/65534 of
// the row's largest weight), then pv_i16_rows on blocks of up to 4 rows x 64 columns. Needs
// dv a multiple of 64. pf: the rows (pfs apart) of the block two ahead, prefetched into L2
// over the first pass, or nullptr.
template <bool kVnni>
static void pv_i16(const int8_t* const* vr, int64_t dv, const float* P, int64_t R, float* acc,
                   int64_t dvp, const int8_t* pf, int64_t pfs) {
  alignas(64) int32_t pairs[kWidenRows][kBlock / 2];  // (w_2i, w_2i+1) as int16 pairs
  float wscale[kWidenRows];
  weights_i16(P, R, pairs, wscale);
  for (int64_t c = 0; c < dv; c += 64)
    for (int64_t r = 0; r < R; r += 4) {
      const int8_t* f = c == 0 && r == 0 ? pf : nullptr;
      const int32_t* w = pairs[r];
      float* o = acc + r * dvp;
      switch (std::min<int64_t>(4, R - r)) {
        case 4: pv_i16_rows<4, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        case 3: pv_i16_rows<3, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        case 2: pv_i16_rows<2, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        default: pv_i16_rows<1, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
      }
    }
}
#endif

#if defined(QKV_I16_DOTS) || defined(QKV_I16_AVX2)
// P·V of a block of int8 value rows on int16 pairs: the VNNI loops (columns in chunks of 64)
// or the avx2 level's (chunks of 16); pair_op names the instruction (native_status)
#ifdef QKV_I16_DOTS
constexpr int64_t kPairCols = 64;
static const char* pair_op() {
#ifdef QKV_VNNI512
  return "vpdpwssd";
#else
  return qkv_simd::vnni512_allowed() ? "vpdpwssd, AVX512_VNNI" : "vpmaddwd";
#endif
}
#else
constexpr int64_t kPairCols = 16;
static const char* pair_op() { return qkv_simd::avxvnni_allowed() ? "vpdpwssd, AVX-VNNI" : "vpmaddwd"; }
#endif
static inline void pv_int16_pairs(const int8_t* const* vr, int64_t dv, const float* P, int64_t R,
                                  float* acc, int64_t dvp, const int8_t* pf, int64_t pfs) {
#ifdef QKV_I16_DOTS
  qkv_simd::with_vnni512([&](auto kVnni) { pv_i16<decltype(kVnni)::value>(vr, dv, P, R, acc, dvp, pf, pfs); });
#else
  qkv_simd::with_avxvnni([&](auto kVnni) { pv_i16_avx2<decltype(kVnni)::value>(vr, dv, P, R, acc, dvp, pf, pfs); });
#endif
}
#endif

}  // namespace
