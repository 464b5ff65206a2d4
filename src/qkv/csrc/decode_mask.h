// Which keys each query row of a decode call may see: the causal / sliding-window structure
// (queries aligned bottom-right) and a bool mask (True = may attend) read in place as a
// strided view. Problem (decode_common.h) holds one of each; row_ranges turns them into each
// row's key range and mask row once per segment.
#pragma once

#include <algorithm>
#include <cstdint>

namespace {

// Which keys query row i may see (aligned bottom-right: position Tk - Tq + i).
struct Structure {
  int64_t Tq, Tk;
  bool causal;
  int64_t window;  // <= 0: none
  int64_t lo(int64_t i) const {
    const int64_t pos = Tk - Tq + i;
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
  int64_t hi(int64_t i) const {
    const int64_t pos = Tk - Tq + i;
    if (causal) return std::min<int64_t>(Tk, pos + 1);
    if (window > 0) return std::min<int64_t>(Tk, pos + window);
    return Tk;
  }
};

// A bool mask (True = may attend) as a strided view (Nb, h_kv, G, Tq, Tk), unit key stride.
struct MaskView {
  const uint8_t* base = nullptr;
  int64_t h_kv = 1, s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const uint8_t* row(int64_t n, int64_t g, int64_t i) const {
    if (!base) return nullptr;
    return base + (n / h_kv) * s0 + (n % h_kv) * s1 + g * s2 + i * s3;
  }
};

}  // namespace
