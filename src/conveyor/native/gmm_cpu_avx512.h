// AVX-512 part of the native CPU kernels (included by gmm_cpu.cc): float32 by vfmadd231ps, bfloat16 by
// vdpbf16ps on row pairs, 14 x 32 register tiles (28 zmm accumulators, two for the step's B, one for
// the broadcast of A). Needs AVX-512 F, BW, VL, BF16.

// Rows of C per register tile. 14 against 10 (each step's two loads of B then feed 28 FMAs, not 20),
// measured 2026-11-27 (2-core Intel VM, m=4096, k=n=1024, medians of 11-15 side by side, in ms):
// f32 tgmm G=8 32.6 -> 31.7 and 32.4 -> 28.8, G=64 49.6 -> 44.8 and 49.5 -> 46.5, G=1 23.4 -> 23.4;
// f32 gmm G=8 26.2 -> 25.1, G=1 26.8 -> 25.6, G=64 and 256 unchanged; bf16 by vdpbf16ps (the AVX-512
// build) within noise. 12 rows fell between.
constexpr int64_t MR = 14;
constexpr int64_t NR = 32;  // columns of C per register tile (two zmm of float32)
// Rows of B are packed in steps of PACK_UNITS 32-bit units (16 float32 rows, 16 bfloat16 row pairs) over
// all panels of a block, so a row-major B is read in runs of up to PANELS_PER_BLOCK * 128 bytes instead
// of one 128-byte piece per row.
constexpr int64_t PACK_UNITS = 16;
template <typename In>
constexpr int64_t pack_rows() { return PACK_UNITS * 4 / int64_t(sizeof(In)); }
// bfloat16 stays bfloat16 when packed, in row pairs for vdpbf16ps.
template <typename In>
using Packed = In;

// ---- C tile load / store in the output type ---------------------------------------------------

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


// (a[p], a[p + 1]) as one 32-bit word, the second zero past K.
inline uint32_t pair_at(const bf16* a, int64_t p, int64_t K) {
  uint32_t v = a[p];
  if (p + 1 < K) v |= uint32_t(a[p + 1]) << 16;
  return v;
}


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

// 32-bit units (float32 elements, bfloat16 pairs) [0, units) of `rows` rows of A (row_bytes apart)
// into dst32[u * MR + r]: 16 units of every row at a time, turned by one 16 x 16 transpose.
// Element by element it cost about a tenth of a tile's time; measured 2026-11-25 against it (2-core VM,
// m=4096, k=n=1024, medians of 7): gmm bf16 G=8 30.1 -> 23.4 ms, G=256 86.5 -> 73.9; f32 G=64 70.6 ->
// 58.0, G=256 121.6 -> 99.6; tgmm f32 G=8 71.4 -> 55.1; no row slower.
inline void pack_a_units(const uint8_t* a, int64_t row_bytes, int64_t rows, int64_t units, uint32_t* dst32) {
  int64_t u = 0;
  for (; u + 16 <= units; u += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(a + i * row_bytes + u * 4) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_mask_storeu_epi32(dst32 + (u + i) * MR, __mmask16((1u << MR) - 1), r[i]);
  }
  for (; u < units; ++u)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst32 + u * MR + r, a + r * row_bytes + u * 4, 4);
}

// Rows [i, i + rows) of A packed step by step, dst[p * MR + r] = A(i + r, p) (bfloat16: 32-bit pairs,
// dst32[pp * MR + r], the last one's second half zero for odd K): the register tile's broadcasts then
// read one contiguous stream instead of `rows` streams lda apart (for lda a multiple of 4 KiB all in
// one L1 set), and the bfloat16 tile needs no odd-K test per step. Packed once per row tile and block
// of panels. Measured 2026-11-25 against unpacked A, packing element by element then (2-core VM, m=4096,
// k=n=1024, medians of 9): bf16 gmm G=64 38.2 -> 35.4 ms, G=256 69.1 -> 62.3; float32 within noise
// (G=64 63.3 -> 60.4, G=256 100.1 -> 106.8).
template <typename Out>
inline void pack_a(const Product<float, Out>& P, const float* a, int64_t rows, float* dst) {
  pack_a_units((const uint8_t*)a, P.lda * 4, rows, P.K, (uint32_t*)dst);
}
template <typename Out>
inline void pack_a(const Product<bf16, Out>& P, const bf16* a, int64_t rows, bf16* dst) {
  uint32_t* d32 = (uint32_t*)dst;
  const int64_t full_pairs = P.K / 2;
  pack_a_units((const uint8_t*)a, P.lda * 2, rows, full_pairs, d32);
  if (P.K % 2)
    for (int64_t r = 0; r < rows; ++r) d32[full_pairs * MR + r] = a[r * P.lda + P.K - 1];
}

template <int R, typename Out>
inline void tile(const Product<float, Out>& P, const float* a, const float* bp, Out* c, int64_t w) {
  tile_f32<R>(P, a, bp, c, w);
}
template <int R, typename Out>
inline void tile(const Product<bf16, Out>& P, const bf16* a, const bf16* bp, Out* c, int64_t w) {
  tile_bf16<R>(P, a, bp, c, w);
}


inline int avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// The AMX build (gmm_cpu_amx.h) adds its own conditions.
#if !defined(CONVEYOR_ISA_AMX)
inline int isa_supported() { return avx512_supported(); }
#endif
