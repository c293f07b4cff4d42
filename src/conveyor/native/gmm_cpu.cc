// Native CPU kernels for gmm and tgmm (float32 and bfloat16 on AVX-512), called through the XLA FFI.
//
// Both ops are a list of independent matrix products, one per group: C_g (+)= A_g @ B_g.
//   gmm:  C_g = out[rows of g]  (M = group rows, K = k),   A_g = lhs[rows of g], B_g = rhs[g] (or rhs[g]^T)
//   tgmm: C_g = out[g] + ...    (M = k, K = group rows),   A_g = lhs[:, rows of g], B_g = rhs[rows of g]
// Each product is computed the GotoBLAS way: a panel of B (K x 32 columns) is packed contiguous, then
// a register tile of 10 rows x 32 columns of C is accumulated over all of K in 20 zmm registers, with
// one broadcast of A per row and step. The columns of n are split into chunks that the XLA CPU
// thread pool's workers and the calling thread claim from an atomic counter (no thread ever waits for
// a task that has not started, so a busy pool cannot deadlock the call). Group bounds come from the
// caller, already clamped to [0, m]; rows outside every group are not touched (the output aliases
// existing_out). Built and loaded by conveyor/native/build.py.
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

// float32: dst[p * NR + q] = B(p, j0 + q), zero past the w real columns.
template <typename Out>
inline void pack_panel(const Product<float, Out>& P, int64_t j0, int64_t w, float* dst) {
  for (int64_t p = 0; p < P.K; ++p) {
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
template <typename Out>
inline void pack_panel(const Product<bf16, Out>& P, int64_t j0, int64_t w, bf16* dst) {
  const int64_t pairs = (P.K + 1) / 2;
  for (int64_t pp = 0; pp < pairs; ++pp) {
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
      const __m512 av = _mm512_set1_ps(a[r * P.lda + p]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_c(c + r * P.ldc, m0, acc[r][0]);
    store_c(c + r * P.ldc + 16, m1, acc[r][1]);
  }
}

inline uint32_t pair_at(const bf16* a, int64_t p, int64_t K) {
  uint32_t v = a[p];
  if (p + 1 < K) v |= uint32_t(a[p + 1]) << 16;
  return v;
}

template <int R, typename Out>
inline void tile_bf16(const Product<bf16, Out>& P, const bf16* a, const bf16* bp, Out* c, int64_t w) {
  const __mmask16 m0 = lane_mask(w), m1 = lane_mask(w - 16);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = P.accumulate ? load_c(c + r * P.ldc, m0) : _mm512_setzero_ps();
    acc[r][1] = P.accumulate ? load_c(c + r * P.ldc + 16, m1) : _mm512_setzero_ps();
  }
  const int64_t full_pairs = P.K / 2, pairs = (P.K + 1) / 2;
  for (int64_t pp = 0; pp < pairs; ++pp) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512((const __m512i*)(bp + pp * NR * 2));
    const __m512bh b1 = (__m512bh)_mm512_load_si512((const __m512i*)(bp + pp * NR * 2 + 32));
    for (int r = 0; r < R; ++r) {
      uint32_t v;
      if (pp < full_pairs) std::memcpy(&v, a + r * P.lda + 2 * pp, 4);
      else v = pair_at(a + r * P.lda, 2 * pp, P.K);  // odd K: the last pair's second half is zero
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(v));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_c(c + r * P.ldc, m0, acc[r][0]);
    store_c(c + r * P.ldc + 16, m1, acc[r][1]);
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

// Columns [n0, n1) of one product. `pack` holds one packed panel (K x NR, rounded up to pairs).
template <typename In, typename Out>
void product_columns(const Product<In, Out>& P, int64_t n0, int64_t n1, std::vector<In>& pack) {
  if (P.M <= 0 || P.K <= 0) return;
  const size_t need = size_t((P.K + 1) / 2 * 2) * NR + 64;
  if (pack.size() < need) pack.resize(need);
  In* bp = (In*)(((uintptr_t)pack.data() + 63) & ~uintptr_t(63));
  for (int64_t j = n0; j < n1; j += NR) {
    const int64_t w = std::min(NR, n1 - j);
    pack_panel(P, j, w, bp);
    for (int64_t i = 0; i < P.M; i += MR)
      tile_rows<In, Out>(std::min(MR, P.M - i), P, P.a + i * P.lda, bp, P.c + i * P.ldc + j, w);
  }
}

// ---- the work split over threads ------------------------------------------------------------------

// Every group's product over column chunk `chunk` of `chunks`.
template <typename In, typename Out>
struct Work {
  std::vector<Product<In, Out>> products;
  int64_t n, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void run_chunk(int64_t chunk, std::vector<In>& pack) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t p0 = panels * chunk / chunks, p1 = panels * (chunk + 1) / chunks;
    const int64_t n0 = p0 * NR, n1 = std::min(n, p1 * NR);
    for (const auto& P : products) product_columns(P, n0, n1, pack);
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

int64_t column_chunks(int64_t n, ffi::ThreadPool& pool) {
  const int64_t panels = (n + NR - 1) / NR;
  return std::max<int64_t>(1, std::min<int64_t>(panels, pool.num_threads() + 1));
}

// ---- FFI handlers ---------------------------------------------------------------------------------

template <typename In, typename Out>
ffi::Error gmm_typed(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, bool transpose_rhs,
                     ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool& pool) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  const int64_t m = ld[0], k = ld[1], groups = rd[0], n = out->dimensions()[1];
  auto work = std::make_shared<Work<In, Out>>();
  work->n = n;
  work->chunks = column_chunks(n, pool);
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
  run_parallel(work, pool);
  return ffi::Error::Success();
}

template <typename In, typename Out>
ffi::Error tgmm_typed(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds,
                      ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool& pool) {
  const auto ld = lhs.dimensions(), od = out->dimensions();
  const int64_t k = ld[0], m = ld[1], groups = od[0], n = od[2];
  auto work = std::make_shared<Work<In, Out>>();
  work->n = n;
  work->chunks = column_chunks(n, pool);
  const In* a = (const In*)lhs.untyped_data();
  const In* b = (const In*)rhs.untyped_data();
  Out* c = (Out*)out->untyped_data();
  const int32_t* bd = bounds.typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = bd[g], r1 = bd[g + 1];
    if (r0 < 0 || r1 > m || r1 < r0) return ffi::Error::InvalidArgument("tgmm: group bounds out of [0, m]");
    if (r1 == r0) continue;  // out[g] keeps existing_out[g]
    work->products.push_back(Product<In, Out>{k, r1 - r0, a + r0, m, b + r0 * n, n, 1, c + g * k * n, n, true});
  }
  run_parallel(work, pool);
  return ffi::Error::Success();
}

bool is(ffi::AnyBuffer x, ffi::DataType t) { return x.element_type() == t; }
bool is(ffi::Result<ffi::AnyBuffer>& x, ffi::DataType t) { return x->element_type() == t; }

ffi::Error gmm_impl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, ffi::AnyBuffer existing,
                    ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs, ffi::ThreadPool pool) {
  (void)existing;  // aliased to out: rows outside the groups keep it
  using T = ffi::DataType;
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::F32)) return gmm_typed<float, float>(lhs, rhs, bounds, transpose_rhs, out, pool);
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::BF16)) return gmm_typed<float, bf16>(lhs, rhs, bounds, transpose_rhs, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::F32)) return gmm_typed<bf16, float>(lhs, rhs, bounds, transpose_rhs, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::BF16)) return gmm_typed<bf16, bf16>(lhs, rhs, bounds, transpose_rhs, out, pool);
  return ffi::Error::InvalidArgument("conveyor native gmm: operands must be float32 or bfloat16, both the same");
}

ffi::Error tgmm_impl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> bounds, ffi::AnyBuffer existing,
                     ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool pool) {
  (void)existing;  // aliased to out: each group's sum starts from it
  using T = ffi::DataType;
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::F32)) return tgmm_typed<float, float>(lhs, rhs, bounds, out, pool);
  if (is(lhs, T::F32) && is(rhs, T::F32) && is(out, T::BF16)) return tgmm_typed<float, bf16>(lhs, rhs, bounds, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::F32)) return tgmm_typed<bf16, float>(lhs, rhs, bounds, out, pool);
  if (is(lhs, T::BF16) && is(rhs, T::BF16) && is(out, T::BF16)) return tgmm_typed<bf16, bf16>(lhs, rhs, bounds, out, pool);
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
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConveyorTgmm, tgmm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<ffi::ThreadPool>());

// Whether this CPU runs the kernels (checked by build.py before the handlers are registered).
extern "C" __attribute__((visibility("default"))) int conveyor_native_cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
