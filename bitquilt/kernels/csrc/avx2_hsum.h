// Horizontal sum of the 8 fp32 lanes of an AVX2 vector, shared by the CPU kernels.

#pragma once

#include <immintrin.h>

namespace bitquilt_simd {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace bitquilt_simd
