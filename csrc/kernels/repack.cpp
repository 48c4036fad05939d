// Kernel layouts cut from a saved weight's bit stream (bitquilt/formats/packing.py: value j of a row at bits
// [b*j, b*j + b) of a little-endian stream of 32-bit words). Done with torch ops one pass at a time, the first call
// of a 1.5B model spent 7 s (int8 layout) to 24 s (bit-planes) here; these loops read each code once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/q4_int8.h"

namespace {

constexpr int64_t VALUES = 32;  // values unpacked at a time: one 256-bit vector of bytes
constexpr int64_t ROW_GRAIN = 16;

// Values [32v, 32v + 32) of a `bits`-bit stream `s` as bytes, in order.
inline __m256i unpack32(const uint8_t* s, int64_t bits) {
  if (bits == 4) {  // 16 bytes, value 2m in the low nibble of byte m
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  }
  if (bits == 2) {  // 8 bytes, value 4m + r at bits 2r of byte m
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i two = _mm_set1_epi8(0x03);
    const __m128i v0 = _mm_and_si128(b, two), v1 = _mm_and_si128(_mm_srli_epi16(b, 2), two);
    const __m128i v2 = _mm_and_si128(_mm_srli_epi16(b, 4), two), v3 = _mm_and_si128(_mm_srli_epi16(b, 6), two);
    const __m128i v01 = _mm_unpacklo_epi8(v0, v1), v23 = _mm_unpacklo_epi8(v2, v3);
    return _mm256_set_m128i(_mm_unpackhi_epi16(v01, v23), _mm_unpacklo_epi16(v01, v23));
  }
  if (bits == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  alignas(32) uint8_t v[VALUES];  // other widths: value by value from a 64-bit window
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t j = 0; j < VALUES; ++j) {
    const int64_t bit = bits * j;
    uint32_t window = s[bit / 8];  // a value of <= 8 bits spans at most 2 bytes (the second read only if it does)
    if (bit % 8 + bits > 8) window |= uint32_t{s[bit / 8 + 1]} << 8;
    v[j] = static_cast<uint8_t>(window >> (bit % 8) & mask);
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
}

// Bytes i < 16: x[i] | x[16 + i] << 4, two 4-bit codes of a 32-byte vector of codes in one byte (16-bit shifts
// leave each byte's code in its byte).
inline __m128i nibble_pairs(__m256i x) {
  return _mm_or_si128(_mm256_castsi256_si128(x), _mm_slli_epi16(_mm256_extracti128_si256(x, 1), 4));
}

// Rows of `bits`-bit values packed in int32 words [R, n*bits/32], each row contiguous (a row slice of a larger
// weight is fine), read byte-wise.
struct PackedRows {
  const uint8_t* data;
  int64_t stride;  // bytes from a row to the next
  int64_t rows;
  const uint8_t* row(int64_t r) const { return data + r * stride; }
};

PackedRows packed_rows(const at::Tensor& words, int64_t bits, int64_t n) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.stride(1) == 1 && n % VALUES == 0 &&
              words.size(1) == n * bits / 32, "words: int32 [rows, n*bits/32] with contiguous rows, n a multiple of "
              "32 that the words hold");
  return {reinterpret_cast<const uint8_t*>(words.data_ptr<int32_t>()), words.stride(0) * 4, words.size(0)};
}

// uint8 [bits, R, n/8] from int32 words [R, n*bits/32] (rows contiguous): bit j of byte p of plane i is bit i of
// value 8p + j, as formats.packing.bit_planes (the reference) computes it.
at::Tensor bit_planes(const at::Tensor& words, int64_t bits, int64_t n) {
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits in 1..8");
  const PackedRows in = packed_rows(words, bits, n);
  const int64_t plane = in.rows * (n / 8);
  auto out = at::empty({bits, in.rows, n / 8}, words.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, in.rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* s = in.row(r);
      uint8_t* dst = o + r * (n / 8);
      if (bits == 1) {  // the stream's bytes are the plane
        std::memcpy(dst, s, n / 8);
        continue;
      }
      for (int64_t v = 0; v < n / VALUES; ++v) {
        const __m256i x = unpack32(s + v * 4 * bits, bits);
        for (int64_t i = 0; i < bits; ++i) {  // bit i of each byte to its top bit (16-bit shifts keep bytes apart)
          const uint32_t m = _mm256_movemask_epi8(_mm256_sll_epi16(x, _mm_cvtsi64_si128(7 - i)));
          std::memcpy(dst + i * plane + v * 4, &m, 4);
        }
      }
    }
  });
  return out;
}

// int8 [R, n] from `bits`-bit two's-complement codes packed in int32 words [R, n*bits/32] (rows contiguous), as
// formats.mxint.unpack_signed (the reference) computes them: value u >= 2^(bits-1) is u - 2^bits.
at::Tensor unpack_signed(const at::Tensor& words, int64_t bits, int64_t n) {
  TORCH_CHECK(bits >= 2 && bits <= 7, "bits in 2..7");
  const PackedRows in = packed_rows(words, bits, n);
  auto out = at::empty({in.rows, n}, words.options().dtype(at::kChar));
  auto* o = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(1 << (bits - 1)));
  at::parallel_for(0, in.rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t v = 0; v < n / VALUES; ++v) {  // (u ^ 2^(b-1)) - 2^(b-1) sign-extends u within its byte
        const __m256i u = unpack32(in.row(r) + v * 4 * bits, bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + r * n + v * VALUES),
                            _mm256_sub_epi8(_mm256_xor_si256(u, sign), sign));
      }
    }
  });
  return out;
}

// uint8 [R, ceil(n/128) * 64]: 4-bit MXINT codes packed in int32 words [R, n/8] (rows contiguous, n a multiple of 32)
// in the MXINT kernel's group order (bitquilt/kernels/mxint.py): byte 4i + b of a 128-column group holds column
// 32b + i in its low nibble and 32b + 16 + i in its high one; a last group's missing blocks are zero.
at::Tensor mxint_pack_nibbles(const at::Tensor& words, int64_t n) {
  const PackedRows in = packed_rows(words, 4, n);
  constexpr int64_t GROUP = 128, GROUP_BYTES = 64;
  const int64_t groups = (n + GROUP - 1) / GROUP, blocks = n / VALUES;
  auto out = at::empty({in.rows, groups * GROUP_BYTES}, words.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, in.rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        __m128i y[4];  // y_b[i] = column 32b + i | column 32b + 16 + i << 4
        for (int64_t b = 0; b < 4; ++b) {
          const int64_t block = 4 * g + b;
          if (block >= blocks) {
            y[b] = _mm_setzero_si128();
            continue;
          }
          y[b] = nibble_pairs(unpack32(in.row(r) + block * 16, 4));
        }
        const __m128i y01l = _mm_unpacklo_epi8(y[0], y[1]), y01h = _mm_unpackhi_epi8(y[0], y[1]);
        const __m128i y23l = _mm_unpacklo_epi8(y[2], y[3]), y23h = _mm_unpackhi_epi8(y[2], y[3]);
        auto* dst = reinterpret_cast<__m128i*>(o + (r * groups + g) * GROUP_BYTES);  // bytes 4i..4i+3: y_0..3[i]
        _mm_storeu_si128(dst, _mm_unpacklo_epi16(y01l, y23l));
        _mm_storeu_si128(dst + 1, _mm_unpackhi_epi16(y01l, y23l));
        _mm_storeu_si128(dst + 2, _mm_unpacklo_epi16(y01h, y23h));
        _mm_storeu_si128(dst + 3, _mm_unpackhi_epi16(y01h, y23h));
      }
    }
  });
  return out;
}

// The 16 columns of 16 rows of bytes: col[c] = (r[0][c], ..., r[15][c]). Four rounds of interleaving pairs of rows
// (bytes, then 2-, 4-, 8-byte units) leave column BITREV4[i] in vector i.
inline void transpose16(const __m128i* r, __m128i* col) {
  static constexpr int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  __m128i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    a[i + 8] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[i + 8] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm_unpacklo_epi32(b[2 * i], b[2 * i + 1]);
    a[i + 8] = _mm_unpackhi_epi32(b[2 * i], b[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    col[BITREV4[i]] = _mm_unpacklo_epi64(a[2 * i], a[2 * i + 1]);
    col[BITREV4[i + 8]] = _mm_unpackhi_epi64(a[2 * i], a[2 * i + 1]);
  }
}

// Writes bit-planes uint8 [k, 32 * tiles, K/8] (`bit_planes`) into `out`, the lookup-table kernel's layout
// [tiles, K/block, k, block/8, 32] (bitquilt/kernels/cpu.py, pack_planes): byte t of a tile's 32 holds its row
// row_of_byte[t], the order csrc/lut_matmul.cpp widens them in. Each plane of a tile is transposed 32 rows x 16
// columns at a time.
void planes_to_tiles(const at::Tensor& planes, int64_t block, const std::vector<int64_t>& row_of_byte,
                     at::Tensor& out) {
  constexpr int64_t TILE = 32, COLS = 16;
  TORCH_CHECK(planes.dim() == 3 && planes.is_contiguous() && planes.scalar_type() == at::kByte &&
              planes.size(1) % TILE == 0, "planes: contiguous uint8 [k, 32 * tiles, K/8]");
  const int64_t k = planes.size(0), rows = planes.size(1), kb = planes.size(2), bb = block / 8, tiles = rows / TILE;
  TORCH_CHECK(row_of_byte.size() == TILE && block % 8 == 0 && kb % bb == 0, "32 rows per tile, K/8 whole blocks");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte && out.numel() == planes.numel(),
              "out: the contiguous uint8 layout of these tiles");
  const uint8_t* in = planes.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const uint8_t* src[TILE];
    __m128i r[TILE], col[TILE];
    for (int64_t tile = t0; tile < t1; ++tile) {
      uint8_t* dst = o + tile * kb * k * TILE;
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t t = 0; t < TILE; ++t) src[t] = in + (i * rows + tile * TILE + row_of_byte[t]) * kb;
        const auto at = [&](int64_t c) { return dst + ((c / bb * k + i) * bb + c % bb) * TILE; };  // column c's 32
        int64_t c0 = 0;
        for (; c0 + COLS <= kb; c0 += COLS) {
          for (int64_t t = 0; t < TILE; ++t) r[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[t] + c0));
          transpose16(r, col);
          transpose16(r + COLS, col + COLS);
          for (int64_t j = 0; j < COLS; ++j) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(at(c0 + j)), col[j]);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(at(c0 + j) + COLS), col[COLS + j]);
          }
        }
        for (; c0 < kb; ++c0) {
          for (int64_t t = 0; t < TILE; ++t) at(c0)[t] = src[t][c0];
        }
      }
    }
  });
}

// Writes rows [r0, r0 + R) of a 4- or 2-bit weight (words [R, k*bits/32], rows contiguous) into `codes`, the
// int8-activation kernel's layout (csrc/q4_int8.h, Weight; bitquilt/kernels/q4_int8.py, Q4Layout): tiles of 32
// rows, [tiles, k*bits/16, 64 bytes], byte 4l + j of a step holding rows l and 16 + l; at 4 bits column 4c + j
// (row l in the low nibble), at 2 bits columns 8c + j (bits 0-1 row l, 2-3 row 16 + l) and 8c + 4 + j (bits 4-7 the
// same). The rows are OR-ed in, so `codes` starts zeroed; r0 is a multiple of 32, so each task writes whole tiles.
void q4_int8_pack_codes(const at::Tensor& words, int64_t r0, int64_t bits, int64_t k, int64_t tiles,
                        at::Tensor& codes) {
  using bitquilt_q4::ROWS;
  TORCH_CHECK((bits == 4 || bits == 2) && k % 64 == 0, "4- or 2-bit codes, k a multiple of 64");
  const PackedRows in = packed_rows(words, bits, k);
  const bitquilt_q4::Weight W{nullptr, nullptr, tiles * ROWS, k, k, static_cast<int>(bits)};  // the geometry only
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.numel() == W.code_bytes() &&
              r0 >= 0 && r0 % ROWS == 0 && r0 + in.rows <= tiles * ROWS,
              "codes: the layout's uint8 buffer, whole tiles of rows within it");
  uint8_t* o = codes.data_ptr<uint8_t>();
  const int64_t steps = VALUES / bitquilt_q4::step_columns(static_cast<int>(bits));  // per 32 columns
  at::parallel_for(0, (in.rows + ROWS - 1) / ROWS, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a * ROWS; r < std::min(in.rows, b * ROWS); ++r) {
      const int64_t row = r0 + r, upper = row % ROWS / 16;
      uint8_t* dst = o + row / ROWS * W.tile_bytes() + 4 * (row % 16);
      for (int64_t v = 0; v < k / VALUES; ++v) {  // 32 columns: 8 steps at 4 bits, 4 at 2, this row's 4 bytes of each
        const __m256i u = unpack32(in.row(r) + v * 4 * bits, bits);
        __m256i bytes;  // step q's 4 bytes of this row at dword q (4 bits) or at the low dword of qword q (2 bits)
        if (bits == 4) {
          bytes = _mm256_slli_epi16(u, static_cast<int>(4 * upper));  // nibbles: no carry across bytes
        } else {  // columns 8c + 4 + j (the qword's high dword) into bits 4-5 of 8c + j's bytes
          bytes = _mm256_slli_epi16(_mm256_or_si256(u, _mm256_slli_epi16(_mm256_srli_epi64(u, 32), 4)),
                                    static_cast<int>(2 * upper));
        }
        alignas(32) uint32_t dwords[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(dwords), bytes);
        for (int64_t q = 0; q < steps; ++q) {
          uint8_t* at = dst + (steps * v + q) * bitquilt_q4::STEP_BYTES;
          uint32_t word;
          std::memcpy(&word, at, 4);
          word |= dwords[bits == 4 ? q : 2 * q];
          std::memcpy(at, &word, 4);
        }
      }
    }
  });
}

}  // namespace

// Adds the repacking functions to the extension module (called from its PYBIND11_MODULE).
void register_repack(pybind11::module& m) {
  m.def("bit_planes", &bit_planes, "bit-planes uint8 [bits, R, n/8] of packed words [R, n*bits/32]",
        pybind11::arg("words"), pybind11::arg("bits"), pybind11::arg("n"));
  m.def("unpack_signed", &unpack_signed, "int8 [R, n] of bits-bit two's-complement codes packed in int32 words",
        pybind11::arg("words"), pybind11::arg("bits"), pybind11::arg("n"));
  m.def("mxint_pack_nibbles", &mxint_pack_nibbles, "4-bit MXINT codes from packed words into the kernel's group order",
        pybind11::arg("words"), pybind11::arg("n"));
  m.def("planes_to_tiles", &planes_to_tiles, "bit-planes [k, 32 * tiles, K/8] into the lookup-table kernel's layout",
        pybind11::arg("planes"), pybind11::arg("block"), pybind11::arg("row_of_byte"), pybind11::arg("out"));
  m.def("q4_int8_pack_codes", &q4_int8_pack_codes,
        "writes rows r0.. of packed 4- or 2-bit words into the int8-activation kernel's code layout",
        pybind11::arg("words"), pybind11::arg("r0"), pybind11::arg("bits"), pybind11::arg("k"),
        pybind11::arg("tiles"), pybind11::arg("codes"));
}
