// How the streaming kernels (the int8-activation tiles of q4_int8.h, the 8-bit GEMV of uniform8.h, the MXINT GEMV
// of mxint_kernel.h, the bit-plane lookup-table kernel of lut_matmul.cpp) prefetch the weights they read once per
// call, chosen once per process by CPU vendor: each line `near` bytes ahead into L1 (T0) and, where `far` > 0, `far`
// bytes ahead into L2 (T1) as well. The int8 and 8-bit layouts sit on huge pages (kernels.layout_empty).
//   AMD: 8 KB into L1 alone; shorter distances left the int8 and 8-bit kernels short of the read ceiling on cold
//     weights, and a far T1 prefetch beside the near one slowed them.
//   Intel: 1 KB into L1 and 4 KB into L2, and the int8 tiles' row-group stream too (q4_int8.h): a short T0 distance
//     alone left every kernel short of the read ceiling. The extra prefetches cost a little where the weights stay
//     in a large L3 (a small model on a server CPU); cold weights, a decode step's case, decide.
// The A/B runs behind both plans (bench/prototypes/build_ab.py, gemv_ab.py, resident_ab.py) are summarized in
// docs/kernels.md, "Int8-activation kernels"; a plan is changed only by such a run on that vendor's CPU.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace bitquilt_prefetch {

struct PrefetchPlan {
  int64_t near, far;  // bytes ahead into L1 (T0) and into L2 (T1; 0: none)
  bool row_groups;    // the int8 tiles' row-group stream too (q4_int8.h, RowGroupPrefetch)
};

inline PrefetchPlan default_prefetch_plan() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? PrefetchPlan{8192, 0, false} : PrefetchPlan{1024, 4096, true};
}
inline const PrefetchPlan PREFETCH = default_prefetch_plan();

// Prefetches `lines` cache lines of a stream: `near` bytes past p into L1 and, if `far`, `far` bytes past p into L2
// (past the end is harmless: a prefetch never faults).
inline void prefetch_stream(const uint8_t* p, int lines, int64_t near, int64_t far) {
  for (int line = 0; line < lines; ++line) {
    if (far) _mm_prefetch(reinterpret_cast<const char*>(p + far + 64 * line), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + near + 64 * line), _MM_HINT_T0);
  }
}

// A weight stream's `lines` cache lines past p, as PREFETCH plans.
inline void prefetch_ahead(const uint8_t* p, int lines) { prefetch_stream(p, lines, PREFETCH.near, PREFETCH.far); }

}  // namespace bitquilt_prefetch
