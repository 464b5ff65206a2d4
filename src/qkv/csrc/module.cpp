// The extension's Python module: plain functions for the dispatcher's per-call hot path.
// Every kernel is a torch.ops operator (registered in the other files); a pybind call skips
// the operator's schema parsing (~0.3 us instead of ~2 us), which matters only for the few
// calls made on every attention call.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with the Tensor casters (not all of torch/extension.h: ~15 s less per build)

#include "simd.h"  // QKV_LEVEL_NAME

#include <optional>
#include <vector>

namespace qkv {
double max_abs_product(const at::Tensor& q, const at::Tensor& k);
bool all_finite(const at::Tensor& t, bool plus_inf_only);
bool lse_clear(const at::Tensor& lse);
void register_step(py::module& m);  // step_cpu.cpp
at::Tensor decode_output(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double scale, bool causal,
                         int64_t window);
int64_t greedy_pick(const at::Tensor& logits, int64_t block, int64_t eos, const at::Tensor& out);
}

namespace {
// What the dispatcher's decision and argument checks read of a tensor: its shape, dtype,
// device and whether it requires grad (-1 for an absent one).
void describe(std::vector<int64_t>& out, const std::optional<at::Tensor>& t) {
  if (!t.has_value()) {
    out.push_back(-1);
    return;
  }
  out.push_back(t->dim());
  for (const int64_t s : t->sizes()) out.push_back(s);
  out.push_back(static_cast<int64_t>(t->scalar_type()));
  out.push_back(static_cast<int64_t>(t->device().type()));
  out.push_back(t->device().index());
  out.push_back(t->requires_grad());
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "max_abs_product",
      [](const at::Tensor& q, const at::Tensor& k) {
        TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(),
                    "max_abs_product: CPU tensors only");
        return qkv::max_abs_product(q, k);
      },
      "max|q| * max|k| over CPU tensors (NaN if either holds a NaN)");
  m.def(
      "finite",
      [](const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
         const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& bias) {
        for (const auto* t : {&q, &k, &v})
          if (t->has_value() && !qkv::all_finite(**t, false)) return false;
        return !bias.has_value() || qkv::all_finite(*bias, true);
      },
      "whether q, k, v (each may be None) hold no NaN or inf and bias no NaN or +inf (-inf "
      "masks): the NaN/inf rule's look at a call's inputs (qkv._nonfinite), one call");
  m.def(
      "flash_cpu_checked",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& attn_mask, bool is_causal,
         std::optional<double> scale) -> py::object {
        // the kernel reads rows as contiguous (SDPA sends other layouts to its math path)
        if (q.stride(-1) != 1 || k.stride(-1) != 1 || v.stride(-1) != 1) return py::none();
        auto [out, lse] =
            at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask, scale);
        return py::make_tuple(out, qkv::lse_clear(lse));
      },
      "PyTorch's fused CPU attention kernel (what its SDPA runs for these calls) and whether "
      "its log-sum-exp is finite and nonzero in every row: (out, clear), one call; None where "
      "q, k or v has a last-dim stride other than 1 (qkv.dispatch.torch_adapter.lse_run)");
  m.def(
      "signature",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias) {
        std::vector<int64_t> out;
        out.reserve(48);
        for (const auto* t : {&q, &k, &v}) describe(out, *t);
        describe(out, mask);
        describe(out, bias);
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
      },
      "the metadata of q, k, v, mask, bias (shapes, dtypes, devices, requires_grad) as bytes: "
      "the dispatcher's cache key");
  m.def("decode", &qkv::decode_output, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("scale"), py::arg("causal"), py::arg("window"),
        "the decode kernel's output for 4-D q, k, v and a (Nb, h_kv, G, Tq, Tk) bool mask view "
        "or None (torch.ops.qkv_decode.fwd without its schema parsing; window -1: none)");
  m.def("greedy_pick", &qkv::greedy_pick,
        "greedy search's step: each row's argmax of logits (N, V) (token block counted as -inf) "
        "into out (N,) int64; returns how many rows chose token eos (if eos >= 0)");
  qkv::register_step(m);
  m.attr("level") = QKV_LEVEL_NAME;  // the instruction-set level this build was compiled for
}
