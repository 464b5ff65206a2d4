// The flash kernels' variants: bias, ALiBi slopes, relative-position tables and
// soft-capping, applied to a score row in place (Variant), and their gradients (VariantGrad).
#pragma once

#include "flash_memory.h"

namespace {

// ---- Variants: bias, ALiBi, relative-position table, soft-capping, block masks -----------
// With any of the first four, each score row becomes its final logits in place before the
// softmax (the order of qkv.functional): x = s·scale → cap·tanh(x/cap) → + bias
// - slope_h·|p(i) - j| + rel_h[j - p(i) + Tk - 1]; the exponent is then (x - m)·log2e and the
// lse is m + log l. A logit of -inf (an additive mask in the bias) counts as masked. None of
// them holds a (Tq, Tk) tensor except a bias the caller passed.

#ifdef __AVX512F__
// tanh for 16 lanes: tanh|x| = (1 - e) / (1 + e) with e = 2^(-2|x|·log2e) in (0, 1]
// (absolute error ~1e-7), the sign copied from x.
static inline __m512 tanh_v(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  // max returns its second operand when one is NaN: x's NaN is kept (a NaN logit stays NaN)
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-200.f),
                                 _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f * kLog2e)));
  const __m512 e = exp2_v<false>(t, 0xffff);
  const __m512 den = _mm512_add_ps(one, e);  // in [1, 2]: 1/den by rcp14 and a Newton step
  __m512 r = _mm512_rcp14_ps(den);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(2.f)));
  const __m512 th = _mm512_mul_ps(_mm512_sub_ps(one, e), r);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sign));
}
#elif defined(QKV_AVX2)
// the same on 8 lanes (rcp is 12 bits here: the Newton step brings it to ~23)
static inline __m256 tanh_v8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 t = _mm256_max_ps(  // x's NaN kept, as above
      _mm256_set1_ps(-200.f),
      _mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.f * kLog2e)));
  const __m256 e = exp2_v8(t);
  const __m256 den = _mm256_add_ps(one, e);
  __m256 r = _mm256_rcp_ps(den);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(den, r, _mm256_set1_ps(2.f)));
  const __m256 th = _mm256_mul_ps(_mm256_sub_ps(one, e), r);
  return _mm256_or_ps(th, _mm256_and_ps(sign, x));
}
#endif

struct Variant {
  bool on = false;
  float scale = 1.f, cap = 0.f;  // cap = 0: no soft-capping
  int64_t h_kv = 1, G = 1, Tq = 0, Tk = 0;
  const void* bias = nullptr;  // view (Nb, h_kv, G, Tq, Tk) of fp32 or bf16, key stride 0/1
  bool bias_bf16 = false;
  int64_t bs[5] = {0, 0, 0, 0, 0};
  const float* alibi = nullptr;  // slopes (h_kv, G): query head hq = hk·G + g
  const float* rel = nullptr;  // (h_kv, G, Tq + Tk - 1): rel[hq, j - p(i) + Tk - 1]
  int64_t rel_ld = 0;

  int64_t head(int64_t n, int64_t g) const { return (n % h_kv) * G + g; }
  int64_t pos(int64_t i) const { return Tk - Tq + i; }
  int64_t bias_off(int64_t n, int64_t g, int64_t i) const {
    return (n / h_kv) * bs[0] + (n % h_kv) * bs[1] + g * bs[2] + i * bs[3];
  }

  // s[c0:c1) (query i, keys ks + c) -> logits; t[c] = tanh(x/cap) if soft-capping and t.
  // Returns whether some logit is -inf.
  bool row(float* s, float* t, int64_t n, int64_t g, int64_t i, int64_t ks, int64_t c0,
           int64_t c1) const {
    const int64_t bo = bias ? bias_off(n, g, i) + (bs[4] ? ks : 0) : 0;
    const float* br = bias && !bias_bf16 ? static_cast<const float*>(bias) + bo : nullptr;
    const uint16_t* bb = bias && bias_bf16 ? static_cast<const uint16_t*>(bias) + bo : nullptr;
    auto bias_at = [&](int64_t c) {  // one bias value (c = 0 for a key-broadcast bias)
      if (br) return br[c];
      const uint32_t u = uint32_t(bb[c]) << 16;
      float f;
      std::memcpy(&f, &u, sizeof(f));
      return f;
    };
    const int64_t hq = head(n, g);
    const float slope = alibi ? alibi[hq] : 0.f;
    const float* rr = rel ? rel + hq * rel_ld + (ks - pos(i) + Tk - 1) : nullptr;
    const float dpos = static_cast<float>(pos(i) - ks);  // distance = |dpos - c|
    bool neg = false;
    int64_t c = c0;
#ifdef __AVX512F__
    const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(cap);
    const __m512 vinv = _mm512_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 anyneg = 0;
    for (; c < c1; c += 16) {
      const __mmask16 k = c + 16 <= c1 ? __mmask16(0xffff) : __mmask16((1u << (c1 - c)) - 1u);
      __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + c), vscale);
      if (cap > 0.f) {
        const __m512 th = tanh_v(_mm512_mul_ps(x, vinv));
        if (t) _mm512_mask_storeu_ps(t + c, k, th);
        x = _mm512_mul_ps(th, vcap);
      }
      if (bias) {
        __m512 b;
        if (!bs[4]) {
          b = _mm512_set1_ps(bias_at(0));
        } else if (br) {
          b = _mm512_maskz_loadu_ps(k, br + c);
        } else {  // bf16 -> fp32: the 16 bits above 16 zero bits
          const __m256i h = _mm256_maskz_loadu_epi16(k, bb + c);
          b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        // a -inf bias masks its key even where the score is +inf (+inf - inf would be NaN)
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                                 _mm512_add_ps(x, b), b);
      }
      if (alibi) {
        const __m512 dist = _mm512_abs_ps(
            _mm512_sub_ps(_mm512_set1_ps(dpos - static_cast<float>(c)), iota));
        x = _mm512_fnmadd_ps(_mm512_set1_ps(slope), dist, x);
      }
      if (rr) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, rr + c));
      anyneg |= _mm512_mask_cmp_ps_mask(k, x, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
      _mm512_mask_storeu_ps(s + c, k, x);
    }
    neg = anyneg != 0;
#else
#ifdef QKV_AVX2
    const __m256 vscale = _mm256_set1_ps(scale), vcap = _mm256_set1_ps(cap);
    const __m256 vinv = _mm256_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), abs = _mm256_set1_ps(-0.f);
    __m256 anyneg = _mm256_setzero_ps();
    for (; c + 8 <= c1; c += 8) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + c), vscale);
      if (cap > 0.f) {
        const __m256 th = tanh_v8(_mm256_mul_ps(x, vinv));
        if (t) _mm256_storeu_ps(t + c, th);
        x = _mm256_mul_ps(th, vcap);
      }
      if (bias) {
        const __m256 b = !bs[4] ? _mm256_set1_ps(bias_at(0))
                         : br   ? _mm256_loadu_ps(br + c)
                                : load8(reinterpret_cast<const BFloat16*>(bb + c));
        // a -inf bias masks its key even where the score is +inf (+inf - inf would be NaN)
        x = _mm256_blendv_ps(_mm256_add_ps(x, b), b,
                             _mm256_cmp_ps(b, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ));
      }
      if (alibi) {
        const __m256 dist = _mm256_andnot_ps(
            abs, _mm256_sub_ps(_mm256_set1_ps(dpos - static_cast<float>(c)), iota));
        x = _mm256_fnmadd_ps(_mm256_set1_ps(slope), dist, x);
      }
      if (rr) x = _mm256_add_ps(x, _mm256_loadu_ps(rr + c));
      anyneg = _mm256_or_ps(anyneg, _mm256_cmp_ps(x, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ));
      _mm256_storeu_ps(s + c, x);
    }
    neg = _mm256_movemask_ps(anyneg) != 0;
#endif
    for (; c < c1; ++c) {
      float x = s[c] * scale;
      if (cap > 0.f) {
        const float th = std::tanh(x / cap);
        if (t) t[c] = th;
        x = cap * th;
      }
      if (bias) {
        const float b = bias_at(bs[4] ? c : 0);
        x = b == kNegInf ? b : x + b;  // -inf masks even a +inf score
      }
      if (alibi) x -= slope * std::fabs(dpos - static_cast<float>(c));
      if (rr) x += rr[c];
      neg |= x == kNegInf;
      s[c] = x;
    }
#endif
    return neg;
  }

  static Variant of(const std::optional<Tensor>& bias, const std::optional<Tensor>& alibi,
                    const std::optional<Tensor>& rel, std::optional<double> softcap,
                    double scale, int64_t G, int64_t Tq, int64_t Tk) {
    Variant v;
    v.scale = static_cast<float>(scale), v.G = G, v.Tq = Tq, v.Tk = Tk;
    if (softcap.has_value()) {
      TORCH_CHECK(*softcap > 0 && std::isfinite(static_cast<float>(*softcap)),
                  "qkv flash: softcap must be finite and > 0 in fp32");
      v.cap = static_cast<float>(*softcap);
    }
    if (bias.has_value() && bias->defined()) {
      const Tensor& b = *bias;
      TORCH_CHECK((b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16) &&
                      b.dim() == 5 && b.size(3) == Tq && b.size(4) == Tk &&
                      (b.stride(4) == 0 || b.stride(4) == 1),
                  "qkv flash: bias must be an fp32/bf16 (Nb, h_kv, G, Tq, Tk) view, key stride "
                  "0/1");
      v.bias = b.const_data_ptr();
      v.bias_bf16 = b.scalar_type() == at::kBFloat16;
      for (int x = 0; x < 5; ++x) v.bs[x] = b.stride(x);
      v.h_kv = b.size(1);
    }
    if (alibi.has_value() && alibi->defined()) {
      TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->is_contiguous() &&
                      alibi->dim() == 2 && alibi->size(1) == G,
                  "qkv flash: alibi slopes must be contiguous fp32 (h_kv, G)");
      v.alibi = alibi->const_data_ptr<float>(), v.h_kv = alibi->size(0);
    }
    if (rel.has_value() && rel->defined()) {
      TORCH_CHECK(rel->scalar_type() == at::kFloat && rel->is_contiguous() && rel->dim() == 3 &&
                      rel->size(1) == G && rel->size(2) == Tq + Tk - 1,
                  "qkv flash: rel must be contiguous fp32 (h_kv, G, Tq + Tk - 1)");
      v.rel = rel->const_data_ptr<float>(), v.rel_ld = rel->size(2), v.h_kv = rel->size(0);
    }
    v.on = v.cap > 0.f || v.bias || v.alibi || v.rel;
    return v;
  }
};

// mb[c] = allowed by the mask row m (all if none) and x[c] > -inf, for c in [c0, c1)
static inline const uint8_t* finite_mask(const float* x, const uint8_t* m, uint8_t* mb,
                                         int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) mb[c] = (!m || m[c]) && x[c] != kNegInf;
  return mb;
}


// Gradients of the variants from dL = d(loss)/d(logits) of one row (query i, keys ks + c,
// c in [c0, c1); dL is 0 elsewhere): the bias's (broadcast dims summed in place), the
// relative table's, the ALiBi slope's; then dL becomes d/d(s·scale): times 1 - tanh².
struct VariantGrad {
  float* dbias = nullptr;  // (Nb, h_kv, Gb, Tqb, Tkb), dims 2-4 of size 1 when broadcast
  int64_t ds[5] = {0, 0, 0, 0, 0}, dsz[5] = {1, 1, 1, 1, 1};
  float* drel = nullptr;  // (N, G, Tq + Tk - 1)
  float* dalibi = nullptr;  // (N, G)

  static VariantGrad of(const std::optional<Tensor>& dbias, const std::optional<Tensor>& drel,
                        const std::optional<Tensor>& dalibi) {
    VariantGrad g;
    if (dbias.has_value() && dbias->defined()) {
      TORCH_CHECK(dbias->scalar_type() == at::kFloat && dbias->dim() == 5,
                  "qkv flash_bwd: dbias must be fp32 5-D");
      g.dbias = dbias->data_ptr<float>();
      for (int x = 0; x < 5; ++x) g.ds[x] = dbias->stride(x), g.dsz[x] = dbias->size(x);
    }
    if (drel.has_value() && drel->defined()) {
      TORCH_CHECK(drel->scalar_type() == at::kFloat && drel->is_contiguous(),
                  "qkv flash_bwd: drel must be contiguous fp32");
      g.drel = drel->data_ptr<float>();
    }
    if (dalibi.has_value() && dalibi->defined()) {
      TORCH_CHECK(dalibi->scalar_type() == at::kFloat && dalibi->is_contiguous(),
                  "qkv flash_bwd: dalibi must be contiguous fp32");
      g.dalibi = dalibi->data_ptr<float>();
    }
    return g;
  }

  void row(float* dl, const float* t, const Variant& v, int64_t n, int64_t g, int64_t i,
           int64_t ks, int64_t c0, int64_t c1) const {
    if (c1 <= c0) return;
    if (dbias) {
      const int64_t h_kv = v.h_kv;
      float* r = dbias + (n / h_kv) * ds[0] + (n % h_kv) * ds[1] + (dsz[2] > 1 ? g : 0) * ds[2] +
                 (dsz[3] > 1 ? i : 0) * ds[3];
      if (dsz[4] > 1) {
        r += ks;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) r[c] += dl[c];
      } else {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = c0; c < c1; ++c) acc += dl[c];
        r[0] += acc;
      }
    }
    if (drel) {
      float* r = drel + (n * v.G + g) * v.rel_ld + (ks - v.pos(i) + v.Tk - 1);
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) r[c] += dl[c];
    }
    if (dalibi) {  // d/dslope of -slope·|p(i) - j|
      const float dpos = static_cast<float>(v.pos(i) - ks);
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = c0; c < c1; ++c) acc += dl[c] * std::fabs(dpos - static_cast<float>(c));
      dalibi[n * v.G + g] -= acc;
    }
    if (v.cap > 0.f) {
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dl[c] *= 1.f - t[c] * t[c];
    }
  }
};

}  // namespace
