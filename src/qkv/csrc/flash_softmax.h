// The softmax rows of qkv's flash kernels (fp32 scores -> p in fp32 or bf16): row max,
// 2^x over a row with its sum, the masked variants; and Structure, the key range each
// query row of a causal or windowed call sees. Shared by the forward (flash_cpu.cpp),
// the backward and the AMX tile forward (flash_amx.cpp); everything has internal
// linkage (each level's library has its own copy, as with every kernel source).
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using at::BFloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLazyLog2 = 8.f;  // see forward_impl (the lazy rescaling)

using qkv_simd::exp2_neg;
using qkv_simd::to_bf16_bits;

#ifdef QKV_AVX512
using qkv_simd::exp2_v;
#elif defined(QKV_AVX2)
// AVX2 + FMA: the same loops on 8 lanes; a row's last n % 8 columns take the scalar code
using qkv_simd::allowed8;
using qkv_simd::exp2_v8;
using qkv_simd::hmax8;
using qkv_simd::hsum8;
using qkv_simd::load8;
using qkv_simd::store8;
#endif

// max of x[0:n]; four accumulators hide vmaxps latency
static inline float row_max(const float* x, int64_t n) {
  float mx = kNegInf;
  int64_t c = 0;
#ifdef __AVX512F__
  __m512 a0 = _mm512_set1_ps(kNegInf), a1 = a0, a2 = a0, a3 = a0;
  for (; c + 64 <= n; c += 64) {
    a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + c));
    a1 = _mm512_max_ps(a1, _mm512_loadu_ps(x + c + 16));
    a2 = _mm512_max_ps(a2, _mm512_loadu_ps(x + c + 32));
    a3 = _mm512_max_ps(a3, _mm512_loadu_ps(x + c + 48));
  }
  for (; c + 16 <= n; c += 16) a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + c));
  mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
#elif defined(QKV_AVX2)
  __m256 a0 = _mm256_set1_ps(kNegInf), a1 = a0, a2 = a0, a3 = a0;
  for (; c + 32 <= n; c += 32) {
    a0 = _mm256_max_ps(a0, _mm256_loadu_ps(x + c));
    a1 = _mm256_max_ps(a1, _mm256_loadu_ps(x + c + 8));
    a2 = _mm256_max_ps(a2, _mm256_loadu_ps(x + c + 16));
    a3 = _mm256_max_ps(a3, _mm256_loadu_ps(x + c + 24));
  }
  for (; c + 8 <= n; c += 8) a0 = _mm256_max_ps(a0, _mm256_loadu_ps(x + c));
  mx = hmax8(_mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
#endif
  for (; c < n; ++c) mx = x[c] > mx ? x[c] : mx;
  return mx;
}

template <typename T> static inline void store(T* dst, float x);
template <> inline void store<float>(float* dst, float x) { *dst = x; }
template <> inline void store<BFloat16>(BFloat16* dst, float x) {
  *reinterpret_cast<uint16_t*>(dst) = to_bf16_bits(x);
}

#ifdef __AVX512F__
// store 16 floats (lanes in k) as T
template <typename T>
static inline void store16(T* p, __m512 e, __mmask16 k) {
  if constexpr (std::is_same_v<T, float>) {
    if (k == 0xffff) _mm512_storeu_ps(p, e);
    else _mm512_mask_storeu_ps(p, k, e);
  } else {
#ifdef __AVX512BF16__
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
#else
    __m512i u = _mm512_castps_si512(e);  // round to nearest even
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                              _mm512_set1_epi32(1))));
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
    if (k == 0xffff) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
    else _mm256_mask_storeu_epi16(p, k, b);
  }
}
#endif

#ifdef __AVX512F__
// lanes of k whose mask byte is nonzero (True = may attend)
static inline __mmask16 mask_bits(const uint8_t* m, __mmask16 k) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_mask_cmpneq_epi8_mask(k, _mm_maskz_loadu_epi8(k, m), _mm_setzero_si128());
#else
  unsigned bits = 0;
  for (int i = 0; i < 16; ++i)
    if (((k >> i) & 1u) && m[i]) bits |= 1u << i;
  return __mmask16(bits);
#endif
}
#endif

// max of x[c] over the allowed c in [0, n) (all of them without a mask m); -inf if none
static inline float row_max_masked(const float* x, const uint8_t* m, int64_t n) {
  if (!m) return row_max(x, n);
  float mx = kNegInf;
  int64_t c = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_set1_ps(kNegInf);
  for (; c < n; c += 16) {
    const __mmask16 k = c + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - c)) - 1u);
    acc = _mm512_max_ps(acc, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), mask_bits(m + c, k),
                                                  x + c));
  }
  mx = _mm512_reduce_max_ps(acc);
#elif defined(QKV_AVX2)
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 acc = ninf;
  for (; c + 8 <= n; c += 8)
    acc = _mm256_max_ps(acc, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + c), allowed8(m + c)));
  mx = hmax8(acc);
#endif
  for (; c < n; ++c)
    if (m[c]) mx = x[c] > mx ? x[c] : mx;
  return mx;
}

// p[c] = 2^((s[c] - mref)·c2) for c in [c0, c1), 0 elsewhere in [0, width); returns the sum
// of the fp32 values (before any rounding of p to bf16). With smax, also the max of s[c0:c1].
// kExact = false computes the exponent as one fma, s[c]·c2 - shift with shift = mref·c2
// rounded; its error, up to |shift|·2^-24, is the same for the whole row (so it cancels in
// out = acc / l) but past |shift| ~ 2^31 it would push 2^t beyond fp32's range (NaN with
// scale = 1e10). Rows with |shift| >= kExactShift take kExact = true: (s[c] - mref)·c2, whose
// argument is <= 0 for s[c] <= mref exactly (one more instruction per 16 scores).
constexpr float kExactShift = 16384.f;  // fma error <= 2^-10 below it

template <typename T, bool kExact>
static inline float exp_row_t(const float* s, T* p, int64_t c0, int64_t c1, int64_t width,
                              float c2, float mref, float* smax, const uint8_t* m) {
  const float shift = mref * c2;
  for (int64_t c = 0; c < c0; ++c) store<T>(p + c, 0.f);
  for (int64_t c = c1; c < width; ++c) store<T>(p + c, 0.f);
  int64_t c = c0;
  float sum = 0.f;
#ifdef __AVX512F__
  constexpr bool kLowT = !std::is_same_v<T, float>;
  const __m512 vc2 = _mm512_set1_ps(c2), vshift = _mm512_set1_ps(shift);
  const __m512 vm = _mm512_set1_ps(mref);
  // the exponent argument in log2 units (see above)
  auto arg = [&](__m512 x) {
    return kExact ? _mm512_mul_ps(_mm512_sub_ps(x, vm), vc2) : _mm512_fmsub_ps(x, vc2, vshift);
  };
  __m512 vsum = _mm512_setzero_ps(), vsum2 = vsum;
  __m512 vmax = _mm512_set1_ps(kNegInf), vmax2 = vmax;
  for (; !m && c + 32 <= c1; c += 32) {  // two independent chains (no mask)
    const __m512 s0 = _mm512_loadu_ps(s + c), s1 = _mm512_loadu_ps(s + c + 16);
    const __m512 e0 = exp2_v<kLowT>(arg(s0), 0xffff);
    const __m512 e1 = exp2_v<kLowT>(arg(s1), 0xffff);
    vsum = _mm512_add_ps(vsum, e0);
    vsum2 = _mm512_add_ps(vsum2, e1);
    if (smax) vmax = _mm512_max_ps(vmax, s0), vmax2 = _mm512_max_ps(vmax2, s1);
    store16<T>(p + c, e0, 0xffff);
    store16<T>(p + c + 16, e1, 0xffff);
  }
  for (; c < c1; c += 16) {
    const __mmask16 k = c + 16 <= c1 ? __mmask16(0xffff) : __mmask16((1u << (c1 - c)) - 1u);
    const __mmask16 vis = m ? mask_bits(m + c, k) : k;  // masked-out lanes: p = 0
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), vis, s + c);
    const __m512 e = exp2_v<kLowT>(arg(x), vis);
    vsum = _mm512_add_ps(vsum, e);
    if (smax) vmax = _mm512_max_ps(vmax, x);
    store16<T>(p + c, e, k);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(vsum, vsum2));
  if (smax) *smax = _mm512_reduce_max_ps(_mm512_max_ps(vmax, vmax2));
#else
  float mx = kNegInf;
#ifdef QKV_AVX2
  constexpr bool kLowT = !std::is_same_v<T, float>;
  const __m256 vc2 = _mm256_set1_ps(c2), vshift = _mm256_set1_ps(shift);
  const __m256 vm = _mm256_set1_ps(mref), ninf = _mm256_set1_ps(kNegInf);
  auto arg = [&](__m256 x) {  // as above
    return kExact ? _mm256_mul_ps(_mm256_sub_ps(x, vm), vc2) : _mm256_fmsub_ps(x, vc2, vshift);
  };
  __m256 vsum = _mm256_setzero_ps(), vsum2 = vsum, vmax = ninf, vmax2 = ninf;
  for (; !m && c + 16 <= c1; c += 16) {  // two independent chains (no mask)
    const __m256 s0 = _mm256_loadu_ps(s + c), s1 = _mm256_loadu_ps(s + c + 8);
    const __m256 e0 = exp2_v8<kLowT>(arg(s0)), e1 = exp2_v8<kLowT>(arg(s1));
    vsum = _mm256_add_ps(vsum, e0);
    vsum2 = _mm256_add_ps(vsum2, e1);
    vmax = _mm256_max_ps(vmax, s0), vmax2 = _mm256_max_ps(vmax2, s1);
    store8(p + c, e0);
    store8(p + c + 8, e1);
  }
  for (; c + 8 <= c1; c += 8) {  // masked-out lanes: -inf, so p = 0
    __m256 x = _mm256_loadu_ps(s + c);
    if (m) x = _mm256_blendv_ps(ninf, x, allowed8(m + c));
    const __m256 e = exp2_v8<kLowT>(arg(x));
    vsum = _mm256_add_ps(vsum, e);
    vmax = _mm256_max_ps(vmax, x);
    store8(p + c, e);
  }
  sum = hsum8(_mm256_add_ps(vsum, vsum2));
  mx = hmax8(_mm256_max_ps(vmax, vmax2));
#endif
  for (; c < c1; ++c) {
    const bool allowed = !m || m[c];
    const float e = allowed ? exp2_neg(kExact ? (s[c] - mref) * c2 : s[c] * c2 - shift) : 0.f;
    sum += e;
    store<T>(p + c, e);
    if (allowed) mx = s[c] > mx ? s[c] : mx;
  }
  if (smax) *smax = mx;
#endif
  return sum;
}

template <typename T>
static inline float exp_row(const float* s, T* p, int64_t c0, int64_t c1, int64_t width,
                            float c2, float mref, float* smax = nullptr,
                            const uint8_t* m = nullptr) {
  return std::fabs(mref * c2) < kExactShift
             ? exp_row_t<T, false>(s, p, c0, c1, width, c2, mref, smax, m)
             : exp_row_t<T, true>(s, p, c0, c1, width, c2, mref, smax, m);
}

// whether x[c] is NaN for some allowed c in [c0, c1) (all c without a mask m)
static inline bool any_nan(const float* x, const uint8_t* m, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c)
    if ((!m || m[c]) && std::isnan(x[c])) return true;
  return false;
}

// Ring attention's blocks (qkv/distributed/block.py) put query row i at key position
// Tk - Tq + shift + i (their global offset); fwd_at/bwd_at set this for one call, so that
// flash_fwd/flash_bwd stay the ops' only entry points.
thread_local int64_t tl_shift = 0;

// Which keys query row i (0-based, aligned bottom-right: position Tk - Tq + i) may see.
struct Structure {
  int64_t Tq, Tk;
  bool causal;
  int64_t window;  // <= 0: none
  int64_t shift = tl_shift;  // 0 but in ring blocks (above)
  int64_t lo(int64_t i) const {
    const int64_t pos = Tk - Tq + shift + i;
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
  int64_t hi(int64_t i) const {
    const int64_t pos = Tk - Tq + shift + i;
    if (causal) return std::min<int64_t>(Tk, pos + 1);
    if (window > 0) return std::min<int64_t>(Tk, pos + window);
    return Tk;
  }
};


}  // namespace
