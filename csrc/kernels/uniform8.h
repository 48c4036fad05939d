// 8-bit uniform weights times a few tokens (uniform8_gemv.cpp), for the other kernels of the extension that
// run whole weights themselves (decode_step.cpp).

#pragma once

#include <cstdint>
#include <string>

#include "common/stream_prefetch.h"

namespace bitquilt_u8 {

// W[r, c] = s[r, g] * (q[r, c] - z[r, g]): codes uint8 [N, K] row-major, s and s * z fp32 [N, groups].
struct Weight {
  const uint8_t* q;
  const float *s, *sz;
  int64_t N, K, group;
  int64_t groups() const { return (K + group - 1) / group; }
};

// Why K inputs in groups of `group` are not a shape the GEMV takes; empty if they are (multiples of 32).
std::string shape_error(int64_t K, int64_t group);

// Row r of W in fp32 [K]: s * q - s * z per group (an embedding lookup from a tied, quantized LM head).
void row_into(const Weight& W, int64_t r, float* out);

// y [T, N] = x [T, K] @ W^T, rows contiguous.
void gemv_into(const float* x, int64_t T, const Weight& W, float* y);

// The same with each token's activations rounded to int8 per block of 32 (int8_round.h): y = x_hat @ W^T.
void gemv_int8_into(const float* x, int64_t T, const Weight& W, float* y);

// The row loops prefetch their (row-major, contiguous) code stream as stream_prefetch.h plans, once per 64 bytes.
using bitquilt_prefetch::prefetch_ahead;

// Rows [r0, r1) for one token rounded to int8 (codes i [K], block steps d [K / 32], group sums X [groups]) on
// AVX-512 VNNI (avx512/uniform8.cpp) and on AVX-VNNI (avxvnni/q4_int8.cpp): y[r] for r0 <= r < r1.
void rows_int8_vnni(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i, const float* d,
                    const float* X, int64_t K, int64_t G, int64_t group, int64_t r0, int64_t r1, float* y);
void rows_int8_avxvnni(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i, const float* d,
                       const float* X, int64_t K, int64_t G, int64_t group, int64_t r0, int64_t r1, float* y);

}  // namespace bitquilt_u8

#ifdef TORCH_EXTENSION_NAME
#include <ATen/core/Tensor.h>

namespace bitquilt_u8 {

// The tensors checked against the shape (TORCH_CHECK otherwise): shape_error, uint8 / fp32, contiguous.
Weight make_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& scale_zero, int64_t K,
                   int64_t group);

}  // namespace bitquilt_u8
#endif
