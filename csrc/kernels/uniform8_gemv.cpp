// 8-bit uniform weights times a few tokens (decode), used by bitquilt.kernels.uniform8.
//
// W[r, c] = s[r, g] * (q[r, c] - z[r, g]) with q the uint8 code, g = c / group. Per row and token:
//   y[t, r] = sum_g s[r, g] * <q[r, g-th group], x[t, g-th group]>  -  sum_g (s z)[r, g] * X[t, g],
//   X[t, g] = sum of x[t] over group g (computed once per call).
// The codes are read where the format keeps them (its int32 words hold 4 codes each, little-endian,
// so the words' bytes are q row by row) and widened to fp32 in registers: 1 byte per weight read
// against 8 planes' worth of lookups in the bit-plane kernel, which is what an 8-bit LM head needs.
// Each group's dot product runs in independent fp32 accumulators (32 columns per step), scaled
// into the row's total at the group's end; one horizontal sum per row and token. Exact up to fp32
// summation order. Columns and groups must be multiples of 32 (the last group may be shorter).
//
// With int8 activations (gemv_int8_into), each block of 32 activations is rounded, x ~ d_b * i, and the codes
// are shifted to signed q' = q - 128 (one xor) so that vpmaddubsw can take |q'| (unsigned, up to 128) against
// sign(i, q') = i * sgn(q'):
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q'[r, b], i_b>  +  sum_g (128 s - s z)[r, g] * X_g,
//   X_g  = sum_{b in g} d_b * sum_{c in b} i_c,
// exactly x_hat @ W^T; pair sums |128 * 127 * 2| fit int16. Six integer instructions per 32 weights instead of
// twelve fp32 ones. Where the int8-activation kernels run AVX-512 VNNI, avx512/uniform8.cpp's loop takes the codes
// unshifted, one vpdpbusd per 32.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"
#include "common/parallel.h"
#include "kernels/int8_round.h"
#include "kernels/q4_int8.h"
#include "kernels/uniform8.h"

#ifdef TORCH_EXTENSION_NAME
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#endif

namespace {

using bitquilt_u8::prefetch_ahead;

constexpr int MAX_TOKENS = 2;  // tokens per pass over the weights
// Each row's codes are read once, in order; the next row's first line is hinted, and every other 32-byte step
// prefetches ahead in the (row-major, contiguous) code stream (uniform8.h), where the hardware prefetcher alone left
// the loop waiting on memory.

inline __m256 widen(const uint8_t* q) {  // 8 codes -> 8 exact floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// Rows r0 .. r1 - 1 for T (1 or 2) tokens (x rows ldx apart, y rows ldy apart). Four accumulators per token, one
// per 8-column quarter of a step: 4 T + 4 weight vectors + T totals stay within the 16 ymm registers, and a token's
// sums run in the same order whether it passes alone or with another (a batch's rows come out as each alone).
template <int T>
void rows(const uint8_t* q, const float* scale, const float* scale_zero, const float* x, const float* xsum, int64_t K,
          int64_t G, int64_t group, int64_t ldx, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = q + r * K;
    if (r + 1 < r1) _mm_prefetch(reinterpret_cast<const char*>(qr + K), _MM_HINT_T0);
    __m256 total[T];
    float offset[T];
    for (int t = 0; t < T; ++t) total[t] = _mm256_setzero_ps(), offset[t] = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[T][4];
      for (int t = 0; t < T; ++t)
        for (int u = 0; u < 4; ++u) acc[t][u] = _mm256_setzero_ps();
      const int64_t c1 = std::min(K, (g + 1) * group);
      for (int64_t c = g * group; c < c1; c += 32) {
        if (c % 64 == 0) prefetch_ahead(qr + c, 1);
        const __m256 w[4] = {widen(qr + c), widen(qr + c + 8), widen(qr + c + 16), widen(qr + c + 24)};
        for (int t = 0; t < T; ++t) {
          const float* xt = x + t * ldx + c;
          for (int u = 0; u < 4; ++u)
            acc[t][u] = _mm256_fmadd_ps(w[u], _mm256_loadu_ps(xt + 8 * u), acc[t][u]);
        }
      }
      const __m256 s = _mm256_set1_ps(scale[r * G + g]);
      for (int t = 0; t < T; ++t) {
        __m256 dot = acc[t][0];
        for (int u = 1; u < 4; ++u) dot = _mm256_add_ps(dot, acc[t][u]);
        total[t] = _mm256_fmadd_ps(dot, s, total[t]);
        offset[t] += scale_zero[r * G + g] * xsum[t * G + g];
      }
    }
    for (int t = 0; t < T; ++t) y[t * ldy + r] = bitquilt_simd::hsum8(total[t]) - offset[t];
  }
}

// Rows r0 .. r1 - 1 for one token rounded to int8: codes i [K], block steps d [K / 32], group sums X [groups].
void rows_int8(const uint8_t* q, const float* scale, const float* scale_zero, const int8_t* i, const float* d,
               const float* X, int64_t K, int64_t G, int64_t group, int64_t r0, int64_t r1, float* y) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t per_group = group / 32, blocks = K / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = q + r * K;
    if (r + 1 < r1) _mm_prefetch(reinterpret_cast<const char*>(qr + K), _MM_HINT_T0);
    __m256 total = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = g * per_group; b < std::min(blocks, (g + 1) * per_group); ++b) {
        if (b % 2 == 0) prefetch_ahead(qr + 32 * b, 1);
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(i + 32 * b));
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + 32 * b)), flip);
        // |q'| as unsigned (abs(-128) = 0x80 = 128) against sign(i, q'): |i| <= 127, so nothing overflows
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b]), acc);
      }
      const float s = scale[r * G + g];
      total = _mm256_fmadd_ps(acc, _mm256_set1_ps(s), total);
      offset += (128.0f * s - scale_zero[r * G + g]) * X[g];
    }
    y[r] = bitquilt_simd::hsum8(total) + offset;
  }
}

using RowsFn = void (*)(const uint8_t*, const float*, const float*, const float*, const float*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, float*, int64_t);
constexpr RowsFn ROWS[MAX_TOKENS] = {rows<1>, rows<2>};

#ifdef TORCH_EXTENSION_NAME
at::Tensor uniform8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& scale_zero, int64_t group, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const bitquilt_u8::Weight W = bitquilt_u8::make_weight(codes, scale, scale_zero, x.size(1), group);
  auto y = at::empty({x.size(0), W.N}, x.options());
  (int8 ? bitquilt_u8::gemv_int8_into : bitquilt_u8::gemv_into)(x.data_ptr<float>(), x.size(0), W,
                                                                 y.data_ptr<float>());
  return y;
}
#endif

}  // namespace

std::string bitquilt_u8::shape_error(int64_t K, int64_t group) {
  return K % 32 == 0 && group % 32 == 0 && group > 0 ? "" : "columns and group size must be multiples of 32";
}

void bitquilt_u8::row_into(const Weight& W, int64_t r, float* out) {
  const uint8_t* q = W.q + r * W.K;
  for (int64_t c = 0; c < W.K; ++c) {
    const int64_t g = r * W.groups() + c / W.group;
    out[c] = W.s[g] * static_cast<float>(q[c]) - W.sz[g];
  }
}

#ifdef TORCH_EXTENSION_NAME
bitquilt_u8::Weight bitquilt_u8::make_weight(const at::Tensor& codes, const at::Tensor& scale,
                                             const at::Tensor& scale_zero, int64_t K, int64_t group) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: contiguous uint8 [N, K]");
  const int64_t N = codes.size(0), G = (K + group - 1) / group;
  TORCH_CHECK(codes.size(1) == K, "codes have ", codes.size(1), " columns for ", K, " inputs");
  const std::string error = shape_error(K, group);
  TORCH_CHECK(error.empty(), error);
  for (const auto* t : {&scale, &scale_zero})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G,
                "scale, scale * zero: contiguous fp32 [N, groups]");
  return {codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), scale_zero.data_ptr<float>(), N, K, group};
}
#endif

void bitquilt_u8::gemv_into(const float* xp, int64_t T, const Weight& W, float* yp) {
  const int64_t K = W.K, G = W.groups(), N = W.N, group = W.group;
  std::vector<float> xsum(T * G, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < K; ++c) xsum[t * G + c / group] += xp[t * K + c];
  const int64_t grain = std::max<int64_t>(16, (1 << 16) / K);  // rows per task: ~64 KB of codes
  bitquilt_par::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t t0 = 0; t0 < T; t0 += MAX_TOKENS) {
      const int64_t n = std::min<int64_t>(MAX_TOKENS, T - t0);
      ROWS[n - 1](W.q, W.s, W.sz, xp + t0 * K, xsum.data() + t0 * G, K, G, group, K, r0, r1, yp + t0 * N, N);
    }
  });
}

void bitquilt_u8::gemv_int8_into(const float* xp, int64_t T, const Weight& W, float* yp) {
  const int64_t K = W.K, G = W.groups(), N = W.N, group = W.group, blocks = K / 32;
  const bitquilt_int8::RoundedTokens a(xp, T, K, group);
  const int64_t grain = std::max<int64_t>(16, (1 << 16) / K);  // rows per task: ~64 KB of codes
  const int isa = bitquilt_q4::active_isa();
  const auto row_loop = isa == bitquilt_q4::ISA_AVX512    ? bitquilt_u8::rows_int8_vnni
                        : isa == bitquilt_q4::ISA_AVXVNNI ? bitquilt_u8::rows_int8_avxvnni
                                                          : rows_int8;
  bitquilt_par::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t t = 0; t < T; ++t)
      row_loop(W.q, W.s, W.sz, a.codes.data() + t * K, a.d.data() + t * blocks, a.X.data() + t * G, K, G, group,
               r0, r1, yp + t * N);
  });
}

#ifdef TORCH_EXTENSION_NAME
// Adds the 8-bit uniform GEMV to the extension module (called from its PYBIND11_MODULE).
void register_uniform8(pybind11::module& m) {
  namespace py = pybind11;
  m.def("uniform8_gemv", &uniform8_gemv,
        "y = x @ W^T for 8-bit uniform W, codes widened in registers; with int8: x rounded to int8 per 32 (AVX2)",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("scale_zero"), py::arg("group"),
        py::arg("int8") = false);
}
#endif
