// The NaN/inf rule's look at a call's inputs (qkv._nonfinite) and the dispatcher's bound on
// the logits: one vectorised pass over the bits of q, k, v or a bias, bound in module.cpp as
// plain Python functions.
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <limits>

using at::Tensor;

namespace {
// max|x| of IEEE numbers stored as U: the absolute values' bit patterns order like unsigned
// integers, so it is an integer max of the bits with the sign cleared (one vectorised pass;
// NaNs are the patterns above infinity's)
template <typename U>
static U abs_bits_max(const U* x, int64_t n, U no_sign) {
  U m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const U a = x[i] & no_sign;
    m = a > m ? a : m;
  }
  return m;
}

template <typename F, typename U>
static double from_bits(U u) {
  F f;
  std::memcpy(&f, &u, sizeof(f));
  return static_cast<double>(f);
}

}  // namespace

namespace qkv {
// max|q|·max|k|: the dispatcher's bound on the scores (qkv.dispatch._logit_bound) in one
// call, without the four tensors and float conversions of two aminmax calls (~6 us -> ~1 us).
// Bound in module.cpp as a plain Python function, not a torch.ops operator: the dispatcher
// calls it on every call that needs gradients, where torch.ops' argument parsing alone costs
// ~2 us.
double max_abs_product(const Tensor& q, const Tensor& k) {
  auto one = [](const Tensor& t) -> double {
    if (t.numel() == 0) return 0.0;
    if (!t.is_contiguous()) return at::abs(t).max().item<double>();
    const void* p = t.const_data_ptr();
    const int64_t n = t.numel();
    constexpr double nan = std::numeric_limits<double>::quiet_NaN();
    switch (t.scalar_type()) {
      case at::kFloat: {
        const uint32_t m = abs_bits_max(static_cast<const uint32_t*>(p), n, 0x7fffffffu);
        return m > 0x7f800000u ? nan : from_bits<float>(m);
      }
      case at::kBFloat16: {
        const uint16_t m = abs_bits_max(static_cast<const uint16_t*>(p), n, uint16_t(0x7fff));
        return m > 0x7f80u ? nan : from_bits<float>(uint32_t(m) << 16);
      }
      case at::kHalf: {
        const uint16_t m = abs_bits_max(static_cast<const uint16_t*>(p), n, uint16_t(0x7fff));
        return m > 0x7c00u ? nan : static_cast<double>(at::Half(m, at::Half::from_bits()));
      }
      case at::kDouble: {
        const uint64_t m =
            abs_bits_max(static_cast<const uint64_t*>(p), n, uint64_t(0x7fffffffffffffffull));
        return m > 0x7ff0000000000000ull ? nan : from_bits<double>(m);
      }
      default:
        return at::abs(t).max().item<double>();
    }
  };
  return one(q) * one(k);
}

// Whether no element of x is NaN or inf (plus_inf_only: no NaN and no +inf; -inf is allowed,
// as in a bias where it means "masked"). The bits test vectorises: |x| below infinity's
// pattern; with plus_inf_only, x's own pattern is not +inf's either.
template <typename U>
static bool finite_bits(const U* x, int64_t n, U no_sign, U inf, bool plus_inf_only) {
  U bad = 0;
  if (plus_inf_only) {
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) {
      const U a = x[i] & no_sign;
      bad |= static_cast<U>((a > inf) | (x[i] == inf));
    }
  } else {
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= static_cast<U>((x[i] & no_sign) >= inf);
  }
  return bad == 0;
}

bool all_finite(const Tensor& t, bool plus_inf_only) {
  if (t.numel() == 0) return true;
  if (!t.is_contiguous() || !t.device().is_cpu()) {
    const Tensor bad = plus_inf_only ? at::isnan(t).logical_or_(at::isposinf(t)) : ~at::isfinite(t);
    return !bad.any().item<bool>();
  }
  const void* p = t.const_data_ptr();
  const int64_t n = t.numel();
  switch (t.scalar_type()) {
    case at::kFloat:
      return finite_bits(static_cast<const uint32_t*>(p), n, 0x7fffffffu, 0x7f800000u,
                         plus_inf_only);
    case at::kBFloat16:
      return finite_bits(static_cast<const uint16_t*>(p), n, uint16_t(0x7fff), uint16_t(0x7f80),
                         plus_inf_only);
    case at::kHalf:
      return finite_bits(static_cast<const uint16_t*>(p), n, uint16_t(0x7fff), uint16_t(0x7c00),
                         plus_inf_only);
    case at::kDouble:
      return finite_bits(static_cast<const uint64_t*>(p), n, uint64_t(0x7fffffffffffffffull),
                         uint64_t(0x7ff0000000000000ull), plus_inf_only);
    default:  // integers and bools are finite; other floats through ATen
      if (!at::isFloatingType(t.scalar_type())) return true;
      const Tensor bad =
          plus_inf_only ? at::isnan(t).logical_or_(at::isposinf(t)) : ~at::isfinite(t);
      return !bad.any().item<bool>();
  }
}

// Whether every element of a log-sum-exp (fp32) is finite and nonzero: the NaN/inf rule's
// check on the summary of PyTorch's fused CPU kernel (qkv.dispatch.torch_adapter.lse_run).
// In the bits: |x| - 1 wraps below zero for +-0 and lands at or above 0x7f7fffff for
// +-inf and NaN, so one unsigned compare covers all three.
bool lse_clear(const Tensor& lse) {
  if (lse.numel() == 0) return true;
  if (lse.scalar_type() != at::kFloat || !lse.device().is_cpu() ||
      !lse.is_non_overlapping_and_dense()) {
    return at::isfinite(lse).logical_and_(lse != 0).all().item<bool>();
  }
  // dense: its elements fill numel() slots from the lowest-addressed one, in some order
  int64_t low = 0;
  for (int64_t i = 0; i < lse.dim(); ++i)
    if (lse.stride(i) < 0) low += (lse.size(i) - 1) * lse.stride(i);
  const uint32_t* x = reinterpret_cast<const uint32_t*>(lse.const_data_ptr<float>()) + low;
  const int64_t n = lse.numel();
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>(((x[i] & 0x7fffffffu) - 1u) >= 0x7f7fffffu);
  return bad == 0;
}
}  // namespace qkv
