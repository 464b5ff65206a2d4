// What every piece of the decode kernel (decode_cpu.cpp) shares: the block and tile sizes and
// the other constants, the dtype conversions, one call's sizes and pointers (Problem), the
// per-thread scratch (Scratch), row copies, and the QKV_DECODE_* path settings' parser. The
// vector loops (decode_qk_avx512.h, decode_pv_avx512.h, decode_avx2.h), the online softmax
// (decode_softmax.h), int8 on int16 pairs (decode_int16.h), a segment's block loop
// (decode_segment.h) and the AMX tiles (decode_amx.h) build on it; decode_cpu.cpp includes
// them all into one translation unit per level, the split over threads and the op last.
#pragma once

#include <ATen/ATen.h>

#include "decode_mask.h"
#include "simd.h"  // QKV_AVX512: the vector code needs F, BW (16-bit lanes, byte masks), VL

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>

namespace {

using at::BFloat16;
using at::Tensor;
#if defined(QKV_AVX2) || defined(QKV_AVX512)
using qkv_simd::pf_line;  // one line into L2
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 16;   // keys per score tile: one vector of 16 scores per row
constexpr int64_t kBlock = 64;  // keys per online-softmax step
// fp32 with this many query rows per kv head is arithmetic-bound: scores by broadcasts
// (scores_bcast; below it the dot-product form wastes less on rows padded to 16) and P·V a
// whole block at a time
constexpr int64_t kBcastMinRows = 16;
#ifdef QKV_AVX512
constexpr int64_t kBcastPad = 16;  // Qᵀ's rows padded to a multiple of the vector width
#else
constexpr int64_t kBcastPad = 8;
#endif
// int8 K/V from this many query rows per kv head: runs of keys widened to fp32 once
// (run_segment_widened). Measured on a 2-core Xeon, Tk = 4096, G = 4, d = 128, 1 thread, same
// process, read as stored / widened: 1.50 / 2.71 ms at 8 rows, 2.91 / 3.40 at 16, 4.02 / 4.15
// at 24, 5.82 / 5.50 at 32, 11.75 / 8.50 at 64.
constexpr int64_t kWidenRows = 32;
// The running max is raised only when a block's max exceeds it by more than this (log2
// units): p then stays below 2^8, harmless in fp32 sums, and acc is rarely rescaled.
constexpr float kLazy = 8.f;
// Below this many (key, row) pairs per thread a call runs on one thread: forking costs more
// than the keys (measured with bench/decode_attention.py, Tk = 512 with 1 and 2 threads).
constexpr int64_t kMinPairsPerThread = 4096;

static inline float to_float(float x) { return x; }
static inline float to_float(BFloat16 x) { return static_cast<float>(x); }
static inline float to_float(int8_t x) { return static_cast<float>(x); }

// fp32 -> bf16, round to nearest even (NaN stays NaN)
static inline BFloat16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (std::isnan(x)) return BFloat16(x);
  u += 0x7fffu + ((u >> 16) & 1u);
  const uint16_t b = static_cast<uint16_t>(u >> 16);
  BFloat16 out;
  std::memcpy(&out, &b, sizeof(b));
  return out;
}
template <typename T> static inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline BFloat16 from_float<BFloat16>(float x) { return to_bf16(x); }

using qkv_simd::exp2_neg;  // 2^t for t <= 0


// bf16 K/V on a CPU with AVX512_BF16: dot products and P·V with vdpbf16ps (P rounded to
// bf16, as PyTorch's bf16 kernels do); the accumulator rows then hold their columns in the
// order vpunpck{l,h}wd leaves them (see pv_pairs) until the end of each segment.
template <typename T>
constexpr bool kPairs =
#if defined(QKV_AVX512) && defined(__AVX512BF16__)
    std::is_same_v<T, BFloat16>;
#else
    false;
#endif

// One call's sizes and pointers. Rows r = g·Tq + i of kv head n = b·h_kv + hk.
// int8 K/V (an int8 cache): each stored row is d (dv) int8 values then its fp32 scale
// (row = scale · values; 4 more bytes), the queries fp32.
template <typename T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;
template <typename T>
using QueryT = std::conditional_t<kInt8<T>, float, T>;

template <typename T>
struct Problem {
  int64_t N, h_kv, G, Tq, R, d, dv, Tk;
  const QueryT<T>* q;
  const T *k, *v;
  int64_t k0s, k1s, k2s, v0s, v1s, v2s;  // strides of k, v over (Nb, h_kv, Tk)
  Structure st;
  MaskView mk;
  float c2;  // scale · log2(e): scores are kept in log2 units
  // beams that were never reordered (null: none): the key and value of batch row b at
  // position t live in batch row rows[b·rows_s + t] (each tile is then gathered row by row)
  const int64_t* rows = nullptr;
  int64_t rows_s = 0;
  // sentences that left a batch (null: none): query batch row b reads keys and values of
  // batch row kv_batch[b] (whole rows: tiles stay contiguous)
  const int64_t* kv_batch = nullptr;
  int64_t t0 = 0;  // the key position of the first stored row (a widened chunk's scratch)
  // fp32 keys with few rows on an AVX-512 level: the AVX2 loops (fp32_path)
  bool lines = false;
  int64_t batch_row(int64_t n, int64_t t) const {
    return rows ? rows[(n / h_kv) * rows_s + t] : kv_batch ? kv_batch[n / h_kv] : n / h_kv;
  }
  const T* krow(int64_t n, int64_t t) const {
    return k + batch_row(n, t) * k0s + (n % h_kv) * k1s + (t - t0) * k2s;
  }
  const T* vrow(int64_t n, int64_t t) const {
    return v + batch_row(n, t) * v0s + (n % h_kv) * v1s + (t - t0) * v2s;
  }
  // elements of one stored key row (int8: the values and their scale)
  int64_t krow_len() const { return kInt8<T> ? d + 4 : d; }
};

// the scale stored after the n values of an int8 row
static inline float row_scale(const int8_t* row, int64_t n) {
  float s;
  std::memcpy(&s, row + n, sizeof(s));
  return s;
}

// Per-thread scratch (floats): the query rows, the scores S and weights P of one block, and a
// tile of zero-padded K and V rows for the last, partial tile of a segment.
struct Scratch {
  float *qf, *S, *P;
  void *ktile, *vtile;
  int64_t *lo, *hi;  // each row's key range [lo, hi) and mask row, set per segment
  const uint8_t** mrow;
  float* qt = nullptr;  // Qᵀ (d x rows padded to kBcastPad) for the broadcast scores, else null
};

// The rows' key ranges and mask rows for kv head n (once per segment: not a division per
// row and tile)
template <typename T>
static inline void row_ranges(const Problem<T>& P, int64_t n, const Scratch& sc) {
  for (int64_t r = 0; r < P.R; ++r) {
    const int64_t i = r % P.Tq;
    sc.lo[r] = P.st.lo(i), sc.hi[r] = P.st.hi(i), sc.mrow[r] = P.mk.row(n, r / P.Tq, i);
  }
}

// n values from src to dst: inline vector moves (short rows of a partial tile; a libc memcpy
// call per row cost a quarter of a decode step with a few keys per head)
template <typename T>
static inline void copy_row(T* dst, const T* src, int64_t n) {
  int64_t bytes = n * static_cast<int64_t>(sizeof(T)), i = 0;
  auto* d8 = reinterpret_cast<char*>(dst);
  const auto* s8 = reinterpret_cast<const char*>(src);
#ifdef QKV_AVX512
  for (; i + 64 <= bytes; i += 64) _mm512_storeu_si512(d8 + i, _mm512_loadu_si512(s8 + i));
  if (i < bytes) {
    const __mmask64 m = (1ull << (bytes - i)) - 1;  // bytes - i < 64
    _mm512_mask_storeu_epi8(d8 + i, m, _mm512_maskz_loadu_epi8(m, s8 + i));
  }
#else
#ifdef QKV_AVX2
  for (; i + 32 <= bytes; i += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d8 + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8 + i)));
#endif
  std::memcpy(d8 + i, s8 + i, static_cast<size_t>(bytes - i));
#endif
}

// A path setting from the environment (QKV_DECODE_*): one of `allowed` (the first is the
// default, also for an unset or empty variable), else an error naming them all. Each is
// read once per process and parsed on every build, so a bad value is an error whatever the CPU.
static std::string path_setting(const char* name, std::initializer_list<const char*> allowed) {
  const char* e = std::getenv(name);
  const std::string want = e && *e ? e : *allowed.begin();
  std::string names;
  size_t i = 0;
  for (const char* a : allowed) {
    if (want == a) return want;
    names += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") + std::string(a), ++i;
  }
  TORCH_CHECK(false, name, " must be ", names, "; got '", want, "'");
}

}  // namespace
