// The 8-bit x int8 GEMV's row loop (uniform8_gemv.cpp) on AVX-512 VNNI, taken at run time where the CPU has it and
// the int8-activation kernels run their VNNI path (bitquilt_q4::active_isa: one switch for both kernels).
//
// vpdpbusd multiplies unsigned bytes by signed ones and sums each 4 adjacent products into an int32 lane, so the
// uint8 codes meet the int8 activations as they are: no shift to signed codes q' and no |q'|, sign(i, q') as the
// AVX2 loop needs for vpmaddubsw (whose int16 pair sums 2 * 255 * 127 would overflow). Per row:
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q[r, b], i_b>  -  sum_g (s z)[r, g] * X_g,
// exactly x_hat @ W^T, as the AVX2 loop. The same 32 columns per step (256-bit): on Zen 4, cold codes, 1 thread,
// builds alternating, a loop at 64 columns per 512-bit step ran 1.4x faster in cache yet 0.65-0.96x on cold codes,
// whatever its prefetch; this one 1.06-1.21x the AVX2 loop (1.01-1.10x with both at 8 KB), 81-89% of the read
// ceiling timed in C (bench/prototypes/c_kernel_timing.cpp), 1.1-1.4x the AVX2 loop in cache.
//
// The row loop around the dot product is rows_int8's (uniform8_gemv.cpp). One template serving both, instantiated
// here after the target pragma with each path's dot product as a lambda, computed the same but GCC 12 kept three
// of its pointers in vector registers inside the inner loop: 0.5-0.93x in cache and 0.88-0.95x on cold codes, on
// both paths (C-timed, alternating). So the two loops stay written out.
//
// Compiled for AVX-512 VNNI (pragma after every include, as avx512/q4_int8.cpp); runs only where isa_supported(ISA_AVX512).

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
