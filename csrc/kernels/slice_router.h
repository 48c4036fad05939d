// A MoBiRoute router's slice count for one token (slice_router.cpp's comment has the math), torch-free: for the
// torch binding (slice_router.cpp) and the kernels that route tokens themselves (routed_parts.h, run by the fused
// decode step and the standalone runtime).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/avx2_simd.h"

namespace bitquilt_router {

// fc1: H x (K + 1) weights and H biases, fc2: (E - 1) x H weights and E - 1 biases, all fp32 row-major.
struct Router {
  const float *w1, *b1, *w2, *b2;
  int64_t K, H, E1;
};

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }  // torch's threshold 20

// k = 1 + #{j : l_j > tau} for the token xt [K]; u: H floats of scratch.
inline int64_t count(const float* xt, const Router& r, float tau, float* u) {
  using bitquilt_simd::dot;
  const int64_t K = r.K, H = r.H;
  const float rms = std::sqrt(dot(xt, xt, K) / static_cast<float>(K) + 1e-12f);
  const float inv = 1.0f / rms, log_rms = std::log(rms);
  for (int64_t h = 0; h < H; ++h) {
    const float* row = r.w1 + h * (K + 1);
    u[h] = std::max(0.0f, dot(row, xt, K) * inv + row[K] * log_rms + r.b1[h]);
  }
  int64_t count = 1;
  float logit = 0.0f;
  for (int64_t j = 0; j < r.E1; ++j) {
    const float v = dot(r.w2 + j * H, u, H) + r.b2[j];
    logit = j == 0 ? v : logit - softplus(v);
    if (logit <= tau) break;  // logits fall with j: no later slice is on either
    ++count;
  }
  return count;
}

}  // namespace bitquilt_router
