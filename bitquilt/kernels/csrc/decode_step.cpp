// One decoded token through every decoder layer of a Llama-like model in one call, used by
// bitquilt.kernels.decode_step (built by bitquilt.models.lean_decode).
//
// A batch-1 decode step of a small model run module by module spends more time in the framework's
// per-op overhead (hundreds of views, slices and element-wise ops per token, a few µs each) than in
// its matmuls. Here a layer is, for the token's hidden state x (fp32, D values):
//
//   h = RMSNorm(x) * w_in                                  (mean of squares in fp32, then rsqrt(. + eps))
//   q = W_q h + b_q,  k = W_k h + b_k,  v = W_v h + b_v     (biases optional: Qwen2)
//   q, k per head: RMSNorm over head_dim * w_qn / w_kn      (optional: Qwen3)
//   q, k per head: RoPE, out = u * cos[pos] + rotate_half(u) * sin[pos],
//                  rotate_half(u) = [-u[d/2:], u[:d/2]]     (cos/sin tables from the model's rotary module)
//   K[g, pos] = k_g, V[g, pos] = v_g                        (the static cache, [kv_heads, max_len, head_dim])
//   a_h = sum_{j <= pos} softmax_j(scaling * <q_h, K[g(h), j]>) V[g(h), j],   g(h) = h / (heads / kv_heads)
//   x = x + W_o a
//   h = RMSNorm(x) * w_post
//   x = x + W_down (silu(W_gate h) * (W_up h))
//
// Every W is a sum of bit-plane packed parts run by the lookup-table kernel (lut_parts.h: one part for a
// bitplane or uniform format, the first k slices for a MoBiQuant checkpoint in static mode), a 4- or 2-bit
// uniform weight run on int8-rounded activations (q4_int8.h, when int8 activations are enabled), an 8-bit
// uniform weight run by the 8-bit GEMV (uniform8.h), or a dense fp32 matrix (at::mv); packed parts may carry a
// MosaicQuant sparse residual, added inside the lookup-table kernel (sparse_residual.h). A routed MoBiQuant
// linear first counts the token's slices with its router (slice_router.h) and runs that prefix of its parts.
// The same math as the eager modules in another fp32 order; tested against them (tests/test_lean_decode.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mv.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "avx2_simd.h"
#include "lut_parts.h"
#include "q4_int8.h"
#include "slice_router.h"
#include "uniform8.h"

namespace {

using bitquilt_simd::dot;
using bitquilt_simd::exp8;
using bitquilt_simd::hsum8;

struct Linear {
  std::optional<bitquilt_q4::Weight> q4;  // 4- or 2-bit codes times int8 activations, or:
  std::optional<bitquilt_u8::Weight> u8;  // 8-bit codes widened in registers (u8_int8: on int8 activations), or:
  bool u8_int8 = false;
  std::vector<bitquilt_lut::Part> parts;  // packed parts summed; if neither: dense
  bitquilt_sparse::Residual residual;     // with parts: a sparse 4-bit residual added tile by tile (MosaicQuant)
  std::vector<at::Tensor> keep;           // the tensors the parts point into
  at::Tensor dense;                       // fp32 [N, K] when there are no parts
  at::Tensor bias;                        // fp32 [N] or undefined
  std::optional<bitquilt_router::Router> router;  // per-token slice count over the parts (MoBiQuant)
  std::vector<std::vector<bitquilt_lut::Part>> prefixes;  // prefixes[k]: the first k parts
  at::Tensor tau;                         // the router's threshold (fp32 scalar, read at every call)
  mutable std::vector<float> hidden;      // the router's scratch
  int64_t N = 0, K = 0;

  // y [N] = W x (+ b)
  void run(const float* x, float* y) const {
    if (router) {
      const int64_t k = bitquilt_router::count(x, *router, *tau.data_ptr<float>(), hidden.data());
      bitquilt_lut::lut_parts_into(x, 1, prefixes[k], N, {}, y);
    } else if (q4) {
      bitquilt_q4::matmul_into(x, 1, *q4, y);
    } else if (u8) {
      (u8_int8 ? bitquilt_u8::gemv_int8_into : bitquilt_u8::gemv_into)(x, 1, *u8, y);
    } else if (parts.empty()) {
      const auto opts = at::TensorOptions().dtype(at::kFloat);
      auto out = at::from_blob(y, {N}, opts);
      at::mv_out(out, dense, at::from_blob(const_cast<float*>(x), {K}, opts));
    } else {
      bitquilt_lut::lut_parts_into(x, 1, parts, N, residual, y);
    }
    if (bias.defined()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t i = 0; i < N; ++i) y[i] += b[i];
    }
  }
};

struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm undefined unless the family has them
  int64_t q, k, v, o, gate, up, down;            // indices into the decoder's linears
  at::Tensor keys, values;                       // fp32 [kv_heads, max_len, head_dim], written in place
};

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i], 8 at a time (exp8).
void silu_times(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// s[j] = e^(s[j] - top) for j < n, 8 at a time (exp8); returns their sum (a softmax's denominator).
float exp_shifted(float* s, int64_t n, float top) {
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum8(sum);
  for (; j < n; ++j) total += s[j] = std::exp(s[j] - top);
  return total;
}

at::Tensor fp32_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what, ": contiguous fp32 [",
              n, "]");
  return t;
}

class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scaling, const at::Tensor& cos, const at::Tensor& sin)
      : D_(hidden), H_(heads), G_(kv_heads), hd_(head_dim), F_(intermediate), eps_(static_cast<float>(eps)),
        scaling_(static_cast<float>(scaling)), cos_(cos), sin_(sin) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
                "cos, sin: contiguous fp32 [max_len, head_dim]");
    max_len_ = cos.size(0);
    h_.resize(std::max(D_, F_));
    q_.resize(H_ * hd_);
    k_.resize(G_ * hd_);
    v_.resize(G_ * hd_);
    a_.resize(H_ * hd_);
    out_.resize(D_);
    gate_.resize(F_);
    up_.resize(F_);
    scores_.resize(max_len_);
  }

  // A linear of N outputs and K inputs: packed parts (planes, coefficients, plane counts, uniform flags, one
  // block and group), optionally plus a sparse residual in sparse_residual.h's segments, or, with no parts, a
  // dense fp32 [N, K] weight; an optional fp32 bias. Returns its index.
  int64_t add_linear(const std::vector<at::Tensor>& planes, const std::vector<at::Tensor>& coefs,
                     const std::vector<int64_t>& ks, const std::vector<bool>& uniforms, int64_t block, int64_t group,
                     int64_t N, int64_t K, const std::optional<at::Tensor>& dense,
                     const std::optional<at::Tensor>& bias, const std::vector<at::Tensor>& residual) {
    TORCH_CHECK(coefs.size() == planes.size() && ks.size() == planes.size() && uniforms.size() == planes.size(),
                "one coefficient tensor, plane count and uniform flag per part");
    Linear lin;
    lin.N = N;
    lin.K = K;
    for (size_t p = 0; p < planes.size(); ++p) {
      lin.parts.push_back(bitquilt_lut::make_part(K, planes[p], coefs[p], N, ks[p], block, group, uniforms[p]));
      lin.keep.push_back(planes[p]);
      lin.keep.push_back(coefs[p]);
    }
    TORCH_CHECK(residual.empty() || !planes.empty(), "a sparse residual is added to packed parts only");
    lin.residual = bitquilt_sparse::check_residual(residual, N, K);
    lin.keep.insert(lin.keep.end(), residual.begin(), residual.end());
    if (planes.empty()) {
      TORCH_CHECK(dense.has_value() && dense->dim() == 2 && dense->size(0) == N && dense->size(1) == K &&
                      dense->scalar_type() == at::kFloat && dense->is_contiguous(),
                  "a linear without packed parts needs a contiguous fp32 [N, K] weight");
      lin.dense = *dense;
    }
    return push(std::move(lin), bias);
  }

  // A 4- or 2-bit uniform linear in the int8-activation kernel's layout (q4_int8.h); an optional fp32 bias.
  int64_t add_q4_linear(const at::Tensor& w, const at::Tensor& sz, int64_t group, int64_t bits, int64_t N, int64_t K,
                        const std::optional<at::Tensor>& bias) {
    Linear lin;
    lin.N = N;
    lin.K = K;
    lin.q4 = bitquilt_q4::make_weight(w, sz, N, K, group, bits);
    lin.keep = {w, sz};
    return push(std::move(lin), bias);
  }

  // An 8-bit uniform linear for the 8-bit GEMV (uniform8.h): codes [N, K], s and s * z [N, groups]; with int8,
  // on int8-rounded activations.
  int64_t add_u8_linear(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& scale_zero, int64_t group,
                        int64_t N, int64_t K, bool int8, const std::optional<at::Tensor>& bias) {
    Linear lin;
    lin.N = N;
    lin.K = K;
    lin.u8 = bitquilt_u8::make_weight(codes, scale, scale_zero, K, group);
    lin.u8_int8 = int8;
    TORCH_CHECK(lin.u8->N == N, "codes have ", lin.u8->N, " rows for ", N, " outputs");
    lin.keep = {codes, scale, scale_zero};
    return push(std::move(lin), bias);
  }

  // Route linear `index`'s tokens over its parts: a MoBiRoute router's fc1 [H, K + 1] (+ [H]), fc2 [E - 1, H]
  // (+ [E - 1]) and threshold (a one-value tensor, read at every step so set_precision applies at once).
  void set_router(int64_t index, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                  const at::Tensor& tau) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "unknown linear ", index);
    Linear& lin = linears_[index];
    const int64_t H = w1.size(0), E1 = w2.size(0);
    TORCH_CHECK(w1.dim() == 2 && w1.size(1) == lin.K + 1 && w2.dim() == 2 && w2.size(1) == H && b1.numel() == H &&
                    b2.numel() == E1 && E1 + 1 == static_cast<int64_t>(lin.parts.size()) && tau.numel() == 1,
                "a router needs fc1 [H, K + 1], fc2 [parts - 1, H], their biases and one threshold");
    for (const at::Tensor* t : {&w1, &b1, &w2, &b2, &tau})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "router tensors: contiguous fp32");
    lin.router = bitquilt_router::Router{w1.data_ptr<float>(), b1.data_ptr<float>(), w2.data_ptr<float>(),
                                         b2.data_ptr<float>(), lin.K, H, E1};
    lin.keep.insert(lin.keep.end(), {w1, b1, w2, b2});
    lin.tau = tau;
    lin.hidden.resize(H);
    lin.prefixes.clear();
    for (size_t k = 0; k <= lin.parts.size(); ++k) lin.prefixes.emplace_back(lin.parts.begin(), lin.parts.begin() + k);
  }

  void add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, const std::vector<int64_t>& linears, const at::Tensor& keys,
                 const at::Tensor& values) {
    TORCH_CHECK(linears.size() == 7, "seven linears per layer: q, k, v, o, gate, up, down");
    for (int64_t i : linears) TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(linears_.size()), "unknown linear ", i);
    const int64_t shapes[7][2] = {{H_ * hd_, D_}, {G_ * hd_, D_}, {G_ * hd_, D_}, {D_, H_ * hd_},
                                  {F_, D_},       {F_, D_},       {D_, F_}};
    for (int j = 0; j < 7; ++j) {
      const Linear& lin = linears_[linears[j]];
      TORCH_CHECK(lin.N == shapes[j][0] && lin.K == shapes[j][1], "linear ", j, " of the layer is [", lin.N, ", ",
                  lin.K, "], expected [", shapes[j][0], ", ", shapes[j][1], "]");
    }
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    for (const at::Tensor* cache : {&keys, &values})
      TORCH_CHECK(cache->dim() == 3 && cache->size(0) == G_ && cache->size(1) == max_len_ && cache->size(2) == hd_ &&
                      cache->scalar_type() == at::kFloat && cache->is_contiguous(),
                  "caches: contiguous fp32 [kv_heads, max_len, head_dim]");
    Layer layer{fp32_vector(in_norm, D_, "input norm"), fp32_vector(post_norm, D_, "post-attention norm"),
                q_norm ? fp32_vector(*q_norm, hd_, "q norm") : at::Tensor(),
                k_norm ? fp32_vector(*k_norm, hd_, "k norm") : at::Tensor(),
                linears[0], linears[1], linears[2], linears[3], linears[4], linears[5], linears[6], keys, values};
    layers_.push_back(std::move(layer));
  }

  // The hidden state [D] of the token at position `pos` after every layer (the caches' row pos written).
  at::Tensor step(const at::Tensor& x, int64_t pos) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.numel() == D_, "x: fp32 with ", D_, " values");
    TORCH_CHECK(pos >= 0 && pos < max_len_, "position ", pos, " outside the cache's ", max_len_);
    at::Tensor y = x.contiguous().clone().view({D_});
    float* xs = y.data_ptr<float>();
    for (Layer& layer : layers_) {
      rms_norm(xs, layer.in_norm.data_ptr<float>(), D_, eps_, h_.data());
      attention(layer, pos);
      linears_[layer.o].run(a_.data(), out_.data());
      for (int64_t i = 0; i < D_; ++i) xs[i] += out_[i];
      rms_norm(xs, layer.post_norm.data_ptr<float>(), D_, eps_, h_.data());
      linears_[layer.gate].run(h_.data(), gate_.data());
      linears_[layer.up].run(h_.data(), up_.data());
      silu_times(gate_.data(), up_.data(), F_, h_.data());
      linears_[layer.down].run(h_.data(), out_.data());
      for (int64_t i = 0; i < D_; ++i) xs[i] += out_[i];
    }
    return y;
  }

 private:
  int64_t push(Linear lin, const std::optional<at::Tensor>& bias) {
    if (bias.has_value()) lin.bias = fp32_vector(*bias, lin.N, "bias");
    linears_.push_back(std::move(lin));
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  // u [hd] rotated in place by the tables' row pos
  void rope(float* u, int64_t pos) const {
    const float* c = cos_.data_ptr<float>() + pos * hd_;
    const float* s = sin_.data_ptr<float>() + pos * hd_;
    const int64_t half = hd_ / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float a = u[i], b = u[i + half];
      u[i] = a * c[i] - b * s[i];
      u[i + half] = b * c[i + half] + a * s[i + half];
    }
  }

  // a_ = attention of the token at pos over the cache's rows 0..pos (h_ holds the normed input)
  void attention(Layer& layer, int64_t pos) {
    linears_[layer.q].run(h_.data(), q_.data());
    linears_[layer.k].run(h_.data(), k_.data());
    linears_[layer.v].run(h_.data(), v_.data());
    float* keys = layer.keys.data_ptr<float>();
    float* values = layer.values.data_ptr<float>();
    for (int64_t g = 0; g < G_; ++g) {
      float* kg = k_.data() + g * hd_;
      if (layer.k_norm.defined()) rms_norm(kg, layer.k_norm.data_ptr<float>(), hd_, eps_, kg);
      rope(kg, pos);
      std::copy_n(kg, hd_, keys + (g * max_len_ + pos) * hd_);
      std::copy_n(v_.data() + g * hd_, hd_, values + (g * max_len_ + pos) * hd_);
    }
    const int64_t group = H_ / G_, n = pos + 1;
    for (int64_t h = 0; h < H_; ++h) {
      float* qh = q_.data() + h * hd_;
      if (layer.q_norm.defined()) rms_norm(qh, layer.q_norm.data_ptr<float>(), hd_, eps_, qh);
      rope(qh, pos);
      const float* kh = keys + h / group * max_len_ * hd_;
      const float* vh = values + h / group * max_len_ * hd_;
      float top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) top = std::max(top, scores_[j] = scaling_ * dot(qh, kh + j * hd_, hd_));
      const float total = exp_shifted(scores_.data(), n, top);
      float* ah = a_.data() + h * hd_;
      std::fill_n(ah, hd_, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float p = scores_[j] / total;
        const float* vj = vh + j * hd_;
        for (int64_t i = 0; i < hd_; ++i) ah[i] += p * vj[i];
      }
    }
  }

  int64_t D_, H_, G_, hd_, F_, max_len_;
  float eps_, scaling_;
  at::Tensor cos_, sin_;
  std::vector<Linear> linears_;
  std::vector<Layer> layers_;
  std::vector<float> h_, q_, k_, v_, a_, out_, gate_, up_, scores_;
};

}  // namespace

// Adds the fused decoder class to the extension module (called from its PYBIND11_MODULE).
void register_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<FusedDecoder>(m, "FusedDecoder", "every decoder layer of one decoded token in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, const at::Tensor&,
                    const at::Tensor&>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("scaling"), py::arg("cos"), py::arg("sin"))
      .def("add_linear", &FusedDecoder::add_linear, py::arg("planes"), py::arg("coefs"), py::arg("ks"),
           py::arg("uniforms"), py::arg("block"), py::arg("group"), py::arg("N"), py::arg("K"),
           py::arg("dense") = py::none(), py::arg("bias") = py::none(),
           py::arg("residual") = std::vector<at::Tensor>())
      .def("add_q4_linear", &FusedDecoder::add_q4_linear, py::arg("w"), py::arg("sz"), py::arg("group"),
           py::arg("bits"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none())
      .def("add_u8_linear", &FusedDecoder::add_u8_linear, py::arg("codes"), py::arg("scale"), py::arg("scale_zero"),
           py::arg("group"), py::arg("N"), py::arg("K"), py::arg("int8"), py::arg("bias") = py::none())
      .def("set_router", &FusedDecoder::set_router, py::arg("index"), py::arg("w1"), py::arg("b1"), py::arg("w2"),
           py::arg("b2"), py::arg("tau"))
      .def("add_layer", &FusedDecoder::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("linears"), py::arg("keys"), py::arg("values"))
      .def("step", &FusedDecoder::step, py::arg("x"), py::arg("pos"));
}
