// plane_int8.h's product on AVX-512 VNNI + VBMI. Per tile of 32 rows and block of 32 columns, each plane's packed
// bytes (one per row, 8 columns of it; lut_parts.cpp's layout) are spread to 0/1 bytes, four vectors per 8 columns:
// vpermb copies row byte j into bytes 4j..4j+3 and a mask keeps bit q of byte 4j+q, so lane j holds 4 columns of one
// row, as vpdpbusd wants them. Those 16 vectors stay in registers while up to TOKENS tokens pass: per token 16
// vpdpbusd, its 4 activation codes per instruction broadcast from memory, give each row's exact integer sum P for
// the plane, weighted by the plane's coefficients in fp32; the block's sum is scaled by the token's block scale,
// and a group's constant term C0 * X added once. Lanes hold rows in the packed byte order (row_of_byte); the
// coefficients are permuted into it, and a tile's results back into row order as they are stored.
//
// This file is compiled for AVX-512 VNNI + VBMI (pragma below, after every include); its entry point runs only where
// vnni_path().

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>  // before the target pragma: broadcast_word.h's includes are then no-ops
#include <vector>

#include "kernels/plane_int8.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,avx2,f16c")

#include "kernels/avx512/broadcast_word.h"  // built for this target (its header comment)

namespace bitquilt_plane8 {

namespace {

using bitquilt_lut::Coef;
using bitquilt_lut::Part;
using bitquilt_lut::TILE;

constexpr int64_t BLOCK = 32;   // columns per activation scale (int8_round.h)
constexpr int64_t TOKENS = 16;  // tokens per pass over a block: its planes are spread once for them all
constexpr int64_t CHUNKS = BLOCK / 8;

// The tile row that byte j of a packed 32-byte vector holds (bitquilt.kernels.cpu._row_of_byte).
constexpr int row_of_byte(int j) { return 8 * (((j & 1) << 1) | ((j >> 3) & 1)) + (j >> 4) * 4 + ((j >> 1) & 3); }

struct Constants {
  __m512i spread_lo, spread_hi;  // vpermb indices: byte 4j + q <- row byte j (lanes 0-15), 16 + j (lanes 16-31)
  __m512i bits_lo, bits_hi;      // byte 4j + q keeps bit q (columns 0-3 of 8) or bit 4 + q (columns 4-7)
  __m512i one;
  __m512i to_bytes_lo, to_bytes_hi;  // permutex2var: rows in row order -> lanes of bytes 0-15 / 16-31
  __m512i to_rows_lo, to_rows_hi;    // and back
  Constants() {
    alignas(64) uint8_t a[64], b[64], lo[64], hi[64];
    for (int j = 0; j < 16; ++j)
      for (int q = 0; q < 4; ++q) {
        a[4 * j + q] = static_cast<uint8_t>(j);
        b[4 * j + q] = static_cast<uint8_t>(16 + j);
        lo[4 * j + q] = static_cast<uint8_t>(1 << q);
        hi[4 * j + q] = static_cast<uint8_t>(16 << q);
      }
    spread_lo = _mm512_load_si512(a);
    spread_hi = _mm512_load_si512(b);
    bits_lo = _mm512_load_si512(lo);
    bits_hi = _mm512_load_si512(hi);
    one = _mm512_set1_epi8(1);
    alignas(64) int32_t rb[32], br[32];
    for (int j = 0; j < 32; ++j) {
      rb[j] = row_of_byte(j);
      br[row_of_byte(j)] = j;
    }
    to_bytes_lo = _mm512_load_si512(rb);
    to_bytes_hi = _mm512_load_si512(rb + 16);
    to_rows_lo = _mm512_load_si512(br);
    to_rows_hi = _mm512_load_si512(br + 16);
  }
};

// 32 rows' values in row order (lo: rows 0-15, hi: 16-31) -> the lanes of packed bytes 0-15 and 16-31.
inline void to_bytes(const Constants& k, __m512 lo, __m512 hi, __m512 out[2]) {
  out[0] = _mm512_permutex2var_ps(lo, k.to_bytes_lo, hi);
  out[1] = _mm512_permutex2var_ps(lo, k.to_bytes_hi, hi);
}

inline __m512 half16(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A part's coefficients for one (tile, group) in byte order: c[0] = C0, c[1 + i] = C_{i+1} (two vectors each).
void coefficients(const Constants& k, const Part& p, const char* cg, __m512 (*c)[2]) {
  if (p.mode == Coef::planes) {  // fp16 [k + 1][32]
    for (int64_t i = 0; i <= p.s.k; ++i) to_bytes(k, half16(cg + 64 * i), half16(cg + 64 * i + 32), c[i]);
    return;
  }
  __m512 s[2], neg_sz[2];
  if (p.mode == Coef::uniform32) {  // fp32 s [32], -s z [32]
    const float* f = reinterpret_cast<const float*>(cg);
    to_bytes(k, _mm512_loadu_ps(f), _mm512_loadu_ps(f + 16), s);
    to_bytes(k, _mm512_loadu_ps(f + 32), _mm512_loadu_ps(f + 48), neg_sz);
  } else {  // fp16 s [32], uint8 z [32]
    const auto z16 = [&](int h) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + 64 + 16 * h))));
    };
    const __m512 s_lo = half16(cg), s_hi = half16(cg + 32);
    to_bytes(k, s_lo, s_hi, s);
    const __m512 minus = _mm512_set1_ps(-0.f);
    to_bytes(k, _mm512_xor_ps(_mm512_mul_ps(s_lo, z16(0)), minus), _mm512_xor_ps(_mm512_mul_ps(s_hi, z16(1)), minus),
             neg_sz);
  }
  for (int h = 0; h < 2; ++h) {
    c[0][h] = neg_sz[h];
    for (int64_t i = 1; i <= p.s.k; ++i) c[i][h] = _mm512_mul_ps(s[h], _mm512_set1_ps(static_cast<float>(1 << (i - 1))));
  }
}

// A plane's 32 bytes (8 columns of the tile's rows) as 0/1 bytes: v[0] bytes 0-15 columns 0-3, v[1] columns 4-7,
// v[2], v[3] the same for bytes 16-31.
inline void spread(const Constants& k, const uint8_t* w, __m512i* v) {
  const __m512i raw = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i a = _mm512_permutexvar_epi8(k.spread_lo, raw), b = _mm512_permutexvar_epi8(k.spread_hi, raw);
  v[0] = _mm512_min_epu8(_mm512_and_si512(a, k.bits_lo), k.one);
  v[1] = _mm512_min_epu8(_mm512_and_si512(a, k.bits_hi), k.one);
  v[2] = _mm512_min_epu8(_mm512_and_si512(b, k.bits_lo), k.one);
  v[3] = _mm512_min_epu8(_mm512_and_si512(b, k.bits_hi), k.one);
}

}  // namespace

void tiles_vnni(const std::vector<Part>& parts, int64_t N, int64_t i0, int64_t i1, int64_t T, const int8_t* codes,
                const float* d, const float* X, float* y) {
  static const Constants k;
  const bitquilt_lut::Shape& s = parts.front().s;
  const int64_t K = s.K, G = s.groups(), blocks = K / BLOCK, plane_bytes = s.block * 4;
  __m512 plane_coef[MAX_PLANES][2];  // a group's C_i of every plane of every part, in order
  alignas(64) float out[TOKENS][TILE], F[TOKENS][TILE];
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t t0 = 0; t0 < T; t0 += TOKENS) {
      const int64_t nt = std::min(TOKENS, T - t0);
      std::fill(&out[0][0], &out[0][0] + nt * TILE, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        __m512 c0[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t pl = 0;
        for (const Part& p : parts) {
          __m512 c[9][2];  // C0..Ck
          coefficients(k, p, p.coef + (i * G + g) * p.coef_group, c);
          for (int h = 0; h < 2; ++h) c0[h] = _mm512_add_ps(c0[h], c[0][h]);
          for (int64_t j = 1; j <= p.s.k; ++j, ++pl)
            for (int h = 0; h < 2; ++h) plane_coef[pl][h] = c[j][h];
        }
        for (int64_t t = 0; t < nt; ++t) {
          const __m512 xg = _mm512_set1_ps(X[(t0 + t) * G + g]);
          for (int h = 0; h < 2; ++h)
            _mm512_store_ps(out[t] + 16 * h, _mm512_fmadd_ps(c0[h], xg, _mm512_load_ps(out[t] + 16 * h)));
        }
        const int64_t col_end = std::min(K, (g + 1) * s.group);
        for (int64_t col = g * s.group; col < col_end; col += BLOCK) {
          std::fill(&F[0][0], &F[0][0] + nt * TILE, 0.f);
          pl = 0;
          for (const Part& p : parts) {
            const uint8_t* wb = p.w + i * p.s.tile_bytes() + col / s.block * p.s.k * plane_bytes + col % s.block * 4;
            for (int64_t j = 0; j < p.s.k; ++j, ++pl) {
              __m512i v[4 * CHUNKS];
              for (int64_t c = 0; c < CHUNKS; ++c) spread(k, wb + j * plane_bytes + 32 * c, v + 4 * c);
              const __m512 cl = plane_coef[pl][0], ch = plane_coef[pl][1];
              for (int64_t t = 0; t < nt; ++t) {
                const int8_t* xc = codes + (t0 + t) * K + col;
                __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t c = 0; c < CHUNKS; ++c) {
                  const __m512i lo = bitquilt_avx512::broadcast_word_512(xc + 8 * c),
                                hi = bitquilt_avx512::broadcast_word_512(xc + 8 * c + 4);
                  a0 = _mm512_dpbusd_epi32(a0, v[4 * c], lo);
                  a1 = _mm512_dpbusd_epi32(a1, v[4 * c + 1], hi);
                  a2 = _mm512_dpbusd_epi32(a2, v[4 * c + 2], lo);
                  a3 = _mm512_dpbusd_epi32(a3, v[4 * c + 3], hi);
                }
                _mm512_store_ps(F[t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), cl,
                                                      _mm512_load_ps(F[t])));
                _mm512_store_ps(F[t] + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a2, a3)), ch,
                                                           _mm512_load_ps(F[t] + 16)));
              }
            }
          }
          for (int64_t t = 0; t < nt; ++t) {
            const __m512 db = _mm512_set1_ps(d[(t0 + t) * blocks + col / BLOCK]);
            for (int h = 0; h < 2; ++h)
              _mm512_store_ps(out[t] + 16 * h, _mm512_fmadd_ps(_mm512_load_ps(F[t] + 16 * h), db,
                                                               _mm512_load_ps(out[t] + 16 * h)));
          }
        }
      }
      const int64_t rows = std::min(TILE, N - i * TILE);
      const __mmask16 m_lo = rows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1);
      const __mmask16 m_hi = rows <= 16 ? 0 : rows >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (rows - 16)) - 1);
      for (int64_t t = 0; t < nt; ++t) {
        const __m512 lo = _mm512_load_ps(out[t]), hi = _mm512_load_ps(out[t] + 16);
        float* dst = y + (t0 + t) * N + i * TILE;
        _mm512_mask_storeu_ps(dst, m_lo, _mm512_permutex2var_ps(lo, k.to_rows_lo, hi));
        _mm512_mask_storeu_ps(dst + 16, m_hi, _mm512_permutex2var_ps(lo, k.to_rows_hi, hi));
      }
    }
  }
}

}  // namespace bitquilt_plane8

#pragma GCC pop_options
