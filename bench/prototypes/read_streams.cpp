// Ad hoc: one thread's streaming read of cold buffers (huge pages) cut into 1, 2 or 4 streams read side by side, with
// and without a software prefetch, and paced like a kernel (WORK dependent vpaddw per 64 bytes); median over rounds.
// On Zen 4 (2026-12-05, three runs, 8 MB and 1.2 MB buffers): two or four streams read no faster than one (plain
// 33.1-35.1 GB/s against 33.7-34.0); paced by six adds per 64 bytes, one stream read 32.0-33.2 GB/s prefetching 8 KB
// ahead and 31.0-31.3 without (docs/benchmarks.md, "Where the last points at 1536² go"). On an Intel Xeon (family 6
// model 207, 2026-12-05, 1 MB buffers): paced by 6 / 12 adds, 16.5 / 15.1 GB/s prefetching 2 KB ahead into L1 against
// 18.0 unpaced; with each line also prefetched 4 or 8 KB ahead into L2 and the L1 prefetch at 1 KB, 18.1-18.4 / 17.5
// (unpaced 18.8) ("Prefetching into L2 as well, on Intel").
//
//     g++ -O3 -mavx2 bench/prototypes/read_streams.cpp -o /tmp/read_streams && /tmp/read_streams 8192   # KB per buffer

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "prototype_memory.h"

namespace {

// S streams (the buffer cut in S equal parts) read side by side, 64 bytes of each per step, each 64 bytes followed
// by WORK dependent vpaddw (a kernel's pace) and, when `ahead`, a prefetch that many bytes on into L1 (and when `far`,
// one that many bytes on into L2).
template <int S, int WORK>
__attribute__((noinline)) int64_t read_pass(const uint8_t* p, size_t n, size_t ahead, size_t far) {
  __m256i acc[S][2];
  for (int s = 0; s < S; ++s) acc[s][0] = acc[s][1] = _mm256_setzero_si256();
  const size_t part = n / S;
  for (size_t i = 0; i < part; i += 64) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * part + i;
      if (far) _mm_prefetch(reinterpret_cast<const char*>(q + far), _MM_HINT_T1);
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T0);
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
      for (int w = 0; w < WORK; ++w) {
        a = _mm256_add_epi16(a, b);
        asm volatile("" : "+x"(a));  // one add after the other, as a kernel's dependent work
      }
      acc[s][0] = _mm256_or_si256(acc[s][0], a);
      acc[s][1] = _mm256_or_si256(acc[s][1], b);
    }
  }
  __m256i all = _mm256_setzero_si256();
  for (int s = 0; s < S; ++s) all = _mm256_or_si256(all, _mm256_or_si256(acc[s][0], acc[s][1]));
  return _mm256_extract_epi64(all, 0);
}

struct Variant {
  const char* name;
  int64_t (*pass)(const uint8_t*, size_t, size_t, size_t);
  size_t ahead, far;
};

}  // namespace

int main(int argc, char** argv) {
  const size_t n = static_cast<size_t>(argc > 1 ? std::atoi(argv[1]) : 8192) * 1024;
  const int copies = std::max<int>(8, static_cast<int>((320u << 20) / n));  // each pass reads a cold buffer
  std::vector<uint8_t*> buffers;
  for (int i = 0; i < copies; ++i) buffers.push_back(huge_pages(n));
  const std::vector<Variant> variants = {
      {"1 plain", read_pass<1, 0>, 0, 0},          {"1 2 KB ahead", read_pass<1, 0>, 2048, 0},
      {"1 8 KB ahead", read_pass<1, 0>, 8192, 0},  {"1 1 KB + L2 8 KB", read_pass<1, 0>, 1024, 8192},
      {"2 plain", read_pass<2, 0>, 0, 0},          {"2 4 KB ahead", read_pass<2, 0>, 4096, 0},
      {"4 plain", read_pass<4, 0>, 0, 0},          {"1 paced plain", read_pass<1, 6>, 0, 0},
      {"1 paced 2 KB", read_pass<1, 6>, 2048, 0},  {"1 paced 8 KB", read_pass<1, 6>, 8192, 0},
      {"1 paced 1 KB + L2 4 KB", read_pass<1, 6>, 1024, 4096},
      {"1 paced 1 KB + L2 8 KB", read_pass<1, 6>, 1024, 8192},
      {"1 paced12 2 KB", read_pass<1, 12>, 2048, 0},
      {"1 paced12 1 KB + L2 8 KB", read_pass<1, 12>, 1024, 8192},
      {"2 paced plain", read_pass<2, 6>, 0, 0},    {"2 paced 4 KB", read_pass<2, 6>, 4096, 0},
      {"2 paced 8 KB", read_pass<2, 6>, 8192, 0},  {"4 paced plain", read_pass<4, 6>, 0, 0},
      {"4 paced 4 KB", read_pass<4, 6>, 4096, 0}};
  std::vector<std::vector<double>> seconds(variants.size());
  volatile int64_t sink = 0;
  int next = 0;
  for (int round = 0; round < 41; ++round)
    for (size_t v = 0; v < variants.size(); ++v) {
      const double start = thread_seconds();
      sink = sink + variants[v].pass(buffers[next++ % copies], n, variants[v].ahead, variants[v].far);
      seconds[v].push_back(thread_seconds() - start);
    }
  std::printf("streams, pacing, prefetch: GB/s (median of 41)\n");
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(seconds[v].begin(), seconds[v].end());
    std::printf("%-26s %5.1f\n", variants[v].name, n / seconds[v][seconds[v].size() / 2] / 1e9);
  }
}
