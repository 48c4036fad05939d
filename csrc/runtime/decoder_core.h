// The layer math of a Llama-like decoder over a static KV cache, shared by the torch extension's fused decode
// step (decode_step.cpp) and the standalone runtime's library (standalone.cpp). For T tokens at positions
// pos..pos+T-1, hidden states x (fp32 [T, D]), a layer is, token by token:
//
//   h = RMSNorm(x) * w_in                                  (mean of squares in fp32, then rsqrt(. + eps))
//   q = W_q h + b_q,  k = W_k h + b_k,  v = W_v h + b_v     (biases optional: Qwen2)
//   q, k per head: RMSNorm over head_dim * w_qn / w_kn      (optional: Qwen3)
//   q, k per head: RoPE, out = u * cos[p] + rotate_half(u) * sin[p],
//                  rotate_half(u) = [-u[d/2:], u[:d/2]]     (cos/sin tables [max_len, head_dim] from the caller)
//   K[g, p] = k_g, V[g, p] = v_g                            (the static cache, [kv_heads, max_len, head_dim])
//   a_h = sum_{j <= p} softmax_j(scaling * <q_h, K[g(h), j]>) V[g(h), j],   g(h) = h / (heads / kv_heads)
//   x = x + W_o a
//   h = RMSNorm(x) * w_post
//   x = x + W_down (silu(W_gate h) * (W_up h))
//
// The linears are the caller's: `run(index, x, T, y)` computes y [T, N] = x [T, K] W_index^T (+ its bias), every
// token's rows contiguous. A token attends to the cache's rows up to its own position (causal for a prompt).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/avx2_simd.h"
#include "common/parallel.h"
#include "runtime/attention_tiles.h"

namespace bitquilt_decoder {

using bitquilt_simd::dot;
using bitquilt_simd::exp8;
using bitquilt_simd::hsum8;

inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i], 8 at a time (exp8).
inline void silu_times(const float* gate, const float* up, int64_t n, float* out) {
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
inline float exp_shifted(float* s, int64_t n, float top) {
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

struct Dims {
  int64_t D, H, G, hd, F, max_len;  // hidden, heads, kv heads, head dim, intermediate, cache positions
  float eps, scaling;
  const float *cos, *sin;  // [max_len, hd]
};

// A layer's norm weights (q_norm / k_norm null unless the family has them), the indices of its q, k, v, o, gate,
// up and down linears, and its caches [G, max_len, hd] (written in place).
struct Layer {
  const float *in_norm, *post_norm, *q_norm, *k_norm;
  int64_t q, k, v, o, gate, up, down;
  float *keys, *values;
};

// Why the dims do not make a decoder; empty if they do.
inline std::string dims_error(const Dims& d) {
  if (d.D <= 0 || d.H <= 0 || d.G <= 0 || d.hd <= 0 || d.F <= 0 || d.max_len <= 0) return "sizes must be positive";
  if (d.H % d.G || d.hd % 2) return "heads must be a multiple of kv_heads, head_dim even";
  return "";
}

// Why a layer's linears q, k, v, o, gate, up, down of N[j] outputs and K[j] inputs do not fit the dims; empty if
// they do.
inline std::string linears_error(const Dims& d, const int64_t N[7], const int64_t K[7]) {
  const int64_t shapes[7][2] = {{d.H * d.hd, d.D}, {d.G * d.hd, d.D}, {d.G * d.hd, d.D}, {d.D, d.H * d.hd},
                                {d.F, d.D},        {d.F, d.D},        {d.D, d.F}};
  static const char* names[7] = {"q", "k", "v", "o", "gate", "up", "down"};
  for (int j = 0; j < 7; ++j)
    if (N[j] != shapes[j][0] || K[j] != shapes[j][1])
      return std::string("the layer's ") + names[j] + " linear is [" + std::to_string(N[j]) + ", " +
             std::to_string(K[j]) + "], expected [" + std::to_string(shapes[j][0]) + ", " +
             std::to_string(shapes[j][1]) + "]";
  return "";
}

class Decoder {
 public:
  explicit Decoder(const Dims& d) : d_(d) {}

  const Dims& dims() const { return d_; }
  void add_layer(const Layer& layer) { layers_.push_back(layer); }
  size_t layers() const { return layers_.size(); }

  // x [T, D] of the tokens at positions pos..pos+T-1 through every layer, in place (the caches' rows written);
  // pos + T <= max_len. A prompt goes through in blocks of kPrompt tokens, each through every layer before the
  // next (whose tokens attend to its cached keys): the work per token, and the activations' memory, stay those of
  // one block however long the prompt.
  template <typename Run>
  void forward(float* x, int64_t T, int64_t pos, const Run& run) {
    for (int64_t t0 = 0; t0 < T; t0 += kPrompt) forward_block(x + t0 * d_.D, std::min(kPrompt, T - t0), pos + t0, run);
  }

 private:
  static constexpr int64_t kPrompt = 256;  // prompt tokens per pass through the layers
  static constexpr int64_t kBlock = 16;    // query tokens per attention task

  template <typename Run>
  void forward_block(float* x, int64_t T, int64_t pos, const Run& run) {
    const int64_t D = d_.D, F = d_.F, q_size = d_.H * d_.hd, kv_size = d_.G * d_.hd;
    fit(h_, T * std::max(D, F));
    fit(q_, T * q_size);
    fit(k_, T * kv_size);
    fit(v_, T * kv_size);
    fit(a_, T * q_size);
    fit(out_, T * D);
    fit(gate_, T * F);
    fit(up_, T * F);
    for (const Layer& layer : layers_) {
      for (int64_t t = 0; t < T; ++t) rms_norm(x + t * D, layer.in_norm, D, d_.eps, h_.data() + t * D);
      run(layer.q, h_.data(), T, q_.data());
      run(layer.k, h_.data(), T, k_.data());
      run(layer.v, h_.data(), T, v_.data());
      attention(layer, T, pos);
      run(layer.o, a_.data(), T, out_.data());
      for (int64_t i = 0; i < T * D; ++i) x[i] += out_[i];
      for (int64_t t = 0; t < T; ++t) rms_norm(x + t * D, layer.post_norm, D, d_.eps, h_.data() + t * D);
      run(layer.gate, h_.data(), T, gate_.data());
      run(layer.up, h_.data(), T, up_.data());
      silu_times(gate_.data(), up_.data(), T * F, h_.data());
      run(layer.down, h_.data(), T, out_.data());
      for (int64_t i = 0; i < T * D; ++i) x[i] += out_[i];
    }
  }

  static void fit(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }

  // u [hd] rotated in place by the tables' row p
  void rope(float* u, int64_t p) const {
    const float* c = d_.cos + p * d_.hd;
    const float* s = d_.sin + p * d_.hd;
    const int64_t half = d_.hd / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float a = u[i], b = u[i + half];
      u[i] = a * c[i] - b * s[i];
      u[i + half] = b * c[i + half] + a * s[i + half];
    }
  }

  // a_ = attention of the T tokens at pos.. over the cache (q_, k_, v_ hold their projections). The queries go in
  // blocks of kBlock tokens: a block's rows of one KV head (its tokens times the query heads that share the head)
  // read each key and value once for all of them (attention_tiles.h), their scores in one row each, soft-maxed
  // over the row's own keys (causal).
  void attention(const Layer& layer, int64_t T, int64_t pos) {
    const int64_t hd = d_.hd, G = d_.G, H = d_.H, L = d_.max_len;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) {
        float* kg = k_.data() + (t * G + g) * hd;
        if (layer.k_norm != nullptr) rms_norm(kg, layer.k_norm, hd, d_.eps, kg);
        rope(kg, pos + t);
        std::copy_n(kg, hd, layer.keys + (g * L + pos + t) * hd);
        std::copy_n(v_.data() + (t * G + g) * hd, hd, layer.values + (g * L + pos + t) * hd);
      }
    const int64_t group = H / G, blocks = (T + kBlock - 1) / kBlock;
    // (block, KV head) tasks: a prompt's spread over the threads, a decoded token's heads run in turn. The blocks
    // are taken first, last, second, second to last...: a block attends to all before it, so contiguous chunks of
    // that order hold as many keys each.
    bitquilt_par::parallel_for(0, blocks * G, T > 1 ? 1 : G, [&](int64_t k0, int64_t k1) {
      const int64_t most = std::min(T, kBlock) * group, width = pos + T;
      std::vector<float> scores(most * width);
      std::vector<const float*> q(most);
      std::vector<float*> s(most), out(most);
      std::vector<int64_t> n(most);
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t r = k / G, b = r % 2 ? blocks - 1 - r / 2 : r / 2, g = k % G;
        const int64_t t0 = b * kBlock, t1 = std::min(T, t0 + kBlock), rows = (t1 - t0) * group;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const int64_t row = (t - t0) * group + h - g * group, i = t * H + h;
            float* qh = q_.data() + i * hd;
            if (layer.q_norm != nullptr) rms_norm(qh, layer.q_norm, hd, d_.eps, qh);
            rope(qh, pos + t);
            q[row] = qh;
            s[row] = scores.data() + row * width;
            out[row] = a_.data() + i * hd;
            n[row] = pos + t + 1;
          }
        const float* kh = layer.keys + g * L * hd;
        const float* vh = layer.values + g * L * hd;
        bitquilt_attention::scores_rows(q.data(), rows, kh, pos + t1, hd, d_.scaling, s.data());
        for (int64_t row = 0; row < rows; ++row) {
          float* sr = s[row];
          const float inv = 1.0f / exp_shifted(sr, n[row], bitquilt_attention::max_of(sr, n[row]));
          for (int64_t j = 0; j < n[row]; ++j) sr[j] *= inv;
        }
        bitquilt_attention::mix_rows(s.data(), n.data(), rows, vh, hd, out.data());
      }
    });
  }

  Dims d_;
  std::vector<Layer> layers_;
  std::vector<float> h_, q_, k_, v_, a_, out_, gate_, up_;
};

}  // namespace bitquilt_decoder
