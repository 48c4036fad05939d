// The 4- and 2-bit x int8 matmul of kernels/q4_int8.cpp on AVX-512 VNNI, picked at run time when the CPU has it: a 64-byte
// step of a 32-row tile is one register whose lane l holds rows l and 16 + l. At 4 bits two masks give the codes of
// rows 0-15 (low nibbles) and, x16, rows 16-31 (high nibbles, masked in place) at columns 4c .. 4c + 3; at 2 bits one
// shift and four masks give rows 0-15 and (x4) 16-31 at columns 8c .. 8c + 3 and 8c + 4 .. 8c + 7. One vpdpbusd per
// vector adds each row's 4 products into its lane (every vector its own accumulator, so no dot product waits for
// the one before); a block's sums are converted and scaled by its activation scale once per 32 columns, the rows' s
// and s * z once per group. Two tokens run together for prefill, each step's masks serving both; a single token
// prefetches the code stream, and on Intel the row groups' stream, as stream_prefetch.h plans (one accumulator per
// vector: a second one did not help cold weights, which bound a decode step). A single token at 4 bits runs the
// same steps in 256-bit halves (q4_int8_ymm.h), which stream cold weights faster than 512-bit steps.
//
// This file is compiled for AVX-512 VNNI (pragma below, after every include, so that no inline function of a
// shared header is built for that target); its entry points run only where `isa_supported(ISA_AVX512)`.

#include <immintrin.h>

#include <algorithm>
#include <cstring>  // before the target pragma: broadcast_word.h's includes are then no-ops

#include "kernels/q4_int8.h"
#include "kernels/vnni_dot.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")

#include "kernels/avx512/broadcast_word.h"  // built for this target (its header comment)
#include "kernels/q4_int8_ymm.h"  // built for this target (its header comment)

namespace bitquilt_q4 {

namespace {

// A single token at 4 bits runs q4_int8_ymm.h's 256-bit loop (EVEX vpdpbusd): closer to the read ceiling on cold
// weights than the 512-bit loop, though slower in cache; at 2 bits the 512-bit loop stays ahead, and prefill keeps
// the 512-bit two-token loop (docs/kernels.md, "Int8-activation kernels").
using bitquilt_vnni::DotEvex;

using bitquilt_avx512::broadcast_word_512;

// The code vectors of one step: rows 0-15, then rows 16-31 (scaled), for each activation word they meet (at 2 bits
// the step's columns 8c .. 8c + 3, then 8c + 4 .. 8c + 7; at 4 bits one word, columns 4c .. 4c + 3).
template <int BITS>
struct StepCodes {
  static constexpr int VECTORS = BITS == 4 ? 2 : 4;
  static constexpr int word[4] = {0, 0, 1, 1};  // the activation word vector k meets
  __m512i codes[VECTORS];
};

template <int BITS>
inline StepCodes<BITS> step_codes(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  if constexpr (BITS == 4) {
    return {{_mm512_and_si512(v, _mm512_set1_epi8(0x0F)), _mm512_and_si512(v, _mm512_set1_epi8(-16))}};
  } else {
    const __m512i low = _mm512_set1_epi8(0x03), high = _mm512_set1_epi8(0x0C), hi = _mm512_srli_epi16(v, 4);
    return {{_mm512_and_si512(v, low), _mm512_and_si512(v, high), _mm512_and_si512(hi, low),
             _mm512_and_si512(hi, high)}};
  }
}

// NT tokens (strided by K, K / 32 and groups) through one tile: out[t * 32 + r].
template <int BITS, int NT>
void tile_tokens(const uint8_t* codes, const uint8_t* sz, const Weight& W, const int8_t* xi, const float* d,
                 const float* X, float* out, [[maybe_unused]] const RowGroupPrefetch& row_groups) {
  using Step = StepCodes<BITS>;
  constexpr int64_t COLUMNS = step_columns(BITS), STEPS = BLOCK / COLUMNS;
  constexpr float HIGH = BITS == 4 ? 1.0f / 16 : 0.25f;  // rows 16-31 were summed x16 / x4
  const int64_t K = W.K, G = W.groups(), blocks_per_group = W.group / BLOCK;
  __m512 total[NT][2];
  for (int t = 0; t < NT; ++t) total[t][0] = total[t][1] = _mm512_setzero_ps();
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m512 af[NT][2];  // the group's sums of rows 0-15 and (scaled) 16-31, activation scales applied
    for (int t = 0; t < NT; ++t) af[t][0] = af[t][1] = _mm512_setzero_ps();
    if constexpr (NT == 1) row_groups(sz + g * GROUP_BYTES);
    for (int64_t b = g * blocks_per_group; b < std::min(K / BLOCK, (g + 1) * blocks_per_group); ++b) {
      __m512i acc[NT][Step::VECTORS];
      for (int t = 0; t < NT; ++t)
        for (int k = 0; k < Step::VECTORS; ++k) acc[t][k] = _mm512_setzero_si512();
      for (int64_t c = 0; c < STEPS; ++c, step += STEP_BYTES) {
        const Step q = step_codes<BITS>(step);
        if constexpr (NT == 1) prefetch_ahead(step, 1);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = xi + t * K + b * BLOCK + c * COLUMNS;
          const __m512i a[2] = {broadcast_word_512(x),
                                BITS == 2 ? broadcast_word_512(x + 4) : _mm512_setzero_si512()};
          for (int k = 0; k < Step::VECTORS; ++k)
            acc[t][k] = _mm512_dpbusd_epi32(acc[t][k], q.codes[k], a[Step::word[k]]);
        }
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 D = _mm512_set1_ps(d[t * (K / BLOCK) + b]);
        for (int upper = 0; upper < 2; ++upper) {
          __m512i sum = acc[t][upper];
          if constexpr (BITS == 2) sum = _mm512_add_epi32(sum, acc[t][upper + 2]);
          af[t][upper] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), D, af[t][upper]);
        }
      }
    }
    const uint8_t* p = sz + g * GROUP_BYTES;
    __m512 s[2], s_z[2];
    for (int upper = 0; upper < 2; ++upper) {
      s[upper] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * upper)));
      s_z[upper] = _mm512_mul_ps(s[upper], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * upper)))));
    }
    s[1] = _mm512_mul_ps(s[1], _mm512_set1_ps(HIGH));
    for (int t = 0; t < NT; ++t) {
      const __m512 Xg = _mm512_set1_ps(X[t * G + g]);
      for (int upper = 0; upper < 2; ++upper)
        total[t][upper] = _mm512_fnmadd_ps(s_z[upper], Xg, _mm512_fmadd_ps(af[t][upper], s[upper], total[t][upper]));
    }
  }
  for (int t = 0; t < NT; ++t) {
    _mm512_storeu_ps(out + t * ROWS, total[t][0]);
    _mm512_storeu_ps(out + t * ROWS + 16, total[t][1]);
  }
}

}  // namespace

template <int BITS>
void tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y) {
  for_tiles<2>(W, i0, i1, T, xi, d, X, y, [&](const uint8_t* codes, const uint8_t* sz, int64_t n, const int8_t* x,
                                              const float* dt, const float* Xt, float* out,
                                              const RowGroupPrefetch& row_groups) {
    if (n == 2)
      tile_tokens<BITS, 2>(codes, sz, W, x, dt, Xt, out, row_groups);
    else if constexpr (BITS == 4)
      tile_token_ymm<4, DotEvex>(codes, sz, W, x, dt, Xt, out, row_groups);
    else
      tile_tokens<BITS, 1>(codes, sz, W, x, dt, Xt, out, row_groups);
  });
}

template void tiles_vnni<4>(const Weight&, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*,
                            float*);
template void tiles_vnni<2>(const Weight&, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*,
                            float*);

}  // namespace bitquilt_q4

#pragma GCC pop_options
