// 2-bit uniform weights times int8-quantized activations (AVX2; the AVX-512 VNNI twin in q2_int8_vnni.cpp), the
// 2-bit half of bitquilt.kernels.q4_int8: the same math as q4_int8.cpp,
//
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q[r, b], i_b>  -  sum_g (s z)[r, g] * X_g,
//
// on a layout of its own (q4_int8.h, Weight). Widening 2-bit codes row by row costs a shift and a mask per 64 codes
// per field, and at batch 1 that bound the 4-bit-style loop by instructions (50-72% of the read rate on Zen 4).
// Here a byte holds two rows' codes for two columns: bits 0-1 row l, 2-3 row 16 + l at column 8c + j, bits 4-5 and
// 6-7 the same rows at column 8c + 4 + j. One 64-byte step is 8 columns of a 32-row tile, and four masks (one
// shift) turn it into four vectors of codes whose 4-byte lanes are 4 consecutive columns of one row: multiplied
// with those 4 activations broadcast to every lane (one 32-bit load), each lane sums its row's products, so every
// row accumulates in its own lane and no activation is ever rearranged. The codes of rows 16-31 come out
// multiplied by 4 (masked in place, not shifted down): their sums are 4x, and the 1/4 joins their row scales once
// per group (exact). Per 64 bytes the loop is one load, one shift, four masks and four dot products (VNNI), against
// the 4-row tiles' three shifts, four masks, four dot products, four activation broadcasts and two conversions.
//
// AVX2 (vpmaddubsw: unsigned code x signed byte, pairs summed in int16): a block of 32 columns adds 8 pair sums per
// lane in int16 before one vpmaddwd widens them (at most 8 * 2 * 12 * 128 = 24,576 for the x4 rows), so the dot
// products are exact, as on VNNI.

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_round.h"
#include "parallel.h"
#include "q4_int8.h"

namespace bitquilt_q4 {

namespace {

constexpr int64_t STEPS_PER_BLOCK = BLOCK / W2_STEP;

// 4 activations (one 32-bit word) broadcast to every lane.
inline __m256i broadcast_word(const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, 4);
  return _mm256_set1_epi32(word);
}

// Group g's s and s * z of 8 rows (r0, r0 + 8) from a tile's scales.
inline void group_rows(const uint8_t* sz, int64_t g, int r0, __m256* s, __m256* sz_out) {
  const uint8_t* p = sz + g * W2_GROUP_BYTES;
  *s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * r0)));
  const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p +
                                                                                  2 * W2_ROWS + r0))));
  *sz_out = _mm256_mul_ps(*s, z);
}

// One token through a tile's codes (K / 8 steps) and scales `sz`: out[32] its rows. A step's 64 bytes are two
// 256-bit halves h whose lane l holds rows 8h + l (bits 0-1, 4-5) and 16 + 8h + l (bits 2-3, 6-7).
void tile_token(const uint8_t* codes, const uint8_t* sz, const Weight& W, const int8_t* xi, const float* d,
                const float* X, float* out) {
  const int64_t G = W.groups(), blocks_per_group = W.group / BLOCK;
  const __m256i m3 = _mm256_set1_epi8(0x03), mC = _mm256_set1_epi8(0x0C), ones = _mm256_set1_epi16(1);
  std::fill_n(out, W2_ROWS, 0.0f);
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m256 af[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};  // [h * 2 + rows 16-31]: int16 pair sums
      for (int64_t c = 0; c < STEPS_PER_BLOCK; ++c, step += 64) {
        prefetch_ahead(step, 1);
        const int8_t* x = xi + b * BLOCK + c * W2_STEP;
        const __m256i a0 = broadcast_word(x), a1 = broadcast_word(x + 4);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * h));
          const __m256i hi = _mm256_srli_epi16(v, 4);
          for (int high = 0; high < 2; ++high) {  // rows 8h + l, then (x4) 16 + 8h + l
            const __m256i mask = high ? mC : m3;
            const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, mask), a0),
                                                 _mm256_maddubs_epi16(_mm256_and_si256(hi, mask), a1));
            pairs[2 * h + high] = _mm256_add_epi16(pairs[2 * h + high], two);
          }
        }
      }
      const __m256 D = _mm256_set1_ps(d[b]);
      for (int k = 0; k < 4; ++k)
        af[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[k], ones)), D, af[k]);
    }
    const __m256 Xg = _mm256_set1_ps(X[g]);
    for (int k = 0; k < 4; ++k) {  // k = 2h + high: rows 8h + 16 * high ..
      const int r0 = 8 * (k / 2) + 16 * (k % 2);
      __m256 s, sz_rows;
      group_rows(sz, g, r0, &s, &sz_rows);
      if (k % 2) s = _mm256_mul_ps(s, _mm256_set1_ps(0.25f));  // rows 16-31 were summed x4
      const __m256 y = _mm256_loadu_ps(out + r0);
      _mm256_storeu_ps(out + r0, _mm256_fnmadd_ps(sz_rows, Xg, _mm256_fmadd_ps(af[k], s, y)));
    }
  }
}

void tiles_avx2(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y) {
  float out[W2_ROWS];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t rows = std::min(W2_ROWS, W.N - i * W2_ROWS);
    for (int64_t t = 0; t < T; ++t) {
      tile_token(w2_tile_codes(W, i), w2_tile_scales(W, i), W, xi + t * W.K, d + t * W.K / BLOCK,
                 X + t * W.groups(), out);
      std::copy_n(out, rows, y + t * W.N + i * W2_ROWS);
    }
  }
}

}  // namespace

void w2_matmul_into(const float* x, int64_t T, const Weight& W, float* y) {
  const int64_t K = W.K, G = W.groups();
  std::vector<int8_t> xi(T * K);
  std::vector<float> d(T * K / BLOCK), X(T * G);
  bitquilt_par::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    bitquilt_int8::round_tokens(x + t0 * K, t1 - t0, K, W.group, xi.data() + t0 * K, d.data() + t0 * K / BLOCK,
                                X.data() + t0 * G);
  });
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / W.tile_bytes());  // tiles per task: ~32 KB of codes
  const auto tiles = vnni_enabled() ? &w2_tiles_vnni : &tiles_avx2;
  bitquilt_par::parallel_for(0, W.tiles(), grain, [&](int64_t i0, int64_t i1) {
    tiles(W, i0, i1, T, xi.data(), d.data(), X.data(), y);
  });
}

}  // namespace bitquilt_q4
