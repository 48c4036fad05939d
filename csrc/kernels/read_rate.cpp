// The read-bandwidth ceiling the kernel benchmarks compare against (bench/kernel_speed.py): one streaming pass over a
// buffer that does as little as a read can, four 256-bit loads OR-ed into four accumulators per step. A batch-1
// matmul reads its weights once, so this pass's bytes per second bound its rate on the same thread and data.
// (torch.sum of fp32, the ceiling used before, adds per element and ran below what the AVX-512 kernels reach.)
// Both it and the int8 kernel can also be timed here, in C (`*_seconds`: thread CPU time around the call alone), as
// the fused decode step and the standalone runtime call the kernel: without the Python binding, the checks and the
// output's allocation, which are a visible share of a small call.

#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <time.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "common/stream_prefetch.h"
#include "kernels/q4_int8.h"

namespace {

// OR of every 64-bit word of `t` (contiguous; a multiple of 128 bytes), returned so the pass cannot be elided.
// `near` > 0: each 128-byte step also prefetches its two cache lines that many bytes ahead into L1, and `far` > 0
// that many bytes ahead into L2, as the batch-1 kernels do (stream_prefetch.h); on some CPUs the hardware
// prefetcher alone leaves a plain pass below what those kernels reach.
int64_t read_pass(const at::Tensor& t, int64_t near, int64_t far) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 128 == 0, "a contiguous buffer of a multiple of 128 bytes");
  TORCH_CHECK(near >= 0 && far >= 0, "prefetch distances must be >= 0 bytes");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const size_t n = t.nbytes();
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 128) {
    for (int line = 0; line < 2; ++line) {  // past the end is harmless: a prefetch never faults
      if (far) _mm_prefetch(reinterpret_cast<const char*>(p + i + far + 64 * line), _MM_HINT_T1);
      if (near) _mm_prefetch(reinterpret_cast<const char*>(p + i + near + 64 * line), _MM_HINT_T0);
    }
    a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_or_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i all = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
  return _mm256_extract_epi64(all, 0) | _mm256_extract_epi64(all, 1) | _mm256_extract_epi64(all, 2) |
         _mm256_extract_epi64(all, 3);
}

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Thread CPU seconds of one read_pass.
double read_pass_seconds(const at::Tensor& t, int64_t near, int64_t far) {
  const double start = thread_seconds();
  volatile int64_t sink = read_pass(t, near, far);
  static_cast<void>(sink);
  return thread_seconds() - start;
}

// Thread CPU seconds of one int8-activation matmul of x [T, K] by the layout (q4_int8_matmul's arguments), the
// output allocated before the clock starts.
double q4_int8_seconds(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t group,
                       int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const bitquilt_q4::Weight W = bitquilt_q4::make_weight(w, sz, N, x.size(1), group, bits);
  std::vector<float> y(x.size(0) * N);
  const double start = thread_seconds();
  bitquilt_q4::matmul_into(x.data_ptr<float>(), x.size(0), W, y.data());
  return thread_seconds() - start;
}

}  // namespace

void register_read_rate(pybind11::module& m) {
  m.def("read_pass", &read_pass, "one streaming read over a buffer (the bandwidth ceiling of batch-1 kernels)",
        pybind11::arg("t"), pybind11::arg("near") = 0, pybind11::arg("far") = 0);
  m.def("read_pass_seconds", &read_pass_seconds, "thread CPU seconds of one read_pass", pybind11::arg("t"),
        pybind11::arg("near") = 0, pybind11::arg("far") = 0);
  m.def("q4_int8_seconds", &q4_int8_seconds, "thread CPU seconds of one q4_int8 matmul, timed in C");
  m.def("prefetch_plan", [] { return std::pair(bitquilt_prefetch::PREFETCH.near, bitquilt_prefetch::PREFETCH.far); },
        "how far ahead the streaming kernels prefetch their weights on this CPU (stream_prefetch.h): bytes into L1, "
        "bytes into L2 (0: none), as read_pass takes them");
}
