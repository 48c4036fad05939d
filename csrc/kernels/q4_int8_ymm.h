// One token through a 4- or 2-bit tile in 256-bit halves with vpdpbusd, shared by the AVX-512 VNNI path (its 4-bit
// token, EVEX vpdpbusd on ymm) and the AVX-VNNI path (VEX vpdpbusd, CPUs with AVX-VNNI but no AVX-512). Lane l of half
// h holds rows 8h + l and 16 + 8h + l (q4_int8.h); rows 16-31 are masked in place (x16 at 4 bits, x4 at 2) and the
// factor joins their row scales. At 2 bits each activation word has its own accumulators, so no vpdpbusd waits for
// the one before it. Each block's lines are prefetched together at its start.
//
// Included by those two files after their target pragma, so that this code is built for each file's target; the
// template lives in an unnamed namespace (one copy per file). `Dot` supplies the instruction (vnni_dot.h).

#pragma once

namespace bitquilt_q4 {
namespace {

template <int BITS, class Dot>
void tile_token_ymm(const uint8_t* codes, const uint8_t* sz, const Weight& W, const int8_t* xi, const float* d,
                    const float* X, float* out, const RowGroupPrefetch& row_groups) {
  constexpr int64_t COLUMNS = step_columns(BITS), STEPS = BLOCK / COLUMNS;
  constexpr int WORDS = BITS == 4 ? 1 : 2;              // activation words a step's bytes meet
  constexpr float HIGH = BITS == 4 ? 1.0f / 16 : 0.25f;  // rows 16-31 summed x16 / x4
  const int64_t K = W.K, G = W.groups(), blocks_per_group = W.group / BLOCK;
  const __m256i low = _mm256_set1_epi8(BITS == 4 ? 0x0F : 0x03), high = _mm256_set1_epi8(BITS == 4 ? -16 : 0x0C);
  __m256 total[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m256 af[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    row_groups(sz + g * GROUP_BYTES);
    for (int64_t b = g * blocks_per_group; b < std::min(K / BLOCK, (g + 1) * blocks_per_group);
         ++b, step += STEPS * STEP_BYTES) {
      prefetch_ahead(step, STEPS);
      __m256i acc[WORDS][4];  // [w][2h + upper]
      for (int w = 0; w < WORDS; ++w)
        for (int k = 0; k < 4; ++k) acc[w][k] = _mm256_setzero_si256();
      for (int64_t c = 0; c < STEPS; ++c) {
        __m256i a[WORDS];
        for (int w = 0; w < WORDS; ++w) a[w] = broadcast_word(xi + b * BLOCK + COLUMNS * c + 4 * w);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + c * STEP_BYTES + 32 * h));
          const __m256i fields[2] = {v, BITS == 2 ? _mm256_srli_epi16(v, 4) : v};  // word w's bits
          for (int w = 0; w < WORDS; ++w) {
            acc[w][2 * h] = Dot::dot(acc[w][2 * h], _mm256_and_si256(fields[w], low), a[w]);
            acc[w][2 * h + 1] = Dot::dot(acc[w][2 * h + 1], _mm256_and_si256(fields[w], high), a[w]);
          }
        }
      }
      const __m256 D = _mm256_set1_ps(d[b]);
      for (int k = 0; k < 4; ++k) {
        const __m256i sum = WORDS == 1 ? acc[0][k] : _mm256_add_epi32(acc[0][k], acc[WORDS - 1][k]);
        af[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), D, af[k]);
      }
    }
    const uint8_t* group_bytes = sz + g * GROUP_BYTES;
    const __m256 Xg = _mm256_set1_ps(X[g]);
    for (int k = 0; k < 4; ++k) {
      const HalfScales f = half_scales(group_bytes, k, HIGH);
      total[k] = _mm256_fnmadd_ps(f.s_z, Xg, _mm256_fmadd_ps(af[k], f.s, total[k]));
    }
  }
  for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + half_rows(k), total[k]);
}

}  // namespace
}  // namespace bitquilt_q4
