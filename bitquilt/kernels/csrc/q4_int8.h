// 4- and 2-bit uniform weights times int8-quantized activations (q4_int8.cpp), for the other kernels of the
// extension that run whole weights themselves (decode_step.cpp).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "int8_round.h"

namespace bitquilt_q4 {

constexpr int64_t ROWS = 4;    // output rows per tile at 4 bits
constexpr int64_t W2_ROWS = 32;  // output rows per tile at 2 bits (q2_int8.cpp)
constexpr int64_t W2_STEP = 8;   // columns of a 2-bit tile's 64-byte step
constexpr int64_t BLOCK = bitquilt_int8::BLOCK;  // columns per activation scale
constexpr int64_t PAIR = 64;   // columns per packed row chunk at 4 bits (two blocks)
constexpr int64_t CHUNK_BYTES = 32;  // a row chunk's 64 codes
constexpr int64_t GROUP_BYTES = 12;  // a tile's row group: 4 fp16 scales, 4 uint8 zeros


// A tile's row group decoded once for all its tokens: s of its 4 rows in floats 0-3, s * z in 4-7.
constexpr int64_t GROUP_FLOATS = 8;

struct GroupScales {
  __m128 s, sz;  // the 4 rows' s and s * z
};

inline GroupScales group_scales(const uint8_t* p) {
  const __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  uint32_t zeros;
  std::memcpy(&zeros, p + 2 * ROWS, 4);
  const __m128 z = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(zeros))));
  return {s, _mm_mul_ps(s, z)};
}

inline void decode_group(const uint8_t* p, float* out) {
  const GroupScales g = group_scales(p);
  _mm_storeu_ps(out, g.s);
  _mm_storeu_ps(out + ROWS, g.sz);
}

// Row group g of a tile: from its decoded floats (`decode_group`, several tokens) when `decoded` is given, else
// unpacked from the packed bytes `sz` in registers (one token).
inline GroupScales tile_group(const float* decoded, const uint8_t* sz, int64_t g) {
  if (decoded == nullptr) return group_scales(sz + g * GROUP_BYTES);
  return {_mm_loadu_ps(decoded + g * GROUP_FLOATS), _mm_loadu_ps(decoded + g * GROUP_FLOATS + ROWS)};
}

// Adds group g's zero-point term of the tile's 4 rows, (s * z)[r] * X[t, g] (sz: `decode_group`'s floats 4-7, or
// `group_scales(...).sz`), to offset[t] for NT tokens (group sums X strided by G); every path subtracts it from its
// row sums.
template <int NT>
inline void add_group_offsets(__m128 sz, const float* X, int64_t G, int64_t g, __m128* offset) {
  for (int t = 0; t < NT; ++t) offset[t] = _mm_fmadd_ps(_mm_set1_ps(X[t * G + g]), sz, offset[t]);
}

// How far ahead a batch-1 tile prefetches its code stream, on both paths (the tiles of a panel are back to back,
// so the prefetch runs on into the next tile), chosen once per process by CPU vendor. The layouts sit on huge pages
// (kernels.layout_empty); on them, cold 4-bit weights, 1 thread, 1536² to 8960 x 1536, builds alternating in two
// rounds: an AMD Zen 4 (2026-12-05) ran its VNNI path at 85-90% of the read ceiling 8 KB ahead against 74-78% at
// 2 KB, 69-84% at 4 KB and 68-84% at 16 KB (AVX2 64-81% at every distance: it is bound by instructions there, as was
// the 2-bit path before its 32-row layout); on 4 KB pages (1536^2) 8 KB was ahead too, 78-81% against 71-73% at
// 2 KB; an Intel Xeon with AVX-512 (2026-12-04) 1.05-1.25x faster at 2 KB than at 4 KB on both paths, 1 KB close
// behind, 512 B and 16 KB slower. Zen 3 (on 4 KB pages): 2 to 8 KB alike.
int64_t default_prefetch_bytes();
inline const int64_t PREFETCH_BYTES = default_prefetch_bytes();

// Prefetches `lines` cache lines PREFETCH_BYTES past p (past the end is harmless: a prefetch never faults).
inline void prefetch_ahead(const uint8_t* p, int lines) {
  for (int line = 0; line < lines; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * line), _MM_HINT_T0);
}

// Columns per panel at most. A batch-1 tile re-reads the token's activations for every 4 rows (int8 codes, block
// scales and decoded group scales: ~1.75 bytes per column) beside its own code stream, so across the whole of a long
// row (qwen2.5-1.5b's down projection, K = 8960: 15.7 KB + 17.9 KB per tile) the two no longer fit L1 together and
// the activations come from L2 at every tile: measured 57-66% of the read rate against 90-100% for K <= 4096. A
// panel of columns keeps them in L1, and prefill's widened tile buffer (4 bytes per column) with them.
constexpr int64_t PANEL = 4096;

// Columns per panel for this group size: the most whole groups within PANEL columns, at least one group.
inline int64_t panel_columns(int64_t group) { return std::max(group, PANEL / group * group); }

// Columns [c0, c0 + cols) of W, groups [g0, g0 + groups): one panel (`Weight::panel`).
struct Panel {
  int64_t c0, cols, g0, groups;
};

// A [N, K] weight W[r, c] = s[r, g] * (q[r, c] - z[r, g]), g = c / group, q of `bits` = 4 or 2 bits, in the
// kernel's layout. At 4 bits, panel by panel (all of panel 0's tiles of 4 rows, then panel 1's, ...; a panel is the
// most whole groups within PANEL columns, at least one group, the last one shorter):
//   w  uint8 [panels][tiles][cols / 64][4 rows][32]: a row's chunk of the 64 columns from c0 on; byte j < 16 holds
//      q[c0 + j] (low nibble) and q[c0 + 16 + j] (high), byte 16 + j holds q[c0 + 32 + j] and q[c0 + 48 + j], so
//      one chunk widens to two vectors of codes (columns 0-15 and 32-47; 16-31 and 48-63).
//   sz uint8 [panels][tiles][groups][12]: the tile's 4 rows' s as fp16 (bytes 0-7), then their z as uint8 (8-11)
//      (3 bytes per row group instead of 8 for fp32 s and s * z; s * z is exact in fp32 for an fp16 s and z < 16)
// At 2 bits, tiles of 32 rows and no panels (q2_int8.cpp):
//   w  uint8 [tiles][K / 8][64]: step c, the tile's columns 8c .. 8c + 7; byte 4l + j (l < 16, j < 4) holds in bits
//      0-1 q[row l, 8c + j], 2-3 q[row 16 + l, 8c + j], 4-5 q[row l, 8c + 4 + j], 6-7 q[row 16 + l, 8c + 4 + j]
//   sz uint8 [tiles][groups][96]: the tile's 32 rows' s as fp16 (bytes 0-63), then their z as uint8 (64-95)
struct Weight {
  const uint8_t* w;
  const uint8_t* sz;
  int64_t N, K, group;
  int bits;
  int64_t rows() const { return bits == 2 ? W2_ROWS : ROWS; }  // per tile
  int64_t tiles() const { return (N + rows() - 1) / rows(); }
  int64_t groups() const { return (K + group - 1) / group; }
  int64_t tile_bytes() const { return rows() * K * bits / 8; }  // of all panels
  int64_t panels() const { return (K + panel_columns(group) - 1) / panel_columns(group); }
  Panel panel(int64_t s) const {
    const int64_t c0 = s * panel_columns(group), cols = std::min(panel_columns(group), K - c0);
    return {c0, cols, c0 / group, (cols + group - 1) / group};
  }
  // Panel p's codes and scales of tile i (every panel before p is whole; 4 bits).
  const uint8_t* codes(const Panel& p, int64_t i) const {
    return w + (tiles() * p.c0 + i * p.cols) / PAIR * ROWS * CHUNK_BYTES;
  }
  const uint8_t* scales(const Panel& p, int64_t i) const { return sz + (tiles() * p.g0 + i * p.groups) * GROUP_BYTES; }
  int64_t code_bytes() const { return tiles() * tile_bytes(); }
  int64_t scale_bytes() const { return tiles() * groups() * 3 * rows(); }
};

// Tile i of a 2-bit layout: its codes and its row groups (3 * W2_ROWS bytes each).
constexpr int64_t W2_GROUP_BYTES = 3 * W2_ROWS;
inline const uint8_t* w2_tile_codes(const Weight& W, int64_t i) { return W.w + i * W.tile_bytes(); }
inline const uint8_t* w2_tile_scales(const Weight& W, int64_t i) { return W.sz + i * W.groups() * W2_GROUP_BYTES; }

// Why a [N, K] weight of `bits`-bit codes in groups of `group` columns, `w_bytes` of codes and `sz_bytes` of
// scales, is not a layout the kernel takes; empty if it is (K and group multiples of 64, bits 4 or 2, sizes as
// Weight::code_bytes and scale_bytes).
std::string layout_error(int64_t N, int64_t K, int64_t group, int64_t bits, int64_t w_bytes, int64_t sz_bytes);

// Row r of a 4-bit W in fp32 [K]: s * q - s * z per group (an embedding lookup from a quantized table or a tied
// LM head; those are 8- or 4-bit).
void row_into(const Weight& W, int64_t r, float* out);

// matmul_into for 2-bit layouts (q2_int8.cpp), and its tiles [i0, i1) on AVX-512 VNNI for T tokens rounded in
// column order (xi [T, K], d [T, K / 32] block scales, X [T, groups] group sums): only after has_vnni().
void w2_matmul_into(const float* x, int64_t T, const Weight& W, float* y);
void w2_tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d,
                   const float* X, float* y);

// y [T, N] = x [T, K] @ W^T with each token's activations rounded to int8 per block of 32 (scale max|x| / 127),
// rows contiguous; on the AVX-512 VNNI path when `vnni_enabled()`.
void matmul_into(const float* x, int64_t T, const Weight& W, float* y);

// Whether the CPU runs the AVX-512 VNNI path (q4_int8_vnni.cpp), and whether matmul_into takes it (by default
// when the CPU has it; `set_vnni(false)` forces AVX2).
bool has_vnni();
bool vnni_enabled();
bool set_vnni(bool enabled);  // false (and nothing changed) when asked for VNNI on a CPU without it

// The tile loop both paths share, for T tokens already rounded (xi: codes in chunk order, d: per-chunk block
// scales, X: group sums), panel by panel: for each tile of the panel its groups are decoded once when T > 1
// (`decode_group`: per group s[4], s * z[4]; for one token `token` decodes them in registers as it goes,
// `tile_group`, which measured 1.07x faster on weights in cache than this pass), `split(wt, pairs, buffer)` widens
// the tile's codes `wt` (`pairs` chunks of 64 columns per row) into `buffer` (ROWS bytes per column) once when
// T > 1, and `token(wt, buffer, sz, scales, xi, d, X, n, panel, out)` computes the panel's share of the tile's 4
// rows for n tokens from the given one on (n = 2 while two are left, so each widened chunk loaded serves both;
// buffer and scales null when T == 1; sz the tile's packed row groups of the panel, scales their decoded floats;
// xi, d and X from the panel's first column and group on, tokens strided by the whole row) into out[n][4], written
// to y by the first panel and added by the others. Decoding the groups per token instead measured ~30% of the
// prefill time at group 128.
template <typename Split, typename Token>
void run_tiles(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
               float* y, const Split& split, const Token& token) {
  const bool several = T > 1;  // widened codes and decoded groups shared by the tokens; none for one token
  const Panel widest = W.panel(0);  // every panel but the last is whole
  std::vector<int8_t> buffer(several ? ROWS * widest.cols : 0);
  std::vector<float> scales(several ? widest.groups * GROUP_FLOATS : 0);
  float out[2 * ROWS];
  for (int64_t s = 0; s < W.panels(); ++s) {
    const Panel P = W.panel(s);
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* wt = W.codes(P, i);
      const uint8_t* sz = W.scales(P, i);
      if (several) {
        for (int64_t g = 0; g < P.groups; ++g) decode_group(sz + g * GROUP_BYTES, scales.data() + g * GROUP_FLOATS);
        split(wt, P.cols / PAIR, buffer.data());
      }
      const int64_t rows = std::min(ROWS, W.N - i * ROWS);
      for (int64_t t = 0; t < T;) {
        const int n = t + 1 < T ? 2 : 1;
        token(wt, several ? buffer.data() : nullptr, sz, several ? scales.data() : nullptr, xi + t * W.K + P.c0,
              d + (t * W.K + P.c0) / 8,
              X + t * W.groups() + P.g0, n, P, out);
        for (int u = 0; u < n; ++u, ++t) {
          float* yt = y + t * W.N + i * ROWS;
          for (int64_t r = 0; r < rows; ++r) yt[r] = s == 0 ? out[u * ROWS + r] : yt[r] + out[u * ROWS + r];
        }
      }
    }
  }
}

// Tiles [i0, i1) of y on AVX-512 VNNI (run_tiles' arguments) for 4-bit W: only after has_vnni().
void tiles_vnni(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y);

}  // namespace bitquilt_q4

#ifdef TORCH_EXTENSION_NAME
#include <ATen/core/Tensor.h>

namespace bitquilt_q4 {

// The layout's tensors checked against the shape (TORCH_CHECK otherwise: layout_error, uint8, contiguous).
Weight make_weight(const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t group, int64_t bits);

}  // namespace bitquilt_q4
#endif
