// The bf16 flash forward on AMX tiles, written for the tiles rather than through oneDNN's
// brgemm, so that the tile multiplies overlap the softmax.
//
// Per item (a kv head n, a query head g, a block of kBQ = 32 query rows), over key blocks of
// kBK keys:
//   S = Q Kᵀ    Q (the A operand) read in place, two row tiles of 16; Kᵀ packed once per call
//               and kv head in VNNI pairs of dims (the B operand), 16 keys per tile
//   P = softmax rows of S (online, with the lazy rescaling of flash_cpu.cpp's forward), bf16
//   O += P V    P read in place as the A operand, V packed once in VNNI pairs of keys
// Each multiply is cut into units of 2 x 2 output tiles (tiles 0-3 accumulate, 4-5 hold A, 6-7
// B) that each run their whole reduction. AMX executes beside the vector units, but the
// out-of-order window (a few hundred instructions) only overlaps what lies close together in
// program order: so while the softmax walks block j's rows, the units of S for block j + 1
// and of P V for block j - 1 are issued between its rows, one unit every few rows. O is
// scaled where block j raised a row's max, after P V of block j - 1 and before that of j.
//
// A step (a sub-block of rows with a key block) multiplies only the chunks of 32 keys some of
// its rows see: a causal diagonal block costs about half the tile work of a full one.
//
// Rows follow the NaN/inf rule of flash_cpu.cpp's forward. Plain rows (the whole block seen,
// a finite max) are inline, a row's first block with its max taken in registers; the row code
// serves the rest (a partial range, a max that moved, NaN or inf).
#include "flash_amx.h"

#ifdef QKV_FLASH_AMX

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "amx_tiles.h"
#include "flash_masks.h"   // BlockView
#include "flash_memory.h"  // parallel_strided, Scratch

#include <vector>

namespace {

constexpr int64_t kBQ = 32;   // query rows per item: two row tiles
constexpr int64_t kBK = 256;  // keys per block
// Sub-blocks per item: a key block's packed K and V (128 KiB at d = 128) are read from L2 by
// kSub sub-blocks in turn rather than streamed from L3 for each (T = 4096, d = 128: the tile
// work alone at 1.2 TFLOP/s with 8, 0.8 with 1)
constexpr int64_t kSub = 8;
// Points per step where the pending tile work is issued: at rows 0 and kBQ / 2. Issuing it
// row by row overlapped no better than in one or two bursts (measured side by side, T = 4096)
constexpr int64_t kIssues = 2;

// K and V of every kv head in the tiles' B layout, keys padded with zeros to whole blocks:
//   kp[n][key tile t][dim chunk c][pair p][key j] = (K[16t + j][32c + 2p], K[..][32c + 2p + 1])
//   vp[n][key chunk u][col tile x][pair p][col j] = (V[32u + 2p][16x + j], V[32u + 2p + 1][..])
// (uint32 pairs of bf16: one tile row is 16 pairs, 64 bytes; one tile 1 KiB, contiguous)
struct Packed {
  at::Tensor kbuf, vbuf;
  const uint32_t *kp, *vp;
  int64_t Tkp, nc, nx;  // padded keys, dim chunks of 32, value column tiles of 16
  const uint32_t* ktile(int64_t n, int64_t t, int64_t c) const {
    return kp + ((n * (Tkp / 16) + t) * nc + c) * 256;
  }
  const uint32_t* vtile(int64_t n, int64_t u, int64_t x) const {
    return vp + ((n * (Tkp / 32) + u) * nx + x) * 256;
  }
};

Packed pack(const at::Tensor& k, const at::Tensor& v) {
  const int64_t N = k.size(0), Tk = k.size(1), d = k.size(2), dv = v.size(2);
  Packed P;
  P.Tkp = (Tk + kBK - 1) / kBK * kBK, P.nc = d / 32, P.nx = dv / 16;
  P.kbuf = at::empty({N * P.Tkp * d / 2}, k.options().dtype(at::kInt));
  P.vbuf = at::empty({N * P.Tkp * dv / 2}, k.options().dtype(at::kInt));
  uint32_t* kp = reinterpret_cast<uint32_t*>(P.kbuf.data_ptr<int32_t>());
  uint32_t* vp = reinterpret_cast<uint32_t*>(P.vbuf.data_ptr<int32_t>());
  P.kp = kp, P.vp = vp;
  const uint32_t* K = reinterpret_cast<const uint32_t*>(k.const_data_ptr<BFloat16>());
  const uint16_t* V = reinterpret_cast<const uint16_t*>(v.const_data_ptr<BFloat16>());
  const int64_t d2 = d / 2, nt = P.Tkp / 16, nu = P.Tkp / 32;
  // K: each tile a 16 x 16 transpose of uint32 pairs (keys to columns), one gather per pair
  // row; V: two keys' rows of 16 bf16 interleaved into 16 pairs. Keys past Tk are zeros.
  const __m512i kidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                           5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(d2)));
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t left = Tk - 16 * t;
        const __mmask16 live = left >= 16 ? __mmask16(0xffff)
                               : left <= 0 ? __mmask16(0)
                                           : __mmask16((1u << left) - 1u);
        const uint32_t* src = K + (n * Tk + 16 * t) * d2;
        for (int64_t c = 0; c < P.nc; ++c) {
          uint32_t* dst = kp + ((n * nt + t) * P.nc + c) * 256;
          for (int64_t p = 0; p < 16; ++p)
            _mm512_storeu_si512(dst + p * 16,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, kidx,
                                                            src + 16 * c + p, 4));
        }
      }
      for (int64_t u = 0; u < nu; ++u)
        for (int64_t x = 0; x < P.nx; ++x) {
          uint32_t* dst = vp + ((n * nu + u) * P.nx + x) * 256;
          for (int64_t p = 0; p < 16; ++p) {
            const int64_t k0 = 32 * u + 2 * p;
            const __m256i z = _mm256_setzero_si256();
            const __m256i r0 = k0 < Tk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             V + (n * Tk + k0) * dv + 16 * x))
                                       : z;
            const __m256i r1 = k0 + 1 < Tk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                 V + (n * Tk + k0 + 1) * dv + 16 * x))
                                           : z;
            _mm512_storeu_si512(dst + p * 16,
                                _mm512_or_si512(_mm512_cvtepu16_epi32(r0),
                                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16)));
          }
        }
    }
  });
  return P;
}

// The two kinds of unit, in phases so that a unit's work can be spread between softmax rows
// (its accumulator tiles stay live across them): phase 0 starts it (zeroes or loads the
// accumulators), phases 1..rounds each multiply one 32-wide slice of the reduction, the last
// stores the accumulators.
//
// S (kBQ x kBK fp32) = the 2 x 2 tiles of unit u (key tiles 2u, 2u + 1 of the block at key
// tile t0): Q (kBQ x d bf16, row stride d) times Kᵀ; rounds = d / 32
inline void s_phase(const Packed& P, int64_t n, int64_t t0, int64_t u, const BFloat16* Q,
                    int64_t d, float* S, int64_t ph) {
  if (ph == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else if (ph <= P.nc) {
    const int64_t c = ph - 1, qs = d * 2;
    _tile_loadd(4, Q + 32 * c, qs);
    _tile_loadd(6, P.ktile(n, t0 + 2 * u, c), 64);
    _tile_loadd(5, Q + 16 * d + 32 * c, qs);
    _tile_loadd(7, P.ktile(n, t0 + 2 * u + 1, c), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  } else {
    constexpr int64_t ss = kBK * 4;
    _tile_stored(0, S + 32 * u, ss);
    _tile_stored(1, S + 32 * u + 16, ss);
    _tile_stored(2, S + 16 * kBK + 32 * u, ss);
    _tile_stored(3, S + 16 * kBK + 32 * u + 16, ss);
  }
}

// O (kBQ x dv fp32, row stride dv) += P (kBQ x kBK bf16) V for unit u (column tiles 2u,
// 2u + 1) of the block at key chunk u0, over its key chunks [c0, c1) (P is 0 outside them);
// rounds = c1 - c0
inline void pv_phase(const Packed& P, int64_t n, int64_t u0, int64_t u, const BFloat16* Pb,
                     float* O, int64_t dv, int64_t ph, int64_t c0, int64_t c1) {
  const int64_t os = dv * 4;
  if (ph == 0) {
    _tile_loadd(0, O + 32 * u, os);
    _tile_loadd(1, O + 32 * u + 16, os);
    _tile_loadd(2, O + 16 * dv + 32 * u, os);
    _tile_loadd(3, O + 16 * dv + 32 * u + 16, os);
  } else if (ph <= c1 - c0) {
    const int64_t c = c0 + ph - 1;
    constexpr int64_t ps = kBK * 2;
    _tile_loadd(4, Pb + 32 * c, ps);
    _tile_loadd(6, P.vtile(n, u0 + c, 2 * u), 64);
    _tile_loadd(5, Pb + 16 * kBK + 32 * c, ps);
    _tile_loadd(7, P.vtile(n, u0 + c, 2 * u + 1), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  } else {
    _tile_stored(0, O + 32 * u, os);
    _tile_stored(1, O + 32 * u + 16, os);
    _tile_stored(2, O + 16 * dv + 32 * u, os);
    _tile_stored(3, O + 16 * dv + 32 * u + 16, os);
  }
}

inline void s_unit(const Packed& P, int64_t n, int64_t t0, int64_t u, const BFloat16* Q,
                   int64_t d, float* S) {
  for (int64_t ph = 0; ph < P.nc + 2; ++ph) s_phase(P, n, t0, u, Q, d, S, ph);
}

inline void pv_unit(const Packed& P, int64_t n, int64_t u0, int64_t u, const BFloat16* Pb,
                    float* O, int64_t dv, int64_t c0, int64_t c1) {
  for (int64_t ph = 0; ph < c1 - c0 + 2; ++ph) pv_phase(P, n, u0, u, Pb, O, dv, ph, c0, c1);
}

// 2^t for the plain rows' p (t <= kLazyLog2 but for the rows sent to the row code): t =
// floor(t) + f with f in [0, 1) in one instruction (vreduceps), 2^f by a degree-3 minimax
// polynomial (relative error 7.5e-5: p is rounded to bf16, 2^-9, before P V), times
// 2^floor(t) by vscalefps (0 below fp32's range).
inline __m512 exp2_p(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, 0x09);  // round down, no precision exception
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.078024514f), f, _mm512_set1_ps(0.22606717f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583356f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999252f));
  return _mm512_scalef_ps(p, t);
}

// One query row's state: m the running max (raw score units), lsum the sum of p in 16 lanes
// (added up once at the end), alpha the factor of O for this block (1: unchanged).
struct RowState {
  float m, alpha;
};

// the row code of flash_cpu.cpp's forward (kept out of line: rare rows); mr: the block's mask
// bytes (1: may attend) or nullptr
__attribute__((noinline)) void row_code(const float* s, BFloat16* p, int64_t c0, int64_t c1,
                                        float c2, RowState& rs, float* lsum,
                                        const uint8_t* mr = nullptr) {
  const float m = rs.m;
  float bmax = c1 <= c0 || m != kNegInf ? kNegInf
                                        : row_max_masked(s + c0, mr ? mr + c0 : nullptr, c1 - c0);
  if (bmax == kNegInf && c1 > c0 && m == kNegInf && any_nan(s, mr, c0, c1))
    bmax = std::numeric_limits<float>::quiet_NaN();
  if (c1 <= c0 || (m == kNegInf && bmax == kNegInf)) {
    std::memset(static_cast<void*>(p), 0, kBK * sizeof(BFloat16));
    return;
  }
  float m_new, a, sum;
  if (m != kNegInf) {
    float mx;
    sum = exp_row<BFloat16>(s, p, c0, c1, kBK, c2, m, &mx, mr);
    if (!(mx - m > kLazyLog2 / c2)) {
      m_new = m, a = 1.f;
    } else {
      m_new = mx, a = exp2_neg((m - m_new) * c2);
      sum = exp_row<BFloat16>(s, p, c0, c1, kBK, c2, m_new, nullptr, mr);
    }
  } else {
    m_new = bmax, a = 0.f;
    sum = exp_row<BFloat16>(s, p, c0, c1, kBK, c2, m_new, nullptr, mr);
  }
  __m512 l = _mm512_mul_ps(_mm512_loadu_ps(lsum), _mm512_set1_ps(a));
  l = _mm512_mask_add_ps(l, 1, l, _mm512_set1_ps(sum));
  _mm512_storeu_ps(lsum, l);
  rs.m = m_new, rs.alpha = a;
}

// p = softmax row of s over [c0, c1) of the block (0 elsewhere), as flash_cpu.cpp's forward
// does it; the plain case (the whole block visible, a finite max that stays within kLazyLog2)
// inline, every other through exp_row.
inline void softmax_row(const float* s, BFloat16* p, int64_t c0, int64_t c1, float c2,
                        RowState& rs, float* lsum) {
  const float m = rs.m;
  rs.alpha = 1.f;
  if (c0 == 0 && c1 == kBK && m != kNegInf && std::fabs(m * c2) < kExactShift) {
    const __m512 vc2 = _mm512_set1_ps(c2), vsh = _mm512_set1_ps(m * c2);
    __m512 e[kBK / 16], sa = _mm512_setzero_ps(), sb = sa;
    for (int i = 0; i < kBK / 16; i += 2) {
      e[i] = exp2_p(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * i), vc2, vsh));
      e[i + 1] = exp2_p(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * i + 16), vc2, vsh));
      sa = _mm512_add_ps(sa, e[i]);
      sb = _mm512_add_ps(sb, e[i + 1]);
    }
    sa = _mm512_add_ps(sa, sb);
    // No max is taken: a score more than kLazyLog2 above m has p > 2^kLazyLog2, and so has
    // its lane's sum (as has +inf); such rows (and rare ones whose lane sums pass it without
    // one) take the row code below, which takes the max and rescales. A NaN score makes p
    // and the sum NaN, the row's answer too, as in the row code.
    if (!_mm512_cmp_ps_mask(sa, _mm512_set1_ps(1 << int(kLazyLog2)), _CMP_GT_OQ)) {
      for (int i = 0; i < kBK / 16; i += 2)
        _mm512_storeu_si512(p + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(e[i + 1], e[i]));
      _mm512_storeu_ps(lsum, _mm512_add_ps(_mm512_loadu_ps(lsum), sa));
      return;
    }
  }
  // A row's first block: its max from the scores in registers, then the same p. As the row
  // code, but for the exp's polynomial: alpha = 0 (O and the sum start from zero) and the
  // sum in lanes; a NaN score, an infinite or a very large max takes the row code.
  if (c0 == 0 && c1 == kBK && m == kNegInf) {
    __m512 x[kBK / 16];
    for (int i = 0; i < kBK / 16; ++i) x[i] = _mm512_loadu_ps(s + 16 * i);
    __m512 mx[kBK / 32];
    for (int i = 0; i < kBK / 32; ++i) mx[i] = _mm512_max_ps(x[2 * i], x[2 * i + 1]);
    for (int w = kBK / 64; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) mx[i] = _mm512_max_ps(mx[i], mx[i + w]);
    const float bmax = _mm512_reduce_max_ps(mx[0]);
    if (std::isfinite(bmax) && std::fabs(bmax * c2) < kExactShift) {
      const __m512 vc2 = _mm512_set1_ps(c2), vsh = _mm512_set1_ps(bmax * c2);
      __m512 sa = _mm512_setzero_ps(), sb = sa;
      for (int i = 0; i < kBK / 16; i += 2) {
        const __m512 e0 = exp2_p(_mm512_fmsub_ps(x[i], vc2, vsh));
        const __m512 e1 = exp2_p(_mm512_fmsub_ps(x[i + 1], vc2, vsh));
        sa = _mm512_add_ps(sa, e0);
        sb = _mm512_add_ps(sb, e1);
        _mm512_storeu_si512(p + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      sa = _mm512_add_ps(sa, sb);
      // vmaxps may pass over a NaN score, but its p and so the sum are NaN: the row code
      if (_mm512_cmp_ps_mask(sa, sa, _CMP_UNORD_Q) == 0) {
        _mm512_storeu_ps(lsum, sa);
        rs.m = bmax, rs.alpha = 0.f;
        return;
      }
    }
  }
  row_code(s, p, c0, c1, c2, rs, lsum);
}

// A row of a masked step (a key block holding an empty or partial block of a block mask):
// narrows the row's keys [c0, c1) to what it sees and returns nullptr where that is one
// contiguous range (empty blocks at either end, full blocks, partial rows that are spans: a
// document's or a window's rows), else fills mrow with the row's mask bytes over the
// chunks and returns it. cs: the states (as BlockView::state) of the block's chunks [kc0, kc1).
inline const uint8_t* block_row(const BlockView& bv, const int32_t* cs, int64_t kc0,
                                int64_t kc1, int64_t ks, int64_t qr, int64_t block_q,
                                int64_t block_k, int64_t& c0, int64_t& c1, uint8_t* mrow) {
  // the visible part of each chunk in turn, while they join up into one range
  int64_t lo = -1, hi = -1;
  bool bytes = false;
  for (int64_t c = std::max(kc0, c0 / 32); c < kc1 && 32 * c < c1 && !bytes; ++c) {
    const int32_t t = cs[c];
    int64_t a = std::max<int64_t>(32 * c, c0), b = std::min<int64_t>(32 * c + 32, c1);
    if (t == -1) {
      a = b;  // nothing seen
    } else if (t >= 0) {
      // the tile's columns of [a, b), narrowed to the row's span (or its bytes: none)
      const int64_t shift = (ks + 32 * c) % block_k - 32 * c;
      int64_t ta = a + shift, tb = b + shift;
      if (bv.row(t, qr % block_q, ta, tb)) {
        bytes = true;
        break;
      }
      a = std::max(a, ta - shift), b = std::min(b, tb - shift);
    }
    if (a >= b) continue;
    if (lo < 0) {
      lo = a, hi = b;
    } else if (a == hi) {
      hi = b;
    } else {
      bytes = true;  // a hole: two ranges
    }
  }
  if (!bytes) {
    if (lo < 0) lo = hi = c0;  // nothing seen
    c0 = lo, c1 = hi;
    return nullptr;
  }
  for (int64_t c = kc0; c < kc1; ++c) {
    const int32_t t = cs[c];
    const int64_t col = (ks + 32 * c) % block_k;
    uint8_t* dst = mrow + 32 * c;
    if (t < 0) {
      std::memset(dst, t == -2 ? 1 : 0, 32);
      continue;
    }
    int64_t a = col, b = col + 32;
    if (const uint8_t* tb = bv.row(t, qr % block_q, a, b)) {
      std::memcpy(dst, tb + col, 32);
    } else {
      for (int64_t x = 0; x < 32; ++x) dst[x] = col + x >= a && col + x < b;
    }
  }
  return mrow;
}

}  // namespace

namespace qkv_flash_amx {

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
             at::Tensor& lse, double scale_d, bool causal, int64_t window, int64_t shift,
             const std::optional<at::Tensor>& blocks, const std::optional<at::Tensor>& tiles,
             const std::optional<at::Tensor>& spans, int64_t block_q, int64_t block_k) {
  TORCH_CHECK(amx_permitted(), "qkv flash: the OS refused the AMX tile state");
  const int64_t N = q.size(0), G = q.size(1), Tq = q.size(2), d = q.size(3);
  const int64_t Tk = k.size(1), dv = v.size(2);
  const Structure st{Tq, Tk, causal, window, shift};
  const float scale = static_cast<float>(scale_d), c2 = scale * kLog2e;
  const BlockView bv = BlockView::of(blocks, tiles, spans, (Tq + block_q - 1) / block_q,
                                     (Tk + block_k - 1) / block_k);
  const Packed P = pack(k, v);
  const BFloat16* qd = q.const_data_ptr<BFloat16>();
  BFloat16* od = out.data_ptr<BFloat16>();
  float* ld = lse.data_ptr<float>();
  const int64_t R = kSub, SB = R * kBQ;  // query rows per item
  const int64_t nqb = (Tq + SB - 1) / SB, items = N * G * nqb;
  const int64_t nPV = dv / 32;  // P V units per step

  parallel_strided(items, [&](int64_t first, int64_t items_end, int64_t step) {
    // S, P (double buffers), O and the rows' sums of each sub-block, a zero-padded Q block
    const size_t sb = kBQ * kBK * 4, pb = kBQ * kBK * 2, ob = kBQ * dv * 4, qb = kBQ * d * 2;
    const size_t lb = kBQ * 64;
    Scratch sc(2 * Scratch::pages(sb) + 2 * Scratch::pages(pb) + Scratch::pages(R * ob) +
               Scratch::pages(R * lb) + Scratch::pages(qb));
    float* Sb[2] = {sc.take<float>(sb / 4), sc.take<float>(sb / 4)};
    BFloat16* Pb[2] = {sc.take<BFloat16>(pb / 2), sc.take<BFloat16>(pb / 2)};
    float* O0 = sc.take<float>(R * ob / 4);
    float* L0 = sc.take<float>(R * lb / 4);
    BFloat16* Qpad = sc.take<BFloat16>(qb / 2);
    std::vector<RowState> rs_v(SB);
    // (sub-block, key block, its chunks of 32 keys [c0, c1) that some row of it sees: S and
    // P V skip the others, a causal diagonal's upper part, a block mask's empty blocks at
    // either end; masked: a chunk in it lies in a partial or empty block of the block mask)
    struct Step {
      int64_t i, j, c0, c1;
      bool masked;
      int32_t cs[kBK / 32];  // with a block mask: the state of each chunk in [c0, c1)
    };
    alignas(64) uint8_t mrow[kBK];  // a row's mask bytes in a masked step
    std::vector<Step> steps;
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t idx = first; idx < items_end; idx += step) {
      const int64_t n = idx / (G * nqb), g = (idx / nqb) % G, qi = idx % nqb;
      const int64_t qs0 = qi * SB, all = std::min(SB, Tq - qs0), nsub = (all + kBQ - 1) / kBQ;
      const BFloat16* Qh = qd + ((n * G + g) * Tq + qs0) * d;
      auto rows_of = [&](int64_t i) { return std::min(kBQ, all - i * kBQ); };
      auto q_of = [&](int64_t i) { return rows_of(i) < kBQ ? Qpad : Qh + i * kBQ * d; };
      if (rows_of(nsub - 1) < kBQ) {  // a last, partial block: its rows copied, the rest zero
        std::memset(static_cast<void*>(Qpad), 0, qb);
        std::memcpy(static_cast<void*>(Qpad), Qh + (nsub - 1) * kBQ * d, rows_of(nsub - 1) * d * 2);
      }
      std::memset(O0, 0, nsub * ob);
      std::memset(L0, 0, nsub * lb);
      for (int64_t r = 0; r < SB; ++r) rs_v[r] = {kNegInf, 1.f};
      // the steps: each sub-block with each key block it sees a key of, key blocks outermost
      // (a key block's packed K and V stay in the caches while every sub-block uses them)
      steps.clear();
      const int64_t j0 = st.lo(qs0) / kBK, hi_all = st.hi(qs0 + all - 1);
      for (int64_t j = j0; j * kBK < hi_all; ++j)
        for (int64_t i = 0; i < nsub; ++i) {
          const int64_t a = qs0 + i * kBQ, lo = st.lo(a), hi = st.hi(a + rows_of(i) - 1);
          if (hi > lo && lo < (j + 1) * kBK && hi > j * kBK) {
            const int64_t ks = j * kBK;
            const int64_t c0 = std::clamp<int64_t>(lo - ks, 0, kBK) / 32;
            const int64_t c1 = (std::clamp<int64_t>(hi - ks, 0, kBK) + 31) / 32;
            Step step{i, j, c0, c1, false, {}};
            if (bv.idx) {
              for (int64_t c = c0; c < c1; ++c)
                step.cs[c] = bv.state(n, g, a / block_q, (ks + 32 * c) / block_k);
              while (step.c0 < step.c1 && step.cs[step.c0] == -1) ++step.c0;
              while (step.c1 > step.c0 && step.cs[step.c1 - 1] == -1) --step.c1;
              for (int64_t c = step.c0; c < step.c1; ++c) step.masked |= step.cs[c] != -2;
            }
            if (step.c1 > step.c0) steps.push_back(step);
          }
        }
      const int64_t ns = static_cast<int64_t>(steps.size());
      if (ns > 0)
        for (int64_t u = steps[0].c0; u < steps[0].c1; ++u)
          s_unit(P, n, steps[0].j * kBK / 16, u, q_of(steps[0].i), d, Sb[0]);
      for (int64_t t = 0; t < ns; ++t) {
        const int cur = t & 1;
        const int64_t i = steps[t].i, j = steps[t].j;
        const bool next = t + 1 < ns, prev = t > 0;
        // the step's phases: the next step's units of S then the previous one's of P V,
        // spread evenly over the rows
        const Step& sn = steps[next ? t + 1 : t];
        const Step& sp = steps[prev ? t - 1 : t];
        const int64_t pr = sp.c1 - sp.c0 + 2;  // phases of a P V unit
        const int64_t sph = next ? (sn.c1 - sn.c0) * (P.nc + 2) : 0, pph = prev ? nPV * pr : 0;
        const int64_t U = sph + pph;
        int64_t issued = 0;
        auto issue = [&](int64_t x) {
          if (x < sph) {
            s_phase(P, n, sn.j * kBK / 16, sn.c0 + x / (P.nc + 2), q_of(sn.i), d, Sb[cur ^ 1],
                    x % (P.nc + 2));
          } else {
            const int64_t y = x - sph;
            pv_phase(P, n, sp.j * kBK / 32, y / pr, Pb[cur ^ 1], O0 + sp.i * kBQ * dv, dv, y % pr,
                     sp.c0, sp.c1);
          }
        };
        const int64_t ks = j * kBK, a = qs0 + i * kBQ, rows = rows_of(i);
        RowState* rs = rs_v.data() + i * kBQ;
        float* lsum = L0 + i * kBQ * 16;
        const Step& sc = steps[t];
        for (int64_t r = 0; r < kBQ; ++r) {
          // issue points: rows 0, kBQ / pts, ...; at each, the phases up to its share
          if (r % (kBQ / kIssues) == 0)
            while (issued < U && issued * kIssues < (r / (kBQ / kIssues) + 1) * U) issue(issued++);
          // the row's keys, within the step's chunks (S holds nothing outside them)
          int64_t c0 = 0, c1 = 0;
          if (r < rows) {
            c0 = std::clamp<int64_t>(st.lo(a + r) - ks, 32 * sc.c0, 32 * sc.c1);
            c1 = std::clamp<int64_t>(st.hi(a + r) - ks, 32 * sc.c0, 32 * sc.c1);
          }
          float* s = Sb[cur] + r * kBK;
          BFloat16* p = Pb[cur] + r * kBK;
          const uint8_t* mr = nullptr;
          if (sc.masked && c1 > c0)
            mr = block_row(bv, sc.cs, sc.c0, sc.c1, ks, a + r, block_q, block_k, c0, c1, mrow);
          if (!mr) {
            softmax_row(s, p, c0, c1, c2, rs[r], lsum + 16 * r);
          } else {
            rs[r].alpha = 1.f;
            row_code(s, p, c0, c1, c2, rs[r], lsum + 16 * r, mr);
          }
        }
        while (issued < U) issue(issued++);
        // every earlier block's P V is in O (this sub-block's last one, at the latest during
        // the rows above): scale the rows whose max this block raised
        float* O = O0 + i * kBQ * dv;
        for (int64_t r = 0; r < kBQ; ++r) {
          if (rs[r].alpha == 1.f) continue;
          const __m512 al = _mm512_set1_ps(rs[r].alpha);
          float* o = O + r * dv;
          for (int64_t c = 0; c < dv; c += 16)
            _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), al));
        }
      }
      if (ns > 0) {
        const Step& sl = steps[ns - 1];
        for (int64_t u = 0; u < nPV; ++u)
          pv_unit(P, n, sl.j * kBK / 32, u, Pb[(ns - 1) & 1], O0 + sl.i * kBQ * dv, dv, sl.c0,
                  sl.c1);
      }
      for (int64_t i = 0; i < nsub; ++i) {
        const float* O = O0 + i * kBQ * dv;
        const float* lsum = L0 + i * kBQ * 16;
        const RowState* rs = rs_v.data() + i * kBQ;
        BFloat16* Out = od + ((n * G + g) * Tq + qs0 + i * kBQ) * dv;
        float* L = ld + (n * G + g) * Tq + qs0 + i * kBQ;
        for (int64_t r = 0; r < rows_of(i); ++r) {
          const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + 16 * r));
          const bool empty = l == 0.f;  // no visible key: zeros, lse = -inf
          const __m512 inv = _mm512_set1_ps(empty ? 0.f : 1.f / l);
          for (int64_t c = 0; c < dv; c += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(O + r * dv + c), inv);
            if (empty) x = _mm512_setzero_ps();  // (O may hold 0 · NaN)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(Out + r * dv + c),
                                (__m256i)_mm512_cvtneps_pbh(x));
          }
          L[r] = empty ? kNegInf : rs[r].m * scale + std::log(l);
        }
      }
    }
    // leave the tiles as oneDNN expects to find them (it keeps its own configuration)
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace qkv_flash_amx

#endif  // QKV_FLASH_AMX
