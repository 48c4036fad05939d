// AVX2 helpers shared by the CPU kernels: horizontal sum and dot product of fp32 vectors.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace bitquilt_simd {

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

}  // namespace bitquilt_simd
