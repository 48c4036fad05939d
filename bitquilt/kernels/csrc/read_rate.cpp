// The read-bandwidth ceiling the kernel benchmarks compare against (bench/kernel_speed.py): one streaming pass over a
// buffer that does as little as a read can, four 256-bit loads OR-ed into four accumulators per step. A batch-1
// matmul reads its weights once, so this pass's bytes per second bound its rate on the same thread and data.
// (torch.sum of fp32, the ceiling used before, adds per element and ran below what the AVX-512 kernels reach.)

#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

namespace {

// OR of every 64-bit word of `t` (contiguous; a multiple of 128 bytes), returned so the pass cannot be elided.
// `prefetch` > 0: each 128-byte step also prefetches the two cache lines that many bytes ahead, as the batch-1
// kernels do; on some CPUs the hardware prefetcher alone leaves a plain pass below what those kernels reach.
int64_t read_pass(const at::Tensor& t, int64_t prefetch) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 128 == 0, "a contiguous buffer of a multiple of 128 bytes");
  TORCH_CHECK(prefetch >= 0, "prefetch distance must be >= 0 bytes");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const size_t n = t.nbytes();
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 128) {
    if (prefetch) {  // past the end is harmless: a prefetch never faults
      _mm_prefetch(reinterpret_cast<const char*>(p + i + prefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + prefetch + 64), _MM_HINT_T0);
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

}  // namespace

void register_read_rate(pybind11::module& m) {
  m.def("read_pass", &read_pass, "one streaming read over a buffer (the bandwidth ceiling of batch-1 kernels)",
        pybind11::arg("t"), pybind11::arg("prefetch") = 0);
}
