// The bf16 flash forward on AMX tiles (flash_amx.cpp), for the calls it takes: no mask or
// bias (full, causal or windowed structure, a block mask whose blocks are whole 32-row,
// 32-key chunks), head dims multiples of 32.
#pragma once

#include <ATen/ATen.h>

#include "flash_softmax.h"

#if defined(QKV_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define QKV_FLASH_AMX 1

namespace qkv_flash_amx {
// whether amx_forward takes a call with these head dims
inline bool applies(int64_t d, int64_t dv) { return d % 32 == 0 && dv % 32 == 0; }
// whether it takes a block mask of (block_q, block_k) blocks
inline bool applies_blocks(int64_t block_q, int64_t block_k) {
  return block_q % 32 == 0 && block_k % 32 == 0;
}

// out (N, G, Tq, dv) bf16, lse (N, G, Tq) fp32 from q (N, G, Tq, d), k (N, Tk, d),
// v (N, Tk, dv) bf16, all contiguous; the keys each query row sees are Structure's for
// (causal, window, shift), within the blocks of a block mask (blocks, tiles, spans as
// flash_fwd takes them, on the grid of block_q x block_k) if blocks is given
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
             at::Tensor& lse, double scale, bool causal, int64_t window, int64_t shift,
             const std::optional<at::Tensor>& blocks = std::nullopt,
             const std::optional<at::Tensor>& tiles = std::nullopt,
             const std::optional<at::Tensor>& spans = std::nullopt, int64_t block_q = 32,
             int64_t block_k = 32);
}  // namespace qkv_flash_amx
#endif
