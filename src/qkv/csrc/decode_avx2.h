// The decode kernel's vector loops on 8 fp32 lanes (AVX2 + FMA): the scores and P·V of the
// avx2 level (int8 K/V on int16 pairs there too), and, on the AVX-512 levels, the loops that
// fp32 caches with few rows take where they stream DRAM better (fp32_path in decode_cpu.cpp).
// Also the int16 weights (weights_i16) that both levels' int8 P·V take (decode_int16.h).
// Called by a segment's block loop (decode_segment.h).
#pragma once

#include "decode_common.h"

namespace {

// -------------------------------------------------------------------------------------------
// Vector pieces (AVX2 + FMA: 8 fp32 lanes), for the avx2 level. Keys and values of any dtype
// are widened to fp32 in registers (bf16: a 16-bit shift; int8: a conversion), so a bf16
// cache reads half the bytes of an fp32 one for the same arithmetic.
#if defined(QKV_AVX2) && !defined(QKV_AVX512)
#define QKV_DECODE_AVX2 1  // the avx2 level: every loop below
#endif
#ifdef QKV_AVX2  // also on the AVX-512 levels: fp32 keys with few rows (run_segment)
using qkv_simd::exp2_v8;
using qkv_simd::hmax8;
using qkv_simd::hsum8;
using qkv_simd::hsum8x8;
using qkv_simd::load8;


// How far ahead (keys) K and V are prefetched into L2. Zen 3, 1 thread, q (1, 32, 1, 128)
// over (1, 8, 16384, 128), GB/s of K+V fp32 / bf16 in one run: none 6.6 / 6.0; 16 keys
// 10.1 / 6.0; 32 10.5 / 7.9; 64 9.5 / 7.8; 128 9.6 / 7.0; 512 8.8 / 7.2 (19.6 GB/s read peak).
constexpr int64_t kAvx2Ahead = 2 * kTile;

// Raw scores S[r][j] = q_r · k_j of kR query rows (row stride qs, fp32, zero past d) and the
// keys [0, nj) in groups of kJ (rows ks apart; nj a multiple of kJ): kR x kJ accumulators in
// registers, each chunk of a key loaded once for all kR rows, the query chunk once for all kJ
// keys (kept in a register: GCC otherwise folds it into every FMA as a memory operand). d8:
// d rounded down to 8; the rest is added in scalar code. kPf: the same keys of pf prefetched
// into L2, one line per 64 bytes read, spread over the arithmetic (a burst of a whole tile's
// prefetches stalls the loads).
template <int kR, int kJ, bool kPf, typename T>
[[gnu::noinline]] static void dots_avx2(const float* q, int64_t qs, const T* kp, int64_t ks,
                                        int64_t d, int64_t nj, float* S, int64_t ldS,
                                        const T* pf) {
  static_assert(kR * kJ == 8);
  constexpr int64_t kLine = 64 / sizeof(T);  // values of a key per 64-byte line (>= 16)
  const int64_t dl = d / kLine * kLine, d8 = d / 8 * 8;
  __m256 a[8];
  // one step: chunk c of every key and row (the loops unrolled so a stays in registers)
  auto step = [&](const T* kr, int64_t c) {
    __m256 kv[kJ];
#pragma GCC unroll 8
    for (int j = 0; j < kJ; ++j) kv[j] = load8(kr + j * ks + c);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      __m256 qv = _mm256_loadu_ps(q + r * qs + c);
      asm("" : "+x"(qv));
#pragma GCC unroll 8
      for (int j = 0; j < kJ; ++j) a[r * kJ + j] = _mm256_fmadd_ps(qv, kv[j], a[r * kJ + j]);
    }
  };
  for (int64_t j0 = 0; j0 < nj; j0 += kJ) {
    const T* kr = kp + j0 * ks;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    // a 64-byte line of each key per iteration, its prefetch issued first (no branch)
    for (int64_t c = 0; c < dl; c += kLine) {
      if constexpr (kPf)
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
#pragma GCC unroll 8
      for (int64_t u = 0; u < kLine; u += 8) step(kr, c + u);
    }
    for (int64_t c = dl; c < d8; c += 8) {
      if constexpr (kPf)
        if (((c - dl) * int64_t(sizeof(T))) % 64 == 0)
          for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
      step(kr, c);
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8x8(a));  // lane r·kJ + j: row r, key j0 + j
    if (d8 == d) {  // each row's kJ scores straight to S, one copy per row
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) std::memcpy(S + r * ldS + j0, t + r * kJ, kJ * sizeof(float));
      continue;
    }
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < kJ; ++j) {
        float x = t[r * kJ + j];
        for (int64_t c = d8; c < d; ++c) x += q[r * qs + c] * to_float(kr[j * ks + c]);
        S[r * ldS + j0 + j] = x;
      }
  }
}

// q · k over d values (a leftover key of a tile)
template <typename T>
static inline float dot_avx2(const float* q, const T* k, int64_t d) {
  __m256 a = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k + c), a);
  float x = hsum8(a);
  for (; c < d; ++c) x += q[c] * to_float(k[c]);
  return x;
}

#ifdef QKV_DECODE_AVX2
// ---- int8 K/V on int16 pairs (vpmaddwd: 16 products of int16 pairs summed into 8 exact
// int32 lanes per instruction, then vpaddd). Widening int8 to fp32 took two instructions per
// 8 values ahead of 8 FMAs, and those, on the FP pipes, bound the loop; here the integer
// multiplies do twice the work per instruction. Queries are int16 rows (q ≈ qscale · q16, as
// on VNNI), weights P int16 per row (as pv_i16). |sums| <= d · 32767 · 128 < 2^31 for d <= 128
// and kBlock · 32767 · 128 for P·V.
// Where the CPU has AVX-VNNI (qkv_simd::avxvnni_allowed) one vpdpwssd replaces each
// vpmaddwd + vpaddd (kVnni; a Xeon forced to this level: 1.07-1.18x at 4 query rows per kv
// head, 1.16-1.23x at 16).
#define QKV_I16_AVX2 1
using qkv_simd::dpwssd;

// lane i = Σ of the 8 int32 lanes of a[i], as fp32 (hsum8x8's tree, exact in int32)
static inline __m256 hsum8x8_i32(const __m256i* a) {
  const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                             _mm256_permute2x128_si256(u0, u1, 0x31)));
}

// dots_avx2 for int16 query rows over int8 keys: raw integer scores S[r][j] = q16_r · k_j (as
// fp32), d a multiple of 64 (one line of each key per iteration, its prefetch first).
template <int kR, int kJ, bool kPf, bool kVnni>
[[gnu::noinline]] static void dots_i16_avx2(const int16_t* q, int64_t qs, const int8_t* kp,
                                            int64_t ks, int64_t d, int64_t nj, float* S,
                                            int64_t ldS, const int8_t* pf) {
  static_assert(kR * kJ == 8);
  __m256i a[8];
  for (int64_t j0 = 0; j0 < nj; j0 += kJ) {
    const int8_t* kr = kp + j0 * ks;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
    for (int64_t c = 0; c < d; c += 64) {
      if constexpr (kPf)
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
#pragma GCC unroll 4
      for (int64_t u = c; u < c + 64; u += 16) {
        __m256i kv[kJ];
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j)
          kv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr + j * ks + u)));
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r) {
          __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * qs + u));
          asm("" : "+x"(qv));  // one load per row and step
#pragma GCC unroll 8
          for (int j = 0; j < kJ; ++j)
            dpwssd<kVnni>(a[r * kJ + j], qv, kv[j]);
        }
      }
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8x8_i32(a));  // lane r·kJ + j: row r, key j0 + j
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) std::memcpy(S + r * ldS + j0, t + r * kJ, kJ * sizeof(float));
  }
}

template <int kR, int kJ, bool kPf>
static void dots_avx2(const int16_t* q, int64_t qs, const int8_t* kp, int64_t ks, int64_t d,
                      int64_t nj, float* S, int64_t ldS, const int8_t* pf) {
  qkv_simd::with_avxvnni([&](auto kVnni) {
    dots_i16_avx2<kR, kJ, kPf, decltype(kVnni)::value>(q, qs, kp, ks, d, nj, S, ldS, pf);
  });
}

// q16 · k over d values, exact in int32 (a leftover key of a tile)
static inline float dot_avx2(const int16_t* q, const int8_t* k, int64_t d) {
  int32_t x = 0;
  for (int64_t c = 0; c < d; ++c) x += int32_t(q[c]) * k[c];
  return static_cast<float>(x);
}
#endif  // QKV_DECODE_AVX2

// Raw scores of R query rows for the nt keys of a tile into S (row stride ldS): fp32 queries
// over keys of any dtype, or (the avx2 level) int16 queries over int8 keys; the same keys of
// a later tile (pf, or nullptr) are prefetched into L2, one line per 64 bytes.
template <typename Q, typename T>
static void scores_avx2(const Q* q, int64_t qs, int64_t R, const T* kp, int64_t ks,
                        int64_t d, int64_t nt, float* S, int64_t ldS, const T* pf) {
  // blocks of kR rows by kJ keys over the tile's first nt / kJ · kJ keys (the first row block
  // prefetches pf's keys), then the keys left over one by one
  auto rows = [&](auto kR_, auto kJ_, int64_t r) {
    constexpr int kR = decltype(kR_)::value, kJ = decltype(kJ_)::value;
    const int64_t nj = nt / kJ * kJ;
    if (nj > 0) {
      if (pf && r == 0) dots_avx2<kR, kJ, true>(q + r * qs, qs, kp, ks, d, nj, S + r * ldS, ldS, pf);
      else dots_avx2<kR, kJ, false>(q + r * qs, qs, kp, ks, d, nj, S + r * ldS, ldS, pf);
    }
    for (int64_t j = nj; j < nt; ++j)
      for (int64_t i = r; i < r + kR; ++i) S[i * ldS + j] = dot_avx2(q + i * qs, kp + j * ks, d);
  };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, r);
  for (; r + 2 <= R; r += 2) rows(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{}, r);
  for (; r < R; ++r) rows(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{}, r);
}

// acc[r] += Σ_j p[r][j] v_j for kR rows (p row stride kBlock, acc row stride dvp) and nj
// value rows (stride vs), columns [c, c + 16): 2·kR accumulators stay in registers over the
// keys, each value chunk is loaded once for all kR rows.
// kPf: the line of pf's row j that holds columns [c, c + 16) prefetched (once per 64 bytes).
template <int kR, bool kPf, typename T>
[[gnu::noinline]] static void pv_avx2(const T* vp, int64_t vs, int64_t c, const float* p,
                                      float* o, int64_t dvp, int64_t nj, const T* pf) {
  // every loop over a unrolled: else GCC keeps a on the stack and stores all of it on each
  // key (8 stores per 8 FMAs: pv ran at half speed)
  __m256 a[kR][2];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
    a[r][0] = _mm256_loadu_ps(o + r * dvp + c), a[r][1] = _mm256_loadu_ps(o + r * dvp + c + 8);
  for (int64_t j = 0; j < nj; ++j) {
    if constexpr (kPf) pf_line(pf + j * vs + c);
    const __m256 v0 = load8(vp + j * vs + c), v1 = load8(vp + j * vs + c + 8);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kBlock + j);
      a[r][0] = _mm256_fmadd_ps(v0, w, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(v1, w, a[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
    _mm256_storeu_ps(o + r * dvp + c, a[r][0]), _mm256_storeu_ps(o + r * dvp + c + 8, a[r][1]);
}

// acc += P V for the nj value rows of a tile (vp, stride vs; pf: the same rows of a later
// tile, prefetched), all R rows, dv columns (the last dv % 16 in scalar code)
template <typename T>
static void pv_tile_avx2(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                         float* acc, int64_t dvp, int64_t nj, const T* pf) {
  const int64_t d16 = dv / 16 * 16;
  for (int64_t c = 0; c < d16; c += 16) {
    // the first row block of the column chunks that start a 64-byte line prefetches it
    const bool line = pf && (c * int64_t(sizeof(T))) % 64 == 0;
    int64_t r = 0;
    auto run = [&](auto kR_) {
      constexpr int kR = decltype(kR_)::value;
      if (line && r == 0) pv_avx2<kR, true>(vp, vs, c, p + r * kBlock, acc + r * dvp, dvp, nj, pf);
      else pv_avx2<kR, false>(vp, vs, c, p + r * kBlock, acc + r * dvp, dvp, nj, pf);
      r += kR;
    };
    while (r + 6 <= R) run(std::integral_constant<int, 6>{});
    while (r + 4 <= R) run(std::integral_constant<int, 4>{});
    while (r + 2 <= R) run(std::integral_constant<int, 2>{});
    while (r < R) run(std::integral_constant<int, 1>{});
  }
  if (d16 < dv)  // the columns past d16 (fewer than 16), and the lines of pf that hold them
    for (int64_t j = 0; j < nj; ++j) {
      if (pf) pf_line(pf + j * vs + d16), pf_line(pf + j * vs + dv - 1);
      for (int64_t r = 0; r < R; ++r) {
        const float w = p[r * kBlock + j];
        float* o = acc + r * dvp;
        for (int64_t c = d16; c < dv; ++c) o[c] += w * to_float(vp[j * vs + c]);
      }
    }
}

// The weights P (R rows of kBlock, >= 0) of one block as int16 for P·V on int16 pairs: row r
// as w · wscale[r] (at most 1/65534 of the row's largest weight off), words in key order,
// pairs[r][i] = (w_2i, w_2i+1). The VNNI and the avx2 level's int8 loops both take it.
static void weights_i16(const float* P, int64_t R, int32_t (*pairs)[kBlock / 2], float* wscale) {
  for (int64_t r = 0; r < R; ++r) {
    const float* p = P + r * kBlock;
    __m256 mx = _mm256_loadu_ps(p);
    for (int64_t j = 8; j < kBlock; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(p + j));
    const float m = hmax8(mx);
    wscale[r] = m / 32767.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int64_t j = 0; j < kBlock; j += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), inv));
      // packs works per 128-bit lane: 64-bit quarters 0, 2, 1, 3 put the words in order
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r] + j / 2), w);
    }
  }
}

#endif  // QKV_AVX2

#ifdef QKV_DECODE_AVX2
// The 16 bf16 keys of a tile (rows ks apart) as fp32 rows d apart; pf: the same keys of a
// later tile, prefetched line by line as they are read
static void widen_tile_avx2(const BFloat16* kp, int64_t ks, int64_t d, float* out,
                            const BFloat16* pf) {
  for (int64_t j = 0; j < kTile; ++j) {
    const BFloat16* k = kp + j * ks;
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
      if (pf && c % 32 == 0) pf_line(pf + j * ks + c);
      _mm256_storeu_ps(out + j * d + c, load8(k + c));
    }
    for (; c < d; ++c) out[j * d + c] = to_float(k[c]);
    if (pf && d % 32) pf_line(pf + j * ks + d - 1);
  }
}

// 8 vectors of 8 -> their transpose: r[i][k] becomes r[k][i]
static inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Raw scores of fp32 keys for many query rows (arithmetic-bound), by broadcasts: for 4 keys
// (rows ks apart) and kG groups of 8 query rows, out[4g + j] (lanes: rows 8g..8g+7) =
// Σ_c K[j][c] · Qᵀ[c][8g..8g+7]. One broadcast of K[j][c] serves 8·kG rows and no sum across
// lanes is needed (dots_avx2 sums its 8 accumulators across lanes for every 4 rows x 2 keys).
// Qᵀ: d x Rp, packed per segment. kPf: the 4 keys of pf prefetched into L2, line L of key j
// at step c = 16 L + 4 j (one prefetch per 4 steps, spread over the arithmetic).
template <int kG, bool kPf>
[[gnu::noinline]] static void qk_bcast_avx2(const float* qt, int64_t Rp, const float* kr,
                                            int64_t ks, int64_t d, const float* pf, __m256* out) {
  __m256 acc[kG * 4];
#pragma GCC unroll 8
  for (int i = 0; i < kG * 4; ++i) acc[i] = _mm256_setzero_ps();
  const float* k[4] = {kr, kr + ks, kr + 2 * ks, kr + 3 * ks};
  for (int64_t c = 0; c < d; ++c) {
    if constexpr (kPf)
      if (c % 4 == 0) pf_line(pf + (c / 4 % 4) * ks + c / 16 * 16);
    __m256 qv[kG];
#pragma GCC unroll 4
    for (int g = 0; g < kG; ++g) {
      qv[g] = _mm256_loadu_ps(qt + c * Rp + 8 * g);
      asm("" : "+x"(qv[g]));  // one load per step (GCC would fold it into each FMA)
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_broadcast_ss(k[j] + c);
#pragma GCC unroll 4
      for (int g = 0; g < kG; ++g) acc[4 * g + j] = _mm256_fmadd_ps(kv, qv[g], acc[4 * g + j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kG * 4; ++i) out[i] = acc[i];
}

// Raw scores of R query rows for the 16 keys of a full tile (rows ks apart) into S (row stride
// ldS), by qk_bcast_avx2: pairs of 8-row groups (8 accumulators; 3 groups, 12 accumulators,
// left GCC too few registers and ran 1.5x slower), 8 keys at a time, transposed to rows of 8
// keys. Rows past R (Qᵀ's zero padding) are not stored. pf: the same keys of a later tile,
// prefetched by the first pass.
static void scores_bcast_avx2(const float* qt, int64_t R, int64_t Rp, int64_t d, const float* kp,
                              int64_t ks, float* S, int64_t ldS, const float* pf) {
  for (int64_t g = 0; g < Rp / 8; g += 2) {
    const bool two = g + 1 < Rp / 8;
    for (int64_t j0 = 0; j0 < kTile; j0 += 8) {
      __m256 x[2][8];  // x[h][4e + j]: row group g + e, key j0 + 4h + j
      for (int h = 0; h < 2; ++h) {
        const float* kr = kp + (j0 + 4 * h) * ks;
        const float* q = qt + 8 * g;
        if (pf && g == 0) {
          const float* p = pf + (j0 + 4 * h) * ks;
          if (two) qk_bcast_avx2<2, true>(q, Rp, kr, ks, d, p, x[h]);
          else qk_bcast_avx2<1, true>(q, Rp, kr, ks, d, p, x[h]);
        } else if (two) {
          qk_bcast_avx2<2, false>(q, Rp, kr, ks, d, nullptr, x[h]);
        } else {
          qk_bcast_avx2<1, false>(q, Rp, kr, ks, d, nullptr, x[h]);
        }
      }
      for (int e = 0; e < (two ? 2 : 1); ++e) {  // row group g + e: its 8 keys, transposed
        __m256 t[8];
        for (int j = 0; j < 4; ++j) t[j] = x[0][4 * e + j], t[4 + j] = x[1][4 * e + j];
        transpose8(t);  // t[i]: the 8 keys' scores of row 8(g + e) + i
        for (int64_t i = 0; i < 8 && 8 * (g + e) + i < R; ++i)
          _mm256_storeu_ps(S + (8 * (g + e) + i) * ldS + j0, t[i]);
      }
    }
  }
}

// acc[r] += P V for kR rows, columns [c, c + 16), from the int16 weight pairs w (row stride
// kBlock / 2) of one block of int8 value rows vr (zero rows past its keys): rows 2i, 2i + 1
// interleaved byte by byte (vpunpck{l,h}bw) and widened to int16 pairs, so one vpmaddwd adds
// p_2i·v_2i + p_2i+1·v_2i+1 for 8 columns, in order. kPf: every line of pf's rows (pfs
// apart) prefetched, two rows per step.
template <int kR, bool kPf, bool kVnni>
[[gnu::noinline]] static void pv_i16_rows_avx2(const int8_t* const* vr, int64_t c,
                                               const int32_t* w, const float* wscale, float* o,
                                               int64_t dvp, const int8_t* pf, int64_t pfs) {
  __m256i a[kR][2];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
  for (int64_t jp = 0; jp < kBlock / 2; ++jp) {
    if constexpr (kPf)
      for (int64_t b = 2 * jp * pfs; b < (2 * jp + 2) * pfs; b += 64) pf_line(pf + b);
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[2 * jp] + c));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[2 * jp + 1] + c));
    const __m256i v0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));  // columns c..c+7
    const __m256i v1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));  // c+8..c+15
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m256i p = _mm256_set1_epi32(w[r * (kBlock / 2) + jp]);
      dpwssd<kVnni>(a[r][0], p, v0);
      dpwssd<kVnni>(a[r][1], p, v1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r) {
    const __m256 s = _mm256_set1_ps(wscale[r]);
    float* orow = o + r * dvp + c;
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(orow + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), s,
                                                     _mm256_loadu_ps(orow + 8 * h)));
  }
}

// acc += P V for one block of int8 value rows (vr[j]: row of key j, its scale folded into P;
// zero rows past the block's keys), R < kWidenRows rows, dv a multiple of 16: P quantized per
// row to int16 (at most 1/65534 of the row's largest weight), then pv_i16_rows_avx2 on 16
// columns at a time. pf: the rows (pfs apart) of a later block, prefetched by the first pass.
template <bool kVnni>
static void pv_i16_avx2(const int8_t* const* vr, int64_t dv, const float* P, int64_t R,
                        float* acc, int64_t dvp, const int8_t* pf, int64_t pfs) {
  alignas(32) int32_t pairs[kWidenRows][kBlock / 2];  // (w_2i, w_2i+1) as int16 pairs
  float wscale[kWidenRows];
  weights_i16(P, R, pairs, wscale);
  for (int64_t c = 0; c < dv; c += 16) {
    int64_t r = 0;
    auto run = [&](auto kR_) {
      constexpr int kR = decltype(kR_)::value;
      const int32_t* w = pairs[r];
      float* o = acc + r * dvp;
      if (pf && c == 0 && r == 0) pv_i16_rows_avx2<kR, true, kVnni>(vr, c, w, wscale + r, o, dvp, pf, pfs);
      else pv_i16_rows_avx2<kR, false, kVnni>(vr, c, w, wscale + r, o, dvp, pf, pfs);
      r += kR;
    };
    while (r + 4 <= R) run(std::integral_constant<int, 4>{});
    while (r + 2 <= R) run(std::integral_constant<int, 2>{});
    while (r < R) run(std::integral_constant<int, 1>{});
  }
}
#endif  // QKV_DECODE_AVX2

}  // namespace
