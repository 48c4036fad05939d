// A MoBiQuant linear run per token (torch-free): its router (slice_router.h) counts the token's slices k at a
// threshold, and the lookup-table kernel (lut_parts.h) sums the first k packed slices, or with int8 activations the
// bit-plane x int8 kernel (plane_int8.h). One piece for the fused
// decode step (decode_step.cpp) and the standalone runtime (standalone.cpp), so both route alike.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/lut_parts.h"
#include "kernels/plane_int8.h"
#include "kernels/slice_router.h"

namespace bitquilt_routed {

// Why a router of fc1 [H, K1], fc2 [E1, H2] cannot route `parts` slices of K inputs; empty if it can.
inline std::string router_error(int64_t K, int64_t parts, int64_t H, int64_t K1, int64_t E1, int64_t H2) {
  if (H <= 0 || K1 != K + 1 || H2 != H || E1 + 1 != parts)
    return "a router needs fc1 [H, K + 1], fc2 [slices - 1, H] and at least 2 slices";
  return "";
}

class RoutedParts {
 public:
  // The slices `parts` (each `slice_bits[p]` bits per weight) of an [N, K] weight, routed by `router`; with `int8`,
  // each token's activations are rounded to int8 (per block of 32) for the slices (the router reads them as they are).
  RoutedParts(const bitquilt_router::Router& router, const std::vector<bitquilt_lut::Part>& parts,
              const std::vector<double>& slice_bits, bool int8)
      : router_(router), prefix_bits_(1, 0.0), int8_(int8), hidden_(router.H) {
    for (size_t k = 0; k <= parts.size(); ++k) prefixes_.emplace_back(parts.begin(), parts.begin() + k);
    for (double b : slice_bits) prefix_bits_.push_back(prefix_bits_.back() + b);
  }

  // y [T, N] = each row x_t [K] through its first count(x_t, taus[t]) slices, as it comes out alone; where `bits`
  // is given, bits[t] += N * K * the bits per weight that row used (summed over linears, weighted by their size).
  // The rows that count the same slices run through them in one kernel call (its rows are independent), so a
  // batched step reads each prefix it needs once, not once per row.
  void run(const float* x, int64_t T, int64_t N, const float* taus, float* y, double* bits) const {
    const int64_t K = router_.K;
    counts_.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      counts_[t] = bitquilt_router::count(x + t * K, router_, taus[t], hidden_.data());
      if (bits != nullptr) bits[t] += static_cast<double>(N * K) * prefix_bits_[counts_[t]];
    }
    for (size_t k = 0; k < prefixes_.size(); ++k) {
      rows_.clear();
      for (int64_t t = 0; t < T; ++t)
        if (counts_[t] == static_cast<int64_t>(k)) rows_.push_back(t);
      const int64_t R = static_cast<int64_t>(rows_.size());
      if (R == T) {  // every row alike: in place
        product(x, T, prefixes_[k], N, y);
        return;
      }
      if (R == 0) continue;
      xs_.resize(R * K);
      ys_.resize(R * N);
      for (int64_t r = 0; r < R; ++r) std::copy_n(x + rows_[r] * K, K, xs_.data() + r * K);
      product(xs_.data(), R, prefixes_[k], N, ys_.data());
      for (int64_t r = 0; r < R; ++r) std::copy_n(ys_.data() + r * N, N, y + rows_[r] * N);
    }
  }

 private:
  void product(const float* x, int64_t T, const std::vector<bitquilt_lut::Part>& parts, int64_t N, float* y) const {
    if (int8_)
      bitquilt_plane8::matmul_into(x, T, parts, N, y);
    else
      bitquilt_lut::lut_parts_into(x, T, parts, N, {}, y);
  }

  bitquilt_router::Router router_;
  std::vector<std::vector<bitquilt_lut::Part>> prefixes_;  // prefixes_[k]: the first k slices
  std::vector<double> prefix_bits_;                        // prefix_bits_[k]: their bits per weight
  bool int8_;                                              // the slices on int8-rounded activations
  mutable std::vector<float> hidden_;                      // the router's scratch
  mutable std::vector<int64_t> counts_, rows_;             // a call's slice count per row; the rows of one count
  mutable std::vector<float> xs_, ys_;                     // those rows' inputs and outputs, gathered
};

}  // namespace bitquilt_routed
