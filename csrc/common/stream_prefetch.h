// How the streaming kernels (the int8-activation tiles of q4_int8.h, the 8-bit GEMV of uniform8.h, the MXINT GEMV of
// mxint_kernel.h, the bit-plane lookup-table kernel of lut_matmul.cpp) prefetch the weights they read once per call, chosen once per process by CPU vendor: each line
// `near` bytes ahead into L1 (T0) and, where `far` > 0, `far` bytes ahead into L2 (T1) as well. The int8 and 8-bit
// layouts sit on huge pages (kernels.layout_empty).
//   AMD: 8 KB into L1. Zen 4 (2026-12-05), cold 4-bit weights, 1 thread, 1536² to 8960 x 1536, builds alternating:
//     the int8 tiles' VNNI path at 85-90% of the read ceiling 8 KB ahead against 74-78% at 2 KB, 69-84% at 4 KB and
//     68-84% at 16 KB; re-checked on the 256-bit 4-bit token and the AVX2 loop, three rounds: 6 and 12 KB 1-5 points
//     lower on every 4-bit row, 6 and 8 KB alike at 2 bits; a far T1 prefetch with a near T0 one measured slower
//     (18-23 GB/s against 24-28, C timing). The 8-bit GEMV: 8 KB 1.02-1.13x faster than 4 KB (AVX2 loop), 1.03-1.35x
//     faster than 4 KB, 2 KB or none (VNNI loop). Zen 3 (4 KB pages): 2 to 8 KB alike; the GEMV 1.2-1.5x faster at
//     4 KB than with none.
//   Intel: 1 KB into L1 and 4 KB into L2. On a Xeon with AVX-512 and AVX-VNNI (family 6 model 207, 2026-12-05),
//     cold weights, builds alternating (bench/prototypes/build_ab.py, the ceiling the fastest of a plain read and
//     reads prefetching 2 KB, 8 KB or as this plan), against 2 KB into L1 alone: the int8 tiles 1.10-1.18x faster at
//     4 bits and, with the row groups' prefetch (q4_int8.h), 1.12-1.17x at 2, on every path (AVX2 76-77% -> 89-90% of
//     the ceiling at 4 bits, 73-76% -> 83-86% at 2; AVX-VNNI 81-82% -> 92-94%, 76-79% -> 88-91%; AVX-512 83-86% ->
//     92-95%, 76-80% -> 87-91%); 4 or 8 KB far with 0.5, 1 or 2 KB near all within 3 points. The 8-bit GEMV (C
//     harness, three runs alternating): 1.07-1.11x faster than 4 KB into L1 alone, 100-103% of the plain read against
//     92-94%. The MXINT GEMV (bench/prototypes/gemv_ab.py, three runs): its AVX-512 loop 1.10-1.14x faster than 2 KB
//     into L1 alone (13.0-14.4 GB/s against 11.3-12.9, 4-bit and MXSens 8/6/4 rows), its AVX2 loop bound by its
//     instructions (6-8 GB/s) and unchanged (0.98-1.03x). The bit-plane lookup-table kernel (same script, three runs):
//     1.07-1.10x faster at 4 bits, 1.00-1.04x at 2 (bound by its instructions at ~10 GB/s). On AMD both moved from
//     2 KB to the 8 KB the int8 and 8-bit kernels measured best there (not measured on them). T0 alone: 2 KB best,
//     4 KB 1.05-1.25x slower on an earlier Xeon; T1 alone 1-5% slower than T0 alone.
//     Weights resident in that Xeon's 300 MB L3 (smollm2-135m's 210 linears, 32-56 MB, called in order) pay for the
//     extra prefetches: 1.03-1.08x slower per step than with 2 KB into L1 alone.

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
