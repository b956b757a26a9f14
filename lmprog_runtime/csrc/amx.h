// AMX (Advanced Matrix Extensions) set-up shared by the kernels that use its tiles.
//
// `LMPROG_AMX` is 1 when the build targets a CPU with AMX tiles and bfloat16 tile products
// (-march=native on Sapphire Rapids and later). Running them also needs the OS to grant
// the tile state, which Linux (5.16+) does on request, once per process (`request_amx`);
// the tile shapes are then loaded per thread (`configure_tiles`).
#pragma once

#include "cpu_vec.h"

#if LMPROG_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LMPROG_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LMPROG_AMX 0
#endif

#if LMPROG_AMX
namespace lmprog {

inline bool request_amx() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Every tile 16 rows x 64 bytes (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // Not `_tile_loadconfig`: GCC 12 declares its operand as 8 bytes, so the compiler may
  // drop the stores of the shapes above and the CPU loads a half-written config (#GP).
  // The whole 64-byte config is the operand here.
  asm volatile("ldtilecfg %0" : : "m"(config));
}

}  // namespace lmprog
#endif

namespace lmprog {

// Whether the AMX kernels can run here: compiled in, and the tile state granted by the OS.
inline bool amx_available() {
#if LMPROG_AMX
  return request_amx();
#else
  return false;
#endif
}

}  // namespace lmprog
