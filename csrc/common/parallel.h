// parallel_for(begin, end, grain, f): f(b, e) over chunks of [begin, end) of at least `grain` items, one per
// thread, for the kernels shared by both builds of csrc/: the torch extension (TORCH_EXTENSION_NAME defined: ATen's
// parallel_for, so torch.set_num_threads applies) and the torch-free library of the standalone runtime (OpenMP,
// omp_set_num_threads applies). The same split either way: ceil(n / threads) items per chunk, never below grain.

#pragma once

#include <algorithm>
#include <cstdint>

#ifdef TORCH_EXTENSION_NAME
#include <ATen/Parallel.h>
#else
#include <omp.h>
#endif

namespace bitquilt_par {

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef TORCH_EXTENSION_NAME
  at::parallel_for(begin, end, grain, f);
#else
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(omp_get_max_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t b = begin + omp_get_thread_num() * chunk, e = std::min(end, b + chunk);
    if (b < e) f(b, e);
  }
#endif
}

}  // namespace bitquilt_par
