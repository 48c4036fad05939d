// The 8-bit x int8 GEMV's row loop on vpdpbusd (avx512/uniform8.cpp says why it needs no sign tricks), built once
// per target: included after the target pragma of avx512/uniform8.cpp (AVX-512 VNNI, EVEX) and avxvnni/q4_int8.cpp
// (AVX-VNNI, VEX), each passing its encoding (vnni_dot.h); the template lives in an unnamed namespace (one copy per
// file). Rows [r0, r1) of one token rounded to int8 (codes i [K], block steps d [K / 32], group sums X [groups]).

#pragma once

namespace bitquilt_u8 {
namespace {

template <class Dot>
void rows_int8_dot(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i, const float* d,
                   const float* X, int64_t K, int64_t G, int64_t group, int64_t r0, int64_t r1, float* y) {
  const int64_t per_group = group / 32, blocks = K / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = q + r * K;
    if (r + 1 < r1) _mm_prefetch(reinterpret_cast<const char*>(qr + K), _MM_HINT_T0);
    __m256 total = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = g * per_group; b < std::min(blocks, (g + 1) * per_group); ++b) {
        if (b % 2 == 0) prefetch_ahead(qr + 32 * b, 1);
        const __m256i dot = Dot::dot(_mm256_setzero_si256(),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + 32 * b)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(i + 32 * b)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[b]), acc);
      }
      total = _mm256_fmadd_ps(acc, _mm256_set1_ps(scale[r * G + g]), total);
      offset += scale_zero[r * G + g] * X[g];
    }
    y[r] = bitquilt_simd::hsum8(total) - offset;
  }
}

}  // namespace
}  // namespace bitquilt_u8
