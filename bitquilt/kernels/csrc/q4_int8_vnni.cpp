// The 4-bit x int8 matmul of q4_int8.cpp on AVX-512 VNNI, picked at run time when the CPU has it.
//
// Same layout, same math: a row's 32-byte chunk holds the codes of 64 columns, low nibbles = columns 0-15 and
// 32-47, high nibbles = 16-31 and 48-63, and a token's int8 activations are stored in exactly that order (64
// bytes per chunk). Here the chunk's two nibble vectors are the two halves of one 512-bit register (the 32 bytes
// broadcast to both halves, the upper half shifted right by 4, then masked), so one vpdpbusd multiplies all 64
// codes with the 64 activations and sums each 4 adjacent products into an int32 lane: lanes 0-3 and 8-11 belong
// to the chunk's first block, 4-7 and 12-15 to its second; the block scales [d_2p x 4, d_2p+1 x 4] broadcast to
// both halves scale them in one FMA. The dot products are exact (int32), as on AVX2; only the fp32 summation
// order differs. Against AVX2's vpmaddubsw + vpaddw + vpmaddwd on two 256-bit halves, a chunk costs one
// instruction instead of four. (2-bit layouts have their own kernel, q2_int8_vnni.cpp.)
//
// This file is compiled for AVX-512 VNNI (pragma below, after every include, so that no inline function of a
// shared header is built for that target); its one entry point runs only after `has_vnni()`.

#include <immintrin.h>

#include <algorithm>

#include "avx2_simd.h"
#include "q4_int8.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2")

namespace bitquilt_q4 {

using bitquilt_simd::hsum8;

namespace {

constexpr int64_t PAIR_BYTES = 128;  // a row pair's split chunk: columns 0-15, 32-47 of both rows, then 16-31, 48-63

// Rows 2j and 2j + 1 of one chunk (the two rows are adjacent in the tile: 2 x 32 packed bytes) as
// codes: lo holds columns 0-15, 32-47 of row 2j, then of row 2j + 1; hi their columns 16-31, 48-63.
struct PairCodes {
  __m512i lo, hi;
};

inline PairCodes split(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
}

// The tile's 4 rows for NT tokens (NT = 2 for prefill: each split chunk loaded serves both), as two row pairs;
// a pair's chunk p is split from the packed tile `wt`, or when `buffered` read from `codes` (PAIR_BYTES at
// (p * 2 + j) * PAIR_BYTES, split once for every token). With a token's low-nibble activations (chunk bytes 0-31)
// broadcast to both halves of one register and its high-nibble ones (32-63) to both halves of another, two
// vpdpbusd leave row 2j's block sums in lanes 0-7 and row 2j + 1's in lanes 8-15 (lanes 0-3 and 8-11 the chunk's
// first block, 4-7 and 12-15 its second). The row groups come decoded (`scales`) with a buffered tile, else packed
// (`sz`) and decoded in registers as the loop goes: for one token that measured 1.07x faster on weights in cache
// than decoding them into memory first (576² to 512 x 4096), the same on cold ones. Token t's inputs and outputs
// are strided as in q4_int8.cpp, and the chunks run in one loop as there.
template <int NT, bool buffered>
inline void tile_tokens(const uint8_t* wt, const int8_t* codes, const uint8_t* sz, const float* scales, const Weight& W,
                        const Panel& P, const int8_t* xi, const float* dpair, const float* X, float* out) {
  const int64_t G = W.groups(), per_group = W.group / PAIR, pairs = P.cols / PAIR;
  const __m512i pair_rows[2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)};
  __m512 total[NT][2];
  __m128 offset[NT];
  for (int t = 0; t < NT; ++t) {
    total[t][0] = total[t][1] = _mm512_setzero_ps();
    offset[t] = _mm_setzero_ps();
  }
  __m512 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t p = 0, g = 0, group_end = std::min(pairs, per_group); p < pairs; ++p) {
    __m512i xlo[NT], xhi[NT];
    __m512 d[NT];
    for (int t = 0; t < NT; ++t) {
      const auto* x = reinterpret_cast<const __m256i*>(xi + t * W.K + p * PAIR);
      xlo[t] = _mm512_broadcast_i64x4(_mm256_loadu_si256(x));
      xhi[t] = _mm512_broadcast_i64x4(_mm256_loadu_si256(x + 1));
      d[t] = _mm512_broadcast_f32x8(_mm256_loadu_ps(dpair + t * W.K / 8 + p * 8));
    }
    if constexpr (!buffered) prefetch_ahead(wt + p * ROWS * CHUNK_BYTES, ROWS * CHUNK_BYTES / 64);
    for (int j = 0; j < 2; ++j) {
      const PairCodes q = buffered ? PairCodes{_mm512_loadu_si512(codes + (p * 2 + j) * PAIR_BYTES),
                                               _mm512_loadu_si512(codes + (p * 2 + j) * PAIR_BYTES + 64)}
                                   : split(wt + (p * ROWS + 2 * j) * CHUNK_BYTES);
      for (int t = 0; t < NT; ++t) {
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q.lo, xlo[t]), q.hi, xhi[t]);
        acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d[t], acc[t][j]);
      }
    }
    if (p + 1 < group_end) continue;
    const GroupScales s = tile_group(scales, sz, g);  // group g's last chunk: its scales (decoded once per tile
    for (int j = 0; j < 2; ++j) {                     // for several tokens, or in registers)
      const __m512 scale = _mm512_permutexvar_ps(pair_rows[j], _mm512_castps128_ps512(s.s));  // [s_2j x 8, s_2j+1 x 8]
      for (int t = 0; t < NT; ++t) {
        total[t][j] = _mm512_fmadd_ps(acc[t][j], scale, total[t][j]);
        acc[t][j] = _mm512_setzero_ps();
      }
    }
    add_group_offsets<NT>(s.sz, X, G, g, offset);
    ++g;
    group_end = std::min(pairs, group_end + per_group);
  }
  for (int t = 0; t < NT; ++t) {
    float off[ROWS];
    _mm_storeu_ps(off, offset[t]);
    for (int j = 0; j < 2; ++j) {
      out[t * ROWS + 2 * j] = hsum8(_mm512_castps512_ps256(total[t][j])) - off[2 * j];
      out[t * ROWS + 2 * j + 1] = hsum8(_mm512_extractf32x8_ps(total[t][j], 1)) - off[2 * j + 1];
    }
  }
}

}  // namespace

void tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y) {
  const auto split_tile = [](const uint8_t* wt, int64_t pairs, int8_t* buffer) {
    for (int64_t q = 0; q < pairs * 2; ++q) {
      const PairCodes c = split(wt + q * 2 * CHUNK_BYTES);
      _mm512_storeu_si512(buffer + q * PAIR_BYTES, c.lo);
      _mm512_storeu_si512(buffer + q * PAIR_BYTES + 64, c.hi);
    }
  };
  const auto token = [&W](const uint8_t* wt, const int8_t* buffer, const uint8_t* sz, const float* scales,
                          const int8_t* x, const float* dt, const float* Xt, int n, const Panel& P, float* out) {
    if (buffer == nullptr)
      tile_tokens<1, false>(wt, nullptr, sz, nullptr, W, P, x, dt, Xt, out);
    else if (n == 2)
      tile_tokens<2, true>(wt, buffer, sz, scales, W, P, x, dt, Xt, out);
    else
      tile_tokens<1, true>(wt, buffer, sz, scales, W, P, x, dt, Xt, out);
  };
  run_tiles(W, i0, i1, T, xi, d, X, y, split_tile, token);
}

}  // namespace bitquilt_q4

#pragma GCC pop_options
