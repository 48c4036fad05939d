// The library of the standalone runtime (bitquilt.standalone): a whole Llama-like model run from the kernel
// layouts of a standalone export, with a C interface that ctypes calls, so that generating text needs neither
// torch nor its extension. Built on its own (bitquilt/standalone/library.py) from this file and the torch-free
// kernels: q4_int8.cpp (+ its VNNI twin) for 4- and 2-bit linears, uniform8_gemv.cpp for 8-bit ones, both on
// int8-rounded activations, and a plain fp32 product for linears kept in full precision; the layer math is
// decoder_core.h's, as in the torch extension's fused decode step.
//
// The caller owns the weights (views of the mapped export): a model here holds pointers to them. A model owns its
// RoPE tables and its key/value caches, the caches in one anonymous mapping whose zero pages become memory only as
// positions fill. Sampling is here too, so that the caller needs no array library. Functions that can fail return
// -1 (or null) and leave the reason in bq_error().

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
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

// madvise(MADV_DONTNEED) over the whole pages around [p, p + bytes): for a private, never written file mapping, the
// process's page table entries go (the pages stay in the page cache); a later read faults them in again.
void unmap_pages(const void* p, size_t bytes) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) & ~(page - 1);
  madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED);
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

  // Drops this process's mapping of W's pages (they stay in the page cache; a later read maps them again): an
  // untied embedding table is read one row per token, and where the page cache holds a file in large folios (ext4
  // on Linux 6.18 here) a read maps the row's whole folio, up to 2 MB, so a few hundred lookups kept most of a 68 MB
  // table of qwen2.5-0.5b resident (55 MB after 150 rows). Harmless on memory the library does not map from a file.
  void unmap() const {
    if (q4) {
      unmap_pages(q4->w, q4->code_bytes());
      unmap_pages(q4->sz, q4->scale_bytes());
    } else if (u8) {
      unmap_pages(u8->q, N * K);
      unmap_pages(u8->s, N * u8->groups() * sizeof(float));
      unmap_pages(u8->sz, N * u8->groups() * sizeof(float));
    } else {
      unmap_pages(dense, N * K * sizeof(float));
    }
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

// Zeroed floats in an anonymous mapping: untouched pages cost nothing (a heap calloc may clear them all at once).
class ZeroPages {
 public:
  explicit ZeroPages(int64_t floats) : bytes_(floats * sizeof(float)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<float*>(p);
  }
  ~ZeroPages() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  ZeroPages(const ZeroPages&) = delete;
  ZeroPages& operator=(const ZeroPages&) = delete;
  float* data() const { return data_; }

 private:
  size_t bytes_;
  float* data_;
};

// cos and sin [max_len, head_dim] of position * inv_freq, the halves repeated: the angle in fp32 as the torch
// runtimes compute it, its cos and sin in double rounded to fp32 (correctly rounded but for rare double roundings,
// where fp32 cos and sin libraries differ by an ulp here and there).
struct Rope {
  Rope(const float* inv_freq, int64_t head_dim, int64_t max_len) : cos(max_len * head_dim), sin(max_len * head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t p = 0; p < max_len; ++p)
      for (int64_t i = 0; i < head_dim; ++i) {
        const double angle = static_cast<float>(p) * inv_freq[i % half];
        cos[p * head_dim + i] = static_cast<float>(std::cos(angle));
        sin[p * head_dim + i] = static_cast<float>(std::sin(angle));
      }
  }
  std::vector<float> cos, sin;
};

struct Model {
  Model(const bitquilt_decoder::Dims& d, const float* inv_freq, int64_t layers)
      : rope(inv_freq, d.hd, d.max_len), core(with_tables(d)), cache_floats(d.G * d.max_len * d.hd),
        caches(2 * layers * cache_floats), layers(layers) {}
  bitquilt_decoder::Dims with_tables(bitquilt_decoder::Dims d) const {
    d.cos = rope.cos.data();
    d.sin = rope.sin.data();
    return d;
  }
  float* cache(int64_t layer, int which) const { return caches.data() + (2 * layer + which) * cache_floats; }

  Rope rope;
  bitquilt_decoder::Decoder core;
  int64_t cache_floats;  // one layer's keys (or values), [kv_heads, max_len, head_dim]
  ZeroPages caches;      // per layer, keys then values
  int64_t layers;
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

// A model of `layers` decoder layers, to be added, for up to `max_len` positions; inv_freq fp32 [head_dim / 2].
void* bq_new(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
             int64_t max_len, double eps, double scaling, const float* inv_freq) {
  const bitquilt_decoder::Dims d{hidden, heads, kv_heads, head_dim, intermediate, max_len, static_cast<float>(eps),
                                 static_cast<float>(scaling), inv_freq, inv_freq};
  std::string error = bitquilt_decoder::dims_error(d);
  if (error.empty() && (layers <= 0 || head_dim % 2)) error = "layers must be positive and the head dim even";
  if (!error.empty()) {
    fail(error);
    return nullptr;
  }
  auto* m = new Model(d, inv_freq, layers);
  if (m->caches.data() == nullptr) {
    delete m;
    fail("no memory for the key/value caches");
    return nullptr;
  }
  return m;
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

// The next layer: norm weights (q_norm, k_norm null unless the family has them) and its linears' indices (q, k, v,
// o, gate, up, down).
int bq_add_layer(void* handle, const float* in_norm, const float* post_norm, const float* q_norm, const float* k_norm,
                 const int64_t* linears) {
  Model* m = model(handle);
  const int64_t layer = m->core.layers();
  if (layer == m->layers) return static_cast<int>(fail("the model has its " + std::to_string(layer) + " layers"));
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
                     linears[5], linears[6], m->cache(layer, 0), m->cache(layer, 1)});
  return 0;
}

// Layer `layer`'s keys (which = 0) or values (1), fp32 [kv_heads, max_len, head_dim]; null outside the model.
const float* bq_cache(void* handle, int64_t layer, int which) {
  Model* m = model(handle);
  return layer < 0 || layer >= m->core.layers() || which < 0 || which > 1 ? nullptr : m->cache(layer, which);
}

// The RoPE table in use: cos (which = 0) or sin (1), fp32 [max_len, head_dim].
const float* bq_rope(void* handle, int which) {
  return which == 0 ? model(handle)->rope.cos.data() : model(handle)->rope.sin.data();
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
  if (m->core.layers() != m->layers)
    return static_cast<int>(fail(std::to_string(m->core.layers()) + " of " + std::to_string(m->layers) + " layers"));
  if (T <= 0 || pos < 0 || pos + T > d.max_len)
    return static_cast<int>(fail("positions " + std::to_string(pos) + ".." + std::to_string(pos + T) +
                                 " outside the cache's " + std::to_string(d.max_len)));
  const Linear& embed = m->linears[m->embed];
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= embed.N)
      return static_cast<int>(fail("token id " + std::to_string(ids[t]) + " outside the vocabulary of " +
                                   std::to_string(embed.N)));
  m->x.resize(T * d.D);
  for (int64_t t = 0; t < T; ++t) {
    embed.row(ids[t], m->x.data() + t * d.D);
    if (m->embed != m->head) embed.unmap();  // a tied table is the head's, which every step reads whole
  }
  m->core.forward(m->x.data(), T, pos,
                  [m](int64_t i, const float* in, int64_t n, float* out) { m->linears[i].run(in, n, out); });
  m->last.resize(d.D);
  bitquilt_decoder::rms_norm(m->x.data() + (T - 1) * d.D, m->final_norm, d.D, d.eps, m->last.data());
  m->linears[m->head].run(m->last.data(), 1, logits);
  return 0;
}

// The index of the largest of logits [n] (the first of equals).
int64_t bq_argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

// A draw from softmax(logits / temperature) [n], `uniform` in [0, 1) the caller's random number: the first index
// whose cumulative probability exceeds it (in double, so that no token's share is lost to rounding). Each weight's
// exponential is computed once, kept as the running sum of the weights before it.
int64_t bq_sample(const float* logits, int64_t n, double temperature, double uniform) {
  const double top = logits[bq_argmax(logits, n)];
  thread_local std::vector<double> cumulative;
  cumulative.resize(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) cumulative[i] = total += std::exp((logits[i] - top) / temperature);
  const double target = uniform * total;
  return std::min<int64_t>(std::upper_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin(), n - 1);
}

}  // extern "C"
