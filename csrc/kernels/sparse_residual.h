// Sparse 4-bit residual in 1x32 segments, added to the bit-plane kernels' output (MosaicQuant's
// "ZipperEngine" on CPU), used by lut_matmul.cpp and bitquilt.kernels.mosaic.
//
// A residual S (SparseBlockFormat with tiles of r x c, c % 32 == 0) is stored as segments of 32
// consecutive columns of one row: segment k covers W[rows[k], cols[k] .. cols[k] + 31] with
//     S[rows[k], cols[k] + j] = scales[k] * q_j,   q_j in [-8, 7],
// codes[k] 16 bytes: byte j holds q_j + 8 in its low nibble and q_{j+16} + 8 in its high nibble.
// Segments are sorted by output tile (TILE = 32 rows), then row, then column; tile_ptr int32
// [tiles + 1] is the CSR index: tile i owns segments tile_ptr[i] .. tile_ptr[i + 1] - 1.
//
// Each segment's codes are decoded once for up to 16 tokens to exact fp32 integers and multiplied with each
// token's 32 activations in fp32 FMAs; the 8 partial sums are scaled by one FMA into the row's sum, and a row's
// segments are summed before a single horizontal sum (horizontal sums are what a batch-1 residual spends its time
// on), so the residual adds no error beyond fp32 rounding and order, the same order for a token whatever tokens
// share the call. Reducing 8 segments' sums at once with hadd, or decoding through an
// L1 buffer, were tried and lost (docs/kernels.md, "Sparse residual").
// The fused kernels add a tile's segments into the tile's accumulators (lookup-table path) or into
// its dequantized fp32 rows (sgemm path) while the tile is hot, so y is written once;
// sparse_residual_add_ is the separate pass y += x @ S^T.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"

#ifdef TORCH_EXTENSION_NAME  // check_residual's tensors: the torch extension's files only
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#endif

namespace bitquilt_sparse {

constexpr int64_t SEG = 32;        // columns per segment
constexpr int64_t SEG_BYTES = 16;  // packed code bytes per segment
constexpr int64_t ROWS = 32;       // output rows per tile (the bit-plane kernels' TILE)

// A residual's segment arrays (all null: no residual).
struct Residual {
  const int32_t* tile_ptr = nullptr;
  const int32_t* rows = nullptr;
  const int32_t* cols = nullptr;
  const float* scales = nullptr;
  const uint8_t* codes = nullptr;
  bool empty() const { return tile_ptr == nullptr; }
  int64_t begin(int64_t tile) const { return tile_ptr[tile]; }
  int64_t end(int64_t tile) const { return tile_ptr[tile + 1]; }
};

// The 32 codes q_j of one segment as exact fp32, w[m] holding columns 8m .. 8m + 7. Byte shuffles move
// code byte j % 16 to the low byte of lane j's 32-bit word; its nibble n = q + 8 under the exponent
// bits of 2^23 makes the float 2^23 + n, and subtracting 2^23 + 8 leaves q.
inline void decode_segment(const uint8_t* code, __m256 w[4]) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
  const __m256i lo8 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,  //
                                       4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i hi8 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,  //
                                       12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  const __m256i nib = _mm256_set1_epi32(0x0F), magic = _mm256_set1_epi32(0x4B000000);  // 2^23
  const __m256 offset = _mm256_set1_ps(8388616.f);                                      // 2^23 + 8
  const __m256i b0 = _mm256_shuffle_epi8(v, lo8), b1 = _mm256_shuffle_epi8(v, hi8);   // bytes 0..7, 8..15
  const auto to_float = [&](__m256i n) {
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(n, magic)), offset);
  };
  w[0] = to_float(_mm256_and_si256(b0, nib));  // low nibbles: q_0 .. q_15
  w[1] = to_float(_mm256_and_si256(b1, nib));
  w[2] = to_float(_mm256_srli_epi32(b0, 4));  // high nibbles: q_16 .. q_31
  w[3] = to_float(_mm256_srli_epi32(b1, 4));
}

// The 8 partial sums of sum_j q_j * x[j] over one decoded segment (w: `decode_segment`'s vectors).
inline __m256 segment_partials(const __m256 w[4], const float* x) {
  __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
  __m256 b = _mm256_mul_ps(w[1], _mm256_loadu_ps(x + 8));
  a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
  b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), b);
  return _mm256_add_ps(a, b);
}

// Tile `tile`'s segments added into acc: acc[t * ld_t + (row - tile * ROWS)] for every token t. Per token, a row's
// segments (consecutive, as sorted) are summed in one vector, each scaled by an FMA of its 8 partial sums, and
// reduced once per row (a touched row has several segments; horizontal sums are what a batch-1 residual spends its
// time on); each segment's codes are decoded once for up to kTokens tokens. A token's sums run in the same order
// however many tokens share the call, so a batch's rows come out as each alone.
inline void tile_residual(const Residual& r, int64_t tile, const float* x, int64_t K, int64_t T, float* acc,
                          int64_t ld_t) {
  constexpr int64_t kTokens = 16;
  __m256 sum[kTokens];
  for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
    const int64_t n = std::min(kTokens, T - t0);
    for (int64_t k = r.begin(tile), end = r.end(tile); k < end;) {
      const int32_t row = r.rows[k];
      for (int64_t t = 0; t < n; ++t) sum[t] = _mm256_setzero_ps();
      for (; k < end && r.rows[k] == row; ++k) {
        __m256 w[4];
        decode_segment(r.codes + k * SEG_BYTES, w);
        const __m256 scale = _mm256_set1_ps(r.scales[k]);
        for (int64_t t = 0; t < n; ++t)
          sum[t] = _mm256_fmadd_ps(segment_partials(w, x + (t0 + t) * K + r.cols[k]), scale, sum[t]);
      }
      for (int64_t t = 0; t < n; ++t) acc[(t0 + t) * ld_t + row - tile * ROWS] += bitquilt_simd::hsum8(sum[t]);
    }
  }
}

// dst[j] += scale * q_j for the 32 columns of one segment (a dequantized fp32 row; scale * q_j is exact).
inline void segment_add_row(const uint8_t* code, float scale, float* dst) {
  __m256 q[4];
  decode_segment(code, q);
  const __m256 s = _mm256_set1_ps(scale);
  for (int m = 0; m < 4; ++m) _mm256_storeu_ps(dst + 8 * m, _mm256_fmadd_ps(q[m], s, _mm256_loadu_ps(dst + 8 * m)));
}

// Tile `tile`'s segments added into its dequantized rows: out[(row - tile * ROWS) * K + col + j].
inline void tile_residual_rows(const Residual& r, int64_t tile, int64_t K, float* out) {
  for (int64_t k = r.begin(tile); k < r.end(tile); ++k)
    segment_add_row(r.codes + k * SEG_BYTES, r.scales[k], out + (r.rows[k] - tile * ROWS) * K + r.cols[k]);
}

#ifdef TORCH_EXTENSION_NAME
// The residual {tile_ptr, rows, cols, scales, codes} of an [N, K] weight, checked so that no segment
// reaches outside its tile's rows or the K columns (empty vector: no residual).
inline Residual check_residual(const std::vector<at::Tensor>& t, int64_t N, int64_t K) {
  if (t.empty()) return {};
  TORCH_CHECK(t.size() == 5, "residual: {tile_ptr, rows, cols, scales, codes}");
  const int64_t tiles = (N + ROWS - 1) / ROWS, n = t[1].numel();
  const auto is = [](const at::Tensor& v, at::ScalarType type) {
    return v.device().is_cpu() && v.scalar_type() == type && v.is_contiguous();
  };
  TORCH_CHECK(is(t[0], at::kInt) && t[0].numel() == tiles + 1, "residual tile_ptr: int32 [tiles + 1]");
  TORCH_CHECK(is(t[1], at::kInt) && is(t[2], at::kInt) && t[2].numel() == n, "residual rows, cols: int32 [n]");
  TORCH_CHECK(is(t[3], at::kFloat) && t[3].numel() == n, "residual scales: fp32 [n]");
  TORCH_CHECK(is(t[4], at::kByte) && t[4].numel() == n * SEG_BYTES, "residual codes: uint8 [n, 16]");
  Residual r{t[0].data_ptr<int32_t>(), t[1].data_ptr<int32_t>(), t[2].data_ptr<int32_t>(), t[3].data_ptr<float>(),
             t[4].data_ptr<uint8_t>()};
  TORCH_CHECK(r.tile_ptr[0] == 0 && r.tile_ptr[tiles] == n, "residual tile_ptr must run from 0 to n");
  TORCH_CHECK(K >= SEG, "residual segments need at least 32 columns");
  for (int64_t i = 0; i < tiles; ++i) {
    TORCH_CHECK(r.begin(i) <= r.end(i), "residual tile_ptr must not decrease");
    // unsigned compares without branches (vectorized): row - lo < rows of the tile, col <= K - 32
    const uint32_t lo = static_cast<uint32_t>(i * ROWS), height = static_cast<uint32_t>(std::min(N - i * ROWS, ROWS));
    const uint32_t last = static_cast<uint32_t>(K - SEG);
    uint32_t bad = 0;
    for (int64_t k = r.begin(i); k < r.end(i); ++k)
      bad |= static_cast<uint32_t>(static_cast<uint32_t>(r.rows[k]) - lo >= height) |
             static_cast<uint32_t>(static_cast<uint32_t>(r.cols[k]) > last);
    TORCH_CHECK(!bad, "a residual segment of tile ", i, " lies outside the tile's rows or the weight's columns");
  }
  return r;
}
#endif

}  // namespace bitquilt_sparse
