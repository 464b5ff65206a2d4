// qkv's CPU linear layers for few rows (a decode step: one row per hypothesis), fp32 weights
// packed once into panels of 64 output columns (qkv.kernels.packed): every weight is read
// once per call, sequentially, so a step runs at the read bandwidth. Registered as
// torch.ops.qkv_decode.small_linear; panel_linear_into is the same for the fused decoder step
// (step_cpu.cpp) on its own buffers.
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

#if defined(QKV_AVX2) || defined(QKV_AVX512)
using qkv_simd::pf_line;
#endif
#ifdef QKV_AVX512
using qkv_simd::lanes;
#endif

// -------------------------------------------------------------------------------------------
// y = act(x Wᵀ + b) for few rows x (M, in) (a decode step: one row per hypothesis), the weight
// packed once into panels of 64 output columns, each panel's rows contiguous:
// panels (P, in, 64), P = ceil(out / 64), zero past `out`. Every weight element is read once
// per call, sequentially within each panel; up to 6 rows share each load (6 x 4 vector
// accumulators). Sums run over `in` in order, in fp32 (one row: in four interleaved parts).
constexpr int64_t kPanel = 64;
constexpr int64_t kRows = 6;

#ifdef QKV_AVX512
// Columns 16q.. of a panel's bias (c0: the panel's first column, nc <= 64 of them real), or 0.
static inline __m512 panel_bias(const float* b, int64_t c0, int64_t nc, int q) {
  if (!b) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps(lanes(std::max<int64_t>(nc - 16 * q, 0)), b + c0 + 16 * q);
}

// The first nc (<= 64) columns of a panel's output row from its 4 accumulators, relu'd if asked.
static inline void store_panel_row(const __m512* acc, int64_t nc, bool relu, float* y) {
  for (int q = 0; q < 4; ++q) {
    const __mmask16 cm = lanes(std::max<int64_t>(nc - 16 * q, 0));
    if (!cm) break;
    const __m512 v = relu ? _mm512_max_ps(acc[q], _mm512_setzero_ps()) : acc[q];
    _mm512_mask_storeu_ps(y + 16 * q, cm, v);
  }
}

// One row (a decode step of one sequence): pure streaming, so the read rate is all. The
// panel's rows are read as four streams at once (its quarters, each with its own 4
// accumulators, added at the end): one core keeps more lines in flight than with one
// stream. Measured on Zen 4, 1 thread, 1.4 GB of panels (a 12-layer LM's linears): one
// stream 23.5 GB/s, two 25, four 26 (a sum over the same bytes: 31), six or eight no better.
static void panel_row1(const float* x, const float* w, int64_t in, const float* b, int64_t c0,
                       int64_t nc, bool relu, float* y) {
  constexpr int kS = 4;
  __m512 a[kS][4];
  for (int q = 0; q < 4; ++q) {
    a[0][q] = panel_bias(b, c0, nc, q);
    for (int s = 1; s < kS; ++s) a[s][q] = _mm512_setzero_ps();
  }
  const int64_t h = in / kS;
  for (int64_t i = 0; i < h; ++i)
    for (int s = 0; s < kS; ++s) {
      const int64_t r = i + s * h;
      const float* wr = w + r * kPanel;
      const __m512 xr = _mm512_set1_ps(x[r]);
      for (int q = 0; q < 4; ++q) a[s][q] = _mm512_fmadd_ps(xr, _mm512_loadu_ps(wr + 16 * q), a[s][q]);
    }
  for (int64_t r = kS * h; r < in; ++r) {  // the last in % 4 rows
    const float* wr = w + r * kPanel;
    const __m512 xr = _mm512_set1_ps(x[r]);
    for (int q = 0; q < 4; ++q) a[0][q] = _mm512_fmadd_ps(xr, _mm512_loadu_ps(wr + 16 * q), a[0][q]);
  }
  __m512 sum[4];
  for (int q = 0; q < 4; ++q)
    sum[q] = _mm512_add_ps(_mm512_add_ps(a[0][q], a[1][q]), _mm512_add_ps(a[2][q], a[3][q]));
  store_panel_row(sum, nc, relu, y + c0);
}
#endif

#if defined(QKV_AVX2) && !defined(QKV_AVX512)
// AVX2 (16 vector registers): MR rows x CW vectors of 8 columns of accumulators, columns
// [cb, cb + 8·CW) of the panel in one pass over its rows (the panel stays in L1/L2 between
// passes; one row takes all 64 columns in one pass). A partial last panel (nc < 64) loads
// its bias and stores its outputs through a small buffer.
template <int MR, int CW, bool kPf>
static inline void panel_pass_avx2(const float* x, int64_t ldx, const float* w, int64_t in,
                                   const float* b, int64_t c0, int64_t nc, int64_t cb,
                                   bool relu, float* y, int64_t ldy, const float* pf) {
  __m256 acc[MR][CW];
  // every loop over m and j unrolled: acc must stay in registers (GCC kept it on the stack,
  // 12 stores per row of the panel, when the store loop below was left rolled)
#pragma GCC unroll 8
  for (int j = 0; j < CW; ++j) {
    const int64_t c = cb + 8 * j, n = std::clamp<int64_t>(nc - c, 0, 8);
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (b) std::copy(b + c0 + c, b + c0 + c + n, t);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_load_ps(t);
  }
  for (int64_t i = 0; i < in; ++i) {
    const float* wr = w + i * kPanel + cb;
    if constexpr (kPf)
      for (int j = 0; j < CW; j += 2) pf_line(pf + i * kPanel + cb + 8 * j);
    __m256 wv[CW];
#pragma GCC unroll 8
    for (int j = 0; j < CW; ++j) wv[j] = _mm256_loadu_ps(wr + 8 * j);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + m * ldx + i);
#pragma GCC unroll 8
      for (int j = 0; j < CW; ++j) acc[m][j] = _mm256_fmadd_ps(xm, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < CW; ++j) {
      const int64_t c = cb + 8 * j, n = std::clamp<int64_t>(nc - c, 0, 8);
      const __m256 v = relu ? _mm256_max_ps(acc[m][j], _mm256_setzero_ps()) : acc[m][j];
      float* yc = y + m * ldy + c0 + c;
      if (n == 8) {
        _mm256_storeu_ps(yc, v);
      } else if (n > 0) {
        alignas(32) float t[8];
        _mm256_store_ps(t, v);
        std::copy(t, t + n, yc);
      }
    }
}
#endif

template <int MR, bool kPf = false>
static void panel_rows(const float* x, int64_t ldx, const float* w, int64_t in, const float* b,
                       int64_t c0, int64_t nc, bool relu, float* y, int64_t ldy,
                       const float* pf = nullptr) {
#if defined(QKV_AVX2) && !defined(QKV_AVX512)
  // 8, 4 or 2 vectors per row: MR·CW accumulators + CW weights + 1 broadcast <= 16 registers
  constexpr int CW = MR == 1 ? 8 : MR == 2 ? 4 : 2;
  for (int64_t cb = 0; cb < nc; cb += 8 * CW)
    panel_pass_avx2<MR, CW, kPf>(x, ldx, w, in, b, c0, nc, cb, relu, y, ldy, pf);
#elif defined(QKV_AVX512)
  __m512 acc[MR][4];
  for (int q = 0; q < 4; ++q) {
    const __m512 bq = panel_bias(b, c0, nc, q);
    for (int m = 0; m < MR; ++m) acc[m][q] = bq;
  }
  for (int64_t i = 0; i < in; ++i) {
    const float* wr = w + i * kPanel;
    if constexpr (kPf)
      for (int q = 0; q < 4; ++q) pf_line(pf + i * kPanel + 16 * q);
    const __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16);
    const __m512 w2 = _mm512_loadu_ps(wr + 32), w3 = _mm512_loadu_ps(wr + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + i]);
      acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xm, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xm, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m) store_panel_row(acc[m], nc, relu, y + m * ldy + c0);
#else
  float acc[MR][kPanel];
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < kPanel; ++c) acc[m][c] = b && c < nc ? b[c0 + c] : 0.f;
  for (int64_t i = 0; i < in; ++i) {
    const float* wr = w + i * kPanel;
    for (int m = 0; m < MR; ++m) {
      const float xm = x[m * ldx + i];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[m][c] += xm * wr[c];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < nc; ++c) {
      const float v = acc[m][c];
      y[m * ldy + c0 + c] = relu && v < 0.f ? 0.f : v;
    }
#endif
}

template <int MR>
static inline void panel_call(const float* x, int64_t ldx, const float* w, int64_t in,
                              const float* b, int64_t c0, int64_t nc, bool relu, float* y,
                              int64_t ldy, const float* pf) {
  if (pf) panel_rows<MR, true>(x, ldx, w, in, b, c0, nc, relu, y, ldy, pf);
  else panel_rows<MR, false>(x, ldx, w, in, b, c0, nc, relu, y, ldy);
}

// y (M, out) with row stride ldy = act(x Wᵀ + b) for x (M, in) with row stride ldx, W in
// panels (ceil(out/64), in, 64); the work of small_linear, also called by the fused decoder
// step on its own buffers.
static void panel_linear_rows(const float* X, int64_t ldx, int64_t M, int64_t in,
                              const float* W, const float* b, int64_t out, bool relu, float* Y,
                              int64_t ldy) {
  const int64_t P = (out + kPanel - 1) / kPanel;
  // at least 64k weights (256 KB) per task: a small layer stays on one thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, in * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = W + p * in * kPanel;
      const int64_t c0 = p * kPanel, nc = std::min(kPanel, out - c0);
      // Several rows: the next panel is prefetched into L2 while the first row group reads
      // this one; the other groups then find their panel there. Weights that live in L3
      // (the layers of a model together exceed L2) otherwise stall each first pass on its
      // latency: M = 32 in a decode step, 1 thread, Xeon (AMX machine): 1.17x faster. One
      // row streams each panel once, where the hardware prefetcher does as well (measured).
      const float* next = p + 1 < p1 && M > 1 ? W + (p + 1) * in * kPanel : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const float* xr = X + m0 * ldx;
        float* yr = Y + m0 * ldy;
        const float* pf = m0 == 0 ? next : nullptr;
        const int64_t mr = std::min(kRows, M - m0);
#ifdef QKV_AVX512
        if (mr == 1 && !pf) {
          panel_row1(xr, w, in, b, c0, nc, relu, yr);
          continue;
        }
#endif
        switch (mr) {
          case 1: panel_call<1>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
          case 2: panel_call<2>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
          case 3: panel_call<3>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
          case 4: panel_call<4>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
          case 5: panel_call<5>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
          default: panel_call<6>(xr, ldx, w, in, b, c0, nc, relu, yr, ldy, pf); break;
        }
      }
    }
  });
}

Tensor small_linear(const Tensor& x, const Tensor& panels, const std::optional<Tensor>& bias,
                    int64_t out, bool relu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "qkv small_linear: x must be float32 (M, in) with unit column stride");
  const int64_t M = x.size(0), in = x.size(1), P = (out + kPanel - 1) / kPanel;
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(0) == P && panels.size(1) == in && panels.size(2) == kPanel,
              "qkv small_linear: panels must be contiguous float32 (ceil(out/64), in, 64)");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "qkv small_linear: bias must be a contiguous float32 (out,) tensor");
    b = bias->const_data_ptr<float>();
  }
  Tensor y = at::empty({M, out}, x.options());
  if (M == 0 || out == 0) return y;
  panel_linear_rows(x.const_data_ptr<float>(), x.stride(0), M, in,
                    panels.const_data_ptr<float>(), b, out, relu, y.data_ptr<float>(), out);
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(qkv_decode, m) {
  m.def("small_linear(Tensor x, Tensor panels, Tensor? bias, int out, bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_decode, CPU, m) {
  m.impl("small_linear", &small_linear);
}

namespace qkv {
void panel_linear_into(const float* x, int64_t ldx, int64_t M, int64_t in, const float* panels,
                       const float* bias, int64_t out, bool relu, float* y, int64_t ldy) {
  if (M > 0 && out > 0) panel_linear_rows(x, ldx, M, in, panels, bias, out, relu, y, ldy);
}
}  // namespace qkv
