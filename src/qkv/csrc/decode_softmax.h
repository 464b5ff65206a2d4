// The online softmax over one block of 64 keys' scores (log2 units): the running max m, sum l
// and the rescaling of acc, P in fp32 or bf16, on each level's vectors (exp2 from simd.h).
// Shared by a segment's block loop (decode_segment.h) and the AMX path (decode_amx.h).
#pragma once

#include "decode_qk_avx512.h"  // exp2_v
#include "decode_avx2.h"       // hmax8, hsum8, exp2_v8

namespace {

// Online softmax over one block of scores S (rows of kBlock, log2 units, -inf where not
// visible): P = 2^(S - m), l += sum P, acc (row stride dvp) rescaled where m grows. kBf16P:
// P in bf16 (for vdpbf16ps and AMX tiles; l keeps the exact sum: the lse), else fp32.
template <bool kBf16P>
static inline void softmax_block(const float* S, float* P, int64_t R, float* m, float* l,
                                 float* acc, int64_t dvp) {
  for (int64_t r = 0; r < R; ++r) {
    const float* s = S + r * kBlock;
    float* p = P + r * kBlock;
    float bm = kNegInf;
#ifdef QKV_AVX512
    __m512 vm = _mm512_loadu_ps(s);
    for (int64_t j = 16; j < kBlock; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
    bm = _mm512_reduce_max_ps(vm);
#elif defined(QKV_DECODE_AVX2)
    __m256 vm = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < kBlock; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    bm = hmax8(vm);
#else
    for (int64_t j = 0; j < kBlock; ++j) bm = s[j] > bm ? s[j] : bm;
#endif
    // vmaxps drops a NaN: a block whose visible scores are all NaN looks empty here; look
    // again (rare: only blocks with no finite visible score), a NaN makes the row NaN
    if (bm == kNegInf)
      for (int64_t j = 0; j < kBlock; ++j)
        if (std::isnan(s[j])) bm = std::numeric_limits<float>::quiet_NaN();
    if (bm == kNegInf) {  // nothing visible in this block
      if constexpr (kBf16P)
        std::memset(reinterpret_cast<BFloat16*>(P) + r * kBlock, 0, kBlock * sizeof(BFloat16));
      else
        std::memset(p, 0, kBlock * sizeof(float));
      continue;
    }
    if (m[r] == kNegInf) {
      m[r] = bm;  // acc and l are still 0
    } else if (bm > m[r] + kLazy) {
      const float alpha = exp2_neg(m[r] - bm);
      m[r] = bm;
      l[r] *= alpha;
      float* o = acc + r * dvp;
      for (int64_t c = 0; c < dvp; ++c) o[c] *= alpha;
    }
    const float mr = m[r];
#ifdef QKV_AVX512
    __m512 vs = _mm512_setzero_ps();
    const __m512 vmr = _mm512_set1_ps(mr), ninf = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < kBlock; j += 16) {
      const __m512 x = _mm512_loadu_ps(s + j);
      // unordered: a NaN lane stays visible (its NaN reaches l and the output)
      const __mmask16 vis = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ);
      const __m512 e = exp2_v<false>(_mm512_sub_ps(x, vmr), vis);
      if constexpr (kBf16P) {
        const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(reinterpret_cast<BFloat16*>(P) + r * kBlock + j), eb);
      } else {
        _mm512_storeu_ps(p + j, e);
      }
      vs = _mm512_add_ps(vs, e);
    }
    l[r] += _mm512_reduce_add_ps(vs);
#elif defined(QKV_DECODE_AVX2)
    if constexpr (!kBf16P) {  // bf16 P is the AVX512_BF16 path's only
      __m256 vs = _mm256_setzero_ps();
      const __m256 vmr = _mm256_set1_ps(mr);
      for (int64_t j = 0; j < kBlock; j += 8) {
        const __m256 e = exp2_v8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmr));  // -inf: 0
        _mm256_storeu_ps(p + j, e);
        vs = _mm256_add_ps(vs, e);
      }
      l[r] += hsum8(vs);
    }
#else
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      p[j] = s[j] == kNegInf ? 0.f : exp2_neg(s[j] - mr);
      sum += p[j];
    }
    l[r] += sum;
#endif
  }
}

}  // namespace
