// AMX part of the native CPU kernels (included by gmm_cpu.cc when built with -DCONVEYOR_ISA_AMX): the
// AVX-512 build (gmm_cpu_avx512.h) with its bfloat16 products done by Intel AMX instead of vdpbf16ps.
// float32 is the AVX-512 build's, unchanged. Needs AVX-512 F, BW, VL, BF16, AMX-TILE and AMX-BF16, and
// the kernel's leave to use AMX state (Linux >= 5.16: arch_prctl(ARCH_REQ_XCOMP_PERM), asked for once
// per process by isa_supported()).
//
// tdpbf16ps multiplies a 16 x 32 bfloat16 tile of A by a 32 x 16 tile of B held as 16 row pairs,
// summing each pair's two products into float32, subnormal inputs and outputs as zero, round to nearest
// even: the rules of vdpbf16ps (Intel SDM; the suite's subnormal test passes on both builds). Measured
// 2026-11-27 on the project's 2-core VM (Xeon with AMX): 3.7 TFLOP/s on one core for a loop of tile
// loads and tdpbf16ps; the AVX-512 build's bf16 gmm ran about 0.1 TFLOP/s per core there (G=1, m=4096,
// k=n=1024: 45 ms on two cores).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gmm_cpu_avx512.h"

// bfloat16 panels of B are packed, as for vdpbf16ps, in row pairs (dst[(pp * NR + q) * 2 + e]), with K
// rounded up to whole B tiles of AMX_K rows (the padding zero): columns [0, 16) of a tile's 16 pairs are
// the panel's first 64 bytes of each pair, columns [16, 32) the next 64.
constexpr int64_t AMX_K = 32;      // contraction steps per tile (16 bfloat16 pairs of 4 bytes: 64 bytes)
constexpr int64_t AMX_ROWS = 16;   // rows of A and C per tile
constexpr int64_t AMX_MR = 2 * AMX_ROWS;   // rows of C per register block: 2 x 2 tiles of C, 32 x 32

// Tile registers: C in 0..3 (row tile r, column half h: 2 r + h), A in 4..5, B in 6..7.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Rows [i, i + rows) of A (rows <= 16) packed tile by tile into `buf`: the 16 x 32 tile of K step s is
// the contiguous KiB at buf + s * AMX_ROWS * AMX_K, zero past the real rows and past K (so the padding
// of B is never multiplied by what lies past A), and a tile load reads it with a 64-byte stride. Packed
// once per 32-row block and reused by every panel of the block. Loading whole 16 x 32 pieces straight
// from A instead reads 16 rows lda apart, which in tgmm (lda = m: 8 KiB at m=4096) all fall in one L1
// set. Measured 2026-11-27 against that (2-core Intel VM, m=4096, k=n=1024, medians of 9-11, side by
// side): bf16 tgmm G=8 10.5 -> 9.1 and 12.8 -> 10.2 ms, G=64 38.8 -> 35.8 and 39.7 -> 37.1, G=256
// 160.6 -> 158.5; gmm within this VM's noise (G=64 14.3 -> 15.2, G=256 58.1 -> 54.5).
struct ATile {
  const bf16* tiles = nullptr;
  const void* step(int64_t s) const { return tiles + s * AMX_ROWS * AMX_K; }
};

template <typename Out>
inline ATile a_tile(const Product<bf16, Out>& P, int64_t i, int64_t rows, bf16* buf) {
  const int64_t steps = (P.K + AMX_K - 1) / AMX_K, whole = P.K / AMX_K, rest = P.K - whole * AMX_K;
  const __mmask32 tail = __mmask32((uint64_t(1) << rest) - 1);   // the last step's real columns
  for (int64_t r = 0; r < AMX_ROWS; ++r) {
    bf16* dst = buf + r * AMX_K;
    if (r >= rows) {
      for (int64_t s = 0; s < steps; ++s) _mm512_store_si512(dst + s * AMX_ROWS * AMX_K, _mm512_setzero_si512());
      continue;
    }
    const bf16* src = P.a + (i + r) * P.lda;
    for (int64_t s = 0; s < whole; ++s)
      _mm512_store_si512(dst + s * AMX_ROWS * AMX_K, _mm512_loadu_si512(src + s * AMX_K));
    if (rest) _mm512_store_si512(dst + whole * AMX_ROWS * AMX_K, _mm512_maskz_loadu_epi16(tail, src + whole * AMX_K));
  }
  return ATile{buf};
}

// C rows [i, i + rows) (rows <= 16), columns [0, w) (w <= 16) from tile `acc` (16 x 16 float32),
// added to what C holds when P accumulates, in the output type.
template <typename Out>
inline void store_tile(const Product<bf16, Out>& P, const float* acc, Out* c, int64_t rows, int64_t w) {
  const __mmask16 mask = lane_mask(w);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(acc + r * 16);
    if (P.accumulate) v = _mm512_add_ps(v, load_c(c + r * P.ldc, mask));
    store_c(c + r * P.ldc, mask, v);
  }
}

// Rows [m0, m1) over a packed block of `panels` panels of B (`panel` elements apart, K padded to
// AMX_K): for each 32-row block, each panel's 32 x 32 piece of C accumulated in four tiles over K.
// `next` is prefetched a part per row block, as the vdpbf16ps path does per row tile.
template <typename Out, typename Next>
void amx_rows(const Product<bf16, Out>& P, int64_t m0, int64_t m1, int64_t j0, int64_t j1, const bf16* bp,
              int64_t panel, const Next& next) {
  thread_local std::vector<bf16> packed_a;   // a_tile's tiles of the block's two 16-row halves
  const int64_t steps = (P.K + AMX_K - 1) / AMX_K, width = steps * AMX_K;
  if (packed_a.size() < size_t(2 * AMX_ROWS * width + 64)) packed_a.resize(2 * AMX_ROWS * width + 64);
  bf16* buf = (bf16*)(((uintptr_t)packed_a.data() + 63) & ~uintptr_t(63));
  alignas(64) float acc[4][AMX_ROWS * 16];
  const int64_t panels = (j1 - j0 + NR - 1) / NR, blocks = (m1 - m0 + AMX_MR - 1) / AMX_MR;
  configure_tiles();
  for (int64_t t = 0; t < blocks; ++t) {
    const int64_t i = m0 + t * AMX_MR, rows = std::min(AMX_MR, m1 - i);
    const int64_t rows0 = std::min(AMX_ROWS, rows), rows1 = rows - rows0;   // rows of each A tile
    const ATile a0 = a_tile(P, i, rows0, buf);
    const ATile a1 = rows1 > 0 ? a_tile(P, i + AMX_ROWS, rows1, buf + AMX_ROWS * width) : ATile{};
    for (int64_t q = 0; q < panels; ++q) {
      const bf16* b = bp + q * panel;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, a0.step(s), AMX_K * 2);
        _tile_loadd(6, b + s * AMX_K * NR, NR * 4);
        _tile_loadd(7, b + s * AMX_K * NR + 32, NR * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1 > 0) {
          _tile_loadd(5, a1.step(s), AMX_K * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, acc[0], 64);
      _tile_stored(1, acc[1], 64);
      if (rows1 > 0) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
      }
      const int64_t w = std::min(NR, j1 - j0 - q * NR);
      Out* c = P.c + i * P.ldc + j0 + q * NR;
      store_tile(P, acc[0], c, rows0, std::min<int64_t>(w, 16));
      if (w > 16) store_tile(P, acc[1], c + 16, rows0, w - 16);
      if (rows1 > 0) {
        store_tile(P, acc[2], c + AMX_ROWS * P.ldc, rows1, std::min<int64_t>(w, 16));
        if (w > 16) store_tile(P, acc[3], c + AMX_ROWS * P.ldc + 16, rows1, w - 16);
      }
    }
    next.prefetch(t, blocks);
  }
  _tile_release();
}

// Asks Linux for leave to use AMX tile data (XFEATURE_XTILEDATA, 18) in this process, once; a kernel
// without it (before 5.16) or a hypervisor that hides AMX answers no, and the AVX-512 build runs.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return permitted;
}

// AVX-512 BF16, and AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), with leave to use them.
inline int isa_supported() {
  unsigned eax, ebx, ecx, edx;
  if (!avx512_supported() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
  return (edx >> 24 & 1) && (edx >> 22 & 1) && amx_permitted();
}
