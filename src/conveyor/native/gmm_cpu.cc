// Native CPU kernels for gmm and tgmm (float32 and bfloat16 on AVX-512), called through the XLA FFI.
//
// Both ops are a list of independent matrix products, one per group: C_g (+)= A_g @ B_g.
//   gmm:  C_g = out[rows of g]  (M = group rows, K = k),   A_g = lhs[rows of g], B_g = rhs[g] (or rhs[g]^T)
//   tgmm: C_g = out[g] + ...    (M = k, K = group rows),   A_g = lhs[:, rows of g], B_g = rhs[rows of g]
// Each product is computed the GotoBLAS way: a block of panels of B (K x 32 columns each) is packed
// contiguous, the register tile's 10 rows of A are packed step by step, then the tile of 10 rows x 32
// columns of C is accumulated over all of K in 20 zmm registers, with one broadcast of A per row and
// step. A transposed B is packed by 16 x 16 register transposes. The work is split into chunks (gmm: ranges of
// columns; tgmm: ranges of rows) that the XLA CPU thread pool's workers and the calling thread claim
// from an atomic counter (no thread ever waits for a task that has not started, so a busy pool cannot
// deadlock the call). Group bounds come from the
// caller, already clamped to [0, m]. Rows (gmm) or blocks (tgmm) no group computes keep existing_out,
// aliased to the output, or, when the op made existing_out itself (`zero_init`: all zeros), are
// zeroed in a fresh output. Built and loaded by conveyor/native/build.py.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t MR = 10;  // rows of C per register tile
constexpr int64_t NR = 32;  // columns of C per register tile (two zmm of float32)
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

// ---- C tile load / store in the output type ------------------------------------------------------

inline __m512 load_c(const float* c, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, c); }
inline __m512 load_c(const bf16* c, __mmask16 mask) {
  __m256i h = _mm256_maskz_loadu_epi16(mask, c);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_c(float* c, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(c, mask, v); }
inline void store_c(bf16* c, __mmask16 mask, __m512 v) {
  // Round to nearest even, as XLA's float32 -> bfloat16 convert.
  _mm256_mask_storeu_epi16(c, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __mmask16 lane_mask(int64_t lanes) {
  return lanes >= 16 ? __mmask16(0xFFFF) : lanes <= 0 ? __mmask16(0) : __mmask16((1u << lanes) - 1);
}

// ---- packing one NR-column panel of B -------------------------------------------------------------

// Rows of B are packed in steps of PACK_UNITS 32-bit units (16 float32 rows, 16 bfloat16 row pairs) over all panels of a block, so a row-major
// B is read in runs of up to PANELS_PER_BLOCK * 128 bytes instead of one 128-byte piece per 4 KiB row.
// Measured 2026-11-25 (2-core VM, m=4096, k=n=1024, medians of 5 after bench.timing.settle): blocks of
// 1 panel packed whole (K rows), and of 4, 8 or 32 panels in steps of 16 rows, were within run-to-run
// noise of each other (gmm G=64 f32 60-74 ms, tgmm G=256 f32 371-459 ms, no variant best throughout).
constexpr int64_t PACK_UNITS = 16;
constexpr int64_t PANELS_PER_BLOCK = 8;

// (a[p], a[p + 1]) as one 32-bit word, the second zero past K.
inline uint32_t pair_at(const bf16* a, int64_t p, int64_t K) {
  uint32_t v = a[p];
  if (p + 1 < K) v |= uint32_t(a[p + 1]) << 16;
  return v;
}

// A transposed B (gmm's transpose_rhs: each column contiguous along p) is packed column by column,
// reading each column's run of p instead of gathering 32 columns at every p.
inline bool columns_contiguous(int64_t b_row, int64_t b_col) { return b_row == 1 && b_col != 1; }

// In place: lane j of r[i] becomes lane i of r[j] (a 16 x 16 transpose of 32-bit elements).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // Now 128-bit chunk c of r[4 i + j] holds rows 4 i .. 4 i + 3 of column 4 c + j.
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), w = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), w2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(v, v2, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(v, v2, 0xdd);
    t[4 + j] = _mm512_shuffle_i32x4(w, w2, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(w, w2, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A transposed B's panel, 16 units of 32 bits (float32 rows, or bfloat16 row pairs) from u0 on, for
// all NR columns: each column's 16 units are one contiguous 64-byte load; two 16 x 16 transposes
// turn them into the panel's rows, dst32[u * NR + q].
inline void pack_transposed_units(const uint8_t* col0, int64_t col_bytes, int64_t u0, uint32_t* dst32) {
  for (int h = 0; h < NR; h += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(col0 + (h + i) * col_bytes + u0 * 4);
    transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_si512((__m512i*)(dst32 + (u0 + i) * NR + h), r[i]);
  }
}

// float32: dst[p * NR + q] = B(p, j0 + q) for p in [p0, p1), zero past the w real columns.
template <typename Out>
inline void pack_panel(const Product<float, Out>& P, int64_t j0, int64_t w, float* dst, int64_t p0, int64_t p1) {
  if (columns_contiguous(P.b_row, P.b_col)) {
    if (w == NR && p1 - p0 == 16) {
      return pack_transposed_units((const uint8_t*)(P.b + j0 * P.b_col), P.b_col * 4, p0, (uint32_t*)dst);
    }
    for (int64_t q = 0; q < NR; ++q) {
      const float* col = P.b + (j0 + q) * P.b_col;
      for (int64_t p = p0; p < p1; ++p) dst[p * NR + q] = q < w ? col[p] : 0.f;
    }
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const float* src = P.b + p * P.b_row + j0 * P.b_col;
    if (P.b_col == 1 && w == NR) {
      _mm512_store_ps(dst + p * NR, _mm512_loadu_ps(src));
      _mm512_store_ps(dst + p * NR + 16, _mm512_loadu_ps(src + 16));
    } else {
      for (int64_t q = 0; q < NR; ++q) dst[p * NR + q] = q < w ? src[q * P.b_col] : 0.f;
    }
  }
}

// bfloat16: pairs of rows interleaved for vdpbf16ps, dst[(pp * NR + q) * 2 + e] = B(2 pp + e, j0 + q),
// zero past K and past the w real columns.
// Pairs pp in [p0 / 2, p1 / 2) (p0, p1 even, or p1 = K).
template <typename Out>
inline void pack_panel(const Product<bf16, Out>& P, int64_t j0, int64_t w, bf16* dst, int64_t p0, int64_t p1) {
  if (columns_contiguous(P.b_row, P.b_col)) {
    uint32_t* d32 = (uint32_t*)dst;
    if (w == NR && p1 - p0 == 32 && p1 <= P.K) {  // 16 whole pairs
      return pack_transposed_units((const uint8_t*)(P.b + j0 * P.b_col), P.b_col * 2, p0 / 2, d32);
    }
    for (int64_t q = 0; q < NR; ++q) {
      const bf16* col = P.b + (j0 + q) * P.b_col;
      for (int64_t pp = p0 / 2; pp < (p1 + 1) / 2; ++pp) d32[pp * NR + q] = q < w ? pair_at(col, 2 * pp, P.K) : 0;
    }
    return;
  }
  for (int64_t pp = p0 / 2; pp < (p1 + 1) / 2; ++pp) {
    bf16* d = dst + pp * NR * 2;
    const bool second = 2 * pp + 1 < P.K;
    const bf16* r0 = P.b + (2 * pp) * P.b_row + j0 * P.b_col;
    const bf16* r1 = r0 + P.b_row;
    if (P.b_col == 1 && w == NR && second) {
      // Interleave two rows of 32 bf16: (r0[q], r1[q]) for q = 0..31.
      const __m512i x = _mm512_loadu_si512(r0), y = _mm512_loadu_si512(r1);
      const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
      _mm512_store_si512((__m512i*)d, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_store_si512((__m512i*)(d + 32), _mm512_permutex2var_epi16(x, hi_idx, y));
    } else {
      for (int64_t q = 0; q < NR; ++q) {
        d[2 * q] = q < w ? r0[q * P.b_col] : 0;
        d[2 * q + 1] = (q < w && second) ? r1[q * P.b_col] : 0;
      }
    }
  }
}

// ---- register tiles -------------------------------------------------------------------------------

template <int R, typename Out>
inline void tile_f32(const Product<float, Out>& P, const float* a, const float* bp, Out* c, int64_t w) {
  const __mmask16 m0 = lane_mask(w), m1 = lane_mask(w - 16);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = P.accumulate ? load_c(c + r * P.ldc, m0) : _mm512_setzero_ps();
    acc[r][1] = P.accumulate ? load_c(c + r * P.ldc + 16, m1) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < P.K; ++p) {
    const __m512 b0 = _mm512_load_ps(bp + p * NR), b1 = _mm512_load_ps(bp + p * NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[p * MR + r]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_c(c + r * P.ldc, m0, acc[r][0]);
    store_c(c + r * P.ldc + 16, m1, acc[r][1]);
  }
}

template <int R, typename Out>
inline void tile_bf16(const Product<bf16, Out>& P, const bf16* a, const bf16* bp, Out* c, int64_t w) {
  const __mmask16 m0 = lane_mask(w), m1 = lane_mask(w - 16);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = P.accumulate ? load_c(c + r * P.ldc, m0) : _mm512_setzero_ps();
    acc[r][1] = P.accumulate ? load_c(c + r * P.ldc + 16, m1) : _mm512_setzero_ps();
  }
  const int64_t pairs = (P.K + 1) / 2;
  for (int64_t pp = 0; pp < pairs; ++pp) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512((const __m512i*)(bp + pp * NR * 2));
    const __m512bh b1 = (__m512bh)_mm512_load_si512((const __m512i*)(bp + pp * NR * 2 + 32));
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(((const uint32_t*)a)[pp * MR + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_c(c + r * P.ldc, m0, acc[r][0]);
    store_c(c + r * P.ldc + 16, m1, acc[r][1]);
  }
}

// Rows [i, i + rows) of A packed step by step, dst[p * MR + r] = A(i + r, p) (bfloat16: 32-bit pairs,
// dst32[pp * MR + r], the last one's second half zero for odd K): the register tile's broadcasts then
// read one contiguous stream instead of `rows` streams lda apart (for lda a multiple of 4 KiB all in
// one L1 set), and the bfloat16 tile needs no odd-K test per step. Packed once per row tile and block
// of panels. Measured 2026-11-25 (2-core VM, m=4096, k=n=1024, medians of 9): bf16 gmm G=64 38.2 -> 35.4
// ms, G=256 69.1 -> 62.3; float32 within noise (G=64 63.3 -> 60.4, G=256 100.1 -> 106.8).
template <typename Out>
inline void pack_a(const Product<float, Out>& P, const float* a, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < P.K; ++p) dst[p * MR + r] = a[r * P.lda + p];
}
template <typename Out>
inline void pack_a(const Product<bf16, Out>& P, const bf16* a, int64_t rows, bf16* dst) {
  uint32_t* d32 = (uint32_t*)dst;
  const int64_t full_pairs = P.K / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* src = a + r * P.lda;
    for (int64_t pp = 0; pp < full_pairs; ++pp) std::memcpy(d32 + pp * MR + r, src + 2 * pp, 4);
    if (P.K % 2) d32[full_pairs * MR + r] = src[P.K - 1];
  }
}

template <int R, typename Out>
inline void tile(const Product<float, Out>& P, const float* a, const float* bp, Out* c, int64_t w) {
  tile_f32<R>(P, a, bp, c, w);
}
template <int R, typename Out>
inline void tile(const Product<bf16, Out>& P, const bf16* a, const bf16* bp, Out* c, int64_t w) {
  tile_bf16<R>(P, a, bp, c, w);
}

template <typename In, typename Out, int R = MR>
inline void tile_rows(int64_t rows, const Product<In, Out>& P, const In* a, const In* bp, Out* c, int64_t w) {
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

// Rows [m0, m1) and columns [j0, j1) (at most one block of PANELS_PER_BLOCK panels) of one product: the
// block's panels are packed (`pack` holds them, K x NR each, K rounded up to pairs), then every
// register tile of the rows runs over them, prefetching `next` a part per row tile.
template <typename In, typename Out>
void product_block(const Product<In, Out>& P, int64_t m0, int64_t m1, int64_t j0, int64_t j1,
                   const BlockSource<In, Out>& next, std::vector<In>& pack) {
  if (m1 <= m0 || j1 <= j0 || P.K <= 0) return;
  const int64_t panel = (P.K + 1) / 2 * 2 * NR;
  const size_t need = size_t(panel * PANELS_PER_BLOCK + panel / NR * MR) + 128;
  if (pack.size() < need) pack.resize(need);
  In* bp = (In*)(((uintptr_t)pack.data() + 63) & ~uintptr_t(63));
  In* ap = (In*)(((uintptr_t)(bp + panel * PANELS_PER_BLOCK) + 63) & ~uintptr_t(63));  // MR x K, rounded to pairs
  const int64_t panels = (j1 - j0 + NR - 1) / NR;
  constexpr int64_t rows = PACK_UNITS * 4 / int64_t(sizeof(In));
  for (int64_t p = 0; p < P.K; p += rows)
    for (int64_t q = 0; q < panels; ++q)
      pack_panel(P, j0 + q * NR, std::min(NR, j1 - j0 - q * NR), bp + q * panel, p, std::min(P.K, p + rows));
  const int64_t row_tiles = (m1 - m0 + MR - 1) / MR;
  for (int64_t t = 0; t < row_tiles; ++t) {
    const int64_t i = m0 + t * MR;
    pack_a(P, P.a + i * P.lda, std::min(MR, m1 - i), ap);
    for (int64_t q = 0; q < panels; ++q)
      tile_rows<In, Out>(std::min(MR, m1 - i), P, ap, bp + q * panel, P.c + i * P.ldc + j0 + q * NR,
                         std::min(NR, j1 - j0 - q * NR));
    next.prefetch(t, row_tiles);
  }
}

// ---- the work split over threads ------------------------------------------------------------------

// Every group's product over chunk `chunk` of `chunks`: a range of column panels (gmm, whose groups
// may have few rows), or of row tiles (tgmm, whose products all have k rows: the threads then write
// disjoint rows of the output, so they never fault in the same fresh page).
template <typename In, typename Out>
struct Work {
  std::vector<Product<In, Out>> products;
  int64_t n, chunks;
  bool split_rows;
  std::atomic<int64_t> next{0}, done{0};

  // This chunk's rows and columns of product P.
  void extent(const Product<In, Out>& P, int64_t chunk, int64_t& m0, int64_t& m1, int64_t& n0, int64_t& n1) const {
    if (split_rows) {
      const int64_t tiles = (P.M + MR - 1) / MR;
      m0 = tiles * chunk / chunks * MR, m1 = std::min(P.M, tiles * (chunk + 1) / chunks * MR), n0 = 0, n1 = n;
    } else {
      const int64_t panels = (n + NR - 1) / NR;
      m0 = 0, m1 = P.M, n0 = panels * chunk / chunks * NR, n1 = std::min(n, panels * (chunk + 1) / chunks * NR);
    }
  }

  // Every group's product over this chunk, block of panels by block, each prefetching the next one's B.
  void run_chunk(int64_t chunk, std::vector<In>& pack) {
    constexpr int64_t BLOCK = NR * PANELS_PER_BLOCK;
    for (size_t g = 0; g < products.size(); ++g) {
      const auto& P = products[g];
      int64_t m0, m1, n0, n1;
      extent(P, chunk, m0, m1, n0, n1);
      for (int64_t jb = n0; jb < n1; jb += BLOCK) {
        BlockSource<In, Out> next;
        if (jb + BLOCK < n1) {
          next = {&P, jb + BLOCK, std::min(n1, jb + 2 * BLOCK)};
        } else if (g + 1 < products.size()) {
          int64_t a0, a1, b0, b1;
          extent(products[g + 1], chunk, a0, a1, b0, b1);
          if (a1 > a0 && b1 > b0) next = {&products[g + 1], b0, std::min(b1, b0 + BLOCK)};
        }
        product_block(P, m0, m1, jb, std::min(n1, jb + BLOCK), next, pack);
      }
    }
  }

  // Claim and run chunks until none is left.
  void drain() {
    thread_local std::vector<In> pack;
    for (int64_t chunk; (chunk = next.fetch_add(1)) < chunks;) {
      run_chunk(chunk, pack);
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
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r0 < 0 || r1 > m || r1 < r0) return ffi::Error::InvalidArgument("gmm: group bounds out of [0, m]");
    if (r1 == r0) continue;
    work->products.push_back(Product<In, Out>{r1 - r0, k, a + r0 * k, k, b + g * k * n,
                                              transpose_rhs ? 1 : n, transpose_rhs ? k : 1, c + r0 * n, n, false});
  }
  if (zero_init) {  // rows outside every local group (groups are contiguous: before the first, after the last)
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
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r0 < 0 || r1 > m || r1 < r0) return ffi::Error::InvalidArgument("tgmm: group bounds out of [0, m]");
    if (r1 > r0) {
      work->products.push_back(Product<In, Out>{k, r1 - r0, a + r0, m, b + r0 * n, n, 1, c + g * k * n, n, !zero_init});
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
extern "C" __attribute__((visibility("default"))) int conveyor_native_cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
