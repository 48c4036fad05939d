// The library of the standalone runtime (bitquilt.runtime.standalone): a whole Llama-like model run from the kernel
// layouts of a standalone export, with a C interface that ctypes calls, so that generating text needs neither
// torch nor its extension. Built on its own (bitquilt/standalone/library.py) from this file and the torch-free
// kernels: q4_int8.cpp (+ its VNNI twin) for 4- and 2-bit linears, uniform8_gemv.cpp for 8-bit ones, both on
// int8-rounded activations, plane_int8.cpp for the bit-plane slices of a MoBiQuant checkpoint, routed per token by
// their routers (routed_parts.h), also on int8-rounded activations, and a plain fp32 product for linears kept in
// full precision;
// the layer math is decoder_core.h's, as in the torch extension's fused decode step, and so is a routed linear's.
// The routers' threshold is each router's saved one, or one for all set from an average of bits
// (bq_threshold: SliceRouter.set_precision's interpolation on the checkpoint's curve).
//
// The file is opened by the library itself (bq_file_open: standalone_file.h maps it and parses its header), once,
// and every model of it (bq_open, one per sequence length) points its linears into that mapping, which it keeps, so
// that the Python runtime and the native runner (native_runner.cpp) share one loader and a new sequence finds the
// weights' pages already mapped. A model owns its RoPE tables and its key/value caches, the caches in one anonymous
// mapping whose zero pages become memory only as positions fill. Sampling is here too, so that the caller needs no
// array library. The interface: standalone.h.

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/dense_rows.h"
#include "kernels/q4_int8.h"
#include "kernels/routed_parts.h"
#include "kernels/uniform8.h"
#include "runtime/decoder_core.h"
#include "runtime/standalone.h"
#include "runtime/standalone_file.h"
#include "text/bpe_tokenizer.h"

namespace {

thread_local std::string g_error;

int64_t fail(const std::string& why) {
  g_error = why;
  return -1;
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
  std::optional<bitquilt_routed::RoutedParts> routed;  // MoBiQuant slices routed per token, or:
  const float* dense = nullptr;           // fp32 [N, K]
  const float* bias = nullptr;            // fp32 [N] or null
  float tau = 0;                          // routed: the router's saved threshold
  int64_t N = 0, K = 0;

  // y [T, N] = x [T, K] W^T (+ b); a routed linear routes row t at thresholds[t] (NaN, or no thresholds: its own)
  // and adds each row's bits times its weights to bits[t] (routed_parts.h).
  void run(const float* x, int64_t T, float* y, const float* thresholds = nullptr, double* bits = nullptr) const {
    if (routed) {
      std::vector<float> taus(T, tau);
      for (int64_t t = 0; thresholds != nullptr && t < T; ++t)
        if (!std::isnan(thresholds[t])) taus[t] = thresholds[t];
      routed->run(x, T, N, taus.data(), y, bits);
    } else if (q4)
      bitquilt_q4::matmul_into(x, T, *q4, y);
    else if (u8)
      bitquilt_u8::gemv_int8_into(x, T, *u8, y);
    else
      bitquilt_dense::rows_into(x, T, dense, N, K, y);
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
  Model(const bitquilt_decoder::Dims& d, const float* inv_freq, const float* local_inv_freq, int64_t layers,
        std::shared_ptr<const bitquilt_standalone::MappedFile> file)
      : file(std::move(file)),
        rope(inv_freq, d.hd, d.max_len),
        local_rope(local_inv_freq != nullptr ? local_inv_freq : inv_freq, d.hd, local_inv_freq != nullptr ? d.max_len : 0),
        core(with_tables(d)),
        cache_floats(d.G * d.max_len * d.hd), caches(2 * layers * cache_floats), layers(layers) {}
  bitquilt_decoder::Dims with_tables(bitquilt_decoder::Dims d) const {
    d.cos = rope.cos.data();
    d.sin = rope.sin.data();
    return d;
  }
  float* cache(int64_t layer, int which) const { return caches.data() + (2 * layer + which) * cache_floats; }
  int64_t add(const Linear& lin) {
    linears.push_back(lin);
    return static_cast<int64_t>(linears.size()) - 1;
  }

  std::shared_ptr<const bitquilt_standalone::MappedFile> file;  // the weights the linears point into
  Rope rope;
  Rope local_rope;  // Gemma's sliding-window layers' tables (empty for other families)
  bitquilt_decoder::Decoder core;
  int64_t cache_floats;  // one layer's keys (or values), [kv_heads, max_len, head_dim]
  ZeroPages caches;      // per layer, keys then values
  bitquilt_decoder::Cache kv;  // the layers' caches as the decoder takes them
  int64_t layers;
  std::vector<Linear> linears;
  int64_t embed = -1, head = -1;
  const float* final_norm = nullptr;
  float embed_scale = 1.0f;  // the embedding rows' factor (Gemma: sqrt(hidden))
  float softcap = 0.0f;      // logits soft-capped to c tanh(z / c) where c > 0 (Gemma)
  std::vector<float> x, last;
  float threshold = NAN;        // the routers' threshold for every routed linear (NaN: each its saved one)
  double routed_weights = 0;    // the routed linears' weights, N * K summed
  double bits = 0;              // the bits times weights the tokens so far used in them
  int64_t routed_tokens = 0;    // those tokens
  std::vector<double> row_bits;  // a call's, per row
  std::vector<float> row_taus;   // a call's thresholds, per row
};

Model* model(void* handle) { return static_cast<Model*>(handle); }

// The logits [rows, vocab] of the LM head's output, in place: soft-capped where the model says so.
void cap_logits(const Model* m, float* logits, int64_t n) {
  if (m->softcap > 0.0f)
    for (int64_t i = 0; i < n; ++i) logits[i] = std::tanh(logits[i] / m->softcap) * m->softcap;
}

// The ids [T] of `m`'s sequence as embedding rows x [T, D]; false (bq_error: why) for an id outside the vocabulary.
bool embed_rows(Model* m, const int64_t* ids, int64_t T, float* x) {
  const Linear& embed = m->linears[m->embed];
  const int64_t D = m->core.dims().D;
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] < 0 || ids[t] >= embed.N) {
      fail("token id " + std::to_string(ids[t]) + " outside the vocabulary of " + std::to_string(embed.N));
      return false;
    }
    embed.row(ids[t], x + t * D);
    if (m->embed_scale != 1.0f)
      for (int64_t i = 0; i < D; ++i) x[t * D + i] *= m->embed_scale;
    if (m->embed != m->head) embed.unmap();  // a tied table is the head's, which every step reads whole
  }
  return true;
}

// The linears of `lead` for rows of several sequences of its file, row r `owner[r]`'s: a routed linear routes each
// row at its owner's threshold and credits the bits it used to its owner (a call's rows are the first of `owner`).
auto linear_runner(Model* lead, const std::vector<Model*>& owner) {
  return [lead, &owner](int64_t i, const float* in, int64_t n, float* out) {
    const Linear& lin = lead->linears[i];
    if (!lin.routed) return lin.run(in, n, out);
    lead->row_bits.assign(n, 0.0);
    lead->row_taus.resize(n);
    for (int64_t r = 0; r < n; ++r) lead->row_taus[r] = owner[r]->threshold;
    lin.run(in, n, out, lead->row_taus.data(), lead->row_bits.data());
    for (int64_t r = 0; r < n; ++r) owner[r]->bits += lead->row_bits[r];
  };
}

using bitquilt_json::Value;
using bitquilt_standalone::MappedFile;
using bitquilt_standalone::Tensor;

[[noreturn]] void refuse(const MappedFile& f, const std::string& why) { throw std::runtime_error(f.path() + ": " + why); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Tensor `name`, fp32 of `shape`.
const float* floats(const MappedFile& f, const std::string& name, const std::vector<int64_t>& shape) {
  const Tensor t = f.tensor(name, "F32");
  if (t.shape != shape) refuse(f, name + " is " + shape_text(t.shape) + ", expected " + shape_text(shape));
  return t.as<float>();
}

// Metadata entry `what`, a size or count: an integer in [0, 2^31 - 1] (no model dimension is larger, and every
// product the loader forms of two of them fits int64).
int64_t integer(const MappedFile& f, const Value& v, const std::string& what) {
  if (v.kind != Value::Number) refuse(f, "its metadata lacks " + what + "; re-export the model");
  if (!v.is_integer(0, INT32_MAX)) refuse(f, "its metadata's " + what + " is " + v.describe() + ", not an integer in "
                                             "[0, 2147483647]; the file is damaged or was edited");
  return v.integer();
}

// The slices of MoBiQuant linear `name` (metadata `entry`) into `lin`: per slice `name.slice<p>.planes` and
// `.coefs` (the lookup-table kernel's packed planes and coefficients as bytes, lut_parts.h), and its router's
// `name.router.fc1.weight` [H, K + 1], `.fc1.bias` [H], `.fc2.weight` [slices - 1, H], `.fc2.bias` and saved
// `.threshold` [1].
void load_slices(const MappedFile& f, const std::string& name, const Value& entry, Linear& lin) {
  static const char* const modes[3] = {"planes", "uniform32", "uniform16"};  // bitquilt_lut::Coef's order
  const int64_t N = lin.N, K = lin.K;
  const int64_t block = integer(f, entry["block"], name + ".block"), group = integer(f, entry["group"], name + ".group");
  const auto& slices = entry["slices"].array;
  if (slices.size() < 2 || slices.size() > 8) refuse(f, name + ": a routed linear has 2 to 8 slices");
  std::vector<bitquilt_lut::Part> parts;
  std::vector<double> slice_bits;
  for (size_t p = 0; p < slices.size(); ++p) {
    const std::string slice = name + ".slice" + std::to_string(p);
    const int64_t k = integer(f, slices[p]["bits"], slice + ".bits");
    const auto mode = std::find(modes, modes + 3, slices[p]["coef"].string) - modes;
    if (mode == 3) refuse(f, slice + " has no coefficient layout (planes, uniform32 or uniform16)");
    const Tensor planes = f.tensor(slice + ".planes", "U8"), coefs = f.tensor(slice + ".coefs", "U8");
    const bitquilt_lut::Shape shape{K, N, k, block, group};
    const auto coef = static_cast<bitquilt_lut::Coef>(mode);
    const std::string error = bitquilt_lut::packed_error(shape, planes.nbytes, coefs.nbytes, coef);
    if (!error.empty()) refuse(f, slice + ": " + error);
    parts.push_back({planes.as<uint8_t>(), coefs.as<char>(), shape, bitquilt_lut::coef_group_bytes(coef, k), coef});
    slice_bits.push_back(static_cast<double>(k));
  }
  const std::string router = name + ".router.";
  const Tensor w1 = f.tensor(router + "fc1.weight", "F32"), w2 = f.tensor(router + "fc2.weight", "F32");
  const int64_t H = w1.shape.size() == 2 ? w1.shape[0] : -1, E1 = w2.shape.size() == 2 ? w2.shape[0] : -1;
  const std::string error = bitquilt_routed::router_error(K, static_cast<int64_t>(parts.size()), H,
                                                          w1.shape.size() == 2 ? w1.shape[1] : -1, E1,
                                                          w2.shape.size() == 2 ? w2.shape[1] : -1);
  if (!error.empty()) refuse(f, name + ": " + error);
  const bitquilt_router::Router r{w1.as<float>(), floats(f, router + "fc1.bias", {H}), w2.as<float>(),
                                  floats(f, router + "fc2.bias", {E1}), K, H, E1};
  lin.tau = *floats(f, router + "threshold", {1});
  lin.routed.emplace(r, parts, slice_bits, true);  // on int8 activations, as every low-bit linear here
}

// Linear `name` of the file, as its metadata entry describes it (kinds: bitquilt.export.standalone).
Linear load_linear(const MappedFile& f, const std::string& name) {
  const Value& entry = f.config()["linears"][name];
  if (entry.kind != Value::Object) refuse(f, "its metadata has no linear '" + name + "'; re-export the model");
  Linear lin;
  const int64_t N = lin.N = integer(f, entry["out"], name + ".out");
  const int64_t K = lin.K = integer(f, entry["in"], name + ".in");
  if (entry["bias"].boolean) lin.bias = floats(f, name + ".bias", {N});
  const std::string& kind = entry["kind"].string;
  if (kind == "q4") {
    const Tensor codes = f.tensor(name + ".codes", "U8"), scales = f.tensor(name + ".scales", "U8");
    const int64_t group = integer(f, entry["group"], name + ".group"), bits = integer(f, entry["bits"], name + ".bits");
    const std::string error = bitquilt_q4::layout_error(N, K, group, bits, codes.nbytes, scales.nbytes);
    if (!error.empty()) refuse(f, name + ": " + error);
    lin.q4 = bitquilt_q4::Weight{codes.as<uint8_t>(), scales.as<uint8_t>(), N, K, group, static_cast<int>(bits)};
  } else if (kind == "u8") {
    const int64_t group = integer(f, entry["group"], name + ".group");
    const std::string error = bitquilt_u8::shape_error(K, group);
    if (!error.empty()) refuse(f, name + ": " + error);
    const int64_t groups = (K + group - 1) / group;
    const Tensor codes = f.tensor(name + ".codes", "U8");
    if (codes.shape != std::vector<int64_t>{N, K})
      refuse(f, name + ".codes is " + shape_text(codes.shape) + ", expected " + shape_text({N, K}));
    lin.u8 = bitquilt_u8::Weight{codes.as<uint8_t>(), floats(f, name + ".scale", {N, groups}),
                                 floats(f, name + ".scale_zero", {N, groups}), N, K, group};
  } else if (kind == "slices") {
    load_slices(f, name, entry, lin);
  } else if (kind == "dense") {
    lin.dense = floats(f, name + ".weight", {N, K});
  } else {
    refuse(f, name + " is of kind '" + kind + "', which this bitquilt does not run");
  }
  return lin;
}

// The model of a standalone file for sequences of up to `max_len` positions.
std::unique_ptr<Model> load_model(const std::shared_ptr<const MappedFile>& file, int64_t max_len) {
  const MappedFile& f = *file;
  const Value& c = f.config();
  auto dim = [&](const char* key) { return integer(f, c[key], key); };
  const int64_t layers = dim("num_hidden_layers"), D = dim("hidden_size"), hd = dim("head_dim");
  if (max_len <= 0 || max_len > dim("max_positions"))
    refuse(f, "a sequence of " + std::to_string(max_len) + " positions does not fit the model's " +
                  std::to_string(dim("max_positions")));
  const float* inv_freq = floats(f, "rope.inv_freq", {hd / 2});
  // Gemma (format 5): each layer's type, its window, GELU-tanh, post-norms; Gemma 3's sliding layers' own RoPE base,
  // Gemma 2's capped attention scores
  const Value& types = c["layer_types"];
  const bool gemma = types.kind == Value::Array;
  if (gemma && static_cast<int64_t>(types.array.size()) != layers) refuse(f, "layer_types must name every layer");
  const float* local_inv_freq =
      f.has("rope.sliding_attention.inv_freq") ? floats(f, "rope.sliding_attention.inv_freq", {hd / 2}) : nullptr;
  const std::string& activation = c["activation"].kind == Value::String ? c["activation"].string : "silu";
  if (activation != "silu" && activation != "gelu_pytorch_tanh")
    refuse(f, "activation '" + activation + "' (this bitquilt runs silu and gelu_pytorch_tanh)");
  bitquilt_decoder::Dims d{D, dim("num_attention_heads"), dim("num_key_value_heads"), hd,
                           dim("intermediate_size"), max_len, static_cast<float>(c["rms_norm_eps"].number),
                           static_cast<float>(c["attention_scaling"].number), inv_freq, inv_freq};
  d.gelu = activation == "gelu_pytorch_tanh";
  if (c["attn_logit_softcapping"].kind == Value::Number)
    d.score_cap = static_cast<float>(c["attn_logit_softcapping"].number);
  if (!(d.score_cap >= 0.0f && std::isfinite(d.score_cap)))
    refuse(f, "attn_logit_softcapping must be non-negative and finite");
  std::string error = bitquilt_decoder::dims_error(d);
  if (error.empty() && (layers <= 0 || hd % 2)) error = "layers must be positive and the head dim even";
  if (!error.empty()) refuse(f, error);
  const int64_t window = gemma ? integer(f, c["sliding_window"], "sliding_window") : 0;
  auto m = std::make_unique<Model>(d, inv_freq, local_inv_freq, layers, file);
  if (m->caches.data() == nullptr) refuse(f, "no memory for the key/value caches");
  static const char* const projections[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                             "mlp.down_proj"};
  const bool qk_norms = c["qk_norms"].boolean, whole = c["qk_norms_whole"].boolean;
  const int64_t H = dim("num_attention_heads"), G = dim("num_key_value_heads");
  // format 6: a mixture of experts in every layer's MLP place (count, top_k, renormalize)
  const Value& moe = c["experts"];
  const int64_t E = moe.kind == Value::Object ? integer(f, moe["count"], "experts.count") : 0;
  const int64_t top_k = E > 0 ? integer(f, moe["top_k"], "experts.top_k") : 0;
  if (E > 0 && !(top_k >= 1 && top_k <= E)) refuse(f, "experts.top_k must be between 1 and experts.count");
  const auto add_linear = [&](const std::string& name) {
    const Linear lin = load_linear(f, name);
    if (lin.routed) m->routed_weights += static_cast<double>(lin.N * lin.K);
    return m->add(lin);
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    bitquilt_decoder::Experts experts;
    if (E > 0) {  // expert 0's linears stand in the MLP's place (its shapes); the router is fp32 [E, D]
      for (int64_t e = 0; e < E; ++e) {
        const std::string expert = prefix + "mlp.experts." + std::to_string(e) + ".";
        experts.gate.push_back(add_linear(expert + "gate_proj"));
        experts.up.push_back(add_linear(expert + "up_proj"));
        experts.down.push_back(add_linear(expert + "down_proj"));
      }
      Linear router;
      router.N = E;
      router.K = D;
      router.dense = floats(f, prefix + "mlp.gate.weight", {E, D});
      experts.router = m->add(router);
      experts.top_k = top_k;
      experts.renormalize = moe["renormalize"].boolean;
    }
    int64_t index[7], N[7], K[7];
    for (int j = 0; j < 7; ++j) {
      index[j] = j < 4 || E == 0 ? add_linear(prefix + projections[j])
                                 : (j == 4 ? experts.gate : j == 5 ? experts.up : experts.down)[0];
      N[j] = m->linears[index[j]].N;
      K[j] = m->linears[index[j]].K;
    }
    for (int64_t e = 1; e < E && error.empty(); ++e) {  // every expert of expert 0's shapes
      const int64_t idx[3] = {experts.gate[e], experts.up[e], experts.down[e]};
      for (int j = 0; j < 3; ++j)
        if (m->linears[idx[j]].N != N[4 + j] || m->linears[idx[j]].K != K[4 + j])
          error = "expert " + std::to_string(e) + "'s linears differ in shape from expert 0's";
    }
    if (!error.empty()) refuse(f, "layer " + std::to_string(layer) + ": " + error);
    error = bitquilt_decoder::linears_error(d, N, K);
    if (!error.empty()) refuse(f, "layer " + std::to_string(layer) + ": " + error);
    bitquilt_decoder::Layer l{floats(f, prefix + "input_layernorm.weight", {D}),
                              floats(f, prefix + (gemma ? "pre_feedforward_layernorm.weight"
                                                        : "post_attention_layernorm.weight"), {D}),
                              qk_norms ? floats(f, prefix + "self_attn.q_norm.weight", {whole ? H * hd : hd}) : nullptr,
                              qk_norms ? floats(f, prefix + "self_attn.k_norm.weight", {whole ? G * hd : hd}) : nullptr,
                              index[0], index[1], index[2], index[3], index[4], index[5], index[6]};
    if (gemma) {
      l.attn_out_norm = floats(f, prefix + "post_attention_layernorm.weight", {D});
      l.mlp_out_norm = floats(f, prefix + "post_feedforward_layernorm.weight", {D});
      const std::string& type = types.array[layer].string;
      if (type != "sliding_attention" && type != "full_attention")
        refuse(f, "layer " + std::to_string(layer) + " is of type '" + type + "', not sliding_attention or "
                  "full_attention");
      if (type == "sliding_attention") {
        l.window = window;
        if (local_inv_freq != nullptr) {
          l.cos = m->local_rope.cos.data();
          l.sin = m->local_rope.sin.data();
        }
      }
    }
    l.whole_qk_norm = whole;
    m->core.add_layer(l);
    if (E > 0) m->core.set_experts(std::move(experts));
    m->kv.keys.push_back(m->cache(layer, 0));
    m->kv.values.push_back(m->cache(layer, 1));
  }
  m->kv.length = max_len;
  m->head = m->add(load_linear(f, "lm_head"));
  const std::string& embed = c["embed"].string;
  m->embed = embed == "lm_head" ? m->head : m->add(load_linear(f, embed));
  const Linear &e = m->linears[m->embed], &h = m->linears[m->head];
  if (e.K != D || h.K != D || h.N != e.N) refuse(f, "the embedding and the head must be [vocab, hidden]");
  if (e.routed || h.routed) refuse(f, "the embedding and the head are not routed");
  if (e.q4 && e.q4->bits != 4) refuse(f, "the embedding table must be fp32, 8- or 4-bit, not 2-bit");
  m->final_norm = floats(f, "model.norm.weight", {D});
  if (c["embed_scale"].kind == Value::Number) m->embed_scale = static_cast<float>(c["embed_scale"].number);
  if (c["final_logit_softcapping"].kind == Value::Number)
    m->softcap = static_cast<float>(c["final_logit_softcapping"].number);
  if (!(m->embed_scale > 0.0f && std::isfinite(m->embed_scale)) || !(m->softcap >= 0.0f && std::isfinite(m->softcap)))
    refuse(f, "embed_scale must be positive and final_logit_softcapping non-negative, both finite");
  return m;
}

using FileHandle = std::shared_ptr<const MappedFile>;  // what bq_file_open returns, held by what opens on it

}  // namespace

extern "C" {

const char* bq_error() { return g_error.c_str(); }

int bq_isa_supported(int isa) { return bitquilt_q4::isa_supported(isa); }
int bq_active_isa() { return bitquilt_q4::active_isa(); }
int bq_set_isa(int isa) {
  if (bitquilt_q4::set_isa(isa)) return 0;
  return static_cast<int>(fail("int8 kernel path " + std::to_string(isa) + " is not supported by this CPU"));
}
void bq_set_threads(int threads) { omp_set_num_threads(threads); }
int bq_threads() { return omp_get_max_threads(); }

// The standalone file at `path`, mapped (nothing read but its header); null with the reason in bq_error().
void* bq_file_open(const char* path) {
  try {
    return new FileHandle(std::make_shared<const MappedFile>(path));
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

// The caller's hold on the file (models and tokenizers opened on it keep theirs).
void bq_file_free(void* file) { delete static_cast<FileHandle*>(file); }

// The model of an opened file for up to `max_len` positions; null with the reason in bq_error() when the file
// cannot be run.
void* bq_open(void* file, int64_t max_len) { return bq_open_mapped(*static_cast<FileHandle*>(file), max_len); }

void bq_free(void* handle) { delete model(handle); }

// Layer `layer`'s keys (which = 0) or values (1), fp32 [kv_heads, max_len, head_dim]; null outside the model.
const float* bq_cache(void* handle, int64_t layer, int which) {
  Model* m = model(handle);
  return layer < 0 || layer >= m->core.layers() || which < 0 || which > 1 ? nullptr : m->cache(layer, which);
}

// The RoPE table in use: cos (which = 0) or sin (1), fp32 [max_len, head_dim].
const float* bq_rope(void* handle, int which) {
  return which == 0 ? model(handle)->rope.cos.data() : model(handle)->rope.sin.data();
}

// The rows of the embedding table (the vocabulary the model reads).
int64_t bq_vocab(void* handle) { return model(handle)->linears[model(handle)->embed].N; }

// Tokens ids [T] at positions pos..pos+T-1 through the model (caches written); logits [vocab] of the last one.
int bq_forward(void* handle, const int64_t* ids, int64_t T, int64_t pos, float* logits) {
  Model* m = model(handle);
  const auto& d = m->core.dims();
  if (T <= 0 || pos < 0 || pos + T > d.max_len)
    return static_cast<int>(fail("positions " + std::to_string(pos) + ".." + std::to_string(pos + T) +
                                 " outside the cache's " + std::to_string(d.max_len)));
  m->x.resize(T * d.D);
  if (!embed_rows(m, ids, T, m->x.data())) return -1;
  const std::vector<Model*> owner(T, m);
  m->core.forward(m->x.data(), m->kv, pos, T, linear_runner(m, owner));
  if (m->routed_weights > 0) m->routed_tokens += T;
  m->last.resize(d.D);
  bitquilt_decoder::rms_norm(m->x.data() + (T - 1) * d.D, m->final_norm, d.D, d.eps, m->last.data());
  // NaN / Inf in the residual stream (a weight or scale that holds one) reach the final norm whatever the int8
  // rounding of the linears' inputs made of them: refused here rather than turned into a token.
  if (!std::all_of(m->last.begin(), m->last.end(), [](float v) { return std::isfinite(v); }))
    return static_cast<int>(fail(bitquilt_standalone::kNonFinite));
  m->linears[m->head].run(m->last.data(), 1, logits);
  cap_logits(m, logits, m->linears[m->head].N);
  return 0;
}

// n sequences (models of one file) a step further together: sequence i reads counts[i] ids (ids holds sequence 0's,
// then 1's, ...) at positions pos[i].., logits[i] [vocab] of its last one (all NaN where that one's hidden state is
// not finite). One kernel call per linear for all their rows, attention per sequence over its own cache, each row
// routed at its own sequence's threshold: every row as it comes out alone (decoder_core.h), so each sequence gets
// the logits bq_forward gives it. The tables and buffers are those of the model with the longest cache.
int bq_step(void* const* handles, int64_t n, const int64_t* ids, const int64_t* counts, const int64_t* pos,
            float* logits) {
  if (n <= 0) return static_cast<int>(fail("a step needs at least one sequence"));
  Model* lead = model(handles[0]);
  for (int64_t i = 1; i < n; ++i) {
    if (model(handles[i])->file != lead->file) return static_cast<int>(fail("the sequences are of different files"));
    if (model(handles[i])->core.dims().max_len > lead->core.dims().max_len) lead = model(handles[i]);
  }
  const auto& d = lead->core.dims();
  std::vector<bitquilt_decoder::Span> spans(n);
  for (int64_t i = 0; i < n; ++i) spans[i] = {&model(handles[i])->kv, pos[i], counts[i]};
  const std::string error = lead->core.spans_error(spans.data(), n);
  if (!error.empty()) return static_cast<int>(fail(error));
  std::vector<Model*> owner;
  for (int64_t i = 0; i < n; ++i) owner.insert(owner.end(), counts[i], model(handles[i]));
  const auto R = static_cast<int64_t>(owner.size());
  lead->x.resize(R * d.D);
  for (int64_t i = 0, r = 0; i < n; r += counts[i++])
    if (!embed_rows(model(handles[i]), ids + r, counts[i], lead->x.data() + r * d.D)) return -1;
  lead->core.forward_spans(lead->x.data(), spans.data(), n, linear_runner(lead, owner));
  lead->last.resize(n * d.D);
  std::vector<bool> finite(n);
  for (int64_t i = 0, r = 0; i < n; ++i) {
    Model* m = model(handles[i]);
    if (m->routed_weights > 0) m->routed_tokens += counts[i];
    r += counts[i];
    float* last = lead->last.data() + i * d.D;
    bitquilt_decoder::rms_norm(lead->x.data() + (r - 1) * d.D, lead->final_norm, d.D, d.eps, last);
    finite[i] = std::all_of(last, last + d.D, [](float v) { return std::isfinite(v); });  // bq_forward refuses it
    if (!finite[i]) std::fill_n(last, d.D, 0.0f);  // through the head as zeros, its logits NaN after it
  }
  const Linear& head = lead->linears[lead->head];
  head.run(lead->last.data(), n, logits);
  cap_logits(lead, logits, n * head.N);
  for (int64_t i = 0; i < n; ++i)
    if (!finite[i]) std::fill_n(logits + i * head.N, head.N, NAN);
  return 0;
}

// The threshold at which the routers of an opened file use `avg_bits` bits per weight on average, into *tau;
// -1 (bq_error: why) when the model has no routers or avg_bits is outside the checkpoint's range.
int bq_threshold(void* file, double avg_bits, float* tau) {
  try {
    *tau = bq_threshold_mapped(**static_cast<FileHandle*>(file), avg_bits);
    return 0;
  } catch (const std::exception& e) {
    return static_cast<int>(fail(e.what()));
  }
}

// Route every routed linear of the model at threshold `tau` from its next token on (NaN: each at its saved one).
void bq_set_threshold(void* handle, float tau) { model(handle)->threshold = tau; }

// The bits per weight the model's tokens so far used on average in its routed linears (weighted by their sizes);
// NaN without routed linears or tokens.
double bq_routed_bits(void* handle) {
  const Model* m = model(handle);
  return m->routed_tokens == 0 ? NAN : m->bits / (m->routed_weights * static_cast<double>(m->routed_tokens));
}

// The tokenizer of an opened file (bpe_tokenizer.h); null with the reason in bq_error().
void* bq_tokenizer_open(void* file) {
  try {
    return new bitquilt_tokenizer::Tokenizer(*static_cast<FileHandle*>(file));
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

void bq_tokenizer_free(void* tokenizer) { delete static_cast<bitquilt_tokenizer::Tokenizer*>(tokenizer); }

// The ids of UTF-8 text [n bytes], the first `capacity` of them written to ids; how many there are (-1: not UTF-8).
int64_t bq_tokenize(void* tokenizer, const char* text, int64_t n, int64_t* ids, int64_t capacity) {
  try {
    const auto found = static_cast<bitquilt_tokenizer::Tokenizer*>(tokenizer)->encode(std::string(text, n));
    std::copy_n(found.begin(), std::min<int64_t>(capacity, found.size()), ids);
    return static_cast<int64_t>(found.size());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// The bytes of tokens ids [n] (special ones left out if skip_special), the first `capacity` written to out; how many.
int64_t bq_detokenize(void* tokenizer, const int64_t* ids, int64_t n, int skip_special, char* out, int64_t capacity) {
  const std::string bytes = static_cast<bitquilt_tokenizer::Tokenizer*>(tokenizer)->decode(ids, n, skip_special != 0);
  std::copy_n(bytes.begin(), std::min<int64_t>(capacity, bytes.size()), out);
  return static_cast<int64_t>(bytes.size());
}

// The index of the largest of logits [n] (the first of equals); -1 when one of them is NaN or infinite (a model whose
// weights or scales hold NaN/Inf has no next token: the callers say so instead of emitting token 0).
int64_t bq_argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(logits[i])) return -1;
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

// A draw from softmax(logits / temperature) [n], `uniform` in [0, 1) the caller's random number: the first index
// whose cumulative probability exceeds it (in double, so that no token's share is lost to rounding). With top_p < 1
// only the fewest most likely tokens whose probability reaches top_p are drawn from (a token is kept while the mass
// of those more likely than it is below top_p, as the torch runtimes' sampler keeps them). Each weight's
// exponential is computed once. -1 as bq_argmax.
int64_t bq_sample(const float* logits, int64_t n, double temperature, double top_p, double uniform) {
  const int64_t argmax = bq_argmax(logits, n);
  if (argmax < 0) return -1;
  const double top = logits[argmax];
  thread_local std::vector<double> weights, cumulative;
  weights.resize(n);
  cumulative.resize(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += weights[i] = std::exp((logits[i] - top) / temperature);
  if (top_p < 1) {
    thread_local std::vector<int64_t> order;
    order.resize(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [](int64_t a, int64_t b) { return weights[a] > weights[b]; });
    double before = 0;
    for (const int64_t i : order) {
      const double w = weights[i];
      if (before >= top_p * total) weights[i] = 0;
      before += w;
    }
  }
  total = 0;
  for (int64_t i = 0; i < n; ++i) cumulative[i] = total += weights[i];
  const double target = uniform * total;
  return std::min<int64_t>(std::upper_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin(), n - 1);
}

}  // extern "C"

void* bq_open_mapped(const std::shared_ptr<const MappedFile>& file, int64_t max_len) {
  try {
    return load_model(file, max_len).release();
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

// The threshold at which the routers of `f` use `avg_bits` bits per weight on average: SliceRouter.set_precision's
// interpolation, as numpy.interp computes it, on the checkpoint's curve (`routing.curve`, the mean bits at each
// threshold of `routing.taus`, falling as the threshold rises).
float bq_threshold_mapped(const MappedFile& f, double avg_bits) {
  if (!f.has("routing.curve"))
    refuse(f, "the model has no slice routers (--avg-bits needs a MoBiQuant checkpoint)");
  const Tensor curve = f.tensor("routing.curve", "F32");
  const int64_t n = curve.numel();
  const float* taus = floats(f, "routing.taus", {n});
  if (curve.shape.size() != 1 || n < 2) refuse(f, "routing.curve is not a curve; re-export the model");
  std::vector<double> xp(n), fp(n);  // bits rising, thresholds falling
  for (int64_t i = 0; i < n; ++i) {
    xp[i] = curve.as<float>()[n - 1 - i];
    fp[i] = taus[n - 1 - i];
  }
  const double low = *std::min_element(xp.begin(), xp.end()), high = *std::max_element(xp.begin(), xp.end());
  if (!(avg_bits >= low - 1e-6 && avg_bits <= high + 1e-6)) {
    char text[160];
    std::snprintf(text, sizeof text, "average bits %g are out of this checkpoint's routed range [%.2f, %.2f]",
                  avg_bits, low, high);
    throw std::runtime_error(text);
  }
  if (avg_bits < xp[0]) return static_cast<float>(fp[0]);
  if (avg_bits >= xp[n - 1]) return static_cast<float>(fp[n - 1]);
  const int64_t j = std::upper_bound(xp.begin(), xp.end(), avg_bits) - xp.begin() - 1;
  if (xp[j] == avg_bits) return static_cast<float>(fp[j]);
  const double slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j]);
  double tau = slope * (avg_bits - xp[j]) + fp[j];
  if (std::isnan(tau)) tau = slope * (avg_bits - xp[j + 1]) + fp[j + 1];
  return static_cast<float>(tau);
}
