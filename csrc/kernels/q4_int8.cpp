// 4- and 2-bit uniform weights times int8-quantized activations (AVX2; the AVX-512 VNNI twin in avx512/q4_int8.cpp,
// the AVX-VNNI one in avxvnni/q4_int8.cpp),
// used by bitquilt.kernels.q4_int8.
//
// The bit-plane lookup-table kernel keeps activations exact to 2^-21 at the price of three table limbs per
// plane; a low-bit code can instead multiply an int8 activation directly (vpmaddubsw: unsigned code x signed
// byte, pairs summed in int16; vpdpbusd: four products summed in int32), which is what llama.cpp's Q4 x Q8 dot
// products do. Per token, each block of 32 activations b is rounded to int8, x_c ~ d_b * i_c with
// d_b = max|x_b| / 127; then for row r
//
//   y[r] = sum_g s[r, g] * sum_{b in g} d_b * <q[r, b], i_b>  -  sum_g (s z)[r, g] * X_g,
//   X_g  = sum_{b in g} d_b * sum_{c in b} i_c
//
// which is exactly x_hat @ W^T for the rounded activations x_hat (the only error: |x - x_hat| <= d_b / 2 per
// value); <q, i> is exact on both paths.
//
// The layout (q4_int8.h, Weight) puts two rows' codes in each byte: rows l and 16 + l of a 32-row tile, at the
// same column (4 bits) or at two (2 bits). Masks (and at 2 bits one shift) turn a 64-byte step into vectors of
// codes whose 4-byte lanes are 4 consecutive columns of one row, and those 4 activations, broadcast to every lane
// from one 32-bit load, meet them: each row accumulates in its own lane, the activations stay in column order, and
// a block's activation scale applies once per 32 columns for 32 rows, a group's row scales once per group. Codes
// masked in place rather than shifted down come out multiplied (rows 16-31: x16 at 4 bits on VNNI, x4 at 2 bits);
// the factor joins their row scales once per group, exactly. Per 64 bytes of codes a token costs, on VNNI, a load,
// two masks and two vpdpbusd at 4 bits, a shift, four masks and four vpdpbusd at 2: no conversion or FMA per code,
// which is what lets a batch-1 step keep up with the memory (docs/kernels.md, "Int8-activation kernels"). Prefill
// runs the same loop, two tokens per pass on VNNI (each step's masks serve both); AVX2 decodes a block's codes once
// for up to 16 tokens, so that the decoding is paid once for all of them.
//
// AVX2 adds a block's pair sums in int16 before one vpmaddwd widens them: at 4 bits 8 steps of at most
// 2 * 15 * 128 = 3,840 (the high nibbles shifted down: x16 would overflow), at 2 bits 4 steps of at most
// 2 * 2 * 12 * 128 = 6,144 for the x4 rows; at most 30,720, inside int16.

#include "kernels/q4_int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common/avx2_simd.h"
#include "common/parallel.h"
#include "kernels/int8_round.h"

#ifdef TORCH_EXTENSION_NAME
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#endif

namespace bitquilt_q4 {

namespace {

// The code vectors of one 256-bit half of a step, whose lane l holds rows 8h + l and 16 + 8h + l: codes[upper][w]
// are rows 8h + 16 * upper + l meeting activation word w (4 bits: one word, columns 4c .. 4c + 3, the high nibbles
// shifted down; 2 bits: columns 8c .. 8c + 3, then 8c + 4 .. 8c + 7, rows 16-31 masked in place, x4).
template <int BITS>
struct HalfCodes {
  static constexpr int WORDS = BITS == 4 ? 1 : 2;
  __m256i codes[2][WORDS];
};

template <int BITS>
inline HalfCodes<BITS> half_codes(const uint8_t* p) {
  const __m256i low = _mm256_set1_epi8(BITS == 2 ? 0x03 : 0x0F), high = _mm256_set1_epi8(0x0C);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_srli_epi16(v, 4);
  if constexpr (BITS == 4) {
    return {{{_mm256_and_si256(v, low)}, {_mm256_and_si256(hi, low)}}};
  } else {
    return {{{_mm256_and_si256(v, low), _mm256_and_si256(hi, low)},
             {_mm256_and_si256(v, high), _mm256_and_si256(hi, high)}}};
  }
}

// Up to NT tokens (n of them: strided by K, K / 32 and groups) through one tile of BITS-bit codes (`codes`:
// K / step_columns steps) and its row groups `sz`: out[t * 32 + r]. One token decodes each step as it goes (the
// batch-1 loop, prefetching); several decode a block's 8 steps once into registers spilled to L1 and run every token
// over them, so the shifts and masks are paid once per block instead of once per token.
template <int BITS, int NT>
void tile_tokens(const uint8_t* codes, const uint8_t* sz, const Weight& W, int64_t n, const int8_t* xi,
                 const float* d, const float* X, float* out, [[maybe_unused]] const RowGroupPrefetch& row_groups) {
  constexpr int64_t STEPS = BLOCK / step_columns(BITS);  // per block
  constexpr float HIGH = BITS == 2 ? 0.25f : 1.0f;       // rows 16-31 summed x4 at 2 bits (masked in place)
  const int64_t K = W.K, G = W.groups(), blocks_per_group = W.group / BLOCK;
  const int64_t tokens = NT == 1 ? 1 : n;
  const __m256i ones = _mm256_set1_epi16(1);
  std::fill_n(out, tokens * ROWS, 0.0f);
  const uint8_t* step = codes;
  for (int64_t g = 0; g < G; ++g) {
    __m256 af[NT][4];  // [t][2h + upper]: the group's sums of rows 8h + 16 * upper .., activation scales applied
    for (int64_t t = 0; t < tokens; ++t)
      for (int k = 0; k < 4; ++k) af[t][k] = _mm256_setzero_ps();
    if constexpr (NT == 1) row_groups(sz + g * GROUP_BYTES);
    for (int64_t b = g * blocks_per_group; b < std::min(K / BLOCK, (g + 1) * blocks_per_group);
         ++b, step += STEPS * STEP_BYTES) {
      HalfCodes<BITS> block[NT == 1 ? 1 : STEPS][2];
      if constexpr (NT == 1) prefetch_ahead(step, STEPS);  // the block's lines, in order
      if constexpr (NT > 1)
        for (int64_t c = 0; c < STEPS; ++c)
          for (int h = 0; h < 2; ++h) block[c][h] = half_codes<BITS>(step + c * STEP_BYTES + 32 * h);
      for (int64_t t = 0; t < tokens; ++t) {
        __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};  // int16 pair sums
        for (int64_t c = 0; c < STEPS; ++c) {
          const int8_t* x = xi + t * K + b * BLOCK + c * step_columns(BITS);
          __m256i a[HalfCodes<BITS>::WORDS];
          for (int w = 0; w < HalfCodes<BITS>::WORDS; ++w) a[w] = broadcast_word(x + 4 * w);
          for (int h = 0; h < 2; ++h) {
            const HalfCodes<BITS> q = NT == 1 ? half_codes<BITS>(step + c * STEP_BYTES + 32 * h) : block[c][h];
            for (int upper = 0; upper < 2; ++upper) {
              __m256i sum = _mm256_maddubs_epi16(q.codes[upper][0], a[0]);
              for (int w = 1; w < HalfCodes<BITS>::WORDS; ++w)
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q.codes[upper][w], a[w]));
              pairs[2 * h + upper] = _mm256_add_epi16(pairs[2 * h + upper], sum);
              bitquilt_simd::keep_order(pairs[2 * h + upper]);
            }
          }
        }
        const __m256 D = _mm256_set1_ps(d[t * (K / BLOCK) + b]);
        for (int k = 0; k < 4; ++k)
          af[t][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[k], ones)), D, af[t][k]);
      }
    }
    add_row_group(sz + g * GROUP_BYTES, HIGH, af, tokens, X + g, G, out);
  }
}

template <int BITS>
void tiles_avx2(const Weight& W, int64_t i0, int64_t i1, int64_t T, const int8_t* xi, const float* d, const float* X,
                float* y) {
  for_tiles<PREFILL_TOKENS>(W, i0, i1, T, xi, d, X, y, [&](const uint8_t* codes, const uint8_t* sz, int64_t n,
                                                            const int8_t* x, const float* dt, const float* Xt,
                                                            float* out, const RowGroupPrefetch& row_groups) {
    (n == 1 ? &tile_tokens<BITS, 1> : &tile_tokens<BITS, PREFILL_TOKENS>)(codes, sz, W, n, x, dt, Xt, out,
                                                                          row_groups);
  });
}

}  // namespace

std::string layout_error(int64_t N, int64_t K, int64_t group, int64_t bits, int64_t w_bytes, int64_t sz_bytes) {
  if (K % 64 || group % 64 || group <= 0) return "columns and group size must be multiples of 64";
  if (bits != 4 && bits != 2) return "codes of 4 or 2 bits, not " + std::to_string(bits);
  const Weight W{nullptr, nullptr, N, K, group, static_cast<int>(bits)};
  if (w_bytes != W.code_bytes()) return "packed codes do not match the shape";
  if (sz_bytes != W.scale_bytes()) return "scales do not match the shape";
  return "";
}

void row_into(const Weight& W, int64_t r, float* out) {
  const int64_t lane = r % 16, upper = r % ROWS / 16;
  const uint8_t* codes = W.tile_codes(r / ROWS);
  for (int64_t c = 0; c < W.K / 4; ++c)  // step c: columns 4c + j, row r's nibble in byte 4 * lane + j
    for (int64_t j = 0; j < 4; ++j)
      out[4 * c + j] = static_cast<float>((codes[c * STEP_BYTES + 4 * lane + j] >> (4 * upper)) & 15);
  const uint8_t* sz = W.tile_scales(r / ROWS);
  for (int64_t g = 0; g < W.groups(); ++g) {
    uint16_t half;
    std::memcpy(&half, sz + g * GROUP_BYTES + 2 * (r % ROWS), 2);
    const float s = _cvtsh_ss(half), z = sz[g * GROUP_BYTES + 2 * ROWS + r % ROWS];
    for (int64_t c = g * W.group; c < std::min(W.K, (g + 1) * W.group); ++c) out[c] = s * out[c] - s * z;
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

bool isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case ISA_AVX2:
      return true;
    case ISA_AVXVNNI:
      return __builtin_cpu_supports("avxvnni");
    case ISA_AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
    default:
      return false;
  }
}

namespace {

int widest_isa() {
  int isa = ISA_AVX512;
  while (!isa_supported(isa)) --isa;
  return isa;
}

int g_isa = widest_isa();

}  // namespace

int active_isa() { return g_isa; }

bool set_isa(int isa) {
  if (!isa_supported(isa)) return false;
  g_isa = isa;
  return true;
}

namespace {

// The tile loop of path `isa` for BITS-bit codes.
template <int BITS>
auto tiles_on(int isa) {
  return isa == ISA_AVX512 ? &tiles_vnni<BITS> : isa == ISA_AVXVNNI ? &tiles_avxvnni<BITS> : &tiles_avx2<BITS>;
}

}  // namespace

void matmul_into(const float* x, int64_t T, const Weight& W, float* y) {
  const bitquilt_int8::RoundedTokens a(x, T, W.K, W.group);
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / W.tile_bytes());  // tiles per task: ~32 KB of codes
  const auto tiles = W.bits == 4 ? tiles_on<4>(g_isa) : tiles_on<2>(g_isa);
  bitquilt_par::parallel_for(0, W.tiles(), grain, [&](int64_t i0, int64_t i1) {
    tiles(W, i0, i1, T, a.codes.data(), a.d.data(), a.X.data(), y);
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
        "y = x_hat @ W^T for 4- or 2-bit uniform W, x_hat = x rounded to int8 per block of 32 (AVX2 maddubs, "
        "AVX-VNNI or AVX-512 VNNI)");
  m.def("q4_int8_isa_supported", &bitquilt_q4::isa_supported,
        "whether the CPU runs path `isa` (0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI)");
  m.def("q4_int8_active_isa", &bitquilt_q4::active_isa, "the path the int8-activation kernels take (as above)");
  m.def("q4_int8_set_isa", [](int isa) {
    TORCH_CHECK(bitquilt_q4::set_isa(isa), "int8-activation kernel path ", isa, " is not supported by this CPU");
  }, "take path `isa` (0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI)");
}
#endif
