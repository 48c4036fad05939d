// vpdpbusd on 256-bit vectors in its two encodings, for the loops built once per target (q4_int8_ymm.h,
// uniform8_rows.h): acc + the sums of 4 adjacent products, unsigned bytes x signed bytes, per int32 lane. Each function
// carries its own target, so this header is included before a file's target pragma and inlines into loops built for
// a superset of it.

#pragma once

#include <immintrin.h>

namespace bitquilt_vnni {

// EVEX (AVX-512 VL + VNNI).
struct DotEvex {
  __attribute__((target("avx512f,avx512vl,avx512vnni"))) static __m256i dot(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_dpbusd_epi32(acc, u8, s8);
  }
};

// VEX (AVX-VNNI: CPUs that have it without AVX-512).
struct DotVex {
  __attribute__((target("avxvnni"))) static __m256i dot(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
  }
};

}  // namespace bitquilt_vnni
