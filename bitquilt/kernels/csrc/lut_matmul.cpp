// Bit-plane lookup-table matmul for x86-64 AVX2 (T-MAC style), used by bitquilt.kernels.cpu.
//
// A weight matrix is k binary planes B_i plus per-(row, group) coefficients:
//     W[r, c] = C0[r, g(c)] + sum_i C_i[r, g(c)] * B_i[r, c]
// so  y[r] = sum_g C0[r, g] * S_g(x) + sum_i C_i[r, g] * P_ig[r],  P_ig[r] = sum_{c in g} x[c] B_i[r, c].
// P is computed with vpshufb: for every 4 activations a 16-entry table holds the 16 possible partial
// sums, and each plane's 4-bit nibble (4 columns of one row) indexes it, 32 rows per instruction.
//
// Precision: a table entry is an int16 v = 256*h + l (h signed byte, l unsigned byte) scaled per
// block of <= 128 columns (v = round(T * 32767 / max|T|)); the h and l bytes are looked up
// separately and summed exactly in int16/int32, so the only error is the 2^-16 relative rounding of
// each table entry -- activations keep ~16 bits instead of int8's 8. Coefficients are applied in fp32
// per group, and C0 multiplies the exact fp32 block sum of x.
//
// Packed weight layout (built by bitquilt.kernels.cpu): uint8 [tiles][blocks][k][B/8][32]; byte t of
// a 32-byte vector is row ROW_OF_BYTE[t] of the 32-row tile, its low nibble columns 8p..8p+3 (bit j =
// column 8p+j) and its high nibble columns 8p+4..8p+7. The byte order undoes the lane shuffles of
// the int8 -> int16 -> int32 widening, so each int32 result vector covers 8 consecutive rows.
//
// Coefficients: mode "planes": fp16 [tiles][groups][k+1][32] (C0, C1..Ck per row);
//               mode "uniform": fp32 [tiles][groups][2][32] (s, -s*z) with C_i = s * 2^(i-1).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t TILE = 32;
constexpr int64_t MAX_BLOCK = 128;  // int16 accumulators hold <= 16 nibble-pair sums of each byte
constexpr int64_t PREFETCH = 1024;  // bytes ahead in the weight stream

struct Shape {
  int64_t K, N, k, block, group;
  int64_t tiles() const { return (N + TILE - 1) / TILE; }
  int64_t blocks() const { return K / block; }
  int64_t groups() const { return (K + group - 1) / group; }  // the last group may be shorter
  int64_t tab_bytes() const { return K / 4 * 32; }  // per token
  int64_t tile_bytes() const { return K / 8 * TILE * k; }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Tables of one token, written to its slots of [blocks][T] arrays: per block, for each column quad
// q, the 16 high bytes then the 16 low bytes of the int16 entries; the block's table scale and sum of x.
void build_tables(const float* x, const Shape& s, int64_t T, uint8_t* tab, float* scale, float* sums) {
  const __m256 bit0 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
  const __m256 bit1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1));
  const __m256 bit2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1));
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // per 128-bit lane: the 8 low bytes of the int16 entries, then the 8 high bytes
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
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
      __m256 hi = _mm256_add_ps(lo, _mm256_set1_ps(xq[3]));
      _mm256_store_ps(t + 16 * q, lo);
      _mm256_store_ps(t + 16 * q + 8, hi);
      vmax = _mm256_max_ps(vmax, _mm256_max_ps(_mm256_and_ps(lo, absmask), _mm256_and_ps(hi, absmask)));
    }
    const float mx = hmax(vmax);
    scale[b * T] = mx / 32767.f;
    sums[b * T] = hsum(vsum);
    const __m256 inv = _mm256_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
    for (int64_t q = 0; q < nq; ++q) {
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(t + 16 * q), inv));
      __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(t + 16 * q + 8), inv));
      __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);  // int16 entries 0..15
      v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0x8D);    // [high bytes | low bytes]
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tab + (b * T * nq + q) * 32), v);
    }
  }
}

// sum_{c in block} x[c] * B[r, c] for the 32 rows of a tile and one plane, in units of the block's
// table scale: r[m] holds rows 8m..8m+7 as int32.
inline void plane_block(const uint8_t* w, const uint8_t* tab, int64_t pairs, __m256i r[4]) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi8(1);
  __m256i ha = _mm256_setzero_si256(), hb = ha, la = ha, lb = ha;
#pragma GCC unroll 4
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * p + PREFETCH), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * p));
    const __m256i i0 = _mm256_and_si256(v, nib);
    const __m256i i1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    const __m128i* t = reinterpret_cast<const __m128i*>(tab + 64 * p);
    const __m256i h0 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(t)), i0);
    const __m256i l0 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(t + 1)), i0);
    const __m256i h1 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(t + 2)), i1);
    const __m256i l1 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(t + 3)), i1);
    // interleave the two nibbles of each row and add them pairwise into int16 lanes
    ha = _mm256_add_epi16(ha, _mm256_maddubs_epi16(ones, _mm256_unpacklo_epi8(h0, h1)));
    hb = _mm256_add_epi16(hb, _mm256_maddubs_epi16(ones, _mm256_unpackhi_epi8(h0, h1)));
    la = _mm256_add_epi16(la, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(l0, l1), ones));
    lb = _mm256_add_epi16(lb, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(l0, l1), ones));
  }
  const __m256i w256 = _mm256_set1_epi32(0x01000001);  // int16 pairs (l, h) -> l + 256 h
  r[0] = _mm256_madd_epi16(_mm256_unpacklo_epi16(la, ha), w256);
  r[1] = _mm256_madd_epi16(_mm256_unpackhi_epi16(la, ha), w256);
  r[2] = _mm256_madd_epi16(_mm256_unpacklo_epi16(lb, hb), w256);
  r[3] = _mm256_madd_epi16(_mm256_unpackhi_epi16(lb, hb), w256);
}

// acc[0..32) += the contribution of block b (all planes) to the 32 rows of one tile, one token.
template <bool UNIFORM>
inline void tile_block(const uint8_t* w, const void* coef, const uint8_t* tab, float scale, float sum,
                       const Shape& s, float* acc) {
  const int64_t pairs = s.block / 8, plane_bytes = s.block * 4;
  const __m256 sc = _mm256_set1_ps(scale), sx = _mm256_set1_ps(sum);
  __m256i r[4];
  if constexpr (UNIFORM) {  // planes combine exactly in int32: q = sum_i 2^i P_i
    const float* c = static_cast<const float*>(coef);
    __m256i q[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
    for (int64_t i = 0; i < s.k; ++i) {
      plane_block(w + i * plane_bytes, tab, pairs, r);
      const __m128i sh = _mm_cvtsi32_si128(static_cast<int>(i));
      for (int m = 0; m < 4; ++m) q[m] = _mm256_add_epi32(q[m], _mm256_sll_epi32(r[m], sh));
    }
    for (int m = 0; m < 4; ++m) {
      __m256 a = _mm256_loadu_ps(acc + 8 * m);
      a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[m]), sc), _mm256_loadu_ps(c + 8 * m), a);
      _mm256_storeu_ps(acc + 8 * m, _mm256_fmadd_ps(_mm256_loadu_ps(c + TILE + 8 * m), sx, a));
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

Shape check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N,
            int64_t k, int64_t block, int64_t group, bool uniform) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const Shape s{x.size(1), N, k, block, group};
  TORCH_CHECK(block == 32 || block == 64 || block == MAX_BLOCK, "block must be 32, 64 or 128");
  TORCH_CHECK(s.K % block == 0 && group % block == 0, "block must divide K and the group size");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == s.tiles() * s.tile_bytes(),
              "packed planes do not match the shape");
  const int64_t per_tile = s.groups() * (uniform ? 2 : k + 1) * TILE;
  TORCH_CHECK(coef.is_contiguous() && coef.numel() == s.tiles() * per_tile &&
                  coef.scalar_type() == (uniform ? at::kFloat : at::kHalf),
              "coefficients do not match the shape");
  return s;
}

// y [T, N] = x [T, K] @ W^T for W in the packed bit-plane layout.
at::Tensor lut_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N,
                         int64_t k, int64_t block, int64_t group, bool uniform) {
  const Shape s = check(x, w, coef, N, k, block, group, uniform);
  const int64_t T = x.size(0), ntiles = s.tiles();
  std::vector<uint8_t> tab(T * s.tab_bytes());
  std::vector<float> scale(T * s.blocks()), sums(T * s.blocks());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      build_tables(xp + t * s.K, s, T, tab.data() + t * s.block * 8, scale.data() + t, sums.data() + t);
  });
  auto y = at::empty({T, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const char* cp = static_cast<const char*>(coef.data_ptr());
  const int64_t coef_group = (uniform ? 2 : k + 1) * TILE * coef.element_size();
  const int64_t per_group = group / block, plane_bytes = block * 4;
  // Per tile, blocks outer and tokens inner: a block's weights (k * block * 4 bytes) stay in L1
  // while every token's 1 KB table slice for that block passes over them.
  at::parallel_for(0, ntiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(T * TILE);
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < s.blocks(); ++b) {
        const uint8_t* wb = wp + i * s.tile_bytes() + b * s.k * plane_bytes;
        const void* cb = cp + (i * s.groups() + b / per_group) * coef_group;
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* tb = tab.data() + (b * T + t) * block * 8;
          const int64_t j = b * T + t;
          if (uniform)
            tile_block<true>(wb, cb, tb, scale[j], sums[j], s, acc.data() + t * TILE);
          else
            tile_block<false>(wb, cb, tb, scale[j], sums[j], s, acc.data() + t * TILE);
        }
      }
      const int64_t rows = std::min(TILE, N - i * TILE);
      for (int64_t t = 0; t < T; ++t) std::copy_n(acc.data() + t * TILE, rows, yp + t * N + i * TILE);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_matmul", &lut_matmul, "y = x @ W^T for bit-plane packed W (AVX2 lookup tables)");
}
