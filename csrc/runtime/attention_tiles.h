// The two products of causal attention for a tile of query rows that share one KV head, each key or value read
// once for all the tile's rows (so a prompt's attention runs at the FMA units' rate instead of re-reading the
// cache for every query row, as one row at a time does):
//
//   scores: s_r[j] = scaling * <q_r, k_j>             for j < n (the tile's longest row; a shorter row's extra
//                                                     scores are computed and left unused)
//   mix:    out_r  = sum_{j < n_r} p_r[j] v_j          (p_r: row r's softmax weights, n_r its own length)
//
// Each score and output element is summed in the same order as for a row alone (a score as bitquilt_simd::dot: 8
// lanes over the head dim, then hsum8; an output column in key order, one FMA per value), so the rows a tile
// holds, and hence how a prompt is split into blocks, never change a result: a prompt run in one call gives the
// logits of the same tokens run one at a time.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/avx2_simd.h"

namespace bitquilt_attention {

constexpr int kRows = 3;  // query rows per register tile: 3 x 4 accumulators, with the keys or values they share

// [hsum8(a), hsum8(b), hsum8(c), hsum8(d)], each summed in hsum8's order ((v0+v4 + v2+v6) + (v1+v5 + v3+v7)), four
// at once.
inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // [a: 0+2, 1+3, c: ..]
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));  // [a, c, ..][b, d, ..]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// The largest of s[0..n), NaNs passed over (as `top = std::max(top, s[j])` from -inf does), 8 lanes at a time.
inline float max_of(const float* s, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(_mm256_loadu_ps(s + j), top8);  // a NaN first: the second kept
  float lanes[8], top = -INFINITY;
  _mm256_storeu_ps(lanes, top8);
  for (const float v : lanes) top = std::max(top, v);
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// s[r][j] = scaling * <q[r], k_j> for r < R and j < n, keys k [n, hd].
template <int R>
void scores(const float* const* q, const float* k, int64_t n, int64_t hd, float scaling, float* const* s) {
  int64_t j = 0;
  for (; hd % 8 == 0 && j + 4 <= n; j += 4) {
    const float* kj = k + j * hd;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 k0 = _mm256_loadu_ps(kj + d), k1 = _mm256_loadu_ps(kj + hd + d),
                   k2 = _mm256_loadu_ps(kj + 2 * hd + d), k3 = _mm256_loadu_ps(kj + 3 * hd + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qr = _mm256_loadu_ps(q[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qr, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qr, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qr, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qr, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s[r] + j, _mm_mul_ps(_mm_set1_ps(scaling), hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])));
  }
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) s[r][j] = scaling * bitquilt_simd::dot(q[r], k + j * hd, hd);
}

// out[r] = sum_{j < n[r]} p[r][j] v_j for r < R, values v [max n, hd]; n ascending in r.
template <int R>
void mix(const float* const* p, const int64_t* n, const float* v, int64_t hd, float* const* out) {
  int64_t c0 = 0;
  for (; hd % 8 == 0 && c0 < hd; c0 += 32) {
    const int width = static_cast<int>(std::min<int64_t>(32, hd - c0) / 8);
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < 4; ++w) acc[r][w] = _mm256_setzero_ps();
    const float* vc = v + c0;
    if (width == 4) {
      for (int64_t j = 0; j < n[0]; ++j) {  // every row's
        const __m256 v0 = _mm256_loadu_ps(vc + j * hd), v1 = _mm256_loadu_ps(vc + j * hd + 8),
                     v2 = _mm256_loadu_ps(vc + j * hd + 16), v3 = _mm256_loadu_ps(vc + j * hd + 24);
        for (int r = 0; r < R; ++r) {
          const __m256 pr = _mm256_set1_ps(p[r][j]);
          acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
          acc[r][2] = _mm256_fmadd_ps(pr, v2, acc[r][2]);
          acc[r][3] = _mm256_fmadd_ps(pr, v3, acc[r][3]);
        }
      }
    }
    for (int r = 0; r < R; ++r)  // the keys only the longer rows have (all of them where the width is short)
      for (int64_t j = width == 4 ? n[0] : 0; j < n[r]; ++j) {
        const __m256 pr = _mm256_set1_ps(p[r][j]);
        for (int w = 0; w < width; ++w)
          acc[r][w] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vc + j * hd + 8 * w), acc[r][w]);
      }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < width; ++w) _mm256_storeu_ps(out[r] + c0 + 8 * w, acc[r][w]);
  }
  for (int r = 0; r < R; ++r)  // a head dim that is no multiple of 8
    for (int64_t c = c0; c < hd; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n[r]; ++j) sum += p[r][j] * v[j * hd + c];
      out[r][c] = sum;
    }
}

// `scores` and `mix` over `rows` query rows, kRows at a time.
inline void scores_rows(const float* const* q, int64_t rows, const float* k, int64_t n, int64_t hd, float scaling,
                        float* const* s) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) scores<kRows>(q + r, k, n, hd, scaling, s + r);
  for (; r < rows; ++r) scores<1>(q + r, k, n, hd, scaling, s + r);
}

inline void mix_rows(const float* const* p, const int64_t* n, int64_t rows, const float* v, int64_t hd,
                     float* const* out) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) mix<kRows>(p + r, n + r, v, hd, out + r);
  for (; r < rows; ++r) mix<1>(p + r, n + r, v, hd, out + r);
}

}  // namespace bitquilt_attention
