// y [T, N] = x [T, K] W^T for a row-major fp32 W [N, K], shared by the fused decode step (dense linears and the LM
// head, decode_step.cpp) and the standalone runtime (standalone.cpp). Each W row, read once in order, meets up to
// eight tokens at a time (independent FMA chains, the row in L1 for the next eight), and each output is summed as
// bitquilt_simd::dot sums one (8 lanes, hsum8, the scalar tail), so a token's row comes out the same whatever tokens
// share the call (a BLAS GEMM's rows may round otherwise for another row count). Two rows at a time lost at few
// tokens: interleaving two rows' reads slowed the memory-bound case.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common/avx2_simd.h"
#include "common/parallel.h"

namespace bitquilt_dense {

// y[t + j, r] for j < C.
template <int C>
inline void tokens(const float* x, const float* w, int64_t N, int64_t K, int64_t r, int64_t t, float* y) {
  __m256 acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wk = _mm256_loadu_ps(w + k);
    for (int j = 0; j < C; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (t + j) * K + k), wk, acc[j]);
  }
  for (int j = 0; j < C; ++j) {
    float total = bitquilt_simd::hsum8(acc[j]);
    for (int64_t c = k; c < K; ++c) total += x[(t + j) * K + c] * w[c];
    y[(t + j) * N + r] = total;
  }
}

inline void rows_into(const float* x, int64_t T, const float* W, int64_t N, int64_t K, float* y) {
  bitquilt_par::parallel_for(0, N, std::max<int64_t>(16, (1 << 14) / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* w = W + r * K;
      int64_t t = 0;
      for (; t + 8 <= T; t += 8) tokens<8>(x, w, N, K, r, t, y);
      for (; t + 4 <= T; t += 4) tokens<4>(x, w, N, K, r, t, y);
      for (; t < T; ++t) tokens<1>(x, w, N, K, r, t, y);
    }
  });
}

}  // namespace bitquilt_dense
