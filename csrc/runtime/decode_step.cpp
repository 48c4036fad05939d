// A decode step through every decoder layer of a Llama-like model in one call, one token for each of B sequences
// (each its own KV cache and position), used by bitquilt.runtime.fused (built by bitquilt.runtime.lean).
//
// A batch-1 decode step of a small model run module by module spends more time in the framework's
// per-op overhead (hundreds of views, slices and element-wise ops per token) than in
// its matmuls. The layer math is decoder_core.h's (shared with the standalone runtime); this file holds the
// linears and the torch bindings. A step with B sequences calls each linear once for all B rows, so its weight is
// read once per step whatever B; every kernel here computes a row as it would alone, so a sequence's results do
// not depend on what runs beside it (one sequence is the case B = 1).
//
// Every W is a sum of bit-plane packed parts run by the lookup-table kernel (lut_parts.h: one part for a
// bitplane or uniform format, the first k slices for a MoBiQuant checkpoint in static mode), a 4- or 2-bit
// uniform weight run on int8-rounded activations (q4_int8.h, when int8 activations are enabled), an 8-bit
// uniform weight run by the 8-bit GEMV (uniform8.h), or a dense fp32 matrix (dense_rows.h); packed parts may carry a
// MosaicQuant sparse residual, added inside the lookup-table kernel (sparse_residual.h). A routed MoBiQuant
// linear first counts the token's slices with its router and runs that prefix of its parts (routed_parts.h; on
// int8-rounded activations when those are enabled), at its own threshold or, per row, at the one the step is given
// (a batch mixing precisions).
// The same math as the eager modules in another fp32 order; tested against them (tests/test_lean.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/dense_rows.h"
#include "kernels/lut_parts.h"
#include "kernels/q4_int8.h"
#include "kernels/routed_parts.h"
#include "kernels/uniform8.h"
#include "runtime/decoder_core.h"

namespace {

struct Linear {
  std::optional<bitquilt_q4::Weight> q4;  // 4- or 2-bit codes times int8 activations, or:
  std::optional<bitquilt_u8::Weight> u8;  // 8-bit codes widened in registers (u8_int8: on int8 activations), or:
  bool u8_int8 = false;
  std::vector<bitquilt_lut::Part> parts;  // packed parts summed; if neither: dense
  bitquilt_sparse::Residual residual;     // with parts: a sparse 4-bit residual added tile by tile (MosaicQuant)
  std::vector<at::Tensor> keep;           // the tensors the parts point into
  at::Tensor dense;                       // fp32 [N, K] when there are no parts
  at::Tensor bias;                        // fp32 [N] or undefined
  std::optional<bitquilt_routed::RoutedParts> routed;  // the parts routed per token (MoBiQuant), or not
  at::Tensor tau;                         // the router's threshold (fp32 scalar, read at every call)
  mutable std::vector<float> taus;        // a call's thresholds, one per row
  int64_t N = 0, K = 0;

  // y [T, N] = x [T, K] W^T (+ b), each row as it comes out alone (tokens run beside it change nothing): every
  // kernel's rows are independent; a routed linear runs each token's own prefix, at thresholds[t] where that is a
  // number (else its own threshold), adding the bits it used to bits[t] (routed_parts.h) where bits is given.
  void run(const float* x, int64_t T, float* y, const double* thresholds = nullptr, double* bits = nullptr) const {
    if (routed) {
      taus.resize(T);
      for (int64_t t = 0; t < T; ++t)
        taus[t] = thresholds != nullptr && !std::isnan(thresholds[t]) ? static_cast<float>(thresholds[t])
                                                                      : *tau.data_ptr<float>();
      routed->run(x, T, N, taus.data(), y, bits);
    } else if (q4) {
      bitquilt_q4::matmul_into(x, T, *q4, y);
    } else if (u8) {
      (u8_int8 ? bitquilt_u8::gemv_int8_into : bitquilt_u8::gemv_into)(x, T, *u8, y);
    } else if (parts.empty()) {
      bitquilt_dense::rows_into(x, T, dense.data_ptr<float>(), N, K, y);
    } else {
      bitquilt_lut::lut_parts_into(x, T, parts, N, residual, y);
    }
    if (bias.defined()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < N; ++i) y[t * N + i] += b[i];
    }
  }
};

// A sequence's KV cache as the fused step takes it: the decoder's view of its per-layer tensors, which it keeps.
struct FusedCache {
  bitquilt_decoder::Cache cache;
  std::vector<at::Tensor> keep;
};

at::Tensor fp32_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what, ": contiguous fp32 [",
              n, "]");
  return t;
}

class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scaling, const at::Tensor& cos, const at::Tensor& sin, bool gelu, double score_cap)
      : core_(dims(hidden, heads, kv_heads, head_dim, intermediate, eps, scaling, cos, sin, gelu, score_cap)),
        cos_(cos),
        sin_(sin) {}

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

  // Route linear `index`'s tokens over its parts (each slice_bits[p] bits per weight): a MoBiRoute router's fc1
  // [H, K + 1] (+ [H]), fc2 [E - 1, H] (+ [E - 1]) and threshold (a one-value tensor, read at every step so
  // set_precision applies at once); with int8, the slices run on int8-rounded activations (plane_int8.h).
  void set_router(int64_t index, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                  const at::Tensor& tau, const std::vector<double>& slice_bits, bool int8) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "unknown linear ", index);
    Linear& lin = linears_[index];
    const int64_t H = w1.size(0), E1 = w2.size(0);
    const std::string error = bitquilt_routed::router_error(lin.K, static_cast<int64_t>(lin.parts.size()), H,
                                                            w1.dim() == 2 ? w1.size(1) : -1, E1,
                                                            w2.dim() == 2 ? w2.size(1) : -1);
    TORCH_CHECK(error.empty() && b1.numel() == H && b2.numel() == E1 && tau.numel() == 1 &&
                    slice_bits.size() == lin.parts.size(),
                error.empty() ? "a router needs biases [H] and [E - 1], one threshold and each slice's bits" : error);
    for (const at::Tensor* t : {&w1, &b1, &w2, &b2, &tau})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "router tensors: contiguous fp32");
    if (!lin.routed) routed_weights_ += static_cast<double>(lin.N * lin.K);
    lin.routed.emplace(bitquilt_router::Router{w1.data_ptr<float>(), b1.data_ptr<float>(), w2.data_ptr<float>(),
                                               b2.data_ptr<float>(), lin.K, H, E1},
                       lin.parts, slice_bits, int8);
    lin.keep.insert(lin.keep.end(), {w1, b1, w2, b2});
    lin.tau = tau;
  }

  void add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, const std::vector<int64_t>& linears,
                 const std::optional<at::Tensor>& attn_out_norm, const std::optional<at::Tensor>& mlp_out_norm,
                 int64_t window, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
    TORCH_CHECK(linears.size() == 7, "seven linears per layer: q, k, v, o, gate, up, down");
    int64_t N[7], K[7];
    for (int j = 0; j < 7; ++j) {
      TORCH_CHECK(linears[j] >= 0 && linears[j] < static_cast<int64_t>(linears_.size()), "unknown linear ",
                  linears[j]);
      N[j] = linears_[linears[j]].N;
      K[j] = linears_[linears[j]].K;
    }
    const std::string error = bitquilt_decoder::linears_error(core_.dims(), N, K);
    TORCH_CHECK(error.empty(), error);
    const int64_t D = core_.dims().D, hd = core_.dims().hd;
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(), "the branches' output norms come together");
    TORCH_CHECK(cos.has_value() == sin.has_value(), "a layer's cos and sin tables come together");
    TORCH_CHECK(window >= 0, "a window of ", window, " positions");
    const auto optional_vector = [&](const std::optional<at::Tensor>& t, int64_t n, const char* what) -> float* {
      if (!t) return nullptr;
      keep_.push_back(fp32_vector(*t, n, what));
      return keep_.back().data_ptr<float>();
    };
    const int64_t H = core_.dims().H, G = core_.dims().G;
    const bool whole = q_norm && q_norm->numel() == H * hd && H * hd != hd;  // OLMoE's norms over the projection
    bitquilt_decoder::Layer layer{
        fp32_vector(in_norm, D, "input norm").data_ptr<float>(),
        fp32_vector(post_norm, D, "post-attention norm").data_ptr<float>(),
        optional_vector(q_norm, whole ? H * hd : hd, "q norm"),
        optional_vector(k_norm, whole ? G * hd : hd, "k norm"),
        linears[0], linears[1], linears[2], linears[3], linears[4], linears[5], linears[6]};
    layer.attn_out_norm = optional_vector(attn_out_norm, D, "attention output norm");
    layer.mlp_out_norm = optional_vector(mlp_out_norm, D, "MLP output norm");
    layer.window = window;
    layer.whole_qk_norm = whole;
    if (cos) {
      check_tables(*cos, *sin, core_.dims().hd, core_.dims().max_len);
      keep_.insert(keep_.end(), {*cos, *sin});
      layer.cos = cos->data_ptr<float>();
      layer.sin = sin->data_ptr<float>();
    }
    keep_.insert(keep_.end(), {in_norm, post_norm});
    core_.add_layer(layer);
  }

  // The last layer's MLP as a mixture of experts: `router` a linear [E, D], expert e's linears gates[e], ups[e],
  // downs[e] of the layer's gate, up and down shapes, each token's `top_k` (renormalised where `renormalize`).
  void set_experts(int64_t router, const std::vector<int64_t>& gates, const std::vector<int64_t>& ups,
                   const std::vector<int64_t>& downs, int64_t top_k, bool renormalize) {
    TORCH_CHECK(core_.layers() > 0, "experts belong to a layer: add it first");
    const auto E = static_cast<int64_t>(gates.size());
    TORCH_CHECK(E > 0 && ups.size() == gates.size() && downs.size() == gates.size() && top_k >= 1 && top_k <= E,
                "experts: as many gates, ups and downs, and 1 <= top_k <= experts");
    const auto& d = core_.dims();
    const auto check = [&](int64_t i, int64_t N, int64_t K, const char* what) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(linears_.size()) && linears_[i].N == N && linears_[i].K == K,
                  what, " linear ", i, " is not [", N, ", ", K, "]");
    };
    check(router, E, d.D, "router");
    for (int64_t e = 0; e < E; ++e) {
      check(gates[e], d.F, d.D, "expert gate");
      check(ups[e], d.F, d.D, "expert up");
      check(downs[e], d.D, d.F, "expert down");
    }
    core_.set_experts({router, top_k, renormalize, gates, ups, downs});
  }

  // A sequence's cache over its per-layer keys and values, each contiguous fp32 [kv_heads, length, head_dim] (one
  // length, at most the RoPE tables'), written in place by the steps it takes part in.
  FusedCache cache(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) const {
    const auto& d = core_.dims();
    TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "keys and values for every layer");
    FusedCache c;
    c.cache.length = keys[0].dim() == 3 ? keys[0].size(1) : 0;
    for (size_t l = 0; l < keys.size(); ++l)
      for (const at::Tensor* t : {&keys[l], &values[l]}) {
        TORCH_CHECK(t->dim() == 3 && t->size(0) == d.G && t->size(1) == c.cache.length && t->size(2) == d.hd &&
                        t->scalar_type() == at::kFloat && t->is_contiguous(),
                    "caches: contiguous fp32 [kv_heads, length, head_dim], one length");
        (t == &keys[l] ? c.cache.keys : c.cache.values).push_back(t->data_ptr<float>());
        c.keep.push_back(*t);
      }
    const std::string error = core_.cache_error(c.cache);
    TORCH_CHECK(error.empty(), error);
    return c;
  }

  // Linear `index` as the LM head (vocab outputs, hidden inputs), after the final RMSNorm of weight `norm` [hidden]
  // (the layers' epsilon).
  void set_head(int64_t index, const at::Tensor& norm) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "unknown linear ", index);
    const int64_t D = core_.dims().D;
    TORCH_CHECK(linears_[index].K == D, "the head takes ", linears_[index].K, " inputs, not the hidden size ", D);
    final_norm_ = fp32_vector(norm, D, "final norm");
    head_ = index;
  }

  // The logits [B, vocab] of hidden states x [B, D]: the final norm and the head, each row as it comes out alone.
  at::Tensor logits(const at::Tensor& x) {
    TORCH_CHECK(head_ >= 0, "no head: set_head first");
    const int64_t D = core_.dims().D;
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == D, "x: fp32 [B, ", D, "]");
    const at::Tensor xc = x.contiguous();
    const int64_t B = xc.size(0);
    normed_.resize(B * D);
    for (int64_t b = 0; b < B; ++b)
      bitquilt_decoder::rms_norm(xc.data_ptr<float>() + b * D, final_norm_.data_ptr<float>(), D, core_.dims().eps,
                                 normed_.data() + b * D);
    at::Tensor y = at::empty({B, linears_[head_].N}, xc.options());
    linears_[head_].run(normed_.data(), B, y.data_ptr<float>());
    return y;
  }

  // The hidden states [R, D] of B sequences' rows after every layer: sequence b's counts[b] tokens (1 each when
  // counts is empty; R their sum; x holds sequence 0's rows, then sequence 1's, ...) at positions[b].. of
  // caches[b] (those rows written): one call per linear for all R rows, so a decode step that also reads a prompt
  // chunk reads each weight once; each row as it comes out alone. Routed linears route sequence b's rows at
  // thresholds[b] where given and a number (else at their own threshold); step_bits() then holds the bits per
  // weight each row used.
  at::Tensor step(const at::Tensor& x, const std::vector<int64_t>& positions, const std::vector<FusedCache*>& caches,
                  const std::vector<double>& thresholds, const std::vector<int64_t>& counts) {
    const int64_t D = core_.dims().D, B = static_cast<int64_t>(positions.size());
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == B, "one cache per position");
    TORCH_CHECK(counts.empty() || static_cast<int64_t>(counts.size()) == B, "no counts or one per sequence");
    TORCH_CHECK(thresholds.empty() || static_cast<int64_t>(thresholds.size()) == B, "no threshold or one per sequence");
    std::vector<bitquilt_decoder::Span> spans(B);
    int64_t R = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(caches[b] != nullptr, "a sequence without a cache");
      spans[b] = {&caches[b]->cache, positions[b], counts.empty() ? 1 : counts[b]};
      R += spans[b].T;
    }
    const std::string error = core_.spans_error(spans.data(), spans.size());
    TORCH_CHECK(error.empty(), error);
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == R && x.size(1) == D, "x: fp32 [", R,
                ", ", D, "] for the sequences' rows");
    std::vector<double> row_taus;  // the thresholds per row
    if (!thresholds.empty())
      for (int64_t b = 0; b < B; ++b) row_taus.insert(row_taus.end(), spans[b].T, thresholds[b]);
    at::Tensor y = x.contiguous().clone();
    const double* taus = row_taus.empty() ? nullptr : row_taus.data();
    bits_.assign(R, 0.0);
    core_.forward_spans(y.data_ptr<float>(), spans.data(), spans.size(),
                        [this, taus](int64_t i, const float* in, int64_t T, float* out) {
                          linears_[i].run(in, T, out, taus, bits_.data());
                        });
    return y;
  }

  // The bits per weight each row of the last step used in the routed linears (weighted by their sizes); empty
  // without routed linears.
  std::vector<double> step_bits() const {
    if (routed_weights_ == 0) return {};
    std::vector<double> out(bits_.size());
    for (size_t b = 0; b < bits_.size(); ++b) out[b] = bits_[b] / routed_weights_;
    return out;
  }

 private:
  // cos, sin: contiguous fp32 [max_len, head_dim] (max_len < 0: any length)
  static void check_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim, int64_t max_len) {
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim && (max_len < 0 || cos.size(0) == max_len) &&
                    cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                    sin.scalar_type() == at::kFloat && sin.is_contiguous(),
                "cos, sin: contiguous fp32 [max_len, head_dim], every layer's as long");
  }

  static bitquilt_decoder::Dims dims(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t intermediate, double eps, double scaling, const at::Tensor& cos,
                                     const at::Tensor& sin, bool gelu, double score_cap) {
    check_tables(cos, sin, head_dim, -1);
    const bitquilt_decoder::Dims d{hidden,        heads,  kv_heads, head_dim, intermediate, cos.size(0),
                                   static_cast<float>(eps), static_cast<float>(scaling), cos.data_ptr<float>(),
                                   sin.data_ptr<float>(), gelu, static_cast<float>(score_cap)};
    const std::string error = bitquilt_decoder::dims_error(d);
    TORCH_CHECK(error.empty(), error);
    return d;
  }

  int64_t push(Linear lin, const std::optional<at::Tensor>& bias) {
    if (bias.has_value()) lin.bias = fp32_vector(*bias, lin.N, "bias");
    linears_.push_back(std::move(lin));
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  bitquilt_decoder::Decoder core_;
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> keep_;  // the tensors the layers point into
  std::vector<Linear> linears_;
  int64_t head_ = -1;      // the LM head's linear, or none
  at::Tensor final_norm_;  // the norm before it
  std::vector<float> normed_;
  double routed_weights_ = 0;  // the routed linears' weights, N * K summed
  std::vector<double> bits_;   // per row of the last step: its routed linears' bits times their weights, summed
};

}  // namespace

// Adds the fused decoder class to the extension module (called from its PYBIND11_MODULE).
void register_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<FusedCache>(m, "FusedCache", "a sequence's KV cache as the fused step takes it");
  py::class_<FusedDecoder>(m, "FusedDecoder", "every decoder layer of a decode step, a token or a prompt chunk per sequence, in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, const at::Tensor&,
                    const at::Tensor&, bool, double>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("scaling"), py::arg("cos"), py::arg("sin"), py::arg("gelu") = false,
           py::arg("score_cap") = 0.0)
      .def("add_linear", &FusedDecoder::add_linear, py::arg("planes"), py::arg("coefs"), py::arg("ks"),
           py::arg("uniforms"), py::arg("block"), py::arg("group"), py::arg("N"), py::arg("K"),
           py::arg("dense") = py::none(), py::arg("bias") = py::none(),
           py::arg("residual") = std::vector<at::Tensor>())
      .def("add_q4_linear", &FusedDecoder::add_q4_linear, py::arg("w"), py::arg("sz"), py::arg("group"),
           py::arg("bits"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none())
      .def("add_u8_linear", &FusedDecoder::add_u8_linear, py::arg("codes"), py::arg("scale"), py::arg("scale_zero"),
           py::arg("group"), py::arg("N"), py::arg("K"), py::arg("int8"), py::arg("bias") = py::none())
      .def("set_router", &FusedDecoder::set_router, py::arg("index"), py::arg("w1"), py::arg("b1"), py::arg("w2"),
           py::arg("b2"), py::arg("tau"), py::arg("slice_bits"), py::arg("int8"))
      .def("add_layer", &FusedDecoder::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("linears"), py::arg("attn_out_norm") = py::none(),
           py::arg("mlp_out_norm") = py::none(), py::arg("window") = 0, py::arg("cos") = py::none(),
           py::arg("sin") = py::none())
      .def("set_experts", &FusedDecoder::set_experts, py::arg("router"), py::arg("gates"), py::arg("ups"),
           py::arg("downs"), py::arg("top_k"), py::arg("renormalize"))
      .def("cache", &FusedDecoder::cache, py::arg("keys"), py::arg("values"))
      .def("set_head", &FusedDecoder::set_head, py::arg("index"), py::arg("norm"))
      // the GIL is released while a step or the head runs (no Python object is touched there), so a server's event
      // loop thread answers and streams meanwhile instead of waiting for the whole step
      .def("logits", &FusedDecoder::logits, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("step", &FusedDecoder::step, py::arg("x"), py::arg("positions"), py::arg("caches"),
           py::arg("thresholds") = std::vector<double>(), py::arg("counts") = std::vector<int64_t>(),
           py::call_guard<py::gil_scoped_release>())
      .def("step_bits", &FusedDecoder::step_bits);
}
