// The scores S = Q Kᵀ of a tile of 16 keys on the AVX-512 levels: the row loads (load16), the
// dot products (4 rows x 4 keys in registers, summed across lanes by one transpose-and-add
// tree), their bf16 (vdpbf16ps) and int8-on-int16 (vpdpwssd) forms, the broadcast form for
// many fp32 rows, and the visibility (mask bits, -inf) as the scores are stored. Called by a
// segment's block loop (decode_segment.h); the AMX path (decode_amx.h) stores its scores
// through transpose16 and store_score_rows.
#pragma once

#include "decode_common.h"

namespace {

// -------------------------------------------------------------------------------------------
// Vector pieces (AVX-512)
#ifdef QKV_AVX512
using qkv_simd::exp2_v;  // 2^t for 16 lanes

using qkv_simd::lanes;  // the first n (0..16) lanes

// 16 values of a row as fp32 (lanes off in k: 0)
static inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const BFloat16* p, __mmask16 k) {
  const __m256i b = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline __m512 load16(const BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline __m512 load16(const int8_t* p, __mmask16 k) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// lanes j of the result = sum of the 16 lanes of a[j]: a transpose-and-add tree (45 ops)
[[gnu::always_inline]] static inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

// q·k for 16 keys (rows kp, kp + ks, ...), q in fp32 (zero past d): one vector of scores
// pf: the same rows of a later tile, prefetched into L2 line by line as these are read
// (spread over the arithmetic rather than issued in a burst), or nullptr.

template <typename T>
static inline __m512 dots16(const float* q, const T* kp, int64_t ks, int64_t d, const T* pf) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
    if (pf && (c * int64_t(sizeof(T))) % 64 == 0)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * ks + c);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, load16(kp + j * ks + c), a[j]);
  }
  if (c < d) {
    const __mmask16 t = lanes(d - c);
    const __m512 qv = _mm512_loadu_ps(q + c);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, load16(kp + j * ks + c, t), a[j]);
  }
  return reduce16(a);
}

#ifdef __AVX512BF16__
// bf16 keys: 32 products per instruction (vdpbf16ps, fp32 sums); q as bf16 pairs, zero past d
static inline __m512 dots16_bf16(const BFloat16* q, const BFloat16* kp, int64_t ks, int64_t d,
                                  const BFloat16* pf) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    if (pf)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * ks + c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(kp + j * ks + c));
  }
  if (c < d) {
    const __mmask32 t = d - c >= 32 ? ~__mmask32(0) : __mmask32((1u << (d - c)) - 1u);
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(t, kp + j * ks + c));
  }
  return reduce16(a);
}
#else
static inline __m512 dots16_bf16(const BFloat16*, const BFloat16*, int64_t, int64_t,
                                  const BFloat16*) {  // never called: kPairs needs AVX512_BF16
  return _mm512_setzero_ps();
}
#endif

// The same for the common head sizes, d = 16·kC (fp32) or 32·kC (bf16 pairs): q stays in
// registers and each key is one row pointer with its chunks at constant offsets. (The
// generic loops keep 16 row pointers and 16 prefetch pointers live; GCC 12 spills them and
// reloads one from the stack per FMA.) kPf: prefetch the same rows of pf, as dots16.
template <int kC, bool kPf, typename T>
[[gnu::noinline]] static __m512 dots16_fixed(const float* q, const T* kp, int64_t ks, const T* pf) {
  __m512 qv[kC], a[16];
  for (int c = 0; c < kC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const T* kr = kp + j * ks;
    if constexpr (kPf)
      for (int c = 0; c < kC; ++c)
        if ((16 * c * sizeof(T)) % 64 == 0) pf_line(pf + j * ks + 16 * c);
    __m512 x = _mm512_mul_ps(qv[0], load16(kr));
    for (int c = 1; c < kC; ++c) x = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), x);
    a[j] = x;
  }
  return reduce16(a);
}

#ifdef __AVX512BF16__
template <int kC, bool kPf>
[[gnu::noinline]] static __m512 dots16_bf16_fixed(const BFloat16* q, const BFloat16* kp, int64_t ks,
                                       const BFloat16* pf) {
  __m512bh qv[kC];
  __m512 a[16];
  for (int c = 0; c < kC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const BFloat16* kr = kp + j * ks;
    if constexpr (kPf)
      for (int c = 0; c < kC; ++c) pf_line(pf + j * ks + 32 * c);
    __m512 x = _mm512_setzero_ps();
    for (int c = 0; c < kC; ++c)
      x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
    a[j] = x;
  }
  return reduce16(a);
}
#endif

// x, kept in a register: GCC otherwise folds a load used by 4 FMAs into each of them as a
// memory operand, i.e. loads it 4 times, which is what the blocking is meant to avoid.
template <typename V>
static inline V in_register(V x) {
  asm("" : "+v"(x));
  return x;
}

// v[kg] holds lanes 4·row + key of keys 4kg..4kg+3: a 4x4 transpose of 128-bit lanes gives
// out[row] with the 16 keys in order.
static inline void rows_by_lanes(const __m512* v, __m512* out) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t2 = _mm512_shuffle_f32x4(v[0], v[1], 0xee), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
  out[0] = _mm512_shuffle_f32x4(t0, t1, 0x88), out[1] = _mm512_shuffle_f32x4(t0, t1, 0xdd);
  out[2] = _mm512_shuffle_f32x4(t2, t3, 0x88), out[3] = _mm512_shuffle_f32x4(t2, t3, 0xdd);
}

// How dots16xR takes one chunk of a key row and of a query row (kWidth elements each) and
// adds their products into an accumulator: FMAs on fp32 (keys of any dtype widened by
// load16); vdpbf16ps on bf16 pairs; vpdpwssd on int16 pairs (int8 keys, int16 queries).
template <typename T>
struct FmaDots {
  using Q = float;
  using K = T;
  using Acc = __m512;
  using V = __m512;
  static constexpr int kWidth = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V key(const K* p) { return load16(p); }
  static V query(const Q* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc a, V q, V k) { return _mm512_fmadd_ps(q, k, a); }
  static __m512 sums(Acc a) { return a; }
};

#ifdef __AVX512BF16__
struct Bf16Dots {
  using Q = BFloat16;
  using K = BFloat16;
  using Acc = __m512;
  using V = __m512i;
  static constexpr int kWidth = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V key(const K* p) { return _mm512_loadu_si512(p); }
  static V query(const Q* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc a, V q, V k) { return _mm512_dpbf16_ps(a, (__m512bh)q, (__m512bh)k); }
  static __m512 sums(Acc a) { return a; }
};
#endif

#define QKV_I16_DOTS 1
// int8 keys against queries rounded to int16: vpdpwssd sums 32 products of int16 pairs per
// instruction into exact int32 lanes (|sum| <= d · 32767 · 127 < 2^31 for d <= 512), where
// widening each key to fp32 took two instructions per 16 values before the FMAs; the lanes
// are converted to fp32 for the reduction. kVnni false: vpmaddwd + vpaddd (the avx512 build
// where the CPU lacks AVX512_VNNI; qkv_simd::dpwssd).
template <bool kVnni>
struct I16Dots {
  using Q = int16_t;
  using K = int8_t;
  using Acc = __m512i;
  using V = __m512i;
  static constexpr int kWidth = 32;
  static Acc zero() { return _mm512_setzero_si512(); }
  static V key(const K* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V query(const Q* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc a, V q, V k) {
    qkv_simd::dpwssd<kVnni>(a, q, k);
    return a;
  }
  static __m512 sums(Acc a) { return _mm512_cvtepi32_ps(a); }
};

// Scores of kR = 1..4 query rows (row stride qs) for a tile of 16 keys, d = kC chunks:
// blocks of kR rows x 4 keys keep their accumulators in registers, so each chunk of a key
// is loaded once for all kR rows (row by row, every key is loaded kR times, and those loads,
// not the FMAs, bound the loop). One reduce16 per block gives lanes 4·row + key. kPf: the
// same rows of pf prefetched, one line per 64 bytes of key.
template <typename Ops, int kR, int kC, bool kPf>
[[gnu::noinline]] static void dots16xR(const typename Ops::Q* q, int64_t qs,
                                       const typename Ops::K* kp, int64_t ks,
                                       const typename Ops::K* pf, __m512* out) {
  constexpr int W = Ops::kWidth;
  __m512 v[4];
#pragma GCC unroll 4
  for (int kg = 0; kg < 4; ++kg) {
    typename Ops::Acc a[16];
    for (int i = 0; i < 16; ++i) a[i] = Ops::zero();
    const typename Ops::K* kr = kp + 4 * kg * ks;
    for (int c = 0; c < kC; ++c) {
      if constexpr (kPf)
        if ((W * c * sizeof(typename Ops::K)) % 64 == 0)
          for (int j = 0; j < 4; ++j) pf_line(pf + (4 * kg + j) * ks + W * c);
      typename Ops::V kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = in_register(Ops::key(kr + j * ks + W * c));
      for (int r = 0; r < kR; ++r) {
        const typename Ops::V qv = in_register(Ops::query(q + r * qs + W * c));
        for (int j = 0; j < 4; ++j) a[4 * r + j] = Ops::madd(a[4 * r + j], qv, kv[j]);
      }
    }
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = Ops::sums(a[i]);
    v[kg] = reduce16(f);
  }
  rows_by_lanes(v, out);
}

// dots16xR for the head sizes with a fixed-size loop (d = 64, 128), with or without the
// prefetch; false: another d (no such loop).
template <typename Ops, int kR>
static inline bool dots16xR_fixed(const typename Ops::Q* q, int64_t qs, const typename Ops::K* kp,
                                  int64_t ks, int64_t d, const typename Ops::K* pf, __m512* out) {
  constexpr int kC = 128 / Ops::kWidth;  // chunks of a row of 128
  if (d == 128)
    pf ? dots16xR<Ops, kR, kC, true>(q, qs, kp, ks, pf, out) : dots16xR<Ops, kR, kC, false>(q, qs, kp, ks, pf, out);
  else if (d == 64)
    pf ? dots16xR<Ops, kR, kC / 2, true>(q, qs, kp, ks, pf, out) : dots16xR<Ops, kR, kC / 2, false>(q, qs, kp, ks, pf, out);
  else
    return false;
  return true;
}

template <int kR, bool kDot, typename T>
static inline bool qk_rows_fixed(const void* q0, int64_t qs, const T* kp, int64_t ks, int64_t d,
                                 const T* pf, __m512* out) {
  if constexpr (kDot) {
#ifdef __AVX512BF16__
    return dots16xR_fixed<Bf16Dots, kR>(static_cast<const BFloat16*>(q0), qs, kp, ks, d, pf, out);
#else
    return false;
#endif
  } else {
    return dots16xR_fixed<FmaDots<T>, kR>(static_cast<const float*>(q0), qs, kp, ks, d, pf, out);
  }
}

// The scores of nr = 3 or 4 rows at once where a fixed-size loop exists (d = 64, 128);
// false: none (the caller goes row by row).
template <bool kDot, typename T>
static inline bool qk_rows(int64_t nr, const void* q0, int64_t qs, const T* kp, int64_t ks,
                           int64_t d, const T* pf, __m512* out) {
  if (nr == 4) return qk_rows_fixed<4, kDot>(q0, qs, kp, ks, d, pf, out);
  if (nr == 3) return qk_rows_fixed<3, kDot>(q0, qs, kp, ks, d, pf, out);
  return false;
}

// One row's scores for a tile of 16 keys: the fixed-size loops for d = 64 and 128.
template <typename T>
static inline __m512 qk_tile(const float* q, const T* kp, int64_t ks, int64_t d, const T* pf) {
  if (d == 128) return pf ? dots16_fixed<8, true>(q, kp, ks, pf) : dots16_fixed<8, false>(q, kp, ks, pf);
  if (d == 64) return pf ? dots16_fixed<4, true>(q, kp, ks, pf) : dots16_fixed<4, false>(q, kp, ks, pf);
  return dots16(q, kp, ks, d, pf);
}

static inline __m512 qk_tile_bf16(const BFloat16* q, const BFloat16* kp, int64_t ks, int64_t d,
                                  const BFloat16* pf) {
#ifdef __AVX512BF16__
  if (d == 128)
    return pf ? dots16_bf16_fixed<4, true>(q, kp, ks, pf) : dots16_bf16_fixed<4, false>(q, kp, ks, pf);
  if (d == 64)
    return pf ? dots16_bf16_fixed<2, true>(q, kp, ks, pf) : dots16_bf16_fixed<2, false>(q, kp, ks, pf);
#endif
  return dots16_bf16(q, kp, ks, d, pf);
}

#ifdef QKV_I16_DOTS
// The scores of nr = 1..4 rows of int16 queries (d = 64 or 128) for a tile of 16 int8 keys.
static inline void qk_rows_i16(int64_t nr, const int16_t* q, int64_t qs, const int8_t* kp,
                               int64_t ks, int64_t d, const int8_t* pf, __m512* out) {
  qkv_simd::with_vnni512([&](auto kVnni) {
    using Ops = I16Dots<decltype(kVnni)::value>;
    switch (nr) {
      case 1: dots16xR_fixed<Ops, 1>(q, qs, kp, ks, d, pf, out); break;
      case 2: dots16xR_fixed<Ops, 2>(q, qs, kp, ks, d, pf, out); break;
      case 3: dots16xR_fixed<Ops, 3>(q, qs, kp, ks, d, pf, out); break;
      default: dots16xR_fixed<Ops, 4>(q, qs, kp, ks, d, pf, out); break;
    }
  });
}
#endif

// lanes allowed by a mask row (True = may attend) among those in k
static inline __mmask16 mask_bits(const uint8_t* m, __mmask16 k) {
  return _mm_mask_cmpneq_epi8_mask(k, _mm_maskz_loadu_epi8(k, m), _mm_setzero_si128());
}

// The 16 rows of x (16 floats each) as 16 columns: out[c] lane j = x[j][c].
static inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_f32x4(a, c, 0x88), t[8 + e] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88), t[12 + e] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// x[i]: the raw scores of query row r0 + i (i < n, rows past R skipped) for the tile of keys
// [kt, kt + nt) at column t0 of the block, stored into S scaled to log2 units, -inf where the
// row may not see the key (its range, its mask row)
static inline void store_score_rows(const __m512* x, int64_t r0, int64_t n, int64_t R, int64_t kt,
                                    int64_t nt, int64_t t0, const Scratch& sc, float c2) {
  for (int64_t i = 0; i < n && r0 + i < R; ++i) {
    const int64_t r = r0 + i;
    const int64_t a = std::clamp<int64_t>(sc.lo[r] - kt, 0, nt);
    const int64_t b = std::clamp<int64_t>(sc.hi[r] - kt, 0, nt);
    __mmask16 vis = __mmask16(lanes(b) & ~lanes(a));
    if (sc.mrow[r] && vis) vis = mask_bits(sc.mrow[r] + kt, vis);
    _mm512_storeu_ps(sc.S + r * kBlock + t0,
                     _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), vis, x[i], _mm512_set1_ps(c2)));
  }
}

// Sᵀ of one tile for fp32 with many query rows: out[16·g + j] (lanes: the 16 rows of group g)
// = Σ_c K[j][c] · Qᵀ[c][16g..16g+15], for kG row groups and keys j0..j0+kJ-1. One broadcast
// of K[j][c] serves 16·kG rows and no horizontal sum is needed (the dot-product form of
// qk_rows reduces 16 accumulators per 4 rows x 4 keys). Qᵀ: d x Rp, packed per segment.
// The K rows are kD floats apart (compile-time offsets: 16 row pointers would be spilled).
// pf: the same keys of a later tile, whose lines (kD / 16 per row) in pf_lines (a bit per
// line index) are prefetched into L2, one line per 16·kG FMAs: spread evenly over the
// arithmetic, as the DRAM delivers them (see pv_spread).
template <int kG, int kJ, int kD>
[[gnu::noinline]] static void qk_bcast(const float* qt, int64_t Rp, const float* kp, int j0,
                                       const float* pf, unsigned pf_lines, __m512* out) {
  __m512 acc[kG * kJ];
  for (int i = 0; i < kG * kJ; ++i) acc[i] = _mm512_setzero_ps();
  const float* kr = kp + j0 * kD;
  for (int c = 0; c < kD; ++c) {
    __m512 qv[kG];
    for (int g = 0; g < kG; ++g) qv[g] = _mm512_loadu_ps(qt + c * Rp + 16 * g);
    // iteration c visits line c / 16 of key j0 + c % 16 (kJ = 16), or of key j0 + c / 2 % 8
    // on even c (kJ = 8: two calls cover the tile)
    if (pf && (pf_lines >> (c / 16) & 1) && (kJ == 16 || c % 2 == 0))
      pf_line(pf + (j0 + (kJ == 16 ? c % 16 : c / 2 % 8)) * kD + c / 16 * 16);
#pragma GCC unroll 16
    for (int j = 0; j < kJ; ++j) {
      const __m512 kv = _mm512_set1_ps(kr[j * kD + c]);
      for (int g = 0; g < kG; ++g) acc[g * kJ + j] = _mm512_fmadd_ps(kv, qv[g], acc[g * kJ + j]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kJ; ++j) out[16 * g + j0 + j] = acc[g * kJ + j];
}

// Scores of a whole tile (16 keys, K rows d floats apart, d = 64 or 128: decode_impl sets
// sc.qt only then) for every query row by qk_bcast, into S. Rp: R padded to 16, Qᵀ's row length.
static void scores_bcast(const float* qt, int64_t R, int64_t Rp, int64_t d, const float* kp,
                         const float* pf, int64_t kt, int64_t nt, int64_t t0, const Scratch& sc,
                         float c2) {
  __m512 x[32];
  const int64_t passes = (Rp / 16 + 1) / 2;
  for (int64_t g = 0; g < Rp / 16; g += 2) {
    const float* q = qt + 16 * g;
    // the passes over the tile (pairs of row groups) share its prefetch: pass g / 2 takes
    // the lines L with L % passes == g / 2
    unsigned f = 0;
    for (int64_t L = 0; L < d / 16; ++L) f |= unsigned(L % passes == g / 2) << L;
    if (g + 1 < Rp / 16) {  // two row groups, keys in halves: 16 accumulators
      if (d == 128) qk_bcast<2, 8, 128>(q, Rp, kp, 0, pf, f, x), qk_bcast<2, 8, 128>(q, Rp, kp, 8, pf, f, x);
      else qk_bcast<2, 8, 64>(q, Rp, kp, 0, pf, f, x), qk_bcast<2, 8, 64>(q, Rp, kp, 8, pf, f, x);
    } else if (d == 128) {
      qk_bcast<1, 16, 128>(q, Rp, kp, 0, pf, f, x);
    } else {
      qk_bcast<1, 16, 64>(q, Rp, kp, 0, pf, f, x);
    }
    for (int64_t h = 0; h < 2 && g + h < Rp / 16; ++h) {
      transpose16(x + 16 * h);  // x[16h + i]: the 16 keys' scores of row 16(g + h) + i
      store_score_rows(x + 16 * h, 16 * (g + h), 16, R, kt, nt, t0, sc, c2);
    }
  }
}
#endif  // QKV_AVX512

}  // namespace
