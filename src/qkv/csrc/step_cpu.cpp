// One decoder step of an encoder-decoder translator, in one call: every layer's norms,
// projections, cache write, self- and cross-attention and feed-forward for one new token per
// hypothesis, then the output layer. The same operations, in the same order, as
// qkv.models.incremental.IncrementalDecoder.step's Python loop (which stays the reference and
// the path for everything this does not cover); what this saves is the ~80 Python-level
// operator calls of a step, and with them the time the interpreter's own data takes to come
// back into cache after each layer's weights have streamed through it (1 sentence, 1 thread:
// a step's linears read 19 MB, and the rest of the Python step took as long as they did).
//
// Shapes: x (N, d) with N = B·K hypotheses (sentence-major, beams inner); the self-attention
// caches k, v (N_cache, h_kv, capacity, d_k), position t written here (batch row phys[i] of
// hypothesis i, or row i); cross-attention keys/values (B_cache, h_kv, S, d_k) per layer.
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

namespace qkv {
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask,
                                                    double scale, bool causal,
                                                    const std::optional<at::Tensor>& rows,
                                                    const std::optional<at::Tensor>& kv_batch);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out, bool relu);
}  // namespace qkv

namespace {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

enum Activation : int64_t { kNone = 0, kRelu = 1, kGelu = 2 };

// a prepared linear: weight panels (ceil(out/64), in, 64), bias, out features, activation
using LinearSpec = std::tuple<Tensor, OptTensor, int64_t, int64_t>;
using NormSpec = std::tuple<Tensor, Tensor, double>;  // LayerNorm weight, bias, eps

struct Linear {
  Tensor panels;
  OptTensor bias;
  int64_t out, act;
  explicit Linear(const LinearSpec& s)
      : panels(std::get<0>(s)), bias(std::get<1>(s)), out(std::get<2>(s)), act(std::get<3>(s)) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 64 && out > 0 && act >= 0 && act <= 2,
                "qkv DecoderStep: a linear must be panels (P, in, 64), out > 0, act 0/1/2");
  }
  Tensor operator()(const Tensor& x) const {
    Tensor y = qkv::panel_linear(x, panels, bias, out, act == kRelu);
    return act == kGelu ? at::gelu(y) : y;
  }
};

struct Norm {
  Tensor w, b;
  double eps;
  explicit Norm(const NormSpec& s) : w(std::get<0>(s)), b(std::get<1>(s)), eps(std::get<2>(s)) {}
  Tensor operator()(const Tensor& x) const { return at::layer_norm(x, {x.size(-1)}, w, b, eps); }
};

struct Layer {
  Linear qkv, o, cq, co, w1, w2;
  Norm n_self, n_cross, n_ffn;
};

class DecoderStep {
 public:
  // linears: 6 per layer (W_q|W_k|W_v fused, W_o, cross W_q, cross W_o, W_1, W_2), then the
  // output layer; norms: 3 per layer (self, cross, feed-forward), then the final one if any
  DecoderStep(int64_t d, int64_t h, int64_t h_kv, int64_t d_k, bool pre_norm, double scale,
              const std::vector<LinearSpec>& linears, const std::vector<NormSpec>& norms)
      : d_(d), h_(h), h_kv_(h_kv), d_k_(d_k), pre_norm_(pre_norm), scale_(scale),
        out_(linears.at(linears.size() - 1)) {
    TORCH_CHECK(linears.size() % 6 == 1, "qkv DecoderStep: 6 linears per layer, then the output");
    const size_t L = linears.size() / 6;
    TORCH_CHECK(norms.size() == 3 * L || norms.size() == 3 * L + 1,
                "qkv DecoderStep: 3 norms per layer, then optionally the final one");
    TORCH_CHECK(h * d_k == d && h_kv > 0 && h % h_kv == 0,
                "qkv DecoderStep: need n_heads * d_k == d_model and h % h_kv == 0");
    for (size_t i = 0; i < L; ++i) {
      const LinearSpec* s = &linears[6 * i];
      layers_.push_back(Layer{Linear(s[0]), Linear(s[1]), Linear(s[2]), Linear(s[3]),
                              Linear(s[4]), Linear(s[5]), Norm(norms[3 * i]),
                              Norm(norms[3 * i + 1]), Norm(norms[3 * i + 2])});
    }
    if (norms.size() == 3 * L + 1) final_.emplace(norms.back());
  }

  // x (N, d): the step's embedded tokens (written over); returns logits (N, V)
  Tensor step(Tensor x, int64_t t, int64_t beams, const std::vector<Tensor>& kbuf,
              const std::vector<Tensor>& vbuf, const std::vector<Tensor>& cross_k,
              const std::vector<Tensor>& cross_v, const OptTensor& cross_mask,
              const OptTensor& rows, const OptTensor& phys, const OptTensor& sent) const {
    const size_t L = layers_.size();
    TORCH_CHECK(kbuf.size() == L && vbuf.size() == L && cross_k.size() == L &&
                    cross_v.size() == L,
                "qkv DecoderStep: one cache and one cross key/value pair per layer");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == d_ && x.scalar_type() == at::kFloat &&
                    x.is_contiguous() && beams >= 1 && x.size(0) % beams == 0,
                "qkv DecoderStep: x must be a contiguous float32 (N, d_model), N = B * beams");
    const int64_t N = x.size(0), B = N / beams, kv_w = h_kv_ * d_k_;
    const bool has_phys = phys.has_value() && phys->defined();
    const bool has_rows = rows.has_value() && rows->defined();
    for (size_t i = 0; i < L; ++i) {
      const Layer& Ly = layers_[i];
      const Tensor& kc = kbuf[i];
      const Tensor& vc = vbuf[i];
      TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4 && t >= 0 && t < kc.size(2) &&
                      t < vc.size(2) && kc.size(1) == h_kv_ && kc.size(3) == d_k_ &&
                      (has_phys || kc.size(0) == N),
                  "qkv DecoderStep: a cache buffer (N_cache, h_kv, capacity > t, d_k) per layer");
      // causal self-attention over the cache
      Tensor hdn = pre_norm_ ? Ly.n_self(x) : x;
      const Tensor qkv = Ly.qkv(hdn);  // (N, (h + 2·h_kv)·d_k)
      const Tensor q = qkv.narrow(1, 0, d_).view({N, h_, 1, d_k_}).contiguous();
      const Tensor k = qkv.narrow(1, d_, kv_w).view({N, h_kv_, d_k_});
      const Tensor v = qkv.narrow(1, d_ + kv_w, kv_w).view({N, h_kv_, d_k_});
      if (has_phys) {  // rows of finished sentences stay where they are
        kc.select(2, t).index_copy_(0, *phys, k.to(kc.scalar_type()));
        vc.select(2, t).index_copy_(0, *phys, v.to(vc.scalar_type()));
      } else {
        kc.select(2, t).copy_(k);  // cast to the storage dtype
        vc.select(2, t).copy_(v);
      }
      const Tensor k_all = kc.narrow(2, 0, t + 1), v_all = vc.narrow(2, 0, t + 1);
      Tensor a = std::get<0>(qkv::decode_attention(q, k_all, v_all, std::nullopt, scale_, true,
                                                   rows, has_rows ? std::nullopt : phys));
      x = residual(x, Ly.o(a.view({N, d_})), Ly.n_self);
      // cross-attention: the K beams of a sentence are K query rows over its memory
      hdn = pre_norm_ ? Ly.n_cross(x) : x;
      Tensor cq = Ly.cq(hdn);  // (N, d)
      cq = beams == 1 ? cq.view({B, h_, 1, d_k_})
                      : cq.view({B, beams, h_, d_k_}).transpose(1, 2).contiguous();
      a = std::get<0>(qkv::decode_attention(cq, cross_k[i], cross_v[i], cross_mask, scale_,
                                            false, std::nullopt, sent));
      a = beams == 1 ? a.view({N, d_}) : a.transpose(1, 2).reshape({N, d_});
      x = residual(x, Ly.co(a), Ly.n_cross);
      // feed-forward
      hdn = pre_norm_ ? Ly.n_ffn(x) : x;
      x = residual(x, Ly.w2(Ly.w1(hdn)), Ly.n_ffn);
    }
    if (final_) x = (*final_)(x);
    return out_(x);
  }

 private:
  // x + y, normalised after in post-LN (x is the step's own activation: summed in place)
  Tensor residual(Tensor& x, const Tensor& y, const Norm& norm) const {
    x.add_(y);
    return pre_norm_ ? x : norm(x);
  }

  int64_t d_, h_, h_kv_, d_k_;
  bool pre_norm_;
  double scale_;
  std::vector<Layer> layers_;
  std::optional<Norm> final_;
  Linear out_;
};
}  // namespace

namespace qkv {
void register_step(py::module& m) {
  py::class_<DecoderStep>(m, "DecoderStep",
                          "an encoder-decoder's decoder step in one call (see step_cpu.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, double,
                    const std::vector<LinearSpec>&, const std::vector<NormSpec>&>())
      .def("step", &DecoderStep::step, py::call_guard<py::gil_scoped_release>());
}
}  // namespace qkv
