// qkv's int8 linear layer for CPU inference: y = act(x Wᵀ + b) with an int8 weight.
//
//   W (N, K): int8, symmetric per output channel (w ≈ s_w[n] · W_q[n, k], |W_q| ≤ 127),
//             quantized once and packed (by qkv/kernels/int8.py) in blocks of 64 bytes:
//             16 output channels × 4 consecutive k, the operand of one VNNI instruction;
//             N padded to a multiple of 64 (Np), K to a multiple of 4 (Kp), with zeros.
//             packed[t][g][j][i] = W_q[16 t + j, 4 g + i]   (Np/16, Kp/4, 16, 4)
//   x (M, K): fp32, quantized per call and per row to uint8, asymmetric with a zero point
//             z[m] (0 exactly representable): x ≈ s_x[m] · (q[m, k] - z[m]);
//   y[m, n] = s_x[m] · s_w[n] · (Σ_k q[m, k] W_q[n, k] - z[m] · Σ_k W_q[n, k]) + b[n]
//             the integer sums in int32 (exact: |Σ| ≤ 255 · 127 · K < 2³¹ for K ≤ 65536),
//             the column sums Σ_k W_q[n, k] precomputed at packing time.
//
// With AVX512-VNNI (Intel Cascade Lake and later, AMD Zen 4 and later), one
// `vpdpbusd` multiplies 64 uint8 × int8 pairs and adds them, 4 by 4, into 16 int32 lanes
// (one lane per output channel). A micro-kernel holds up to 4 rows × 64 output channels of
// accumulators in registers; the dequantization, bias and ReLU are fused into the store.
// AVX2 widens both to int16 and adds exact pairs with vpmaddwd (vpmaddubsw could saturate),
// or, where the CPU has AVX-VNNI, adds 4 byte products per lane with vpdpbusd on 8 lanes;
// in the portable build plain C++ loops compute the same integers.
// Threads split the output channels (and the rows when there are many) with
// at::parallel_for; a call too small to pay for the fork runs on the calling thread.
// Rows with a non-finite value come out as NaN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kGroup = 64;  // output channels per micro-kernel call (4 VNNI lanes × 16)
constexpr int64_t kRows = 4;    // rows per micro-kernel call
constexpr int64_t kMaxK = 65536;
// below this many multiply-adds per thread a call does not fork: ~5 us of work, about what
// waking the OpenMP team costs (bench/int8_linear.py --threads 2)
constexpr int64_t kMinMacsPerTask = 1 << 20;

// ---- per-row quantization of x -----------------------------------------------------------

struct RowQuant {
  float scale;   // s_x
  int32_t zero;  // z, in [0, 255]
  bool finite;
};

// The quantization parameters of one row of K floats. The same float operations in every
// build (min and max do not depend on the order), so that every build gives the same q.
static inline RowQuant row_params(float lo, float hi, bool finite) {
  lo = std::min(lo, 0.f), hi = std::max(hi, 0.f);
  // (hi - lo) / 255 without overflow for |x| near FLT_MAX; at least FLT_MIN so that 1 / s
  // stays finite (a row of zeros or of denormals quantizes to z)
  const float s = std::max(hi / 255.f - lo / 255.f, FLT_MIN);
  const float inv = 1.f / s;
  const float zf = std::nearbyint(-lo * inv);
  const int32_t z = static_cast<int32_t>(std::min(std::max(zf, 0.f), 255.f));
  return {s, z, finite};
}

static inline uint8_t quant_one(float v, float inv, int32_t z) {
  const int32_t q = static_cast<int32_t>(std::nearbyint(v * inv)) + z;
  return static_cast<uint8_t>(std::min(std::max(q, 0), 255));
}

// q (Kp bytes; the padding 0: its weights are 0), scale and zero of one row x (K floats)
static RowQuant quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* q) {
  float lo = 0.f, hi = 0.f;
  bool finite = true;
  int64_t k = 0;
#ifdef QKV_AVX512
  __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps(), vnan = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    vlo = _mm512_min_ps(vlo, v), vhi = _mm512_max_ps(vhi, v);
    vnan = _mm512_add_ps(vnan, _mm512_mul_ps(v, _mm512_setzero_ps()));  // NaN if inf/NaN
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    vlo = _mm512_min_ps(vlo, v), vhi = _mm512_max_ps(vhi, v);
    vnan = _mm512_add_ps(vnan, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
  finite = _mm512_cmp_ps_mask(vnan, vnan, _CMP_UNORD_Q) == 0;
#else
  float bad = 0.f;
  for (; k < K; ++k) {
    lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
    bad += x[k] * 0.f;
  }
  finite = !std::isnan(bad);
#endif
  RowQuant p = row_params(lo, hi, finite);
  if (!finite) p = row_params(0.f, 0.f, false);  // quantized as zeros; the output is NaN
  const float inv = 1.f / p.scale;
  k = 0;
#ifdef QKV_AVX512
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i vz = _mm512_set1_epi32(p.zero), v0 = _mm512_setzero_si512(),
                v255 = _mm512_set1_epi32(255);
  for (; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xffff)
                                    : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    if (!finite) v = _mm512_setzero_ps();
    // round to nearest even (the default MXCSR mode), as std::nearbyint
    __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, vinv)), vz);
    qi = _mm512_min_epi32(_mm512_max_epi32(qi, v0), v255);
    _mm512_mask_cvtepi32_storeu_epi8(q + k, m, qi);
  }
#else
  for (; k < K; ++k) q[k] = finite ? quant_one(x[k], inv, p.zero) : quant_one(0.f, inv, p.zero);
#endif
  for (k = K; k < Kp; ++k) q[k] = 0;
  return p;
}

// ---- the integer products ----------------------------------------------------------------

struct Problem {
  const uint8_t* q;    // (M, Kp)
  const int32_t* zero;  // (M,)
  const int8_t* w;     // packed (Np/16, Kp/4, 16, 4)
  const int32_t* wsum;  // (Np,)
  int64_t M, N, Kp;
};

#if defined(QKV_AVX2) && !defined(QKV_AVX512)
// block_s32 (below) where the avx2 build has AVX-VNNI (qkv_simd::avxvnni_allowed): one
// vpdpbusd per row adds 4 k of 8 channels, the packed layout's 32 bytes as they are; a pass
// keeps R rows x 16 channels (one tile) of accumulators in registers.
template <int R>
static void block_s32_avxvnni(const Problem& P, int64_t m0, int64_t n0, int32_t* out) {
  const int64_t groups = P.Kp / 4;
  const int8_t* wt = P.w + (n0 / 16) * P.Kp * 16;
  const uint8_t* q0 = P.q + m0 * P.Kp;
  const uint8_t *q1 = q0 + P.Kp, *q2 = q1 + P.Kp, *q3 = q2 + P.Kp;  // read only below R
  auto bcast = [](const uint8_t* p) {  // q[k .. k + 3] of a row, for every channel
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
  };
  using qkv_simd::dpbusd;
  for (int t = 0; t < 4; ++t) {
    const int8_t* w = wt + t * P.Kp * 16;
    // accumulators as named variables: in an array GCC kept them on the stack, a load and a
    // store around every vpdpbusd (1.5-1.9x slower)
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
            c21 = c00, c30 = c00, c31 = c00;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
      __m256i x = bcast(q0 + 4 * g);
      dpbusd(c00, x, w0), dpbusd(c01, x, w1);  // channels 16t .. 16t + 7, 16t + 8 .. 16t + 15
      if constexpr (R > 1) x = bcast(q1 + 4 * g), dpbusd(c10, x, w0), dpbusd(c11, x, w1);
      if constexpr (R > 2) x = bcast(q2 + 4 * g), dpbusd(c20, x, w0), dpbusd(c21, x, w1);
      if constexpr (R > 3) x = bcast(q3 + 4 * g), dpbusd(c30, x, w0), dpbusd(c31, x, w1);
    }
    const __m256i c[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int r = 0; r < R; ++r) {
      const __m256i z = _mm256_set1_epi32(P.zero[m0 + r]);
      for (int h = 0; h < 2; ++h) {
        const __m256i sw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.wsum + n0 + 16 * t + 8 * h));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * 64 + 16 * t + 8 * h),
                            _mm256_sub_epi32(c[r][h], _mm256_mullo_epi32(z, sw)));
      }
    }
  }
}
#endif

#ifdef QKV_AVX512
// block_s32 (below) with AVX512_VNNI (qkv_simd::vnni512_allowed): one vpdpbusd per row adds
// 4 k of 16 channels, a packed block (64 bytes) as it is; R rows x 64 channels of
// accumulators stay in registers.
template <int R>
static void block_s32_vnni512(const Problem& P, int64_t m0, int64_t n0, int32_t* out) {
  const int64_t groups = P.Kp / 4;
  const int8_t* wt = P.w + (n0 / 16) * P.Kp * 16;  // the first of 4 tiles of 16 channels
  const int64_t tile = P.Kp * 16;                  // bytes per tile
  using qkv_simd::dpbusd;
  // accumulators as named variables (an array of vectors makes GCC copy them every step)
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00;
  __m512i c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00,
          c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  const uint8_t* q0 = P.q + m0 * P.Kp;
  const uint8_t* q1 = q0 + (R > 1 ? P.Kp : 0);
  const uint8_t* q2 = q0 + (R > 2 ? 2 * P.Kp : 0);
  const uint8_t* q3 = q0 + (R > 3 ? 3 * P.Kp : 0);
  auto bcast = [](const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
  };
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* wg = wt + g * 64;
    __m512i w0 = _mm512_loadu_si512(wg), w1 = _mm512_loadu_si512(wg + tile),
            w2 = _mm512_loadu_si512(wg + 2 * tile), w3 = _mm512_loadu_si512(wg + 3 * tile);
    // in registers, loaded once: without this GCC folds each load into every row's vpdpbusd
    asm("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
    __m512i a = bcast(q0 + 4 * g);
    dpbusd(c00, a, w0), dpbusd(c01, a, w1);
    dpbusd(c02, a, w2), dpbusd(c03, a, w3);
    if constexpr (R > 1) {
      a = bcast(q1 + 4 * g);
      dpbusd(c10, a, w0), dpbusd(c11, a, w1);
      dpbusd(c12, a, w2), dpbusd(c13, a, w3);
    }
    if constexpr (R > 2) {
      a = bcast(q2 + 4 * g);
      dpbusd(c20, a, w0), dpbusd(c21, a, w1);
      dpbusd(c22, a, w2), dpbusd(c23, a, w3);
    }
    if constexpr (R > 3) {
      a = bcast(q3 + 4 * g);
      dpbusd(c30, a, w0), dpbusd(c31, a, w1);
      dpbusd(c32, a, w2), dpbusd(c33, a, w3);
    }
  }
  const __m512i c[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13},
                           {c20, c21, c22, c23}, {c30, c31, c32, c33}};
  for (int r = 0; r < R; ++r) {
    const __m512i z = _mm512_set1_epi32(P.zero[m0 + r]);
    for (int t = 0; t < 4; ++t) {
      const __m512i s = _mm512_loadu_si512(P.wsum + n0 + 16 * t);
      _mm512_storeu_si512(out + r * 64 + 16 * t,
                          _mm512_sub_epi32(c[r][t], _mm512_mullo_epi32(z, s)));
    }
  }
}
#endif

#if defined(QKV_AVX2) && !defined(QKV_VNNI512)
// block_s32 (below) without VNNI: the avx2 and avx512 builds where the CPU lacks it.
template <int R>
static void block_s32_i16(const Problem& P, int64_t m0, int64_t n0, int32_t* out) {
  const int64_t groups = P.Kp / 4;
  const int8_t* wt = P.w + (n0 / 16) * P.Kp * 16;  // the first of 4 tiles of 16 channels
  const int64_t tile = P.Kp * 16;                  // bytes per tile
  // AVX2 has no u8·s8 dot product that cannot saturate (vpmaddubsw's pair sums overflow int16
  // at 255·127·2), so both operands are widened to int16 and vpmaddwd adds exact pairs into
  // int32: lane 2c + e holds channel c's sum over k = 2e, 2e + 1 of each group of 4. Per tile
  // (16 channels), two passes of 8 channels: R rows x 2 accumulators stay in registers.
  // The rows' q are widened to int16 once per call (up to kWideKp values), so each step
  // broadcasts a row's 4 values with one load instead of widening them again for each of
  // the 8 passes (longer rows widen in the loop).
  constexpr int64_t kWideKp = 2048;
  alignas(32) int16_t xw[R][kWideKp];
  const bool wide = P.Kp <= kWideKp;
  if (wide)
    for (int r = 0; r < R; ++r) {
      const uint8_t* qr = P.q + (m0 + r) * P.Kp;
      int64_t k = 0;
      for (; k + 16 <= P.Kp; k += 16)
        _mm256_store_si256(reinterpret_cast<__m256i*>(xw[r] + k),
                           _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
      for (; k < P.Kp; ++k) xw[r][k] = qr[k];
    }
  auto pass = [&](auto wide_, int t, int h) {
    constexpr bool kWide = decltype(wide_)::value;
    __m256i acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* wh = wt + t * tile + 4 * h;
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i* wp = reinterpret_cast<const __m128i*>(wh + g * 64);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp));  // 4 channels x 4 k
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp + 1));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i x;  // q[k = 4g .. 4g + 3] of row r as int16, repeated for the 4 channels
        if constexpr (kWide) {
          int64_t four;
          std::memcpy(&four, xw[r] + 4 * g, 8);
          x = _mm256_set1_epi64x(four);
        } else {
          int32_t four;
          std::memcpy(&four, P.q + (m0 + r) * P.Kp + 4 * g, 4);
          x = _mm256_cvtepu8_epi16(_mm_set1_epi32(four));
        }
        qkv_simd::dpwssd<false>(acc[r][0], x, w0);  // vpmaddwd, then vpaddd in place
        qkv_simd::dpwssd<false>(acc[r][1], x, w1);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // pair sums -> channel sums, in channel order (hadd works within 128-bit halves)
      const __m256i c = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xd8);
      const __m256i z = _mm256_set1_epi32(P.zero[m0 + r]);
      const __m256i sw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.wsum + n0 + 16 * t + h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * 64 + 16 * t + h),
                          _mm256_sub_epi32(c, _mm256_mullo_epi32(z, sw)));
    }
  };
  for (int t = 0; t < 4; ++t)
    for (int h = 0; h < 16; h += 8) {  // channels 16t + h .. 16t + h + 7
      if (wide) pass(std::true_type{}, t, h);
      else pass(std::false_type{}, t, h);
    }
}
#endif

#if !defined(QKV_AVX2)
// block_s32 (below) in plain C++: the portable and neon builds
template <int R>
static void block_s32_plain(const Problem& P, int64_t m0, int64_t n0, int32_t* out) {
  const int64_t groups = P.Kp / 4;
  const int8_t* wt = P.w + (n0 / 16) * P.Kp * 16;  // the first of 4 tiles of 16 channels
  const int64_t tile = P.Kp * 16;                  // bytes per tile
  for (int r = 0; r < R; ++r) {
    const uint8_t* qr = P.q + (m0 + r) * P.Kp;
    for (int t = 0; t < 4; ++t) {
      int32_t acc[16] = {0};
      const int8_t* w = wt + t * tile;
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < 16; ++j)
          for (int i = 0; i < 4; ++i)
            acc[j] += static_cast<int32_t>(qr[4 * g + i]) * w[g * 64 + 4 * j + i];
      for (int j = 0; j < 16; ++j)
        out[r * 64 + 16 * t + j] = acc[j] - P.zero[m0 + r] * P.wsum[n0 + 16 * t + j];
    }
  }
}
#endif

// acc[r][c] = Σ_k q[m0 + r, k] W_q[n0 + c, k] - z · Σ_k W_q[n0 + c, k], for R rows and the
// 64 output channels from n0 (a multiple of 64), written to out (R, 64) int32. Each build
// compiles only the loops it can run.
template <int R>
static void block_s32(const Problem& P, int64_t m0, int64_t n0, int32_t* out) {
#if defined(QKV_VNNI512)
  block_s32_vnni512<R>(P, m0, n0, out);
#elif defined(QKV_AVX512)
  if (qkv_simd::vnni512_allowed()) block_s32_vnni512<R>(P, m0, n0, out);
  else block_s32_i16<R>(P, m0, n0, out);
#elif defined(QKV_AVX2)
  if (qkv_simd::avxvnni_allowed()) block_s32_avxvnni<R>(P, m0, n0, out);
  else block_s32_i16<R>(P, m0, n0, out);
#else
  block_s32_plain<R>(P, m0, n0, out);
#endif
}

static void block_dispatch(const Problem& P, int64_t m0, int64_t rows, int64_t n0, int32_t* out) {
  switch (rows) {
    case 4: block_s32<4>(P, m0, n0, out); break;
    case 3: block_s32<3>(P, m0, n0, out); break;
    case 2: block_s32<2>(P, m0, n0, out); break;
    default: block_s32<1>(P, m0, n0, out); break;
  }
}

// Runs fn(m0, rows, n0, acc) over every (row block, group of 64 channels), in parallel when
// the work pays for it. Tasks are (row chunk, channel group), chunk-major: a chunk's
// quantized rows (at most kChunkBytes) stay in L1 while the groups' weights stream past
// them, each group's weights reused by every row block of the chunk. acc is the task's
// (kRows, 64) int32 scratch.
constexpr int64_t kChunkBytes = 8192;
template <typename Fn>
static void for_blocks(const Problem& P, Fn fn) {
  const int64_t groups = (P.N + kGroup - 1) / kGroup;
  const int64_t threads = at::get_num_threads();
  int64_t chunk = std::max<int64_t>(kRows, kChunkBytes / std::max<int64_t>(P.Kp, 1) / kRows * kRows);
  chunk = std::min(chunk, P.M);
  // too few tasks to feed the threads (few channels, many rows): smaller chunks
  while (chunk > kRows && ((P.M + chunk - 1) / chunk) * groups < 2 * threads)
    chunk = std::max<int64_t>(kRows, (chunk / 2 + kRows - 1) / kRows * kRows);
  const int64_t chunks = (P.M + chunk - 1) / chunk;
  const int64_t macs = std::max<int64_t>(1, chunk * kGroup * P.Kp);
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerTask / macs);
  at::parallel_for(0, groups * chunks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kRows * kGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t ci = task / groups, gi = task % groups;
      const int64_t m_end = std::min(P.M, (ci + 1) * chunk);
      for (int64_t m0 = ci * chunk; m0 < m_end; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_end - m0);
        block_dispatch(P, m0, rows, gi * kGroup, acc);
        fn(m0, rows, gi * kGroup, acc);
      }
    }
  });
}

// ---- checks ------------------------------------------------------------------------------

static void check_packed(const Tensor& packed, const Tensor& wsum, int64_t N, int64_t Kp) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.is_cpu(),
              "qkv int8: packed must be a contiguous int8 CPU tensor");
  TORCH_CHECK(N >= 0 && Kp % 4 == 0, "qkv int8: N must be >= 0 and Kp a multiple of 4");
  const int64_t Np = (N + kGroup - 1) / kGroup * kGroup;
  TORCH_CHECK(packed.numel() == Np * Kp, "qkv int8: packed holds ", packed.numel(),
              " bytes, expected ", Np * Kp, " for N=", N, ", Kp=", Kp);
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == Np,
              "qkv int8: wsum must be a contiguous int32 tensor of ", Np, " elements");
  TORCH_CHECK(Kp <= kMaxK, "qkv int8: in_features must be <= ", kMaxK, ", got ", Kp);
}

static Tensor rows_of(const Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qkv int8: ", what, " must be (M, ", K,
              "), got ", x.sizes());
  return x.contiguous();
}

// ---- ops ---------------------------------------------------------------------------------

// q (M, Kp) uint8, scale (M,) fp32, zero (M,) int32 of x (M, K) fp32: the quantized rows.
std::tuple<Tensor, Tensor, Tensor> quantize_rows(const Tensor& x_, int64_t Kp) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.is_cpu() && x_.dim() == 2,
              "qkv int8: x must be a 2-D float32 CPU tensor");
  const Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(Kp >= K && Kp % 4 == 0, "qkv int8: Kp must be >= K and a multiple of 4");
  Tensor q = at::empty({M, Kp}, x.options().dtype(at::kByte));
  Tensor scale = at::empty({M}, x.options());
  Tensor zero = at::empty({M}, x.options().dtype(at::kInt));
  const float* xp = x.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const RowQuant p = quantize_row(xp + m * K, K, Kp, q.data_ptr<uint8_t>() + m * Kp);
    scale.data_ptr<float>()[m] = p.finite ? p.scale : NAN;
    zero.data_ptr<int32_t>()[m] = p.zero;
  }
  return {q, scale, zero};
}

// Σ_k (q[m, k] - zero[m]) W_q[n, k] as int32 (M, N): the integer part of linear().
Tensor matmul_s32(const Tensor& q_, const Tensor& zero_, const Tensor& packed,
                  const Tensor& wsum, int64_t N) {
  TORCH_CHECK(q_.scalar_type() == at::kByte && q_.dim() == 2, "qkv int8: q must be (M, Kp) uint8");
  const Tensor q = q_.contiguous(), zero = zero_.contiguous();
  const int64_t M = q.size(0), Kp = q.size(1);
  TORCH_CHECK(zero.scalar_type() == at::kInt && zero.numel() == M,
              "qkv int8: zero must be int32 (M,)");
  check_packed(packed, wsum, N, Kp);
  Tensor out = at::empty({M, N}, q.options().dtype(at::kInt));
  if (M == 0 || N == 0) return out;
  const Problem P{q.const_data_ptr<uint8_t>(), zero.const_data_ptr<int32_t>(),
                  packed.const_data_ptr<int8_t>(), wsum.const_data_ptr<int32_t>(), M, N, Kp};
  int32_t* o = out.data_ptr<int32_t>();
  for_blocks(P, [&](int64_t m0, int64_t rows, int64_t n0, const int32_t* acc) {
    const int64_t cols = std::min(kGroup, N - n0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(o + (m0 + r) * N + n0, acc + r * kGroup, cols * sizeof(int32_t));
  });
  return out;
}

// y (M, N), row stride ldy = act(s_x s_w (Σ (q - z) W_q) + b) for x (M, K) fp32, row
// stride ldx; the operands as checked by linear() (also called by the compiled decoder step
// on its own buffers).
static void linear_rows(const float* xp, int64_t ldx, int64_t M, int64_t K, const int8_t* packed,
                        const float* sw, const int32_t* wsum, const float* b, int64_t N,
                        bool relu, float* o, int64_t ldy) {
  if (M == 0 || N == 0) return;
  const int64_t Kp = (K + 3) / 4 * 4;
  // the quantized rows, kept between calls (no allocation per call)
  static thread_local std::vector<uint8_t> qbuf;
  static thread_local std::vector<float> sbuf;
  static thread_local std::vector<int32_t> zbuf;
  if (qbuf.size() < static_cast<size_t>(M * Kp)) qbuf.resize(M * Kp);
  if (sbuf.size() < static_cast<size_t>(M)) sbuf.resize(M), zbuf.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const RowQuant p = quantize_row(xp + m * ldx, K, Kp, qbuf.data() + m * Kp);
    sbuf[m] = p.finite ? p.scale : NAN;
    zbuf[m] = p.zero;
  }
  const Problem P{qbuf.data(), zbuf.data(), packed, wsum, M, N, Kp};
  const float* sx = sbuf.data();
  for_blocks(P, [&](int64_t m0, int64_t rows, int64_t n0, const int32_t* acc) {
    const int64_t cols = std::min(kGroup, N - n0);
    for (int64_t r = 0; r < rows; ++r) {
      const float s = sx[m0 + r];
      float* orow = o + (m0 + r) * ldy + n0;
      const int32_t* a = acc + r * kGroup;
#ifdef QKV_AVX512
      const __m512 vs = _mm512_set1_ps(s);
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = cols - c >= 16 ? static_cast<__mmask16>(0xffff)
                                           : static_cast<__mmask16>((1u << (cols - c)) - 1);
        __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + c)),
                                 _mm512_mul_ps(vs, _mm512_loadu_ps(sw + n0 + c)));
        if (b) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, b + n0 + c));
        if (relu) y = _mm512_max_ps(_mm512_setzero_ps(), y);  // NaN stays NaN (2nd operand)
        _mm512_mask_storeu_ps(orow + c, m, y);
      }
#else
      for (int64_t c = 0; c < cols; ++c) {
        float y = static_cast<float>(a[c]) * (s * sw[n0 + c]);
        if (b) y += b[n0 + c];
        if (relu) y = std::isnan(y) ? y : std::max(y, 0.f);
        orow[c] = y;
      }
#endif
    }
  });
}

// The checks of linear()'s weight operands: packed, wscale (Np,), wsum (Np,) for N outputs
// of K inputs; returns the bias pointer (nullptr: none).
static const float* check_weight(const Tensor& packed, const Tensor& wscale, const Tensor& wsum,
                                 const std::optional<Tensor>& bias, int64_t N, int64_t K) {
  TORCH_CHECK(K >= 0, "qkv int8: K must be >= 0");
  check_packed(packed, wsum, N, (K + 3) / 4 * 4);
  const int64_t Np = wsum.numel();
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() &&
                  wscale.numel() == Np,
              "qkv int8: wscale must be a contiguous float32 tensor of ", Np, " elements");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "qkv int8: bias must be a contiguous float32 tensor of ", N, " elements");
  return bias->const_data_ptr<float>();
}

// y = act(s_x s_w (Σ (q - z) W_q) + b) (M, N) fp32 for x (M, K) fp32.
Tensor linear(const Tensor& x_, const Tensor& packed, const Tensor& wscale, const Tensor& wsum,
              const std::optional<Tensor>& bias, int64_t N, int64_t K, bool relu) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.is_cpu(),
              "qkv int8: x must be a float32 CPU tensor");
  const Tensor x = rows_of(x_, K, "x");
  const float* b = check_weight(packed, wscale, wsum, bias, N, K);
  Tensor out = at::empty({x.size(0), N}, x.options());
  linear_rows(x.const_data_ptr<float>(), K, x.size(0), K, packed.const_data_ptr<int8_t>(),
              wscale.const_data_ptr<float>(), wsum.const_data_ptr<int32_t>(), b, N, relu,
              out.data_ptr<float>(), N);
  return out;
}

std::string int8_isa() {
#ifdef QKV_AVX512
  if (qkv_simd::vnni512_allowed()) return "avx512_vnni";
#endif
#ifdef QKV_AVX2
  return qkv_simd::avxvnni_allowed() ? "avx2_vnni (vpdpbusd)" : "avx2 (int16 pairs)";
#else
  return "portable";
#endif
}

}  // namespace

namespace qkv {
// an int8 linear of the compiled decoder step (step_cpu.cpp): checks once, then runs on rows
void int8_check_weight(const Tensor& packed, const Tensor& wscale, const Tensor& wsum,
                       const std::optional<Tensor>& bias, int64_t N, int64_t K) {
  check_weight(packed, wscale, wsum, bias, N, K);
}
void int8_linear_into(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* packed,
                      const float* wscale, const int32_t* wsum, const float* bias, int64_t N,
                      bool relu, float* y, int64_t ldy) {
  linear_rows(x, ldx, M, K, packed, wscale, wsum, bias, N, relu, y, ldy);
}
}  // namespace qkv

TORCH_LIBRARY(qkv_int8, m) {
  m.def("quantize_rows(Tensor x, int Kp) -> (Tensor, Tensor, Tensor)");
  m.def("matmul_s32(Tensor q, Tensor zero, Tensor packed, Tensor wsum, int N) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor wscale, Tensor wsum, Tensor? bias, int N,"
        " int K, bool relu) -> Tensor");
  m.def("isa() -> str", &int8_isa);
}

TORCH_LIBRARY_IMPL(qkv_int8, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("matmul_s32", &matmul_s32);
  m.impl("linear", &linear);
}
