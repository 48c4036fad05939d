// Rounding a block of 32 fp32 activations to int8 (scale max|x| / 127), shared by the int8-activation kernels
// (q4_int8.cpp, uniform8_gemv.cpp): llama.cpp's Q8 activation blocks.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"
#include "common/parallel.h"

namespace bitquilt_int8 {

constexpr int64_t BLOCK = 32;  // activations per scale

struct Rounded {
  __m256i codes;  // 32 int8 in column order
  float d;        // the step: x ~ d * code
  float sum;      // sum of the codes (exact integer)
};

// i_c = round-to-nearest-even(x_c * 127 / max|x|) for the 32 values at x (all zero when they are).
inline Rounded round_block(const float* x) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < BLOCK; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), absmask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i sum = _mm256_setzero_si256();
  __m256i v[4];
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv));
    sum = _mm256_add_epi32(sum, v[j]);
  }
  // packs interleave 128-bit lanes; the permute restores column order
  const __m256i w8 = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return {w8, amax / 127.0f, bitquilt_simd::hsum8(_mm256_cvtepi32_ps(sum))};
}

// Tokens x [T, K] (K a multiple of 32) rounded block by block, for the kernels that read activations in column
// order (uniform8_gemv.cpp, q4_int8.cpp): codes [T, K] in column order, block scales d [T, K / 32] and each group's
// sum of d * code, X [T, ceil(K / group)]. A prompt's tokens are rounded in parallel, 16 to a task.
struct RoundedTokens {
  std::vector<int8_t> codes;
  std::vector<float> d, X;

  RoundedTokens(const float* x, int64_t T, int64_t K, int64_t group) {
    const int64_t blocks = K / BLOCK, G = (K + group - 1) / group;
    codes.resize(T * K);
    d.resize(T * blocks);
    X.assign(T * G, 0.0f);
    bitquilt_par::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t b = 0; b < blocks; ++b) {
          const Rounded r = round_block(x + t * K + BLOCK * b);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes.data() + t * K + BLOCK * b), r.codes);
          d[t * blocks + b] = r.d;
          X[t * G + BLOCK * b / group] += r.d * r.sum;
        }
    });
  }
};

}  // namespace bitquilt_int8
