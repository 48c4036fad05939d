// The 8-bit x int8 GEMV's row loop (kernels/uniform8_gemv.cpp) on AVX-512 VNNI, taken at run time where the CPU has it and
// the int8-activation kernels run their VNNI path (bitquilt_q4::active_isa: one switch for both kernels).
//
// vpdpbusd multiplies unsigned bytes by signed ones and sums each 4 adjacent products into an int32 lane, so the
// uint8 codes meet the int8 activations as they are: no shift to signed codes q' and no |q'|, sign(i, q') as the
// AVX2 loop needs for vpmaddubsw (whose int16 pair sums 2 * 255 * 127 would overflow). Per row:
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q[r, b], i_b>  -  sum_g (s z)[r, g] * X_g,
// exactly x_hat @ W^T, as the AVX2 loop. The same 32 columns per step (256-bit): a loop at 64 columns per 512-bit
// step was faster in cache but slower on cold codes, which is how a decode step reads them (docs/kernels.md,
// "8-bit GEMV").
//
// The row loop around the dot product is rows_int8's (kernels/uniform8_gemv.cpp). One template serving both,
// instantiated here after the target pragma with each path's dot product as a lambda, computed the same but GCC 12
// kept three of its pointers in vector registers inside the inner loop, slower on both paths. So the two loops stay
// written out.
//
// Compiled for AVX-512 VNNI (pragma after every include, as avx512/q4_int8.cpp); runs only where
// isa_supported(ISA_AVX512).

#include <immintrin.h>

#include <algorithm>

#include "common/avx2_simd.h"
#include "kernels/uniform8.h"
#include "kernels/vnni_dot.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2")

#include "kernels/uniform8_rows.h"  // built for this target (its header comment)

void bitquilt_u8::rows_int8_vnni(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i,
                                 const float* d, const float* X, int64_t K, int64_t G, int64_t group, int64_t r0,
                                 int64_t r1, float* y) {
  rows_int8_dot<bitquilt_vnni::DotEvex>(q, scale, scale_zero, i, d, X, K, G, group, r0, r1, y);
}

#pragma GCC pop_options
