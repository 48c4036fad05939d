// MoBiRoute slice counts in one call per linear, used by bitquilt.kernels.router (a token's count is
// slice_router.h's, which the fused step and the standalone runtime run too).
//
// For each token x_t (a row of x, K values) and the router's two layers (fc1: H x (K + 1), fc2: (E - 1) x H):
//   r_t = sqrt(mean(x_t^2) + 1e-12)
//   u_h = relu(<fc1_h[:K], x_t> / r_t + fc1_h[K] * log r_t + b1_h)         (fc1 on [x_t / r_t, log r_t])
//   v_j = <fc2_j, u> + b2_j,  l_1 = v_1,  l_j = l_{j-1} - softplus(v_j)      (logits falling with j)
//   k_t = 1 + #{j : l_j > tau}
// exactly the math of SliceRouter.logits / counts, with fp32 sums in another order (dot products in
// 8 AVX2 lanes). Eager torch spends ~15 dispatches on this per linear, which at batch 1 cost a third
// of a routed decode step; here it is one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/slice_router.h"

namespace {

at::Tensor slice_router_counts(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                               const at::Tensor& b2, double tau) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  const int64_t T = x.size(0), K = x.size(1), H = w1.size(0), E1 = w2.size(0);
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == K + 1 && w1.scalar_type() == at::kFloat && w1.is_contiguous(),
              "fc1 weight: contiguous fp32 [H, K + 1]");
  TORCH_CHECK(w2.dim() == 2 && w2.size(1) == H && w2.scalar_type() == at::kFloat && w2.is_contiguous(),
              "fc2 weight: contiguous fp32 [E - 1, H]");
  TORCH_CHECK(b1.numel() == H && b2.numel() == E1 && b1.scalar_type() == at::kFloat &&
                  b2.scalar_type() == at::kFloat && b1.is_contiguous() && b2.is_contiguous(),
              "biases: contiguous fp32 [H] and [E - 1]");
  auto out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const bitquilt_router::Router r{w1.data_ptr<float>(), b1.data_ptr<float>(), w2.data_ptr<float>(),
                                  b2.data_ptr<float>(), K, H, E1};
  int64_t* op = out.data_ptr<int64_t>();
  const float threshold = static_cast<float>(tau);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(H * (K + 1), 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> u(H);
    for (int64_t t = t0; t < t1; ++t) op[t] = bitquilt_router::count(xp + t * K, r, threshold, u.data());
  });
  return out;
}

}  // namespace

// Adds the router function to the extension module (called from its PYBIND11_MODULE).
void register_router(pybind11::module& m) {
  m.def("slice_router_counts", &slice_router_counts, "per-token slice counts of a MoBiRoute router (AVX2)");
}
