// 4 int8 activations (one 32-bit word) broadcast to every lane of a 512-bit vector, for the AVX-512 files
// (q4_int8.cpp, plane_int8.cpp). Include it after a file's AVX-512 target pragma, so that it is built for that target.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace bitquilt_avx512 {

inline __m512i broadcast_word_512(const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, 4);
  return _mm512_set1_epi32(word);
}

}  // namespace bitquilt_avx512
