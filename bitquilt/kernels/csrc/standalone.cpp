// The library of the standalone runtime (bitquilt.standalone): a whole Llama-like model run from the kernel
// layouts of a standalone export, with a C interface that ctypes calls, so that generating text needs neither
// torch nor its extension. Built on its own (bitquilt/standalone/library.py) from this file and the torch-free
// kernels: q4_int8.cpp (+ its VNNI twin) for 4- and 2-bit linears, uniform8_gemv.cpp for 8-bit ones, both on
// int8-rounded activations, and a plain fp32 product for linears kept in full precision; the layer math is
// decoder_core.h's, as in the torch extension's fused decode step.
//
// The caller owns every array (the weights are views of the mapped export, the caches its own buffers); a model
// here holds pointers. Functions that can fail return -1 (or null) and leave the reason in bq_error().

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "avx2_simd.h"
#include "decoder_core.h"
#include "parallel.h"
#include "q4_int8.h"
#include "uniform8.h"

namespace {

thread_local std::string g_error;

int64_t fail(const std::string& why) {
  g_error = why;
  return -1;
}

// y [T, N] = x [T, K] W^T for a row-major fp32 W [N, K]
void dense_into(const float* x, int64_t T, const float* W, int64_t N, int64_t K, float* y) {
  bitquilt_par::parallel_for(0, N, std::max<int64_t>(16, (1 << 14) / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t t = 0; t < T; ++t) y[t * N + r] = bitquilt_simd::dot(x + t * K, W + r * K, K);
  });
}

struct Linear {
  std::optional<bitquilt_q4::Weight> q4;  // 4- or 2-bit codes on int8 activations, or:
  std::optional<bitquilt_u8::Weight> u8;  // 8-bit codes on int8 activations, or:
  const float* dense = nullptr;           // fp32 [N, K]
  const float* bias = nullptr;            // fp32 [N] or null
  int64_t N = 0, K = 0;

  void run(const float* x, int64_t T, float* y) const {
    if (q4)
      bitquilt_q4::matmul_into(x, T, *q4, y);
    else if (u8)
      bitquilt_u8::gemv_int8_into(x, T, *u8, y);
    else
      dense_into(x, T, dense, N, K, y);
    if (bias != nullptr)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < N; ++i) y[t * N + i] += bias[i];
  }

  // Row r of W (an embedding lookup), fp32 [K]
  void row(int64_t r, float* out) const {
    if (q4)
      bitquilt_q4::row_into(*q4, r, out);
    else if (u8)
      bitquilt_u8::row_into(*u8, r, out);
    else
      std::memcpy(out, dense + r * K, K * sizeof(float));
  }
};

struct Model {
  explicit Model(const bitquilt_decoder::Dims& d) : core(d) {}
  bitquilt_decoder::Decoder core;
  std::vector<Linear> linears;
  int64_t embed = -1, head = -1;
  const float* final_norm = nullptr;
  std::vector<float> x, last;
};

Model* model(void* handle) { return static_cast<Model*>(handle); }

int64_t push(void* handle, Linear lin, const float* bias) {
  lin.bias = bias;
  model(handle)->linears.push_back(lin);
  return static_cast<int64_t>(model(handle)->linears.size()) - 1;
}

}  // namespace

extern "C" {

const char* bq_error() { return g_error.c_str(); }

int bq_has_vnni() { return bitquilt_q4::has_vnni(); }
int bq_vnni_enabled() { return bitquilt_q4::vnni_enabled(); }
int bq_set_vnni(int enabled) {
  if (bitquilt_q4::set_vnni(enabled != 0)) return 0;
  return static_cast<int>(fail("the AVX-512 VNNI path needs a CPU with AVX-512 F/BW/VL/DQ and VNNI"));
}
void bq_set_threads(int threads) { omp_set_num_threads(threads); }
int bq_threads() { return omp_get_max_threads(); }

// A model of `layers` decoder layers to be added; cos, sin fp32 [max_len, head_dim].
void* bq_new(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, int64_t max_len,
             double eps, double scaling, const float* cos, const float* sin) {
  const bitquilt_decoder::Dims d{hidden, heads, kv_heads, head_dim, intermediate, max_len, static_cast<float>(eps),
                                 static_cast<float>(scaling), cos, sin};
  const std::string error = bitquilt_decoder::dims_error(d);
  if (!error.empty()) {
    fail(error);
    return nullptr;
  }
  return new Model(d);
}

void bq_free(void* handle) { delete model(handle); }

// A 4- or 2-bit linear in the layout of q4_int8.h; its index.
int64_t bq_add_q4(void* handle, const uint8_t* codes, int64_t code_bytes, const uint8_t* scales, int64_t scale_bytes,
                  int64_t group, int64_t bits, int64_t N, int64_t K, const float* bias) {
  const std::string error = bitquilt_q4::layout_error(N, K, group, bits, code_bytes, scale_bytes);
  if (!error.empty()) return fail(error);
  Linear lin;
  lin.q4 = bitquilt_q4::Weight{codes, scales, N, K, group, static_cast<int>(bits)};
  lin.N = N;
  lin.K = K;
  return push(handle, lin, bias);
}

// An 8-bit linear: codes uint8 [N, K], s and s * z fp32 [N, groups]; its index.
int64_t bq_add_u8(void* handle, const uint8_t* codes, const float* scale, const float* scale_zero, int64_t group,
                  int64_t N, int64_t K, const float* bias) {
  const std::string error = bitquilt_u8::shape_error(K, group);
  if (!error.empty()) return fail(error);
  Linear lin;
  lin.u8 = bitquilt_u8::Weight{codes, scale, scale_zero, N, K, group};
  lin.N = N;
  lin.K = K;
  return push(handle, lin, bias);
}

// A full-precision linear, fp32 [N, K]; its index.
int64_t bq_add_dense(void* handle, const float* weight, int64_t N, int64_t K, const float* bias) {
  Linear lin;
  lin.dense = weight;
  lin.N = N;
  lin.K = K;
  return push(handle, lin, bias);
}

// A layer: norm weights (q_norm, k_norm null unless the family has them), its linears' indices (q, k, v, o, gate,
// up, down) and its caches fp32 [kv_heads, max_len, head_dim].
int bq_add_layer(void* handle, const float* in_norm, const float* post_norm, const float* q_norm, const float* k_norm,
                 const int64_t* linears, float* keys, float* values) {
  Model* m = model(handle);
  int64_t N[7], K[7];
  for (int j = 0; j < 7; ++j) {
    if (linears[j] < 0 || linears[j] >= static_cast<int64_t>(m->linears.size()))
      return static_cast<int>(fail("unknown linear " + std::to_string(linears[j])));
    N[j] = m->linears[linears[j]].N;
    K[j] = m->linears[linears[j]].K;
  }
  const std::string error = bitquilt_decoder::linears_error(m->core.dims(), N, K);
  if (!error.empty()) return static_cast<int>(fail(error));
  if ((q_norm == nullptr) != (k_norm == nullptr)) return static_cast<int>(fail("q and k norms come together"));
  m->core.add_layer({in_norm, post_norm, q_norm, k_norm, linears[0], linears[1], linears[2], linears[3], linears[4],
                     linears[5], linears[6], keys, values});
  return 0;
}

// The embedding table (a linear [vocab, hidden] read by rows), the final norm and the LM head.
int bq_set_ends(void* handle, int64_t embed, const float* final_norm, int64_t head) {
  Model* m = model(handle);
  const int64_t n = static_cast<int64_t>(m->linears.size()), D = m->core.dims().D;
  if (embed < 0 || embed >= n || head < 0 || head >= n) return static_cast<int>(fail("unknown embedding or head"));
  if (m->linears[embed].K != D || m->linears[head].K != D || m->linears[head].N != m->linears[embed].N)
    return static_cast<int>(fail("the embedding and the head must be [vocab, hidden]"));
  m->embed = embed;
  m->head = head;
  m->final_norm = final_norm;
  return 0;
}

// Tokens ids [T] at positions pos..pos+T-1 through the model (caches written); logits [vocab] of the last one.
int bq_forward(void* handle, const int64_t* ids, int64_t T, int64_t pos, float* logits) {
  Model* m = model(handle);
  const auto& d = m->core.dims();
  if (m->embed < 0) return static_cast<int>(fail("bq_set_ends was not called"));
  if (m->core.layers() == 0) return static_cast<int>(fail("no layers"));
  if (T <= 0 || pos < 0 || pos + T > d.max_len)
    return static_cast<int>(fail("positions " + std::to_string(pos) + ".." + std::to_string(pos + T) +
                                 " outside the cache's " + std::to_string(d.max_len)));
  const Linear& embed = m->linears[m->embed];
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= embed.N)
      return static_cast<int>(fail("token id " + std::to_string(ids[t]) + " outside the vocabulary of " +
                                   std::to_string(embed.N)));
  m->x.resize(T * d.D);
  for (int64_t t = 0; t < T; ++t) embed.row(ids[t], m->x.data() + t * d.D);
  m->core.forward(m->x.data(), T, pos,
                  [m](int64_t i, const float* in, int64_t n, float* out) { m->linears[i].run(in, n, out); });
  m->last.resize(d.D);
  bitquilt_decoder::rms_norm(m->x.data() + (T - 1) * d.D, m->final_norm, d.D, d.eps, m->last.data());
  m->linears[m->head].run(m->last.data(), 1, logits);
  return 0;
}

}  // extern "C"
