// Bit-plane lookup-table matmul for x86-64 AVX2 (T-MAC style), used by bitquilt.kernels.cpu.
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
//
// Large batches go through dequant_matmul instead: rows dequantized to fp32 in chunks, then at::mm.
//
// Both take an optional sparse 4-bit residual in 1x32 segments (sparse_residual.h), y = x @ (W + S)^T:
// the lookup-table path adds a tile's segments into the tile's accumulators after its blocks, before
// the copy-out; the sgemm path adds them into the tile's dequantized fp32 rows before at::mm. With no
// residual (an empty list, the default) both compute x @ W^T as before. sparse_residual_add_ is the
// residual alone, y += x @ S^T in place.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"
#include "common/stream_prefetch.h"
#include "kernels/lut_parts.h"
#include "kernels/sparse_residual.h"

namespace bitquilt_lut {

namespace {

using bitquilt_simd::hsum8;
using bitquilt_sparse::check_residual;
using bitquilt_sparse::Residual;

constexpr int64_t MAX_BLOCK = 128;  // int16 accumulators hold <= 16 pair sums of each limb
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

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
}

Coef coef_mode(const at::Tensor& coef, bool uniform) {
  const auto type = coef.scalar_type();
  TORCH_CHECK(uniform ? type == at::kFloat || type == at::kByte : type == at::kHalf,
              uniform ? "uniform coefficients: fp32 (s, -s*z) or uint8 (fp16 s, uint8 z)" : "plane coefficients: fp16");
  return !uniform ? Coef::planes : type == at::kByte ? Coef::uniform16 : Coef::uniform32;
}

int64_t coef_group_bytes(Coef mode, int64_t k) {
  switch (mode) {
    case Coef::planes: return (k + 1) * TILE * 2;
    case Coef::uniform32: return 2 * TILE * 4;
    default: return TILE * 3;
  }
}

}  // namespace

Shape check_packed(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
                   int64_t group, bool uniform) {
  const Shape s{K, N, k, block, group};
  TORCH_CHECK(k >= 1 && k <= 8, "1 to 8 planes");
  TORCH_CHECK(block == 32 || block == 64 || block == MAX_BLOCK, "block must be 32, 64 or 128");
  TORCH_CHECK(s.K % block == 0 && group % block == 0, "block must divide K and the group size");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == s.tiles() * s.tile_bytes(),
              "packed planes do not match the shape");
  TORCH_CHECK(coef.is_contiguous() &&
                  coef.nbytes() == s.tiles() * s.groups() * coef_group_bytes(coef_mode(coef, uniform), k),
              "coefficients do not match the shape");
  return s;
}

Part make_part(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
               int64_t group, bool uniform) {
  const Shape s = check_packed(K, w, coef, N, k, block, group, uniform);
  const Coef mode = coef_mode(coef, uniform);
  return {w.data_ptr<uint8_t>(), static_cast<const char*>(coef.data_ptr()), s, coef_group_bytes(mode, k), mode};
}

// y [T, N] = x [T, K] @ (sum_p W_p + S)^T for the parts W_p in the packed bit-plane layout, S the residual (none
// if empty). The activation tables are built once and serve every part.
void lut_parts_into(const float* xp, int64_t T, const std::vector<Part>& parts, int64_t N, const Residual& res,
                    float* yp) {
  const Shape& s = parts.front().s;
  const int64_t ntiles = s.tiles(), block = s.block;
  std::vector<uint8_t> tab(T * s.tab_bytes());
  std::vector<float> scale(T * s.blocks()), sums(T * s.blocks());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      build_tables(xp + t * s.K, s, T, tab.data() + t * s.block * 12, scale.data() + t, sums.data() + t);
  });
  const int64_t per_group = s.group / block, plane_bytes = block * 4;
  // Per tile, blocks outer and tokens inner: a block's weights (k * block * 4 bytes) stay in L1
  // while every token's table slice for that block (12 bytes per column) passes over them. With
  // several tokens, a few tiles share each slice while it is in L1.
  const int64_t span = T > 1 ? 4 : 1;
  at::parallel_for(0, ntiles, span, [&](int64_t begin, int64_t end) {
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

namespace {

at::Tensor lut_parts(const at::Tensor& x, const std::vector<Part>& parts, int64_t N, const Residual& res) {
  auto y = at::empty({x.size(0), N}, x.options());
  lut_parts_into(x.data_ptr<float>(), x.size(0), parts, N, res, y.data_ptr<float>());
  return y;
}

// y [T, N] = x [T, K] @ (W + S)^T for W in the packed bit-plane layout, S the residual (none if empty).
at::Tensor lut_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k,
                      int64_t block, int64_t group, bool uniform, const std::vector<at::Tensor>& residual) {
  check_rows(x);
  const Part part = make_part(x.size(1), w, coef, N, k, block, group, uniform);
  return lut_parts(x, {part}, N, check_residual(residual, N, part.s.K));
}

// The parts of a sum, each checked against the shared shape.
std::vector<Part> make_parts(int64_t K, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& coefs,
                             const std::vector<int64_t>& ks, const std::vector<bool>& uniforms, int64_t N,
                             int64_t block, int64_t group) {
  TORCH_CHECK(!ws.empty() && coefs.size() == ws.size() && ks.size() == ws.size() && uniforms.size() == ws.size(),
              "one coefficient tensor, plane count and uniform flag per part");
  std::vector<Part> parts;
  for (size_t p = 0; p < ws.size(); ++p)
    parts.push_back(make_part(K, ws[p], coefs[p], N, ks[p], block, group, uniforms[p]));
  return parts;
}

// y = x @ (sum_p W_p)^T for several packed weights of one shape, block and group (MoBiQuant's slices up to a
// prefix): one call, one set of activation tables.
at::Tensor lut_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                            const std::vector<at::Tensor>& coefs, const std::vector<int64_t>& ks,
                            const std::vector<bool>& uniforms, int64_t N, int64_t block, int64_t group) {
  check_rows(x);
  return lut_parts(x, make_parts(x.size(1), ws, coefs, ks, uniforms, N, block, group), N, {});
}

// Rows of one tile dequantized to fp32 row-major: out[r * K + c] = C0 + sum_i C_i B_i[r, c], added to what out
// holds when `accumulate` (the next part of a sum).
void dequant_tile(const uint8_t* w, const char* coef, int64_t coef_group, Coef mode, const Shape& s,
                  const uint8_t* byte_of_row, bool accumulate, float* out) {
  // kBits[b] = the 8 bits of byte b as floats 0/1
  static const std::vector<float> kBits = [] {
    std::vector<float> v(256 * 8);
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) v[b * 8 + j] = static_cast<float>((b >> j) & 1);
    return v;
  }();
  const int64_t pairs = s.block / 8, plane_bytes = s.block * 4, per_group = s.group / s.block;
  float c[9];
  for (int64_t b = 0; b < s.blocks(); ++b) {
    const char* cg = coef + (b / per_group) * coef_group;
    const uint8_t* wb = w + b * s.k * plane_bytes;
    for (int64_t r = 0; r < TILE; ++r) {
      if (mode != Coef::planes) {  // (s, -s z) -> C0 = -s z, C_{i+1} = s 2^i
        float scale;
        if (mode == Coef::uniform32) {
          const float* u = reinterpret_cast<const float*>(cg);
          scale = u[r];
          c[0] = u[TILE + r];
        } else {
          scale = static_cast<float>(reinterpret_cast<const at::Half*>(cg)[r]);
          c[0] = -(scale * static_cast<float>(reinterpret_cast<const uint8_t*>(cg)[2 * TILE + r]));
        }
        for (int64_t i = 0; i < s.k; ++i) c[i + 1] = scale * static_cast<float>(1 << i);
      } else {
        const at::Half* h = reinterpret_cast<const at::Half*>(cg);
        for (int64_t i = 0; i <= s.k; ++i) c[i] = static_cast<float>(h[i * TILE + r]);
      }
      const uint8_t* wr = wb + byte_of_row[r];
      float* o = out + r * s.K + b * s.block;
      for (int64_t p = 0; p < pairs; ++p) {
        __m256 v = _mm256_set1_ps(c[0]);
        if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o + 8 * p), v);
        for (int64_t i = 0; i < s.k; ++i)
          v = _mm256_fmadd_ps(_mm256_loadu_ps(kBits.data() + 8 * wr[i * plane_bytes + 32 * p]),
                              _mm256_set1_ps(c[i + 1]), v);
        _mm256_storeu_ps(o + 8 * p, v);
      }
    }
  }
}

// y [T, N] = x [T, K] @ (sum_p W_p + S)^T by dequantizing chunks of rows to fp32 (each part added in turn, then the
// residual S) and calling at::mm once per chunk: faster than the tables once the batch is large enough for sgemm to
// be compute-efficient, and a sum of parts (MoBiQuant's slices up to a prefix) costs one product, not one per part.
at::Tensor dequant_parts_matmul(const at::Tensor& x, const std::vector<Part>& parts, int64_t N,
                                const std::vector<int64_t>& byte_of_row, const Residual& res) {
  TORCH_CHECK(byte_of_row.size() == TILE, "byte_of_row needs one entry per tile row");
  uint8_t bor[TILE];
  std::copy(byte_of_row.begin(), byte_of_row.end(), bor);
  const Shape& s = parts.front().s;
  const int64_t ntiles = s.tiles(), chunk = std::max<int64_t>(1, (4 << 20) / (TILE * s.K * 4));
  auto yt = at::empty({ntiles * TILE, x.size(0)}, x.options());  // y^T, rows padded to whole tiles
  auto wf = at::empty({chunk * TILE, s.K}, x.options());
  const at::Tensor xt = x.t();
  for (int64_t c0 = 0; c0 < ntiles; c0 += chunk) {
    const int64_t c1 = std::min(ntiles, c0 + chunk);
    at::parallel_for(c0, c1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* rows = wf.data_ptr<float>() + (i - c0) * TILE * s.K;
        for (size_t p = 0; p < parts.size(); ++p) {
          const Part& part = parts[p];
          dequant_tile(part.w + i * part.s.tile_bytes(), part.coef + i * s.groups() * part.coef_group,
                       part.coef_group, part.mode, part.s, bor, p > 0, rows);
        }
        if (!res.empty()) bitquilt_sparse::tile_residual_rows(res, i, s.K, rows);
      }
    });
    auto out = yt.narrow(0, c0 * TILE, (c1 - c0) * TILE);
    at::mm_out(out, wf.narrow(0, 0, (c1 - c0) * TILE), xt);
  }
  return yt.narrow(0, 0, N).t().contiguous();
}

at::Tensor dequant_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k,
                          int64_t block, int64_t group, bool uniform, const std::vector<int64_t>& byte_of_row,
                          const std::vector<at::Tensor>& residual) {
  check_rows(x);
  const Part part = make_part(x.size(1), w, coef, N, k, block, group, uniform);
  return dequant_parts_matmul(x, {part}, N, byte_of_row, check_residual(residual, N, part.s.K));
}

// y = x @ (sum_p W_p)^T for several packed weights of one shape, block and group through one sgemm per chunk.
at::Tensor dequant_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                const std::vector<at::Tensor>& coefs, const std::vector<int64_t>& ks,
                                const std::vector<bool>& uniforms, int64_t N, int64_t block, int64_t group,
                                const std::vector<int64_t>& byte_of_row) {
  check_rows(x);
  return dequant_parts_matmul(x, make_parts(x.size(1), ws, coefs, ks, uniforms, N, block, group), N, byte_of_row, {});
}

// y [T, N] += x [T, K] @ S^T in place for the residual S alone, tiles of 32 output rows in parallel.
void sparse_residual_add_(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "y: contiguous fp32 [T, N]");
  TORCH_CHECK(!residual.empty(), "sparse_residual_add_ needs a residual");
  const int64_t T = x.size(0), N = y.size(1), K = x.size(1);
  const Residual res = check_residual(residual, N, K);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // tile i's rows of y: y + i * TILE, one row of y per token
      bitquilt_sparse::tile_residual(res, i, xp, K, T, yp + i * TILE, N);
  });
}

}  // namespace

}  // namespace bitquilt_lut

void register_mxint(pybind11::module& m);   // mxint_matmul.cpp
void register_router(pybind11::module& m);  // slice_router.cpp
void register_uniform8(pybind11::module& m);  // uniform8_gemv.cpp

void register_decode_step(pybind11::module& m);  // decode_step.cpp
void register_q4_int8(pybind11::module& m);  // q4_int8.cpp
void register_hadamard(pybind11::module& m);  // hadamard.cpp
void register_read_rate(pybind11::module& m);  // read_rate.cpp
void register_repack(pybind11::module& m);  // repack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace bitquilt_lut;
  const std::vector<at::Tensor> none;
  m.def("lut_matmul", &lut_matmul, "y = x @ (W + S)^T for bit-plane packed W (AVX2 lookup tables), S a residual",
        py::arg("x"), py::arg("w"), py::arg("coef"), py::arg("N"), py::arg("k"), py::arg("block"), py::arg("group"),
        py::arg("uniform"), py::arg("residual") = none);
  m.def("lut_matmul_parts", &lut_matmul_parts, "y = x @ (sum_p W_p)^T for bit-plane packed parts of one shape",
        py::arg("x"), py::arg("ws"), py::arg("coefs"), py::arg("ks"), py::arg("uniforms"), py::arg("N"),
        py::arg("block"), py::arg("group"));
  m.def("dequant_matmul", &dequant_matmul,
        "y = x @ (W + S)^T through dequantized fp32 row chunks and at::mm, S a residual", py::arg("x"), py::arg("w"),
        py::arg("coef"), py::arg("N"), py::arg("k"), py::arg("block"), py::arg("group"), py::arg("uniform"),
        py::arg("byte_of_row"), py::arg("residual") = none);
  m.def("dequant_matmul_parts", &dequant_matmul_parts,
        "y = x @ (sum_p W_p)^T for bit-plane packed parts of one shape through dequantized fp32 rows and at::mm",
        py::arg("x"), py::arg("ws"), py::arg("coefs"), py::arg("ks"), py::arg("uniforms"), py::arg("N"),
        py::arg("block"), py::arg("group"), py::arg("byte_of_row"));
  m.def("sparse_residual_add_", &sparse_residual_add_, "y += x @ S^T in place for a residual S in 1x32 segments",
        py::arg("y"), py::arg("x"), py::arg("residual"));
  register_mxint(m);
  register_router(m);
  register_uniform8(m);
  register_decode_step(m);
  register_read_rate(m);
  register_repack(m);
  register_q4_int8(m);
  register_hadamard(m);
}
