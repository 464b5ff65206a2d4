// What every AMX kernel needs before its first tile instruction: the tile configuration
// (palette 1: up to 16 rows of 64 bytes per tile) and the OS's permission to use the tiles.
// Shared by the decode kernel's tile path (decode_amx.h) and the flash forward on tiles
// (flash_amx.cpp); compiled only where the level has the AMX instructions.
#pragma once

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state only on request, once per process (oneDNN asks too).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

}  // namespace
#endif  // __AMX_TILE__
