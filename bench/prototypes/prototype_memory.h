// What the C timing prototypes of bench/prototypes share: this thread's CPU time, and buffers on huge pages as
// kernels.layout_empty places the layouts (2 MB-aligned, advised MADV_HUGEPAGE; smaller layouts share 16 MB blocks
// there, here each buffer has its own).

#pragma once

#include <sys/mman.h>
#include <time.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

inline double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// `n` bytes (rounded up to whole 2 MB pages), touched so every page is resident before any timing.
inline uint8_t* huge_pages(size_t n) {
  const size_t bytes = (n + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  auto* p = static_cast<uint8_t*>(aligned_alloc(2 << 20, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return p;
}
