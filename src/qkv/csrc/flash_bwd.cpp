// qkv's fused CPU flash-attention backward, fp32 and bf16 (FlashAttention-2's), over the
// forward's shared parts (see flash_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "flash_bf16.h"
#include "flash_masks.h"
#include "flash_memory.h"
#include "flash_softmax.h"
#include "flash_variants.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;

// One row of the backward: p = 2^(s·c2 - sh) on the visible columns [c0, c1) (0 elsewhere),
// dS = p∘(dP - D), in place in s and dp; bf16: also rounded copies for the matmuls.
template <typename T>
static inline void grad_row(float* s, float* dp, T* p_low, T* ds_low, int64_t c0, int64_t c1,
                            int64_t nk, float c2, float sh, float Dr, const uint8_t* m) {
  if (c1 <= c0) {  // no visible key (also every row with lse = -inf)
    for (int64_t c = 0; c < nk; ++c) {
      s[c] = dp[c] = 0.f;
      if constexpr (!std::is_same_v<T, float>) store<T>(p_low + c, 0.f), store<T>(ds_low + c, 0.f);
    }
    return;
  }
#ifdef __AVX512F__
  const __m512 vc2 = _mm512_set1_ps(c2), vsh = _mm512_set1_ps(sh), vD = _mm512_set1_ps(Dr);
  for (int64_t c = 0; c < nk; c += 16) {
    const __mmask16 in = c + 16 <= nk ? __mmask16(0xffff) : __mmask16((1u << (nk - c)) - 1u);
    // visible lanes: c0 <= c + i < c1
    const int64_t a = std::clamp<int64_t>(c0 - c, 0, 16), b = std::clamp<int64_t>(c1 - c, 0, 16);
    __mmask16 vis = __mmask16(((1u << b) - 1u) & ~((1u << a) - 1u));
    if (m) vis = mask_bits(m + c, vis);
    // p = exp(s - lse) <= 1 exactly; the clamp keeps the lse's rounding (|lse|·2^-24,
    // large for logits of ~1e9) from pushing it past fp32's range
    const __m512 t = _mm512_min_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(vis, s + c), vc2, vsh),
                                   _mm512_setzero_ps());
    const __m512 p = exp2_v<false>(t, vis);
    const __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(in, dp + c), vD));
    _mm512_mask_storeu_ps(s + c, in, p);
    _mm512_mask_storeu_ps(dp + c, in, ds);
    if constexpr (!std::is_same_v<T, float>) {
      store16<T>(p_low + c, p, in);
      store16<T>(ds_low + c, ds, in);
    }
  }
#else
  int64_t c = 0;
#ifdef QKV_AVX2
  const __m256 vc2 = _mm256_set1_ps(c2), vsh = _mm256_set1_ps(sh), vD = _mm256_set1_ps(Dr);
  const __m256i vc0 = _mm256_set1_epi32(static_cast<int32_t>(c0));
  const __m256i vc1 = _mm256_set1_epi32(static_cast<int32_t>(c1));
  for (; c + 8 <= nk; c += 8) {
    // visible lanes: c0 <= j < c1 (and the mask byte); off lanes are ANDed to 0 (even NaN)
    const __m256i j = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm256_set1_epi32(static_cast<int32_t>(c)));
    __m256 vis = _mm256_castsi256_ps(
        _mm256_andnot_si256(_mm256_cmpgt_epi32(vc0, j), _mm256_cmpgt_epi32(vc1, j)));
    if (m) vis = _mm256_and_ps(vis, allowed8(m + c));
    const __m256 t = _mm256_min_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s + c), vc2, vsh),
                                   _mm256_setzero_ps());  // p <= 1 (see above)
    const __m256 p = _mm256_and_ps(exp2_v8(t), vis);
    const __m256 ds = _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + c), vD));
    _mm256_storeu_ps(s + c, p);
    _mm256_storeu_ps(dp + c, ds);
    if constexpr (!std::is_same_v<T, float>) store8(p_low + c, p), store8(ds_low + c, ds);
  }
#endif
  const int64_t cv = c;  // columns the vector loop did
#pragma omp simd
  for (int64_t i = cv; i < nk; ++i) {
    const bool visible = i >= c0 && i < c1 && (!m || m[i]);
    const float p = visible ? exp2_neg(std::min(s[i] * c2 - sh, 0.f)) : 0.f;  // p <= 1
    s[i] = p;
    dp[i] = p * (dp[i] - Dr);
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = cv; i < nk; ++i) store<T>(p_low + i, s[i]), store<T>(ds_low + i, dp[i]);
  }
#endif
}

// p and dS rows (fp32) -> their low-precision copies for the backward's matmuls
template <typename T>
static inline void to_low(const float* p, const float* ds, T* p_low, T* ds_low, int64_t n) {
  int64_t c = 0;
#ifdef __AVX512F__
  for (; c < n; c += 16) {
    const __mmask16 k = c + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - c)) - 1u);
    store16<T>(p_low + c, _mm512_maskz_loadu_ps(k, p + c), k);
    store16<T>(ds_low + c, _mm512_maskz_loadu_ps(k, ds + c), k);
  }
#elif defined(QKV_AVX2)
  for (; c + 8 <= n; c += 8) store8(p_low + c, load8(p + c)), store8(ds_low + c, load8(ds + c));
#endif
  for (; c < n; ++c) store<T>(p_low + c, p[c]), store<T>(ds_low + c, ds[c]);
}

// Backward, FlashAttention-2 style, parallel over kv heads (each owns its dK, dV and the dQ
// rows of its G query heads, so no two threads write the same memory). Per (q block, key
// block): S = Q Kᵀ, P = exp(S·scale - lse), dVᵀ += dOᵀ P, dP = dO Vᵀ, dS = P∘(dP - D),
// dKᵀ += Qᵀ dS, dQ += dS K; dK and dQ are multiplied by the scale once at the end. Every
// matmul is a plain row-major brgemm thanks to per-head transposed copies of Q, K, V, dO.
// Kᵀ, Vᵀ and the dKᵀ, dVᵀ accumulators are stored block by block ((d, bk) per key block):
// rows Tk apart would put a block's rows 4·Tk bytes apart, in the same few L1 sets (measured
// 1.3x slower at T=4096).
template <typename T>
static void backward_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk,
                          Tensor& dv_, double scale_d, const Structure& st, int64_t bq,
                          int64_t bk, const MaskView& mk, const Variant& var,
                          const VariantGrad& vg, const BlockView& bv, bool dotp = false) {
  const Dims D0 = Dims::of(q, k, v);
  const int64_t N = D0.N, G = D0.G, Tq = D0.Tq, d = D0.d, Tk = D0.Tk, dv = D0.dv;
  const float scale = static_cast<float>(scale_d);
  const float c2 = (var.on ? 1.f : scale) * kLog2e;  // variants: rows hold logits
  const T *qd = q.const_data_ptr<T>(), *kd = k.const_data_ptr<T>(), *vd = v.const_data_ptr<T>();
  const T* od = out.const_data_ptr<T>();
  const T* dod = dout.const_data_ptr<T>();
  const float* lsed = lse.const_data_ptr<float>();
  float* dqd = dq.data_ptr<float>();
  float* dkd = dk.data_ptr<float>();
  float* dvd = dv_.data_ptr<float>();
  constexpr bool low = !std::is_same_v<T, float>;

  parallel_strided(N, [&](int64_t first, int64_t end, int64_t step) {
    const int64_t nkb = (Tk + bk - 1) / bk;
    // per head, read once per query block; cached per thread between calls (see HugeBuffer)
    static thread_local HugeBuffer<T> kt, vt;
    static thread_local HugeBuffer<float> dkt, dvt;
    if (!dotp) kt.assign(nkb * d * bk), vt.assign(nkb * dv * bk);
    dkt.assign(nkb * d * bk);
    dvt.assign(nkb * dv * bk);
    const size_t blk = bq * bk, lowb = low ? blk : 0;
    Scratch sc(2 * Scratch::pages(blk * 4) + 2 * Scratch::pages(lowb * sizeof(T)) +
               Scratch::pages(d * bq * sizeof(T)) + Scratch::pages(dv * bq * sizeof(T)));
    float* S = sc.take<float>(blk);
    float* dP = sc.take<float>(blk);
    T* Plow = sc.take<T>(lowb);
    T* dSlow = sc.take<T>(lowb);
    T* qt = sc.take<T>(d * bq);
    T* dot = sc.take<T>(dv * bq);
    std::vector<float> lse2(bq), D(bq), tb(var.on ? bk : 0);
    std::vector<uint8_t> mb(var.on ? bk : 0);
    std::vector<int64_t> glo_v(bq / kGroup + 2), ghi_v(bq / kGroup + 2);
    int64_t* glo = glo_v.data();
    int64_t* ghi = ghi_v.data();
    // dot path (bf16 without AMX): per key block, Kᵀ and Vᵀ in chunk pairs (S, dP), K in row
    // pairs (dQ); per block, P and dS in row pairs (dVᵀ, dKᵀ)
    const int64_t d2 = (d + 1) / 2, dv2 = (dv + 1) / 2, rbk16 = (bk + 15) / 16 * 16;
    const int64_t rd16 = (d + 15) / 16 * 16, kpblk = (bk + 1) / 2 * rd16;
    static thread_local HugeBuffer<uint32_t> kc, vc, kp, pairs;
    if (dotp) {
      kc.assign(nkb * rbk16 * d2), vc.assign(nkb * rbk16 * dv2), kp.assign(nkb * kpblk);
      pairs.assign((bq + 1) / 2 * 2 * rbk16);
    }
    uint32_t* pp = pairs.data();
    uint32_t* dsp = dotp ? pp + (bq + 1) / 2 * rbk16 : nullptr;
    for (int64_t n = first; n < end; n += step) {
      const T* K = kd + n * Tk * d;
      const T* V = vd + n * Tk * dv;
      for (int64_t j = 0; j < nkb; ++j) {
        const int64_t ks = j * bk, nk = std::min(bk, Tk - ks);
        if constexpr (low) {
          if (dotp) {
            pack_chunks(K + ks * d, nk, d, kc.data() + j * rbk16 * d2);
            pack_chunks(V + ks * dv, nk, dv, vc.data() + j * rbk16 * dv2);
            pack_row_pairs(K + ks * d, nk, d, d, kp.data() + j * kpblk, rd16);
            continue;
          }
        }
        transpose(K + ks * d, nk, d, d, kt.data() + j * d * bk, bk);
        transpose(V + ks * dv, nk, dv, dv, vt.data() + j * dv * bk, bk);
      }
      std::memset(dkt.data(), 0, dkt.n * sizeof(float));
      std::memset(dvt.data(), 0, dvt.n * sizeof(float));
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = n * G + g;
        for (int64_t qs = 0; qs < Tq; qs += bq) {
          const int64_t rows = std::min(bq, Tq - qs);
          const int64_t lo = st.lo(qs), hi = st.hi(qs + rows - 1);
          if (hi <= lo) continue;
          const T* Q = qd + (h * Tq + qs) * d;
          const T* dO = dod + (h * Tq + qs) * dv;
          float* dQ = dqd + (h * Tq + qs) * d;
          transpose(Q, rows, d, d, qt, bq);
          transpose(dO, rows, dv, dv, dot, bq);
          for (int64_t r = 0; r < rows; ++r) {
            const float L = lsed[h * Tq + qs + r];
            lse2[r] = L == kNegInf ? std::numeric_limits<float>::infinity() : L * kLog2e;
            const T* o = od + (h * Tq + qs + r) * dv;
            const T* go = dO + r * dv;
            float acc = 0.f;
            for (int64_t c = 0; c < dv; ++c)
              acc += static_cast<float>(o[c]) * static_cast<float>(go[c]);
            D[r] = acc;
          }
          for (int64_t ks = lo - lo % bk; ks < hi; ks += bk) {
            const int64_t nk = std::min(bk, Tk - ks);
            const int64_t j = ks / bk;
            const int32_t bst = bv.state(n, g, qs / bq, j);
            if (bst == -1) continue;  // an empty block of the block mask
            // row groups as in the forward: each group's matmuls cover only its rows' keys
            const int64_t ng = row_groups(st, bv, bst, qs, rows, ks, nk, glo, ghi);
            for_each_group(ng, rows, glo, ghi, [&](int64_t r0, int64_t nr, int64_t c, int64_t nc) {
              if (dotp) {
                if constexpr (low) {
                  dot_mm(nr, nc, d, Q + r0 * d, d, kc.data() + j * rbk16 * d2 + (c / 16) * d2 * 16,
                         16, d2 * 16, S + r0 * bk + c, bk, false);
                  dot_mm(nr, nc, dv, dO + r0 * dv, dv,
                         vc.data() + j * rbk16 * dv2 + (c / 16) * dv2 * 16, 16, dv2 * 16,
                         dP + r0 * bk + c, bk, false);
                }
              } else {
                mm<T>(nr, nc, d, Q + r0 * d, d, kt.data() + j * d * bk + c, bk, S + r0 * bk + c,
                      bk, false);
                mm<T>(nr, nc, dv, dO + r0 * dv, dv, vt.data() + j * dv * bk + c, bk,
                      dP + r0 * bk + c, bk, false);
              }
            });
            for (int64_t r = 0; r < rows; ++r) {
              // this row's group computed columns [gc, gc + gn) of S and dP; nothing outside
              // them is read again
              const int64_t gi = ng == 1 ? 0 : r / kGroup, gc = glo[gi], gn = ghi[gi] - gc;
              if (gn <= 0) continue;
              int64_t c0 = std::clamp<int64_t>(st.lo(qs + r) - ks, 0, nk);
              int64_t c1 = std::clamp<int64_t>(st.hi(qs + r) - ks, 0, nk);
              float* s = S + r * bk;  // becomes P
              float* dp = dP + r * bk;  // becomes dS
              const float sh = lse2[r], Dr = D[r];
              T* pl = low ? Plow + r * bk + gc : nullptr;
              T* dsl = low ? dSlow + r * bk + gc : nullptr;
              const uint8_t* mr = bst >= 0 ? bv.row(bst, r, c0, c1) : mk.row(n, g, qs + r, ks);
              if (!var.on) {
                grad_row<T>(s + gc, dp + gc, pl, dsl, c0 - gc, c1 - gc, gn, c2, sh, Dr,
                            mr ? mr + gc : nullptr);
                continue;
              }
              // logits, dL = p∘(dP - D) in fp32, the variants' gradients, then the bf16 copies
              if (c1 > c0 && var.row(s, tb.data(), n, g, qs + r, ks, c0, c1))
                mr = finite_mask(s, mr, mb.data(), c0, c1);
              grad_row<float>(s + gc, dp + gc, nullptr, nullptr, c0 - gc, c1 - gc, gn, c2, sh, Dr,
                              mr ? mr + gc : nullptr);
              vg.row(dp, tb.data(), var, n, g, qs + r, ks, c0, c1);
              if constexpr (low) to_low(s + gc, dp + gc, pl, dsl, gn);
            }
            const T* P = low ? Plow : reinterpret_cast<const T*>(S);
            const T* dS = low ? dSlow : reinterpret_cast<const T*>(dP);
            if (dotp) {
              if constexpr (low) {
                pack_row_pairs(P, rows, nk, bk, pp, rbk16);
                pack_row_pairs(dS, rows, nk, bk, dsp, rbk16);
              }
            }
            for_each_group(ng, rows, glo, ghi, [&](int64_t r0, int64_t nr, int64_t c, int64_t nc) {
              if (dotp) {
                if constexpr (low) {
                  const int64_t pr = (r0 / 2) * rbk16 + c;  // pair row r0/2, column c
                  dot_mm(dv, nc, nr, dot + r0, bq, pp + pr, rbk16, 16,
                         dvt.data() + j * dv * bk + c, bk, true);
                  dot_mm(d, nc, nr, qt + r0, bq, dsp + pr, rbk16, 16,
                         dkt.data() + j * d * bk + c, bk, true);
                  dot_mm(nr, d, nc, dS + r0 * bk + c, bk, kp.data() + j * kpblk + (c / 2) * rd16,
                         rd16, 16, dQ + r0 * d, d, true);
                }
                return;
              }
              mm<T>(dv, nc, nr, dot + r0, bq, P + r0 * bk + c, bk, dvt.data() + j * dv * bk + c,
                    bk, true);  // dVᵀ
              mm<T>(d, nc, nr, qt + r0, bq, dS + r0 * bk + c, bk, dkt.data() + j * d * bk + c,
                    bk, true);  // dKᵀ
              mm<T>(nr, d, nc, dS + r0 * bk + c, bk, K + (ks + c) * d, d, dQ + r0 * d, d,
                    true);  // dQ
            });
          }
          for (int64_t i = 0; i < rows * d; ++i) dQ[i] *= scale;
        }
      }
      for (int64_t j = 0; j < nkb; ++j) {
        const int64_t ks = j * bk, nk = std::min(bk, Tk - ks);
        transpose(dkt.data() + j * d * bk, d, nk, bk, dkd + (n * Tk + ks) * d, d);
        transpose(dvt.data() + j * dv * bk, dv, nk, bk, dvd + (n * Tk + ks) * dv, dv);
      }
      for (int64_t i = 0; i < Tk * d; ++i) dkd[n * Tk * d + i] *= scale;
    }
    if (kt.cap_bytes + vt.cap_bytes + dkt.cap_bytes + dvt.cap_bytes + kc.cap_bytes +
            vc.cap_bytes + kp.cap_bytes >
        kKeepBytes)
      kt.release(), vt.release(), dkt.release(), dvt.release(), kc.release(), vc.release(),
          kp.release();
  });
}

std::tuple<Tensor, Tensor, Tensor> flash_bwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& dout,
                                             const Tensor& lse, const std::optional<Tensor>& mask,
                                             double scale, bool causal, int64_t window,
                                             int64_t block_q, int64_t block_k,
                                             const std::optional<Tensor>& bias,
                                             const std::optional<Tensor>& alibi,
                                             const std::optional<Tensor>& rel,
                                             std::optional<double> softcap,
                                             const std::optional<Tensor>& blocks,
                                             const std::optional<Tensor>& tiles,
                                             const std::optional<Tensor>& spans,
                                             const std::optional<Tensor>& dbias,
                                             const std::optional<Tensor>& drel,
                                             const std::optional<Tensor>& dalibi) {
  const MaskView mk = MaskView::of(mask);
  const Variant var = Variant::of(bias, alibi, rel, softcap, scale, q.size(1), q.size(2),
                                  k.size(1));
  const VariantGrad vg = VariantGrad::of(dbias, drel, dalibi);
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                  out.is_contiguous() && dout.is_contiguous() && lse.is_contiguous(),
              "qkv flash_bwd: inputs must be contiguous");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "qkv flash_bwd: lse must be fp32");
  TORCH_CHECK(scale > 0 && std::isfinite(static_cast<float>(scale)),
              "qkv flash_bwd: scale must be finite and > 0 in fp32");
  const Structure st{q.size(2), k.size(1), causal, window};
  auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = at::zeros(q.sizes(), f32), dk = at::empty(k.sizes(), f32);
  Tensor dv = at::empty(v.sizes(), f32);
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) {  // nothing to differentiate
    dk.zero_(), dv.zero_();
    return {dq, dk, dv};
  }
  block_q = std::clamp<int64_t>(block_q, 1, q.size(2));
  block_k = std::clamp<int64_t>(block_k, 1, k.size(1));
  const BlockView bv = BlockView::of(blocks, tiles, spans, (q.size(2) + block_q - 1) / block_q,
                                     (k.size(1) + block_k - 1) / block_k);
  if (q.scalar_type() == at::kFloat) {
    backward_impl<float>(q, k, v, out, dout, lse, dq, dk, dv, scale, st, block_q, block_k, mk,
                         var, vg, bv);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "qkv flash_bwd: fp32 or bf16 only");
    const Bf16Path path = bf16_path(q.size(3));
    if (path == Bf16Path::kWiden) {
      backward_impl<float>(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                           out.to(at::kFloat), dout.to(at::kFloat), lse, dq, dk, dv, scale, st,
                           block_q, block_k, mk, var, vg, bv);
    } else {
      backward_impl<BFloat16>(q, k, v, out, dout, lse, dq, dk, dv, scale, st, block_q, block_k,
                              mk, var, vg, bv, path == Bf16Path::kDot);
    }
  }
  return {dq, dk, dv};
}


// fwd/bwd with query row i at key position Tk - Tq + shift + i (see tl_shift)
struct ShiftScope {
  explicit ShiftScope(int64_t s) { tl_shift = s; }
  ~ShiftScope() { tl_shift = 0; }
};

std::tuple<Tensor, Tensor, Tensor> flash_bwd_at(const Tensor& q, const Tensor& k,
                                                const Tensor& v, const Tensor& out,
                                                const Tensor& dout, const Tensor& lse,
                                                double scale, bool causal, int64_t window,
                                                int64_t block_q, int64_t block_k,
                                                int64_t shift) {
  ShiftScope at(shift);
  const std::optional<Tensor> none;
  return flash_bwd(q, k, v, out, dout, lse, none, scale, causal, window, block_q, block_k, none,
                   none, none, std::nullopt, none, none, none, none, none, none);
}
}  // namespace

TORCH_LIBRARY_IMPL(qkv_flash, CPU, m) {
  m.impl("bwd", &flash_bwd);
  m.impl("bwd_at", &flash_bwd_at);
}
