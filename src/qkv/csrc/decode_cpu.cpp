// qkv's CPU decode-attention kernel ("flash-decoding"): a few queries over a long KV cache.
//
// Decoding attends Tq = 1..16 queries per head to Tk = thousands of cached keys. The work is
// memory-bound (each key and value is used by only G·Tq query rows), so the kernel's job is
// to read K and V exactly once, in their stored dtype, at the machine's read bandwidth:
//
//   * the G query heads of one kv head and their Tq queries form one small matrix of
//     R = G·Tq rows that reads its kv head once (GQA without repeating K/V);
//   * the keys of all kv heads, laid end to end, are cut into one contiguous span per thread
//     (flash-decoding): each thread keeps, per row, a running max m, sum l and unnormalised
//     output acc for each piece ("segment") of a head it covers; one merge by log-sum-exp
//     then combines the pieces of each head;
//   * per block of 64 keys: S = Q Kᵀ on tiles of 16 keys (4 rows x 4 keys of dot products
//     in registers, each key chunk loaded once for the 4 rows, summed across lanes by one
//     transpose-and-add tree), the online softmax over the block, then acc += P V with up to
//     4 rows x 64 columns of acc in registers; the tile two blocks ahead is prefetched into
//     L2 line by line as the current one is read, so that DRAM streams while the arithmetic
//     runs. Both products are register-blocked because the loads, not the FMAs, bounded the
//     row-at-a-time loops; with the arithmetic 1.5x faster, DRAM and arithmetic overlap
//     (measurements: bench/decode_attention.py, docs/kernels.md).
//
// fp32 and bf16 K/V (fp32 accumulation; with AVX512_BF16, vdpbf16ps for both products, P
// rounded to bf16 for P·V as in PyTorch's bf16 kernels; with AMX, from 8 query rows per kv
// head, both products on tiles: run_segment_amx). Causal and sliding-window structure (queries aligned bottom-right: query i sits at
// key position Tk - Tq + i), a bool mask (True = may attend) read in place as a broadcast
// view, any scale. Rows that see no key give zeros and lse = -inf, as every qkv backend.
// Layout:
//   q (Nb, h, Tq, d) contiguous   k (Nb, h_kv, Tk, d), v (Nb, h_kv, Tk, dv): any strides
//   but a unit one over the head dim (a slice of a preallocated cache is read in place)
//   out (Nb, h, Tq, dv) in q's dtype, lse (Nb, h, Tq) fp32;  query head = kv head · G + g.
//   fp32 q with bf16 k, v (an fp32 model with a bf16 cache): q rounded to bf16, out fp32.
//   Generation: rows (Nb, >= Tk) int64 names the k/v batch row of each query row's key at
//   each position (beams reordered without copying); kv_batch (Nb,) the k/v batch row of
//   each query row (sentences that finished left the batch without copying the cache); with
//   either, k and v may hold more batch rows than q.
// Built once per level (qkv/kernels/_levels.py): AVX-512 code on the AVX-512 levels, AVX2 code
// on avx2, plain C++ loops on portable (QKV_ISA forces a level; the tests run each). The
// AVX-512 levels run fp32 caches with few rows through the AVX2 loops where those stream DRAM
// better (Zen 5: fp32_path).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/native/CPUBlas.h>  // could_pack: oneDNN sees AMX
#include <torch/library.h>

#include "simd.h"  // QKV_AVX512: the vector code needs F, BW (16-bit lanes, byte masks), VL

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#if defined(__x86_64__)
#include <cpuid.h>  // amd_family(): which AVX-512 CPU this is
#endif
#include <unistd.h>

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

// -------------------------------------------------------------------------------------------
// Vector pieces (AVX-512)
#ifdef QKV_AVX512
using qkv_simd::exp2_v;  // 2^t for 16 lanes

using qkv_simd::lanes;  // the first n (0..16) lanes

// 16 values of a row as fp32 (lanes off in k: 0)
static inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const BFloat16* p, __mmask16 k) {
  const __m256i b = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline __m512 load16(const BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline __m512 load16(const int8_t* p, __mmask16 k) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// lanes j of the result = sum of the 16 lanes of a[j]: a transpose-and-add tree (45 ops)
[[gnu::always_inline]] static inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

// q·k for 16 keys (rows kp, kp + ks, ...), q in fp32 (zero past d): one vector of scores
// pf: the same rows of a later tile, prefetched into L2 line by line as these are read
// (spread over the arithmetic rather than issued in a burst), or nullptr.

template <typename T>
static inline __m512 dots16(const float* q, const T* kp, int64_t ks, int64_t d, const T* pf) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
    if (pf && (c * int64_t(sizeof(T))) % 64 == 0)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * ks + c);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, load16(kp + j * ks + c), a[j]);
  }
  if (c < d) {
    const __mmask16 t = lanes(d - c);
    const __m512 qv = _mm512_loadu_ps(q + c);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, load16(kp + j * ks + c, t), a[j]);
  }
  return reduce16(a);
}

#ifdef __AVX512BF16__
// bf16 keys: 32 products per instruction (vdpbf16ps, fp32 sums); q as bf16 pairs, zero past d
static inline __m512 dots16_bf16(const BFloat16* q, const BFloat16* kp, int64_t ks, int64_t d,
                                  const BFloat16* pf) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    if (pf)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * ks + c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(kp + j * ks + c));
  }
  if (c < d) {
    const __mmask32 t = d - c >= 32 ? ~__mmask32(0) : __mmask32((1u << (d - c)) - 1u);
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(t, kp + j * ks + c));
  }
  return reduce16(a);
}
#else
static inline __m512 dots16_bf16(const BFloat16*, const BFloat16*, int64_t, int64_t,
                                  const BFloat16*) {  // never called: kPairs needs AVX512_BF16
  return _mm512_setzero_ps();
}
#endif

// The same for the common head sizes, d = 16·kC (fp32) or 32·kC (bf16 pairs): q stays in
// registers and each key is one row pointer with its chunks at constant offsets. (The
// generic loops keep 16 row pointers and 16 prefetch pointers live; GCC 12 spills them and
// reloads one from the stack per FMA.) kPf: prefetch the same rows of pf, as dots16.
template <int kC, bool kPf, typename T>
[[gnu::noinline]] static __m512 dots16_fixed(const float* q, const T* kp, int64_t ks, const T* pf) {
  __m512 qv[kC], a[16];
  for (int c = 0; c < kC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const T* kr = kp + j * ks;
    if constexpr (kPf)
      for (int c = 0; c < kC; ++c)
        if ((16 * c * sizeof(T)) % 64 == 0) pf_line(pf + j * ks + 16 * c);
    __m512 x = _mm512_mul_ps(qv[0], load16(kr));
    for (int c = 1; c < kC; ++c) x = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), x);
    a[j] = x;
  }
  return reduce16(a);
}

#ifdef __AVX512BF16__
template <int kC, bool kPf>
[[gnu::noinline]] static __m512 dots16_bf16_fixed(const BFloat16* q, const BFloat16* kp, int64_t ks,
                                       const BFloat16* pf) {
  __m512bh qv[kC];
  __m512 a[16];
  for (int c = 0; c < kC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const BFloat16* kr = kp + j * ks;
    if constexpr (kPf)
      for (int c = 0; c < kC; ++c) pf_line(pf + j * ks + 32 * c);
    __m512 x = _mm512_setzero_ps();
    for (int c = 0; c < kC; ++c)
      x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
    a[j] = x;
  }
  return reduce16(a);
}
#endif

// x, kept in a register: GCC otherwise folds a load used by 4 FMAs into each of them as a
// memory operand, i.e. loads it 4 times, which is what the blocking is meant to avoid.
template <typename V>
static inline V in_register(V x) {
  asm("" : "+v"(x));
  return x;
}

// v[kg] holds lanes 4·row + key of keys 4kg..4kg+3: a 4x4 transpose of 128-bit lanes gives
// out[row] with the 16 keys in order.
static inline void rows_by_lanes(const __m512* v, __m512* out) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t2 = _mm512_shuffle_f32x4(v[0], v[1], 0xee), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
  out[0] = _mm512_shuffle_f32x4(t0, t1, 0x88), out[1] = _mm512_shuffle_f32x4(t0, t1, 0xdd);
  out[2] = _mm512_shuffle_f32x4(t2, t3, 0x88), out[3] = _mm512_shuffle_f32x4(t2, t3, 0xdd);
}

// How dots16xR takes one chunk of a key row and of a query row (kWidth elements each) and
// adds their products into an accumulator: FMAs on fp32 (keys of any dtype widened by
// load16); vdpbf16ps on bf16 pairs; vpdpwssd on int16 pairs (int8 keys, int16 queries).
template <typename T>
struct FmaDots {
  using Q = float;
  using K = T;
  using Acc = __m512;
  using V = __m512;
  static constexpr int kWidth = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V key(const K* p) { return load16(p); }
  static V query(const Q* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc a, V q, V k) { return _mm512_fmadd_ps(q, k, a); }
  static __m512 sums(Acc a) { return a; }
};

#ifdef __AVX512BF16__
struct Bf16Dots {
  using Q = BFloat16;
  using K = BFloat16;
  using Acc = __m512;
  using V = __m512i;
  static constexpr int kWidth = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V key(const K* p) { return _mm512_loadu_si512(p); }
  static V query(const Q* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc a, V q, V k) { return _mm512_dpbf16_ps(a, (__m512bh)q, (__m512bh)k); }
  static __m512 sums(Acc a) { return a; }
};
#endif

#define QKV_I16_DOTS 1
// int8 keys against queries rounded to int16: vpdpwssd sums 32 products of int16 pairs per
// instruction into exact int32 lanes (|sum| <= d · 32767 · 127 < 2^31 for d <= 512), where
// widening each key to fp32 took two instructions per 16 values before the FMAs; the lanes
// are converted to fp32 for the reduction. kVnni false: vpmaddwd + vpaddd (the avx512 build
// where the CPU lacks AVX512_VNNI; qkv_simd::dpwssd).
template <bool kVnni>
struct I16Dots {
  using Q = int16_t;
  using K = int8_t;
  using Acc = __m512i;
  using V = __m512i;
  static constexpr int kWidth = 32;
  static Acc zero() { return _mm512_setzero_si512(); }
  static V key(const K* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V query(const Q* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc a, V q, V k) {
    qkv_simd::dpwssd<kVnni>(a, q, k);
    return a;
  }
  static __m512 sums(Acc a) { return _mm512_cvtepi32_ps(a); }
};

// Scores of kR = 1..4 query rows (row stride qs) for a tile of 16 keys, d = kC chunks:
// blocks of kR rows x 4 keys keep their accumulators in registers, so each chunk of a key
// is loaded once for all kR rows (row by row, every key is loaded kR times, and those loads,
// not the FMAs, bound the loop). One reduce16 per block gives lanes 4·row + key. kPf: the
// same rows of pf prefetched, one line per 64 bytes of key.
template <typename Ops, int kR, int kC, bool kPf>
[[gnu::noinline]] static void dots16xR(const typename Ops::Q* q, int64_t qs,
                                       const typename Ops::K* kp, int64_t ks,
                                       const typename Ops::K* pf, __m512* out) {
  constexpr int W = Ops::kWidth;
  __m512 v[4];
#pragma GCC unroll 4
  for (int kg = 0; kg < 4; ++kg) {
    typename Ops::Acc a[16];
    for (int i = 0; i < 16; ++i) a[i] = Ops::zero();
    const typename Ops::K* kr = kp + 4 * kg * ks;
    for (int c = 0; c < kC; ++c) {
      if constexpr (kPf)
        if ((W * c * sizeof(typename Ops::K)) % 64 == 0)
          for (int j = 0; j < 4; ++j) pf_line(pf + (4 * kg + j) * ks + W * c);
      typename Ops::V kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = in_register(Ops::key(kr + j * ks + W * c));
      for (int r = 0; r < kR; ++r) {
        const typename Ops::V qv = in_register(Ops::query(q + r * qs + W * c));
        for (int j = 0; j < 4; ++j) a[4 * r + j] = Ops::madd(a[4 * r + j], qv, kv[j]);
      }
    }
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = Ops::sums(a[i]);
    v[kg] = reduce16(f);
  }
  rows_by_lanes(v, out);
}

// dots16xR for the head sizes with a fixed-size loop (d = 64, 128), with or without the
// prefetch; false: another d (no such loop).
template <typename Ops, int kR>
static inline bool dots16xR_fixed(const typename Ops::Q* q, int64_t qs, const typename Ops::K* kp,
                                  int64_t ks, int64_t d, const typename Ops::K* pf, __m512* out) {
  constexpr int kC = 128 / Ops::kWidth;  // chunks of a row of 128
  if (d == 128)
    pf ? dots16xR<Ops, kR, kC, true>(q, qs, kp, ks, pf, out) : dots16xR<Ops, kR, kC, false>(q, qs, kp, ks, pf, out);
  else if (d == 64)
    pf ? dots16xR<Ops, kR, kC / 2, true>(q, qs, kp, ks, pf, out) : dots16xR<Ops, kR, kC / 2, false>(q, qs, kp, ks, pf, out);
  else
    return false;
  return true;
}

template <int kR, bool kDot, typename T>
static inline bool qk_rows_fixed(const void* q0, int64_t qs, const T* kp, int64_t ks, int64_t d,
                                 const T* pf, __m512* out) {
  if constexpr (kDot) {
#ifdef __AVX512BF16__
    return dots16xR_fixed<Bf16Dots, kR>(static_cast<const BFloat16*>(q0), qs, kp, ks, d, pf, out);
#else
    return false;
#endif
  } else {
    return dots16xR_fixed<FmaDots<T>, kR>(static_cast<const float*>(q0), qs, kp, ks, d, pf, out);
  }
}

// The scores of nr = 3 or 4 rows at once where a fixed-size loop exists (d = 64, 128);
// false: none (the caller goes row by row).
template <bool kDot, typename T>
static inline bool qk_rows(int64_t nr, const void* q0, int64_t qs, const T* kp, int64_t ks,
                           int64_t d, const T* pf, __m512* out) {
  if (nr == 4) return qk_rows_fixed<4, kDot>(q0, qs, kp, ks, d, pf, out);
  if (nr == 3) return qk_rows_fixed<3, kDot>(q0, qs, kp, ks, d, pf, out);
  return false;
}

// One row's scores for a tile of 16 keys: the fixed-size loops for d = 64 and 128.
template <typename T>
static inline __m512 qk_tile(const float* q, const T* kp, int64_t ks, int64_t d, const T* pf) {
  if (d == 128) return pf ? dots16_fixed<8, true>(q, kp, ks, pf) : dots16_fixed<8, false>(q, kp, ks, pf);
  if (d == 64) return pf ? dots16_fixed<4, true>(q, kp, ks, pf) : dots16_fixed<4, false>(q, kp, ks, pf);
  return dots16(q, kp, ks, d, pf);
}

static inline __m512 qk_tile_bf16(const BFloat16* q, const BFloat16* kp, int64_t ks, int64_t d,
                                  const BFloat16* pf) {
#ifdef __AVX512BF16__
  if (d == 128)
    return pf ? dots16_bf16_fixed<4, true>(q, kp, ks, pf) : dots16_bf16_fixed<4, false>(q, kp, ks, pf);
  if (d == 64)
    return pf ? dots16_bf16_fixed<2, true>(q, kp, ks, pf) : dots16_bf16_fixed<2, false>(q, kp, ks, pf);
#endif
  return dots16_bf16(q, kp, ks, d, pf);
}

#ifdef QKV_I16_DOTS
// The scores of nr = 1..4 rows of int16 queries (d = 64 or 128) for a tile of 16 int8 keys.
static inline void qk_rows_i16(int64_t nr, const int16_t* q, int64_t qs, const int8_t* kp,
                               int64_t ks, int64_t d, const int8_t* pf, __m512* out) {
  qkv_simd::with_vnni512([&](auto kVnni) {
    using Ops = I16Dots<decltype(kVnni)::value>;
    switch (nr) {
      case 1: dots16xR_fixed<Ops, 1>(q, qs, kp, ks, d, pf, out); break;
      case 2: dots16xR_fixed<Ops, 2>(q, qs, kp, ks, d, pf, out); break;
      case 3: dots16xR_fixed<Ops, 3>(q, qs, kp, ks, d, pf, out); break;
      default: dots16xR_fixed<Ops, 4>(q, qs, kp, ks, d, pf, out); break;
    }
  });
}
#endif

// lanes allowed by a mask row (True = may attend) among those in k
static inline __mmask16 mask_bits(const uint8_t* m, __mmask16 k) {
  return _mm_mask_cmpneq_epi8_mask(k, _mm_maskz_loadu_epi8(k, m), _mm_setzero_si128());
}

// The 16 rows of x (16 floats each) as 16 columns: out[c] lane j = x[j][c].
static inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_f32x4(a, c, 0x88), t[8 + e] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88), t[12 + e] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// x[i]: the raw scores of query row r0 + i (i < n, rows past R skipped) for the tile of keys
// [kt, kt + nt) at column t0 of the block, stored into S scaled to log2 units, -inf where the
// row may not see the key (its range, its mask row)
static inline void store_score_rows(const __m512* x, int64_t r0, int64_t n, int64_t R, int64_t kt,
                                    int64_t nt, int64_t t0, const Scratch& sc, float c2) {
  for (int64_t i = 0; i < n && r0 + i < R; ++i) {
    const int64_t r = r0 + i;
    const int64_t a = std::clamp<int64_t>(sc.lo[r] - kt, 0, nt);
    const int64_t b = std::clamp<int64_t>(sc.hi[r] - kt, 0, nt);
    __mmask16 vis = __mmask16(lanes(b) & ~lanes(a));
    if (sc.mrow[r] && vis) vis = mask_bits(sc.mrow[r] + kt, vis);
    _mm512_storeu_ps(sc.S + r * kBlock + t0,
                     _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), vis, x[i], _mm512_set1_ps(c2)));
  }
}

// Sᵀ of one tile for fp32 with many query rows: out[16·g + j] (lanes: the 16 rows of group g)
// = Σ_c K[j][c] · Qᵀ[c][16g..16g+15], for kG row groups and keys j0..j0+kJ-1. One broadcast
// of K[j][c] serves 16·kG rows and no horizontal sum is needed (the dot-product form of
// qk_rows reduces 16 accumulators per 4 rows x 4 keys). Qᵀ: d x Rp, packed per segment.
// The K rows are kD floats apart (compile-time offsets: 16 row pointers would be spilled).
// pf: the same keys of a later tile, whose lines (kD / 16 per row) in pf_lines (a bit per
// line index) are prefetched into L2, one line per 16·kG FMAs: spread evenly over the
// arithmetic, as the DRAM delivers them (see pv_spread).
template <int kG, int kJ, int kD>
[[gnu::noinline]] static void qk_bcast(const float* qt, int64_t Rp, const float* kp, int j0,
                                       const float* pf, unsigned pf_lines, __m512* out) {
  __m512 acc[kG * kJ];
  for (int i = 0; i < kG * kJ; ++i) acc[i] = _mm512_setzero_ps();
  const float* kr = kp + j0 * kD;
  for (int c = 0; c < kD; ++c) {
    __m512 qv[kG];
    for (int g = 0; g < kG; ++g) qv[g] = _mm512_loadu_ps(qt + c * Rp + 16 * g);
    // iteration c visits line c / 16 of key j0 + c % 16 (kJ = 16), or of key j0 + c / 2 % 8
    // on even c (kJ = 8: two calls cover the tile)
    if (pf && (pf_lines >> (c / 16) & 1) && (kJ == 16 || c % 2 == 0))
      pf_line(pf + (j0 + (kJ == 16 ? c % 16 : c / 2 % 8)) * kD + c / 16 * 16);
#pragma GCC unroll 16
    for (int j = 0; j < kJ; ++j) {
      const __m512 kv = _mm512_set1_ps(kr[j * kD + c]);
      for (int g = 0; g < kG; ++g) acc[g * kJ + j] = _mm512_fmadd_ps(kv, qv[g], acc[g * kJ + j]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kJ; ++j) out[16 * g + j0 + j] = acc[g * kJ + j];
}

// Scores of a whole tile (16 keys, K rows d floats apart, d = 64 or 128: decode_impl sets
// sc.qt only then) for every query row by qk_bcast, into S. Rp: R padded to 16, Qᵀ's row length.
static void scores_bcast(const float* qt, int64_t R, int64_t Rp, int64_t d, const float* kp,
                         const float* pf, int64_t kt, int64_t nt, int64_t t0, const Scratch& sc,
                         float c2) {
  __m512 x[32];
  const int64_t passes = (Rp / 16 + 1) / 2;
  for (int64_t g = 0; g < Rp / 16; g += 2) {
    const float* q = qt + 16 * g;
    // the passes over the tile (pairs of row groups) share its prefetch: pass g / 2 takes
    // the lines L with L % passes == g / 2
    unsigned f = 0;
    for (int64_t L = 0; L < d / 16; ++L) f |= unsigned(L % passes == g / 2) << L;
    if (g + 1 < Rp / 16) {  // two row groups, keys in halves: 16 accumulators
      if (d == 128) qk_bcast<2, 8, 128>(q, Rp, kp, 0, pf, f, x), qk_bcast<2, 8, 128>(q, Rp, kp, 8, pf, f, x);
      else qk_bcast<2, 8, 64>(q, Rp, kp, 0, pf, f, x), qk_bcast<2, 8, 64>(q, Rp, kp, 8, pf, f, x);
    } else if (d == 128) {
      qk_bcast<1, 16, 128>(q, Rp, kp, 0, pf, f, x);
    } else {
      qk_bcast<1, 16, 64>(q, Rp, kp, 0, pf, f, x);
    }
    for (int64_t h = 0; h < 2 && g + h < Rp / 16; ++h) {
      transpose16(x + 16 * h);  // x[16h + i]: the 16 keys' scores of row 16(g + h) + i
      store_score_rows(x + 16 * h, 16 * (g + h), 16, R, kt, nt, t0, sc, c2);
    }
  }
}
#endif  // QKV_AVX512

#ifdef QKV_AVX512
#ifdef __AVX512BF16__
// acc += P V for one tile of 16 bf16 value rows (vp, row stride vs), P in bf16 (row r at
// p + r·kBlock), with vdpbf16ps on key pairs: for each 32-column chunk the rows j, j+1 are
// interleaved (vpunpcklwd/hwd: fp32 lane 4L+i then holds column 8L+i, resp. 8L+4+i, of the
// chunk) and each query row adds p_j·v_j + p_{j+1}·v_{j+1} in one instruction. The chunk's
// "lo" half goes to acc[c, c+16), "hi" to acc[c+16, c+32): unpermute_pairs restores the order.
static inline void pv_pairs(const BFloat16* vp, int64_t vs, int64_t dv, const BFloat16* p,
                            int64_t R, float* acc, int64_t dvp, const BFloat16* pf) {
  auto pair = [&](int64_t r, int jp) {  // (p_2jp, p_2jp+1) of row r, broadcast
    int32_t w;
    std::memcpy(&w, p + r * kBlock + 2 * jp, sizeof(w));
    return (__m512bh)_mm512_set1_epi32(w);
  };
  for (int64_t c = 0; c < dv; c += 32) {
    const __mmask32 cm = dv - c >= 32 ? ~__mmask32(0) : __mmask32((1u << (dv - c)) - 1u);
    __m512bh lo[8], hi[8];
    if (pf)
      for (int j = 0; j < 16; ++j) pf_line(pf + j * vs + c);
    for (int jp = 0; jp < 8; ++jp) {
      const __m512i x = _mm512_maskz_loadu_epi16(cm, vp + (2 * jp) * vs + c);
      const __m512i y = _mm512_maskz_loadu_epi16(cm, vp + (2 * jp + 1) * vs + c);
      lo[jp] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[jp] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {  // four rows: eight independent chains
      float* o = acc + r * dvp + c;
      __m512 a[8];
      for (int i = 0; i < 4; ++i)
        a[2 * i] = _mm512_loadu_ps(o + i * dvp), a[2 * i + 1] = _mm512_loadu_ps(o + i * dvp + 16);
      for (int jp = 0; jp < 8; ++jp)
        for (int i = 0; i < 4; ++i) {
          const __m512bh w = pair(r + i, jp);
          a[2 * i] = _mm512_dpbf16_ps(a[2 * i], lo[jp], w);
          a[2 * i + 1] = _mm512_dpbf16_ps(a[2 * i + 1], hi[jp], w);
        }
      for (int i = 0; i < 4; ++i)
        _mm512_storeu_ps(o + i * dvp, a[2 * i]), _mm512_storeu_ps(o + i * dvp + 16, a[2 * i + 1]);
    }
    for (; r < R; ++r) {  // one row: four chains
      float* o = acc + r * dvp + c;
      __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16);
      __m512 b0 = _mm512_setzero_ps(), b1 = b0;
      for (int jp = 0; jp < 8; jp += 2) {
        const __m512bh w0 = pair(r, jp), w1 = pair(r, jp + 1);
        a0 = _mm512_dpbf16_ps(a0, lo[jp], w0), a1 = _mm512_dpbf16_ps(a1, hi[jp], w0);
        b0 = _mm512_dpbf16_ps(b0, lo[jp + 1], w1), b1 = _mm512_dpbf16_ps(b1, hi[jp + 1], w1);
      }
      _mm512_storeu_ps(o, _mm512_add_ps(a0, b0)), _mm512_storeu_ps(o + 16, _mm512_add_ps(a1, b1));
    }
  }
}
#else
static inline void pv_pairs(const BFloat16*, int64_t, int64_t, const BFloat16*, int64_t, float*,
                            int64_t, const BFloat16*) {}  // never called: kPairs is false without AVX512_BF16
#endif
#endif  // QKV_AVX512

#ifdef QKV_AVX512
// acc += P V for nj value rows (a tile of 16 or a whole block; vp, row stride vs; fp32 or bf16
// widened), P in fp32 (row r at p + r·kBlock). Register-blocked: up to 4 rows x 4 column chunks (16
// accumulators) stay in registers over the 16 keys, so each value chunk is loaded once per
// 4 rows and each weight broadcast once per 64 columns (the row-at-a-time loop broadcast
// every weight once per 16 columns and reloaded acc per 16 keys: twice the memory ops).
// kPf: also prefetch into L2, spread over the arithmetic, for each key j: 1, the chunk's
// lines of row j of the tile two blocks ahead (pf); 2, the one line at pf + j·vs. A template
// flag, not a runtime test: with a branch in the loop GCC 12 keeps a copy of the accumulators
// on the stack, 16 stores per key, and the loop runs at half speed.
template <int kRows, int kCols, int kPf, typename T>
[[gnu::noinline]] static void pv_block(const T* vp, int64_t vs, int64_t c, __mmask16 last,
                            const float* p, float* o, int64_t dvp, const T* pf, int nj) {
  __m512 a[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) a[i][u] = _mm512_loadu_ps(o + i * dvp + c + 16 * u);
  for (int j = 0; j < nj; ++j) {
    if constexpr (kPf == 1)  // c is a multiple of 64 columns: chunk u starts a new 64-byte line
                        // exactly when 16·u·sizeof(T) is a multiple of 64
      for (int u = 0; u < kCols; ++u)
        if ((16 * u * sizeof(T)) % 64 == 0) pf_line(pf + j * vs + c + 16 * u);
    if constexpr (kPf == 2) pf_line(pf + j * vs);
    __m512 v[kCols];
    for (int u = 0; u < kCols; ++u)
      v[u] = u + 1 < kCols ? load16(vp + j * vs + c + 16 * u)
                           : load16(vp + j * vs + c + 16 * u, last);
    for (int i = 0; i < kRows; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * kBlock + j]);
      for (int u = 0; u < kCols; ++u) a[i][u] = _mm512_fmadd_ps(v[u], w, a[i][u]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) _mm512_storeu_ps(o + i * dvp + c + 16 * u, a[i][u]);
}

template <int kRows, bool kPf, typename T>
static inline void pv_rows(const T* vp, int64_t vs, int64_t dv, const float* p, float* o,
                           int64_t dvp, const T* pf, int nj) {
  int64_t c = 0;
  for (; c + 64 <= dv; c += 64) pv_block<kRows, 4, kPf>(vp, vs, c, 0xffff, p, o, dvp, pf, nj);
  const int64_t rest = dv - c;  // 0..63 columns: 1-4 chunks, the last one masked
  if (rest <= 0) return;
  const __mmask16 last = lanes(rest - (rest - 1) / 16 * 16);
  switch ((rest + 15) / 16) {
    case 1: pv_block<kRows, 1, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    case 2: pv_block<kRows, 2, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    case 3: pv_block<kRows, 3, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
    default: pv_block<kRows, 4, kPf>(vp, vs, c, last, p, o, dvp, pf, nj); break;
  }
}

template <bool kPf, typename T>
static inline void pv_groups(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                             float* acc, int64_t dvp, const T* pf, int nj) {
  int64_t r = 0;
  if (R >= 4) {  // the first row group prefetches (when kPf), the others do not
    pv_rows<4, kPf>(vp, vs, dv, p, acc, dvp, pf, nj);
    for (r = 4; r + 4 <= R; r += 4)
      pv_rows<4, false>(vp, vs, dv, p + r * kBlock, acc + r * dvp, dvp, pf, nj);
    if (r == R) return;
    return pv_groups<false>(vp, vs, dv, p + r * kBlock, R - r, acc + r * dvp, dvp, pf, nj);
  }
  switch (R) {
    case 1: pv_rows<1, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    case 2: pv_rows<2, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    case 3: pv_rows<3, kPf>(vp, vs, dv, p, acc, dvp, pf, nj); break;
    default: break;
  }
}

// pv_block for call q of a block: calls q = 0, stride, 2·stride, ... prefetch line q / stride
// of every value row of the block two ahead (pf + j·vs + 64·(q / stride) bytes) while there
// are lines left; the others fetch nothing.
template <int kRows, int kCols, typename T>
static inline void pv_call(const T* vp, int64_t vs, int64_t c, __mmask16 last, const float* p,
                           float* o, int64_t dvp, const T* pf, int nj, int64_t q, int64_t lines,
                           int64_t stride) {
  if (pf && q % stride == 0 && q / stride < lines) {
    const char* line = reinterpret_cast<const char*>(pf) + 64 * (q / stride);
    pv_block<kRows, kCols, 2>(vp, vs, c, last, p, o, dvp, reinterpret_cast<const T*>(line), nj);
  } else
    pv_block<kRows, kCols, 0>(vp, vs, c, last, p, o, dvp, static_cast<const T*>(nullptr), nj);
}

template <int kRows, typename T>
static inline void pv_rows_spread(const T* vp, int64_t vs, int64_t dv, const float* p, float* o,
                                  int64_t dvp, const T* pf, int nj, int64_t& q, int64_t lines,
                                  int64_t stride) {
  int64_t c = 0;
  for (; c + 64 <= dv; c += 64, ++q)
    pv_call<kRows, 4>(vp, vs, c, 0xffff, p, o, dvp, pf, nj, q, lines, stride);
  const int64_t rest = dv - c;
  if (rest <= 0) return;
  const __mmask16 last = lanes(rest - (rest - 1) / 16 * 16);
  switch ((rest + 15) / 16) {
    case 1: pv_call<kRows, 1>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    case 2: pv_call<kRows, 2>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    case 3: pv_call<kRows, 3>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
    default: pv_call<kRows, 4>(vp, vs, c, last, p, o, dvp, pf, nj, q, lines, stride); break;
  }
  ++q;
}

// acc += P V for a whole block of kBlock value rows (vs apart) with many query rows (the
// arithmetic-bound case), the prefetch of the block two ahead (pf) spread over all its calls
// (row groups x column chunks): each fetches at most one line per key, so the DRAM requests
// keep pace with the arithmetic. (Issued all by the first row group, as pv_tile does, they
// came in a burst that filled the line-fill buffers, stalling the loads from L2, and then
// nothing was fetched for the rest of the block: Tk = 16384, 16 rows, fp32, 1 thread,
// same process, 18.6 -> 15.3 ms.)
template <typename T>
static void pv_spread(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R, float* acc,
                      int64_t dvp, const T* pf) {
  const int64_t lines = (dv * int64_t(sizeof(T)) + 63) / 64;
  const int64_t calls = (R + 3) / 4 * ((dv + 63) / 64);
  const int64_t stride = std::max<int64_t>(1, calls / std::max<int64_t>(lines, 1));  // dv = 0
  constexpr int nj = kBlock;
  int64_t q = 0, r = 0;
  for (; r + 4 <= R; r += 4)
    pv_rows_spread<4>(vp, vs, dv, p + r * kBlock, acc + r * dvp, dvp, pf, nj, q, lines, stride);
  const float* pr = p + r * kBlock;
  float* ar = acc + r * dvp;
  switch (R - r) {
    case 1: pv_rows_spread<1>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    case 2: pv_rows_spread<2>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    case 3: pv_rows_spread<3>(vp, vs, dv, pr, ar, dvp, pf, nj, q, lines, stride); break;
    default: break;
  }
}

template <typename T>
static inline void pv_tile(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                           float* acc, int64_t dvp, const T* pf) {
  constexpr int nj = kTile;
  if (pf)
    pv_groups<true>(vp, vs, dv, p, R, acc, dvp, pf, nj);
  else
    pv_groups<false>(vp, vs, dv, p, R, acc, dvp, pf, nj);
}
#endif  // QKV_AVX512

// -------------------------------------------------------------------------------------------
// Vector pieces (AVX2 + FMA: 8 fp32 lanes), for the avx2 level. Keys and values of any dtype
// are widened to fp32 in registers (bf16: a 16-bit shift; int8: a conversion), so a bf16
// cache reads half the bytes of an fp32 one for the same arithmetic.
#if defined(QKV_AVX2) && !defined(QKV_AVX512)
#define QKV_DECODE_AVX2 1  // the avx2 level: every loop below
#endif
#ifdef QKV_AVX2  // also on the AVX-512 levels: fp32 keys with few rows (run_segment)
using qkv_simd::exp2_v8;
using qkv_simd::hmax8;
using qkv_simd::hsum8;
using qkv_simd::hsum8x8;
using qkv_simd::load8;


// How far ahead (keys) K and V are prefetched into L2. Zen 3, 1 thread, q (1, 32, 1, 128)
// over (1, 8, 16384, 128), GB/s of K+V fp32 / bf16 in one run: none 6.6 / 6.0; 16 keys
// 10.1 / 6.0; 32 10.5 / 7.9; 64 9.5 / 7.8; 128 9.6 / 7.0; 512 8.8 / 7.2 (19.6 GB/s read peak).
constexpr int64_t kAvx2Ahead = 2 * kTile;

// Raw scores S[r][j] = q_r · k_j of kR query rows (row stride qs, fp32, zero past d) and the
// keys [0, nj) in groups of kJ (rows ks apart; nj a multiple of kJ): kR x kJ accumulators in
// registers, each chunk of a key loaded once for all kR rows, the query chunk once for all kJ
// keys (kept in a register: GCC otherwise folds it into every FMA as a memory operand). d8:
// d rounded down to 8; the rest is added in scalar code. kPf: the same keys of pf prefetched
// into L2, one line per 64 bytes read, spread over the arithmetic (a burst of a whole tile's
// prefetches stalls the loads).
template <int kR, int kJ, bool kPf, typename T>
[[gnu::noinline]] static void dots_avx2(const float* q, int64_t qs, const T* kp, int64_t ks,
                                        int64_t d, int64_t nj, float* S, int64_t ldS,
                                        const T* pf) {
  static_assert(kR * kJ == 8);
  constexpr int64_t kLine = 64 / sizeof(T);  // values of a key per 64-byte line (>= 16)
  const int64_t dl = d / kLine * kLine, d8 = d / 8 * 8;
  __m256 a[8];
  // one step: chunk c of every key and row (the loops unrolled so a stays in registers)
  auto step = [&](const T* kr, int64_t c) {
    __m256 kv[kJ];
#pragma GCC unroll 8
    for (int j = 0; j < kJ; ++j) kv[j] = load8(kr + j * ks + c);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      __m256 qv = _mm256_loadu_ps(q + r * qs + c);
      asm("" : "+x"(qv));
#pragma GCC unroll 8
      for (int j = 0; j < kJ; ++j) a[r * kJ + j] = _mm256_fmadd_ps(qv, kv[j], a[r * kJ + j]);
    }
  };
  for (int64_t j0 = 0; j0 < nj; j0 += kJ) {
    const T* kr = kp + j0 * ks;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    // a 64-byte line of each key per iteration, its prefetch issued first (no branch)
    for (int64_t c = 0; c < dl; c += kLine) {
      if constexpr (kPf)
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
#pragma GCC unroll 8
      for (int64_t u = 0; u < kLine; u += 8) step(kr, c + u);
    }
    for (int64_t c = dl; c < d8; c += 8) {
      if constexpr (kPf)
        if (((c - dl) * int64_t(sizeof(T))) % 64 == 0)
          for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
      step(kr, c);
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8x8(a));  // lane r·kJ + j: row r, key j0 + j
    if (d8 == d) {  // each row's kJ scores straight to S, one copy per row
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) std::memcpy(S + r * ldS + j0, t + r * kJ, kJ * sizeof(float));
      continue;
    }
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < kJ; ++j) {
        float x = t[r * kJ + j];
        for (int64_t c = d8; c < d; ++c) x += q[r * qs + c] * to_float(kr[j * ks + c]);
        S[r * ldS + j0 + j] = x;
      }
  }
}

// q · k over d values (a leftover key of a tile)
template <typename T>
static inline float dot_avx2(const float* q, const T* k, int64_t d) {
  __m256 a = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k + c), a);
  float x = hsum8(a);
  for (; c < d; ++c) x += q[c] * to_float(k[c]);
  return x;
}

#ifdef QKV_DECODE_AVX2
// ---- int8 K/V on int16 pairs (vpmaddwd: 16 products of int16 pairs summed into 8 exact
// int32 lanes per instruction, then vpaddd). Widening int8 to fp32 took two instructions per
// 8 values ahead of 8 FMAs, and those, on the FP pipes, bound the loop; here the integer
// multiplies do twice the work per instruction. Queries are int16 rows (q ≈ qscale · q16, as
// on VNNI), weights P int16 per row (as pv_i16). |sums| <= d · 32767 · 128 < 2^31 for d <= 128
// and kBlock · 32767 · 128 for P·V.
// Where the CPU has AVX-VNNI (qkv_simd::avxvnni_allowed) one vpdpwssd replaces each
// vpmaddwd + vpaddd (kVnni; a Xeon forced to this level: 1.07-1.18x at 4 query rows per kv
// head, 1.16-1.23x at 16).
#define QKV_I16_AVX2 1
using qkv_simd::dpwssd;

// lane i = Σ of the 8 int32 lanes of a[i], as fp32 (hsum8x8's tree, exact in int32)
static inline __m256 hsum8x8_i32(const __m256i* a) {
  const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                             _mm256_permute2x128_si256(u0, u1, 0x31)));
}

// dots_avx2 for int16 query rows over int8 keys: raw integer scores S[r][j] = q16_r · k_j (as
// fp32), d a multiple of 64 (one line of each key per iteration, its prefetch first).
template <int kR, int kJ, bool kPf, bool kVnni>
[[gnu::noinline]] static void dots_i16_avx2(const int16_t* q, int64_t qs, const int8_t* kp,
                                            int64_t ks, int64_t d, int64_t nj, float* S,
                                            int64_t ldS, const int8_t* pf) {
  static_assert(kR * kJ == 8);
  __m256i a[8];
  for (int64_t j0 = 0; j0 < nj; j0 += kJ) {
    const int8_t* kr = kp + j0 * ks;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
    for (int64_t c = 0; c < d; c += 64) {
      if constexpr (kPf)
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j) pf_line(pf + (j0 + j) * ks + c);
#pragma GCC unroll 4
      for (int64_t u = c; u < c + 64; u += 16) {
        __m256i kv[kJ];
#pragma GCC unroll 8
        for (int j = 0; j < kJ; ++j)
          kv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr + j * ks + u)));
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r) {
          __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * qs + u));
          asm("" : "+x"(qv));  // one load per row and step
#pragma GCC unroll 8
          for (int j = 0; j < kJ; ++j)
            dpwssd<kVnni>(a[r * kJ + j], qv, kv[j]);
        }
      }
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8x8_i32(a));  // lane r·kJ + j: row r, key j0 + j
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) std::memcpy(S + r * ldS + j0, t + r * kJ, kJ * sizeof(float));
  }
}

template <int kR, int kJ, bool kPf>
static void dots_avx2(const int16_t* q, int64_t qs, const int8_t* kp, int64_t ks, int64_t d,
                      int64_t nj, float* S, int64_t ldS, const int8_t* pf) {
  qkv_simd::with_avxvnni([&](auto kVnni) {
    dots_i16_avx2<kR, kJ, kPf, decltype(kVnni)::value>(q, qs, kp, ks, d, nj, S, ldS, pf);
  });
}

// q16 · k over d values, exact in int32 (a leftover key of a tile)
static inline float dot_avx2(const int16_t* q, const int8_t* k, int64_t d) {
  int32_t x = 0;
  for (int64_t c = 0; c < d; ++c) x += int32_t(q[c]) * k[c];
  return static_cast<float>(x);
}
#endif  // QKV_DECODE_AVX2

// Raw scores of R query rows for the nt keys of a tile into S (row stride ldS): fp32 queries
// over keys of any dtype, or (the avx2 level) int16 queries over int8 keys; the same keys of
// a later tile (pf, or nullptr) are prefetched into L2, one line per 64 bytes.
template <typename Q, typename T>
static void scores_avx2(const Q* q, int64_t qs, int64_t R, const T* kp, int64_t ks,
                        int64_t d, int64_t nt, float* S, int64_t ldS, const T* pf) {
  // blocks of kR rows by kJ keys over the tile's first nt / kJ · kJ keys (the first row block
  // prefetches pf's keys), then the keys left over one by one
  auto rows = [&](auto kR_, auto kJ_, int64_t r) {
    constexpr int kR = decltype(kR_)::value, kJ = decltype(kJ_)::value;
    const int64_t nj = nt / kJ * kJ;
    if (nj > 0) {
      if (pf && r == 0) dots_avx2<kR, kJ, true>(q + r * qs, qs, kp, ks, d, nj, S + r * ldS, ldS, pf);
      else dots_avx2<kR, kJ, false>(q + r * qs, qs, kp, ks, d, nj, S + r * ldS, ldS, pf);
    }
    for (int64_t j = nj; j < nt; ++j)
      for (int64_t i = r; i < r + kR; ++i) S[i * ldS + j] = dot_avx2(q + i * qs, kp + j * ks, d);
  };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, r);
  for (; r + 2 <= R; r += 2) rows(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{}, r);
  for (; r < R; ++r) rows(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{}, r);
}

// acc[r] += Σ_j p[r][j] v_j for kR rows (p row stride kBlock, acc row stride dvp) and nj
// value rows (stride vs), columns [c, c + 16): 2·kR accumulators stay in registers over the
// keys, each value chunk is loaded once for all kR rows.
// kPf: the line of pf's row j that holds columns [c, c + 16) prefetched (once per 64 bytes).
template <int kR, bool kPf, typename T>
[[gnu::noinline]] static void pv_avx2(const T* vp, int64_t vs, int64_t c, const float* p,
                                      float* o, int64_t dvp, int64_t nj, const T* pf) {
  // every loop over a unrolled: else GCC keeps a on the stack and stores all of it on each
  // key (8 stores per 8 FMAs: pv ran at half speed)
  __m256 a[kR][2];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
    a[r][0] = _mm256_loadu_ps(o + r * dvp + c), a[r][1] = _mm256_loadu_ps(o + r * dvp + c + 8);
  for (int64_t j = 0; j < nj; ++j) {
    if constexpr (kPf) pf_line(pf + j * vs + c);
    const __m256 v0 = load8(vp + j * vs + c), v1 = load8(vp + j * vs + c + 8);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kBlock + j);
      a[r][0] = _mm256_fmadd_ps(v0, w, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(v1, w, a[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
    _mm256_storeu_ps(o + r * dvp + c, a[r][0]), _mm256_storeu_ps(o + r * dvp + c + 8, a[r][1]);
}

// acc += P V for the nj value rows of a tile (vp, stride vs; pf: the same rows of a later
// tile, prefetched), all R rows, dv columns (the last dv % 16 in scalar code)
template <typename T>
static void pv_tile_avx2(const T* vp, int64_t vs, int64_t dv, const float* p, int64_t R,
                         float* acc, int64_t dvp, int64_t nj, const T* pf) {
  const int64_t d16 = dv / 16 * 16;
  for (int64_t c = 0; c < d16; c += 16) {
    // the first row block of the column chunks that start a 64-byte line prefetches it
    const bool line = pf && (c * int64_t(sizeof(T))) % 64 == 0;
    int64_t r = 0;
    auto run = [&](auto kR_) {
      constexpr int kR = decltype(kR_)::value;
      if (line && r == 0) pv_avx2<kR, true>(vp, vs, c, p + r * kBlock, acc + r * dvp, dvp, nj, pf);
      else pv_avx2<kR, false>(vp, vs, c, p + r * kBlock, acc + r * dvp, dvp, nj, pf);
      r += kR;
    };
    while (r + 6 <= R) run(std::integral_constant<int, 6>{});
    while (r + 4 <= R) run(std::integral_constant<int, 4>{});
    while (r + 2 <= R) run(std::integral_constant<int, 2>{});
    while (r < R) run(std::integral_constant<int, 1>{});
  }
  if (d16 < dv)  // the columns past d16 (fewer than 16), and the lines of pf that hold them
    for (int64_t j = 0; j < nj; ++j) {
      if (pf) pf_line(pf + j * vs + d16), pf_line(pf + j * vs + dv - 1);
      for (int64_t r = 0; r < R; ++r) {
        const float w = p[r * kBlock + j];
        float* o = acc + r * dvp;
        for (int64_t c = d16; c < dv; ++c) o[c] += w * to_float(vp[j * vs + c]);
      }
    }
}

// The weights P (R rows of kBlock, >= 0) of one block as int16 for P·V on int16 pairs: row r
// as w · wscale[r] (at most 1/65534 of the row's largest weight off), words in key order,
// pairs[r][i] = (w_2i, w_2i+1). The VNNI and the avx2 level's int8 loops both take it.
static void weights_i16(const float* P, int64_t R, int32_t (*pairs)[kBlock / 2], float* wscale) {
  for (int64_t r = 0; r < R; ++r) {
    const float* p = P + r * kBlock;
    __m256 mx = _mm256_loadu_ps(p);
    for (int64_t j = 8; j < kBlock; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(p + j));
    const float m = hmax8(mx);
    wscale[r] = m / 32767.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int64_t j = 0; j < kBlock; j += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), inv));
      // packs works per 128-bit lane: 64-bit quarters 0, 2, 1, 3 put the words in order
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r] + j / 2), w);
    }
  }
}

#endif  // QKV_AVX2

#ifdef QKV_DECODE_AVX2
// The 16 bf16 keys of a tile (rows ks apart) as fp32 rows d apart; pf: the same keys of a
// later tile, prefetched line by line as they are read
static void widen_tile_avx2(const BFloat16* kp, int64_t ks, int64_t d, float* out,
                            const BFloat16* pf) {
  for (int64_t j = 0; j < kTile; ++j) {
    const BFloat16* k = kp + j * ks;
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
      if (pf && c % 32 == 0) pf_line(pf + j * ks + c);
      _mm256_storeu_ps(out + j * d + c, load8(k + c));
    }
    for (; c < d; ++c) out[j * d + c] = to_float(k[c]);
    if (pf && d % 32) pf_line(pf + j * ks + d - 1);
  }
}

// 8 vectors of 8 -> their transpose: r[i][k] becomes r[k][i]
static inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Raw scores of fp32 keys for many query rows (arithmetic-bound), by broadcasts: for 4 keys
// (rows ks apart) and kG groups of 8 query rows, out[4g + j] (lanes: rows 8g..8g+7) =
// Σ_c K[j][c] · Qᵀ[c][8g..8g+7]. One broadcast of K[j][c] serves 8·kG rows and no sum across
// lanes is needed (dots_avx2 sums its 8 accumulators across lanes for every 4 rows x 2 keys).
// Qᵀ: d x Rp, packed per segment. kPf: the 4 keys of pf prefetched into L2, line L of key j
// at step c = 16 L + 4 j (one prefetch per 4 steps, spread over the arithmetic).
template <int kG, bool kPf>
[[gnu::noinline]] static void qk_bcast_avx2(const float* qt, int64_t Rp, const float* kr,
                                            int64_t ks, int64_t d, const float* pf, __m256* out) {
  __m256 acc[kG * 4];
#pragma GCC unroll 8
  for (int i = 0; i < kG * 4; ++i) acc[i] = _mm256_setzero_ps();
  const float* k[4] = {kr, kr + ks, kr + 2 * ks, kr + 3 * ks};
  for (int64_t c = 0; c < d; ++c) {
    if constexpr (kPf)
      if (c % 4 == 0) pf_line(pf + (c / 4 % 4) * ks + c / 16 * 16);
    __m256 qv[kG];
#pragma GCC unroll 4
    for (int g = 0; g < kG; ++g) {
      qv[g] = _mm256_loadu_ps(qt + c * Rp + 8 * g);
      asm("" : "+x"(qv[g]));  // one load per step (GCC would fold it into each FMA)
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_broadcast_ss(k[j] + c);
#pragma GCC unroll 4
      for (int g = 0; g < kG; ++g) acc[4 * g + j] = _mm256_fmadd_ps(kv, qv[g], acc[4 * g + j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kG * 4; ++i) out[i] = acc[i];
}

// Raw scores of R query rows for the 16 keys of a full tile (rows ks apart) into S (row stride
// ldS), by qk_bcast_avx2: pairs of 8-row groups (8 accumulators; 3 groups, 12 accumulators,
// left GCC too few registers and ran 1.5x slower), 8 keys at a time, transposed to rows of 8
// keys. Rows past R (Qᵀ's zero padding) are not stored. pf: the same keys of a later tile,
// prefetched by the first pass.
static void scores_bcast_avx2(const float* qt, int64_t R, int64_t Rp, int64_t d, const float* kp,
                              int64_t ks, float* S, int64_t ldS, const float* pf) {
  for (int64_t g = 0; g < Rp / 8; g += 2) {
    const bool two = g + 1 < Rp / 8;
    for (int64_t j0 = 0; j0 < kTile; j0 += 8) {
      __m256 x[2][8];  // x[h][4e + j]: row group g + e, key j0 + 4h + j
      for (int h = 0; h < 2; ++h) {
        const float* kr = kp + (j0 + 4 * h) * ks;
        const float* q = qt + 8 * g;
        if (pf && g == 0) {
          const float* p = pf + (j0 + 4 * h) * ks;
          if (two) qk_bcast_avx2<2, true>(q, Rp, kr, ks, d, p, x[h]);
          else qk_bcast_avx2<1, true>(q, Rp, kr, ks, d, p, x[h]);
        } else if (two) {
          qk_bcast_avx2<2, false>(q, Rp, kr, ks, d, nullptr, x[h]);
        } else {
          qk_bcast_avx2<1, false>(q, Rp, kr, ks, d, nullptr, x[h]);
        }
      }
      for (int e = 0; e < (two ? 2 : 1); ++e) {  // row group g + e: its 8 keys, transposed
        __m256 t[8];
        for (int j = 0; j < 4; ++j) t[j] = x[0][4 * e + j], t[4 + j] = x[1][4 * e + j];
        transpose8(t);  // t[i]: the 8 keys' scores of row 8(g + e) + i
        for (int64_t i = 0; i < 8 && 8 * (g + e) + i < R; ++i)
          _mm256_storeu_ps(S + (8 * (g + e) + i) * ldS + j0, t[i]);
      }
    }
  }
}

// acc[r] += P V for kR rows, columns [c, c + 16), from the int16 weight pairs w (row stride
// kBlock / 2) of one block of int8 value rows vr (zero rows past its keys): rows 2i, 2i + 1
// interleaved byte by byte (vpunpck{l,h}bw) and widened to int16 pairs, so one vpmaddwd adds
// p_2i·v_2i + p_2i+1·v_2i+1 for 8 columns, in order. kPf: every line of pf's rows (pfs
// apart) prefetched, two rows per step.
template <int kR, bool kPf, bool kVnni>
[[gnu::noinline]] static void pv_i16_rows_avx2(const int8_t* const* vr, int64_t c,
                                               const int32_t* w, const float* wscale, float* o,
                                               int64_t dvp, const int8_t* pf, int64_t pfs) {
  __m256i a[kR][2];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
  for (int64_t jp = 0; jp < kBlock / 2; ++jp) {
    if constexpr (kPf)
      for (int64_t b = 2 * jp * pfs; b < (2 * jp + 2) * pfs; b += 64) pf_line(pf + b);
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[2 * jp] + c));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[2 * jp + 1] + c));
    const __m256i v0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));  // columns c..c+7
    const __m256i v1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));  // c+8..c+15
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m256i p = _mm256_set1_epi32(w[r * (kBlock / 2) + jp]);
      dpwssd<kVnni>(a[r][0], p, v0);
      dpwssd<kVnni>(a[r][1], p, v1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r) {
    const __m256 s = _mm256_set1_ps(wscale[r]);
    float* orow = o + r * dvp + c;
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(orow + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), s,
                                                     _mm256_loadu_ps(orow + 8 * h)));
  }
}

// acc += P V for one block of int8 value rows (vr[j]: row of key j, its scale folded into P;
// zero rows past the block's keys), R < kWidenRows rows, dv a multiple of 16: P quantized per
// row to int16 (at most 1/65534 of the row's largest weight), then pv_i16_rows_avx2 on 16
// columns at a time. pf: the rows (pfs apart) of a later block, prefetched by the first pass.
template <bool kVnni>
static void pv_i16_avx2(const int8_t* const* vr, int64_t dv, const float* P, int64_t R,
                        float* acc, int64_t dvp, const int8_t* pf, int64_t pfs) {
  alignas(32) int32_t pairs[kWidenRows][kBlock / 2];  // (w_2i, w_2i+1) as int16 pairs
  float wscale[kWidenRows];
  weights_i16(P, R, pairs, wscale);
  for (int64_t c = 0; c < dv; c += 16) {
    int64_t r = 0;
    auto run = [&](auto kR_) {
      constexpr int kR = decltype(kR_)::value;
      const int32_t* w = pairs[r];
      float* o = acc + r * dvp;
      if (pf && c == 0 && r == 0) pv_i16_rows_avx2<kR, true, kVnni>(vr, c, w, wscale + r, o, dvp, pf, pfs);
      else pv_i16_rows_avx2<kR, false, kVnni>(vr, c, w, wscale + r, o, dvp, pf, pfs);
      r += kR;
    };
    while (r + 4 <= R) run(std::integral_constant<int, 4>{});
    while (r + 2 <= R) run(std::integral_constant<int, 2>{});
    while (r < R) run(std::integral_constant<int, 1>{});
  }
}
#endif  // QKV_DECODE_AVX2

// The column order of pv_pairs back to the natural one, in each 32-column chunk of acc's rows.
static inline void unpermute_pairs(float* acc, int64_t R, int64_t dvp) {
  float tmp[32];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < dvp; c += 32) {
      float* a = acc + r * dvp + c;
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 4; ++i) tmp[8 * L + i] = a[4 * L + i], tmp[8 * L + 4 + i] = a[16 + 4 * L + i];
      std::memcpy(a, tmp, sizeof(tmp));
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

// Online softmax over one block of scores S (rows of kBlock, log2 units, -inf where not
// visible): P = 2^(S - m), l += sum P, acc (row stride dvp) rescaled where m grows. kBf16P:
// P in bf16 (for vdpbf16ps and AMX tiles; l keeps the exact sum: the lse), else fp32.
template <bool kBf16P>
static inline void softmax_block(const float* S, float* P, int64_t R, float* m, float* l,
                                 float* acc, int64_t dvp) {
  for (int64_t r = 0; r < R; ++r) {
    const float* s = S + r * kBlock;
    float* p = P + r * kBlock;
    float bm = kNegInf;
#ifdef QKV_AVX512
    __m512 vm = _mm512_loadu_ps(s);
    for (int64_t j = 16; j < kBlock; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
    bm = _mm512_reduce_max_ps(vm);
#elif defined(QKV_DECODE_AVX2)
    __m256 vm = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < kBlock; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    bm = hmax8(vm);
#else
    for (int64_t j = 0; j < kBlock; ++j) bm = s[j] > bm ? s[j] : bm;
#endif
    // vmaxps drops a NaN: a block whose visible scores are all NaN looks empty here; look
    // again (rare: only blocks with no finite visible score), a NaN makes the row NaN
    if (bm == kNegInf)
      for (int64_t j = 0; j < kBlock; ++j)
        if (std::isnan(s[j])) bm = std::numeric_limits<float>::quiet_NaN();
    if (bm == kNegInf) {  // nothing visible in this block
      if constexpr (kBf16P)
        std::memset(reinterpret_cast<BFloat16*>(P) + r * kBlock, 0, kBlock * sizeof(BFloat16));
      else
        std::memset(p, 0, kBlock * sizeof(float));
      continue;
    }
    if (m[r] == kNegInf) {
      m[r] = bm;  // acc and l are still 0
    } else if (bm > m[r] + kLazy) {
      const float alpha = exp2_neg(m[r] - bm);
      m[r] = bm;
      l[r] *= alpha;
      float* o = acc + r * dvp;
      for (int64_t c = 0; c < dvp; ++c) o[c] *= alpha;
    }
    const float mr = m[r];
#ifdef QKV_AVX512
    __m512 vs = _mm512_setzero_ps();
    const __m512 vmr = _mm512_set1_ps(mr), ninf = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < kBlock; j += 16) {
      const __m512 x = _mm512_loadu_ps(s + j);
      // unordered: a NaN lane stays visible (its NaN reaches l and the output)
      const __mmask16 vis = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ);
      const __m512 e = exp2_v<false>(_mm512_sub_ps(x, vmr), vis);
      if constexpr (kBf16P) {
        const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(reinterpret_cast<BFloat16*>(P) + r * kBlock + j), eb);
      } else {
        _mm512_storeu_ps(p + j, e);
      }
      vs = _mm512_add_ps(vs, e);
    }
    l[r] += _mm512_reduce_add_ps(vs);
#elif defined(QKV_DECODE_AVX2)
    if constexpr (!kBf16P) {  // bf16 P is the AVX512_BF16 path's only
      __m256 vs = _mm256_setzero_ps();
      const __m256 vmr = _mm256_set1_ps(mr);
      for (int64_t j = 0; j < kBlock; j += 8) {
        const __m256 e = exp2_v8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmr));  // -inf: 0
        _mm256_storeu_ps(p + j, e);
        vs = _mm256_add_ps(vs, e);
      }
      l[r] += hsum8(vs);
    }
#else
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      p[j] = s[j] == kNegInf ? 0.f : exp2_neg(s[j] - mr);
      sum += p[j];
    }
    l[r] += sum;
#endif
  }
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

// int8 K/V on int16 pairs (the default where the AVX-512 builds may issue VNNI, and on the
// avx2 level), or widened to fp32: QKV_DECODE_INT8=int16|widen (the tests run both). The
// avx512 build on a CPU without VNNI widens unless told int16 (then vpmaddwd + vpaddd).
static bool int8_on_int16() {
  static const bool on = [] {
    const std::string want = path_setting("QKV_DECODE_INT8", {"auto", "int16", "widen"});
#if defined(QKV_I16_DOTS)
    return want == "int16" || (want == "auto" && qkv_simd::vnni512_allowed());
#elif defined(QKV_I16_AVX2)
    return want != "widen";
#else
    return false;
#endif
  }();
  return on;
}

#ifdef QKV_I16_DOTS

// acc += P V for kR rows, columns [c, c + 64), from the int16 weight pairs w (row stride
// kBlock / 2) of one block of int8 value rows vr (zero rows past its keys), multiplied in
// exact int32 sums by vpdpwssd on key pairs: the rows 2i, 2i + 1 are interleaved byte by byte
// (vpunpck{l,h}bw per 128-bit lane, then widened to int16 pairs), so one instruction adds
// p_2i·v_2i + p_2i+1·v_2i+1 for 16 columns, where widening every value to fp32 took two
// instructions before the FMAs. Lanes of the "lo" half hold columns 0-7 and 16-23 of each
// 32, "hi" 8-15 and 24-31: put back in order when the sums are added to acc. The row count
// is fixed and every loop over the accumulators unrolled, so that they stay in registers
// (with a run-time count GCC kept them on the stack: a load and a store around each
// vpdpwssd). pf: every line of pf's rows (pfs apart) prefetched, two rows per step.
template <int kR, bool kVnni>
[[gnu::noinline]] static void pv_i16_rows(const int8_t* const* vr, int64_t c, const int32_t* w,
                                          const float* wscale, float* o, int64_t dvp,
                                          const int8_t* pf, int64_t pfs) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  __m512i a[kR][4];
#pragma GCC unroll 16
  for (int i = 0; i < kR * 4; ++i) a[i / 4][i % 4] = _mm512_setzero_si512();
  for (int64_t jp = 0; jp < kBlock / 2; ++jp) {
    if (pf)
      for (int64_t b = 2 * jp * pfs; b < (2 * jp + 2) * pfs; b += 64) pf_line(pf + b);
    const int8_t* x = vr[2 * jp] + c;
    const int8_t* y = vr[2 * jp + 1] + c;
    __m512i v[4];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h));
      const __m256i ya = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32 * h));
      v[2 * h] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(xa, ya));
      v[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(xa, ya));
    }
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      const __m512i p = _mm512_set1_epi32(w[r * (kBlock / 2) + jp]);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) qkv_simd::dpwssd<kVnni>(a[r][u], p, v[u]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r) {
    float* orow = o + r * dvp + c;
    const __m512 s = _mm512_set1_ps(wscale[r]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 lo = _mm512_cvtepi32_ps(a[r][2 * h]), hi = _mm512_cvtepi32_ps(a[r][2 * h + 1]);
      float* oh = orow + 32 * h;
      _mm512_storeu_ps(oh, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), s, _mm512_loadu_ps(oh)));
      _mm512_storeu_ps(oh + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), s, _mm512_loadu_ps(oh + 16)));
    }
  }
}

// acc += P V for one block of int8 value rows (vr[j]: row of key j, its scale already folded
// into P, zero rows past the block's keys), P quantized per row to int16 (at most 1/65534 of
// the row's largest weight), then pv_i16_rows on blocks of up to 4 rows x 64 columns. Needs
// dv a multiple of 64. pf: the rows (pfs apart) of the block two ahead, prefetched into L2
// over the first pass, or nullptr.
template <bool kVnni>
static void pv_i16(const int8_t* const* vr, int64_t dv, const float* P, int64_t R, float* acc,
                   int64_t dvp, const int8_t* pf, int64_t pfs) {
  alignas(64) int32_t pairs[kWidenRows][kBlock / 2];  // (w_2i, w_2i+1) as int16 pairs
  float wscale[kWidenRows];
  weights_i16(P, R, pairs, wscale);
  for (int64_t c = 0; c < dv; c += 64)
    for (int64_t r = 0; r < R; r += 4) {
      const int8_t* f = c == 0 && r == 0 ? pf : nullptr;
      const int32_t* w = pairs[r];
      float* o = acc + r * dvp;
      switch (std::min<int64_t>(4, R - r)) {
        case 4: pv_i16_rows<4, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        case 3: pv_i16_rows<3, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        case 2: pv_i16_rows<2, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
        default: pv_i16_rows<1, kVnni>(vr, c, w, wscale + r, o, dvp, f, pfs); break;
      }
    }
}
#endif

#if defined(QKV_I16_DOTS) || defined(QKV_I16_AVX2)
// P·V of a block of int8 value rows on int16 pairs: the VNNI loops (columns in chunks of 64)
// or the avx2 level's (chunks of 16); pair_op names the instruction (native_status)
#ifdef QKV_I16_DOTS
constexpr int64_t kPairCols = 64;
static const char* pair_op() {
#ifdef QKV_VNNI512
  return "vpdpwssd";
#else
  return qkv_simd::vnni512_allowed() ? "vpdpwssd, AVX512_VNNI" : "vpmaddwd";
#endif
}
#else
constexpr int64_t kPairCols = 16;
static const char* pair_op() { return qkv_simd::avxvnni_allowed() ? "vpdpwssd, AVX-VNNI" : "vpmaddwd"; }
#endif
static inline void pv_int16_pairs(const int8_t* const* vr, int64_t dv, const float* P, int64_t R,
                                  float* acc, int64_t dvp, const int8_t* pf, int64_t pfs) {
#ifdef QKV_I16_DOTS
  qkv_simd::with_vnni512([&](auto kVnni) { pv_i16<decltype(kVnni)::value>(vr, dv, P, R, acc, dvp, pf, pfs); });
#else
  qkv_simd::with_avxvnni([&](auto kVnni) { pv_i16_avx2<decltype(kVnni)::value>(vr, dv, P, R, acc, dvp, pf, pfs); });
#endif
}
#endif

// -------------------------------------------------------------------------------------------
// One segment: kv head n, keys [k0, k1). Leaves m (log2 units), l and the unnormalised acc
// (R x dvp, zeroed by the caller) of every row.
// kDot: bf16 K/V through vdpbf16ps (kPairs), else widened to fp32 for FMAs
template <typename T, bool kDot>
static void run_segment(const Problem<T>& P, int64_t n, int64_t k0, int64_t k1, float* m,
                        float* l, float* acc, int64_t dvp, const Scratch& sc, bool fresh = true) {
  const int64_t R = P.R, d = P.d, dv = P.dv;
  const int64_t dqp = (d + 31) / 32 * 32;  // q row stride in the scratch
  // the query rows of this head, unscaled: fp32 (bf16 pairs for the bf16 dot products)
  const QueryT<T>* Q = P.q + n * R * d;
  constexpr bool kBf16Dot = kDot;
  // the keys / values of the tile `ahead` keys after the nt at kt, prefetched while those are
  // read: only for a full tile that is not gathered and whose later tile lies in [k0, k1)
  [[maybe_unused]] auto k_ahead = [&](int64_t kt, int64_t nt, int64_t ahead) -> const T* {
    return nt == kTile && !P.rows && kt + ahead + kTile <= k1 ? P.krow(n, kt + ahead) : nullptr;
  };
  [[maybe_unused]] auto v_ahead = [&](int64_t kt, int64_t nt, int64_t ahead) -> const T* {
    return nt == kTile && !P.rows && kt + ahead + kTile <= k1 ? P.vrow(n, kt + ahead) : nullptr;
  };
  const float c2 = P.c2;
  const int64_t Rp = (R + kBcastPad - 1) / kBcastPad * kBcastPad;  // Qᵀ's row length
  const bool bcast = sc.qt != nullptr;
  // int8 keys with d = 64 or 128: the queries as int16 rows (each q ≈ qscale[r] · q16, an
  // error of at most 1/65534 of the row's largest |q|) for integer dot products
#if defined(QKV_I16_DOTS) || defined(QKV_I16_AVX2)
  bool i16 = kInt8<T> && (d == 64 || d == 128) && int8_on_int16();
  // a NaN or inf in a query takes the fp32 scores (an int16 row cannot hold it: each of its
  // logits must come out as IEEE gives it, NaN, +inf or -inf by the key's sign)
  if (i16)
    for (int64_t i = 0; i < R * d && i16; ++i) i16 = std::isfinite(to_float(Q[i]));
#else
  constexpr bool i16 = false;
#endif
  int16_t* q16 = reinterpret_cast<int16_t*>(sc.qf);  // rows dqp apart, then R scales
  float* qscale = sc.qf + R * dqp / 2;
  // the query rows, key ranges and running state of head n: set up once per segment (a
  // widened run after the first carries on with them: run_segment_widened)
  if (fresh) {
    for (int64_t r = 0; r < R; ++r) {
      if constexpr (kBf16Dot) {
        BFloat16* qb = reinterpret_cast<BFloat16*>(sc.qf) + r * dqp;
        std::memcpy(qb, Q + r * d, d * sizeof(T));
        std::memset(qb + d, 0, (dqp - d) * sizeof(T));
      } else if (i16) {
        const QueryT<T>* qr = Q + r * d;
        float amax = 0.f;
        for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(to_float(qr[c])));
        const float sq = amax / 32767.f;
        qscale[r] = sq;
        int16_t* o = q16 + r * dqp;
        for (int64_t c = 0; c < d; ++c)
          o[c] = sq > 0.f ? static_cast<int16_t>(std::nearbyint(to_float(qr[c]) / sq)) : int16_t(0);
        for (int64_t c = d; c < dqp; ++c) o[c] = 0;
      } else {
        float* qf = sc.qf + r * dqp;
        for (int64_t c = 0; c < d; ++c) qf[c] = to_float(Q[r * d + c]);
        for (int64_t c = d; c < dqp; ++c) qf[c] = 0.f;
      }
    }
    row_ranges(P, n, sc);
    for (int64_t r = 0; r < R; ++r) m[r] = kNegInf, l[r] = 0.f;
    if constexpr (kInt8<T>) std::memset(sc.vtile, 0, dv);  // pv_i16's zero row
    if (bcast)  // Qᵀ, rows padded with zeros
      for (int64_t c = 0; c < d; ++c)
        for (int64_t r = 0; r < Rp; ++r) sc.qt[c * Rp + r] = r < R ? to_float(Q[r * d + c]) : 0.f;
  }

  for (int64_t kb = k0; kb < k1; kb += kBlock) {
    const int64_t nk = std::min(kBlock, k1 - kb);
    // ---- scores S (R x kBlock) in log2 units, -inf where not visible
    for (int64_t t0 = 0; t0 < kBlock; t0 += kTile) {
      const int64_t nt = std::clamp<int64_t>(nk - t0, 0, kTile);
      if (nt == 0) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < kTile; ++j) sc.S[r * kBlock + t0 + j] = kNegInf;
        continue;
      }
      const int64_t kt = kb + t0;
      const T* kp = P.krow(n, kt);
      int64_t ks = P.k2s;
      if (nt < kTile || P.rows) {  // a partial or gathered tile: its rows copied (the
        // scores after them are -inf whatever the rows hold: old, finite contents stay)
        T* buf = static_cast<T*>(sc.ktile);
        const int64_t len = P.krow_len();  // int8: the scale comes along
        for (int64_t j = 0; j < nt; ++j) copy_row(buf + j * len, P.krow(n, kt + j), len);
        kp = buf, ks = len;
      }
      // int8 keys: score = scale_j · (q · k_j); c2 · scale_j per key of the tile
      [[maybe_unused]] float kscale[kTile];
      if constexpr (kInt8<T>)
        for (int64_t j = 0; j < kTile; ++j) kscale[j] = j < nt ? c2 * row_scale(kp + j * ks, d) : 0.f;
#ifdef QKV_AVX512
      // The same tile two blocks ahead, prefetched into L2 while this one is read (the
      // first query row's loop issues one prefetch per line it loads). Measured on a loaded
      // 2-core Zen 4, Tk = 16384, Tq = 1, 1 thread, CPU time, GB/s of K+V (fp32 / bf16):
      // no prefetch 6-7; bursts of a whole tile into L1 6-7, into L2 9-12; spread one block
      // ahead 12.5-14; two blocks 13-15.6; four blocks 9-13.
      const T* kpf = k_ahead(kt, nt, 2 * kBlock);
#endif
#ifdef QKV_AVX512
      if constexpr (std::is_same_v<T, float>)
        if (bcast && ks == d) {
          scores_bcast(sc.qt, R, Rp, d, kp, kpf, kt, nt, t0, sc, c2);
          continue;
        }
      // fp32 keys, fewer rows than the broadcasts take: on CPUs where they keep DRAM streaming
      // better (fp32_path), the AVX2 loops: a 64-byte line of 2 keys for 4 rows per step,
      // prefetched kAvx2Ahead keys ahead
      bool raw = false;
      if constexpr (std::is_same_v<T, float>)
        if (P.lines) {
          scores_avx2(sc.qf, dqp, R, kp, ks, d, nt, sc.S + t0, kBlock,
                      k_ahead(kt, nt, kAvx2Ahead));
          raw = true;
        }
      const T* pf_left = kpf;  // the first dot-product call of the tile prefetches
      __m512 blk[4];
      int64_t blk_r = -1;  // the rows [blk_r, blk_r + 3 or 4) whose scores are in blk
      const int64_t R4 = R / 4 * 4, tail = R - R4 == 3 ? 3 : 0;  // blocks of 4, then one of 3
#endif
#ifdef QKV_DECODE_AVX2
      // raw dot products of every row with the tile's keys (the same keys kAvx2Ahead later
      // prefetched); visibility and scale below
      const T* kpf = k_ahead(kt, nt, kAvx2Ahead);
      // many rows, a full tile: by broadcasts; bf16 keys widened to fp32 once for all rows
      // (a tile read from the cache itself, so the scratch is free for them); int8 keys with
      // int16 queries: integer dot products. scored: the tile's raw scores are in S
      bool scored = false;
      if constexpr (std::is_same_v<T, float>)
        if (bcast && nt == kTile) {
          scores_bcast_avx2(sc.qt, R, Rp, d, kp, ks, sc.S + t0, kBlock, kpf);
          scored = true;
        }
      if constexpr (std::is_same_v<T, BFloat16>)
        if (bcast && nt == kTile && !P.rows) {
          float* kw = static_cast<float*>(sc.ktile);  // kTile x d fp32
          widen_tile_avx2(kp, ks, d, kw, kpf);
          scores_bcast_avx2(sc.qt, R, Rp, d, kw, d, sc.S + t0, kBlock, nullptr);
          scored = true;
        }
      if constexpr (kInt8<T>)
        if (i16) {
          scores_avx2(q16, dqp, R, kp, ks, d, nt, sc.S + t0, kBlock, kpf);
          scored = true;
        }
      if (!scored) scores_avx2(sc.qf, dqp, R, kp, ks, d, nt, sc.S + t0, kBlock, kpf);
#endif
      for (int64_t r = 0; r < R; ++r) {
        const int64_t a = std::clamp<int64_t>(sc.lo[r] - kt, 0, nt);
        const int64_t b = std::clamp<int64_t>(sc.hi[r] - kt, 0, nt);
        float* s = sc.S + r * kBlock + t0;
        const uint8_t* mr = sc.mrow[r];
#ifdef QKV_AVX512
        __mmask16 vis = __mmask16(lanes(b) & ~lanes(a));
        if (mr && vis) vis = mask_bits(mr + kt, vis);
        if (!vis) {
          _mm512_storeu_ps(s, _mm512_set1_ps(kNegInf));
          continue;
        }
        __m512 x;
        if (raw) {  // the row's raw scores, scaled; -inf where not visible
          x = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), vis, _mm512_loadu_ps(s), _mm512_set1_ps(c2));
          _mm512_storeu_ps(s, x);
          continue;
        }
#ifdef QKV_I16_DOTS
        if constexpr (kInt8<T>)
          if (i16) {  // blocks of up to 4 rows, each computed at its first visible row
            const int64_t b0 = r / 4 * 4;
            if (blk_r != b0) {
              qk_rows_i16(std::min<int64_t>(4, R - b0), q16 + b0 * dqp, dqp, kp, ks, d, pf_left, blk);
              blk_r = b0, pf_left = nullptr;
            }
            const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(kscale), _mm512_set1_ps(qscale[r]));
            _mm512_storeu_ps(s, _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), vis, blk[r - b0], sv));
            continue;
          }
#endif
        const int64_t r0 = r < R4 ? r / 4 * 4 : R4, nr = r < R4 ? 4 : tail;
        const void* q0 = kBf16Dot ? static_cast<const void*>(reinterpret_cast<const BFloat16*>(sc.qf) + r0 * dqp)
                                  : static_cast<const void*>(sc.qf + r0 * dqp);
        if (nr && (blk_r == r0 || qk_rows<kDot, T>(nr, q0, dqp, kp, ks, d, pf_left, blk))) {
          if (blk_r != r0) blk_r = r0, pf_left = nullptr;
          x = blk[r - r0];
        } else if constexpr (kBf16Dot) {
          x = qk_tile_bf16(reinterpret_cast<const BFloat16*>(sc.qf) + r * dqp,
                           reinterpret_cast<const BFloat16*>(kp), ks, d,
                           reinterpret_cast<const BFloat16*>(pf_left));
          pf_left = nullptr;
        } else {
          x = qk_tile(sc.qf + r * dqp, kp, ks, d, pf_left);
          pf_left = nullptr;
        }
        const __m512 c2v = kInt8<T> ? _mm512_loadu_ps(kscale) : _mm512_set1_ps(c2);
        x = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), vis, x, c2v);
        _mm512_storeu_ps(s, x);
#elif defined(QKV_DECODE_AVX2)
        const float qs_r = i16 ? qscale[r] : 1.f;  // integer scores: the query's scale
        for (int64_t j = 0; j < kTile; ++j) {
          const bool visible = j >= a && j < b && (!mr || mr[kt + j]);
          if constexpr (kInt8<T>) s[j] = visible ? s[j] * (kscale[j] * qs_r) : kNegInf;
          else s[j] = visible ? s[j] * c2 : kNegInf;
        }
#else
        const float* qf = sc.qf + r * dqp;
        for (int64_t j = 0; j < kTile; ++j) {
          const bool visible = j >= a && j < b && (!mr || mr[kt + j]);
          if (!visible) {
            s[j] = kNegInf;
            continue;
          }
          const T* kr = kp + j * ks;
          float dot = 0.f;
          // in lanes (NEON, SSE2): a sum the compiler may not reorder stays scalar
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < d; ++c) dot += qf[c] * to_float(kr[c]);
          if constexpr (kInt8<T>) s[j] = dot * kscale[j];
          else s[j] = dot * c2;
        }
#endif
      }
    }
    // ---- online softmax over the block
    softmax_block<kBf16Dot>(sc.S, sc.P, R, m, l, acc, dvp);
    // int8 values: acc += Σ_j (p_j · scale_j) v_j, the scales folded into P (l keeps Σ p_j)
    if constexpr (kInt8<T>) {
      // the block's value rows: v2s apart unless gathered (krow/vrow divide, so only then)
      const T* vr = P.vrow(n, kb);
      const int8_t* rows[kBlock];
      for (int64_t j = 0; j < nk; ++j) rows[j] = P.rows ? P.vrow(n, kb + j) : vr + j * P.v2s;
      alignas(64) float vscale[kBlock];
      bool finite = true;  // a row stored with a NaN or inf has scale NaN (qkv.cache)
      for (int64_t j = 0; j < nk; ++j) {
        vscale[j] = row_scale(rows[j], dv);
        finite &= std::isfinite(vscale[j]);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < nk; ++j) sc.P[r * kBlock + j] *= vscale[j];
#if defined(QKV_I16_DOTS) || defined(QKV_I16_AVX2)
      // P·V in int16 pairs; a block with a non-finite row takes the fp32 loops below, where
      // w · NaN is NaN (rounded to int16, a NaN weight would become a finite number)
      if (finite && dv % kPairCols == 0 && dv > 0 && int8_on_int16()) {
        const int8_t* zero = static_cast<const int8_t*>(sc.vtile);  // zeroed per segment
        for (int64_t j = nk; j < kBlock; ++j) rows[j] = zero;  // keys past nk: weight 0
        const bool ahead = !P.rows && kb + 3 * kBlock <= k1;
        pv_int16_pairs(rows, dv, sc.P, R, acc, dvp, ahead ? P.vrow(n, kb + 2 * kBlock) : nullptr, P.v2s);
        continue;
      }
#endif
    }
    // ---- acc += P V over the block: with many rows (arithmetic-bound) at once where its
    // value rows are evenly spaced, so each accumulator block is loaded and stored once per
    // block (Tk = 16384, Tq = 16, fp32, 1 thread: 5 % faster, same process); else one tile of
    // 16 value rows at a time (with few rows the per-tile order of the prefetches read ~3 %
    // faster from DRAM)
#ifdef QKV_AVX512
    if (!kBf16Dot && R >= kBcastMinRows && nk == kBlock && !P.rows) {
      const T* vpf = kb + 3 * kBlock <= k1 ? P.vrow(n, kb + 2 * kBlock) : nullptr;
      pv_spread(P.vrow(n, kb), P.v2s, dv, sc.P, R, acc, dvp, vpf);
      continue;
    }
#elif defined(QKV_DECODE_AVX2)
    if (!kInt8<T> && bcast && nk == kBlock && !P.rows) {
      const T* vpf = kb + 2 * kBlock <= k1 ? P.vrow(n, kb + kBlock) : nullptr;
      pv_tile_avx2(P.vrow(n, kb), P.v2s, dv, sc.P, R, acc, dvp, kBlock, vpf);
      continue;
    }
#endif
    for (int64_t t0 = 0; t0 < nk; t0 += kTile) {
      const int64_t nt = std::min(kTile, nk - t0), kt = kb + t0;
      const T* vp = P.vrow(n, kt);
      int64_t vs = P.v2s;
      if (nt < kTile || P.rows) {
        T* buf = static_cast<T*>(sc.vtile);
        std::memset(static_cast<void*>(buf + nt * dv), 0, (kTile - nt) * dv * sizeof(T));
        for (int64_t j = 0; j < nt; ++j) copy_row(buf + j * dv, P.vrow(n, kt + j), dv);
        vp = buf, vs = dv;
      }
      const float* pt = sc.P + t0;  // P[r][t0 + j] at pt[r * kBlock + j]
#ifdef QKV_AVX512
      // the same value tile two blocks ahead, prefetched into L2 line by line (as the keys)
      const T* vpf = v_ahead(kt, nt, 2 * kBlock);
      if constexpr (std::is_same_v<T, float>)
        if (P.lines) {  // as the scores above
          pv_tile_avx2(vp, vs, dv, pt, R, acc, dvp, nt, v_ahead(kt, nt, kAvx2Ahead));
          continue;
        }
      if constexpr (kBf16Dot) {
        pv_pairs(reinterpret_cast<const BFloat16*>(vp), vs, dv,
                 reinterpret_cast<const BFloat16*>(sc.P) + t0, R, acc, dvp,
                 reinterpret_cast<const BFloat16*>(vpf));
        continue;
      }
      pv_tile(vp, vs, dv, pt, R, acc, dvp, vpf);
#elif defined(QKV_DECODE_AVX2)
      const T* vpf = v_ahead(kt, nt, kAvx2Ahead);
      pv_tile_avx2(vp, vs, dv, pt, R, acc, dvp, nt, vpf);
#else
      for (int64_t j = 0; j < nt; ++j) {
        const T* vr = vp + j * vs;
        for (int64_t r = 0; r < R; ++r) {
          // no skip of a zero weight: an underflowed weight times a NaN value is NaN, as on
          // every level (values at keys no row may see are zeroed before the call)
          const float w = pt[r * kBlock + j];
          float* o = acc + r * dvp;
#pragma omp simd
          for (int64_t c = 0; c < dv; ++c) o[c] += w * to_float(vr[c]);
        }
      }
#endif
    }
  }
  if constexpr (kBf16Dot) unpermute_pairs(acc, R, dvp);
}

// int8 rows with many query rows (beams, drafts: G·Tq >= kWidenRows). The vector loops above
// widen each chunk of K and V once per group of 4 rows, so the widening grows with the rows;
// here each run of kWiden keys is widened once, scales applied, into fp32 scratch and run
// as fp32 (with its loops for many rows), m, l and acc carried from run to run.
constexpr int64_t kWiden = 128;  // keys per widened run: (d + dv) · 512 bytes of scratch

// row = scale · values, in fp32 (as qkv.cache.dequantize_rows)
static inline void widen_row(const int8_t* src, int64_t n, float* dst) {
  const float s = row_scale(src, n);
  int64_t c = 0;
#ifdef QKV_AVX512
  const __m512 sv = _mm512_set1_ps(s);
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(load16(src + c), sv));
  if (c < n) {
    const __mmask16 k = lanes(n - c);
    _mm512_mask_storeu_ps(dst + c, k, _mm512_mul_ps(load16(src + c, k), sv));
    return;
  }
#endif
  for (; c < n; ++c) dst[c] = static_cast<float>(src[c]) * s;
}

static void run_segment_widened(const Problem<int8_t>& P, int64_t n, int64_t k0, int64_t k1,
                                float* m, float* l, float* acc, int64_t dvp, const Scratch& sc,
                                float* kf) {
  const int64_t d = P.d, dv = P.dv;
  float* vf = kf + kWiden * d;
  // the run's rows as an fp32 cache of one head: krow(n, t) = kf + (t - t0) · d
  Problem<float> F{P.N, P.h_kv, P.G, P.Tq, P.R, d, dv, P.Tk, P.q, kf, vf,
                   0, 0, d, 0, 0, dv, P.st, P.mk, P.c2};
  for (int64_t c0 = k0; c0 < k1; c0 += kWiden) {
    const int64_t c1 = std::min(k1, c0 + kWiden);
    const int8_t *kr = P.krow(n, c0), *vr = P.vrow(n, c0);  // rows k2s, v2s apart
    for (int64_t t = c0; t < c1; ++t) {  // (unless gathered: krow/vrow divide, so only then)
      widen_row(P.rows ? P.krow(n, t) : kr + (t - c0) * P.k2s, d, kf + (t - c0) * d);
      widen_row(P.rows ? P.vrow(n, t) : vr + (t - c0) * P.v2s, dv, vf + (t - c0) * dv);
    }
    F.t0 = c0;
    run_segment<float, false>(F, n, c0, c1, m, l, acc, dvp, sc, c0 == k0);
  }
}

// -------------------------------------------------------------------------------------------
// bf16 K/V on AMX tiles (Intel server cores): both products as tile multiplies, which also
// serve many query rows (G·Tq up to 64 and more: beams, drafts) at memory speed, where the
// vector loops above run out of arithmetic. Per block of 64 keys:
//   * Sᵀ = K Qᵀ per tile of 16 keys: K is the A operand, read straight from the cache
//     (16 keys x 32 dims per tile load), Qᵀ the B operand, packed once per segment in
//     pairs of dims (rows of Mt = min(R, 16) queries; more rows in groups of Mt); Sᵀ is
//     transposed back to rows of 16 keys, where visibility and the softmax work as above;
//   * acc += P V: P (bf16 rows of 64 keys) is the A operand; V is the B operand, its key
//     pairs interleaved per 32 columns into a block buffer (the order of pv_pairs, put right
//     by unpermute_pairs at the end); acc (Rpad x dvp) lives in memory and is loaded and
//     stored per tile of 16 columns.
// Needs d and dv multiples of 32. Tiles: 0 Sᵀ, 1 K / V, 2 Qᵀ, 3 and 6 acc, 4 V, 5 and 7 P.
#if defined(QKV_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QKV_AMX 1

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state only on request, once per process (oneDNN asks too).
static bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Rows of the AMX path: groups of Mt query rows, padded to Rpad.
struct AmxRows {
  int64_t Mt, groups, Rpad;
  explicit AmxRows(int64_t R)
      : Mt(std::min<int64_t>(R, 16)), groups((R + Mt - 1) / Mt), Rpad(groups * Mt) {}
};

// Scratch of the AMX path (bytes, 64-aligned): Qᵀ packed, Sᵀ of one tile, P, V of one block.
static inline int64_t amx_scratch_bytes(int64_t R, int64_t d, int64_t dv) {
  const AmxRows g(R);
  return g.Rpad * d * 2 + 4 * 16 * 64 + g.Rpad * kBlock * 2 + kBlock * dv * 2 + kBlock * d * 2 +
         5 * 64;
}

static void run_segment_amx(const Problem<BFloat16>& P, int64_t n, int64_t k0, int64_t k1,
                            float* m, float* l, float* acc, int64_t dvp, const Scratch& sc,
                            char* amx) {
  const int64_t R = P.R, d = P.d, dv = P.dv, nc = d / 32, ct_n = dv / 16;
  const AmxRows g(R);
  const int64_t Mt = g.Mt;
  auto align = [](char* p) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); };
  uint32_t* qt = reinterpret_cast<uint32_t*>(align(amx));  // [group][chunk][pair][row]
  float* st = reinterpret_cast<float*>(align(reinterpret_cast<char*>(qt + g.Rpad * d / 2)));
  BFloat16* pb = reinterpret_cast<BFloat16*>(st + 4 * 16 * 16);  // P: Rpad x kBlock
  uint32_t* vb = reinterpret_cast<uint32_t*>(
      align(reinterpret_cast<char*>(pb + g.Rpad * kBlock)));  // V: [half][col tile][pair][16]
  BFloat16* kbuf = reinterpret_cast<BFloat16*>(align(reinterpret_cast<char*>(vb + kBlock * dv / 2)));
  // Qᵀ in pairs of dims: qt[((grp·nc + c)·16 + p)·Mt + i] = dims (32c + 2p, +1) of row grp·Mt + i
  const uint32_t* Q = reinterpret_cast<const uint32_t*>(P.q + n * R * d);
  for (int64_t grp = 0; grp < g.groups; ++grp)
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t i = 0; i < Mt; ++i) {
          const int64_t r = grp * Mt + i;
          qt[((grp * nc + c) * 16 + p) * Mt + i] = r < R ? Q[r * (d / 2) + c * 16 + p] : 0u;
        }
  std::memset(static_cast<void*>(pb), 0, g.Rpad * kBlock * sizeof(BFloat16));
  row_ranges(P, n, sc);
  for (int64_t r = 0; r < R; ++r) m[r] = kNegInf, l[r] = 0.f;
  TileConfig cfg;
  auto tile = [&](int t, int rows, int colsb) { cfg.rows[t] = rows, cfg.colsb[t] = colsb; };
  tile(0, 16, int(Mt * 4));  // Sᵀ: 16 keys x Mt rows (fp32)
  tile(1, 16, 64);           // K: 16 keys x 32 dims; V: 16 key pairs x 16 columns
  tile(2, 16, int(Mt * 4));  // Qᵀ: 16 dim pairs x Mt rows
  tile(4, 16, 64);           // V, second half of the block
  for (int t : {3, 6}) tile(t, int(Mt), 64);  // acc: Mt rows x 16 columns
  for (int t : {5, 7}) tile(t, int(Mt), 64);  // P: Mt rows x 32 keys
  _tile_loadconfig(&cfg);
  const float c2 = P.c2;
  const int64_t kb_bytes = P.k2s * int64_t(sizeof(BFloat16));

  for (int64_t kb = k0; kb < k1; kb += kBlock) {
    const int64_t nk = std::min(kBlock, k1 - kb);
    // ---- S (R x kBlock), log2 units, -inf where not visible
    // kpf: the same tile two blocks ahead, prefetched into L2 a line per row as each chunk of
    // this one is multiplied (spread over the arithmetic, as the vector path does)
    const BFloat16 *kp[4], *kpf[4] = {};
    int64_t ks[4], jobs = 0;
    for (int64_t t = 0; t < 4; ++t) {
      const int64_t t0 = t * kTile, nt = std::clamp<int64_t>(nk - t0, 0, kTile), kt = kb + t0;
      ks[t] = kb_bytes, kp[t] = nt ? P.krow(n, kt) : nullptr;
      if (nt == 0) {
        for (int64_t r = 0; r < R; ++r)
          _mm512_storeu_ps(sc.S + r * kBlock + t0, _mm512_set1_ps(kNegInf));
        continue;
      }
      jobs = (t + 1) * g.groups;
      if (nt < kTile || P.rows) {  // a partial or gathered tile: its rows copied (keys past
        // nt come out -inf whatever the stale rows hold)
        BFloat16* buf = kbuf + t0 * d;
        for (int64_t j = 0; j < nt; ++j) copy_row(buf + j * d, P.krow(n, kt + j), d);
        kp[t] = buf, ks[t] = d * int64_t(sizeof(BFloat16));
      } else if (kt + 2 * kBlock + kTile <= k1) {
        kpf[t] = P.krow(n, kt + 2 * kBlock);
      }
    }
    // jobs (key tile, row group), up to 4 at once in independent accumulators (tiles 0, 3,
    // 5, 6) when all tiles have one shape (Mt = 16), else one at a time
    const int64_t batch = Mt == 16 ? 4 : 1;
    for (int64_t j0 = 0; j0 < jobs; j0 += batch) {
      const int64_t nj = std::min(batch, jobs - j0);
      auto kq = [&](int64_t slot, int64_t c, const void*& a, int64_t& as, const void*& b) {
        const int64_t t = (j0 + slot) / g.groups, grp = (j0 + slot) % g.groups;
        a = kp[t] + 32 * c, as = ks[t], b = qt + (grp * nc + c) * 16 * Mt;
        if (grp == 0 && kpf[t])
          for (int64_t j = 0; j < kTile; ++j) pf_line(kpf[t] + j * P.k2s + 32 * c);
      };
      _tile_zero(0);
      if (nj > 1) _tile_zero(3);
      if (nj > 2) _tile_zero(5);
      if (nj > 3) _tile_zero(6);
      // job `slot`, chunk c: K into tile A, Qᵀ into tile B, summed into tile C (tile numbers
      // are immediates of the instructions, hence a macro rather than a loop)
#define QKV_S_JOB(slot, A, B, C) \
  kq(slot, c, a, as, b);         \
  _tile_loadd(A, a, as);         \
  _tile_loadd(B, b, Mt * 4);     \
  _tile_dpbf16ps(C, A, B)
      for (int64_t c = 0; c < nc; ++c) {
        const void *a, *b;
        int64_t as;
        QKV_S_JOB(0, 1, 2, 0);
        if (nj < 2) continue;
        QKV_S_JOB(1, 4, 7, 3);
        if (nj < 3) continue;
        QKV_S_JOB(2, 1, 2, 5);
        if (nj < 4) continue;
        QKV_S_JOB(3, 4, 7, 6);
      }
#undef QKV_S_JOB
      _tile_stored(0, st, 64);
      if (nj > 1) _tile_stored(3, st + 256, 64);
      if (nj > 2) _tile_stored(5, st + 512, 64);
      if (nj > 3) _tile_stored(6, st + 768, 64);
      for (int64_t slot = 0; slot < nj; ++slot) {
        const int64_t t = (j0 + slot) / g.groups, grp = (j0 + slot) % g.groups;
        const int64_t t0 = t * kTile, nt = std::min(kTile, nk - t0), kt = kb + t0;
        __m512 x[16];
        for (int j = 0; j < 16; ++j) x[j] = _mm512_loadu_ps(st + 256 * slot + 16 * j);
        transpose16(x);  // x[i]: the 16 keys' scores of row grp·Mt + i
        store_score_rows(x, grp * Mt, Mt, R, kt, nt, t0, sc, c2);
      }
    }
    // ---- online softmax: P in bf16 rows of kBlock keys (rows past R stay 0)
    softmax_block<true>(sc.S, reinterpret_cast<float*>(pb), R, m, l, acc, dvp);
    // ---- V of the block, key pairs interleaved (rows past nk: zeros, as their P)
    const bool pf_v = nk == kBlock && !P.rows && kb + 3 * kBlock <= k1;
    const bool two = nk > 32;  // keys in the block's second half
    for (int64_t jp = 0; jp < (two ? kBlock / 2 : 16); ++jp) {
      const int64_t j = 2 * jp, half = jp / 16, p = jp % 16;
      const BFloat16* x0 = j < nk ? P.vrow(n, kb + j) : nullptr;
      const BFloat16* x1 = j + 1 < nk ? P.vrow(n, kb + j + 1) : nullptr;
      if (pf_v) {
        const char* f0 = reinterpret_cast<const char*>(P.vrow(n, kb + 2 * kBlock + j));
        const int64_t vbytes = P.v2s * int64_t(sizeof(BFloat16));
        for (int64_t c = 0; c < dv * 2; c += 64) pf_line(f0 + c), pf_line(f0 + vbytes + c);
      }
      for (int64_t c = 0; c < dv; c += 32) {
        const __m512i a = x0 ? _mm512_loadu_si512(x0 + c) : _mm512_setzero_si512();
        const __m512i b = x1 ? _mm512_loadu_si512(x1 + c) : _mm512_setzero_si512();
        const int64_t ct = c / 16;  // lo half -> tile ct, hi half -> ct + 1
        _mm512_storeu_si512(vb + ((half * ct_n + ct) * 16 + p) * 16, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(vb + ((half * ct_n + ct + 1) * 16 + p) * 16, _mm512_unpackhi_epi16(a, b));
      }
    }
    // ---- acc += P V, two tiles of 16 columns at a time
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const BFloat16* pg = pb + grp * Mt * kBlock;
      _tile_loadd(7, pg, kBlock * 2);
      if (two) _tile_loadd(5, pg + 32, kBlock * 2);
      float* og = acc + grp * Mt * dvp;
      for (int64_t ct = 0; ct < ct_n; ct += 2) {
        _tile_loadd(6, og + 16 * ct, dvp * 4);
        _tile_loadd(3, og + 16 * (ct + 1), dvp * 4);
        _tile_loadd(1, vb + ct * 256, 64);
        _tile_loadd(4, vb + (ct + 1) * 256, 64);
        _tile_dpbf16ps(6, 7, 1);
        _tile_dpbf16ps(3, 7, 4);
        if (two) {
          _tile_loadd(1, vb + (ct_n + ct) * 256, 64);
          _tile_loadd(4, vb + (ct_n + ct + 1) * 256, 64);
          _tile_dpbf16ps(6, 5, 1);
          _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(6, og + 16 * ct, dvp * 4);
        _tile_stored(3, og + 16 * (ct + 1), dvp * 4);
      }
    }
  }
  // leave the tiles as oneDNN expects to find them (it keeps its own configuration)
  at::native::cpublas::brgemm_release(true);
  unpermute_pairs(acc, R, dvp);
}
#endif  // AMX

// A contiguous run of one head's keys handled by one thread.
struct Segment {
  int64_t n, k0, k1;
};

// A short segment's K and V rows, fetched while the segment before it runs: with a few keys
// per head (a beam search's first steps, a short source) each head is a new, cold region
// and the kernel otherwise waits on memory latency there (long segments prefetch ahead
// inside run_segment).
template <typename T>
static inline void prefetch_segment(const Problem<T>& P, const Segment& g) {
  if (g.k1 - g.k0 > 2 * kBlock) return;
  const int64_t kb = P.krow_len() * int64_t(sizeof(T)), vb = (P.dv + (kInt8<T> ? 4 : 0)) * int64_t(sizeof(T));
  for (int64_t t = g.k0; t < g.k1; ++t) {
    const char* kr = reinterpret_cast<const char*>(P.krow(g.n, t));
    const char* vr = reinterpret_cast<const char*>(P.vrow(g.n, t));
    for (int64_t c = 0; c < kb; c += 64) __builtin_prefetch(kr + c, 0, 3);
    for (int64_t c = 0; c < vb; c += 64) __builtin_prefetch(vr + c, 0, 3);
  }
}

// splits > 0: cut the keys into exactly that many pieces (the tests' way to exercise the
// merge on small inputs); else one piece per thread, fewer for small calls.
// O: the output's type, T's or float (fp32 queries over a bf16 cache)
// kAmx: bf16 on AMX tiles (run_segment_amx), whose acc has rows padded to whole tiles
template <typename T, typename O, bool kDot, bool kAmx = false>
static void decode_impl(const Problem<T>& P, O* out, float* lse, int64_t splits) {
  const int64_t N = P.N, R = P.R, dv = P.dv;
  const int64_t dvp = kDot || kAmx ? (dv + 31) / 32 * 32 : (dv + 15) / 16 * 16;
  // keys any row may see: [lo(0), hi(Tq - 1)) (lo and hi grow with the row)
  const int64_t lo = P.st.lo(0), hi = P.st.hi(P.Tq - 1), L = std::max<int64_t>(hi - lo, 0);
  const int64_t W = N * L;  // (head, key) pairs
  int64_t nt = 1;
#ifdef _OPENMP
  if (!omp_in_parallel())
    nt = std::clamp<int64_t>(W * R / kMinPairsPerThread, 1, at::get_num_threads());
#endif
  if (splits > 0) nt = splits;
  // thread t takes pairs [W·t/nt, W·(t+1)/nt), cut at tile boundaries and at head ends
  std::vector<Segment> segs;
  std::vector<int64_t> first(nt + 1, 0);  // thread t's segments: [first[t], first[t+1])
  auto cut = [&](int64_t t) {
    const int64_t b = W * t / nt, h = L ? b / L : 0;
    return h * L + (b - h * L) / kTile * kTile;
  };
  for (int64_t t = 0; t < nt; ++t) {
    first[t] = static_cast<int64_t>(segs.size());
    const int64_t e = t + 1 == nt ? W : cut(t + 1);
    for (int64_t pos = cut(t); pos < e;) {
      const int64_t h = pos / L, end = std::min(e, (h + 1) * L);
      segs.push_back({h, lo + pos - h * L, lo + end - h * L});
      pos = end;
    }
  }
  first[nt] = static_cast<int64_t>(segs.size());
  const int64_t S = static_cast<int64_t>(segs.size());
  // every buffer allocated here, before the threads start (nothing throws inside)
  const int64_t dqp = (P.d + 31) / 32 * 32;
  const int64_t qt_at = (R * dqp + 2 * R * kBlock + kTile * (P.d + dv) + 64 + 6 * R + 15) / 16 * 16;
  const bool widen = kInt8<T> && R >= kWidenRows;  // int8: run_segment_widened
#ifdef QKV_AVX512
  const bool bcast = (std::is_same_v<T, float> || widen) && R >= kBcastMinRows &&
                     (P.d == 64 || P.d == 128);
#elif defined(QKV_DECODE_AVX2)
  const bool bcast = (!kInt8<T> || widen) && R >= kBcastMinRows;
#else
  const bool bcast = false;  // the broadcast scores are vector code
#endif
  const int64_t Rp = (R + kBcastPad - 1) / kBcastPad * kBcastPad;  // Qᵀ: d x Rp, as run_segment
  int64_t per_thread = qt_at + (bcast ? P.d * Rp : 0), Racc = R;
  const int64_t widen_at = (per_thread + 15) / 16 * 16;
  if (widen) per_thread = widen_at + kWiden * (P.d + dv);
#ifdef QKV_AMX
  [[maybe_unused]] const int64_t amx_at = per_thread;  // the AMX path's scratch follows the vector path's
  if constexpr (kAmx) per_thread += amx_scratch_bytes(R, P.d, dv) / 4 + 16, Racc = AmxRows(R).Rpad;
#endif
  per_thread = (per_thread + 15) / 16 * 16;  // each thread's scratch on its own cache lines
  const int64_t part = 2 * R + Racc * dvp;  // m, l, acc of one segment
  static thread_local std::vector<float> buf;  // kept between calls: no page faults per call
  const size_t need = static_cast<size_t>(nt * per_thread + S * part + 16);
  if (buf.size() < need) buf.assign(need, 0.f);
  float* base = buf.data();
  auto partial = [&](int64_t s) { return base + nt * per_thread + s * part; };
  // heads without any segment (L = 0: no row sees a key) come out as zeros, lse = -inf
  std::vector<int64_t> head_first(N + 1, S);
  for (int64_t s = S - 1; s >= 0; --s) head_first[segs[s].n] = s;
  for (int64_t h = N - 1; h >= 0; --h) head_first[h] = std::min(head_first[h], head_first[h + 1]);

  auto work = [&](int64_t t) {  // piece t
    float* tb = base + t * per_thread;
    float* rr = tb + R * dqp + 2 * R * kBlock + kTile * (P.d + dv) + 64;  // 3R 8-byte slots
    Scratch sc{tb, tb + R * dqp, tb + R * dqp + R * kBlock, tb + R * dqp + 2 * R * kBlock,
               tb + R * dqp + 2 * R * kBlock + (kTile * P.d + 15) / 16 * 16,
               reinterpret_cast<int64_t*>(rr), reinterpret_cast<int64_t*>(rr) + R,
               reinterpret_cast<const uint8_t**>(reinterpret_cast<int64_t*>(rr) + 2 * R),
               bcast ? tb + qt_at : nullptr};
    constexpr int64_t kAhead = 3;  // segments prefetched ahead (short ones: a few keys each)
    for (int64_t s = first[t]; s < std::min(first[t] + kAhead, first[t + 1]); ++s)
      prefetch_segment(P, segs[s]);
    for (int64_t s = first[t]; s < first[t + 1]; ++s) {
      if (s + kAhead < first[t + 1]) prefetch_segment(P, segs[s + kAhead]);
      float* pm = partial(s);
      std::memset(pm + 2 * R, 0, Racc * dvp * sizeof(float));
#ifdef QKV_AMX
      if constexpr (kAmx) {
        char* amx = reinterpret_cast<char*>(tb + amx_at);
        run_segment_amx(P, segs[s].n, segs[s].k0, segs[s].k1, pm, pm + R, pm + 2 * R, dvp, sc, amx);
        continue;
      }
#endif
      if constexpr (kInt8<T>)
        if (widen) {
          run_segment_widened(P, segs[s].n, segs[s].k0, segs[s].k1, pm, pm + R, pm + 2 * R, dvp,
                              sc, tb + widen_at);
          continue;
        }
      run_segment<T, kDot>(P, segs[s].n, segs[s].k0, segs[s].k1, pm, pm + R, pm + 2 * R, dvp, sc);
    }
  };
  // merge by log-sum-exp: M = max m_s, L = Σ l_s 2^(m_s - M), out = Σ acc_s 2^(m_s - M) / L
  auto merge = [&](int64_t h) {
    const int64_t s0 = head_first[h], s1 = head_first[h + 1];
    for (int64_t r = 0; r < R; ++r) {
      float M = kNegInf;
      bool nan = false;  // a NaN score at a visible key: the row is NaN, lse too
      for (int64_t s = s0; s < s1; ++s) {
        const float ms = partial(s)[r], ls = partial(s)[R + r];
        if (std::isnan(ms) || std::isnan(ls)) nan = true;
        else if (ls > 0.f) M = std::max(M, ms);
      }
      O* o = out + (h * R + r) * dv;
      if (nan) {
        for (int64_t c = 0; c < dv; ++c) o[c] = from_float<O>(std::numeric_limits<float>::quiet_NaN());
        lse[h * R + r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (M == kNegInf) {  // no visible key
        for (int64_t c = 0; c < dv; ++c) o[c] = from_float<O>(0.f);
        lse[h * R + r] = kNegInf;
        continue;
      }
      float sum = 0.f;
      for (int64_t s = s0; s < s1; ++s)
        if (partial(s)[R + r] > 0.f) sum += partial(s)[R + r] * exp2_neg(partial(s)[r] - M);
      const float inv = 1.f / sum;
      float* tmp = partial(s0) + 2 * R + r * dvp;  // combined into the first segment's acc
      if (s1 - s0 > 1 || partial(s0)[r] != M) {
        const float w0 = partial(s0)[R + r] > 0.f ? exp2_neg(partial(s0)[r] - M) : 0.f;
        for (int64_t c = 0; c < dv; ++c) tmp[c] *= w0;
        for (int64_t s = s0 + 1; s < s1; ++s) {
          // a segment whose logits are all -inf still adds 0 · acc: a NaN there (0 · NaN at a
          // key the row may see) reaches the row whatever the split, as in one segment
          const float w = partial(s)[R + r] > 0.f ? exp2_neg(partial(s)[r] - M) : 0.f;
          const float* a = partial(s) + 2 * R + r * dvp;
          for (int64_t c = 0; c < dv; ++c) tmp[c] += w * a[c];
        }
      }
      for (int64_t c = 0; c < dv; ++c) o[c] = from_float<O>(tmp[c] * inv);
      lse[h * R + r] = (M + std::log2(sum)) * kLn2;
    }
  };
#ifdef _OPENMP
  if (nt > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(nt)
    {
      // the team may be smaller than asked: each thread takes every team-th piece
      const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
      for (int64_t p = t; p < nt; p += team) work(p);
#pragma omp barrier
      for (int64_t h = t; h < N; h += team) merge(h);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < nt; ++t) work(t);
  for (int64_t h = 0; h < N; ++h) merge(h);
}

// bf16 K/V: AMX tiles (run_segment_amx), vdpbf16ps on pairs (kPairs), or widened to fp32 for
// FMAs. By default, where oneDNN sees AMX (Intel server cores; the test the flash kernel's bf16
// path uses): tiles from kAmxMinRows query rows per kv head, widened below (there vdpbf16ps
// took ~34.5 ns per key in cache, G = 4, d = 128, 1 thread, against ~28 widened); elsewhere
// the pairs from kDotMinRows rows, widened below (Zen 4: the pairs for every call).
// QKV_DECODE_BF16=amx|dot|widen forces one for every call
// (amx: also for few rows; d or dv not a multiple of 32 still goes widened).
// Measured on a 2-core Xeon, 16384 keys, G = 4, d = 128, 1 thread, same process: widened /
// tiles 4.3 / 4.6 ms at 4 rows, 8.5 / 6.0 at 8, 16.3 / 8.8 at 16, ~50 / ~15 at 64.
constexpr int64_t kAmxMinRows = 8;
// Without AMX (AVX512_BF16: Zen 5, Cooper Lake) the pairs from this many rows, widened below.
// With few rows the work keeps pace with DRAM either way, and the widened loop streams it
// better: Zen 5, G = 4, d = 128, 1 thread, same process, pairs / widened: 16384 keys 2.14 /
// 1.91 ms at 4 rows, 2.83 / 3.32 at 8, 4.52 / 7.92 at 16; 65536 keys 11.1 / 9.1 at 4 rows,
// 12.5 / 14.0 at 8 (a cache small enough to stay in L3, read again and again as a benchmark
// does, runs 4 rows 15 % faster as pairs; a model's cache, layer after layer, comes from DRAM).
// Zen 4 keeps the pairs at every row count: it runs a 512-bit instruction as two 256-bit
// halves, so its arithmetic, not DRAM, is the limit there, and the pairs need fewer
// instructions per key (measured faster there when this path was chosen).
constexpr int64_t kDotMinRows = 8;

// The CPU family of an AMD CPU (0: another vendor). On the AVX-512 levels: 25 is Zen 4 (Zen 3,
// the same family, has no AVX-512), 26 Zen 5.
static unsigned amd_family() {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u) return 0;  // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xfu;
  return base + (base == 0xfu ? (a >> 20) & 0xffu : 0u);
#else
  return 0;
#endif
}

// fp32 K/V with few query rows per kv head on an AVX-512 level: whether the AVX2 loops run
// (a 64-byte line of 2 keys for 4 rows per step, P·V in 6-row blocks, prefetch kAvx2Ahead
// keys ahead) instead of the AVX-512 ones (16-key tiles summed across lanes, prefetch 2
// blocks ahead). The AVX2 loops do more work per key but keep DRAM streaming better on Zen 5:
// G = 4, 1 thread, same process, AVX-512 / AVX2 loops, 4 rows: 4096 keys (32 MiB of K+V)
// 1.01 / 0.82-0.87 ms, 16384 keys 5.44-5.65 / 3.66-3.87, 65536 keys 22.9 / 16.7-17.5;
// 8 rows, 16384 keys 7.05-7.29 / 6.09-6.14; 12 rows 8.49 / 8.07 but 4096 keys 1.78 / 2.02.
// K/V that stay in L3 (3072 keys and fewer: 24 MiB) run 0.6-0.9x on them, so they are taken
// for calls that read at least kLinesMinBytes with up to kLinesMaxRows rows. A Xeon (Sapphire
// Rapids class) ran the avx2 level's loops 0.94x its AVX-512 ones, so there, and on Zen 4
// (not measured), the AVX-512 loops stay. QKV_DECODE_FP32=avx2 takes the AVX2 loops for every
// call with fewer than kBcastMinRows rows, =avx512 never (no effect on the other levels).
constexpr int64_t kLinesMaxRows = 8;
constexpr int64_t kLinesMinBytes = int64_t(32) << 20;
enum class Fp32Path { kAvx512, kAvx2, kAuto };
static Fp32Path fp32_path() {
  static const Fp32Path path = [] {
    const std::string want = path_setting("QKV_DECODE_FP32", {"auto", "avx2", "avx512"});
    if (want == "avx2") return Fp32Path::kAvx2;
    if (want == "avx512") return Fp32Path::kAvx512;
    return amd_family() >= 26u ? Fp32Path::kAuto : Fp32Path::kAvx512;
  }();
  return path;
}
enum class Bf16Path { kWiden, kDot, kDotAlways, kAmx, kAmxAlways };
static Bf16Path bf16_path() {
  static const Bf16Path path = [] {
    const std::string want = path_setting("QKV_DECODE_BF16", {"auto", "amx", "dot", "widen"});
    // oneDNN sees AMX and the level allows it (QKV_ISA=avx512_bf16 turns it off)
    const bool onednn_amx =
        at::native::cpublas::could_pack(at::kBFloat16) && qkv_simd::amx_allowed();
#ifdef QKV_AMX
    const bool amx = onednn_amx && amx_permitted();
#else
    const bool amx = false;
#endif
    if (want == "amx") {
      TORCH_CHECK(amx, "QKV_DECODE_BF16=amx: this build or CPU has no AMX tiles (or oneDNN "
                       "does not see them)");
      return Bf16Path::kAmxAlways;
    }
    if (want == "dot") return Bf16Path::kDotAlways;
    if (want == "widen") return Bf16Path::kWiden;
    if (amx) return Bf16Path::kAmx;  // unset/empty: as the level
    if (onednn_amx) return Bf16Path::kWiden;
    return amd_family() == 25u ? Bf16Path::kDotAlways : Bf16Path::kDot;  // Zen 4: always
  }();
  return path;
}

std::tuple<Tensor, Tensor> decode_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const std::optional<Tensor>& mask, double scale,
                                      bool causal, int64_t window, int64_t splits,
                                      const std::optional<Tensor>& rows,
                                      const std::optional<Tensor>& kv_batch) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "qkv decode: q, k, v must be 4-D (Nb, heads, T, d)");
  TORCH_CHECK(q.is_contiguous(), "qkv decode: q must be contiguous");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              "qkv decode: k and v need a unit stride over the head dim");
  // fp32 queries over a bf16 cache (an fp32 model storing K/V in bf16): the queries are
  // rounded to bf16 as the bf16 kernel's dot products take them, the output stays fp32
  const bool mixed = q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16;
  // an int8 cache: rows of d int8 values and their fp32 scale (d + 4 bytes), any float q
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (mixed || int8 || q.scalar_type() == k.scalar_type()),
              "qkv decode: q, k, v must share a dtype (or q float32 over bfloat16 k, v, or "
              "int8 k, v)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "qkv decode: float32 or bfloat16 queries only");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 || int8,
              "qkv decode: float32, bfloat16 or int8 k, v only");
  TORCH_CHECK(scale > 0 && std::isfinite(static_cast<float>(scale)),
              "qkv decode: scale must be finite and > 0 in fp32");
  const int64_t Nb = q.size(0), h = q.size(1), Tq = q.size(2), d = q.size(3);
  const int64_t extra = int8 ? 4 : 0;  // the scale's bytes at the end of an int8 row
  const int64_t h_kv = k.size(1), Tk = k.size(2), dv = v.size(3) - extra;
  const bool gather = rows.has_value() && rows->defined();
  const bool mapped = kv_batch.has_value() && kv_batch->defined();
  TORCH_CHECK(!(gather && mapped), "qkv decode: pass rows or kv_batch, not both");
  // with rows or kv_batch, k and v may hold more batch rows than q (sentences that left)
  const int64_t Nk = k.size(0);
  TORCH_CHECK((gather || mapped ? Nb == 0 || Nk >= 1 : Nk == Nb) && v.size(0) == Nk &&
                  v.size(1) == h_kv && v.size(2) == Tk && k.size(3) == d + extra && d > 0 &&
                  dv >= 0 && h_kv > 0 &&
                  h % h_kv == 0,
              "qkv decode: shapes of q, k, v do not match");
  Tensor out = at::empty({Nb, h, Tq, dv}, q.options());
  Tensor lse = at::empty({Nb, h, Tq}, q.options().dtype(at::kFloat));
  if (Nb * h * Tq == 0) return {out, lse};
  MaskView mk;
  if (mask.has_value() && mask->defined()) {
    const Tensor& t = *mask;
    TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 5 && t.stride(4) == 1 &&
                    t.size(0) == Nb && t.size(1) == h_kv && t.size(2) == h / h_kv &&
                    t.size(3) == Tq && t.size(4) == Tk,
                "qkv decode: mask must be a bool (Nb, h_kv, G, Tq, Tk) view, unit key stride");
    mk.base = reinterpret_cast<const uint8_t*>(t.const_data_ptr<bool>());
    mk.h_kv = h_kv, mk.s0 = t.stride(0), mk.s1 = t.stride(1), mk.s2 = t.stride(2);
    mk.s3 = t.stride(3);
  }
  if (gather) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 2 && rows->size(0) == Nb &&
                    rows->size(1) >= Tk && rows->stride(1) == 1,
                "qkv decode: rows must be an int64 (Nb, >= Tk) tensor, unit stride over positions");
    const int64_t* r = rows->const_data_ptr<int64_t>();
    for (int64_t b = 0; b < Nb; ++b)
      for (int64_t t = 0; t < Tk; ++t) {
        const int64_t x = r[b * rows->stride(0) + t];
        TORCH_CHECK(x >= 0 && x < Nk, "qkv decode: rows out of range");
      }
  }
  if (mapped) {
    TORCH_CHECK(kv_batch->scalar_type() == at::kLong && kv_batch->dim() == 1 &&
                    kv_batch->size(0) == Nb && kv_batch->is_contiguous(),
                "qkv decode: kv_batch must be a contiguous int64 (Nb,) tensor");
    const int64_t* r = kv_batch->const_data_ptr<int64_t>();
    for (int64_t b = 0; b < Nb; ++b)
      TORCH_CHECK(r[b] >= 0 && r[b] < Nk, "qkv decode: kv_batch out of range");
  }
  // the path settings are checked on every build (once per process), not only where they
  // choose something
  if (int8) (void)int8_on_int16();
  else if (k.scalar_type() == at::kBFloat16) (void)bf16_path();
  else (void)fp32_path();
  const Structure st{Tq, Tk, causal, window};
  const float c2 = static_cast<float>(scale) * kLog2e;
  // queries in the cache's dtype (fp32 over an int8 cache)
  const Tensor qk = mixed ? q.to(at::kBFloat16) : int8 ? q.to(at::kFloat) : q;
  auto run = [&](auto tag, auto out_tag) {
    using T = decltype(tag);
    using O = decltype(out_tag);
    Problem<T> P{Nb * h_kv, h_kv, h / h_kv, Tq, (h / h_kv) * Tq, d, dv, Tk,
                 qk.const_data_ptr<QueryT<T>>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(),
                 k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                 v.stride(2), st, mk, c2};
    if (gather) P.rows = rows->const_data_ptr<int64_t>(), P.rows_s = rows->stride(0);
    if (mapped) P.kv_batch = kv_batch->const_data_ptr<int64_t>();
#if defined(QKV_AVX512) && defined(QKV_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      const Fp32Path path = fp32_path();
      const int64_t bytes = P.N * P.Tk * (P.d + P.dv) * int64_t(sizeof(float));  // K + V read
      P.lines = path == Fp32Path::kAvx2 ? P.R < kBcastMinRows
                : path == Fp32Path::kAuto ? P.R <= kLinesMaxRows && bytes >= kLinesMinBytes
                                          : false;
    }
#endif
    if constexpr (kPairs<T>) {
      const Bf16Path path = bf16_path();
#ifdef QKV_AMX
      const bool tiles = path == Bf16Path::kAmxAlways || (path == Bf16Path::kAmx && P.R >= kAmxMinRows);
      if (tiles && d % 32 == 0 && dv % 32 == 0)
        return decode_impl<T, O, false, true>(P, out.data_ptr<O>(), lse.data_ptr<float>(), splits);
#endif
      if (path == Bf16Path::kDotAlways || (path == Bf16Path::kDot && P.R >= kDotMinRows))
        return decode_impl<T, O, true>(P, out.data_ptr<O>(), lse.data_ptr<float>(), splits);
    }
    decode_impl<T, O, false>(P, out.data_ptr<O>(), lse.data_ptr<float>(), splits);
  };
  if (mixed) run(BFloat16{}, float{});
  else if (int8 && q.scalar_type() == at::kFloat) run(int8_t{}, float{});
  else if (int8) run(int8_t{}, BFloat16{});
  else if (q.scalar_type() == at::kFloat) run(float{}, float{});
  else run(BFloat16{}, BFloat16{});
  return {out, lse};
}

// Which instruction paths this build uses (for benchmarks and native_status).
std::string decode_isa() {
#if defined(QKV_I16_DOTS) || defined(QKV_I16_AVX2)
  const std::string i16 = std::string("int16 dot products (") + pair_op() + ")";
  const std::string int8 = "; int8 K/V: " + (int8_on_int16() ? i16 : "widened to fp32") +
                           ", widened runs from " + std::to_string(kWidenRows) + " rows";
#else
  (void)int8_on_int16();  // a bad setting is an error here too
  const std::string int8 = "; int8 K/V: widened to fp32";
#endif
  // fp32 K/V with few rows (a bad setting is an error on every level)
  const Fp32Path f = fp32_path();
  [[maybe_unused]] const std::string fp32 =
      f == Fp32Path::kAvx2   ? "; fp32 K/V under " + std::to_string(kBcastMinRows) + " rows per kv head: avx2 loops"
      : f == Fp32Path::kAuto ? "; fp32 K/V up to " + std::to_string(kLinesMaxRows) + " rows per kv head, " +
                                   std::to_string(kLinesMinBytes >> 20) + " MiB or more a call: avx2 loops"
                             : "";
#if defined(QKV_AVX512) && defined(__AVX512BF16__)
  const Bf16Path p = bf16_path();
  const std::string bf16 =
      p == Bf16Path::kAmx ? "amx tiles from " + std::to_string(kAmxMinRows) +
                                " rows per kv head, else widened to fp32"
      : p == Bf16Path::kAmxAlways ? "amx tiles"
      : p == Bf16Path::kDot       ? "vdpbf16ps from " + std::to_string(kDotMinRows) +
                                      " rows per kv head, else widened to fp32"
      : p == Bf16Path::kDotAlways ? "vdpbf16ps"
                                  : "widened to fp32";
  // "+amx" only where the tiles run (a build with AMX code on a CPU without them does not)
  const bool tiles = p == Bf16Path::kAmx || p == Bf16Path::kAmxAlways;
  return std::string("avx512+avx512bf16") + (tiles ? "+amx" : "") + "; bf16 K/V: " + bf16 + fp32 +
         int8;
#elif defined(QKV_AVX512)
  return "avx512" + fp32 + int8;
#elif defined(QKV_DECODE_AVX2)
  return "avx2 (bf16 K/V widened in registers)" + int8;
#else
  return "portable" + int8;
#endif
}

}  // namespace

TORCH_LIBRARY(qkv_decode, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, int window,"
        " int splits=0, Tensor? rows=None, Tensor? kv_batch=None) -> (Tensor, Tensor)");
  m.def("isa() -> str", &decode_isa);
}

TORCH_LIBRARY_IMPL(qkv_decode, CPU, m) {
  m.impl("fwd", &decode_fwd);
}

// The kernels above as plain functions, for the fused decoder step (step_cpu.cpp).
namespace qkv {
std::tuple<Tensor, Tensor> decode_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const std::optional<Tensor>& mask, double scale,
                                            bool causal, const std::optional<Tensor>& rows,
                                            const std::optional<Tensor>& kv_batch) {
  return decode_fwd(q, k, v, mask, scale, causal, -1, 0, rows, kv_batch);
}

// The dispatcher's per-call entry (module.cpp's `decode`): any q layout, k and v with any
// head-dim stride (copied where it is not 1), the output only.
Tensor decode_output(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& mask, double scale, bool causal,
                     int64_t window) {
  auto unit = [](const Tensor& t) { return t.dim() == 4 && t.stride(3) != 1 ? t.contiguous() : t; };
  return std::get<0>(decode_fwd(q.contiguous(), unit(k), unit(v), mask, scale, causal, window, 0,
                                std::nullopt, std::nullopt));
}

}  // namespace qkv
