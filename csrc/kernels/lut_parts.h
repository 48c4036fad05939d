// The bit-plane lookup-table matmul as a C++ call (lut_parts.cpp, torch-free), for the kernels that run whole
// weights themselves (decode_step.cpp, the standalone runtime's standalone.cpp): the packed shape, a weight "part"
// and y = x @ (sum W_p)^T. The torch extension's checks of tensors against it (check_packed, make_part) are
// lut_matmul.cpp's, declared here for the extension's files only.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/sparse_residual.h"

#ifdef TORCH_EXTENSION_NAME
#include <ATen/core/Tensor.h>
#endif

namespace bitquilt_lut {

constexpr int64_t TILE = 32;        // output rows per tile
constexpr int64_t MAX_BLOCK = 128;  // int16 accumulators hold <= 16 pair sums of each limb

struct Shape {
  int64_t K, N, k, block, group;
  int64_t tiles() const { return (N + TILE - 1) / TILE; }
  int64_t blocks() const { return K / block; }
  int64_t groups() const { return (K + group - 1) / group; }  // the last group may be shorter
  int64_t tab_bytes() const { return K / 4 * 48; }  // per token
  int64_t tile_bytes() const { return K / 8 * TILE * k; }
};

// How a part's coefficients are stored per (tile, group) (lut_parts.cpp's header says what each holds).
enum class Coef : uint8_t { planes, uniform32, uniform16 };

// One weight of a sum: packed planes, coefficients and shape (all parts of a call share K, N, block, group).
struct Part {
  const uint8_t* w;
  const char* coef;
  Shape s;
  int64_t coef_group;  // bytes of coefficients per (tile, group)
  Coef mode;
};

// Bytes of coefficients per (tile, group) of a part of k planes stored as `mode`.
int64_t coef_group_bytes(Coef mode, int64_t k);

// Why packed planes of `plane_bytes` and coefficients of `coef_bytes` stored as `mode` are no weight of shape `s`
// (planes, block and sizes included); empty if they are one.
std::string packed_error(const Shape& s, int64_t plane_bytes, int64_t coef_bytes, Coef mode);

// y [T, N] = x [T, K] @ (sum_p W_p + S)^T, rows contiguous; S the residual (none if empty).
void lut_parts_into(const float* x, int64_t T, const std::vector<Part>& parts, int64_t N,
                    const bitquilt_sparse::Residual& res, float* y);

#ifdef TORCH_EXTENSION_NAME
// The packed planes and coefficients of a [N, K] weight checked against its shape (TORCH_CHECK otherwise).
Shape check_packed(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
                   int64_t group, bool uniform);

// A part pointing into w and coef (which must outlive it).
Part make_part(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
               int64_t group, bool uniform);
#endif

}  // namespace bitquilt_lut
