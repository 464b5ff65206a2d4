// bf16 matmuls of the flash kernels on CPUs without AMX (qkv's AVX512_BF16 dot-product
// micro-kernel and its pair layouts) and the choice of path bf16 calls take (Bf16Path).
#pragma once

#include "flash_amx.h"
#include "flash_memory.h"

namespace {

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
static inline void dot_tile(int64_t K, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t bkk,
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
static inline void dot_mm(int64_t M, int64_t N, int64_t K, const BFloat16* A_, int64_t lda,
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
static inline void dot_mm(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const uint32_t*, int64_t,
                   int64_t, float*, int64_t, bool) {
  TORCH_CHECK(false, "qkv flash: built without AVX512_BF16");
}
#endif

// Pair layout of B = Xᵀ for X (n x K, row-major, ld K), e.g. S = Q Kᵀ: chunks of 16 rows of
// X, each (ceil(K/2) pairs x 16) uint32; rows past n and the pad of an odd K are 0.
// Column block j of B is at out + j·ceil(K/2)·16 (bnb), pair kk at + kk·16 (bkk = 16).
static inline void pack_chunks(const BFloat16* x_, int64_t n, int64_t K, uint32_t* out) {
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
static inline void pack_row_pairs(const BFloat16* x_, int64_t rows, int64_t n, int64_t ld,
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
static inline Bf16Path bf16_path(int64_t d) {
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
inline std::string isa_name() {
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

}  // namespace
