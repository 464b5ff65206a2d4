// One decoder step of an encoder-decoder translator, in one call: the tokens' embeddings and
// positions, every layer's norms, projections, cache write, self- and cross-attention and
// feed-forward for one new token per hypothesis, then the output layer. The same operations,
// in the same order, as qkv.models.incremental.IncrementalDecoder.step's Python loop (which
// stays the reference and the path for everything this does not cover). What this saves is
// the ~80 Python-level operator calls of a step and their allocations, and with them the time
// the interpreter's own data takes to come back into cache after each layer's weights have
// streamed through it (one sentence, 1 thread: a step's linears read 19 MB, and the rest of
// the Python step took as long as they did).
//
// Shapes: tokens (N,) with N = B·K hypotheses (sentence-major, beams inner); the
// self-attention caches k, v (N_cache, h_kv, capacity, d_k), position t written here (batch
// row phys[i] of hypothesis i, else row i); cross-attention keys/values (B_cache, h_kv, S, d_k)
// per layer. Activations live in one fp32 workspace per call, rows contiguous.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with the Tensor casters (not all of torch/extension.h: ~15 s less per build)

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace qkv {
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask,
                                                    double scale, bool causal,
                                                    const std::optional<at::Tensor>& rows,
                                                    const std::optional<at::Tensor>& kv_batch);
void panel_linear_into(const float* x, int64_t ldx, int64_t M, int64_t in, const float* panels,
                       const float* bias, int64_t out, bool relu, float* y, int64_t ldy);
void int8_check_weight(const at::Tensor& packed, const at::Tensor& wscale, const at::Tensor& wsum,
                       const std::optional<at::Tensor>& bias, int64_t N, int64_t K);
void int8_linear_into(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* packed,
                      const float* wscale, const int32_t* wsum, const float* bias, int64_t N,
                      bool relu, float* y, int64_t ldy);
}  // namespace qkv

namespace {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

enum Activation : int64_t { kNone = 0, kRelu = 1, kGelu = 2 };

// a prepared linear: (weight, bias, out features, in features, activation, int8 scales,
// int8 column sums). float32: the weight packed in panels (ceil(out/64), in, 64), no scales;
// int8: the weight as qkv/kernels/int8.py packs it, with its per-channel scales and sums.
using LinearSpec = std::tuple<Tensor, OptTensor, int64_t, int64_t, int64_t, OptTensor, OptTensor>;
using NormSpec = std::tuple<Tensor, Tensor, double>;  // LayerNorm weight, bias, eps

bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

struct Linear {
  Tensor weight;
  OptTensor bias, wscale, wsum;
  int64_t out, in, act;
  bool int8;
  explicit Linear(const LinearSpec& s)
      : weight(std::get<0>(s)), bias(std::get<1>(s)), wscale(std::get<5>(s)),
        wsum(std::get<6>(s)), out(std::get<2>(s)), in(std::get<3>(s)), act(std::get<4>(s)),
        int8(weight.scalar_type() == at::kChar) {
    TORCH_CHECK(out > 0 && in > 0 && act >= kNone && act <= kGelu,
                "qkv DecoderStep: a linear needs out, in > 0 and activation 0/1/2");
    if (int8) {
      TORCH_CHECK(defined(wscale) && defined(wsum),
                  "qkv DecoderStep: an int8 linear needs its scales and column sums");
      qkv::int8_check_weight(weight, *wscale, *wsum, bias, out, in);
      return;
    }
    TORCH_CHECK(weight.dim() == 3 && weight.size(2) == 64 && weight.is_contiguous() &&
                    weight.scalar_type() == at::kFloat && weight.size(0) == (out + 63) / 64 &&
                    weight.size(1) == in && !defined(wscale) && !defined(wsum),
                "qkv DecoderStep: a float linear must be float32 panels (ceil(out/64), in, 64)");
    TORCH_CHECK(!defined(bias) || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                   bias->numel() == out),
                "qkv DecoderStep: a bias must be a contiguous float32 (out,) tensor");
  }
  // y (M, out) = act(x Wᵀ + b), x (M, in): rows contiguous
  void operator()(const float* x, int64_t M, float* y) const {
    const float* b = defined(bias) ? bias->const_data_ptr<float>() : nullptr;
    if (int8)
      qkv::int8_linear_into(x, in, M, in, weight.const_data_ptr<int8_t>(),
                            wscale->const_data_ptr<float>(), wsum->const_data_ptr<int32_t>(), b,
                            out, act == kRelu, y, out);
    else
      qkv::panel_linear_into(x, in, M, in, weight.const_data_ptr<float>(), b, out, act == kRelu,
                             y, out);
    if (act == kGelu)  // exact (erf) GELU, as torch.nn.functional.gelu's default
      for (int64_t i = 0; i < M * out; ++i)
        y[i] = 0.5f * y[i] * (1.f + std::erf(y[i] * static_cast<float>(M_SQRT1_2)));
  }
};

struct Norm {
  Tensor w, b;
  float eps;
  explicit Norm(const NormSpec& s)
      : w(std::get<0>(s)), b(std::get<1>(s)), eps(static_cast<float>(std::get<2>(s))) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                    w.is_contiguous() && b.is_contiguous() && w.dim() == 1 && b.sizes() == w.sizes(),
                "qkv DecoderStep: a norm must be float32 LayerNorm weight and bias (d,)");
  }
  // out = LayerNorm(x) over rows of d (out may be x); mean and variance summed in double
  void operator()(const float* x, int64_t N, int64_t d, float* out) const {
    const float* W = w.const_data_ptr<float>();
    const float* B = b.const_data_ptr<float>();
    for (int64_t r = 0; r < N; ++r) {
      const float* xr = x + r * d;
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < d; ++c) s += xr[c];
      const float mean = static_cast<float>(s / d);
      double ss = 0.0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < d; ++c) ss += double(xr[c] - mean) * double(xr[c] - mean);
      const float rstd = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
      float* o = out + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) o[c] = (xr[c] - mean) * rstd * W[c] + B[c];
    }
  }
};

struct Layer {
  Linear qkv, o, cq, co, w1, w2;
  Norm n_self, n_cross, n_ffn;
};

// x += y over n values
void add_into(float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// rows (B, A, C, dk) -> (B, C, A, dk): the beams of a sentence as query rows of its heads
// (A = K beams, C = h heads) and back (A = h, C = K)
void swap_middle(const float* src, float* dst, int64_t B, int64_t A, int64_t C, int64_t dk) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a)
      for (int64_t c = 0; c < C; ++c)
        std::memcpy(dst + ((b * C + c) * A + a) * dk, src + ((b * A + a) * C + c) * dk,
                    dk * sizeof(float));
}

// What the compiled encoder and decoder share: sizes, where the norms sit, the attention
// scale, the token embedding (already scaled by √d_model) and the final norm, if any.
struct Stack {
  std::string who;  // for error messages
  int64_t d_, h_, h_kv_, d_k_, d_ff_ = 0;
  bool pre_norm_;
  double scale_;
  Tensor embedding_;
  std::optional<Norm> final_;

  Stack(std::string who_, int64_t d, int64_t h, int64_t h_kv, int64_t d_k, bool pre_norm,
        double scale, Tensor embedding)
      : who(std::move(who_)), d_(d), h_(h), h_kv_(h_kv), d_k_(d_k), pre_norm_(pre_norm),
        scale_(scale), embedding_(std::move(embedding)) {
    TORCH_CHECK(h * d_k == d && h_kv > 0 && h % h_kv == 0, "qkv ", who,
                ": need n_heads * d_k == d_model and h % h_kv == 0");
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.size(1) == d && embedding_.is_contiguous() &&
                    embedding_.scalar_type() == at::kFloat,
                "qkv ", who, ": the embedding must be a contiguous float32 (V, d_model)");
  }
  // norms: `per_layer` per layer, then optionally the final one; returns the layer count
  size_t take_final(const std::vector<NormSpec>& norms, size_t layers, size_t per_layer) {
    TORCH_CHECK(norms.size() == per_layer * layers || norms.size() == per_layer * layers + 1,
                "qkv ", who, ": ", per_layer, " norms per layer, then optionally the final one");
    if (norms.size() == per_layer * layers + 1) {
      final_.emplace(norms.back());
      TORCH_CHECK(final_->w.numel() == d_, "qkv ", who, ": the final norm must have size d");
    }
    return layers;
  }
  // x (d,) = the embedding of token t, plus pos (d,) if given
  void embed(int64_t t, const float* pos, float* x) const {
    TORCH_CHECK(t >= 0 && t < embedding_.size(0), "qkv ", who, ": token ", t,
                " out of range for a vocabulary of ", embedding_.size(0));
    std::memcpy(x, embedding_.const_data_ptr<float>() + t * d_, d_ * sizeof(float));
    if (pos) add_into(x, pos, d_);
  }
};

class DecoderStep : Stack {
 public:
  // linears: 6 per layer (W_q|W_k|W_v fused, W_o, cross W_q, cross W_o, W_1, W_2), then the
  // output layer; norms: 3 per layer (self, cross, feed-forward), then the final one if any;
  // embedding (V, d): the token embedding already scaled by √d_model
  DecoderStep(int64_t d, int64_t h, int64_t h_kv, int64_t d_k, bool pre_norm, double scale,
              const std::vector<LinearSpec>& linears, const std::vector<NormSpec>& norms,
              Tensor embedding)
      : Stack("DecoderStep", d, h, h_kv, d_k, pre_norm, scale, std::move(embedding)),
        out_(linears.at(linears.size() - 1)) {
    TORCH_CHECK(linears.size() % 6 == 1, "qkv DecoderStep: 6 linears per layer, then the output");
    const size_t L = take_final(norms, linears.size() / 6, 3);
    const int64_t kv_w = h_kv * d_k;
    for (size_t i = 0; i < L; ++i) {
      const LinearSpec* s = &linears[6 * i];
      Layer Ly{Linear(s[0]), Linear(s[1]), Linear(s[2]), Linear(s[3]), Linear(s[4]),
               Linear(s[5]), Norm(norms[3 * i]), Norm(norms[3 * i + 1]), Norm(norms[3 * i + 2])};
      TORCH_CHECK(Ly.qkv.in == d && Ly.qkv.out == d + 2 * kv_w && Ly.o.in == d && Ly.o.out == d &&
                      Ly.cq.in == d && Ly.cq.out == d && Ly.co.in == d && Ly.co.out == d &&
                      Ly.w1.in == d && Ly.w2.in == Ly.w1.out && Ly.w2.out == d &&
                      Ly.qkv.act == kNone && Ly.o.act == kNone && Ly.cq.act == kNone &&
                      Ly.co.act == kNone && Ly.w2.act == kNone,
                  "qkv DecoderStep: layer ", i, "'s linears do not fit d_model ", d);
      for (const Norm* n : {&Ly.n_self, &Ly.n_cross, &Ly.n_ffn})
        TORCH_CHECK(n->w.numel() == d, "qkv DecoderStep: a norm of size ", n->w.numel(),
                    " in a model of d_model ", d);
      d_ff_ = std::max(d_ff_, Ly.w1.out);
      layers_.push_back(std::move(Ly));
    }
    TORCH_CHECK(out_.in == d && out_.act == kNone, "qkv DecoderStep: the output layer must read d");
  }

  // logits (N, V) of the next token after tokens (N,) at position t; positions (>= t + 1, d)
  // added to the embeddings (sinusoidal or learned), or none
  Tensor step(const Tensor& tokens, const OptTensor& positions, int64_t t, int64_t beams,
              const std::vector<Tensor>& kbuf, const std::vector<Tensor>& vbuf,
              const std::vector<Tensor>& cross_k, const std::vector<Tensor>& cross_v,
              const OptTensor& cross_mask, const OptTensor& rows, const OptTensor& phys,
              const OptTensor& sent) const {
    const size_t L = layers_.size();
    TORCH_CHECK(kbuf.size() == L && vbuf.size() == L && cross_k.size() == L &&
                    cross_v.size() == L,
                "qkv DecoderStep: one cache and one cross key/value pair per layer");
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong &&
                    tokens.is_contiguous() && beams >= 1 && tokens.size(0) % beams == 0,
                "qkv DecoderStep: tokens must be a contiguous int64 (N,), N = B * beams");
    const int64_t N = tokens.size(0), B = N / beams, d = d_, kv_w = h_kv_ * d_k_;
    const int64_t W = d + 2 * kv_w;
    const bool has_phys = defined(phys), has_rows = defined(rows);
    if (has_phys)
      TORCH_CHECK(phys->scalar_type() == at::kLong && phys->is_contiguous() &&
                      phys->numel() == N,
                  "qkv DecoderStep: phys must be a contiguous int64 (N,)");
    // the workspace: x, h (sub-layer input / output), qkv, q, the feed-forward's hidden rows
    Tensor ws = at::empty({N * (3 * d + W + std::max(d_ff_, d))}, embedding_.options());
    float* x = ws.data_ptr<float>();
    float* hb = x + N * d;
    float* yb = hb + N * d;
    float* qkv = yb + N * d;
    float* ff = qkv + N * W;
    // embeddings (scaled) + positions
    const int64_t* tok = tokens.const_data_ptr<int64_t>();
    const float* pos = nullptr;
    if (defined(positions)) {
      TORCH_CHECK(positions->dim() == 2 && positions->size(0) > t && positions->size(1) == d &&
                      positions->scalar_type() == at::kFloat && positions->stride(1) == 1,
                  "qkv DecoderStep: positions must be float32 (> t, d_model)");
      pos = positions->const_data_ptr<float>() + t * positions->stride(0);
    }
    for (int64_t i = 0; i < N; ++i) embed(tok[i], pos, x + i * d);
    const auto fopt = embedding_.options();
    for (size_t i = 0; i < L; ++i) {
      const Layer& Ly = layers_[i];
      const Tensor& kc = kbuf[i];
      const Tensor& vc = vbuf[i];
      const bool int8 = kc.scalar_type() == at::kChar;  // packed rows: values, then the scale
      TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes() && kc.size(1) == h_kv_ &&
                      kc.size(3) == d_k_ + (int8 ? 4 : 0) && t < kc.size(2) &&
                      kc.stride(3) == 1 && vc.stride(3) == 1 &&
                      kc.scalar_type() == vc.scalar_type() &&
                      (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16 ||
                       int8) &&
                      (has_phys || kc.size(0) == N),
                  "qkv DecoderStep: a float32/bfloat16 cache (N_cache, h_kv, capacity > t, d_k), "
                  "or int8 rows (..., d_k + 4), per layer");
      // causal self-attention over the cache
      sub_in(Ly.n_self, x, N, hb);
      Ly.qkv(pre_norm_ ? hb : x, N, qkv);  // (N, (h + 2·h_kv)·d_k)
      write_cache(kc, qkv + d, W, N, t, has_phys ? phys->const_data_ptr<int64_t>() : nullptr);
      write_cache(vc, qkv + d + kv_w, W, N, t,
                  has_phys ? phys->const_data_ptr<int64_t>() : nullptr);
      Tensor q = at::empty({N, h_, 1, d_k_}, fopt);
      for (int64_t r = 0; r < N; ++r)
        std::memcpy(q.data_ptr<float>() + r * d, qkv + r * W, d * sizeof(float));
      Tensor a = std::get<0>(qkv::decode_attention(q, kc.narrow(2, 0, t + 1),
                                                   vc.narrow(2, 0, t + 1), std::nullopt, scale_,
                                                   true, rows, has_rows ? std::nullopt : phys));
      Ly.o(a.const_data_ptr<float>(), N, yb);
      residual(Ly.n_self, x, yb, N);
      // cross-attention: the K beams of a sentence are K query rows over its memory
      sub_in(Ly.n_cross, x, N, hb);
      Ly.cq(pre_norm_ ? hb : x, N, yb);  // (N, d) = (B, K, h, d_k)
      Tensor cq = at::empty({B, h_, beams, d_k_}, fopt);
      if (beams == 1) std::memcpy(cq.data_ptr<float>(), yb, N * d * sizeof(float));
      else swap_middle(yb, cq.data_ptr<float>(), B, beams, h_, d_k_);
      a = std::get<0>(qkv::decode_attention(cq, cross_k[i], cross_v[i], cross_mask, scale_,
                                            false, std::nullopt, sent));  // (B, h, K, d_k)
      const float* ap = a.const_data_ptr<float>();
      if (beams > 1) {
        swap_middle(ap, hb, B, h_, beams, d_k_);  // back to (B, K, h, d_k) = (N, d)
        ap = hb;
      }
      Ly.co(ap, N, yb);
      residual(Ly.n_cross, x, yb, N);
      // feed-forward
      sub_in(Ly.n_ffn, x, N, hb);
      Ly.w1(pre_norm_ ? hb : x, N, ff);
      Ly.w2(ff, N, yb);
      residual(Ly.n_ffn, x, yb, N);
    }
    if (final_) (*final_)(x, N, d, x);
    Tensor logits = at::empty({N, out_.out}, fopt);
    out_(x, N, logits.data_ptr<float>());
    return logits;
  }

 private:
  // a sub-layer's input: normalised into h in pre-LN (post-LN reads x as it is)
  void sub_in(const Norm& norm, const float* x, int64_t N, float* h) const {
    if (pre_norm_) norm(x, N, d_, h);
  }
  // x += y, normalised after in post-LN
  void residual(const Norm& norm, float* x, const float* y, int64_t N) const {
    add_into(x, y, N * d_);
    if (!pre_norm_) norm(x, N, d_, x);
  }
  // the new position t of every hypothesis' keys (or values): src rows of stride ld, each
  // (h_kv, d_k); hypothesis r goes to batch row phys[r] (else r), in the cache's dtype
  void write_cache(const Tensor& c, const float* src, int64_t ld, int64_t N, int64_t t,
                   const int64_t* phys) const {
    const int64_t Nc = c.size(0);
    for (int64_t r = 0; r < N; ++r) {
      const int64_t row = phys ? phys[r] : r;
      TORCH_CHECK(row >= 0 && row < Nc, "qkv DecoderStep: phys out of range");
      for (int64_t hk = 0; hk < h_kv_; ++hk) {
        const float* s = src + r * ld + hk * d_k_;
        const int64_t off = row * c.stride(0) + hk * c.stride(1) + t * c.stride(2);
        if (c.scalar_type() == at::kFloat) {
          std::memcpy(c.data_ptr<float>() + off, s, d_k_ * sizeof(float));
        } else if (c.scalar_type() == at::kChar) {
          // int8 rows as qkv.cache.quantize_rows writes them, bit for bit: scale = max|x| /
          // 127, values round(x / scale) (ties to even), then the scale's 4 bytes; a row
          // holding a NaN or an inf: scale NaN, values 0 (std::max would drop a NaN)
          int8_t* dst = c.data_ptr<int8_t>() + off;
          float amax = 0.f;
          bool finite = true;
          for (int64_t j = 0; j < d_k_; ++j) {
            finite &= std::isfinite(s[j]);
            amax = std::max(amax, std::fabs(s[j]));
          }
          const float scale = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
          for (int64_t j = 0; j < d_k_; ++j)
            dst[j] = scale > 0.f ? static_cast<int8_t>(std::nearbyint(s[j] / scale)) : int8_t(0);
          std::memcpy(dst + d_k_, &scale, sizeof(scale));
        } else {
          c10::BFloat16* dst = c.data_ptr<c10::BFloat16>() + off;
          for (int64_t j = 0; j < d_k_; ++j) dst[j] = c10::BFloat16(s[j]);  // round to nearest even
        }
      }
    }
  }

  std::vector<Layer> layers_;
  Linear out_;
};

// The encoder's layers in one call: every position-wise operation (projections, norms,
// residuals, feed-forward) on the real tokens only, packed without their padding, attention
// on the padded layout (padding rows zero, hidden by the key-padding mask). Attention is the
// path IncrementalDecoder.encode resolves for the call: the decode kernel (S <= 16 queries)
// or PyTorch's SDPA; the caller falls back to Python for any other.
class EncoderStep : Stack {
 public:
  // linears: 4 per layer (W_q|W_k|W_v fused, W_o, W_1, W_2); norms: 2 per layer (attention,
  // feed-forward), then the final one if any; embedding (V, d) already scaled by √d_model
  EncoderStep(int64_t d, int64_t h, int64_t h_kv, int64_t d_k, bool pre_norm, double scale,
              const std::vector<LinearSpec>& linears, const std::vector<NormSpec>& norms,
              Tensor embedding)
      : Stack("EncoderStep", d, h, h_kv, d_k, pre_norm, scale, std::move(embedding)) {
    TORCH_CHECK(linears.size() % 4 == 0 && !linears.empty(),
                "qkv EncoderStep: 4 linears per layer");
    const size_t L = take_final(norms, linears.size() / 4, 2);
    for (size_t i = 0; i < L; ++i) {
      EncLayer Ly{Linear(linears[4 * i]), Linear(linears[4 * i + 1]), Linear(linears[4 * i + 2]),
                  Linear(linears[4 * i + 3]), Norm(norms[2 * i]), Norm(norms[2 * i + 1])};
      TORCH_CHECK(Ly.qkv.in == d && Ly.qkv.out == d + 2 * h_kv * d_k && Ly.qkv.act == kNone &&
                      Ly.o.in == d && Ly.o.out == d && Ly.o.act == kNone && Ly.w1.in == d &&
                      Ly.w2.in == Ly.w1.out && Ly.w2.out == d && Ly.w2.act == kNone &&
                      Ly.n_attn.w.numel() == d && Ly.n_ffn.w.numel() == d,
                  "qkv EncoderStep: layer ", i, " does not fit d_model ", d);
      d_ff_ = std::max(d_ff_, Ly.w1.out);
      layers_.push_back(std::move(Ly));
    }
  }

  // src (B, S) int64; real (n,) int64: flat indices b·S + s of the real tokens, increasing;
  // mask (B, 1, 1, S) bool (True = may attend) or none; positions (>= S, d) or none.
  // Returns memory (B, S, d): the real tokens' vectors, zeros at padding.
  Tensor forward(const Tensor& src, const Tensor& real, const OptTensor& mask,
                 const OptTensor& positions, bool use_decode) const {
    TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kLong && src.is_contiguous(),
                "qkv EncoderStep: src must be a contiguous int64 (B, S)");
    const int64_t B = src.size(0), S = src.size(1), d = d_, kv_w = h_kv_ * d_k_;
    const int64_t W = d + 2 * kv_w;
    TORCH_CHECK(real.dim() == 1 && real.scalar_type() == at::kLong && real.is_contiguous() &&
                    real.numel() <= B * S,
                "qkv EncoderStep: real must be a contiguous int64 (n,) of token indices");
    const int64_t n = real.numel();
    const int64_t* R = real.const_data_ptr<int64_t>();
    const int64_t* tok = src.const_data_ptr<int64_t>();
    const float* pos = nullptr;
    if (defined(positions)) {
      TORCH_CHECK(positions->dim() == 2 && positions->size(0) >= S && positions->size(1) == d &&
                      positions->scalar_type() == at::kFloat && positions->is_contiguous(),
                  "qkv EncoderStep: positions must be a contiguous float32 (>= S, d_model)");
      pos = positions->const_data_ptr<float>();
    }
    const auto fopt = embedding_.options();
    Tensor ws = at::empty({n * (4 * d + W + std::max(d_ff_, d))}, fopt);
    float* x = ws.data_ptr<float>();
    float* hb = x + n * d;
    float* yb = hb + n * d;
    float* ab = yb + n * d;
    float* qkv = ab + n * d;
    float* ff = qkv + n * W;
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(R[r] >= 0 && R[r] < B * S && (r == 0 || R[r] > R[r - 1]),
                  "qkv EncoderStep: real must hold increasing indices below B * S");
      embed(tok[R[r]], pos ? pos + (R[r] % S) * d : nullptr, x + r * d);
    }
    // the padded layouts attention reads: zero where no real token writes
    Tensor q = at::zeros({B, h_, S, d_k_}, fopt), k = at::zeros({B, h_kv_, S, d_k_}, fopt);
    Tensor v = at::zeros({B, h_kv_, S, d_k_}, fopt);
    OptTensor m5;
    if (defined(mask)) {
      TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) == B &&
                      mask->size(1) == 1 && mask->size(2) == 1 && mask->size(3) == S,
                  "qkv EncoderStep: mask must be a bool (B, 1, 1, S)");
      if (use_decode)  // the decode kernel's view (B, h_kv, G, Tq, Tk)
        m5 = mask->view({B, 1, 1, 1, S}).expand({B, h_kv_, h_ / h_kv_, S, S});
    }
    for (const EncLayer& Ly : layers_) {
      if (pre_norm_) Ly.n_attn(x, n, d, hb);
      Ly.qkv(pre_norm_ ? hb : x, n, qkv);  // (n, (h + 2·h_kv)·d_k)
      scatter(qkv, W, R, n, S, h_, q.data_ptr<float>());
      scatter(qkv + d, W, R, n, S, h_kv_, k.data_ptr<float>());
      scatter(qkv + d + kv_w, W, R, n, S, h_kv_, v.data_ptr<float>());
      const Tensor a = use_decode
          ? std::get<0>(qkv::decode_attention(q, k, v, m5, scale_, false, std::nullopt,
                                              std::nullopt))
          : at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale_, h_ != h_kv_);
      const Tensor ac = a.contiguous();  // (B, h, S, d_k)
      const float* A = ac.const_data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) {  // the real rows back to (n, d)
        const int64_t b = R[r] / S, s = R[r] % S;
        for (int64_t hh = 0; hh < h_; ++hh)
          std::memcpy(ab + r * d + hh * d_k_, A + ((b * h_ + hh) * S + s) * d_k_,
                      d_k_ * sizeof(float));
      }
      Ly.o(ab, n, yb);
      add_into(x, yb, n * d);
      if (!pre_norm_) Ly.n_attn(x, n, d, x);
      if (pre_norm_) Ly.n_ffn(x, n, d, hb);
      Ly.w1(pre_norm_ ? hb : x, n, ff);
      Ly.w2(ff, n, yb);
      add_into(x, yb, n * d);
      if (!pre_norm_) Ly.n_ffn(x, n, d, x);
    }
    if (final_) (*final_)(x, n, d, x);
    Tensor memory = at::zeros({B, S, d}, fopt);
    float* M = memory.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) std::memcpy(M + R[r] * d, x + r * d, d * sizeof(float));
    return memory;
  }

 private:
  struct EncLayer {
    Linear qkv, o, w1, w2;
    Norm n_attn, n_ffn;
  };
  // rows of src (stride ld, heads x d_k each) to their padded places dst (B, heads, S, d_k)
  void scatter(const float* src, int64_t ld, const int64_t* R, int64_t n, int64_t S,
               int64_t heads, float* dst) const {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t b = R[r] / S, s = R[r] % S;
      for (int64_t hh = 0; hh < heads; ++hh)
        std::memcpy(dst + ((b * heads + hh) * S + s) * d_k_, src + r * ld + hh * d_k_,
                    d_k_ * sizeof(float));
    }
  }

  std::vector<EncLayer> layers_;
};
}  // namespace

namespace qkv {
void register_step(py::module& m) {
  py::class_<DecoderStep>(m, "DecoderStep",
                          "an encoder-decoder's decoder step in one call (see step_cpu.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, double,
                    const std::vector<LinearSpec>&, const std::vector<NormSpec>&, Tensor>())
      .def("step", &DecoderStep::step, py::call_guard<py::gil_scoped_release>());
  py::class_<EncoderStep>(m, "EncoderStep",
                          "an encoder-decoder's encoder in one call (see step_cpu.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, double,
                    const std::vector<LinearSpec>&, const std::vector<NormSpec>&, Tensor>())
      .def("forward", &EncoderStep::forward, py::call_guard<py::gil_scoped_release>());
}
}  // namespace qkv
