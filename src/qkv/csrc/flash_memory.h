// The flash kernels' threads and memory: OpenMP over interleaved items, PyTorch's brgemm for
// the plain block matmuls, transposes, and the per-thread buffers reused between calls
// (huge pages for the prepared K/V, page-aligned scratch).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "flash_softmax.h"
#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;
namespace cpublas = at::native::cpublas;

// Runs f(first, end, step) once on each of at::get_num_threads() OpenMP threads (PyTorch's
// own runtime: libtorch links libgomp); thread t takes items t, t + nt, t + 2·nt, ...
// Interleaved rather than at::parallel_for's contiguous chunks: causal query blocks grow in
// cost along the sequence. Each thread allocates its scratch buffers once.
template <typename F>
static inline void parallel_strided(int64_t n, const F& f) {
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

// C (M x N, ld_c) (+)= A (M x K, ld_a) @ B (K x N, ld_b), all row-major, C in fp32.
template <typename T>
static inline void mm(int64_t M, int64_t N, int64_t K, const T* A, int64_t ld_a, const T* B,
                      int64_t ld_b, float* C, int64_t ld_c, bool add) {
  cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add, A, B, C, /*is_vnni=*/false);
}

// out = transpose(in): in (R x C, ld_in) -> out (C x R, ld_out)
template <typename T>
static inline void transpose(const T* in, int64_t R, int64_t C, int64_t ld_in, T* out, int64_t ld_out) {
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

}  // namespace
