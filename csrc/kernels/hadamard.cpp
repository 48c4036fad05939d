// Orthonormal Hadamard transform of fp32 rows (AVX2), used by bitquilt.nn.hadamard for QuaRot's online
// rotations (the down projection's input, the per-head query/key rotation) at calibration, evaluation and decode.
//
// The torch path runs one elementwise pass over the whole tensor per butterfly stage (14 passes for n = 1536);
// here each row is transformed while it sits in L1. With n = p * k (k a power of two) and F the orthonormal
// p x p factor already divided by sqrt(k):
//
//   u = x * s                                   (QuaRot's random signs; s = 1 when none are given)
//   v[a, :] = H_k u[a, :]       a < p           (unnormalised Walsh-Hadamard of each length-k segment)
//   y[c, :] = sum_a F[a, c] v[a, :]             (the odd factor; skipped when p = 1, F = [1 / sqrt(k)])
//
// which is x M_n for M_n = F ⊗ H_k, the matrix of bitquilt.nn.hadamard.hadamard_matrix. Stages with butterfly
// span 1, 2, 4 run inside one 8-lane register (a lane permutation and one FMA each: the pair (a, b) becomes
// (a + b, a - b)); wider spans pair whole registers.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <vector>

namespace bitquilt_hadamard {

namespace {

// Butterflies of span 1, 2 and 4 within v: lane i pairs with lane i ^ h, the lower lane keeps a + b.
inline __m256 butterflies_in_register(__m256 v) {
  const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0b10110001));
  v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0b01001110));
  return _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 1));
}

// In place: the unnormalised Walsh-Hadamard transform of x[0 .. k), k a power of two.
void walsh_hadamard(float* x, int64_t k) {
  if (k < 8) {
    for (int64_t h = 1; h < k; h *= 2)
      for (int64_t i = 0; i < k; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
    return;
  }
  for (int64_t i = 0; i < k; i += 8) _mm256_storeu_ps(x + i, butterflies_in_register(_mm256_loadu_ps(x + i)));
  for (int64_t h = 8; h < k; h *= 2)
    for (int64_t i = 0; i < k; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
}

// y[c * k + j] = sum_a ft[c * p + a] * v[a * k + j] for every column c of the odd factor (ft: F transposed).
// Four columns at a time: four independent FMA chains share each load of v.
void combine(const float* v, const float* ft, int64_t p, int64_t k, float* y) {
  constexpr int64_t C = 4;
  int64_t c = 0;
  for (; c + C <= p; c += C) {
    const float* f = ft + c * p;
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
      __m256 acc[C];
      for (int64_t i = 0; i < C; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t a = 0; a < p; ++a) {
        const __m256 va = _mm256_loadu_ps(v + a * k + j);
        for (int64_t i = 0; i < C; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(f[i * p + a]), va, acc[i]);
      }
      for (int64_t i = 0; i < C; ++i) _mm256_storeu_ps(y + (c + i) * k + j, acc[i]);
    }
    for (; j < k; ++j)
      for (int64_t i = 0; i < C; ++i) {
        float acc = 0.0f;
        for (int64_t a = 0; a < p; ++a) acc += f[i * p + a] * v[a * k + j];
        y[(c + i) * k + j] = acc;
      }
  }
  for (; c < p; ++c)
    for (int64_t j = 0; j < k; ++j) {
      float acc = 0.0f;
      for (int64_t a = 0; a < p; ++a) acc += ft[c * p + a] * v[a * k + j];
      y[c * k + j] = acc;
    }
}

// y [rows, n] = (x * signs) M_n for x [rows, n] contiguous fp32; signs [n] (or undefined: none); f [p, p] the odd
// factor over sqrt(k), row-major (f[a * p + c] = F[a, c] / sqrt(k)).
at::Tensor hadamard_rows(const at::Tensor& x, const c10::optional<at::Tensor>& signs, const at::Tensor& f) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [rows, n]");
  TORCH_CHECK(f.dim() == 2 && f.size(0) == f.size(1) && f.scalar_type() == at::kFloat && f.is_contiguous(),
              "f: contiguous fp32 [p, p]");
  const int64_t rows = x.size(0), n = x.size(1), p = f.size(0), k = p > 0 ? n / p : 0;
  TORCH_CHECK(p > 0 && k * p == n && (k & (k - 1)) == 0, "n must be p times a power of two");
  const bool has_signs = signs.has_value() && signs->defined();
  if (has_signs)
    TORCH_CHECK(signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->numel() == n,
                "signs: contiguous fp32 [n]");
  auto y = at::empty({rows, n}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* s = has_signs ? signs->data_ptr<float>() : nullptr;
  const float* fs = f.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  std::vector<float> ft(p * p);  // F transposed: column c of F contiguous
  for (int64_t a = 0; a < p; ++a)
    for (int64_t c = 0; c < p; ++c) ft[c * p + a] = fs[a * p + c];
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(n, 1));  // rows per task: ~256 KB
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> u(p > 1 ? n : 0);
    for (int64_t r = r0; r < r1; ++r) {
      float* dst = p > 1 ? u.data() : ys + r * n;  // p = 1: transform in the output row
      const float* src = xs + r * n;
      if (s)
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s[i];
      else
        std::copy_n(src, n, dst);
      for (int64_t a = 0; a < p; ++a) walsh_hadamard(dst + a * k, k);
      if (p == 1) {
        const float scale = fs[0];
        for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
        continue;
      }
      combine(u.data(), ft.data(), p, k, ys + r * n);
    }
  });
  return y;
}

}  // namespace

}  // namespace bitquilt_hadamard

// Adds the Hadamard transform to the extension module (called from its PYBIND11_MODULE).
void register_hadamard(pybind11::module& m) {
  m.def("hadamard_rows", &bitquilt_hadamard::hadamard_rows,
        "y = (x * signs) @ M_n, M_n = F (x) H_k for fp32 rows x [rows, n], F [p, p] pre-divided by sqrt(k)",
        pybind11::arg("x"), pybind11::arg("signs"), pybind11::arg("f"));
}
