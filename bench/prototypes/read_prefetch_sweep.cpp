// Ad hoc: one thread's streaming read of cold 8 MB buffers (huge pages) with a software prefetch of every cache line
// at several distances and two hints, against the plain read (the hardware prefetchers alone); median over rounds.
// On Zen 4 (2026-12-05, two runs) every T0 pass ran slower than the plain one (24-32 GB/s at 2-16 KB ahead against
// 32-36; T1 only at 2 KB came close), so a batch-1 kernel that needs the prefetch (its own loads are too few ahead of it for the
// hardware prefetcher) is held below the plain read by the prefetch itself; bench/kernel_speed.py --int8 reports
// both passes per shape.
//
//     g++ -O3 -mavx2 bench/prototypes/read_prefetch_sweep.cpp -o /tmp/read_prefetch_sweep && /tmp/read_prefetch_sweep

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "prototype_memory.h"

namespace {

// csrc/kernels/read_rate.cpp's pass, the prefetch hint a template argument
template <int HINT>
__attribute__((noinline)) int64_t read_pass(const uint8_t* p, size_t n, size_t ahead) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 128) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead), static_cast<_mm_hint>(HINT));
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead + 64), static_cast<_mm_hint>(HINT));
    }
    a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_or_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  return _mm256_extract_epi64(_mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d)), 0);
}

}  // namespace

int main() {
  const size_t n = 8 << 20;
  const int copies = 40;  // 320 MB: each pass reads a buffer the last 39 passes did not
  std::vector<uint8_t*> buffers;
  for (int i = 0; i < copies; ++i) buffers.push_back(huge_pages(n));
  volatile int64_t sink = 0;
  for (const int t1 : {0, 1})
    for (const size_t ahead : {0, 2048, 4096, 8192, 16384}) {
      std::vector<double> seconds;
      for (int r = 0; r < 3 * copies; ++r) {
        const double start = thread_seconds();
        sink = sink + (t1 ? read_pass<_MM_HINT_T1>(buffers[r % copies], n, ahead)
                          : read_pass<_MM_HINT_T0>(buffers[r % copies], n, ahead));
        seconds.push_back(thread_seconds() - start);
      }
      std::sort(seconds.begin(), seconds.end());
      std::printf("%s %5zu bytes ahead: %.1f GB/s\n", ahead ? (t1 ? "T1" : "T0") : "plain", ahead,
                  n / seconds[seconds.size() / 2] / 1e9);
    }
  return 0;
}
