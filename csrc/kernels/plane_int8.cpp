// The int8-activation bit-plane matmul's entry point (plane_int8.h): the VNNI tiles where the CPU takes that path,
// else the lookup-table kernel on the rounded activations.

#include "kernels/plane_int8.h"

#include <algorithm>

#include "common/parallel.h"
#include "kernels/int8_round.h"
#include "kernels/q4_int8.h"

namespace bitquilt_plane8 {

bool vnni_path() {
  static const bool vbmi = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vbmi"));
  return vbmi && bitquilt_q4::active_isa() == bitquilt_q4::ISA_AVX512;
}

void matmul_into(const float* x, int64_t T, const std::vector<bitquilt_lut::Part>& parts, int64_t N, float* y) {
  const bitquilt_lut::Shape& s = parts.front().s;
  const bitquilt_int8::RoundedTokens a(x, T, s.K, s.group);
  int64_t planes = 0;
  for (const bitquilt_lut::Part& p : parts) planes += p.s.k;
  if (vnni_path() && planes <= MAX_PLANES) {
    bitquilt_par::parallel_for(0, s.tiles(), 1, [&](int64_t i0, int64_t i1) {
      tiles_vnni(parts, N, i0, i1, T, a.codes.data(), a.d.data(), a.X.data(), y);
    });
    return;
  }
  const int64_t blocks = s.K / bitquilt_int8::BLOCK;
  std::vector<float> rounded(T * s.K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t j = 0; j < bitquilt_int8::BLOCK; ++j) {
        const int64_t c = t * s.K + b * bitquilt_int8::BLOCK + j;
        rounded[c] = a.d[t * blocks + b] * static_cast<float>(a.codes[c]);
      }
  bitquilt_lut::lut_parts_into(rounded.data(), T, parts, N, {}, y);
}

}  // namespace bitquilt_plane8
