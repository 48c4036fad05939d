// A MoBiRoute router's slice count for one token (slice_router.cpp), for the other kernels of the extension
// that route tokens themselves (decode_step.cpp).

#pragma once

#include <cstdint>

namespace bitquilt_router {

// fc1: H x (K + 1) weights and H biases, fc2: (E - 1) x H weights and E - 1 biases, all fp32 row-major.
struct Router {
  const float *w1, *b1, *w2, *b2;
  int64_t K, H, E1;
};

// k = 1 + #{j : l_j > tau} for the token x [K] (slice_router.cpp's comment); u: H floats of scratch.
int64_t count(const float* x, const Router& r, float tau, float* u);

}  // namespace bitquilt_router
