// The layer math of a Llama-like decoder over static KV caches, shared by the torch extension's fused decode
// step (decode_step.cpp) and the standalone runtime's library (standalone.cpp). For T tokens of a sequence at
// positions pos..pos+T-1, hidden states x (fp32 [T, D]), a layer is, token by token:
//
//   h = RMSNorm(x) * w_in                                  (mean of squares in fp32, then rsqrt(. + eps))
//   q = W_q h + b_q,  k = W_k h + b_k,  v = W_v h + b_v     (biases optional: Qwen2)
//   q, k per head: RMSNorm over head_dim * w_qn / w_kn      (optional: Qwen3)
//   q, k per head: RoPE, out = u * cos[p] + rotate_half(u) * sin[p],
//                  rotate_half(u) = [-u[d/2:], u[:d/2]]     (cos/sin tables [max_len, head_dim] from the caller)
//   K[g, p] = k_g, V[g, p] = v_g                            (the sequence's cache, [kv_heads, length, head_dim])
//   a_h = sum_{j <= p} softmax_j(scaling * <q_h, K[g(h), j]>) V[g(h), j],   g(h) = h / (heads / kv_heads)
//                  (a layer with a window W: over p - W < j <= p only; Gemma 2: each score s as c tanh(s / c))
//   x = x + W_o a                                           (Gemma: x + RMSNorm(W_o a) * w_attn_out)
//   h = RMSNorm(x) * w_post
//   x = x + W_down (act(W_gate h) * (W_up h))               (Gemma: the sum's second term RMSNorm'd by w_mlp_out)
//
// A mixture-of-experts layer (Mixtral, Qwen3-MoE, OLMoE) replaces the last line: the router's logits W_r h give
// each token p = softmax over the E experts, its top_k experts (the lower index first among equal p) weights p_e
// (divided by their sum where the family renormalises), and x = x + sum_e p_e W_down,e (silu(W_gate,e h) *
// (W_up,e h)) over them in ascending e; each expert's linears run once for all the rows routed to it. OLMoE norms q
// and k over the whole projection, before the split into heads.
//
// act is silu(u) = u / (1 + e^-u), or Gemma's GELU with the tanh approximation, 0.5 u (1 + tanh(z)) with
// z = sqrt(2/pi) (u + 0.044715 u^3), computed as u / (1 + e^-2z) (the same function). Gemma's norms scale by
// (1 + w): the caller passes the vectors they multiply by. Each layer may bring its own RoPE tables (Gemma's
// sliding and global layers rotate by different bases).
//
// The linears are the caller's: `run(index, x, R, y)` computes y [R, N] = x [R, K] W_index^T (+ its bias), every
// token's rows contiguous. Several sequences (spans, each its own cache and position) go through together: their
// rows in one call per linear, so a weight is read once for all of them, attention per sequence over its own
// cache. A token attends to its cache's rows up to its own position (causal for a prompt). Everything but the
// linears is computed row by row the same whatever rows run beside it; so, with linears whose rows are
// independent of each other (the CPU kernels'), a sequence's results do not depend on what runs with it.

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

// out[i] = act(gate[i]) * up[i] = gate[i] / (1 + e^-a(gate[i])) * up[i], 8 at a time (exp8), where a(u) = u for
// SiLU and 2 sqrt(2/pi) (u + 0.044715 u^3) for GELU-tanh (`gelu`).
inline void gated(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  constexpr float c1 = 1.5957691216057308f, c3 = 0.0713548162726009f;  // 2 sqrt(2/pi), times 0.044715
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 a = gelu ? _mm256_mul_ps(g, _mm256_add_ps(_mm256_set1_ps(c1),
                                                           _mm256_mul_ps(_mm256_set1_ps(c3), _mm256_mul_ps(g, g))))
                          : g;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i], a = gelu ? g * (c1 + c3 * g * g) : g;
    out[i] = g / (1.0f + std::exp(-a)) * up[i];
  }
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
  bool gelu = false;       // the MLP's activation: GELU-tanh (Gemma), else SiLU
  float score_cap = 0.0f;  // attention scores soft-capped to c tanh(s / c) where c > 0 (Gemma 2)
};

// A layer's norm weights (q_norm / k_norm null unless the family has them) and the indices of its q, k, v, o, gate,
// up and down linears; Gemma's norms of the attention's and the MLP's outputs (else null), its window (0: none) and
// its own RoPE tables (null: the dims').
struct Layer {
  const float *in_norm, *post_norm, *q_norm, *k_norm;
  int64_t q, k, v, o, gate, up, down;
  const float *attn_out_norm = nullptr, *mlp_out_norm = nullptr;
  int64_t window = 0;
  const float *cos = nullptr, *sin = nullptr;
  bool whole_qk_norm = false;  // q_norm / k_norm over the whole projection [H hd] / [G hd] (OLMoE)
};

// A layer's experts in place of its gated MLP (router < 0: none): the router's linear [E, D] and each expert's gate,
// up and down linears.
struct Experts {
  int64_t router = -1, top_k = 0;
  bool renormalize = false;
  std::vector<int64_t> gate, up, down;
};

// One sequence's KV cache: per layer, its keys and values [G, length, hd], written in place.
struct Cache {
  std::vector<float*> keys, values;
  int64_t length = 0;
};

// T tokens of one sequence, at positions pos..pos+T-1 of its cache.
struct Span {
  const Cache* cache;
  int64_t pos, T;
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
  void add_layer(const Layer& layer) {
    layers_.push_back(layer);
    experts_.emplace_back();
  }
  // The last layer's MLP becomes `experts` (the caller checks their linears' shapes).
  void set_experts(Experts experts) { experts_.back() = std::move(experts); }
  size_t layers() const { return layers_.size(); }

  // Why `c` is no cache for this decoder's layers; empty if it is one.
  std::string cache_error(const Cache& c) const {
    if (c.keys.size() != layers_.size() || c.values.size() != layers_.size())
      return "a cache holds keys and values for each of the " + std::to_string(layers_.size()) + " layers";
    if (c.length <= 0 || c.length > d_.max_len)
      return "a cache of " + std::to_string(c.length) + " positions; 1 to " + std::to_string(d_.max_len) + " fit";
    for (size_t l = 0; l < layers_.size(); ++l)
      if (c.keys[l] == nullptr || c.values[l] == nullptr) return "a cache without layer " + std::to_string(l);
    return "";
  }

  // Why `spans` cannot run together: each needs a cache of its own (cache_error) and 1 to length - pos tokens
  // from a position pos >= 0; empty if they can.
  std::string spans_error(const Span* spans, size_t n) const {
    if (n == 0) return "no sequences";
    for (size_t s = 0; s < n; ++s) {
      const Span& sp = spans[s];
      if (sp.cache == nullptr) return "a sequence without a cache";
      const std::string error = cache_error(*sp.cache);
      if (!error.empty()) return error;
      if (sp.T <= 0 || sp.pos < 0 || sp.pos + sp.T > sp.cache->length)
        return "positions " + std::to_string(sp.pos) + ".." + std::to_string(sp.pos + sp.T) + " outside the cache's " +
               std::to_string(sp.cache->length);
      for (size_t o = 0; o < s; ++o)
        if (spans[o].cache == sp.cache) return "a cache given twice";
    }
    return "";
  }

  // x [T, D] of one sequence's tokens at positions pos..pos+T-1 through every layer, in place (its cache's rows
  // written). A prompt goes through in blocks of kPrompt tokens, each through every layer before the next (whose
  // tokens attend to its cached keys): the work per token, and the activations' memory, stay those of one block
  // however long the prompt. The caller checks the span (spans_error).
  template <typename Run>
  void forward(float* x, const Cache& cache, int64_t pos, int64_t T, const Run& run) {
    for (int64_t t0 = 0; t0 < T; t0 += kPrompt) {
      const Span span{&cache, pos + t0, std::min(kPrompt, T - t0)};
      forward_spans(x + t0 * d_.D, &span, 1, run);
    }
  }

  // The rows of n sequences (x: span 0's T rows, then span 1's, ...) through every layer together, in place: one
  // `run` per linear for all rows, attention per sequence over its own cache (written). The caller checks the spans
  // (spans_error) and keeps the rows few (a decode step: one per sequence, and at most a prompt chunk).
  template <typename Run>
  void forward_spans(float* x, const Span* spans, size_t n, const Run& run) {
    int64_t R = 0;
    for (size_t s = 0; s < n; ++s) R += spans[s].T;
    const int64_t D = d_.D, F = d_.F, q_size = d_.H * d_.hd, kv_size = d_.G * d_.hd;
    fit(h_, R * std::max(D, F));
    fit(q_, R * q_size);
    fit(k_, R * kv_size);
    fit(v_, R * kv_size);
    fit(a_, R * q_size);
    fit(out_, R * D);
    fit(gate_, R * F);
    fit(up_, R * F);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      for (int64_t t = 0; t < R; ++t) rms_norm(x + t * D, layer.in_norm, D, d_.eps, h_.data() + t * D);
      run(layer.q, h_.data(), R, q_.data());
      run(layer.k, h_.data(), R, k_.data());
      run(layer.v, h_.data(), R, v_.data());
      attention(l, spans, n);
      run(layer.o, a_.data(), R, out_.data());
      add_branch(x, R, layer.attn_out_norm);
      for (int64_t t = 0; t < R; ++t) rms_norm(x + t * D, layer.post_norm, D, d_.eps, h_.data() + t * D);
      if (experts_[l].router >= 0) {
        mixture(experts_[l], R, run);
      } else {
        run(layer.gate, h_.data(), R, gate_.data());
        run(layer.up, h_.data(), R, up_.data());
        for (int64_t t = 0; t < R; ++t)  // row by row: a row's 8-lane groups whatever rows come before it
          gated(gate_.data() + t * F, up_.data() + t * F, F, d_.gelu, h_.data() + t * F);
        run(layer.down, h_.data(), R, out_.data());
      }
      add_branch(x, R, layer.mlp_out_norm);
    }
  }

 private:
  static constexpr int64_t kPrompt = 256;  // prompt tokens per pass through the layers
  static constexpr int64_t kBlock = 16;    // query tokens per attention task

  static void fit(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }

  // out_ [R, D] = the experts' weighted outputs for the MLP's inputs h_ [R, D] (the module comment): each row's top_k
  // of the router's softmax, then expert by expert its rows gathered, its three linears run once for them, and each
  // output times its weight added to its row, experts in ascending order.
  template <typename Run>
  void mixture(const Experts& ex, int64_t R, const Run& run) {
    const int64_t D = d_.D, F = d_.F, E = static_cast<int64_t>(ex.gate.size()), k = ex.top_k;
    fit(probs_, R * E);
    run(ex.router, h_.data(), R, probs_.data());
    chosen_.assign(R * k, -1);
    weights_.assign(R * k, 0.0f);
    for (int64_t t = 0; t < R; ++t) {
      float* p = probs_.data() + t * E;
      const float top = *std::max_element(p, p + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      float picked = 0.0f;
      for (int64_t j = 0; j < k; ++j) {  // the j-th largest, the lower index first among equals
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (std::find(chosen_.begin() + t * k, chosen_.begin() + t * k + j, e) == chosen_.begin() + t * k + j &&
              (best < 0 || p[e] > p[best]))
            best = e;
        chosen_[t * k + j] = best;
        picked += weights_[t * k + j] = p[best];
      }
      if (ex.renormalize)
        for (int64_t j = 0; j < k; ++j) weights_[t * k + j] /= picked;
    }
    std::fill_n(out_.begin(), R * D, 0.0f);
    fit(rows_x_, R * D);
    fit(rows_y_, R * D);
    for (int64_t e = 0; e < E; ++e) {
      rows_.clear();
      for (int64_t slot = 0; slot < R * k; ++slot)
        if (chosen_[slot] == e) rows_.push_back(slot);
      const auto n = static_cast<int64_t>(rows_.size());
      if (n == 0) continue;
      for (int64_t i = 0; i < n; ++i) std::copy_n(h_.data() + rows_[i] / k * D, D, rows_x_.data() + i * D);
      run(ex.gate[e], rows_x_.data(), n, gate_.data());
      run(ex.up[e], rows_x_.data(), n, up_.data());
      for (int64_t i = 0; i < n; ++i)
        gated(gate_.data() + i * F, up_.data() + i * F, F, d_.gelu, gate_.data() + i * F);
      run(ex.down[e], gate_.data(), n, rows_y_.data());
      for (int64_t i = 0; i < n; ++i) {
        float* o = out_.data() + rows_[i] / k * D;
        const float* y = rows_y_.data() + i * D;
        const float w = weights_[rows_[i]];
        for (int64_t c = 0; c < D; ++c) o[c] += y[c] * w;
      }
    }
  }

  // x [R, D] += out_ [R, D], each row of out_ RMSNorm'd by `norm` first where given (Gemma's post-norms)
  void add_branch(float* x, int64_t R, const float* norm) {
    const int64_t D = d_.D;
    if (norm != nullptr)
      for (int64_t t = 0; t < R; ++t) rms_norm(out_.data() + t * D, norm, D, d_.eps, out_.data() + t * D);
    for (int64_t i = 0; i < R * D; ++i) x[i] += out_[i];
  }

  // u [hd] rotated in place by row p of the layer's tables
  void rope(const Layer& layer, float* u, int64_t p) const {
    const float* c = (layer.cos != nullptr ? layer.cos : d_.cos) + p * d_.hd;
    const float* s = (layer.sin != nullptr ? layer.sin : d_.sin) + p * d_.hd;
    const int64_t half = d_.hd / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float a = u[i], b = u[i + half];
      u[i] = a * c[i] - b * s[i];
      u[i + half] = b * c[i + half] + a * s[i + half];
    }
  }

  // a_ = attention of every span's tokens over its own cache in layer l (q_, k_, v_ hold their projections, the
  // spans' rows in order). A span's queries go in blocks of kBlock tokens: a block's rows of one KV head (its tokens
  // times the query heads that share the head) read each key and value once for all of them (attention_tiles.h),
  // their scores in one row each, soft-maxed over the row's own keys (causal; with a window, from the block's first
  // key in it on, a row's earlier keys weighted 0).
  void attention(size_t l, const Span* spans, size_t n) {
    const Layer& layer = layers_[l];
    const int64_t hd = d_.hd, G = d_.G, H = d_.H, group = H / G;
    std::vector<int64_t> first(n + 1, 0), row0(n, 0);  // span s: tasks first[s].., rows row0[s]..
    int64_t rows_before = 0, width = 0, longest = 0;
    if (layer.whole_qk_norm) {  // OLMoE: each row's q and k normed whole, before the split into heads
      int64_t R = 0;
      for (size_t s = 0; s < n; ++s) R += spans[s].T;
      for (int64_t r = 0; r < R; ++r) {
        rms_norm(q_.data() + r * H * hd, layer.q_norm, H * hd, d_.eps, q_.data() + r * H * hd);
        rms_norm(k_.data() + r * G * hd, layer.k_norm, G * hd, d_.eps, k_.data() + r * G * hd);
      }
    }
    const bool head_norms = layer.q_norm != nullptr && !layer.whole_qk_norm;
    for (size_t s = 0; s < n; ++s) {
      const Span& sp = spans[s];
      const int64_t L = sp.cache->length;
      for (int64_t t = 0; t < sp.T; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = (rows_before + t) * G + g, p = sp.pos + t;
          float* kg = k_.data() + i * hd;
          if (head_norms) rms_norm(kg, layer.k_norm, hd, d_.eps, kg);
          rope(layer, kg, p);
          std::copy_n(kg, hd, sp.cache->keys[l] + (g * L + p) * hd);
          std::copy_n(v_.data() + i * hd, hd, sp.cache->values[l] + (g * L + p) * hd);
        }
      row0[s] = rows_before;
      rows_before += sp.T;
      first[s + 1] = first[s] + (sp.T + kBlock - 1) / kBlock * G;
      width = std::max(width, sp.pos + sp.T);
      longest = std::max(longest, sp.T);
    }
    // (span, block, KV head) tasks: a prompt's spread over the threads, a decoded token's heads run in turn (one
    // token per span: a chunk of tasks is a span's heads). A span's blocks are taken first, last, second, second to
    // last...: a block attends to all before it, so contiguous chunks of that order hold as many keys each.
    bitquilt_par::parallel_for(0, first[n], longest > 1 ? 1 : G, [&](int64_t k0, int64_t k1) {
      const int64_t most = std::min(longest, kBlock) * group;
      std::vector<float> scores(most * width);
      std::vector<const float*> q(most);
      std::vector<float*> s(most), out(most);
      std::vector<int64_t> count(most);
      for (int64_t k = k0; k < k1; ++k) {
        const size_t sn = std::upper_bound(first.begin(), first.end(), k) - first.begin() - 1;
        const Span& sp = spans[sn];
        const int64_t T = sp.T, pos = sp.pos, L = sp.cache->length, local = k - first[sn];
        const int64_t blocks = (T + kBlock - 1) / kBlock, r = local / G, g = local % G;
        const int64_t b = r % 2 ? blocks - 1 - r / 2 : r / 2;
        const int64_t t0 = b * kBlock, t1 = std::min(T, t0 + kBlock), rows = (t1 - t0) * group;
        const int64_t lo = layer.window > 0 ? std::max<int64_t>(0, pos + t0 + 1 - layer.window) : 0;  // first key
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const int64_t row = (t - t0) * group + h - g * group, i = (row0[sn] + t) * H + h;
            float* qh = q_.data() + i * hd;
            if (head_norms) rms_norm(qh, layer.q_norm, hd, d_.eps, qh);
            rope(layer, qh, pos + t);
            q[row] = qh;
            s[row] = scores.data() + row * width;
            out[row] = a_.data() + i * hd;
            count[row] = pos + t + 1 - lo;  // keys lo .. pos + t
          }
        const float* kh = sp.cache->keys[l] + (g * L + lo) * hd;
        const float* vh = sp.cache->values[l] + (g * L + lo) * hd;
        bitquilt_attention::scores_rows(q.data(), rows, kh, pos + t1 - lo, hd, d_.scaling, s.data());
        for (int64_t row = 0; row < rows; ++row) {
          // the row's own first key: `skip` past the block's (only with a window)
          const int64_t skip = layer.window > 0 ? std::max<int64_t>(0, count[row] - layer.window) : 0;
          float* sr = s[row] + skip;
          const int64_t n_row = count[row] - skip;
          if (d_.score_cap > 0.0f)
            for (int64_t j = 0; j < n_row; ++j) sr[j] = std::tanh(sr[j] / d_.score_cap) * d_.score_cap;
          const float inv = 1.0f / exp_shifted(sr, n_row, bitquilt_attention::max_of(sr, n_row));
          for (int64_t j = 0; j < n_row; ++j) sr[j] *= inv;
          std::fill_n(s[row], skip, 0.0f);
        }
        bitquilt_attention::mix_rows(s.data(), count.data(), rows, vh, hd, out.data());
      }
    });
  }

  Dims d_;
  std::vector<Layer> layers_;
  std::vector<Experts> experts_;  // per layer (router < 0: a dense MLP)
  std::vector<float> h_, q_, k_, v_, a_, out_, gate_, up_;
  std::vector<float> probs_, weights_, rows_x_, rows_y_;  // a mixture's router probabilities, picks' weights, rows
  std::vector<int64_t> chosen_, rows_;                   // each row's picked experts; an expert's (row, slot)s
};

}  // namespace bitquilt_decoder
