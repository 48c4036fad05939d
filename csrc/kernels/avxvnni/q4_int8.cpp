// The int8-activation kernels on AVX-VNNI, the 256-bit vpdpbusd (VEX) of CPUs that have it without AVX-512 (Intel's
// client cores since Alder Lake), picked at run time after `isa_supported(ISA_AVXVNNI)`: the 4- and 2-bit matmul of
// q4_int8.cpp, and the 8-bit GEMV's row loop (uniform8_rows.h, as avx512/uniform8.cpp builds it for AVX-512).
// One token runs q4_int8_ymm.h's loop, as the AVX-512 path's 4-bit token does; several tokens (prefill) run the AVX2
// path's plan (q4_int8.cpp: a block's codes masked once into vectors kept in L1, then up to PREFILL_TOKENS tokens
// over them) with vpdpbusd into int32: no pair sums in int16 to widen, and the high nibbles masked in place (x16)
// instead of shifted down.
//
// Compiled for AVX-VNNI (pragma below, after every include, so that no inline function of a shared header is built
// for that target, as in avx512/q4_int8.cpp).

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common/avx2_simd.h"
#include "kernels/q4_int8.h"
#include "kernels/uniform8.h"
#include "kernels/vnni_dot.h"

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")

#include "kernels/q4_int8_ymm.h"     // built for this target (their header comments)
#include "kernels/uniform8_rows.h"

namespace bitquilt_q4 {

namespace {

using bitquilt_vnni::DotVex;

// n tokens (strided by K, K / 32 and groups) through one tile: out[t * 32 + r].
template <int BITS>
void tile_tokens(const uint8_t* codes, const uint8_t* sz, const Weight& W, int64_t n, const int8_t* xi,
                 const float* d, const float* X, float* out) {
  constexpr int64_t COLUMNS = step_columns(BITS), STEPS = BLOCK / COLUMNS;
  constexpr int WORDS = BITS == 4 ? 1 : 2;
  constexpr float HIGH = BITS == 4 ? 1.0f / 16 : 0.25f;
  const int64_t K = W.K, G = W.groups(), blocks_per_group = W.group / BLOCK;
  const __m256i low = _mm256_set1_epi8(BITS == 4 ? 0x0F : 0x03), high = _mm256_set1_epi8(BITS == 4 ? -16 : 0x0C);
  std::fill_n(out, n * ROWS, 0.0f);
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m256 af[PREFILL_TOKENS][4];  // [t][2h + upper]
    for (int64_t t = 0; t < n; ++t)
      for (int k = 0; k < 4; ++k) af[t][k] = _mm256_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < std::min(K / BLOCK, (g + 1) * blocks_per_group);
         ++b, step += STEPS * STEP_BYTES) {
      __m256i block[STEPS][2][WORDS][2];  // [c][h][w][upper]
      for (int64_t c = 0; c < STEPS; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + c * STEP_BYTES + 32 * h));
          const __m256i fields[2] = {v, BITS == 2 ? _mm256_srli_epi16(v, 4) : v};
          for (int w = 0; w < WORDS; ++w) {
            block[c][h][w][0] = _mm256_and_si256(fields[w], low);
            block[c][h][w][1] = _mm256_and_si256(fields[w], high);
          }
        }
      for (int64_t t = 0; t < n; ++t) {
        __m256i acc[2][4];  // [c % 2][2h + upper]: two sets, so that half as many vpdpbusd wait on each other
        for (int e = 0; e < 2; ++e)
          for (int k = 0; k < 4; ++k) acc[e][k] = _mm256_setzero_si256();
        for (int64_t c = 0; c < STEPS; ++c)
          for (int w = 0; w < WORDS; ++w) {
            const __m256i a = broadcast_word(xi + t * K + b * BLOCK + COLUMNS * c + 4 * w);
            for (int h = 0; h < 2; ++h)
              for (int upper = 0; upper < 2; ++upper)
                acc[c % 2][2 * h + upper] = DotVex::dot(acc[c % 2][2 * h + upper], block[c][h][w][upper], a);
          }
        const __m256 D = _mm256_set1_ps(d[t * (K / BLOCK) + b]);
        for (int k = 0; k < 4; ++k)
          af[t][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[0][k], acc[1][k])), D, af[t][k]);
      }
    }
    add_row_group(sz + g * GROUP_BYTES, HIGH, af, n, X + g, G, out);
  }
}

}  // namespace

template <int BITS>
void tiles_avxvnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d,
                   const float* X, float* y) {
  for_tiles<PREFILL_TOKENS>(W, i0, i1, T, xi, d, X, y, [&](const uint8_t* codes, const uint8_t* sz, int64_t n,
                                                            const int8_t* x, const float* dt, const float* Xt,
                                                            float* out, const RowGroupPrefetch& row_groups) {
    if (n == 1)
      tile_token_ymm<BITS, DotVex>(codes, sz, W, x, dt, Xt, out, row_groups);
    else
      tile_tokens<BITS>(codes, sz, W, n, x, dt, Xt, out);
  });
}

template void tiles_avxvnni<4>(const Weight&, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*,
                               float*);
template void tiles_avxvnni<2>(const Weight&, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*,
                               float*);

}  // namespace bitquilt_q4

void bitquilt_u8::rows_int8_avxvnni(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i,
                                    const float* d, const float* X, int64_t K, int64_t G, int64_t group, int64_t r0,
                                    int64_t r1, float* y) {
  rows_int8_dot<bitquilt_vnni::DotVex>(q, scale, scale_zero, i, d, X, K, G, group, r0, r1, y);
}

#pragma GCC pop_options
