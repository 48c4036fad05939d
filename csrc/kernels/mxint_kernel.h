// ISA-generic part of the MXINT kernels (see mxint_matmul.cpp), included once per instruction set.
//
// The including file defines, in the enclosing namespace, a vector type `V` (V::F, V::W lanes,
// zero/load/store/fma/add/hsum) and two decoders that hand every W-wide vector of dequantized
// weights w = q * 2^(e - (m - 2)) to a sink(i, col, w) (i: the vector's index within the call,
// col: its first column relative to the call's first column):
//   group4(bytes, e8m0, step, sink)  4 blocks of the nibble-packed 4-bit class (64 bytes)
//   block8(int8s, e8m0, step, sink)  1 block of int8 elements (32 bytes)
// and MAX_TT, the most tokens sharing one decode of a weight row (bounded by the vector registers).
// It has no include guard on purpose. Each row's weight stream is prefetched as stream_prefetch.h plans, once per
// 64 bytes.

// Every dequantized weight vector of row r, handed to sink(i, col, w) with col in padded columns.
template <class Sink>
inline void row_weights(const Mx& m, int64_t r, Sink&& sink) {
  const uint8_t* wr = m.w + r * m.row_bytes;
  const uint8_t* er = m.e + r * m.nblocks;
  for (int64_t si = 0; si < m.nsegs; ++si) {
    const Seg& s = m.segs[si];
    const float* step = step_table(s.bits);
    const uint8_t* es = er + s.col / BLOCK;
    if (s.bits == 4) {
      for (int64_t g = 0; g < s.blocks / 4; ++g) {
        bitquilt_prefetch::prefetch_ahead(wr + s.byte + 64 * g, 1);
        group4(wr + s.byte + 64 * g, es + 4 * g, step,
               [&](int i, int64_t col, typename V::F w) { sink(i, s.col + 4 * BLOCK * g + col, w); });
      }
    } else {
      // blocks in pairs, the second feeding other accumulators (shorter FMA dependency chains)
      const auto block = [&](int64_t b, int base) {
        if (b % 2 == 0) bitquilt_prefetch::prefetch_ahead(wr + s.byte + BLOCK * b, 1);
        block8(reinterpret_cast<const int8_t*>(wr + s.byte + BLOCK * b), es[b], step,
               [&](int i, int64_t col, typename V::F w) { sink(base + i, s.col + BLOCK * b + col, w); });
      };
      int64_t b = 0;
      for (; b + 1 < s.blocks; b += 2) {
        block(b, 0);
        block(b + 1, BLOCK / V::W);
      }
      if (b < s.blocks) block(b, 0);
    }
  }
  for (int64_t off = 0; off < m.nblocks; off += 64)  // the next row's exponents
    _mm_prefetch(reinterpret_cast<const char*>(er + m.nblocks + off), _MM_HINT_T0);
}

// y[t, r] = x[t] . W[r] for TT tokens and rows r0..r1: weights decoded once per row, FMAs into A
// independent accumulators per token (enough to hide the FMA latency).
template <int TT>
void dot_rows(const Mx& m, const float* x, int64_t r0, int64_t r1, float* y, int64_t N) {
  constexpr int A = TT <= 2 ? 4 : TT <= 4 ? 2 : 1;
  for (int64_t r = r0; r < r1; ++r) {
    typename V::F acc[TT][A];
    for (int t = 0; t < TT; ++t)
      for (int a = 0; a < A; ++a) acc[t][a] = V::zero();
    row_weights(m, r, [&](int i, int64_t col, typename V::F w) {
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) acc[t][i % A] = V::fma(V::load(x + t * m.K + col), w, acc[t][i % A]);
    });
    for (int t = 0; t < TT; ++t) {
      typename V::F s = acc[t][0];
      for (int a = 1; a < A; ++a) s = V::add(s, acc[t][a]);
      y[t * N + r] = V::hsum(s);
    }
  }
}

// dot_rows for tt <= TT tokens (tt known only at run time).
template <int TT>
void dot_tokens(int64_t tt, const Mx& m, const float* x, int64_t r0, int64_t r1, float* y) {
  if constexpr (TT > 1) {
    if (tt < TT) return dot_tokens<TT - 1>(tt, m, x, r0, r1, y);
  }
  dot_rows<TT>(m, x, r0, r1, y, m.N);
}

// y [T, N] = x [T, K] @ W^T, parallel over row ranges; within a range, rows in L1-sized chunks and
// tokens in groups of up to MAX_TT that share each decoded weight vector.
__attribute__((noinline)) void gemv(const Mx& m, const float* x, int64_t T, float* y) {
  const int64_t chunk = std::max<int64_t>(1, L1_WEIGHT_BYTES / m.row_bytes);
  at::parallel_for(0, m.N, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin; r0 < end; r0 += chunk) {
      const int64_t r1 = r0 + chunk < end ? r0 + chunk : end;
      for (int64_t t0 = 0; t0 < T; t0 += MAX_TT)
        dot_tokens<MAX_TT>(T - t0, m, x + t0 * m.K, r0, r1, y + t0 * m.N);
    }
  });
}

// Rows r0..r1 dequantized to fp32, row-major [r1 - r0, K] (padded columns).
__attribute__((noinline)) void dequant_rows(const Mx& m, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    float* o = out + (r - r0) * m.K;
    row_weights(m, r, [&](int, int64_t col, typename V::F w) { V::store(o + col, w); });
  }
}
