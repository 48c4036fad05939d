// 4-bit uniform weights times int8-quantized activations (q4_int8.cpp), for the other kernels of the
// extension that run whole weights themselves (decode_step.cpp).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "int8_round.h"

namespace bitquilt_q4 {

constexpr int64_t ROWS = 4;    // output rows per tile
constexpr int64_t BLOCK = bitquilt_int8::BLOCK;  // columns per activation scale
constexpr int64_t PAIR = 64;   // columns per packed 32-byte row chunk (two blocks)

// A [N, K] weight W[r, c] = s[r, g] * (q[r, c] - z[r, g]), g = c / group, in the kernel's layout:
//   w  uint8 [tiles][K / 64][4 rows][32]: for the chunk starting at column c0, byte j < 16 holds q[c0 + j] (low
//      nibble) and q[c0 + 16 + j] (high), byte 16 + j holds q[c0 + 32 + j] and q[c0 + 48 + j]
//   sz fp32  [tiles][groups][2][4 rows]: s and s * z of the tile's rows
struct Weight {
  const uint8_t* w;
  const float* sz;
  int64_t N, K, group;
  int64_t tiles() const { return (N + ROWS - 1) / ROWS; }
  int64_t groups() const { return (K + group - 1) / group; }
};

// The layout's tensors checked against the shape (TORCH_CHECK otherwise); K and group multiples of 64.
Weight make_weight(const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t group);

// y [T, N] = x [T, K] @ W^T with each token's activations rounded to int8 per block of 32 (scale max|x| / 127),
// rows contiguous.
void matmul_into(const float* x, int64_t T, const Weight& W, float* y);

}  // namespace bitquilt_q4
