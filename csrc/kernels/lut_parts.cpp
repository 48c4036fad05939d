// The bit-plane lookup-table matmul's kernel (T-MAC style, x86-64 AVX2), without torch: shared by the torch
// extension (lut_matmul.cpp binds it; decode_step.cpp runs it) and the standalone runtime's library (standalone.cpp,
// MoBiQuant slices), so that both run the same code. lut_parts.h is its interface.
//
// A weight matrix is k binary planes B_i plus per-(row, group) coefficients:
//     W[r, c] = C0[r, g(c)] + sum_i C_i[r, g(c)] * B_i[r, c]
// so  y[r] = sum_g C0[r, g] * S_g(x) + sum_i C_i[r, g] * P_ig[r],  P_ig[r] = sum_{c in g} x[c] B_i[r, c].
// P is computed with vpshufb: for every 4 activations a 16-entry table holds the 16 possible partial
// sums, and each plane's 4-bit nibble (4 columns of one row) indexes it, 32 rows per instruction.
//
// Precision: a table entry is a 21-bit integer v = round(T * (2^20 - 1) / max|T|), one scale per
// block of <= 128 columns, split into three 7-bit limbs v = 2^14 h + 2^7 m + l (h signed). Each limb
// has its own 16-byte table; two lookups of a limb fit a byte, are widened to int16 with vpmaddubsw
// and recombined exactly in int32, so the only error is the 2^-21 relative rounding of each entry.
// Coefficients are applied in fp32 per group, and C0 multiplies the fp32 block sum of x.
//
// Packed weight layout (built by bitquilt.kernels.cpu): uint8 [tiles][blocks][k][B/8][32]; byte t of
// a 32-byte vector belongs to one row of the 32-row tile (the order undoes the lane shuffles of the
// int16 -> int32 widening, so each int32 result vector covers 8 consecutive rows), its low nibble
// holds columns 8p..8p+3 (bit j = column 8p+j) and its high nibble columns 8p+4..8p+7.
//
// Coefficients: mode "planes": fp16 [tiles][groups][k+1][32] (C0, C1..Ck per row);
//               mode "uniform" (C0 = -s*z, C_i = s * 2^(i-1)), by the tensor's dtype: uint8 [tiles][groups][96]
//               (32 fp16 s, then 32 uint8 z: 96 bytes per 32 rows) where s is an fp16 value (what a saved model
//               holds), or fp32 [tiles][groups][2][32] (s, -s*z) otherwise. -s*z is the same fp32 product either
//               way, so both give the same result; the compact one reads 96 bytes a group-tile instead of 256.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"
#include "common/parallel.h"
#include "common/stream_prefetch.h"
#include "kernels/lut_parts.h"
#include "kernels/sparse_residual.h"

namespace bitquilt_lut {

namespace {

using bitquilt_simd::hsum8;
using bitquilt_sparse::Residual;

constexpr float VMAX = (1 << 20) - 1;  // largest table entry

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 16 int32 entries (a: 0..7, c: 8..15) -> 16 bytes in order (values fit int8).
inline __m128i bytes16(__m256i a, __m256i c) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Tables of one token, written to its slots of [blocks][T] arrays: per block, for each column quad
// q, the 16-byte h, m and l limb tables; the block's table scale and sum of x.
void build_tables(const float* x, const Shape& s, int64_t T, uint8_t* tab, float* scale, float* sums) {
  const __m256 bit0 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
  const __m256 bit1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1));
  const __m256 bit2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1));
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i low7 = _mm256_set1_epi32(127);
  alignas(32) float t[MAX_BLOCK / 4 * 16];
  const int64_t nq = s.block / 4;
  for (int64_t b = 0; b < s.blocks(); ++b) {
    const float* xb = x + b * s.block;
    __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < s.block; j += 8) vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(xb + j));
    for (int64_t q = 0; q < nq; ++q) {
      const float* xq = xb + 4 * q;
      __m256 lo = _mm256_and_ps(_mm256_set1_ps(xq[0]), bit0);
      lo = _mm256_add_ps(lo, _mm256_and_ps(_mm256_set1_ps(xq[1]), bit1));
      lo = _mm256_add_ps(lo, _mm256_and_ps(_mm256_set1_ps(xq[2]), bit2));
      const __m256 hi = _mm256_add_ps(lo, _mm256_set1_ps(xq[3]));
      _mm256_store_ps(t + 16 * q, lo);
      _mm256_store_ps(t + 16 * q + 8, hi);
      vmax = _mm256_max_ps(vmax, _mm256_max_ps(_mm256_and_ps(lo, absmask), _mm256_and_ps(hi, absmask)));
    }
    const float mx = hmax(vmax);
    scale[b * T] = mx / VMAX;
    sums[b * T] = hsum8(vsum);
    const __m256 inv = _mm256_set1_ps(mx > 0.f ? VMAX / mx : 0.f);
    uint8_t* tb = tab + b * T * s.block * 12;
    for (int64_t q = 0; q < nq; ++q) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(t + 16 * q), inv));
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(t + 16 * q + 8), inv));
      __m128i* out = reinterpret_cast<__m128i*>(tb + 48 * q);
      _mm_storeu_si128(out, bytes16(_mm256_srai_epi32(a, 14), _mm256_srai_epi32(c, 14)));
      _mm_storeu_si128(out + 1, bytes16(_mm256_and_si256(_mm256_srai_epi32(a, 7), low7),
                                        _mm256_and_si256(_mm256_srai_epi32(c, 7), low7)));
      _mm_storeu_si128(out + 2, bytes16(_mm256_and_si256(a, low7), _mm256_and_si256(c, low7)));
    }
  }
}

// sum_{c in block} x[c] * B[r, c] for the 32 rows of a tile and one plane, in units of the block's
// table scale: r[m] holds rows 8m..8m+7 as int32.
inline void plane_block(const uint8_t* w, const uint8_t* tab, int64_t pairs, __m256i r[4]) {
  const __m256i nib = _mm256_set1_epi8(0x0F), even = _mm256_set1_epi16(1), odd = _mm256_set1_epi16(256);
  __m256i he = _mm256_setzero_si256(), ho = he, me = he, mo = he, le = he, lo = he;
  // one 32-byte vector: nibbles q = 2p (low) and q' = 2p + 1 (high) of 32 rows
  auto pair = [&](const uint8_t* wp, const __m128i* t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    const __m256i i0 = _mm256_and_si256(v, nib);
    const __m256i i1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    const auto look = [&](int j, __m256i idx) {
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(t + j)), idx);
    };
    const __m256i hs = _mm256_add_epi8(look(0, i0), look(3, i1));  // both limbs' sums fit a byte
    const __m256i ms = _mm256_add_epi8(look(1, i0), look(4, i1));
    const __m256i ls = _mm256_add_epi8(look(2, i0), look(5, i1));
    he = _mm256_add_epi16(he, _mm256_maddubs_epi16(even, hs));  // even bytes, sign-extended
    ho = _mm256_add_epi16(ho, _mm256_maddubs_epi16(odd, hs));
    me = _mm256_add_epi16(me, _mm256_maddubs_epi16(ms, even));
    mo = _mm256_add_epi16(mo, _mm256_maddubs_epi16(ms, odd));
    le = _mm256_add_epi16(le, _mm256_maddubs_epi16(ls, even));
    lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(ls, odd));
  };
  for (int64_t p = 0; p < pairs; p += 2) {  // pairs is even (block >= 32)
    bitquilt_prefetch::prefetch_ahead(w + 32 * p, 1);
    pair(w + 32 * p, reinterpret_cast<const __m128i*>(tab + 96 * p));
    pair(w + 32 * p + 32, reinterpret_cast<const __m128i*>(tab + 96 * p + 96));
  }
  // int32 l + 2^7 m + 2^14 h; the unpacks put rows 8m..8m+7 in r[m] given the packed byte order
  const __m256i w128 = _mm256_set1_epi32(0x00800001), z = _mm256_setzero_si256();
  r[0] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(le, me), w128),
                          _mm256_srai_epi32(_mm256_unpacklo_epi16(z, he), 2));
  r[1] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi16(le, me), w128),
                          _mm256_srai_epi32(_mm256_unpackhi_epi16(z, he), 2));
  r[2] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(lo, mo), w128),
                          _mm256_srai_epi32(_mm256_unpacklo_epi16(z, ho), 2));
  r[3] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi16(lo, mo), w128),
                          _mm256_srai_epi32(_mm256_unpackhi_epi16(z, ho), 2));
}

// Rows 8m..8m+7 of a uniform part's (s, -s*z) for one (tile, group), from either storage.
template <Coef MODE>
inline void uniform_coef(const void* coef, int m, __m256& scale, __m256& neg_sz) {
  if constexpr (MODE == Coef::uniform32) {
    const float* c = static_cast<const float*>(coef);
    scale = _mm256_loadu_ps(c + 8 * m);
    neg_sz = _mm256_loadu_ps(c + TILE + 8 * m);
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(coef);
    scale = half8(reinterpret_cast<const uint16_t*>(c) + 8 * m);
    const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(c + 2 * TILE + 8 * m))));
    neg_sz = _mm256_xor_ps(_mm256_mul_ps(scale, z), _mm256_set1_ps(-0.f));  // -(s z): the fp32 product of (-s) z
  }
}

// acc[0..32) += the contribution of block b (all planes) to the 32 rows of one tile, one token.
template <Coef MODE>
inline void tile_block(const uint8_t* w, const void* coef, const uint8_t* tab, float scale, float sum,
                       const Shape& s, float* acc) {
  const int64_t pairs = s.block / 8, plane_bytes = s.block * 4;
  const __m256 sc = _mm256_set1_ps(scale), sx = _mm256_set1_ps(sum);
  __m256i r[4];
  if constexpr (MODE != Coef::planes) {  // C_i = s * 2^(i-1): weight the planes by powers of two, then by s
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < s.k; ++i) {
      plane_block(w + i * plane_bytes, tab, pairs, r);
      const __m256 p2 = _mm256_set1_ps(static_cast<float>(1 << i));
      for (int m = 0; m < 4; ++m) f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r[m]), p2, f[m]);
    }
    for (int m = 0; m < 4; ++m) {
      __m256 s_m, neg_sz;
      uniform_coef<MODE>(coef, m, s_m, neg_sz);
      __m256 a = _mm256_loadu_ps(acc + 8 * m);
      a = _mm256_fmadd_ps(_mm256_mul_ps(f[m], sc), s_m, a);
      _mm256_storeu_ps(acc + 8 * m, _mm256_fmadd_ps(neg_sz, sx, a));
    }
  } else {
    const uint16_t* c = static_cast<const uint16_t*>(coef);
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < s.k; ++i) {
      plane_block(w + i * plane_bytes, tab, pairs, r);
      const uint16_t* ci = c + (i + 1) * TILE;
      for (int m = 0; m < 4; ++m)
        f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r[m]), half8(ci + 8 * m), f[m]);
    }
    for (int m = 0; m < 4; ++m) {
      const __m256 a = _mm256_fmadd_ps(f[m], sc, _mm256_loadu_ps(acc + 8 * m));
      _mm256_storeu_ps(acc + 8 * m, _mm256_fmadd_ps(half8(c + 8 * m), sx, a));
    }
  }
}

}  // namespace

int64_t coef_group_bytes(Coef mode, int64_t k) {
  switch (mode) {
    case Coef::planes: return (k + 1) * TILE * 2;
    case Coef::uniform32: return 2 * TILE * 4;
    default: return TILE * 3;
  }
}

std::string packed_error(const Shape& s, int64_t plane_bytes, int64_t coef_bytes, Coef mode) {
  if (s.k < 1 || s.k > 8) return "1 to 8 planes";
  if (s.block != 32 && s.block != 64 && s.block != MAX_BLOCK) return "block must be 32, 64 or 128";
  if (s.K <= 0 || s.N <= 0 || s.K % s.block || s.group % s.block) return "block must divide K and the group size";
  if (plane_bytes != s.tiles() * s.tile_bytes()) return "packed planes do not match the shape";
  if (coef_bytes != s.tiles() * s.groups() * coef_group_bytes(mode, s.k)) return "coefficients do not match the shape";
  return "";
}

// y [T, N] = x [T, K] @ (sum_p W_p + S)^T for the parts W_p in the packed bit-plane layout, S the residual (none
// if empty). The activation tables are built once and serve every part.
void lut_parts_into(const float* xp, int64_t T, const std::vector<Part>& parts, int64_t N, const Residual& res,
                    float* yp) {
  const Shape& s = parts.front().s;
  const int64_t ntiles = s.tiles(), block = s.block;
  std::vector<uint8_t> tab(T * s.tab_bytes());
  std::vector<float> scale(T * s.blocks()), sums(T * s.blocks());
  bitquilt_par::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      build_tables(xp + t * s.K, s, T, tab.data() + t * s.block * 12, scale.data() + t, sums.data() + t);
  });
  const int64_t per_group = s.group / block, plane_bytes = block * 4;
  // Per tile, blocks outer and tokens inner: a block's weights (k * block * 4 bytes) stay in L1
  // while every token's table slice for that block (12 bytes per column) passes over them. With
  // several tokens, a few tiles share each slice while it is in L1.
  const int64_t span = T > 1 ? 4 : 1;
  bitquilt_par::parallel_for(0, ntiles, span, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(span * T * TILE);
    for (int64_t first = begin; first < end; first += span) {
      const int64_t last = std::min(end, first + span);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < s.blocks(); ++b)
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* tb = tab.data() + (b * T + t) * block * 12;
          const int64_t j = b * T + t;
          for (int64_t i = first; i < last; ++i) {
            float* out = acc.data() + ((i - first) * T + t) * TILE;
            for (const Part& p : parts) {
              const uint8_t* wb = p.w + i * p.s.tile_bytes() + b * p.s.k * plane_bytes;
              const void* cb = p.coef + (i * s.groups() + b / per_group) * p.coef_group;
              switch (p.mode) {
                case Coef::uniform16: tile_block<Coef::uniform16>(wb, cb, tb, scale[j], sums[j], p.s, out); break;
                case Coef::uniform32: tile_block<Coef::uniform32>(wb, cb, tb, scale[j], sums[j], p.s, out); break;
                default: tile_block<Coef::planes>(wb, cb, tb, scale[j], sums[j], p.s, out);
              }
            }
          }
        }
      if (!res.empty())  // the tiles' residual segments, every token, while the accumulators are hot
        for (int64_t i = first; i < last; ++i)
          bitquilt_sparse::tile_residual(res, i, xp, s.K, T, acc.data() + (i - first) * T * TILE, TILE);
      for (int64_t i = first; i < last; ++i) {
        const int64_t rows = std::min(TILE, N - i * TILE);
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(acc.data() + ((i - first) * T + t) * TILE, rows, yp + t * N + i * TILE);
      }
    }
  });
}

}  // namespace bitquilt_lut
