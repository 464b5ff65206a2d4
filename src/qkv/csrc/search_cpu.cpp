// qkv's CPU kernels for the search of a decoding loop (qkv.generate), one read of the logits
// each: beam search's fused step (log-softmax, scores and the k best candidates) and greedy
// search's argmax. Registered as torch.ops.qkv_decode.beam_topk / argmax_rows; greedy_pick is
// the same argmax for module.cpp's per-step Python function.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

namespace {
using at::Tensor;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#ifdef QKV_AVX512
using qkv_simd::exp2_v;  // 2^t for 16 lanes
using qkv_simd::lanes;
#elif defined(QKV_AVX2)
using qkv_simd::exp2_v8;  // 2^t for 8 lanes (0 for -inf)
using qkv_simd::hmax8;
using qkv_simd::hsum8;
#endif

// -------------------------------------------------------------------------------------------
// Beam search's step, fused: log-softmax of each hypothesis' logits, plus its score, and the
// k best (hypothesis, token) candidates of each sentence, in one read of the logits and
// without writing the (N, V) log-probabilities. logits (B·beams, V) fp32, scores (B·beams,)
// fp32; block >= 0: that token's log-probability is -inf (after normalising, as setting it in
// the log-softmax output). Returns values (B, k) best first and their flat indices
// (B, k) = beam·V + token; ties keep the lower index first; a sentence with fewer than k
// candidates above -inf gets -inf entries at the lowest unused indices.

// log Σ exp(x) over one row (max first; -inf entries add nothing)
static float row_lse(const float* x, int64_t V) {
  float m = kNegInf;
  int64_t j = 0;
#ifdef QKV_AVX512
  __m512 vm = _mm512_set1_ps(kNegInf);
  for (; j + 16 <= V; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + j));
  m = _mm512_reduce_max_ps(vm);
#elif defined(QKV_AVX2)
  __m256 vm = _mm256_set1_ps(kNegInf);
  for (; j + 8 <= V; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
  m = hmax8(vm);
#endif
  for (; j < V; ++j) m = x[j] > m ? x[j] : m;
  if (!(m > kNegInf) || std::isinf(m)) return m;  // no finite entry (or +inf): as is
  double sum = 0.0;
  j = 0;
#ifdef QKV_AVX512
  const __m512 vmax = _mm512_set1_ps(m), l2e = _mm512_set1_ps(kLog2e);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 fin = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    acc = _mm512_add_ps(acc, exp2_v<false>(_mm512_mul_ps(_mm512_sub_ps(v, vmax), l2e), fin));
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(QKV_AVX2)
  // (the scalar loop's std::exp in double took ~10 ns an element: 13 ms of a 32-sentence,
  // beam-5 step's 8000-token rows on Zen 3)
  const __m256 vmax = _mm256_set1_ps(m), l2e = _mm256_set1_ps(kLog2e);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= V; j += 8) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmax), l2e);
    acc = _mm256_add_ps(acc, exp2_v8(t));  // -inf: 0
  }
  sum = hsum8(acc);
#endif
  for (; j < V; ++j) sum += std::exp(static_cast<double>(x[j]) - m);
  return m + static_cast<float>(std::log(sum));
}

struct Cand {
  float v;
  int64_t i;
};

// insert (v, i) into best[0..k) (sorted, best first) if it beats the last entry
static inline void offer(Cand* best, int64_t k, float v, int64_t i) {
  if (!(v > best[k - 1].v)) return;
  int64_t p = k - 1;
  while (p > 0 && v > best[p - 1].v) {
    best[p] = best[p - 1];
    --p;
  }
  best[p] = {v, i};
}

std::tuple<Tensor, Tensor> beam_topk(const Tensor& logits, const Tensor& scores, int64_t beams,
                                     int64_t k, int64_t block) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "qkv beam_topk: logits must be a contiguous float32 (N, V) tensor");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(beams >= 1 && N % beams == 0, "qkv beam_topk: N must be a multiple of beams");
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == N && scores.scalar_type() == at::kFloat &&
                  scores.is_contiguous(),
              "qkv beam_topk: scores must be a contiguous float32 (N,) tensor");
  TORCH_CHECK(k >= 1 && k <= beams * V, "qkv beam_topk: need 1 <= k <= beams * V");
  const int64_t B = N / beams;
  Tensor top = at::empty({B, k}, logits.options());
  Tensor idx = at::empty({B, k}, logits.options().dtype(at::kLong));
  const float* X = logits.const_data_ptr<float>();
  const float* S = scores.const_data_ptr<float>();
  float* TV = top.data_ptr<float>();
  int64_t* TI = idx.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<Cand> best(k);
    for (int64_t b = b0; b < b1; ++b) {
      for (auto& c : best) c = {kNegInf, -1};
      for (int64_t r = 0; r < beams; ++r) {
        const int64_t row = b * beams + r;
        const float* x = X + row * V;
        const float lse = row_lse(x, V), sc = S[row];
        const int64_t base = r * V;
        int64_t j = 0;
#ifdef QKV_AVX512
        const __m512 vl = _mm512_set1_ps(lse), vs = _mm512_set1_ps(sc);
        for (; j + 16 <= V; j += 16) {
          // the same float operations as the scalar loop below: one decision per element
          const __m512 v = _mm512_add_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vl), vs);
          __mmask16 hit = _mm512_cmp_ps_mask(v, _mm512_set1_ps(best[k - 1].v), _CMP_GT_OQ);
          if (block >= j && block < j + 16) hit &= __mmask16(~(1u << (block - j)));
          while (hit) {
            const int lane = __builtin_ctz(hit);
            hit &= hit - 1;
            offer(best.data(), k, (x[j + lane] - lse) + sc, base + j + lane);
          }
        }
#elif defined(QKV_AVX2)
        const __m256 vl = _mm256_set1_ps(lse), vs = _mm256_set1_ps(sc);
        for (; j + 8 <= V; j += 8) {
          const __m256 v = _mm256_add_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vl), vs);
          unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(
              _mm256_cmp_ps(v, _mm256_set1_ps(best[k - 1].v), _CMP_GT_OQ)));
          if (block >= j && block < j + 8) hit &= ~(1u << (block - j));
          while (hit) {
            const int lane = __builtin_ctz(hit);
            hit &= hit - 1;
            offer(best.data(), k, (x[j + lane] - lse) + sc, base + j + lane);
          }
        }
#endif
        for (; j < V; ++j)
          if (j != block) offer(best.data(), k, (x[j] - lse) + sc, base + j);
      }
      // fewer than k candidates above -inf: -inf at the lowest indices not taken
      int64_t next = 0;
      for (int64_t p = 0; p < k; ++p) {
        if (best[p].i >= 0) continue;
        for (;; ++next) {
          bool used = false;
          for (int64_t q = 0; q < k; ++q) used = used || best[q].i == next;
          if (!used) break;
        }
        best[p] = {kNegInf, next++};
      }
      for (int64_t p = 0; p < k; ++p) TV[b * k + p] = best[p].v, TI[b * k + p] = best[p].i;
    }
  });
  return {top, idx};
}

// -------------------------------------------------------------------------------------------
// Greedy search's choice: the index of each row's largest logit, token `block` (if >= 0)
// counted as -inf, as torch.argmax gives it after `logits[:, block] = -inf`: the first index
// of the maximum, the first NaN where a row has one. torch's argmax over (32, 8000) took
// ~0.37 ms of a ~5 ms decode step (1 thread, Xeon); this reads each row twice from L1/L2.
static void argmax_core(const float* X, int64_t N, int64_t V, int64_t block, int64_t* I) {
  auto value = [&](const float* x, int64_t j) { return j == block ? kNegInf : x[j]; };
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = X + r * V;
      float m = kNegInf;
      bool nan = false;
      int64_t j = 0;
#ifdef QKV_AVX512
      __m512 vm = _mm512_set1_ps(kNegInf);
      __mmask16 un = 0;
      for (; j + 16 <= V; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        if (block >= j && block < j + 16)
          v = _mm512_mask_mov_ps(v, __mmask16(1u << (block - j)), _mm512_set1_ps(kNegInf));
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
      }
      nan = un != 0;
      m = _mm512_reduce_max_ps(vm);
#elif defined(QKV_AVX2)
      __m256 vm = _mm256_set1_ps(kNegInf), un = _mm256_setzero_ps();
      for (; j + 8 <= V; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        if (block >= j && block < j + 8) {
          alignas(32) float t[8];
          _mm256_store_ps(t, v);
          t[block - j] = kNegInf;
          v = _mm256_load_ps(t);
        }
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
      }
      nan = _mm256_movemask_ps(un) != 0;
      m = hmax8(vm);
#endif
      for (int64_t t = j; t < V; ++t) {
        const float v = value(x, t);
        nan = nan || std::isnan(v);
        m = v > m ? v : m;
      }
      int64_t best = 0;
      if (nan) {
        while (!std::isnan(value(x, best))) ++best;
      } else {
        int64_t t = 0;
#ifdef QKV_AVX512
        const __m512 vmax = _mm512_set1_ps(m);
        for (; t + 16 <= V; t += 16) {
          __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + t), vmax, _CMP_EQ_OQ);
          if (block >= t && block < t + 16) {  // the blocked token counts as -inf
            const __mmask16 bit = __mmask16(1u << (block - t));
            hit = m == kNegInf ? __mmask16(hit | bit) : __mmask16(hit & ~bit);
          }
          if (hit) break;
        }
#elif defined(QKV_AVX2)
        const __m256 vmax = _mm256_set1_ps(m);
        for (; t + 8 <= V; t += 8) {
          unsigned hit = static_cast<unsigned>(
              _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + t), vmax, _CMP_EQ_OQ)));
          if (block >= t && block < t + 8) {  // the blocked token counts as -inf
            const unsigned bit = 1u << (block - t);
            hit = m == kNegInf ? (hit | bit) : (hit & ~bit);
          }
          if (hit) break;
        }
#endif
        while (t < V && value(x, t) != m) ++t;
        best = t < V ? t : 0;
      }
      I[r] = best;
    }
  });
}

static void check_logits(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "qkv argmax_rows: logits must be a contiguous float32 (N, V) tensor");
  TORCH_CHECK(logits.size(1) >= 1, "qkv argmax_rows: need V >= 1");
}

Tensor argmax_rows(const Tensor& logits, int64_t block) {
  check_logits(logits);
  Tensor idx = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  argmax_core(logits.const_data_ptr<float>(), logits.size(0), logits.size(1), block,
              idx.data_ptr<int64_t>());
  return idx;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(qkv_decode, m) {
  m.def("beam_topk(Tensor logits, Tensor scores, int beams, int k, int block) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_decode, CPU, m) {
  m.impl("beam_topk", &beam_topk);
  m.impl("argmax_rows", &argmax_rows);
}

namespace qkv {
// argmax_rows written into out (N,) int64; returns how many rows chose token eos (if >= 0)
int64_t greedy_pick(const Tensor& logits, int64_t block, int64_t eos, const Tensor& out) {
  check_logits(logits);
  const int64_t N = logits.size(0);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == N &&
                  out.is_contiguous() && out.device().is_cpu(),
              "qkv greedy_pick: out must be a contiguous int64 (N,) CPU tensor");
  int64_t* I = out.data_ptr<int64_t>();
  argmax_core(logits.const_data_ptr<float>(), N, logits.size(1), block, I);
  int64_t ended = 0;
  for (int64_t r = 0; r < N; ++r) ended += eos >= 0 && I[r] == eos;
  return ended;
}
}  // namespace qkv
