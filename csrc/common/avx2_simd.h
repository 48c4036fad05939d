// AVX2 helpers shared by the CPU kernels: horizontal sum and dot product of fp32 vectors, e^x of 8 floats, a barrier
// to reassociation.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace bitquilt_simd {

// An empty asm the compiler cannot see through, holding `v` as it is: integer sums on either side of it stay in
// program order. GCC otherwise reassociates a fully unrolled chain of vpaddw into a tree, every product live at once
// and spilled to the stack (the AVX2 4-bit loop: 32 stores and reloads a block per token).
inline void keep_order(__m256i& v) { asm("" : "+x"(v)); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// sum_i a[i] * b[i] in 8 lanes, the tail scalar.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum8(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// e^x of 8 floats: x = n ln 2 + r with n = round(x / ln 2) and |r| <= ln 2 / 2 (ln 2 split in two parts so that r
// is exact), e^r = 1 + r + r^2 p(r) with p Cephes' degree-5 minimax polynomial for expf, times 2^n built in the
// exponent bits. x is clamped to [-87.3, 88] (e^x from ~1.2e-38 to ~1.65e38, 2^n a normal float; a NaN stays NaN);
// there it is within 1 ulp of the correctly rounded e^x. The decode step calls it where std::exp would run one value
// at a time: the SiLU of every MLP row and the softmax of every attention score.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));  // NaN in the second: kept
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 = 0.693359375 - 2.12194440e-4
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 er = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(er, _mm256_castsi256_ps(two_n));
}

}  // namespace bitquilt_simd
