// One segment of the decode kernel: kv head n, keys [k0, k1), for fp32, bf16 and int8 caches
// on every level. Per block of 64 keys: the scores (decode_qk_avx512.h, decode_avx2.h, or
// plain loops on portable), the online softmax (decode_softmax.h), then acc += P V
// (decode_pv_avx512.h, decode_avx2.h, decode_int16.h). Also int8 caches with many rows,
// widened to fp32 run by run (run_segment_widened). decode_impl (decode_cpu.cpp) runs the
// segments of each thread and merges them.
#pragma once

// (in the order the pieces build on each other)
#include "decode_qk_avx512.h"
#include "decode_pv_avx512.h"
#include "decode_avx2.h"
#include "decode_softmax.h"
#include "decode_int16.h"

namespace {

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

}  // namespace
