// MXINT (microscaled integer) matmul for x86-64, used by bitquilt.kernels.mxint.
//
// A row of the stored (column-permuted) weight is a sequence of segments, one per MXINT class,
// each made of whole 32-column blocks sharing a power-of-two step 2^(e - (m - 2)):
//   m = 4: nibble-packed, 64 bytes per group of 4 blocks (the class is padded with zero blocks to a
//          multiple of 4): 32-bit word i of the group holds, in nibble j, the two's-complement code of
//          column 16 (j % 2) + i of block j / 2, so a shift by 4j brings 16 (or 8) consecutive columns'
//          codes to the low bits of the lanes;
//   m = 6, 8: int8 elements, 32 bytes per block.
// Weights: uint8 [N, row_bytes] (segments in order, each starting on a 64-byte line); exponents: the format's E8M0 bytes,
// uint8 [N, blocks] in the same column order. x arrives gathered to that order (mxint_gather).
//
// Every weight is dequantized exactly in registers, w = q * step (a power of two times a small
// integer: exact in fp32, subnormals included), and multiplied by x in fp32 FMAs, so the result
// differs from the torch reference only in summation order. The AVX-512 path turns a 4-bit block
// into weights with one multiply (a 16-entry table of code values times the step) and a vpermps
// per 16 columns; the AVX2 path sign-extends each nibble with two shifts and converts.
//
// Small batches: mxint_gemv (decode once per row, FMA against up to 4 tokens). Large batches:
// mxint_dequant_matmul (rows dequantized to fp32 in chunks, then at::mm).
// The AVX-512 functions are compiled for that target only (pragma below) and picked at run time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/avx2_simd.h"
#include "common/stream_prefetch.h"

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROW_GRAIN = 16;              // fewest rows per parallel task
constexpr int64_t L1_WEIGHT_BYTES = 16 << 10;  // weight bytes per row chunk (re-read once per token group)
constexpr int64_t CHUNK_FLOATS = 1 << 19;      // dequantized fp32 values per at::mm call (2 MiB, about L2)
constexpr int64_t MIN_CHUNK_ROWS = 128;         // ... but enough rows to reuse each x load in sgemm
constexpr int64_t MAX_CHUNK_ROWS = 512;

struct Seg {
  int64_t bits, col, byte, blocks;  // width m, first (padded) column, first byte in the row, 32-blocks
};

struct Mx {
  const uint8_t* w;
  const uint8_t* e;
  const Seg* segs;
  int64_t nsegs, N, K, row_bytes, nblocks;
};

// step(eb) = 2^(eb - 127 - (m - 2)) for each E8M0 byte eb, per width m = 4, 6, 8: exact in fp32.
const std::vector<float> kSteps = [] {
  std::vector<float> t(3 * 256);
  for (int k = 0; k < 3; ++k)
    for (int eb = 0; eb < 256; ++eb) t[k * 256 + eb] = std::ldexp(1.0f, eb - 127 - 2 * (k + 1));
  return t;
}();

inline const float* step_table(int64_t bits) { return kSteps.data() + (bits / 2 - 2) * 256; }

}  // namespace

namespace bq_mxint_avx2 {
namespace {

struct V {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float hsum(F v) { return bitquilt_simd::hsum8(v); }
};

// Words 0..7 then 8..15 of the group: 8 lanes, nibble j sign-extended by shifting it to the top and back.
template <class Sink>
inline void group4(const uint8_t* w, const uint8_t* e, const float* step, Sink&& sink) {
  const __m256 s[4] = {_mm256_set1_ps(step[e[0]]), _mm256_set1_ps(step[e[1]]), _mm256_set1_ps(step[e[2]]),
                       _mm256_set1_ps(step[e[3]])};
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(v, 28 - 4 * j), 28);
      sink(8 * half + j, BLOCK * (j / 2) + 16 * (j % 2) + 8 * half, _mm256_mul_ps(_mm256_cvtepi32_ps(q), s[j / 2]));
    }
  }
}

template <class Sink>
inline void block8(const int8_t* q, uint8_t e, const float* step, Sink&& sink) {
  const __m256 s = _mm256_set1_ps(step[e]);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
    sink(k, 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
  }
}

constexpr int MAX_TT = 4;  // 16 ymm registers: 8 accumulators, weights, x

}  // namespace
#include "kernels/mxint_kernel.h"
}  // namespace bq_mxint_avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace bq_mxint_avx512 {
namespace {

struct V {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};

// Per block: the 16 code values times the step, then one vpermps per 16 columns (it reads the low
// 4 bits of each lane, so shifting the word is all the unpacking needed).
template <class Sink>
inline void group4(const uint8_t* w, const uint8_t* e, const float* step, Sink&& sink) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i v = _mm512_loadu_si512(w);
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    const __m512 t = _mm512_mul_ps(codes, _mm512_set1_ps(step[e[b]]));
    sink(2 * b, BLOCK * b, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * b), t));
    sink(2 * b + 1, BLOCK * b + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * b + 4), t));
  }
}

template <class Sink>
inline void block8(const int8_t* q, uint8_t e, const float* step, Sink&& sink) {
  const __m512 s = _mm512_set1_ps(step[e]);
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k)));
    sink(k, 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
  }
}

constexpr int MAX_TT = 8;  // 32 zmm registers: 8 accumulators, tables, weights, x

}  // namespace
#include "kernels/mxint_kernel.h"
}  // namespace bq_mxint_avx512
#pragma GCC pop_options

namespace {

enum Isa : int64_t { AVX2 = 0, AVX512 = 1 };

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// The layout's segments, checked against the weight and exponent tensors.
std::vector<Seg> segments(const at::Tensor& w, const at::Tensor& e, const at::Tensor& segs) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "weights: uint8 [N, bytes]");
  TORCH_CHECK(e.dim() == 2 && e.scalar_type() == at::kByte && e.is_contiguous() && e.size(0) == w.size(0),
              "exponents: uint8 [N, blocks]");
  TORCH_CHECK(segs.dim() == 2 && segs.size(1) == 4 && segs.scalar_type() == at::kLong && segs.is_contiguous(),
              "segments: int64 [S, 4]");
  std::vector<Seg> out(segs.size(0));
  const int64_t* p = segs.data_ptr<int64_t>();
  int64_t col = 0, byte = 0;
  for (auto& s : out) {
    s = Seg{p[0], p[1], p[2], p[3]};
    p += 4;
    TORCH_CHECK((s.bits == 4 || s.bits == 6 || s.bits == 8) && s.col == col && s.byte >= byte && s.blocks > 0 &&
                    (s.bits != 4 || s.blocks % 4 == 0),
                "inconsistent MXINT segment");
    col += s.blocks * BLOCK;
    byte = s.byte + s.blocks * (s.bits == 4 ? BLOCK / 2 : BLOCK);  // segments may be padded apart
  }
  TORCH_CHECK(col == e.size(1) * BLOCK && byte <= w.size(1), "segments do not cover the row");
  return out;
}

Mx view(const at::Tensor& w, const at::Tensor& e, const std::vector<Seg>& segs) {
  return Mx{w.data_ptr<uint8_t>(), e.data_ptr<uint8_t>(), segs.data(), static_cast<int64_t>(segs.size()),
            w.size(0), e.size(1) * BLOCK, w.size(1), e.size(1)};
}

void check_x(const at::Tensor& x, const Mx& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == m.K,
              "x: contiguous fp32 [T, padded in_features]");
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa == AVX2 || (isa == AVX512 && has_avx512()), "MXINT kernel path ", isa, " unavailable");
}

void dequant_rows(const Mx& m, int64_t r0, int64_t r1, float* out, int64_t isa) {
  if (isa == AVX512)
    bq_mxint_avx512::dequant_rows(m, r0, r1, out);
  else
    bq_mxint_avx2::dequant_rows(m, r0, r1, out);
}

// y [T, N] = x [T, K] @ W^T with weights decoded in registers (small batches).
at::Tensor mxint_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& e, const at::Tensor& segs,
                      int64_t isa) {
  check_isa(isa);
  const std::vector<Seg> sv = segments(w, e, segs);
  const Mx m = view(w, e, sv);
  check_x(x, m);
  auto y = at::empty({x.size(0), m.N}, x.options());
  if (isa == AVX512)
    bq_mxint_avx512::gemv(m, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  else
    bq_mxint_avx2::gemv(m, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  return y;
}

// y [T, N] = x [T, K] @ W^T through fp32 row chunks and at::mm (large batches). One parallel region:
// each thread dequantizes chunks of its rows (L2-sized) and multiplies them itself, so there is no
// barrier per chunk (each costs a scheduler quantum on a busy machine) and the chunk is still in L2.
at::Tensor mxint_dequant_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& e,
                                const at::Tensor& segs, int64_t isa) {
  check_isa(isa);
  const std::vector<Seg> sv = segments(w, e, segs);
  const Mx m = view(w, e, sv);
  check_x(x, m);
  const int64_t chunk = std::clamp<int64_t>(CHUNK_FLOATS / m.K, MIN_CHUNK_ROWS, MAX_CHUNK_ROWS);
  auto yt = at::empty({m.N, x.size(0)}, x.options());  // y^T: each chunk's rows are contiguous
  const at::Tensor xt = x.t();
  at::parallel_for(0, m.N, chunk, [&](int64_t begin, int64_t end) {
    auto wf = at::empty({std::min(chunk, end - begin), m.K}, x.options());
    for (int64_t r0 = begin; r0 < end; r0 += chunk) {
      const int64_t r1 = std::min(end, r0 + chunk);
      dequant_rows(m, r0, r1, wf.data_ptr<float>(), isa);
      auto out = yt.narrow(0, r0, r1 - r0);
      at::mm_out(out, wf.narrow(0, 0, r1 - r0), xt);
    }
  });
  return yt.t().contiguous();
}

// The whole weight as fp32 [N, K] in stored (padded) column order: for tests.
at::Tensor mxint_dequantize(const at::Tensor& w, const at::Tensor& e, const at::Tensor& segs, int64_t isa) {
  check_isa(isa);
  const std::vector<Seg> sv = segments(w, e, segs);
  const Mx m = view(w, e, sv);
  auto out = at::empty({m.N, m.K}, w.options().dtype(at::kFloat));
  dequant_rows(m, 0, m.N, out.data_ptr<float>(), isa);
  return out;
}

// out[j] = x[idx[j]], or 0 where idx[j] < 0: AVX2 masked gathers, 8 columns at a time.
void gather_row(const float* x, const int32_t* idx, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i i = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j));
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(i, _mm256_set1_epi32(-1)));
    _mm256_storeu_ps(out + j, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), x, i, valid, 4));
  }
  for (; j < n; ++j) out[j] = idx[j] < 0 ? 0.f : x[idx[j]];
}

// out [T, len(idx)]: out[t, j] = x[t, idx[j]], or 0 where idx[j] < 0 (padding columns).
at::Tensor mxint_gather(const at::Tensor& x, const at::Tensor& idx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kInt && idx.is_contiguous(), "idx: int32 [K']");
  const int64_t T = x.size(0), K = x.size(1), Kp = idx.size(0);
  const int32_t* ip = idx.data_ptr<int32_t>();
  TORCH_CHECK(std::all_of(ip, ip + Kp, [K](int32_t i) { return i < K; }), "gather index out of range");
  auto out = at::empty({T, Kp}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(Kp, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) gather_row(xp + t * K, ip, Kp, op + t * Kp);
  });
  return out;
}

}  // namespace

// Adds the MXINT functions to the extension module (called from its PYBIND11_MODULE).
void register_mxint(pybind11::module& m) {
  m.def("mxint_gemv", &mxint_gemv, "y = x @ W^T for MXINT W, weights decoded in registers (isa: 0 avx2, 1 avx512)");
  m.def("mxint_dequant_matmul", &mxint_dequant_matmul, "y = x @ W^T for MXINT W through fp32 row chunks and at::mm");
  m.def("mxint_dequantize", &mxint_dequantize, "MXINT W as fp32 [N, padded K] (stored column order)");
  m.def("mxint_gather", &mxint_gather, "x[:, idx] with zeros where idx < 0");
  m.def("mxint_has_avx512", &has_avx512, "whether this CPU runs the AVX-512 MXINT path");
}
