// Bit-plane lookup-table matmul for x86-64 AVX2 (T-MAC style), bindings for bitquilt.kernels.cpu.
//
// The kernel itself (its layouts, its precision) is lut_parts.cpp's, shared with the standalone runtime; this file
// checks torch tensors against it, binds it, and holds the large-batch path.
//
// Large batches go through dequant_matmul instead: rows dequantized to fp32 in chunks, then at::mm.
//
// Both take an optional sparse 4-bit residual in 1x32 segments (sparse_residual.h), y = x @ (W + S)^T:
// the lookup-table path adds a tile's segments into the tile's accumulators after its blocks, before
// the copy-out; the sgemm path adds them into the tile's dequantized fp32 rows before at::mm. With no
// residual (an empty list, the default) both compute x @ W^T as before. sparse_residual_add_ is the
// residual alone, y += x @ S^T in place.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/lut_parts.h"
#include "kernels/plane_int8.h"
#include "kernels/sparse_residual.h"

namespace bitquilt_lut {

namespace {

using bitquilt_sparse::check_residual;
using bitquilt_sparse::Residual;

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
}

Coef coef_mode(const at::Tensor& coef, bool uniform) {
  const auto type = coef.scalar_type();
  TORCH_CHECK(uniform ? type == at::kFloat || type == at::kByte : type == at::kHalf,
              uniform ? "uniform coefficients: fp32 (s, -s*z) or uint8 (fp16 s, uint8 z)" : "plane coefficients: fp16");
  return !uniform ? Coef::planes : type == at::kByte ? Coef::uniform16 : Coef::uniform32;
}

}  // namespace

Shape check_packed(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
                   int64_t group, bool uniform) {
  const Shape s{K, N, k, block, group};
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && coef.is_contiguous(),
              "packed planes: contiguous uint8; coefficients: contiguous");
  const std::string error = packed_error(s, w.numel(), coef.nbytes(), coef_mode(coef, uniform));
  TORCH_CHECK(error.empty(), error);
  return s;
}

Part make_part(int64_t K, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k, int64_t block,
               int64_t group, bool uniform) {
  const Shape s = check_packed(K, w, coef, N, k, block, group, uniform);
  const Coef mode = coef_mode(coef, uniform);
  return {w.data_ptr<uint8_t>(), static_cast<const char*>(coef.data_ptr()), s, coef_group_bytes(mode, k), mode};
}


namespace {

at::Tensor lut_parts(const at::Tensor& x, const std::vector<Part>& parts, int64_t N, const Residual& res) {
  auto y = at::empty({x.size(0), N}, x.options());
  lut_parts_into(x.data_ptr<float>(), x.size(0), parts, N, res, y.data_ptr<float>());
  return y;
}

// y [T, N] = x [T, K] @ (W + S)^T for W in the packed bit-plane layout, S the residual (none if empty).
at::Tensor lut_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k,
                      int64_t block, int64_t group, bool uniform, const std::vector<at::Tensor>& residual) {
  check_rows(x);
  const Part part = make_part(x.size(1), w, coef, N, k, block, group, uniform);
  return lut_parts(x, {part}, N, check_residual(residual, N, part.s.K));
}

// The parts of a sum, each checked against the shared shape.
std::vector<Part> make_parts(int64_t K, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& coefs,
                             const std::vector<int64_t>& ks, const std::vector<bool>& uniforms, int64_t N,
                             int64_t block, int64_t group) {
  TORCH_CHECK(!ws.empty() && coefs.size() == ws.size() && ks.size() == ws.size() && uniforms.size() == ws.size(),
              "one coefficient tensor, plane count and uniform flag per part");
  std::vector<Part> parts;
  for (size_t p = 0; p < ws.size(); ++p)
    parts.push_back(make_part(K, ws[p], coefs[p], N, ks[p], block, group, uniforms[p]));
  return parts;
}

// y = x @ (sum_p W_p)^T for several packed weights of one shape, block and group (MoBiQuant's slices up to a
// prefix): one call, one set of activation tables.
at::Tensor lut_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                            const std::vector<at::Tensor>& coefs, const std::vector<int64_t>& ks,
                            const std::vector<bool>& uniforms, int64_t N, int64_t block, int64_t group) {
  check_rows(x);
  return lut_parts(x, make_parts(x.size(1), ws, coefs, ks, uniforms, N, block, group), N, {});
}

// The same product with each token's activations rounded to int8 per block of 32 (plane_int8.h).
at::Tensor plane_int8_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                   const std::vector<at::Tensor>& coefs, const std::vector<int64_t>& ks,
                                   const std::vector<bool>& uniforms, int64_t N, int64_t block, int64_t group) {
  check_rows(x);
  auto y = at::empty({x.size(0), N}, x.options());
  bitquilt_plane8::matmul_into(x.data_ptr<float>(), x.size(0),
                               make_parts(x.size(1), ws, coefs, ks, uniforms, N, block, group), N,
                               y.data_ptr<float>());
  return y;
}

// Rows of one tile dequantized to fp32 row-major: out[r * K + c] = C0 + sum_i C_i B_i[r, c], added to what out
// holds when `accumulate` (the next part of a sum).
void dequant_tile(const uint8_t* w, const char* coef, int64_t coef_group, Coef mode, const Shape& s,
                  const uint8_t* byte_of_row, bool accumulate, float* out) {
  // kBits[b] = the 8 bits of byte b as floats 0/1
  static const std::vector<float> kBits = [] {
    std::vector<float> v(256 * 8);
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) v[b * 8 + j] = static_cast<float>((b >> j) & 1);
    return v;
  }();
  const int64_t pairs = s.block / 8, plane_bytes = s.block * 4, per_group = s.group / s.block;
  float c[9];
  for (int64_t b = 0; b < s.blocks(); ++b) {
    const char* cg = coef + (b / per_group) * coef_group;
    const uint8_t* wb = w + b * s.k * plane_bytes;
    for (int64_t r = 0; r < TILE; ++r) {
      if (mode != Coef::planes) {  // (s, -s z) -> C0 = -s z, C_{i+1} = s 2^i
        float scale;
        if (mode == Coef::uniform32) {
          const float* u = reinterpret_cast<const float*>(cg);
          scale = u[r];
          c[0] = u[TILE + r];
        } else {
          scale = static_cast<float>(reinterpret_cast<const at::Half*>(cg)[r]);
          c[0] = -(scale * static_cast<float>(reinterpret_cast<const uint8_t*>(cg)[2 * TILE + r]));
        }
        for (int64_t i = 0; i < s.k; ++i) c[i + 1] = scale * static_cast<float>(1 << i);
      } else {
        const at::Half* h = reinterpret_cast<const at::Half*>(cg);
        for (int64_t i = 0; i <= s.k; ++i) c[i] = static_cast<float>(h[i * TILE + r]);
      }
      const uint8_t* wr = wb + byte_of_row[r];
      float* o = out + r * s.K + b * s.block;
      for (int64_t p = 0; p < pairs; ++p) {
        __m256 v = _mm256_set1_ps(c[0]);
        if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o + 8 * p), v);
        for (int64_t i = 0; i < s.k; ++i)
          v = _mm256_fmadd_ps(_mm256_loadu_ps(kBits.data() + 8 * wr[i * plane_bytes + 32 * p]),
                              _mm256_set1_ps(c[i + 1]), v);
        _mm256_storeu_ps(o + 8 * p, v);
      }
    }
  }
}

// y [T, N] = x [T, K] @ (sum_p W_p + S)^T by dequantizing chunks of rows to fp32 (each part added in turn, then the
// residual S) and calling at::mm once per chunk: faster than the tables once the batch is large enough for sgemm to
// be compute-efficient, and a sum of parts (MoBiQuant's slices up to a prefix) costs one product, not one per part.
at::Tensor dequant_parts_matmul(const at::Tensor& x, const std::vector<Part>& parts, int64_t N,
                                const std::vector<int64_t>& byte_of_row, const Residual& res) {
  TORCH_CHECK(byte_of_row.size() == TILE, "byte_of_row needs one entry per tile row");
  uint8_t bor[TILE];
  std::copy(byte_of_row.begin(), byte_of_row.end(), bor);
  const Shape& s = parts.front().s;
  const int64_t ntiles = s.tiles(), chunk = std::max<int64_t>(1, (4 << 20) / (TILE * s.K * 4));
  auto yt = at::empty({ntiles * TILE, x.size(0)}, x.options());  // y^T, rows padded to whole tiles
  auto wf = at::empty({chunk * TILE, s.K}, x.options());
  const at::Tensor xt = x.t();
  for (int64_t c0 = 0; c0 < ntiles; c0 += chunk) {
    const int64_t c1 = std::min(ntiles, c0 + chunk);
    at::parallel_for(c0, c1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* rows = wf.data_ptr<float>() + (i - c0) * TILE * s.K;
        for (size_t p = 0; p < parts.size(); ++p) {
          const Part& part = parts[p];
          dequant_tile(part.w + i * part.s.tile_bytes(), part.coef + i * s.groups() * part.coef_group,
                       part.coef_group, part.mode, part.s, bor, p > 0, rows);
        }
        if (!res.empty()) bitquilt_sparse::tile_residual_rows(res, i, s.K, rows);
      }
    });
    auto out = yt.narrow(0, c0 * TILE, (c1 - c0) * TILE);
    at::mm_out(out, wf.narrow(0, 0, (c1 - c0) * TILE), xt);
  }
  return yt.narrow(0, 0, N).t().contiguous();
}

at::Tensor dequant_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& coef, int64_t N, int64_t k,
                          int64_t block, int64_t group, bool uniform, const std::vector<int64_t>& byte_of_row,
                          const std::vector<at::Tensor>& residual) {
  check_rows(x);
  const Part part = make_part(x.size(1), w, coef, N, k, block, group, uniform);
  return dequant_parts_matmul(x, {part}, N, byte_of_row, check_residual(residual, N, part.s.K));
}

// y = x @ (sum_p W_p)^T for several packed weights of one shape, block and group through one sgemm per chunk.
at::Tensor dequant_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                const std::vector<at::Tensor>& coefs, const std::vector<int64_t>& ks,
                                const std::vector<bool>& uniforms, int64_t N, int64_t block, int64_t group,
                                const std::vector<int64_t>& byte_of_row) {
  check_rows(x);
  return dequant_parts_matmul(x, make_parts(x.size(1), ws, coefs, ks, uniforms, N, block, group), N, byte_of_row, {});
}

// y [T, N] += x [T, K] @ S^T in place for the residual S alone, tiles of 32 output rows in parallel.
void sparse_residual_add_(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "y: contiguous fp32 [T, N]");
  TORCH_CHECK(!residual.empty(), "sparse_residual_add_ needs a residual");
  const int64_t T = x.size(0), N = y.size(1), K = x.size(1);
  const Residual res = check_residual(residual, N, K);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // tile i's rows of y: y + i * TILE, one row of y per token
      bitquilt_sparse::tile_residual(res, i, xp, K, T, yp + i * TILE, N);
  });
}

}  // namespace

}  // namespace bitquilt_lut

void register_mxint(pybind11::module& m);   // mxint_matmul.cpp
void register_router(pybind11::module& m);  // slice_router.cpp
void register_uniform8(pybind11::module& m);  // uniform8_gemv.cpp

void register_decode_step(pybind11::module& m);  // decode_step.cpp
void register_q4_int8(pybind11::module& m);  // q4_int8.cpp
void register_hadamard(pybind11::module& m);  // hadamard.cpp
void register_read_rate(pybind11::module& m);  // read_rate.cpp
void register_repack(pybind11::module& m);  // repack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace bitquilt_lut;
  const std::vector<at::Tensor> none;
  m.def("lut_matmul", &lut_matmul, "y = x @ (W + S)^T for bit-plane packed W (AVX2 lookup tables), S a residual",
        py::arg("x"), py::arg("w"), py::arg("coef"), py::arg("N"), py::arg("k"), py::arg("block"), py::arg("group"),
        py::arg("uniform"), py::arg("residual") = none);
  m.def("lut_matmul_parts", &lut_matmul_parts, "y = x @ (sum_p W_p)^T for bit-plane packed parts of one shape",
        py::arg("x"), py::arg("ws"), py::arg("coefs"), py::arg("ks"), py::arg("uniforms"), py::arg("N"),
        py::arg("block"), py::arg("group"));
  m.def("plane_int8_matmul_parts", &plane_int8_matmul_parts,
        "y = x^ @ (sum_p W_p)^T for bit-plane packed parts of one shape, x^ x rounded to int8 per block of 32",
        py::arg("x"), py::arg("ws"), py::arg("coefs"), py::arg("ks"), py::arg("uniforms"), py::arg("N"),
        py::arg("block"), py::arg("group"));
  m.def("plane_int8_vnni", &bitquilt_plane8::vnni_path,
        "whether plane_int8_matmul_parts takes its AVX-512 VNNI path here (else the tables on rounded activations)");
  m.def("dequant_matmul", &dequant_matmul,
        "y = x @ (W + S)^T through dequantized fp32 row chunks and at::mm, S a residual", py::arg("x"), py::arg("w"),
        py::arg("coef"), py::arg("N"), py::arg("k"), py::arg("block"), py::arg("group"), py::arg("uniform"),
        py::arg("byte_of_row"), py::arg("residual") = none);
  m.def("dequant_matmul_parts", &dequant_matmul_parts,
        "y = x @ (sum_p W_p)^T for bit-plane packed parts of one shape through dequantized fp32 rows and at::mm",
        py::arg("x"), py::arg("ws"), py::arg("coefs"), py::arg("ks"), py::arg("uniforms"), py::arg("N"),
        py::arg("block"), py::arg("group"), py::arg("byte_of_row"));
  m.def("sparse_residual_add_", &sparse_residual_add_, "y += x @ S^T in place for a residual S in 1x32 segments",
        py::arg("y"), py::arg("x"), py::arg("residual"));
  register_mxint(m);
  register_router(m);
  register_uniform8(m);
  register_decode_step(m);
  register_read_rate(m);
  register_repack(m);
  register_q4_int8(m);
  register_hadamard(m);
}
