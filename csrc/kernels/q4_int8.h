// 4- and 2-bit uniform weights times int8-quantized activations (q4_int8.cpp), for the other kernels of the
// extension that run whole weights themselves (decode_step.cpp).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/stream_prefetch.h"
#include "kernels/int8_round.h"

namespace bitquilt_q4 {

constexpr int64_t ROWS = 32;  // output rows per tile
constexpr int64_t STEP_BYTES = 64;  // one step of a tile: 64 bytes of codes, 16 / bits columns of its 32 rows
constexpr int64_t BLOCK = bitquilt_int8::BLOCK;  // columns per activation scale
constexpr int64_t GROUP_BYTES = 3 * ROWS;  // a tile's row group: 32 fp16 s, then 32 uint8 z

// Tokens per pass over a tile on the 256-bit paths (AVX2, AVX-VNNI): a block's codes are decoded once for them
// all, and their sums stay in L1.
constexpr int64_t PREFILL_TOKENS = 16;

// Columns of a tile's 64-byte step: 4 at 4 bits, 8 at 2.
constexpr int64_t step_columns(int bits) { return 16 / bits; }

// How the batch-1 loops prefetch their code stream (stream_prefetch.h; the tiles are back to back, so the prefetch
// runs on into the next tile).
using bitquilt_prefetch::PREFETCH;
using bitquilt_prefetch::prefetch_ahead;
using bitquilt_prefetch::prefetch_stream;

// A [N, K] weight W[r, c] = s[r, g] * (q[r, c] - z[r, g]), g = c / group, q of `bits` = 4 or 2 bits, in the
// kernel's layout: tiles of 32 rows (the last padded with zero rows), each a run of 64-byte steps, byte 4l + j
// (l < 16, j < 4) of a step holding codes of rows l and 16 + l:
//   w  uint8 [tiles][K / step_columns][64]: at 4 bits step c holds columns 4c + j, row l in the low nibble and row
//      16 + l in the high one; at 2 bits step c holds columns 8c + j in bits 0-1 (row l) and 2-3 (row 16 + l), and
//      8c + 4 + j in bits 4-5 (row l) and 6-7 (row 16 + l)
//   sz uint8 [tiles][groups][96]: the tile's 32 rows' s as fp16 (bytes 0-63), then their z as uint8 (64-95) (3
//      bytes per row group instead of 8 for fp32 s and s * z; s * z is exact in fp32 for an fp16 s and z < 16)
// So a step's 4-byte lanes are 4 consecutive columns of one row each (q4_int8.cpp).
struct Weight {
  const uint8_t* w;
  const uint8_t* sz;
  int64_t N, K, group;
  int bits;
  int64_t tiles() const { return (N + ROWS - 1) / ROWS; }
  int64_t groups() const { return (K + group - 1) / group; }
  int64_t tile_bytes() const { return ROWS * K * bits / 8; }
  int64_t code_bytes() const { return tiles() * tile_bytes(); }
  int64_t scale_bytes() const { return tiles() * groups() * GROUP_BYTES; }
  const uint8_t* tile_codes(int64_t i) const { return w + i * tile_bytes(); }
  const uint8_t* tile_scales(int64_t i) const { return sz + i * groups() * GROUP_BYTES; }
};

// The prefetch of a tile's row-group stream (sz, which runs on into the next tile's), where PREFETCH.row_groups: as
// many row groups ahead as the code stream is prefetched groups of codes ahead (at least one). It pays on Intel,
// whose hardware prefetcher misses this second stream beside the codes; on AMD it cost more than it saved, so the
// plan there has none (stream_prefetch.h).
class RowGroupPrefetch {
 public:
  explicit RowGroupPrefetch(const Weight& W) {
    if (!PREFETCH.row_groups) return;
    const int64_t group_code_bytes = ROWS * W.group * W.bits / 8;
    near_ = GROUP_BYTES * std::max<int64_t>(1, (PREFETCH.near + group_code_bytes - 1) / group_code_bytes);
    if (PREFETCH.far)
      far_ = GROUP_BYTES * std::max<int64_t>(1, (PREFETCH.far + group_code_bytes - 1) / group_code_bytes);
  }
  // Prefetches the row group that many groups past `group_bytes` (its 96 bytes span two cache lines).
  void operator()(const uint8_t* group_bytes) const {
    if (near_) prefetch_stream(group_bytes, 2, near_, far_);
  }

 private:
  int64_t near_ = 0, far_ = 0;
};

// The tile loop every path shares: tiles [i0, i1) of y for T tokens rounded in column order (xi [T, K], d [T, K / 32]
// block scales, X [T, groups] group sums), up to CHUNK tokens per pass over a tile: pass(codes, sz, n, xi, d, X, out,
// row_groups) writes n tokens' outputs out[t * 32 + r] of the tile whose codes and row groups it is given.
template <int64_t CHUNK, class Pass>
void for_tiles(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
               float* y, const Pass& pass) {
  float out[CHUNK * ROWS];
  const RowGroupPrefetch row_groups(W);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t rows = std::min(ROWS, W.N - i * ROWS);
    for (int64_t t = 0; t < T; t += CHUNK) {
      const int64_t n = std::min(CHUNK, T - t);
      pass(W.tile_codes(i), W.tile_scales(i), n, xi + t * W.K, d + t * W.K / BLOCK, X + t * W.groups(), out,
           row_groups);
      for (int64_t u = 0; u < n; ++u) std::copy_n(out + u * ROWS, rows, y + (t + u) * W.N + i * ROWS);
    }
  }
}

// For the loops that split a 64-byte step into two 256-bit halves h, whose lane l holds rows 8h + l and 16 + 8h + l:
// vector k = 2h + upper holds rows half_rows(k) .. + 7.
constexpr int half_rows(int k) { return 8 * (k / 2) + 16 * (k % 2); }

// 4 activations (one 32-bit word) broadcast to every lane of a 256-bit vector.
inline __m256i broadcast_word(const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, 4);
  return _mm256_set1_epi32(word);
}

// The row group's factors for vector k of those loops (`group_bytes`: Weight's 96 bytes): s, times `high` for rows
// 16-31 (their codes masked in place were summed x16 or x4), and s * z, as fp32.
struct HalfScales {
  __m256 s, s_z;
};
inline HalfScales half_scales(const uint8_t* group_bytes, int k, float high) {
  const int r0 = half_rows(k);
  const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_bytes + 2 * r0)));
  const __m256 z = _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group_bytes + 2 * ROWS + r0))));
  return {k % 2 ? _mm256_mul_ps(s, _mm256_set1_ps(high)) : s, _mm256_mul_ps(s, z)};
}

// A row group's part of n tokens' outputs out[t * 32 + r], added in place for those loops' vectors k: s * af[t][k] -
// (s z) * X[t * G] (af: the group's sums, activation scales applied; X: the group's activation sums, G apart).
inline void add_row_group(const uint8_t* group_bytes, float high, const __m256 (*af)[4], int64_t n, const float* X,
                          int64_t G, float* out) {
  for (int k = 0; k < 4; ++k) {
    const HalfScales f = half_scales(group_bytes, k, high);
    for (int64_t t = 0; t < n; ++t) {
      float* o = out + t * ROWS + half_rows(k);
      const __m256 y = _mm256_fmadd_ps(af[t][k], f.s, _mm256_loadu_ps(o));
      _mm256_storeu_ps(o, _mm256_fnmadd_ps(f.s_z, _mm256_set1_ps(X[t * G]), y));
    }
  }
}

// Why a [N, K] weight of `bits`-bit codes in groups of `group` columns, `w_bytes` of codes and `sz_bytes` of
// scales, is not a layout the kernel takes; empty if it is (K and group multiples of 64, bits 4 or 2, sizes as
// Weight::code_bytes and scale_bytes).
std::string layout_error(int64_t N, int64_t K, int64_t group, int64_t bits, int64_t w_bytes, int64_t sz_bytes);

// Row r of a 4-bit W in fp32 [K]: s * q - s * z per group (an embedding lookup from a quantized table or a tied
// LM head; those are 8- or 4-bit).
void row_into(const Weight& W, int64_t r, float* out);

// y [T, N] = x [T, K] @ W^T with each token's activations rounded to int8 per block of 32 (scale max|x| / 127),
// rows contiguous; on the path `active_isa()` names.
void matmul_into(const float* x, int64_t T, const Weight& W, float* y);

// The int8-activation kernels' paths, narrowest first (bitquilt.isa.INT8_ISAS, in this order): AVX2 (vpmaddubsw);
// AVX-VNNI (256-bit VEX vpdpbusd, avxvnni/q4_int8.cpp, also the 8-bit GEMV's rows);
// AVX-512 VNNI (avx512/q4_int8.cpp, avx512/uniform8.cpp). The widest the CPU runs is active by default.
enum Isa : int { ISA_AVX2 = 0, ISA_AVXVNNI = 1, ISA_AVX512 = 2 };
bool isa_supported(int isa);  // whether this CPU runs `isa` (false for a value not in Isa)
int active_isa();
bool set_isa(int isa);  // false (and nothing changed) when `isa` is not supported

// Tiles [i0, i1) of y for T tokens rounded in column order (xi [T, K], d [T, K / 32] block scales, X [T, groups]
// group sums) on AVX-512 VNNI, for BITS = W.bits: only where isa_supported(ISA_AVX512).
template <int BITS>
void tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y);

// The same on AVX-VNNI: only where isa_supported(ISA_AVXVNNI).
template <int BITS>
void tiles_avxvnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d,
                   const float* X, float* y);

}  // namespace bitquilt_q4

#ifdef TORCH_EXTENSION_NAME
#include <ATen/core/Tensor.h>

namespace bitquilt_q4 {

// The layout's tensors checked against the shape (TORCH_CHECK otherwise: layout_error, uint8, contiguous).
Weight make_weight(const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t group, int64_t bits);

}  // namespace bitquilt_q4
#endif
