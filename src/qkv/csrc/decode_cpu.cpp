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
//
// Files (one translation unit per level: this file includes the others):
//   decode_mask.h        which keys a row may see (causal, window, bool mask)
//   decode_common.h      constants, dtype conversions, Problem, Scratch, path settings
//   decode_qk_avx512.h   the scores on AVX-512 (fp32, bf16 pairs, int8 on int16, broadcasts)
//   decode_pv_avx512.h   acc += P V on AVX-512
//   decode_avx2.h        the avx2 level's loops (and fp32 with few rows on AVX-512)
//   decode_softmax.h     the online softmax of one block
//   decode_int16.h       int8 K/V on int16 pairs: the setting and P·V
//   decode_segment.h     one segment's block loop; int8 with many rows widened run by run
//   decode_amx.h         bf16 K/V on AMX tiles
//   decode_cpu.cpp       (here) the split of the keys over threads, the merge of the
//                        segments, the choice of path, argument checks and the op
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

#if defined(__x86_64__)
#include <cpuid.h>  // amd_family(): which AVX-512 CPU this is
#endif

#include "decode_segment.h"  // decode_common.h and the vector pieces
#include "decode_amx.h"

namespace {

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
