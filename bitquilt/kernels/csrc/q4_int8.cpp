// 4-bit uniform weights times int8-quantized activations (AVX2; the AVX-512 VNNI twin in q4_int8_vnni.cpp),
// used by bitquilt.kernels.q4_int8.
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
// value). <q, i> is exact: a vpmaddubsw pair sum is at most 2 * 15 * 127, so two of them add in int16 before one
// vpmaddwd widens to int32. A row's 64 codes of two blocks are one 32-byte chunk: one mask gives the codes of
// columns 0-15 and 32-47, one shift and mask those of 16-31 and 48-63, and the token's int8 activations are
// stored in that order (64 per chunk: 0-15, 32-47, 16-31, 48-63), so two vpmaddubsw cover both blocks, the int32
// lanes 0-3 summing block 2p and lanes 4-7 block 2p + 1, scaled by [d_2p x 4, d_2p+1 x 4] in one FMA. Four rows
// share each activation load. Several tokens (prefill) widen each tile's codes once into an int8 buffer and run
// the tokens over it two at a time (each widened chunk loaded serves both), with the tile's group scales decoded
// once per tile rather than per token: on Zen 4 at 128 tokens the two measured 1.13-1.60x faster on this path
// and 1.26-1.53x on VNNI, the decoding alone ~30% of the time at group 128. The code stream is sequential, yet
// at batch 1 the hardware prefetcher alone leaves loads waiting: prefetching each chunk PREFETCH_BYTES ahead
// measured 1.15-1.45x faster on Zen 3 and up to 1.24x on Zen 4's 2-bit VNNI loop (q4_int8.h).
//
// 2-bit layouts have their own tiles and kernel (q2_int8.cpp); matmul_into and row_into hand them over.

#include "q4_int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "avx2_simd.h"
#include "int8_round.h"
#include "parallel.h"

#ifdef TORCH_EXTENSION_NAME
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#endif

namespace bitquilt_q4 {

namespace {

using bitquilt_simd::hsum8;

// Token x [K] as int8 codes [K] in chunk order (module comment), per-chunk block scales [K / 64][8] (d_2p four
// times, then d_2p+1) and group sums X [groups].
void round_token(const float* x, int64_t K, int64_t group, int8_t* codes, float* dpair, float* X) {
  std::fill_n(X, (K + group - 1) / group, 0.0f);
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const bitquilt_int8::Rounded r = bitquilt_int8::round_block(x + b * BLOCK);
    std::fill_n(dpair + b / 2 * 8 + b % 2 * 4, 4, r.d);
    // the block's halves to their places in the chunk: columns 0-15 at 16 * (b % 2), 16-31 at 32 + 16 * (b % 2)
    int8_t* chunk = codes + b / 2 * PAIR + b % 2 * 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk), _mm256_castsi256_si128(r.codes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 32), _mm256_extracti128_si256(r.codes, 1));
    X[b * BLOCK / group] += r.d * r.sum;
  }
}

// A row's chunk as two vectors of 32 codes: lo (columns 0-15, 32-47), hi (16-31, 48-63).
struct Codes {
  __m256i lo, hi;
};

inline Codes widen(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib)};
}

// 8 lanes: 0-3 sum to <q, i> over the chunk's first block, 4-7 over its second, as floats
inline __m256 chunk_dot(const Codes& q, __m256i xl, __m256i xh) {
  const __m256i ones = _mm256_set1_epi16(1);
  // each int16 pair sum is at most 2 * 15 * 127, so the two halves add exactly in int16 before one vpmaddwd
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q.lo, xl), _mm256_maddubs_epi16(q.hi, xh));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
}

// Panel P's share of the tile's 4 rows for NT tokens at once (NT = 2 for prefill: each code chunk loaded serves
// both tokens); `codes(p, r)` gives row r's chunk p of the panel (packed, or widened in a buffer), `scales` the
// tile's decoded groups of the panel (`decode_group`), or null for one token: then the packed `sz` (`tile_group`).
// Token t's rounded activations, block scales and group sums from the panel's start are at xi + t * K,
// dpair + t * K / 8, X + t * groups; its rows go to out[t * ROWS + r]. One loop runs over the panel's chunks, a
// group's scales applied after its last one, on both paths (q4_int8_vnni.cpp too): against a loop over the groups
// with one over each group's chunks inside, the same sums in the same order ran (Intel Xeon with AVX-512, builds
// alternating, 1536² to 4096² in cache) 1.05-1.12x faster at batch 1 in groups of 64 (at 128: 1.00-1.03x),
// 1.05-1.08x at batch 128 on AVX2 and 1.13-1.22x on VNNI (cold weights: 1.12-1.14x).
template <int NT, typename CodesOf>
inline void tile_tokens(const CodesOf& codes, const uint8_t* sz, const float* scales, const Weight& W, const Panel& P,
                        const int8_t* xi, const float* dpair, const float* X, float* out) {
  const int64_t G = W.groups(), per_group = W.group / PAIR;
  __m256 total[NT][ROWS];
  __m128 offset[NT];
  for (int t = 0; t < NT; ++t) {
    offset[t] = _mm_setzero_ps();
    for (int r = 0; r < ROWS; ++r) total[t][r] = _mm256_setzero_ps();
  }
  __m256 acc[NT][ROWS];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < ROWS; ++r) acc[t][r] = _mm256_setzero_ps();
  const int64_t pairs = P.cols / PAIR;
  for (int64_t p = 0, g = 0, group_end = std::min(pairs, per_group); p < pairs; ++p) {
    __m256i xl[NT], xh[NT];
    __m256 d[NT];
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = xi + t * W.K + p * PAIR;
      xl[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      xh[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      d[t] = _mm256_loadu_ps(dpair + t * W.K / 8 + p * 8);
    }
    for (int r = 0; r < ROWS; ++r) {
      const Codes q = codes(p, r);
      for (int t = 0; t < NT; ++t) acc[t][r] = _mm256_fmadd_ps(chunk_dot(q, xl[t], xh[t]), d[t], acc[t][r]);
    }
    if (p + 1 < group_end) continue;
    const GroupScales s = tile_group(scales, sz, g);  // group g's last chunk: its scales, then the next group
    for (int r = 0; r < ROWS; ++r) {
      const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s.s), _mm256_set1_epi32(r));
      for (int t = 0; t < NT; ++t) {
        total[t][r] = _mm256_fmadd_ps(acc[t][r], scale, total[t][r]);
        acc[t][r] = _mm256_setzero_ps();
      }
    }
    add_group_offsets<NT>(s.sz, X, G, g, offset);
    ++g;
    group_end = std::min(pairs, group_end + per_group);
  }
  for (int t = 0; t < NT; ++t) {
    float off[ROWS];
    _mm_storeu_ps(off, offset[t]);
    for (int r = 0; r < ROWS; ++r) out[t * ROWS + r] = hsum8(total[t][r]) - off[r];
  }
}

}  // namespace

std::string layout_error(int64_t N, int64_t K, int64_t group, int64_t bits, int64_t w_bytes, int64_t sz_bytes) {
  if (K % PAIR || group % PAIR || group <= 0) return "columns and group size must be multiples of 64";
  if (bits != 4 && bits != 2) return "codes of 4 or 2 bits, not " + std::to_string(bits);
  const Weight W{nullptr, nullptr, N, K, group, static_cast<int>(bits)};
  if (w_bytes != W.code_bytes()) return "packed codes do not match the shape";
  if (sz_bytes != W.scale_bytes()) return "scales do not match the shape";
  return "";
}

void row_into(const Weight& W, int64_t r, float* out) {
  const int64_t tile = r / ROWS, row = r % ROWS;
  for (int64_t s = 0; s < W.panels(); ++s) {
    const Panel P = W.panel(s);
    const uint8_t* wt = W.codes(P, tile);
    const uint8_t* sz = W.scales(P, tile);
    for (int64_t p = 0; p < P.cols / PAIR; ++p) {
      const uint8_t* bytes = wt + (p * ROWS + row) * CHUNK_BYTES;
      float* o = out + P.c0 + p * PAIR;
      for (int64_t j = 0; j < 16; ++j) {  // the chunk's columns j, 16 + j, 32 + j, 48 + j (q4_int8.h's layout)
        for (int m = 0; m < 4; ++m)
          o[16 * m + j] = static_cast<float>((bytes[j + 16 * (m / 2)] >> (4 * (m % 2))) & 15);
      }
    }
    for (int64_t g = 0; g < P.groups; ++g) {
      float sc[2 * ROWS];
      decode_group(sz + g * GROUP_BYTES, sc);
      const int64_t c0 = P.c0 + g * W.group, c1 = std::min(P.c0 + P.cols, c0 + W.group);
      for (int64_t c = c0; c < c1; ++c) out[c] = sc[row] * out[c] - sc[ROWS + row];
    }
  }
}

#ifdef TORCH_EXTENSION_NAME
Weight make_weight(const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t group, int64_t bits) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && sz.scalar_type() == at::kByte &&
                  sz.is_contiguous(), "packed codes and scales: contiguous uint8");
  const std::string error = layout_error(N, K, group, bits, w.numel(), sz.numel());
  TORCH_CHECK(error.empty(), error);
  return {w.data_ptr<uint8_t>(), sz.data_ptr<uint8_t>(), N, K, group, static_cast<int>(bits)};
}
#endif

namespace {

// Tiles [i0, i1) of y for T rounded tokens of 4-bit codes (AVX2; tiles_vnni is the AVX-512 VNNI twin). The
// split buffer holds each row chunk's Codes (lo, hi: 64 bytes) in tile order.
void tiles_avx2(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y) {
  constexpr int64_t chunk = CHUNK_BYTES;
  const auto split = [](const uint8_t* wt, int64_t pairs, int8_t* buffer) {
    for (int64_t c = 0; c < pairs * ROWS; ++c) {
      const Codes q = widen(wt + c * chunk);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buffer + c * 64), q.lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buffer + c * 64 + 32), q.hi);
    }
  };
  const auto token = [&W](const uint8_t* wt, const int8_t* buffer, const uint8_t* sz, const float* scales,
                          const int8_t* x, const float* dt, const float* Xt, int n, const Panel& P, float* out) {
    if (buffer == nullptr) {
      const auto streamed = [wt](int64_t p, int r) {
        const uint8_t* row = wt + (p * ROWS + r) * chunk;
        if (r == 0) prefetch_ahead(row, ROWS * chunk / 64);  // the chunk's 4 rows: 2 cache lines
        return widen(row);
      };
      tile_tokens<1>(streamed, sz, nullptr, W, P, x, dt, Xt, out);
      return;
    }
    const auto buffered = [buffer](int64_t p, int r) {
      const auto* c = reinterpret_cast<const __m256i*>(buffer + (p * ROWS + r) * 64);
      return Codes{_mm256_loadu_si256(c), _mm256_loadu_si256(c + 1)};
    };
    if (n == 2)
      tile_tokens<2>(buffered, sz, scales, W, P, x, dt, Xt, out);
    else
      tile_tokens<1>(buffered, sz, scales, W, P, x, dt, Xt, out);
  };
  run_tiles(W, i0, i1, T, xi, d, X, y, split, token);
}

}  // namespace

int64_t default_prefetch_bytes() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 8192 : 2048;  // q4_int8.h
}

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

namespace {

bool g_vnni = has_vnni();  // the widest path by default

}  // namespace

bool vnni_enabled() { return g_vnni; }

bool set_vnni(bool enabled) {
  if (enabled && !has_vnni()) return false;
  g_vnni = enabled;
  return true;
}

void matmul_into(const float* x, int64_t T, const Weight& W, float* y) {
  if (W.bits == 2) return w2_matmul_into(x, T, W, y);
  const int64_t K = W.K, G = W.groups(), pairs = K / PAIR, tile_bytes = W.tile_bytes();
  std::vector<int8_t> xi(T * K);
  std::vector<float> d(T * pairs * 8), X(T * G);
  bitquilt_par::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      round_token(x + t * K, K, W.group, xi.data() + t * K, d.data() + t * pairs * 8, X.data() + t * G);
  });
  const int64_t grain = std::max<int64_t>(4, (1 << 15) / tile_bytes);  // tiles per task: ~32 KB of codes
  const auto tiles = g_vnni ? &tiles_vnni : &tiles_avx2;
  bitquilt_par::parallel_for(0, W.tiles(), grain, [&](int64_t i0, int64_t i1) {
    tiles(W, i0, i1, T, xi.data(), d.data(), X.data(), y);
  });
}

#ifdef TORCH_EXTENSION_NAME
namespace {

at::Tensor q4_int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t group,
                          int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const Weight W = make_weight(w, sz, N, x.size(1), group, bits);
  auto y = at::empty({x.size(0), N}, x.options());
  matmul_into(x.data_ptr<float>(), x.size(0), W, y.data_ptr<float>());
  return y;
}

}  // namespace
#endif

}  // namespace bitquilt_q4

#ifdef TORCH_EXTENSION_NAME
// Adds the int8-activation 4-bit matmul to the extension module (called from its PYBIND11_MODULE).
void register_q4_int8(pybind11::module& m) {
  m.def("q4_int8_matmul", &bitquilt_q4::q4_int8_matmul,
        "y = x_hat @ W^T for 4- or 2-bit uniform W, x_hat = x rounded to int8 per block of 32 (AVX2 maddubs or "
        "AVX-512 VNNI)");
  m.def("q4_int8_panel_columns", &bitquilt_q4::panel_columns, "columns per panel of the layout for this group size");
  m.def("q4_int8_has_vnni", &bitquilt_q4::has_vnni, "whether the CPU runs the AVX-512 VNNI path");
  m.def("q4_int8_prefetch_bytes", [] { return bitquilt_q4::PREFETCH_BYTES; },
        "how far ahead the batch-1 tiles prefetch their codes on this CPU");
  m.def("q4_int8_vnni_enabled", &bitquilt_q4::vnni_enabled, "whether the kernel takes the AVX-512 VNNI path");
  m.def("q4_int8_set_vnni", [](bool enabled) {
    TORCH_CHECK(bitquilt_q4::set_vnni(enabled), "the AVX-512 VNNI path of the int8-activation kernel needs a CPU "
                "with AVX-512 F/BW/VL/DQ and VNNI");
  }, "take the AVX-512 VNNI path (true) or AVX2 (false)");
}
#endif
