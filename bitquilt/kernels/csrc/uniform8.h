// 8-bit uniform weights times a few tokens (uniform8_gemv.cpp), for the other kernels of the extension that
// run whole weights themselves (decode_step.cpp).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace bitquilt_u8 {

// W[r, c] = s[r, g] * (q[r, c] - z[r, g]): codes uint8 [N, K] row-major, s and s * z fp32 [N, groups].
struct Weight {
  const uint8_t* q;
  const float *s, *sz;
  int64_t N, K, group;
  int64_t groups() const { return (K + group - 1) / group; }
};

// The tensors checked against the shape (TORCH_CHECK otherwise): K and group multiples of 32.
Weight make_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& scale_zero, int64_t K,
                   int64_t group);

// y [T, N] = x [T, K] @ W^T, rows contiguous.
void gemv_into(const float* x, int64_t T, const Weight& W, float* y);

// The same with each token's activations rounded to int8 per block of 32 (int8_round.h): y = x_hat @ W^T.
void gemv_int8_into(const float* x, int64_t T, const Weight& W, float* y);

}  // namespace bitquilt_u8
