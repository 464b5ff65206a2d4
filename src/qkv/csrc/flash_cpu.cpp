// qkv's fused CPU flash-attention kernel, fp32 and bf16: the forward (this file), the backward
// (flash_bwd.cpp), the bf16 forward on AMX tiles (flash_amx.cpp) and their shared parts
// (flash_softmax.h: softmax rows and causal/window structure; flash_masks.h; flash_variants.h;
// flash_bf16.h: bf16 matmuls without AMX; flash_memory.h: threads and buffers).
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

#include "flash_amx.h"
#include "flash_bf16.h"
#include "flash_masks.h"
#include "flash_memory.h"
#include "flash_softmax.h"
#include "flash_variants.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;
namespace cpublas = at::native::cpublas;

constexpr int64_t kPack = 64;  // oneDNN's VNNI pack takes blocks of 64 columns






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

// Whether a block mask's visited blocks are mostly partial ones (tiles), where brgemm's row
// groups beat the tile kernel, whose partial steps take the row code: bf16, T = 8192, d = 64,
// block 128, 1 thread, side by side: 16 packed documents (54 % of visited blocks partial)
// 0.91x the brgemm path, sink + window (29 %) 1.02x, prefix-LM (2 %) 1.36x
#ifdef QKV_FLASH_AMX
static bool mostly_partial(const Tensor& blocks) {
  const int64_t visited = blocks.ne(-1).sum().item<int64_t>();
  return 2 * blocks.ge(0).sum().item<int64_t>() > visited;
}
#endif

// Whether a bf16 forward runs on qkv's own AMX tile kernel (flash_amx.cpp): the AMX path,
// no mask or variant, a block mask only on whole 32-row, 32-key chunks and not mostly
// partial (unless QKV_BF16_MATMUL=amx asks for the tiles), head dims it takes
// (QKV_BF16_MATMUL=onednn: oneDNN's brgemm on AMX tiles, as masks and variants take)
static bool amx_tiles(Bf16Path path, const MaskView& mk, const Variant& var,
                      const BlockView& bv, const std::optional<Tensor>& blocks, int64_t d,
                      int64_t dv, int64_t block_q, int64_t block_k) {
#ifdef QKV_FLASH_AMX
  const char* env = std::getenv("QKV_BF16_MATMUL");
  const std::string want = env ? env : "auto";
  return path == Bf16Path::kAmx && !mk.base && !var.on && qkv_flash_amx::applies(d, dv) &&
         want != "onednn" &&
         (!bv.idx || (qkv_flash_amx::applies_blocks(block_q, block_k) &&
                      (want == "amx" || !mostly_partial(*blocks))));
#else
  (void)path, (void)mk, (void)var, (void)bv, (void)blocks, (void)d, (void)dv, (void)block_q,
      (void)block_k;
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
    } else if (amx_tiles(path, mk, var, bv, blocks, q.size(3), v.size(2), block_q, block_k)) {
#ifdef QKV_FLASH_AMX
      qkv_flash_amx::forward(q, k, v, out, lse, scale, causal, window, st.shift, blocks, tiles,
                             spans, block_q, block_k);
#endif
    } else {
      forward_impl<BFloat16>(q, k, v, out, lse, scale, st, block_q, block_k,
                             path == Bf16Path::kAmx, mk, var, bv, path == Bf16Path::kDot);
    }
  }
  return {out, lse};
}

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
}


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
}
