// Bit-plane weights (the lookup-table kernel's packed layout, lut_parts.h) times int8-rounded activations: the
// int8-activation path of a MoBiQuant linear's slices (routed_parts.h), as q4_int8.h is a uniform linear's.
//
//     y[t, r] = sum_g ( C0[r, g] X[t, g] + sum_i C_i[r, g] sum_{b in g} d[t, b] P_ib[t, r] ),
//     P_ib[t, r] = sum_{c in b} code[t, c] B_i[r, c]  (an exact integer)
//
// for every plane i of every part, x[t, c] ~ d[t, b] code[t, c] rounded per block b of 32 columns (int8_round.h)
// and X[t, g] the group's sum of d * code. On AVX-512 VNNI + VBMI (avx512/plane_int8.cpp) a plane's bits are
// spread to 0/1 bytes once per 32 columns for all tokens and each P is a vpdpbusd sum; elsewhere the lookup-table
// kernel runs on the rounded activations d * code, the same product up to its 2^-21 table rounding.

#pragma once

#include <cstdint>
#include <vector>

#include "kernels/lut_parts.h"

namespace bitquilt_plane8 {

constexpr int64_t MAX_PLANES = 64;  // planes of all parts together on the VNNI path (8 slices of up to 8 planes)

// y [T, N] = x̂ [T, K] @ (sum_p W_p)^T, x̂ each token rounded to int8 per block of 32; rows contiguous. The parts
// share K, N, block and group (as lut_parts_into's).
void matmul_into(const float* x, int64_t T, const std::vector<bitquilt_lut::Part>& parts, int64_t N, float* y);

// Whether matmul_into takes the VNNI path here: the int8 kernels' AVX-512 path is active (q4_int8.h, active_isa)
// and the CPU has AVX-512 VBMI.
bool vnni_path();

// Tiles [i0, i1) of y on AVX-512 VNNI + VBMI, for tokens rounded in column order (codes [T, K], d [T, K / 32]
// block scales, X [T, groups] group sums): only where vnni_path(), for at most MAX_PLANES planes.
void tiles_vnni(const std::vector<bitquilt_lut::Part>& parts, int64_t N, int64_t i0, int64_t i1, int64_t T,
                const int8_t* codes, const float* d, const float* X, float* y);

}  // namespace bitquilt_plane8
