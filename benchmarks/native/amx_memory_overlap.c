// Whether a core overlaps AMX work with reading memory: a 32 x 512 block of C over K = 1024 in AMX
// tiles on operands in cache (gmm_cpu_amx.h's loop), alone, then with 64-byte lines of a 256 MiB
// buffer read in every K step (plain loads, prefetcht0 or prefetcht1), and the reads alone. On the
// 2026-11-27 VM the two together took the sum of their times, not the larger one
// (benchmarks/results/gmm-2026-11-27-8.md). Needs AMX and Linux >= 5.16.
//
//   cc -O2 -mamx-tile -mamx-bf16 -mavx512f amx_memory_overlap.c -o /tmp/amx_overlap && /tmp/amx_overlap 16
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define K 1024
#define STEPS (K / 32)
#define PANELS 16
#define PANEL (K * 32)   // bfloat16 elements of one packed 32-column panel of B
#define STREAM_BYTES (256L << 20)

typedef struct __attribute__((packed)) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

enum Mode { COMPUTE, COMPUTE_LOADS, COMPUTE_PREFETCH_T0, COMPUTE_PREFETCH_T1, LOADS, MODES };
static const char* names[] = {"AMX alone", "AMX + loads", "AMX + prefetcht0", "AMX + prefetcht1", "loads alone"};

static uint16_t *packed_b, *packed_a;
static float* c_tile;
static char* stream;
static long stream_at;
static volatile int sink;

static void read_lines(enum Mode mode, int lines, __m512i* acc) {
  for (int l = 0; l < lines; ++l, stream_at = (stream_at + 64) & (STREAM_BYTES - 1)) {
    if (mode == COMPUTE_PREFETCH_T0) _mm_prefetch(stream + stream_at, _MM_HINT_T0);
    else if (mode == COMPUTE_PREFETCH_T1) _mm_prefetch(stream + stream_at, _MM_HINT_T1);
    else *acc = _mm512_xor_si512(*acc, _mm512_load_si512(stream + stream_at));
  }
}

// Two 32-row blocks over all panels, as for a group of 64 rows.
static void run(enum Mode mode, int lines) {
  __m512i acc = _mm512_setzero_si512();
  for (int block = 0; block < 2; ++block) {
    for (int q = 0; q < PANELS; ++q) {
      const uint16_t* b = packed_b + q * PANEL;
      if (mode != LOADS) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
      for (int s = 0; s < STEPS; ++s) {
        if (mode != LOADS) {
          _tile_loadd(4, packed_a + s * 512, 64);
          _tile_loadd(6, b + s * 1024, 128);
          _tile_loadd(7, b + s * 1024 + 32, 128);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, packed_a + 16 * K + s * 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        if (mode != COMPUTE) read_lines(mode, lines, &acc);
      }
      if (mode != LOADS) {
        _tile_stored(0, c_tile, 64);
        _tile_stored(1, c_tile + 256, 64);
        _tile_stored(2, c_tile + 512, 64);
        _tile_stored(3, c_tile + 768, 64);
      }
    }
  }
  sink = _mm512_reduce_add_epi32(acc);
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int lines = argc > 1 ? atoi(argv[1]) : 16, reps = 400;
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    fprintf(stderr, "this kernel or CPU does not grant AMX tile state\n");
    return 1;
  }
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  packed_b = aligned_alloc(64, PANELS * PANEL * 2);
  packed_a = aligned_alloc(64, 32 * K * 2);
  c_tile = aligned_alloc(64, 1024 * 4);
  stream = aligned_alloc(4096, STREAM_BYTES);
  memset(packed_b, 0, PANELS * PANEL * 2);
  memset(packed_a, 0, 32 * K * 2);
  memset(stream, 1, STREAM_BYTES);
  _tile_loadconfig(&cfg);
  const double flop = 2.0 * 64 * K * 512 * reps;
  const double bytes = (double)reps * 2 * PANELS * STEPS * lines * 64;
  for (int round = 0; round < 2; ++round) {
    for (int mode = 0; mode < MODES; ++mode) {
      const double t0 = seconds();
      for (int i = 0; i < reps; ++i) run(mode, lines);
      const double dt = seconds() - t0;
      printf("%-18s %7.2f ms", names[mode], dt * 1e3);
      if (mode != LOADS) printf("  %5.0f GFLOP/s", flop / dt / 1e9);
      if (mode != COMPUTE) printf("  %5.1f GB/s read", bytes / dt / 1e9);
      printf("\n");
    }
  }
  _tile_release();
  return 0;
}
