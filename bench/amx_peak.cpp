// This core's AMX limits for the benchmarks, measured rather than taken from a datasheet:
//   clock_ghz()        the core clock while it runs, from a chain of dependent imuls (3 cycles
//                      each on every x86 core since Sandy Bridge); /proc/cpuinfo's MHz is the
//                      nominal one, and a core under AMX load may run slower than it
//   amx_bf16_tflops()  tdpbf16ps on tiles that stay in the registers (no loads, no stores),
//                      four independent accumulators: the most the tile unit multiplies
// Both on the calling thread; the clock is measured right after the tile loop, while the core
// still runs at the frequency the tiles left it at.
#include <torch/extension.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

namespace {
double seconds(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

double clock_ghz(int64_t iters) {
  uint64_t x = 3;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) asm volatile("imul %0, %0\n\timul %0, %0" : "+r"(x));
  return 6.0 * static_cast<double>(iters) / seconds(t0) / 1e9;
}

double amx_bf16_tflops(int64_t iters) {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  TORCH_CHECK(syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0,
              "amx_bf16_tflops: the OS refused the AMX tile state");
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t ones[16 * 32];
  for (auto& v : ones) v = 0x3f80;  // bf16 1.0
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int t : {0, 1, 2, 3}) (void)t;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) static float sink[16 * 16];
  _tile_stored(0, sink, 64);  // waits for the last multiplies
  const double t = seconds(t0);
  _tile_release();
  return 4.0 * static_cast<double>(iters) * 16 * 16 * 32 * 2 / t / 1e12;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("clock_ghz", &clock_ghz, "the core clock (GHz) from `iters` pairs of dependent imuls");
  m.def("amx_bf16_tflops", &amx_bf16_tflops,
        "bf16 TFLOP/s of `iters` rounds of four independent tdpbf16ps on register tiles");
}
