// qkv's fused CPU flash-attention kernel (forward and backward), fp32 and bf16.
//
// The algorithm is the one of qkv/kernels/flash.py (FlashAttention's online softmax,
// FlashAttention-2's backward), written as one pass per score block instead of a chain of
// PyTorch ops: block matmuls go to PyTorch's own BLAS micro-kernels (cpublas::brgemm, which
// is oneDNN with AMX tiles on CPUs that have them), the softmax of a block (max, exp, sum,
// rescale, rounding to bf16) is one vectorised loop per row that stays in L1/L2.
//
// Causal (bottom-right) and sliding windows give each query row one contiguous key range,
// so empty blocks are skipped without reading any mask, and where a block's rows see only
// part of its keys (a diagonal, a window's edge, a partial block-mask tile) groups of rows
// multiply only the keys they see (row_groups); a bool mask (True = may attend), if
// given, is read in place as a broadcast view (MaskView). Biases (with their gradient), ALiBi
// slopes, relative-position tables, soft-capping (Variant) and block masks (BlockView: empty
// blocks skipped, full ones unmasked) are applied row by row; fp64 stays on the PyTorch-ops
// kernel. Layout (qkv/kernels/_blocks.py):
//   q (N, G, Tq, d)   k (N, Tk, d)   v (N, Tk, dv)   out (N, G, Tq, dv)   lse (N, G, Tq) fp32
// with N = batch * kv heads and G query heads per kv head (GQA without repeating K/V).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "simd.h"
#include "flash_amx.h"
#include "flash_softmax.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <mutex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>

#include <sys/mman.h>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;
namespace cpublas = at::native::cpublas;

constexpr int64_t kPack = 64;  // oneDNN's VNNI pack takes blocks of 64 columns

// Runs f(first, end, step) once on each of at::get_num_threads() OpenMP threads (PyTorch's
// own runtime: libtorch links libgomp); thread t takes items t, t + nt, t + 2·nt, ...
// Interleaved rather than at::parallel_for's contiguous chunks: causal query blocks grow in
// cost along the sequence. Each thread allocates its scratch buffers once.
template <typename F>
static void parallel_strided(int64_t n, const F& f) {
#ifdef _OPENMP
  const int64_t nt = omp_in_parallel() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (nt > 1) {
    std::exception_ptr err;
    std::mutex mu;
#pragma omp parallel num_threads(nt)
    {
      try {
        f(static_cast<int64_t>(omp_get_thread_num()), n, nt);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return;
  }
#endif
  f(0, n, 1);
}

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

// C (M x N, ld_c) (+)= A (M x K, ld_a) @ B (K x N, ld_b), all row-major, C in fp32.
template <typename T>
static inline void mm(int64_t M, int64_t N, int64_t K, const T* A, int64_t ld_a, const T* B,
                      int64_t ld_b, float* C, int64_t ld_c, bool add) {
  cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add, A, B, C, /*is_vnni=*/false);
}

// ---- bf16 on CPUs without AMX: qkv's AVX512_BF16 micro-kernel --------------------------
// Without AMX, oneDNN's unpacked bf16 brgemm reached ~35-40 % of the bf16 peak on 256x256x64
// blocks (slower than the fp32 kernel). vdpbf16ps multiplies PAIRS of bf16 along the
// reduction dimension into fp32 lanes, so the B operand is stored as uint32 pairs
// (B[2kk, n], B[2kk+1, n]) 16 columns per vector ("pair layout"); A needs no packing (its
// pairs are adjacent in a row-major row). K and V are packed once per call and head, the
// backward's P and dS once per block (pack_row_pairs). An odd reduction length pairs the last
// element of A with 0 (A's half is masked, B's pad is stored as 0).
//
// Which path bf16 takes (Bf16Path): AMX tiles through oneDNN's VNNI-packed brgemm where the
// CPU has AMX (the forward; the backward uses oneDNN's unpacked brgemm there), this kernel
// where it has AVX512_BF16; elsewhere bf16 is a storage format: the call's q, k, v (and the
// backward's out, dout) are widened to fp32 once and the fp32 kernel runs (kWiden; O(T·d)
// conversions against O(T²·d) work). oneDNN's unpacked bf16 brgemm without bf16 instructions
// made bf16 slower than fp32 (Zen 3, AVX2: 0.85x qkv fp32 at T = 4096, full). kBrgemm stays
// as a forced choice. QKV_BF16_MATMUL=amx|dot|widen|brgemm forces one (oneDNN's own
// ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 also hides AMX from it).
enum class Bf16Path { kAmx, kDot, kWiden, kBrgemm };

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kHasDot = true;

// C (MR x 16·NV, ldc) (+)= A (MR x K, lda) · B; B's pair kk of column block j (16 columns)
// is at B + j·bnb + kk·bkk. Columns of the last block outside `last` are neither read from
// nor written to C.
template <int MR, int NV>
static void dot_tile(int64_t K, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t bkk,
                     int64_t bnb, float* C, int64_t ldc, bool add, __mmask16 last) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      acc[i][j] = add ? _mm512_maskz_loadu_ps(j == NV - 1 ? last : 0xffff, C + i * ldc + j * 16)
                      : _mm512_setzero_ps();
  const int64_t K2 = K / 2;
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) b[j] = (__m512bh)_mm512_loadu_si512(B + j * bnb + kk * bkk);
    for (int i = 0; i < MR; ++i) {
      int32_t a;
      std::memcpy(&a, A + i * lda + 2 * kk, sizeof(a));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
    }
  }
  if (K & 1) {  // the last element pairs with 0
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) b[j] = (__m512bh)_mm512_loadu_si512(B + j * bnb + K2 * bkk);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(A[i * lda + K - 1]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      _mm512_mask_storeu_ps(C + i * ldc + j * 16, j == NV - 1 ? last : 0xffff, acc[i][j]);
}

using DotTile = void (*)(int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t,
                         float*, int64_t, bool, __mmask16);
constexpr int kDotRows = 6;  // 6 x 4 accumulators + 4 B vectors + 1 broadcast <= 32 zmm

template <int MR>
constexpr std::array<DotTile, 4> dot_row() {
  return {dot_tile<MR, 1>, dot_tile<MR, 2>, dot_tile<MR, 3>, dot_tile<MR, 4>};
}

// C (M x N, ldc) (+)= A (M x K bf16, row-major, lda) · B (K x N in the pair layout above)
static void dot_mm(int64_t M, int64_t N, int64_t K, const BFloat16* A_, int64_t lda,
                   const uint32_t* B, int64_t bkk, int64_t bnb, float* C, int64_t ldc,
                   bool add) {
  static constexpr std::array<std::array<DotTile, 4>, kDotRows> table = {
      dot_row<1>(), dot_row<2>(), dot_row<3>(), dot_row<4>(), dot_row<5>(), dot_row<6>()};
  const uint16_t* A = reinterpret_cast<const uint16_t*>(A_);
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nn = std::min<int64_t>(64, N - n0), nv = (nn + 15) / 16;
    const int64_t rem = nn - (nv - 1) * 16;
    const __mmask16 last = rem == 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1u);
    const uint32_t* Bn = B + (n0 / 16) * bnb;
    int64_t m = 0;
    for (; m + kDotRows <= M; m += kDotRows)
      table[kDotRows - 1][nv - 1](K, A + m * lda, lda, Bn, bkk, bnb, C + m * ldc + n0, ldc, add,
                                  last);
    if (m < M)
      table[M - m - 1][nv - 1](K, A + m * lda, lda, Bn, bkk, bnb, C + m * ldc + n0, ldc, add,
                               last);
  }
}
#else
constexpr bool kHasDot = false;
static void dot_mm(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const uint32_t*, int64_t,
                   int64_t, float*, int64_t, bool) {
  TORCH_CHECK(false, "qkv flash: built without AVX512_BF16");
}
#endif

// Pair layout of B = Xᵀ for X (n x K, row-major, ld K), e.g. S = Q Kᵀ: chunks of 16 rows of
// X, each (ceil(K/2) pairs x 16) uint32; rows past n and the pad of an odd K are 0.
// Column block j of B is at out + j·ceil(K/2)·16 (bnb), pair kk at + kk·16 (bkk = 16).
static void pack_chunks(const BFloat16* x_, int64_t n, int64_t K, uint32_t* out) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_);
  const int64_t K2 = (K + 1) / 2;
  for (int64_t c = 0; c < n; c += 16)
    for (int64_t i = 0; i < 16; ++i) {
      uint32_t* o = out + (c / 16) * K2 * 16 + i;
      if (c + i >= n) {  // past the last row: zeros
        for (int64_t kk = 0; kk < K2; ++kk) o[kk * 16] = 0u;
        continue;
      }
      const uint16_t* row = x + (c + i) * K;
      for (int64_t kk = 0; kk < K2; ++kk) {
        const uint32_t hi = 2 * kk + 1 < K ? row[2 * kk + 1] : 0u;
        o[kk * 16] = row[2 * kk] | (hi << 16);
      }
    }
}

// Pair layout of B = X for X (rows x n, ld): out[(r/2)·ldo + c] = (X[r, c], X[r+1, c]), an odd
// last row paired with 0, columns n..ldo zero (bkk = ldo, bnb = 16; ldo a multiple of 16).
static void pack_row_pairs(const BFloat16* x_, int64_t rows, int64_t n, int64_t ld,
                           uint32_t* out, int64_t ldo) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_);
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* a = x + r * ld;
    const uint16_t* b = r + 1 < rows ? a + ld : nullptr;
    uint32_t* o = out + (r / 2) * ldo;
    int64_t c = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; c < ldo; c += 16) {
      const __mmask16 k = c + 16 <= n ? __mmask16(0xffff)
                          : c < n    ? __mmask16((1u << (n - c)) - 1u)
                                     : __mmask16(0);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, a + c));
      const __m512i hi =
          b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, b + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
#endif
    for (; c < ldo; ++c)
      o[c] = c < n ? (uint32_t(a[c]) | (b ? uint32_t(b[c]) << 16 : 0u)) : 0u;
  }
}

// The path bf16 calls take (see above); QKV_BF16_MATMUL=auto|amx|onednn|dot|widen|brgemm is
// read on each call so that a process can compare the paths (amx: qkv's own tile forward
// where it applies, see amx_tiles, else oneDNN's brgemm on tiles; onednn: always the
// latter). AMX needs oneDNN's view of the CPU and the level (QKV_ISA=avx512_bf16 turns it off).
static Bf16Path bf16_path(int64_t d) {
  const char* env = std::getenv("QKV_BF16_MATMUL");
  const std::string want = env ? env : "";
  const bool amx = cpublas::could_pack(at::kBFloat16) && qkv_simd::amx_allowed();
  TORCH_CHECK(want.empty() || want == "auto" || want == "amx" || want == "onednn" ||
                  want == "dot" || want == "widen" || want == "brgemm",
              "QKV_BF16_MATMUL must be auto, amx, onednn, dot, widen or brgemm; got '", want, "'");
  if (want == "brgemm") return Bf16Path::kBrgemm;
  if (want == "widen") return Bf16Path::kWiden;
  if (want == "amx" || want == "onednn") {
    TORCH_CHECK(amx, "QKV_BF16_MATMUL=", want, ": no AMX here (this CPU or level has none, or "
                     "oneDNN does not see it: ONEDNN_MAX_CPU_ISA)");
    return d % 2 == 0 ? Bf16Path::kAmx : Bf16Path::kBrgemm;
  }
  if (want != "dot" && amx && d % 2 == 0) return Bf16Path::kAmx;
  return kHasDot ? Bf16Path::kDot : Bf16Path::kWiden;
}

// bf16_path's answer in words, for benchmarks and native_status (an even head dim)
std::string isa_name() {
  switch (bf16_path(64)) {
    case Bf16Path::kAmx: {
      const char* env = std::getenv("QKV_BF16_MATMUL");
      if (env && std::string(env) == "onednn") return "amx (oneDNN brgemm, AMX tiles)";
#ifdef QKV_FLASH_AMX
      return "amx (qkv tile kernel; oneDNN brgemm with masks or variants)";
#else
      return "amx (oneDNN brgemm, AMX tiles)";
#endif
    }
    case Bf16Path::kDot:
      return "avx512_bf16 (qkv dot-product kernel)";
    case Bf16Path::kWiden:
      return "widen (bf16 stored, fp32 kernel)";
    default:
      return "brgemm (oneDNN, no AMX packing)";
  }
}

// out = transpose(in): in (R x C, ld_in) -> out (C x R, ld_out)
template <typename T>
static void transpose(const T* in, int64_t R, int64_t C, int64_t ld_in, T* out, int64_t ld_out) {
  constexpr int64_t b = 16;
  for (int64_t r0 = 0; r0 < R; r0 += b)
    for (int64_t c0 = 0; c0 < C; c0 += b)
      for (int64_t r = r0; r < std::min(R, r0 + b); ++r)
        for (int64_t c = c0; c < std::min(C, c0 + b); ++c) out[c * ld_out + r] = in[r * ld_in + c];
}

// A buffer of n T's (zero-filled by assign), 2 MiB-aligned and marked for transparent huge
// pages: the prepared K/V of a head are read once per query block, and with 4 KiB pages
// long-sequence calls swung between 1.1 s and 1.9 s (bf16, T=16384). The memory is kept for
// the next call (the buffers live in thread_local caches): freeing and re-faulting fresh huge
// pages on every call cost ~4 ms per call at T=1024. Buffers above kKeepBytes are released
// after each call so that one long call does not pin its memory.
constexpr size_t kKeepBytes = size_t(64) << 20;

template <typename T>
struct HugeBuffer {
  T* ptr = nullptr;
  size_t n = 0, cap_bytes = 0;
  HugeBuffer() = default;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  HugeBuffer(HugeBuffer&& o) noexcept : ptr(o.ptr), n(o.n), cap_bytes(o.cap_bytes) {
    o.ptr = nullptr, o.n = o.cap_bytes = 0;
  }
  ~HugeBuffer() { std::free(ptr); }
  void release() {
    std::free(ptr);
    ptr = nullptr, n = cap_bytes = 0;
  }
  void assign(size_t count) {  // n = count zeros
    // huge pages only pay off for big buffers; small ones (many short heads) stay small
    const size_t huge = size_t(2) << 20, raw = count * sizeof(T);
    const size_t align = raw >= huge / 2 ? huge : 4096;
    const size_t bytes = (raw + align - 1) / align * align;
    if (bytes > cap_bytes) {
      release();
      if (bytes && posix_memalign(reinterpret_cast<void**>(&ptr), align, bytes) != 0)
        throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      if (ptr && align == huge) madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
      cap_bytes = bytes;
    }
    n = count;
    if (ptr) std::memset(ptr, 0, count * sizeof(T));
  }
  void trim() {  // after a call
    if (cap_bytes > kKeepBytes) release();
  }
  T* data() const { return ptr; }
};

// A thread's scratch arrays carved out of one (thread_local, reused) HugeBuffer, each
// starting on a 4 KiB page: their cache placement is then the same from run to run (with
// separate malloc'ed vectors, bf16 T=16384 forwards swung between 1.04 s and 1.46 s; now
// ~0.98 s each time).
class Scratch {
 public:
  static size_t pages(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }
  explicit Scratch(size_t bytes) : buf_(tls_buffer()) { buf_.assign(bytes); }
  ~Scratch() { buf_.trim(); }
  template <typename U>
  U* take(size_t n) {
    U* p = reinterpret_cast<U*>(buf_.data() + used_);
    used_ += pages(n * sizeof(U));
    TORCH_CHECK(used_ <= buf_.n, "qkv flash: scratch overflow");
    return p;
  }

 private:
  static HugeBuffer<char>& tls_buffer() {
    static thread_local HugeBuffer<char> buf;
    return buf;
  }
  HugeBuffer<char>& buf_;
  size_t used_ = 0;
};

// K and V of one kv head, prepared for the forward's two block matmuls. Plain: K transposed
// block by block, (d x bk) per key block with rows kld = bk + 64 bytes apart: in one (d x Tk)
// Kᵀ the rows of a block lie 4·Tk bytes apart, all in the same few L1 sets, and the matmul's
// column strips evicted each other (the fp32 forward at T = 4096: 1.2x slower on Zen 3); the
// extra cache line staggers them. VNNI (bf16 with AMX): every key block j is packed for oneDNN's brgemm, Kᵀ in
// chunks of 64 keys and V (keys padded to even) in chunks of 64 value columns.
// Dot (bf16 without AMX): per key block, Kᵀ in the pair layout of pack_chunks and V in that
// of pack_row_pairs (k_dot/v_dot).
// The packed layout lives here only: the forward reads it through k_block/v_block.
template <typename T>
struct PreparedKV {
  HugeBuffer<T> kt, vp;
  HugeBuffer<uint32_t> kd, vd;  // dot path
  int64_t d, dv, Tk, bk, rdv, rbk, ebk;  // rdv, rbk: dv, bk rounded up to 64; ebk: bk to even
  int64_t kld = 0;  // plain: row stride of a block of Kᵀ
  int64_t kblk = 0, vblk = 0, rdv16 = 0;  // dot: uint32 per key block of kd, vd; dv to 16
  bool vnni, dot = false;
  const uint32_t* k_dot(int64_t j) const { return kd.data() + j * kblk; }
  const uint32_t* v_dot(int64_t j) const { return vd.data() + j * vblk; }
  size_t bytes() const { return kt.cap_bytes + vp.cap_bytes + kd.cap_bytes + vd.cap_bytes; }
  void release() { kt.release(), vp.release(), kd.release(), vd.release(); }
  // Kᵀ of key block j: VNNI (d x rbk) in 64-key chunks of d·64 each; plain: (d x bk), row
  // stride kld
  const T* k_block(int64_t j) const { return kt.data() + j * d * (vnni ? rbk : kld); }
  // V of key block j, VNNI only: chunk c (of 64 value columns) at + c·(keys of the block, even)
  const T* v_block(int64_t j) const { return vp.data() + j * ebk * rdv; }
  void prepare(const T* k, const T* v, int64_t d_, int64_t dv_, int64_t Tk_, int64_t bk_,
               bool vnni_, bool dot_ = false) {
    d = d_, dv = dv_, Tk = Tk_, bk = bk_, vnni = vnni_, dot = dot_;
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (dot) {
        const int64_t nb = (Tk + bk - 1) / bk;
        rdv16 = (dv + 15) / 16 * 16;
        kblk = (bk + 15) / 16 * 16 * ((d + 1) / 2);
        vblk = (bk + 1) / 2 * rdv16;
        kd.assign(nb * kblk), vd.assign(nb * vblk);
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t ks = j * bk, n = std::min(bk, Tk - ks);
          pack_chunks(k + ks * d, n, d, kd.data() + j * kblk);
          pack_row_pairs(v + ks * dv, n, dv, dv, vd.data() + j * vblk, rdv16);
        }
        rdv = dv, rbk = bk, ebk = bk + (bk & 1);
        return;
      }
    }
    rdv = vnni ? (dv + kPack - 1) / kPack * kPack : dv;
    rbk = vnni ? (bk + kPack - 1) / kPack * kPack : bk;
    ebk = vnni ? bk + (bk & 1) : bk;
    const int64_t nb = (Tk + bk - 1) / bk;
    if (!vnni) {
      kld = bk + 64 / static_cast<int64_t>(sizeof(T));
      kt.assign(nb * d * kld);
      for (int64_t j = 0; j < nb; ++j)
        transpose(k + j * bk * d, std::min(bk, Tk - j * bk), d, d, kt.data() + j * d * kld, kld);
      return;
    }
    kt.assign(nb * d * rbk);
    vp.assign(nb * ebk * rdv);
    std::vector<T> tmp(std::max(d * kPack, ebk * kPack));
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t ks = j * bk, n = std::min(bk, Tk - ks), en = n + (n & 1);
      for (int64_t c = 0; c < n; c += kPack) {  // Kᵀ chunk (d x 64), zero-padded keys
        std::fill(tmp.begin(), tmp.end(), T(0));
        transpose(k + (ks + c) * d, std::min(kPack, n - c), d, d, tmp.data(), kPack);
        cpublas::pack(d, kPack, kPack, kPack, c10::CppTypeToScalarType<T>::value,
                      c10::CppTypeToScalarType<T>::value, tmp.data(),
                      const_cast<T*>(k_block(j)) + c * d);
      }
      for (int64_t c = 0; c < dv; c += kPack) {  // V chunk (even keys x 64)
        std::fill(tmp.begin(), tmp.end(), T(0));
        for (int64_t r = 0; r < n; ++r)
          for (int64_t x = 0; x < std::min(kPack, dv - c); ++x)
            tmp[r * kPack + x] = v[(ks + r) * dv + c + x];
        cpublas::pack(en, kPack, kPack, kPack, c10::CppTypeToScalarType<T>::value,
                      c10::CppTypeToScalarType<T>::value, tmp.data(),
                      const_cast<T*>(v_block(j)) + c * en);
      }
    }
  }
};

// A bool mask (True = may attend) as a strided view (Nb, h_kv, G, Tq, Tk) with unit stride
// over keys (Python passes the broadcast view, never a copy); kv head n = b·h_kv + hk.
struct MaskView {
  const uint8_t* base = nullptr;
  int64_t h_kv = 1, s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const uint8_t* row(int64_t n, int64_t g, int64_t i, int64_t ks) const {
    if (!base) return nullptr;
    return base + (n / h_kv) * s0 + (n % h_kv) * s1 + g * s2 + i * s3 + ks;
  }
  static MaskView of(const std::optional<Tensor>& mask) {
    MaskView v;
    if (!mask.has_value() || !mask->defined()) return v;
    const Tensor& t = *mask;
    TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 5 && t.stride(4) == 1,
                "qkv flash: mask must be a bool (Nb, h_kv, G, Tq, Tk) view with unit key stride");
    v.base = reinterpret_cast<const uint8_t*>(t.const_data_ptr<bool>());
    v.h_kv = t.size(1), v.s0 = t.stride(0), v.s1 = t.stride(1), v.s2 = t.stride(2);
    v.s3 = t.stride(3);
    return v;
  }
};

// Sizes in the kernel's layout: q (N, G, Tq, d), k (N, Tk, d), v (N, Tk, dv).
struct Dims {
  int64_t N, G, Tq, d, Tk, dv;
  static Dims of(const Tensor& q, const Tensor& k, const Tensor& v) {
    return {q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), v.size(2)};
  }
};

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

// A block mask (qkv.masks.BlockMask): per (batch, query head, query block, key block) -1 for
// an empty block (skipped), -2 for a full one (no masking), else the index of its bool tile
// (bq x bk, True = may attend). The kernel's blocks are the mask's blocks. A tile row whose
// keys are one contiguous span [lo, hi) (spans, (P, bq, 2); -1 if not) narrows the row's key
// range instead: no mask bytes read, as on a causal diagonal.
struct BlockView {
  const int32_t* idx = nullptr;
  int64_t s[5] = {0, 0, 0, 0, 0}, h_kv = 1;
  const uint8_t* tiles = nullptr;
  const int32_t* spans = nullptr;
  int64_t ld = 0, tile = 0;
  // the mask bytes of row r of tile t, or nullptr after narrowing [c0, c1) to its span
  const uint8_t* row(int32_t t, int64_t r, int64_t& c0, int64_t& c1) const {
    const int32_t* sp = spans + (t * tile / ld + r) * 2;
    if (sp[0] < 0) return tile_row(t, r);
    c0 = std::max<int64_t>(c0, sp[0]), c1 = std::min<int64_t>(c1, sp[1]);
    return nullptr;
  }
  int32_t state(int64_t n, int64_t g, int64_t qb, int64_t j) const {
    if (!idx) return -2;
    return idx[(n / h_kv) * s[0] + (n % h_kv) * s[1] + g * s[2] + qb * s[3] + j * s[4]];
  }
  const uint8_t* tile_row(int32_t t, int64_t r) const { return tiles + t * tile + r * ld; }
  static BlockView of(const std::optional<Tensor>& blocks, const std::optional<Tensor>& tiles,
                      const std::optional<Tensor>& spans, int64_t nqb, int64_t nkb) {
    BlockView b;
    if (!blocks.has_value() || !blocks->defined()) return b;
    TORCH_CHECK(blocks->scalar_type() == at::kInt && blocks->dim() == 5 &&
                    blocks->size(3) == nqb && blocks->size(4) == nkb,
                "qkv flash: blocks must be an int32 (Nb, h_kv, G, q blocks, k blocks) view "
                "matching block_q, block_k");
    TORCH_CHECK(tiles.has_value() && tiles->scalar_type() == at::kBool && tiles->dim() == 3 &&
                    tiles->is_contiguous(),
                "qkv flash: tiles must be a contiguous bool (P, bq, bk) tensor");
    b.idx = blocks->const_data_ptr<int32_t>();
    for (int x = 0; x < 5; ++x) b.s[x] = blocks->stride(x);
    b.h_kv = blocks->size(1);
    b.tiles = reinterpret_cast<const uint8_t*>(tiles->const_data_ptr<bool>());
    b.ld = tiles->size(2), b.tile = tiles->size(1) * tiles->size(2);
    TORCH_CHECK(spans.has_value() && spans->scalar_type() == at::kInt && spans->is_contiguous() &&
                    spans->numel() == tiles->size(0) * tiles->size(1) * 2,
                "qkv flash: spans must be a contiguous int32 (P, bq, 2) tensor");
    b.spans = spans->const_data_ptr<int32_t>();
    return b;
  }
};

// Rows per group of the narrowed matmuls (see row_groups): 16 and 32 measured alike
// (dense time / masked time 1.03-1.23 on documents and sink+window at T=16384), 32 makes
// half the calls and gives the backward's dV, dK updates twice the reduction length.
constexpr int64_t kGroup = 32;

// The key ranges [glo, ghi) (16-aligned, within [0, nk)) that groups of kGroup rows of a
// query block (rows from qs) see in the key block [ks, ks + nk): the union of their rows'
// ranges (causal/window structure, spans of a block mask's partial tile; a row read through
// mask bytes counts whole). Returns the number of groups, 1 (glo = 0, ghi = nk: all rows at
// once) when no group would be narrower than the block.
static int64_t row_groups(const Structure& st, const BlockView& bv, int32_t bst, int64_t qs,
                          int64_t rows, int64_t ks, int64_t nk, int64_t* glo, int64_t* ghi) {
  glo[0] = 0, ghi[0] = nk;
  const bool edge = st.lo(qs + rows - 1) > ks || st.hi(qs) < ks + nk;
  if ((bst < 0 && !edge) || rows <= kGroup) return 1;
  const int64_t ng = (rows + kGroup - 1) / kGroup;
  bool narrower = false;
  for (int64_t gi = 0; gi < ng; ++gi) {
    int64_t lo = nk, hi = 0;
    for (int64_t r = gi * kGroup; r < std::min(rows, (gi + 1) * kGroup); ++r) {
      int64_t c0 = std::clamp<int64_t>(st.lo(qs + r) - ks, 0, nk);
      int64_t c1 = std::clamp<int64_t>(st.hi(qs + r) - ks, 0, nk);
      if (bst >= 0) bv.row(bst, r, c0, c1);
      if (c1 > c0) lo = std::min(lo, c0), hi = std::max(hi, c1);
    }
    if (hi <= lo) {
      lo = hi = 0;
    } else {
      lo = lo / 16 * 16, hi = std::min<int64_t>(nk, (hi + 15) / 16 * 16);
    }
    glo[gi] = lo, ghi[gi] = hi;
    narrower |= lo > 0 || hi < nk;
  }
  if (!narrower) {
    glo[0] = 0, ghi[0] = nk;
    return 1;
  }
  return ng;
}

// f(r0, nr, c, nc) for each of the ng row groups that sees a key: rows [r0, r0 + nr) and
// key columns [c, c + nc) of the block (one group of all rows when ng == 1)
template <typename F>
static inline void for_each_group(int64_t ng, int64_t rows, const int64_t* glo,
                                  const int64_t* ghi, F&& f) {
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t r0 = gi * kGroup, nr = ng == 1 ? rows : std::min(kGroup, rows - r0);
    const int64_t c = glo[gi], nc = ghi[gi] - c;
    if (nc > 0) f(r0, nr, c, nc);  // else every row of the group sees no key here: p = 0
  }
}

template <typename T>
static void forward_impl(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                         Tensor& lse, double scale_d, const Structure& st, int64_t bq,
                         int64_t bk, bool vnni, const MaskView& mk, const Variant& var,
                         const BlockView& bv, bool dot = false) {
  const Dims D0 = Dims::of(q, k, v);
  const int64_t N = D0.N, G = D0.G, Tq = D0.Tq, d = D0.d, Tk = D0.Tk, dv = D0.dv;
  // with variants the rows hold logits (see Variant): the exponent's factor is log2e alone
  const float scale = var.on ? 1.f : static_cast<float>(scale_d), c2 = scale * kLog2e;
  const T *qd = q.const_data_ptr<T>(), *kd = k.const_data_ptr<T>(), *vd = v.const_data_ptr<T>();
  T* od = out.data_ptr<T>();
  float* ld = lse.data_ptr<float>();

  // K/V copies, cached per calling thread between calls (see HugeBuffer)
  static thread_local std::vector<PreparedKV<T>> prep_cache;
  if (static_cast<int64_t>(prep_cache.size()) < N) prep_cache.resize(N);
  std::vector<PreparedKV<T>>& prep = prep_cache;
  parallel_strided(N, [&](int64_t first, int64_t e, int64_t step) {
    for (int64_t n = first; n < e; n += step)
      prep[n].prepare(kd + n * Tk * d, vd + n * Tk * dv, d, dv, Tk, bk, vnni, dot);
  });

  const int64_t nqb = (Tq + bq - 1) / bq;
  const int64_t rbk = prep[0].rbk, rdv = prep[0].rdv;  // row lengths of S and P, of acc
  parallel_strided(N * G * nqb, [&](int64_t first, int64_t end, int64_t step) {
    Scratch sc(Scratch::pages(bq * rbk * 4) + Scratch::pages(bq * rbk * sizeof(T)) +
               Scratch::pages(bq * rdv * 4));
    float* S = sc.take<float>(bq * rbk);
    T* P = sc.take<T>(bq * rbk);  // p of a block (its own buffer: see the lazy max below)
    float* acc = sc.take<float>(bq * rdv);
    std::vector<float> m(bq), l(bq), alpha(bq);
    std::vector<uint8_t> mb(var.on ? bk : 0);
    std::vector<int64_t> glo_v(bq / kGroup + 2), ghi_v(bq / kGroup + 2);
    int64_t* glo = glo_v.data();
    int64_t* ghi = ghi_v.data();
    for (int64_t idx = first; idx < end; idx += step) {
      const int64_t n = idx / (G * nqb), g = (idx / nqb) % G, qb = idx % nqb;
      const int64_t qs = qb * bq, rows = std::min(bq, Tq - qs);
      const PreparedKV<T>& kv = prep[n];
      const T* Q = qd + ((n * G + g) * Tq + qs) * d;
      std::fill(m.begin(), m.begin() + rows, kNegInf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      std::fill(acc, acc + rows * rdv, 0.f);
      const int64_t lo = st.lo(qs), hi = st.hi(qs + rows - 1);
      // key blocks on the global grid of bk (the VNNI packs are per grid block)
      for (int64_t j = lo / bk; j * bk < hi; ++j) {
        const int64_t ks = j * bk, nk = std::min(bk, Tk - ks);
        const int32_t bst = bv.state(n, g, qb, j);
        if (bst == -1) continue;  // an empty block of the block mask
        // Row groups: where the block's rows see only part of its keys (a causal diagonal, a
        // window's edge, a partial tile of a block mask), each group of kGroup rows multiplies
        // only the union of its rows' key ranges, 16-aligned ([glo, ghi)); S and P outside it
        // are never read. Not on the VNNI path (its packs are whole 64-key chunks).
        const int64_t ng = vnni ? 1 : row_groups(st, bv, bst, qs, rows, ks, nk, glo, ghi);
        if (vnni) {
          const int64_t rnk = (nk + kPack - 1) / kPack * kPack;
          for (int64_t c = 0; c < rnk; c += kPack)
            cpublas::brgemm(rows, kPack, d, d, kPack, rbk, false, Q, kv.k_block(j) + c * d,
                            S + c, true);
        } else {
          for_each_group(ng, rows, glo, ghi, [&](int64_t r0, int64_t nr, int64_t c, int64_t nc) {
            if (dot) {
              if constexpr (std::is_same_v<T, BFloat16>)
                dot_mm(nr, nc, d, Q + r0 * d, d, kv.k_dot(j) + (c / 16) * ((d + 1) / 2 * 16), 16,
                       (d + 1) / 2 * 16, S + r0 * rbk + c, rbk, false);
            } else {
              mm<T>(nr, nc, d, Q + r0 * d, d, kv.k_block(j) + c, kv.kld, S + r0 * rbk + c, rbk,
                    false);
            }
          });
        }
        const int64_t enk = vnni ? nk + (nk & 1) : nk;  // P's columns the PV matmul reads
        for (int64_t r = 0; r < rows; ++r) {
          int64_t c0 = std::clamp<int64_t>(st.lo(qs + r) - ks, 0, nk);
          int64_t c1 = std::clamp<int64_t>(st.hi(qs + r) - ks, 0, nk);
          float* s = S + r * rbk;
          T* p = P + r * rbk;
          // mask bytes of this block's keys (none on a full block of a block mask)
          const uint8_t* mr = bst >= 0 ? bv.row(bst, r, c0, c1) : mk.row(n, g, qs + r, ks);
          if (var.on && c1 > c0 && var.row(s, nullptr, n, g, qs + r, ks, c0, c1))
            mr = finite_mask(s, mr, mb.data(), c0, c1);
          float m_new, a, sum;
          float bmax = c1 <= c0 || m[r] != kNegInf
                           ? kNegInf
                           : row_max_masked(s + c0, mr ? mr + c0 : nullptr, c1 - c0);
          // vmaxps drops a NaN, so a row whose visible scores are all NaN looks empty: look
          // again (only such rows); a NaN score at a visible key makes the row NaN, lse too
          if (bmax == kNegInf && c1 > c0 && m[r] == kNegInf && any_nan(s, mr, c0, c1))
            bmax = std::numeric_limits<float>::quiet_NaN();
          if (c1 <= c0 || (m[r] == kNegInf && bmax == kNegInf)) {  // nothing visible yet
            for (int64_t c = 0; c < enk; ++c) store<T>(p + c, 0.f);
            alpha[r] = 1.f;
            continue;
          }
          if (m[r] != kNegInf) {
            // One pass with the running max kept ("lazy" rescaling, as in FlashAttention-4),
            // redone only if this block's max exceeds it by more than kLazyLog2 in log2 units
            // (p stays below 2^kLazyLog2, harmless in fp32 sums and in bf16). Measured 1.2-1.5x
            // on the bf16 forward at T=4096 (no separate max pass, no rescaling of acc).
            float mx;
            sum = exp_row<T>(s, p, c0, c1, enk, c2, m[r], &mx, mr);
            if (!(mx - m[r] > kLazyLog2 / c2)) {  // (also when the mask hid every key: mx = -inf)
              m_new = m[r], a = 1.f;
            } else {
              m_new = mx, a = exp2_neg((m[r] - m_new) * c2);
              sum = exp_row<T>(s, p, c0, c1, enk, c2, m_new, nullptr, mr);
            }
          } else {
            m_new = bmax, a = 0.f;  // first visible key: nothing to rescale
            sum = exp_row<T>(s, p, c0, c1, enk, c2, m_new, nullptr, mr);
          }
          l[r] = l[r] * a + sum;
          m[r] = m_new;
          alpha[r] = a;
        }
        for (int64_t r = 0; r < rows; ++r) {
          if (alpha[r] == 1.f) continue;
          float* o = acc + r * rdv;
          const float a = alpha[r];
#pragma omp simd
          for (int64_t c = 0; c < rdv; ++c) o[c] *= a;
        }
        if (vnni) {
          for (int64_t c = 0; c < dv; c += kPack)
            cpublas::brgemm(rows, kPack, enk, rbk, kPack, rdv, true, P, kv.v_block(j) + c * enk,
                            acc + c, true);
        } else {
          for_each_group(ng, rows, glo, ghi, [&](int64_t r0, int64_t nr, int64_t c, int64_t nc) {
            if (dot) {
              if constexpr (std::is_same_v<T, BFloat16>)
                dot_mm(nr, dv, nc, P + r0 * rbk + c, rbk, kv.v_dot(j) + (c / 2) * kv.rdv16,
                       kv.rdv16, 16, acc + r0 * rdv, rdv, true);
            } else {
              mm<T>(nr, dv, nc, P + r0 * rbk + c, rbk, vd + (n * Tk + ks + c) * dv, dv,
                    acc + r0 * rdv, rdv, true);
            }
          });
        }
      }
      T* O = od + ((n * G + g) * Tq + qs) * dv;
      float* L = ld + (n * G + g) * Tq + qs;
      for (int64_t r = 0; r < rows; ++r) {
        const bool empty = l[r] == 0.f;  // no visible key: zeros, lse = -inf
        // every logit -inf (masked, or through an inf in q or k): zeros whatever the values
        // (acc may hold 0 · NaN)
        const float inv = empty ? 0.f : 1.f / l[r];
        const float* a = acc + r * rdv;
        for (int64_t c = 0; c < dv; ++c) store<T>(O + r * dv + c, empty ? 0.f : a[c] * inv);
        L[r] = empty ? kNegInf : m[r] * scale + std::log(l[r]);
      }
    }
    if (vnni) cpublas::brgemm_release(true);
  });
  size_t kept = 0;
  for (const auto& p : prep) kept += p.bytes();
  if (kept > kKeepBytes)
    for (auto& p : prep) p.release();
}

// Whether a bf16 forward runs on qkv's own AMX tile kernel (flash_amx.cpp): the AMX path,
// no mask, variant or block mask, head dims it takes (QKV_BF16_MATMUL=onednn: oneDNN's
// brgemm on AMX tiles, as masks and variants take)
static bool amx_tiles(Bf16Path path, const MaskView& mk, const Variant& var,
                      const BlockView& bv, int64_t d, int64_t dv) {
#ifdef QKV_FLASH_AMX
  const char* env = std::getenv("QKV_BF16_MATMUL");
  return path == Bf16Path::kAmx && !mk.base && !var.on && !bv.idx &&
         qkv_flash_amx::applies(d, dv) && !(env && std::string(env) == "onednn");
#else
  (void)path, (void)mk, (void)var, (void)bv, (void)d, (void)dv;
  return false;
#endif
}

std::tuple<Tensor, Tensor> flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const std::optional<Tensor>& mask, double scale,
                                     bool causal, int64_t window, int64_t block_q,
                                     int64_t block_k, const std::optional<Tensor>& bias,
                                     const std::optional<Tensor>& alibi,
                                     const std::optional<Tensor>& rel,
                                     std::optional<double> softcap,
                                     const std::optional<Tensor>& blocks,
                                     const std::optional<Tensor>& tiles,
                                     const std::optional<Tensor>& spans) {
  const MaskView mk = MaskView::of(mask);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.dim() == 3, "qkv flash_fwd: bad ranks");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "qkv flash_fwd: inputs must be contiguous");
  TORCH_CHECK(scale > 0 && std::isfinite(static_cast<float>(scale)),
              "qkv flash_fwd: scale must be finite and > 0 in fp32");
  TORCH_CHECK(q.size(3) > 0 && q.size(3) == k.size(2) && v.size(2) > 0,
              "qkv flash_fwd: head dims must be >= 1 and q, k must share theirs");
  const Structure st{q.size(2), k.size(1), causal, window};
  const Variant var = Variant::of(bias, alibi, rel, softcap, scale, q.size(1), q.size(2),
                                  k.size(1));
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(2)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 || k.size(1) == 0) {  // no score: zeros, lse = -inf (no work, no
    out.zero_();                            // buffer indexed)
    lse.fill_(kNegInf);
    return {out, lse};
  }
  // a block never exceeds the sequence (the scratch buffers are sized by the blocks)
  block_q = std::clamp<int64_t>(block_q, 1, q.size(2));
  block_k = std::clamp<int64_t>(block_k, 1, k.size(1));
  const BlockView bv = BlockView::of(blocks, tiles, spans, (q.size(2) + block_q - 1) / block_q,
                                     (k.size(1) + block_k - 1) / block_k);
  if (q.scalar_type() == at::kFloat) {
    forward_impl<float>(q, k, v, out, lse, scale, st, block_q, block_k, false, mk, var, bv);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "qkv flash_fwd: fp32 or bf16 only");
    const Bf16Path path = bf16_path(q.size(3));
    if (path == Bf16Path::kWiden) {
      Tensor out32 = at::empty(out.sizes(), lse.options());
      forward_impl<float>(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), out32, lse,
                          scale, st, block_q, block_k, false, mk, var, bv);
      out.copy_(out32);
    } else if (amx_tiles(path, mk, var, bv, q.size(3), v.size(2))) {
#ifdef QKV_FLASH_AMX
      qkv_flash_amx::forward(q, k, v, out, lse, scale, causal, window, st.shift);
#endif
    } else {
      forward_impl<BFloat16>(q, k, v, out, lse, scale, st, block_q, block_k,
                             path == Bf16Path::kAmx, mk, var, bv, path == Bf16Path::kDot);
    }
  }
  return {out, lse};
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

}  // namespace

TORCH_LIBRARY(qkv_flash, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, int window, "
        "int block_q, int block_k, Tensor? bias=None, Tensor? alibi=None, Tensor? rel=None, "
        "float? softcap=None, Tensor? blocks=None, Tensor? tiles=None, Tensor? spans=None) -> "
        "(Tensor, Tensor)");
  m.def("bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor? mask, "
        "float scale, bool causal, int window, int block_q, int block_k, Tensor? bias=None, "
        "Tensor? alibi=None, Tensor? rel=None, float? softcap=None, Tensor? blocks=None, "
        "Tensor? tiles=None, Tensor? spans=None, Tensor(a!)? dbias=None, Tensor(b!)? drel=None, "
        "Tensor(c!)? dalibi=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qkv_flash, CPU, m) {
  m.impl("fwd", &flash_fwd);
  m.impl("bwd", &flash_bwd);
}

namespace {
// fwd/bwd with query row i at key position Tk - Tq + shift + i (see tl_shift)
struct ShiftScope {
  explicit ShiftScope(int64_t s) { tl_shift = s; }
  ~ShiftScope() { tl_shift = 0; }
};

std::tuple<Tensor, Tensor> flash_fwd_at(const Tensor& q, const Tensor& k, const Tensor& v,
                                        double scale, bool causal, int64_t window,
                                        int64_t block_q, int64_t block_k, int64_t shift) {
  ShiftScope at(shift);
  const std::optional<Tensor> none;  // no mask, bias or block mask in ring blocks
  return flash_fwd(q, k, v, none, scale, causal, window, block_q, block_k, none, none, none,
                   std::nullopt, none, none, none);
}

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
}  // namespace qkv

// Which bf16 matmul path runs here (QKV_BF16_MATMUL, the level and the CPU decide; see
// Bf16Path), the level this build was compiled for, and the kernels with a query offset for ring attention's blocks.
TORCH_LIBRARY_FRAGMENT(qkv_flash, m) {
  m.def("bf16_path() -> str", []() { return isa_name(); });
  m.def("level() -> str", []() { return std::string(QKV_LEVEL_NAME); });
  m.def("fwd_at(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window, "
        "int block_q, int block_k, int shift) -> (Tensor, Tensor)");
  m.def("bwd_at(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, "
        "float scale, bool causal, int window, int block_q, int block_k, int shift) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qkv_flash, CPU, m) {
  m.impl("fwd_at", &flash_fwd_at);
  m.impl("bwd_at", &flash_bwd_at);
}
