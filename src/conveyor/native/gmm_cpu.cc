// Native CPU kernels for gmm and tgmm (float32 and bfloat16; AMX, AVX-512 or AVX2), called through the XLA FFI.
//
// Both ops are a list of independent matrix products, one per group: C_g (+)= A_g @ B_g.
//   gmm:  C_g = out[rows of g]  (M = group rows, K = k),   A_g = lhs[rows of g], B_g = rhs[g] (or rhs[g]^T)
//   tgmm: C_g = out[g] + ...    (M = k, K = group rows),   A_g = lhs[:, rows of g], B_g = rhs[rows of g]
// Each product is computed the GotoBLAS way: a block of panels of B (K x NR columns each) is packed
// contiguous, the register tile's MR rows of A are packed step by step, then the MR x NR tile of C is
// accumulated over all of K in registers, with one broadcast of A per row and step; the next block's B
// is prefetched meanwhile. A product longer than K_CHUNK along K with a float32 C runs as K chunks
// (push_product), and a fresh output is asked for 2 MiB pages before it is written
// (ask_for_huge_pages). MR, NR and the packing are the instruction set's (gmm_cpu_avx512.h: 14 x 32,
// gmm_cpu_avx2.h: 6 x 16); the AMX build (gmm_cpu_amx.h) runs bfloat16 products on 32 x 32 blocks of
// AMX tiles over the same packed B instead (amx_rows). The work is split into chunks (gmm: ranges of
// columns, or whole groups where there are many of few rows (group_split_k_chunk); tgmm: ranges of
// rows) that the XLA CPU thread pool's workers and the calling thread claim from an atomic counter
// (no thread ever waits for a task that has not started, so a busy pool cannot deadlock the call).
// Group bounds come from the caller, already clamped to [0, m]. Rows (gmm) or blocks
// (tgmm) no group computes keep existing_out, aliased to the output, or, when the op made existing_out
// itself (`zero_init`: all zeros), are zeroed in a fresh output. Built and loaded by
// conveyor/native/build.py.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;

// One group's product C (+)= A @ B. A is M x K with unit stride along K; B element (p, j) lies at
// b[p * b_row + j * b_col]; C is M x N with row stride ldc.
template <typename In, typename Out>
struct Product {
  int64_t M, K;
  const In* a;
  int64_t lda;
  const In* b;
  int64_t b_row, b_col;
  Out* c;
  int64_t ldc;
  bool accumulate;
};

// A transposed B (gmm's transpose_rhs: each column contiguous along p) is packed column by column,
// reading each column's run of p instead of gathering NR columns at every p.
inline bool columns_contiguous(int64_t b_row, int64_t b_col) { return b_row == 1 && b_col != 1; }

// Column panels of B packed and computed on together. Measured 2026-11-25 (2-core VM, m=4096, k=n=1024,
// medians of 5 after a cache eviction and pause, AVX-512): blocks of 1 panel packed whole (K rows), and of 4,
// 8 or 32 panels in steps of 16 rows, were within run-to-run noise of each other (gmm G=64 f32 60-74
// ms, tgmm G=256 f32 371-459 ms, no variant best throughout).
constexpr int64_t PANELS_PER_BLOCK = 8;

// The instruction set's part: MR x NR register tiles, the packed element type Packed<In>, the output
// tile's loads and stores, pack_panel (B), pack_a (A), tile<R> and isa_supported().
#if defined(CONVEYOR_ISA_AMX)
#include "gmm_cpu_amx.h"
#elif defined(CONVEYOR_ISA_AVX2)
#include "gmm_cpu_avx2.h"
#else
#include "gmm_cpu_avx512.h"
#endif

// Whether this build's bfloat16 products run on AMX tiles (gmm_cpu_amx.h: amx_rows) instead of
// register tiles, and the multiple of K a packed panel holds (the rest zero): whole AMX tiles there,
// whole bfloat16 pairs elsewhere.
#if defined(CONVEYOR_ISA_AMX)
template <typename In>
constexpr bool on_amx() { return std::is_same_v<In, bf16>; }
template <typename In>
constexpr int64_t panel_k_unit() { return on_amx<In>() ? AMX_K : 2; }
#else
template <typename In>
constexpr bool on_amx() { return false; }
template <typename In>
constexpr int64_t panel_k_unit() { return 2; }
#endif

// Panels packed and computed on together. On AMX a bfloat16 product is so fast that it waits on its
// weights from memory; longer runs of each row of B (16 panels: 1 KiB) read them faster. Measured
// 2026-11-27 (2-core Intel VM with AMX, m=4096, k=n=1024, bf16 gmm, medians of 9 interleaved with 8
// panels): G=256 52.1 -> 37.8 ms, G=64 23.5 -> 20.6 (18.0 -> 16.6 in a second run), G=1 11.2 -> 11.0.
template <typename In>
constexpr int64_t panels_per_block() { return on_amx<In>() ? 2 * PANELS_PER_BLOCK : PANELS_PER_BLOCK; }

template <typename In, typename Out, int R = MR>
inline void tile_rows(int64_t rows, const Product<In, Out>& P, const Packed<In>* a, const Packed<In>* bp, Out* c,
                      int64_t w) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<In, Out, R - 1>(rows, P, a, bp, c, w);
  }
  tile<R>(P, a, bp, c, w);
}

// The source of one block of B: columns [j0, j1) over all K steps of a product (what pack_panel reads).
template <typename In, typename Out>
struct BlockSource {
  const Product<In, Out>* P = nullptr;
  int64_t j0 = 0, j1 = 0;

  // Ask for part `part` of `parts` of the block's cache lines in L2. A block is packed all at once and
  // then computed on; prefetching the next block while this one computes overlaps its DRAM reads
  // (which are the whole cost when a group has few rows) with the arithmetic.
  // Measured 2026-11-25 (2-core VM, m=4096, k=n=1024, medians of 9, interleaved with the kernel
  // without it): faster in all 12 gmm / tgmm / transposed-gmm rows at G=8 and 64, f32 and bf16, by
  // 0.3-9 ms (e.g. f32 gmm G=64 72.3 -> 67.1 ms, tgmm G=64 154.0 -> 145.1, bf16 gmm G=8 30.6 -> 25.9).
  void prefetch(int64_t part, int64_t parts) const {
    if (P == nullptr) return;
    const bool by_column = columns_contiguous(P->b_row, P->b_col);
    // Runs of contiguous elements: rows of the block (row-major B) or its columns (transposed B).
    const int64_t runs = by_column ? j1 - j0 : P->K, run_bytes = (by_column ? P->K : j1 - j0) * int64_t(sizeof(In));
    const int64_t stride = (by_column ? P->b_col : P->b_row) * int64_t(sizeof(In));
    const char* base = (const char*)(P->b + j0 * P->b_col);
    for (int64_t r = runs * part / parts, r1 = runs * (part + 1) / parts; r < r1; ++r)
      for (int64_t off = 0; off < run_bytes; off += 64) _mm_prefetch(base + r * stride + off, _MM_HINT_T1);
  }
};

// Elements of one register tile's packed A (MR rows, K rounded up to the panels' K unit).
template <typename In, typename Out>
int64_t packed_a_tile(const Product<In, Out>& P) {
  constexpr int64_t k_unit = panel_k_unit<In>();
  return (P.K + k_unit - 1) / k_unit * k_unit * MR;
}

// Packed A of at most this many bytes is packed once for all blocks of B (pack_a_once).
constexpr int64_t A_PACK_ONCE_BYTES = int64_t(4) << 20;

// The packed A of rows [m0, m1) of P, every register tile's (tile t at t * packed_a_tile(P)), where
// the rows run over `blocks` > 1 blocks of B and fit A_PACK_ONCE_BYTES: the blocks then share it
// instead of each packing every tile again. nullptr where not (and for AMX products, which pack their
// own). Measured 2026-11-27 (2-core Intel VM, m=4096, k=n=1024, f32, medians of 11 side by side,
// three runs, in ms): tgmm G=8 31.4 -> 30.0, 39.2 -> 34.1, 31.6 -> 29.5; G=64 56.6 -> 54.1,
// 58.3 -> 54.0, 57.3 -> 50.5; G=1 (4 MiB of A per thread) within noise; f32 gmm within noise
// (G=8 28.3 -> 28.8, G=64 40.7 -> 41.8). A 1 MiB bound gained less at tgmm G=8 (31.0).
template <typename In, typename Out>
const Packed<In>* pack_a_once(const Product<In, Out>& P, int64_t m0, int64_t m1, int64_t blocks,
                              std::vector<Packed<In>>& buf) {
  const int64_t tiles = (m1 - m0 + MR - 1) / MR, tile = packed_a_tile(P);
  if (on_amx<In>() || blocks < 2 || m1 <= m0 || tiles * tile * int64_t(sizeof(Packed<In>)) > A_PACK_ONCE_BYTES)
    return nullptr;
  if (buf.size() < size_t(tiles * tile + 64)) buf.resize(tiles * tile + 64);
  Packed<In>* base = (Packed<In>*)(((uintptr_t)buf.data() + 63) & ~uintptr_t(63));
  for (int64_t t = 0; t < tiles; ++t)
    pack_a(P, P.a + (m0 + t * MR) * P.lda, std::min(MR, m1 - m0 - t * MR), base + t * tile);
  return base;
}

// Rows [m0, m1) and columns [j0, j1) (one block: Work::block_columns at most) of one product: the
// block's panels are packed (`pack` holds them, K x NR each, K rounded up to pairs), then every
// register tile of the rows runs over them, prefetching `next` a part per row tile. Each tile's rows
// of A are packed as it comes, or come from `a_packed` (pack_a_once).
template <typename In, typename Out>
void product_block(const Product<In, Out>& P, int64_t m0, int64_t m1, int64_t j0, int64_t j1,
                   const BlockSource<In, Out>& next, std::vector<Packed<In>>& pack,
                   const Packed<In>* a_packed = nullptr) {
  if (m1 <= m0 || j1 <= j0 || P.K <= 0) return;
  constexpr int64_t k_unit = panel_k_unit<In>();
  const int64_t padded_k = (P.K + k_unit - 1) / k_unit * k_unit, panel = padded_k * NR;
  const int64_t block_panels = (j1 - j0 + NR - 1) / NR;
  const size_t need = size_t(panel * block_panels + packed_a_tile(P)) + 128;
  if (pack.size() < need) pack.resize(need);
  Packed<In>* bp = (Packed<In>*)(((uintptr_t)pack.data() + 63) & ~uintptr_t(63));
  Packed<In>* ap = (Packed<In>*)(((uintptr_t)(bp + panel * block_panels) + 63) & ~uintptr_t(63));  // MR x K, rounded to pairs
  const int64_t panels = (j1 - j0 + NR - 1) / NR;
  constexpr int64_t rows = pack_rows<In>();
  for (int64_t p = 0; p < P.K; p += rows)
    for (int64_t q = 0; q < panels; ++q)
      pack_panel(P, j0 + q * NR, std::min(NR, j1 - j0 - q * NR), bp + q * panel, p, std::min(P.K, p + rows));
  if constexpr (on_amx<In>()) {
    const int64_t packed = (P.K + 1) / 2 * 2 * NR;   // what pack_panel wrote: whole pairs
    for (int64_t q = 0; q < panels; ++q) std::memset(bp + q * panel + packed, 0, sizeof(In) * (panel - packed));
    return amx_rows(P, m0, m1, j0, j1, bp, panel, next);
  }
  const int64_t row_tiles = (m1 - m0 + MR - 1) / MR;
  for (int64_t t = 0; t < row_tiles; ++t) {
    const int64_t i = m0 + t * MR;
    const Packed<In>* a_tile = a_packed ? a_packed + t * packed_a_tile(P) : ap;
    if (!a_packed) pack_a(P, P.a + i * P.lda, std::min(MR, m1 - i), ap);
    for (int64_t q = 0; q < panels; ++q)
      tile_rows<In, Out>(std::min(MR, m1 - i), P, a_tile, bp + q * panel, P.c + i * P.ldc + j0 + q * NR,
                         std::min(NR, j1 - j0 - q * NR));
    next.prefetch(t, row_tiles);
  }
}

// ---- the work split over threads ------------------------------------------------------------------

// Every group's product over chunk `chunk` of `chunks`: a range of column panels (gmm, whose groups
// may have few rows), or of row tiles (tgmm, whose products all have k rows: the threads then write
// disjoint rows of the output, so they never fault in the same fresh page; tgmm split by columns
// instead, measured 2026-11-27 side by side: f32 G=64 92.4 -> 139.6 ms, G=8 35.8 -> 40.7).
template <typename In, typename Out>
struct Work {
  std::vector<Product<In, Out>> products;
  int64_t n, chunks;
  bool split_rows;
  // gmm split by groups (group_split_k_chunk): chunk c is products [group_starts[c], group_starts[c + 1]),
  // one group's K chunks in order, over all columns. Empty: every chunk runs a part of every product.
  std::vector<size_t> group_starts;
  int64_t block_columns = NR * panels_per_block<In>();   // columns of B packed and computed on together
  std::atomic<int64_t> next{0}, done{0};

  // This chunk's rows and columns of product P.
  void extent(const Product<In, Out>& P, int64_t chunk, int64_t& m0, int64_t& m1, int64_t& n0, int64_t& n1) const {
    if (!group_starts.empty()) {
      m0 = 0, m1 = P.M, n0 = 0, n1 = n;
    } else if (split_rows) {
      const int64_t tiles = (P.M + MR - 1) / MR;
      m0 = tiles * chunk / chunks * MR, m1 = std::min(P.M, tiles * (chunk + 1) / chunks * MR), n0 = 0, n1 = n;
    } else {
      const int64_t panels = (n + NR - 1) / NR;
      m0 = 0, m1 = P.M, n0 = panels * chunk / chunks * NR, n1 = std::min(n, panels * (chunk + 1) / chunks * NR);
    }
  }

  // The chunk's products (every one, or its group's) over this chunk, block of panels by block, each
  // prefetching the next one's B.
  void run_chunk(int64_t chunk, std::vector<Packed<In>>& pack, std::vector<Packed<In>>& a_pack) {
    const int64_t BLOCK = block_columns;
    const bool by_group = !group_starts.empty();
    const size_t first = by_group ? group_starts[chunk] : 0, end = by_group ? group_starts[chunk + 1] : products.size();
    for (size_t g = first; g < end; ++g) {
      const auto& P = products[g];
      int64_t m0, m1, n0, n1;
      extent(P, chunk, m0, m1, n0, n1);
      const Packed<In>* a_packed = pack_a_once(P, m0, m1, (n1 - n0 + BLOCK - 1) / BLOCK, a_pack);
      for (int64_t jb = n0; jb < n1; jb += BLOCK) {
        BlockSource<In, Out> next;
        if (jb + BLOCK < n1) {
          next = {&P, jb + BLOCK, std::min(n1, jb + 2 * BLOCK)};
        } else if (g + 1 < end) {
          int64_t a0, a1, b0, b1;
          extent(products[g + 1], chunk, a0, a1, b0, b1);
          if (a1 > a0 && b1 > b0) next = {&products[g + 1], b0, std::min(b1, b0 + BLOCK)};
        }
        product_block(P, m0, m1, jb, std::min(n1, jb + BLOCK), next, pack, a_packed);
      }
    }
  }

  // Claim and run chunks until none is left.
  void drain() {
    thread_local std::vector<Packed<In>> pack, a_pack;
    for (int64_t chunk; (chunk = next.fetch_add(1)) < chunks;) {
      run_chunk(chunk, pack, a_pack);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename In, typename Out>
void run_parallel(std::shared_ptr<Work<In, Out>> work, ffi::ThreadPool& pool) {
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), work->chunks - 1));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->drain(); });
  work->drain();
  // The chunks still running were claimed by started workers: waiting for them cannot deadlock.
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
}

// One chunk per thread of the pool (as many as the host has cores): the calling thread and
// num_threads - 1 helpers claim one each. One more chunk than threads left one thread running two
// chunks while the other idled: measured 2026-11-25 on the 2-core VM (pool of 2), 3 chunks against 2: gmm G=1 f32 55.4 against
// 41.4 ms, bf16 29.7 against 22.7 (medians of 7, interleaved; m=4096, k=n=1024).
int64_t chunks_of(int64_t units, ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, std::min<int64_t>(units, pool.num_threads()));
}

// Products longer than K_CHUNK along K are run as K chunks in order, C += A[:, chunk] @ B[chunk, :]
// (GotoBLAS's kc): a packed block of B then holds at most K_CHUNK rows (1 MiB: float32 x 256 columns,
// AMX bfloat16 x 512), which stays in L2 while every row tile of the block runs over it. Only where C
// is float32: a bfloat16 C would round each chunk's partial sum. tgmm's products are long along K
// (K = a group's rows). Measured 2026-11-27 (2-core Intel VM, m=4096, k=n=1024, medians of 7,
// variants side by side): f32 tgmm G=1 35.5 -> 25.8 ms (the dense dot: 25-27), G=8 within noise;
// bf16 tgmm G=1 on the AVX-512 build 41.6 -> 39.6; chunks of 512 gave the same for tgmm and split gmm's
// k=1024 for nothing (f32 gmm G=1 23.5 -> 24.4, G=64 37.6 -> 36.6).
constexpr int64_t K_CHUNK = 1024;   // a multiple of every build's K step (AMX: 32)

template <typename In, typename Out>
void push_product(std::vector<Product<In, Out>>& products, const Product<In, Out>& P, int64_t k_chunk = K_CHUNK) {
  if (!std::is_same_v<Out, float> || P.K <= k_chunk) return products.push_back(P);
  for (int64_t p0 = 0; p0 < P.K; p0 += k_chunk) {
    Product<In, Out> chunk = P;
    chunk.K = std::min(k_chunk, P.K - p0);
    chunk.a = P.a + p0;
    chunk.b = P.b + p0 * P.b_row;
    chunk.accumulate = P.accumulate || p0 > 0;
    products.push_back(chunk);
  }
}

// A fresh output (zero_init) is asked to be backed by 2 MiB pages (the 2 MiB-aligned part of it) before
// it is written. XLA:CPU allocates a large result afresh on every call, and the kernel's first writes
// then fault it in 4 KiB at a time: on the 2026-11-27 VM, perf put about half of a bf16 tgmm G=8 call
// in the kernel's page faults. Measured there (m=4096, k=n=1024, medians of 7, side by side): tgmm bf16
// G=8 16.2 -> 11.1 ms, G=64 72.0 -> 37.1; f32 G=8 33.0 -> 29.1, G=64 89.0 -> 51.3; gmm (16 MiB outputs)
// unchanged. MADV_POPULATE_WRITE after it (one thread faulting it all in) was slower: bf16 G=64 55.8.
// Advice only: where transparent huge pages are off, or none is free, the pages stay 4 KiB.
inline void ask_for_huge_pages(void* out, int64_t bytes) {
  constexpr uintptr_t HUGE_PAGE = uintptr_t(2) << 20;
  const uintptr_t lo = ((uintptr_t)out + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  const uintptr_t hi = ((uintptr_t)out + uintptr_t(bytes)) & ~(HUGE_PAGE - 1);
  if (hi > lo) madvise((void*)lo, hi - lo, MADV_HUGEPAGE);
}

// gmm over many groups with a row-major B and a float32 C is split by groups instead of by columns:
// a thread runs each of its groups over all n columns, in K chunks of B_BLOCK_BYTES of whole rows of
// B, so it reads B as one contiguous run. Split by columns, each thread reads half of every row of B
// (n = 1024 bfloat16: 1 KiB of each 2 KiB), and on the 2026-11-27 VM (2-core Intel Xeon with AMX) two
// threads read 128 MiB that way at 21-24 GB/s against 27-31 GB/s in contiguous halves. Measured there
// (m=4096, k=n=1024, skewed groups, f32 out, medians of 11-25 calls each after its own warm call and
// a 64 MiB cache eviction, side by side, in ms; every G shown split by groups):
//   bf16 (AMX):    G=64 14.2 -> 11.9, G=256 48.4 -> 36.4; G=8 6.8 -> 8.1, G=16 7.5 -> 7.4, G=32 9.1 -> 8.4
//   f32 (AVX-512): G=64 43.2 -> 40.0, G=256 82.1 -> 68.1; G=16 31.1 -> 36.2 and 30.3 -> 31.8, G=32 31.4 -> 33.5
// It pays where a group's product is bound by reading its B (few rows per group): at most
// MAX_ROWS_PER_GROUP on average, with GROUPS_PER_THREAD groups for the threads to claim so that
// skewed sizes even out.
constexpr int64_t B_BLOCK_BYTES = int64_t(1) << 20;
constexpr int64_t MAX_ROWS_PER_GROUP = 64;
constexpr int64_t GROUPS_PER_THREAD = 8;

// The K chunk length (a multiple of 32) for gmm split by groups, or 0 where gmm is split by columns.
template <typename In, typename Out>
int64_t group_split_k_chunk(int64_t groups_with_rows, int64_t rows, int64_t n, bool transpose_rhs,
                            ffi::ThreadPool& pool) {
  // Threads that run at once: the pool's, at most one per core (a pool made for 8 virtual devices
  // on 2 cores has more threads than cores). The core count is read once: glibc reads it from /sys.
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::min<int64_t>(pool.num_threads(), cores);
  if (!std::is_same_v<Out, float> || transpose_rhs || groups_with_rows < GROUPS_PER_THREAD * threads ||
      rows > MAX_ROWS_PER_GROUP * groups_with_rows)
    return 0;
  const int64_t b_rows = B_BLOCK_BYTES / (n * int64_t(sizeof(In))) / 32 * 32;
  return b_rows >= 128 ? b_rows : 0;   // n too wide for 128 whole rows of B in a block: split by columns
}

// ---- FFI handlers ---------------------------------------------------------------------------------

template <typename In, typename Out>
ffi::Error gmm_typed(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, bool transpose_rhs,
                     bool zero_init, ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool& pool) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  const int64_t m = ld[0], k = ld[1], groups = rd[0], n = out->dimensions()[1];
  auto work = std::make_shared<Work<In, Out>>();
  work->n = n;
  work->chunks = chunks_of((n + NR - 1) / NR, pool);
  work->split_rows = false;
  const In* a = (const In*)lhs.untyped_data();
  const In* b = (const In*)rhs.untyped_data();
  Out* c = (Out*)out->untyped_data();
  const int32_t* bd = bounds.typed_data();
  int64_t groups_with_rows = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r0 < 0 || r1 > m || r1 < r0) return ffi::Error::InvalidArgument("gmm: group bounds out of [0, m]");
    groups_with_rows += r1 > r0;
  }
  const int64_t k_chunk = group_split_k_chunk<In, Out>(groups_with_rows, bd[groups] - bd[0], n, transpose_rhs, pool);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r1 == r0) continue;
    if (k_chunk) work->group_starts.push_back(work->products.size());
    push_product(work->products, Product<In, Out>{r1 - r0, k, a + r0 * k, k, b + g * k * n,
                                              transpose_rhs ? 1 : n, transpose_rhs ? k : 1, c + r0 * n, n, false},
                 k_chunk ? k_chunk : K_CHUNK);
  }
  if (k_chunk) {
    work->group_starts.push_back(work->products.size());
    work->chunks = groups_with_rows;
    work->block_columns = n;
  }
  if (zero_init) {  // rows outside every local group (groups are contiguous: before the first, after the last)
    ask_for_huge_pages(c, int64_t(sizeof(Out)) * m * n);
    const int64_t first = std::clamp<int64_t>(bd[0], 0, m), last = std::clamp<int64_t>(bd[groups], first, m);
    std::memset(c, 0, sizeof(Out) * first * n);
    std::memset(c + last * n, 0, sizeof(Out) * (m - last) * n);
  }
  run_parallel(work, pool);
  return ffi::Error::Success();
}

template <typename In, typename Out>
ffi::Error tgmm_typed(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, bool zero_init,
                      ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool& pool) {
  const auto ld = lhs.dimensions(), od = out->dimensions();
  const int64_t k = ld[0], m = ld[1], groups = od[0], n = od[2];
  auto work = std::make_shared<Work<In, Out>>();
  work->n = n;
  work->chunks = chunks_of((k + MR - 1) / MR, pool);
  work->split_rows = true;
  const In* a = (const In*)lhs.untyped_data();
  const In* b = (const In*)rhs.untyped_data();
  Out* c = (Out*)out->untyped_data();
  const int32_t* bd = bounds.typed_data();
  if (zero_init) ask_for_huge_pages(c, int64_t(sizeof(Out)) * groups * k * n);   // before any write to it
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r0 < 0 || r1 > m || r1 < r0) return ffi::Error::InvalidArgument("tgmm: group bounds out of [0, m]");
    if (r1 > r0) {
      push_product(work->products, Product<In, Out>{k, r1 - r0, a + r0, m, b + r0 * n, n, 1, c + g * k * n, n, !zero_init});
    } else if (zero_init) {  // else out[g] keeps existing_out[g] (aliased)
      std::memset(c + g * k * n, 0, sizeof(Out) * k * n);
    }
  }
  run_parallel(work, pool);
  return ffi::Error::Success();
}

bool is(ffi::AnyBuffer x, ffi::DataType t) { return x.element_type() == t; }
bool is(ffi::Result<ffi::AnyBuffer>& x, ffi::DataType t) { return x->element_type() == t; }

// zero_init: existing is empty and out is written whole (zeros outside the groups); otherwise existing
// is aliased to out and rows outside the groups keep it.
ffi::Error gmm_impl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, ffi::AnyBuffer existing,
                    ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs, bool zero_init, ffi::ThreadPool pool) {
  (void)existing;
  using T = ffi::DataType;
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::F32)) return gmm_typed<float, float>(lhs, rhs, bounds, transpose_rhs, zero_init, out, pool);
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::BF16)) return gmm_typed<float, bf16>(lhs, rhs, bounds, transpose_rhs, zero_init, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::F32)) return gmm_typed<bf16, float>(lhs, rhs, bounds, transpose_rhs, zero_init, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::BF16)) return gmm_typed<bf16, bf16>(lhs, rhs, bounds, transpose_rhs, zero_init, out, pool);
  return ffi::Error::InvalidArgument("conveyor native gmm: operands must be float32 or bfloat16, both the same");
}

// zero_init: existing is empty and out is written whole (zeros for empty groups); otherwise existing is
// aliased to out and each group's sum starts from it.
ffi::Error tgmm_impl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, ffi::AnyBuffer existing,
                     ffi::Result<ffi::AnyBuffer> out, bool zero_init, ffi::ThreadPool pool) {
  (void)existing;
  using T = ffi::DataType;
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::F32)) return tgmm_typed<float, float>(lhs, rhs, bounds, zero_init, out, pool);
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::BF16)) return tgmm_typed<float, bf16>(lhs, rhs, bounds, zero_init, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::F32)) return tgmm_typed<bf16, float>(lhs, rhs, bounds, zero_init, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::BF16)) return tgmm_typed<bf16, bf16>(lhs, rhs, bounds, zero_init, out, pool);
  return ffi::Error::InvalidArgument("conveyor native tgmm: operands must be float32 or bfloat16, both the same");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConveyorGmm, gmm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<bool>("zero_init")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConveyorTgmm, tgmm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("zero_init")
                                  .Ctx<ffi::ThreadPool>());

// Whether this CPU runs the kernels (checked by build.py before the handlers are registered).
extern "C" __attribute__((visibility("default"))) int conveyor_native_cpu_supported() { return isa_supported(); }
