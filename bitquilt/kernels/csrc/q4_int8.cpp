// 4-bit uniform weights times int8-quantized activations (AVX2), used by bitquilt.kernels.q4_int8.
//
// The bit-plane lookup-table kernel keeps activations exact to 2^-21 at the price of three table limbs per
// plane; a 4-bit code can instead multiply an int8 activation directly (vpmaddubsw: unsigned code x signed
// byte, pairs summed in int16), which is what llama.cpp's Q4 x Q8 dot products do. Per token, each block of
// 32 activations b is rounded to int8, x_c ~ d_b * i_c with d_b = max|x_b| / 127; then for row r
//
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q[r, b], i_b>  -  sum_g (s z)[r, g] * X_g,
//   X_g  = sum_{b in g} d_b * sum_{c in b} i_c
//
// which is exactly x_hat @ W^T for the rounded activations x_hat (the only error: |x - x_hat| <= d_b / 2 per
// value). <q, i> is exact in int32 (|15 * 127 * 2| fits int16 per pair). One 16-byte chunk per row and block
// holds the 32 codes (low nibbles: the first 16 columns, high nibbles: the next 16), widened with one shift
// and mask; four rows share each activation block load. Several tokens (prefill) widen each tile's codes
// once into an int8 buffer and run every token over it.

#include "q4_int8.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "avx2_simd.h"

namespace bitquilt_q4 {

namespace {

using bitquilt_simd::hsum8;

// Token x [K] as int8 codes [K], block scales d [K / 32] and group sums X [groups] (module comment).
void round_token(const float* x, int64_t K, int64_t group, int8_t* codes, float* d, float* X) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  std::fill_n(X, (K + group - 1) / group, 0.0f);
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < BLOCK; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + j), absmask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    d[b] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i sum = _mm256_setzero_si256();
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), inv));  // round to nearest even
      sum = _mm256_add_epi32(sum, v[j]);
    }
    // 32 int32 -> 32 int8 in column order (packs interleave 128-bit lanes; the permute undoes it)
    const __m256i w16a = _mm256_packs_epi32(v[0], v[1]), w16b = _mm256_packs_epi32(v[2], v[3]);
    const __m256i w8 = _mm256_packs_epi16(w16a, w16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * BLOCK),
                        _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    X[b * BLOCK / group] += d[b] * hsum8(_mm256_cvtepi32_ps(sum));
  }
}

inline __m256i widen(const uint8_t* p) {  // 16 bytes -> 32 codes in column order
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
}

inline __m256 block_dot(__m256i q, __m256i x) {  // 8 lanes whose sum is <q, x>, as floats
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)));
}

// The tile's 4 rows for one token; `codes` gives a row's 32 codes of block b (packed chunk or widened buffer).
template <typename Codes>
inline void tile_token(const Codes& codes, const float* sz, const Weight& W, const int8_t* xi, const float* d,
                       const float* X, float* out) {
  __m256 total[ROWS];
  float offset[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = 0; r < ROWS; ++r) total[r] = _mm256_setzero_ps();
  const int64_t per_group = W.group / BLOCK, blocks = W.K / BLOCK;
  for (int64_t g = 0; g < W.groups(); ++g) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < std::min(blocks, (g + 1) * per_group); ++b) {
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + b * BLOCK));
      const __m256 db = _mm256_set1_ps(d[b]);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(block_dot(codes(b, r), xb), db, acc[r]);
    }
    const float* s = sz + g * 2 * ROWS;
    for (int r = 0; r < ROWS; ++r) {
      total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(s[r]), total[r]);
      offset[r] += s[ROWS + r] * X[g];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = hsum8(total[r]) - offset[r];
}

}  // namespace

Weight make_weight(const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t group) {
  TORCH_CHECK(K % BLOCK == 0 && group % BLOCK == 0 && group > 0, "columns and group size must be multiples of 32");
  const Weight W{nullptr, nullptr, N, K, group};
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == W.tiles() * ROWS * K / 2,
              "packed codes do not match the shape");
  TORCH_CHECK(sz.scalar_type() == at::kFloat && sz.is_contiguous() && sz.numel() == W.tiles() * W.groups() * 2 * ROWS,
              "scales do not match the shape");
  return {w.data_ptr<uint8_t>(), sz.data_ptr<float>(), N, K, group};
}

void matmul_into(const float* x, int64_t T, const Weight& W, float* y) {
  const int64_t K = W.K, G = W.groups(), blocks = K / BLOCK, tile_bytes = ROWS * K / 2;
  std::vector<int8_t> xi(T * K);
  std::vector<float> d(T * blocks), X(T * G);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      round_token(x + t * K, K, W.group, xi.data() + t * K, d.data() + t * blocks, X.data() + t * G);
  });
  const int64_t grain = std::max<int64_t>(4, (1 << 15) / tile_bytes);  // tiles per task: ~32 KB of codes
  at::parallel_for(0, W.tiles(), grain, [&](int64_t i0, int64_t i1) {
    std::vector<int8_t> widened(T > 1 ? ROWS * K : 0);
    float out[ROWS];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* wt = W.w + i * tile_bytes;
      const float* sz = W.sz + i * G * 2 * ROWS;
      const int64_t rows = std::min(ROWS, W.N - i * ROWS);
      if (T == 1) {
        const auto packed = [wt](int64_t b, int r) { return widen(wt + (b * ROWS + r) * 16); };
        tile_token(packed, sz, W, xi.data(), d.data(), X.data(), out);
        std::copy_n(out, rows, y + i * ROWS);
        continue;
      }
      for (int64_t b = 0; b < blocks; ++b)  // widen the tile once, then every token over it
        for (int r = 0; r < ROWS; ++r)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(widened.data() + (b * ROWS + r) * BLOCK),
                              widen(wt + (b * ROWS + r) * 16));
      const int8_t* wd = widened.data();
      const auto buffered = [wd](int64_t b, int r) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + (b * ROWS + r) * BLOCK));
      };
      for (int64_t t = 0; t < T; ++t) {
        tile_token(buffered, sz, W, xi.data() + t * K, d.data() + t * blocks, X.data() + t * G, out);
        std::copy_n(out, rows, y + t * W.N + i * ROWS);
      }
    }
  });
}

namespace {

at::Tensor q4_int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const Weight W = make_weight(w, sz, N, x.size(1), group);
  auto y = at::empty({x.size(0), N}, x.options());
  matmul_into(x.data_ptr<float>(), x.size(0), W, y.data_ptr<float>());
  return y;
}

}  // namespace

}  // namespace bitquilt_q4

// Adds the int8-activation 4-bit matmul to the extension module (called from its PYBIND11_MODULE).
void register_q4_int8(pybind11::module& m) {
  m.def("q4_int8_matmul", &bitquilt_q4::q4_int8_matmul,
        "y = x_hat @ W^T for 4-bit uniform W, x_hat = x rounded to int8 per block of 32 (AVX2 maddubs)");
}
