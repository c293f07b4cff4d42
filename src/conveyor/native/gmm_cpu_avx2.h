// AVX2 part of the native CPU kernels (included by gmm_cpu.cc when built with -DCONVEYOR_ISA_AVX2): for
// x86-64 CPUs without AVX-512 BF16 (most laptops and CI runners). float32 by vfmadd231ps on ymm, 6 x 16
// register tiles (12 accumulators of the 16 ymm registers). bfloat16 operands are widened to float32
// when packed, so their products are exact and summed in float32 as vdpbf16ps and XLA:CPU do; like
// them, subnormal bfloat16 inputs count as zero. Needs AVX2 and FMA.

constexpr int64_t MR = 6;   // rows of C per register tile
constexpr int64_t NR = 16;  // columns of C per register tile (two ymm of float32)
// Rows of B packed per step over all panels of a block (8 float32 units: one 8 x 8 transpose).
template <typename In>
constexpr int64_t pack_rows() { return 8; }
// Both input types are packed as float32.
template <typename In>
using Packed = float;

// ---- element conversions ---------------------------------------------------------------------------

inline float widen(float x) { return x; }
// bfloat16 -> float32, a subnormal (zero exponent) to a zero of its sign.
inline float widen(bf16 h) {
  const uint32_t bits = (h & 0x7F80) ? uint32_t(h) << 16 : uint32_t(h & 0x8000) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Eight consecutive elements as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000)),
                                               _mm256_setzero_si256());
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(bits, sign, subnormal));
}

// ---- C tile load / store in the output type (`lanes` of 8 real) -----------------------------------

inline __m256i lane_mask(int64_t lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<int64_t>(lanes, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load_c(const float* c, int64_t lanes) {
  return lanes >= 8 ? _mm256_loadu_ps(c) : _mm256_maskload_ps(c, lane_mask(lanes));
}
inline __m256 load_c(const bf16* c, int64_t lanes) {
  bf16 tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < std::min<int64_t>(lanes, 8); ++i) tmp[i] = c[i];
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)tmp)), 16));
}
inline void store_c(float* c, int64_t lanes, __m256 v) {
  if (lanes >= 8) _mm256_storeu_ps(c, v);
  else if (lanes > 0) _mm256_maskstore_ps(c, lane_mask(lanes), v);
}
// Round to nearest even, as XLA's float32 -> bfloat16 convert; a NaN stays a (quiet) NaN.
inline void store_c(bf16* c, int64_t lanes, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i h = _mm256_blendv_epi8(rounded, quiet_nan, nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  if (lanes >= 8) return _mm_storeu_si128((__m128i*)c, packed);
  bf16 tmp[8];
  _mm_storeu_si128((__m128i*)tmp, packed);
  for (int64_t i = 0; i < lanes; ++i) c[i] = tmp[i];
}

// ---- packing one NR-column panel of B ----------------------------------------------------------------

// In place: lane j of r[i] becomes lane i of r[j].
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // 128-bit half h of u[4 i + j] holds rows 4 i .. 4 i + 3 of column 4 h + j.
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// dst[p * NR + q] = B(p, j0 + q) as float32 for p in [p0, p1), zero past the w real columns.
template <typename In, typename Out>
inline void pack_panel(const Product<In, Out>& P, int64_t j0, int64_t w, float* dst, int64_t p0, int64_t p1) {
  if (columns_contiguous(P.b_row, P.b_col)) {
    if (w == NR && p1 - p0 == 8) {  // each column's 8 steps are one load; two 8 x 8 transposes
      for (int h = 0; h < NR; h += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = load8(P.b + (j0 + h + i) * P.b_col + p0);
        transpose8x8(r);
        for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (p0 + i) * NR + h, r[i]);
      }
      return;
    }
    for (int64_t q = 0; q < NR; ++q)
      for (int64_t p = p0; p < p1; ++p) dst[p * NR + q] = q < w ? widen(P.b[(j0 + q) * P.b_col + p]) : 0.f;
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const In* src = P.b + p * P.b_row + j0 * P.b_col;
    if (P.b_col == 1 && w == NR) {
      _mm256_store_ps(dst + p * NR, load8(src));
      _mm256_store_ps(dst + p * NR + 8, load8(src + 8));
    } else {
      for (int64_t q = 0; q < NR; ++q) dst[p * NR + q] = q < w ? widen(src[q * P.b_col]) : 0.f;
    }
  }
}

// Rows [i, i + rows) of A packed step by step as float32, dst[p * MR + r] = A(i + r, p).
template <typename In, typename Out>
inline void pack_a(const Product<In, Out>& P, const In* a, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < P.K; ++p) dst[p * MR + r] = widen(a[r * P.lda + p]);
}

// ---- register tile -----------------------------------------------------------------------------------

template <int R, typename In, typename Out>
inline void tile(const Product<In, Out>& P, const float* a, const float* bp, Out* c, int64_t w) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = P.accumulate ? load_c(c + r * P.ldc, w) : _mm256_setzero_ps();
    acc[r][1] = P.accumulate ? load_c(c + r * P.ldc + 8, w - 8) : _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < P.K; ++p) {
    const __m256 b0 = _mm256_load_ps(bp + p * NR), b1 = _mm256_load_ps(bp + p * NR + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + p * MR + r);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_c(c + r * P.ldc, w, acc[r][0]);
    store_c(c + r * P.ldc + 8, w - 8, acc[r][1]);
  }
}

inline int isa_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
