// How fast two threads read 128 MiB, by the split of the bytes between them: contiguous halves,
// 1 KiB of every 2 KiB each (what a column split of gmm's bfloat16 weights does at n = 1024), or
// alternate 64-byte lines. Behind gmm's split by groups (src/conveyor/native/gmm_cpu.cc,
// group_split_k_chunk); readings in benchmarks/results/gmm-2026-11-27-8.md.
//
//   cc -O2 -mavx512f -pthread read_bandwidth.c -o /tmp/read_bandwidth && /tmp/read_bandwidth
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BYTES (128L << 20)
#define EVICT_BYTES (256L << 20)

static char* buffer;
static volatile int sink;

typedef struct { int thread; int split; } Job;

// Split 0: contiguous halves; 1: 1 KiB of every 2 KiB; 2: alternate 64-byte lines.
static void* read_share(void* arg) {
  const Job* job = arg;
  __m512i acc = _mm512_setzero_si512();
  if (job->split == 0) {
    for (long i = job->thread * (BYTES / 2); i < (job->thread + 1) * (BYTES / 2); i += 64)
      acc = _mm512_xor_si512(acc, _mm512_load_si512(buffer + i));
  } else if (job->split == 1) {
    for (long row = 0; row < BYTES; row += 2048)
      for (long i = row + job->thread * 1024; i < row + (job->thread + 1) * 1024; i += 64)
        acc = _mm512_xor_si512(acc, _mm512_load_si512(buffer + i));
  } else {
    for (long i = job->thread * 64; i < BYTES; i += 128) acc = _mm512_xor_si512(acc, _mm512_load_si512(buffer + i));
  }
  sink = _mm512_reduce_add_epi32(acc);
  return NULL;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  static const char* names[] = {"contiguous halves", "1 KiB of each 2 KiB", "alternate lines"};
  buffer = aligned_alloc(4096, BYTES);
  char* evict = malloc(EVICT_BYTES);
  memset(buffer, 1, BYTES);
  for (int rep = 0; rep < 5; ++rep) {
    for (int split = 0; split < 3; ++split) {
      memset(evict, rep, EVICT_BYTES);   // the buffer out of the caches
      pthread_t threads[2];
      Job jobs[2] = {{0, split}, {1, split}};
      const double t0 = seconds();
      for (int t = 0; t < 2; ++t) pthread_create(&threads[t], NULL, read_share, &jobs[t]);
      for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
      const double dt = seconds() - t0;
      printf("%-20s %6.2f ms %5.1f GB/s\n", names[split], dt * 1e3, BYTES / dt / 1e9);
    }
  }
  return 0;
}
