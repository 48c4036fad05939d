// Ad hoc: the batch-1 int8-activation kernels timed in C, as the fused decode step and the standalone runtime call
// them (no Python call, no tensor allocation per call), on weights in cache (hot), on cold copies, and against one
// streaming read of a cold buffer of the same bytes (the ceiling), the kernel and the read alternating, median thread
// CPU time. Build against a source tree (the repository's, or an edited copy to compare):
//
//     g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -fopenmp -I csrc bench/prototypes/c_kernel_timing.cpp
//         csrc/kernels/{q4_int8,avx512/q4_int8,avxvnni/q4_int8,uniform8_gemv,avx512/uniform8}.cpp -o /tmp/c_kernel_timing
//         (one command)
//     OMP_NUM_THREADS=1 /tmp/c_kernel_timing 4      # 4-bit codes, group 128 (2: 2-bit, group 64; 8: the 8-bit GEMV)
//
// Each of the int8 kernels' paths the CPU runs (AVX2; AVX-512 VNNI where present), qwen2.5-1.5b's shapes and 4096²
// for 4 and 2 bits, a small and two LM-head-like shapes for 8 bits. Codes are random (scales too: the timing does
// not depend on them), the layouts (and the read buffers) on huge pages, as kernels.layout_empty allocates them.

#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "prototype_memory.h"
#include "kernels/q4_int8.h"
#include "kernels/uniform8.h"

namespace {

int64_t read_pass(const uint8_t* p, size_t n) {  // csrc/kernels/read_rate.cpp's plain pass
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 128) {
    a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_or_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  return _mm256_extract_epi64(_mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d)), 0);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One shape: `run(copy)` multiplies one token by weight copy `copy` (0 the hot one); `nbytes` per copy.
template <typename Run>
void measure(const char* shape, const char* path, size_t nbytes, int copies, const Run& run,
             const std::vector<uint8_t*>& buffers) {
  for (int i = 0; i < 10; ++i) run(0);
  const int reps = std::max(20, static_cast<int>(3e8 / nbytes));
  const double t0 = thread_seconds();
  for (int i = 0; i < reps; ++i) run(0);
  const double hot = (thread_seconds() - t0) / reps;
  std::vector<double> kernel, read;
  volatile int64_t sink = 0;
  for (int r = 0; r < 3 * copies; ++r) {
    const double a = thread_seconds();
    run(1 + r % (copies - 1));
    const double b = thread_seconds();
    sink = sink + read_pass(buffers[r % buffers.size()], nbytes / 128 * 128);
    kernel.push_back(b - a);
    read.push_back(thread_seconds() - b);
  }
  const double cold = median(kernel), ceiling = median(read);
  std::printf("%-11s %-6s hot %5.1f GB/s  cold %5.1f GB/s  ceiling %5.1f GB/s  %3.0f%%\n", shape, path,
              nbytes / hot / 1e9, nbytes / cold / 1e9, nbytes / ceiling / 1e9, 100 * ceiling / cold);
}

}  // namespace

int main(int argc, char** argv) {
  const int bits = argc > 1 ? std::atoi(argv[1]) : 4;
  if (bits != 4 && bits != 2 && bits != 8) {
    std::fprintf(stderr, "usage: %s 4|2|8\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(1);
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      bits == 8 ? std::vector<std::pair<int64_t, int64_t>>{{2048, 1536}, {49152, 576}, {32768, 1536}}
                : std::vector<std::pair<int64_t, int64_t>>{{1536, 1536}, {8960, 1536}, {1536, 8960}, {4096, 4096}};
  for (const auto& [N, K] : shapes) {
    std::vector<float> x(K), y(N);
    for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e-3f;
    char shape[32];
    std::snprintf(shape, sizeof shape, "%ldx%ld", static_cast<long>(N), static_cast<long>(K));
    if (bits == 8) {
      const int64_t G = (K + 127) / 128;
      const size_t nbytes = N * K + 8 * N * G;
      const int copies = std::max(3, static_cast<int>(3e8 / nbytes));
      std::vector<bitquilt_u8::Weight> weights;
      std::vector<uint8_t*> buffers;
      for (int c = 0; c < copies; ++c) {
        uint8_t* q = huge_pages(N * K);
        for (int64_t i = 0; i < N * K; ++i) q[i] = static_cast<uint8_t>(rng());
        auto* s = reinterpret_cast<float*>(huge_pages(4 * N * G));
        auto* sz = reinterpret_cast<float*>(huge_pages(4 * N * G));
        std::fill_n(s, N * G, 0.01f);
        std::fill_n(sz, N * G, 1.28f);
        weights.push_back({q, s, sz, N, K, 128});
        buffers.push_back(huge_pages(nbytes));
      }
      for (int vnni = 0; vnni <= static_cast<int>(bitquilt_q4::isa_supported(bitquilt_q4::ISA_AVX512)); ++vnni) {
        bitquilt_q4::set_isa(vnni ? bitquilt_q4::ISA_AVX512 : bitquilt_q4::ISA_AVX2);  // the int8 kernels' one switch
        measure(shape, vnni ? "vnni" : "avx2", nbytes, copies,
                [&](int c) { bitquilt_u8::gemv_int8_into(x.data(), 1, weights[c], y.data()); }, buffers);
      }
      continue;
    }
    const int64_t group = bits == 4 ? 128 : 64;
    const bitquilt_q4::Weight shape_of{nullptr, nullptr, N, K, group, bits};
    const size_t code_bytes = shape_of.code_bytes(), scale_bytes = shape_of.scale_bytes(),
                 nbytes = code_bytes + scale_bytes;
    const int copies = std::max(3, static_cast<int>(2e8 / nbytes));
    std::vector<bitquilt_q4::Weight> weights;
    std::vector<uint8_t*> buffers;
    for (int c = 0; c < copies; ++c) {
      uint8_t* w = huge_pages(code_bytes);
      uint8_t* sz = huge_pages(scale_bytes);
      for (size_t i = 0; i < code_bytes; ++i) w[i] = static_cast<uint8_t>(rng());
      const int64_t rows = bitquilt_q4::ROWS, group_bytes = bitquilt_q4::GROUP_BYTES;  // a tile's row group
      for (size_t g = 0; g < scale_bytes / group_bytes; ++g)
        for (int64_t r = 0; r < rows; ++r) {  // fp16 scales, then uint8 zeros
          const uint16_t h = _cvtss_sh(0.01f + static_cast<float>(rng() % 100) * 1e-4f, 0);
          std::memcpy(sz + g * group_bytes + 2 * r, &h, 2);
          sz[g * group_bytes + 2 * rows + r] = static_cast<uint8_t>(rng() % (1 << bits));
        }
      weights.push_back({w, sz, N, K, group, bits});
      buffers.push_back(huge_pages(nbytes));
    }
    for (int vnni = 0; vnni <= static_cast<int>(bitquilt_q4::isa_supported(bitquilt_q4::ISA_AVX512)); ++vnni) {
      bitquilt_q4::set_isa(vnni ? bitquilt_q4::ISA_AVX512 : bitquilt_q4::ISA_AVX2);
      measure(shape, vnni ? "vnni" : "avx2", nbytes, copies,
              [&](int c) { bitquilt_q4::matmul_into(x.data(), 1, weights[c], y.data()); }, buffers);
    }
  }
  return 0;
}
