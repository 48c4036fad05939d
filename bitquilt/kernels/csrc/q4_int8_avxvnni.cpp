// The batch-1 4- and 2-bit x int8 matmul of q4_int8.cpp on AVX-VNNI: the 256-bit vpdpbusd (VEX) of CPUs that have it
// without AVX-512 (Intel's client cores since Alder Lake), picked at run time after `isa_supported(ISA_AVXVNNI)`.
// One token runs q4_int8_ymm.h's loop, as the AVX-512 path's 4-bit token does; several tokens (prefill) take the AVX2
// loop, which decodes a block's codes once for up to 16 of them.
//
// Compiled for AVX-VNNI (pragma below, after every include, so that no inline function of a shared header is built
// for that target, as in q4_int8_vnni.cpp).

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "q4_int8.h"

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")

#include "q4_int8_ymm.h"  // built for this target (its header comment)

namespace bitquilt_q4 {

namespace {

// vpdpbusd on 256-bit vectors, VEX-encoded (AVX-VNNI).
struct DotVex {
  static __m256i dot(__m256i acc, __m256i codes, __m256i activations) {
    return _mm256_dpbusd_avx_epi32(acc, codes, activations);
  }
};

}  // namespace

template <int BITS>
void tiles_avxvnni(const Weight& W, int64_t i0, int64_t i1, const int8_t* xi, const float* d, const float* X,
                   float* y) {
  float out[ROWS];
  for (int64_t i = i0; i < i1; ++i) {
    tile_token_ymm<BITS, DotVex>(W.tile_codes(i), W.tile_scales(i), W, xi, d, X, out);
    std::copy_n(out, std::min(ROWS, W.N - i * ROWS), y + i * ROWS);
  }
}

template void tiles_avxvnni<4>(const Weight&, int64_t, int64_t, const int8_t*, const float*, const float*, float*);
template void tiles_avxvnni<2>(const Weight&, int64_t, int64_t, const int8_t*, const float*, const float*, float*);

}  // namespace bitquilt_q4

#pragma GCC pop_options
