// One set of instruction-set macros and the scalar helpers every kernel shares.
//
// Each kernel source is compiled once per level (qkv/kernels/_levels.py: portable, avx2,
// avx512, avx512_bf16; neon on aarch64) with that level's -march flags; the code below and
// the kernels' #if blocks pick what a level has from the compiler's own feature macros:
//   QKV_AVX512       AVX-512 F + BW + VL (16 fp32 lanes, byte/word masks)
//   QKV_AVX512_BF16  + AVX512_BF16 (vdpbf16ps, vcvtneps2bf16)
//   QKV_VNNI512      + AVX512_VNNI (vpdpbusd, vpdpwssd) compiled in (the avx512_bf16 build); the
//                    avx512 build issues them by inline asm where the CPU has them (vnni512_allowed)
//   QKV_AVX2         AVX2 + FMA + F16C (8 fp32 lanes; also defined on AVX-512 levels)
// Only the loaded level runs, and only on a CPU that has its instructions (the loader checks).
#pragma once

#include <c10/util/BFloat16.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QKV_AVX512 1
#endif
#if defined(QKV_AVX512) && defined(__AVX512BF16__)
#define QKV_AVX512_BF16 1
#endif
#if defined(QKV_AVX512) && defined(__AVX512VNNI__)
#define QKV_VNNI512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QKV_AVX2 1
#endif
#if defined(__x86_64__) && (defined(QKV_AVX2) || defined(QKV_AVX512))
#include <immintrin.h>
#endif

// QKV_LEVEL: the level's name as a bare token (-DQKV_LEVEL=avx2, set by the build: setup.py or
// the just-in-time build; a token survives every shell and build tool, a string may not)
#define QKV_STR_(x) #x
#define QKV_STR(x) QKV_STR_(x)
#ifdef QKV_LEVEL
#define QKV_LEVEL_NAME QKV_STR(QKV_LEVEL)
#else
#define QKV_LEVEL_NAME "unknown"
#endif

namespace qkv_simd {

// fp32 -> bf16 bits, round to nearest even (finite inputs; see to_bf16 for NaN)
inline uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 2^t for t <= 0 (0 below 2^-126, also for t = -inf): round-to-nearest split t = n + f,
// |f| <= 1/2, a degree-5 polynomial of 2^f fitted for relative error (< 2e-7), 2^n from the
// exponent bits. Branch-free so that `omp simd` vectorises it. t is clamped at 64 so that
// the exponent bits can never overflow.
// The polynomial of 2^f on [-1/2, 1/2], highest degree first: degree 5, fitted for the
// relative error (< 2e-7); every exp2 below (scalar, AVX2, AVX-512) evaluates it.
constexpr float kExp2[6] = {0.0013264614390209317f, 0.009671480394899845f, 0.05550733581185341f,
                            0.24022242426872253f, 0.6931470036506653f, 1.0f};
// degree 4 (< 3e-6), for bf16 probabilities (rounded to 8 bits before the P·V matmul anyway)
constexpr float kExp2Low[5] = {0.009582719765603542f, 0.05590607225894928f,
                               0.24024099111557007f, 0.6931242346763611f, 1.0f};

inline float exp2_neg(float t) {
  const float tc = t < -126.f ? -126.f : (t > 64.f ? 64.f : t);
  const float n = (tc + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick)
  const float f = tc - n;
  float p = kExp2[0];
  for (int i = 1; i < 6; ++i) p = p * f + kExp2[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return t < -126.f ? 0.f : p * scale;
}

// QKV_ISA as set (lower case, without surrounding spaces, as the loader reads it; empty if
// unset): the loader has checked it against the CPU
inline std::string isa_setting() {
  const char* e = std::getenv("QKV_ISA");
  std::string s = e ? e : "";
  const size_t b = s.find_first_not_of(" \t\n\r\f\v");
  s = b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(" \t\n\r\f\v") - b + 1);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Whether AMX tiles may be used, qkv's own or oneDNN's: only in the build whose level has
// them, and not when QKV_ISA=avx512_bf16 asks for that level on a CPU that also has AMX (the
// tiles also need the OS's permission and oneDNN's view of the CPU, which the kernels
// check). A lower level forced on an AMX machine (QKV_ISA=avx2, avx512) then takes the
// paths it takes on a CPU without AMX, so that measuring it there measures that level.
inline bool amx_allowed() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool ok = isa_setting() != "avx512_bf16";
  return ok;
#else
  return false;
#endif
}

// Whether the avx2 build's int8 loops may issue AVX-VNNI (vpdpwssd, vpdpbusd on 8 lanes).
// It is not part of x86-64-v3, so that build is compiled without it (GCC would otherwise use
// it in any loop it vectorises) and the loops that want it issue it by inline asm
// (dpwssd below), where the CPU has it and QKV_ISA is not plain avx2 (which then runs
// as on a CPU without it; QKV_ISA=avx2_vnni is the same build with it on).
inline bool avxvnni_allowed() {
#if defined(QKV_AVX2) && !defined(QKV_AVX512)
  static const bool ok = __builtin_cpu_supports("avxvnni") && isa_setting() != "avx2";
  return ok;
#else
  return false;
#endif
}

// Whether the AVX-512 int8 loops may issue AVX512_VNNI (vpdpwssd, vpdpbusd on 16 lanes):
// always in the avx512_bf16 build, compiled with it. The avx512 build is compiled without it
// (x86-64-v4 lacks it) and issues it by inline asm (dpwssd, dpbusd below) where the CPU has
// it (Cascade Lake, Ice Lake, Tiger Lake: QKV_ISA=avx512_vnni) and QKV_ISA is not plain
// avx512, which then runs as on a CPU without it (Skylake-X), as avx2 and avx2_vnni do.
inline bool vnni512_allowed() {
#if defined(QKV_VNNI512)
  return true;
#elif defined(QKV_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512vnni") && isa_setting() != "avx512";
  return ok;
#else
  return false;
#endif
}

#if defined(QKV_AVX2) || defined(QKV_AVX512)
// one cache line into L2, ahead of its use (the kernels' software prefetch)
inline void pf_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

#ifdef QKV_AVX2
// ---- 8 fp32 lanes (AVX2 + FMA) ---------------------------------------------------------

// 8 values as fp32: fp32 as is, bf16 widened (a 16-bit shift: bf16 is the top half of an
// fp32), int8 converted
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline __m256 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// a += the int16 pair products of x and y, 8 int32 lanes: vpdpwssd (AVX-VNNI) in one
// instruction, or vpmaddwd then vpaddd. The add is in a's register either way: GCC otherwise
// adds into the product's and copies the sum back, one more instruction per product (Zen 5,
// int8 decode from L3: 1.15-1.2x faster in place).
template <bool kVnni>
inline void dpwssd(__m256i& a, __m256i x, __m256i y) {
  if constexpr (kVnni) asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(a) : "x"(x), "x"(y));
  else asm("vpaddd %1, %0, %0" : "+x"(a) : "x"(_mm256_madd_epi16(x, y)));
}

// f(std::true_type{}) where the avx2 build's int8 loops may issue AVX-VNNI, else
// f(std::false_type{}) (as with_vnni512 below)
template <typename F>
inline auto with_avxvnni(F&& f) {
  return avxvnni_allowed() ? f(std::true_type{}) : f(std::false_type{});
}

// a += Σ of 4 products of unsigned bytes u and signed bytes s, per int32 lane: vpdpbusd
// (AVX-VNNI; exact, this form does not saturate). Only where avxvnni_allowed().
inline void dpbusd(__m256i& a, __m256i u, __m256i s) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(a) : "x"(u), "x"(s));
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// lane i = the sum of the 8 lanes of a[i] (a transpose-and-add tree)
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 values -> dst: fp32 as is, bf16 rounded to nearest even (finite x, as to_bf16_bits)
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  __m256i u = _mm256_castps_si256(x);
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                            _mm256_set1_epi32(1))));
  u = _mm256_srli_epi32(u, 16);  // < 2^16: packus's unsigned saturation never bites
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// all-ones lanes where the mask byte m[i] is nonzero (True = may attend); reads 8 bytes
inline __m256 allowed8(const uint8_t* m) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
  return _mm256_castsi256_ps(
      _mm256_xor_si256(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(-1)));
}

// 2^t for 8 lanes of t <= 0 (as exp2_neg: 0 below 2^-126 and for -inf; NaN stays NaN);
// kLow: the degree-4 polynomial (bf16 probabilities)
template <bool kLow = false>
inline __m256 exp2_v8(__m256 t) {
  // max/min return their second operand when one is NaN: t second keeps a NaN
  const __m256 tc = _mm256_min_ps(_mm256_set1_ps(64.f), _mm256_max_ps(_mm256_set1_ps(-127.f), t));
  const __m256 n = _mm256_round_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(tc, n);
  const float* c = kLow ? kExp2Low : kExp2;
  constexpr int kTerms = kLow ? 5 : 6;
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < kTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  // 2^n from the exponent bits; n = -127 gives 0 (so does every t below -126.5)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  // t < -126: 0, as exp2_neg (a NaN compares false and stays)
  return _mm256_andnot_ps(_mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_LT_OQ), r);
}
#endif  // QKV_AVX2

#ifdef QKV_AVX512
// a += the int16 pair products of x and y, 16 int32 lanes: vpdpwssd (AVX512_VNNI; the
// intrinsic where the build has it, else inline asm: only where vnni512_allowed()), or
// vpmaddwd then vpaddd
template <bool kVnni>
inline void dpwssd(__m512i& a, __m512i x, __m512i y) {
#ifdef QKV_VNNI512
  if constexpr (kVnni) a = _mm512_dpwssd_epi32(a, x, y);
#else
  if constexpr (kVnni) asm("vpdpwssd %2, %1, %0" : "+v"(a) : "v"(x), "v"(y));
#endif
  else a = _mm512_add_epi32(a, _mm512_madd_epi16(x, y));
}

// a += Σ of 4 products of unsigned bytes u and signed bytes s, per int32 lane, 16 lanes:
// vpdpbusd (AVX512_VNNI, as dpwssd). Only where vnni512_allowed().
inline void dpbusd(__m512i& a, __m512i u, __m512i s) {
#ifdef QKV_VNNI512
  a = _mm512_dpbusd_epi32(a, u, s);
#else
  asm("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(s));
#endif
}

// f(std::true_type{}) where the AVX-512 int8 loops may issue AVX512_VNNI, else
// f(std::false_type{}): the build with it compiled in instantiates only the first
template <typename F>
inline auto with_vnni512(F&& f) {
#ifdef QKV_VNNI512
  return f(std::true_type{});
#else
  return vnni512_allowed() ? f(std::true_type{}) : f(std::false_type{});
#endif
}

inline __mmask16 lanes(int64_t n) {  // the first n (0..16) lanes of a 16-lane vector
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}

// 2^t for 16 lanes of finite t <= 0 (lanes off in k give 0): t = n + f with |f| <= 1/2,
// 2^n by scalef (exact, down to 0 through the denormals); kLow: the degree-4 polynomial.
template <bool kLow>
inline __m512 exp2_v(__m512 t, __mmask16 k) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  const float* c = kLow ? kExp2Low : kExp2;
  constexpr int kTerms = kLow ? 5 : 6;
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < kTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return k == 0xffff ? _mm512_scalef_ps(p, n) : _mm512_maskz_scalef_ps(k, p, n);
}
#endif  // QKV_AVX512

}  // namespace qkv_simd
