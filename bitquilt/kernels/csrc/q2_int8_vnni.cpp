// The 2-bit x int8 matmul of q2_int8.cpp on AVX-512 VNNI, picked at run time when the CPU has it: a 64-byte step of
// the 32-row tile is one register whose lane l holds rows l and 16 + l; one shift and four masks give the codes of
// rows 0-15 and (x4) 16-31 at columns 8c .. 8c + 3 and 8c + 4 .. 8c + 7, and four vpdpbusd add each row's 4
// products into its lane (four accumulators, so no dot product waits for the one before). A block's sums are
// converted and scaled by its activation scale once per 32 columns, the rows' s and s * z once per group. Two tokens
// run together for prefill, each step's masks serving both. A single token prefetches the code stream
// PREFETCH_BYTES ahead, as the 4-bit tiles do (Zen 4, cold weights, the tile loop timed alone against a read pass:
// 8 KB 82-90% of the read rate, 6-12 KB alike, 4 KB 72-84%, 16 KB 74-83%, 2 KB 64-74%, none 58-70%); prefetching
// the row groups' stream too measured 4-11% slower, two accumulators per field (no vpdpbusd waiting on the one
// before) no faster cold and slower in L1.
//
// This file is compiled for AVX-512 VNNI (pragma below, after every include, as q4_int8_vnni.cpp); its entry point
// runs only after `has_vnni()`.

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "q4_int8.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")

namespace bitquilt_q4 {

namespace {

inline __m512i broadcast_word(const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, 4);
  return _mm512_set1_epi32(word);
}

// NT tokens (strided by K, K / 32 and groups) through one tile: out[t * 32 + r].
template <int NT>
void tile_tokens(const uint8_t* codes, const uint8_t* sz, const Weight& W, const int8_t* xi, const float* d,
                 const float* X, float* out) {
  const int64_t K = W.K, G = W.groups(), blocks_per_group = W.group / BLOCK;
  const __m512i m3 = _mm512_set1_epi8(0x03), mC = _mm512_set1_epi8(0x0C);
  __m512 total[NT][2];
  for (int t = 0; t < NT; ++t) total[t][0] = total[t][1] = _mm512_setzero_ps();
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m512 af[NT][2];  // the group's sums of rows 0-15 and (x4) 16-31, activation scales applied
    for (int t = 0; t < NT; ++t) af[t][0] = af[t][1] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i acc[NT][4];
      for (int t = 0; t < NT; ++t)
        for (int k = 0; k < 4; ++k) acc[t][k] = _mm512_setzero_si512();
      for (int64_t c = 0; c < BLOCK / W2_STEP; ++c, step += 64) {
        const __m512i v = _mm512_loadu_si512(step);
        if constexpr (NT == 1) prefetch_ahead(step, 1);
        const __m512i hi = _mm512_srli_epi16(v, 4);
        const __m512i f0 = _mm512_and_si512(v, m3), f1 = _mm512_and_si512(v, mC), f2 = _mm512_and_si512(hi, m3),
                      f3 = _mm512_and_si512(hi, mC);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = xi + t * K + b * BLOCK + c * W2_STEP;
          const __m512i a0 = broadcast_word(x), a1 = broadcast_word(x + 4);
          acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], f0, a0);
          acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], f1, a0);
          acc[t][2] = _mm512_dpbusd_epi32(acc[t][2], f2, a1);
          acc[t][3] = _mm512_dpbusd_epi32(acc[t][3], f3, a1);
        }
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 D = _mm512_set1_ps(d[t * (K / BLOCK) + b]);
        af[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[t][0], acc[t][2])), D, af[t][0]);
        af[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[t][1], acc[t][3])), D, af[t][1]);
      }
    }
    const uint8_t* p = sz + g * W2_GROUP_BYTES;
    __m512 s[2], s_z[2];
    for (int half = 0; half < 2; ++half) {
      s[half] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half)));
      s_z[half] = _mm512_mul_ps(s[half], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * half)))));
    }
    s[1] = _mm512_mul_ps(s[1], _mm512_set1_ps(0.25f));  // rows 16-31 were summed x4
    for (int t = 0; t < NT; ++t) {
      const __m512 Xg = _mm512_set1_ps(X[t * G + g]);
      for (int half = 0; half < 2; ++half)
        total[t][half] = _mm512_fnmadd_ps(s_z[half], Xg, _mm512_fmadd_ps(af[t][half], s[half], total[t][half]));
    }
  }
  for (int t = 0; t < NT; ++t) {
    _mm512_storeu_ps(out + t * W2_ROWS, total[t][0]);
    _mm512_storeu_ps(out + t * W2_ROWS + 16, total[t][1]);
  }
}

}  // namespace

void w2_tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d,
                   const float* X, float* y) {
  float out[2 * W2_ROWS];
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* codes = w2_tile_codes(W, i);
    const uint8_t* sz = w2_tile_scales(W, i);
    const int64_t rows = std::min(W2_ROWS, W.N - i * W2_ROWS);
    for (int64_t t = 0; t < T;) {
      const int n = t + 1 < T ? 2 : 1;
      const int8_t* x = xi + t * W.K;
      const float* dt = d + t * W.K / BLOCK;
      const float* Xt = X + t * W.groups();
      if (n == 2)
        tile_tokens<2>(codes, sz, W, x, dt, Xt, out);
      else
        tile_tokens<1>(codes, sz, W, x, dt, Xt, out);
      for (int u = 0; u < n; ++u, ++t) std::copy_n(out + u * W2_ROWS, rows, y + t * W.N + i * W2_ROWS);
    }
  }
}

}  // namespace bitquilt_q4

#pragma GCC pop_options
