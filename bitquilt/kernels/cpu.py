"""AVX2 CPU kernels: bit-plane lookup-table matmul for the `bitplane` and `uniform` formats.

Importing this module loads the C++ extension built at install time (`bitquilt.native_build`'s
TORCH_EXTENSION, in the package's `_native/`) and registers the kernels with `bitquilt.kernels`.
Nothing compiles here: if the extension was not built, cannot load, or (in a checkout) is older
than its sources, one warning is logged and nothing is registered, so `QuantLinear` keeps the
torch reference path; `make kernels` rebuilds it.

Both formats run through one kernel: a weight matrix is k binary planes with per-(row, group)
coefficients (a b-bit uniform grid is b planes with C_i = s·2^(i-1), C0 = −s·z), multiplied by
activation lookup tables (see csrc/kernels/lut_parts.cpp); from a bit-width-dependent batch size on,
rows are instead dequantized to fp32 in chunks and multiplied by sgemm. The packed layout is
built on first use from the format's codes (cut into bit-planes by csrc/kernels/repack.cpp), `scale_zero()` and
coefficients and kept in this module's `LayoutCache` while the format lives (about the size of the packed
weights again); the format itself is unchanged. Calls with per-token context are declined.
`Packed.matmul` also takes an optional sparse 4-bit residual, added inside either path
(csrc/kernels/sparse_residual.h; the MosaicQuant kernels in `bitquilt.kernels.mosaic`).

The same extension also holds the MXINT kernel (csrc/kernels/mxint_matmul.cpp), registered by
`bitquilt.kernels.mxint`, the 8-bit uniform GEMV (csrc/kernels/uniform8_gemv.cpp, `bitquilt.kernels.uniform8`; its
AVX-512 VNNI row loop in csrc/kernels/avx512/uniform8.cpp),
the MoBiRoute slice counts (csrc/kernels/slice_router.cpp, used by `bitquilt.kernels.router`), the fused
decoder layers of a batch-1 decode step (csrc/runtime/decode_step.cpp, `bitquilt.runtime.fused`) and the
4- and 2-bit × int8-activation matmul (csrc/kernels/q4_int8.cpp, `bitquilt.kernels.q4_int8`; its AVX-512 VNNI path in
csrc/kernels/avx512/q4_int8.cpp, its AVX-VNNI one in csrc/kernels/avxvnni/q4_int8.cpp), and a plain streaming read
(csrc/kernels/read_rate.cpp) that the kernel benchmarks take as
their bandwidth ceiling.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

from bitquilt import native_build
from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.uniform import UniformFormat, resolve_group_size
from bitquilt.kernels.huge_pages import layout_empty
from bitquilt.kernels.layouts import PACK_ROWS, LayoutCache, fp16_grid, grid_chunks
from bitquilt.kernels.options import options
from bitquilt.kernels.registry import fp32_rows, like, register_kernel, takes
from bitquilt.mapped import release_chunk

log = logging.getLogger(__name__)

TILE = 32  # output rows per kernel tile
PACK_TILES = PACK_ROWS // TILE  # tiles cut into bit-planes and reordered at a time (`pack_planes`)
_ext: ModuleType | None = None
_failed = False


def _load(target: native_build.Target, directory: Path) -> ModuleType:
    """The extension module built for `target` in `directory`, loaded (torch, which it links against, is loaded)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        raise RuntimeError("the CPU lacks AVX2")
    path = directory / target.output
    loader = importlib.machinery.ExtensionFileLoader(target.module, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(target.module, path, loader=loader))
    loader.exec_module(module)
    return module


def build_extension(name: str, source_dir: Path, build_dir: Path) -> ModuleType:
    """The extension built from the sources in `source_dir` (csrc/ or an edited copy of it) into `build_dir` (kept
    while those sources are unchanged) and loaded as module `name`: for benchmarks that compare builds."""
    target = replace(native_build.TORCH_EXTENSION, output=f"{name}.so")
    native_build.build(target, build_dir, source_dir)
    return _load(target, build_dir)


def _load_extension() -> ModuleType:
    """The package's prebuilt extension; RuntimeError (one line) if it is missing or older than its sources."""
    problem = native_build.problem(native_build.TORCH_EXTENSION)
    if problem:
        raise RuntimeError(problem)
    return _load(native_build.TORCH_EXTENSION, native_build.OUT)


def extension() -> ModuleType | None:
    """The prebuilt extension, loaded on first call; None (after one warning) if it cannot be."""
    global _ext, _failed
    if _ext is None and not _failed:
        try:
            _ext = _load_extension()
        except Exception as e:  # any build/load failure means: no kernels, torch reference path
            _failed = True
            log.warning("bitquilt: CPU kernels unavailable (%s); using the torch reference path",
                        str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    return _ext


def _row_of_byte() -> list[int]:
    """Tile row held by byte t of a packed 32-byte vector.

    The kernel widens even and odd bytes separately, then unpacks 128-bit halves into int32; this
    order leaves rows 8m..8m+7 in result vector m.
    """
    rows = [0] * TILE
    for m in range(4):
        for lane in range(8):
            rows[lane // 4 * 16 + m % 2 * 8 + 2 * (lane % 4) + m // 2] = 8 * m + lane
    return rows


_ROW_OF_BYTE = _row_of_byte()
_BYTE_OF_ROW = sorted(range(TILE), key=_ROW_OF_BYTE.__getitem__)

# Batch size from which dequantizing row chunks to fp32 and calling sgemm beats the tables (whose
# cost grows with the planes; sgemm's does not): measured on a 2-core Zen 3 (MKL sgemm ~40 GFLOP/s
# per core) with `python bench/kernel_speed.py --crossover`.
_SGEMM_BATCH = {2: 192, 3: 96, 4: 64, 8: 32}


def sgemm_batch(bits: int) -> int:
    """Tokens from which dequantize + sgemm beats the tables for a weight of `bits` planes in all (a sum of parts
    counts every part's): the measured entry at `bits`, else at the nearest width below (above for 1 bit)."""
    below = [b for b in _SGEMM_BATCH if b <= bits]
    return _SGEMM_BATCH[max(below) if below else min(_SGEMM_BATCH)]


def _block(group: int, in_features: int) -> int | None:
    """Columns per table scale: the largest of 128/64/32 dividing both the group and the width."""
    return next((b for b in (128, 64, 32) if math.gcd(group, in_features) % b == 0), None)


def _pad_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = -t.shape[dim] % TILE
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _plane_bytes(fmt: BitplaneFormat | UniformFormat, rows: slice) -> torch.Tensor:
    """The bit-planes of `rows`, uint8 [k, rows, K/8] (bit j of byte p = column 8p+j): a uniform weight's codes cut by
    csrc/kernels/repack.cpp (`formats.packing.bit_planes` is the reference), a bit-plane weight's planes as stored."""
    if isinstance(fmt, UniformFormat):
        return _ext.bit_planes(fmt.qweight[rows], fmt.bits, fmt.in_features)
    return fmt.plane_bytes(rows)


def pack_planes(fmt: BitplaneFormat | UniformFormat, block: int) -> torch.Tensor:
    """The format's bit-planes (`_plane_bytes`: uint8 [k, N, K/8], bit j of byte p = column 8p+j) in the kernel layout
    [tiles, blocks, k, block/8, 32] (csrc/kernels/repack.cpp), PACK_TILES tiles at a time straight into the result: the
    planes of a whole LM head would be several times its layout, a transient peak of the process. The file pages of a
    loaded uniform weight's rows are given back once packed, and the chunks' temporaries every few chunks
    (`bitquilt.mapped.release_chunk`), so a head is not resident twice while its layout is built."""
    n, k, kb = fmt.out_features, fmt.bits, fmt.in_features // 8
    out = layout_empty(-(-n // TILE) * kb * k * TILE).view(-1, kb * 8 // block, k, block // 8, TILE)
    for t0 in range(0, out.shape[0], PACK_TILES):
        rows = slice(t0 * TILE, (t0 + PACK_TILES) * TILE)
        planes = _pad_rows(_plane_bytes(fmt, rows), 1)
        _ext.planes_to_tiles(planes, block, _ROW_OF_BYTE, out[t0:t0 + planes.shape[1] // TILE])
        if isinstance(fmt, UniformFormat):  # a loaded model's file pages of these rows, given back as we go
            release_chunk(t0 // PACK_TILES, [fmt.qweight[rows]])
    return out


def _tile_coefficients(c: torch.Tensor) -> torch.Tensor:
    """[N, G, m] -> [tiles, G, m, 32] (rows in natural order within a tile)."""
    n, g, m = c.shape
    return _pad_rows(c, 0).view(-1, TILE, g, m).permute(0, 2, 3, 1).contiguous()


class Residual(Protocol):
    """A sparse residual in the kernels' 1×32 segment layout (built by `bitquilt.kernels.mosaic`)."""

    def segments(self) -> list[torch.Tensor]:
        """[tile_ptr, rows, cols, scales, codes] as csrc/kernels/sparse_residual.h reads them."""


def _segments(residual: Residual | None) -> list[torch.Tensor]:
    return [] if residual is None else residual.segments()


@dataclass(frozen=True)
class Packed:
    """A weight matrix in the kernel's layout (see csrc/kernels/lut_parts.cpp)."""

    planes: torch.Tensor  # uint8 [tiles, blocks, bits, block/8, 32]
    coeffs: torch.Tensor  # fp16 [tiles, G, bits+1, 32] (C0..Ck); if uniform, `_uniform_coefficients`
    out_features: int
    bits: int
    block: int  # columns per activation-table scale
    group: int
    uniform: bool

    def nbytes(self) -> int:
        return self.planes.nbytes + self.coeffs.nbytes

    def matmul(self, x: torch.Tensor, residual: Residual | None = None) -> torch.Tensor:
        """x [T, in] fp32 contiguous -> x @ (Ŵ + S)ᵀ [T, out] fp32, by whichever path is faster at this batch.

        `residual` is an optional sparse residual S in its kernel layout (`bitquilt.kernels.mosaic`),
        added inside the kernel (fused); None: x @ Ŵᵀ.
        """
        return self.sgemm(x, residual) if x.shape[0] >= sgemm_batch(self.bits) else self.lut(x, residual)

    def lut(self, x: torch.Tensor, residual: Residual | None = None) -> torch.Tensor:
        """The lookup-table kernel."""
        return _ext.lut_matmul(x, *self._args(), _segments(residual))

    def sgemm(self, x: torch.Tensor, residual: Residual | None = None) -> torch.Tensor:
        """Dequantize chunks of rows to fp32 (plus the residual) and multiply with at::mm."""
        return _ext.dequant_matmul(x, *self._args(), _BYTE_OF_ROW, _segments(residual))

    def _args(self) -> tuple:
        return self.planes, self.coeffs, self.out_features, self.bits, self.block, self.group, self.uniform


def _pack_bitplane(fmt: BitplaneFormat) -> Packed | None:
    block = _block(fmt.group_size, fmt.in_features)
    if block is None:
        return None
    return Packed(pack_planes(fmt, block), _tile_coefficients(fmt.coeffs.to(torch.float16)),
                  fmt.out_features, fmt.bits, block, fmt.group_size, uniform=False)


def _pack_uniform(fmt: UniformFormat) -> Packed | None:
    group = resolve_group_size(fmt.group_size, fmt.in_features)
    block = _block(group, fmt.in_features)
    if fmt.g_idx is not None or block is None:
        return None
    return Packed(pack_planes(fmt, block), _uniform_coefficients(fmt), fmt.out_features, fmt.bits, block, group,
                  uniform=True)


def _uniform_coefficients(fmt: UniformFormat) -> torch.Tensor:
    """(s, z) of every row group in tile order (csrc/kernels/lut_parts.cpp): uint8 [tiles, G, 96], 32 fp16 s then 32
    uint8 z, when every s is an fp16 value and every z an integer in [0, 255] (a saved grid always is); fp32 [tiles, G,
    2, 32] (s, −s·z) otherwise, 2.7× the bytes. Built PACK_ROWS rows at a time (the whole matrix's fp32 temporaries at
    once were ≈ 35 MB above the layout for Qwen's 151,936-row LM head)."""
    n, groups = fmt.scales.shape
    compact = torch.empty(-(-n // TILE), groups, 3 * TILE, dtype=torch.uint8)
    if _fill_tiles(compact, fmt, _compact_tiles):
        return compact
    wide = torch.empty(-(-n // TILE), groups, 2, TILE)
    _fill_tiles(wide, fmt, _fp32_tiles)
    return wide


def _fill_tiles(out: torch.Tensor, fmt: UniformFormat,
                tiles_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]) -> bool:
    """out[tiles] = tiles_of(s, z) of each PACK_ROWS rows; False as soon as one chunk cannot be stored so."""
    for r0, scale, zero in grid_chunks(fmt, PACK_ROWS):
        chunk = tiles_of(scale, zero)
        if chunk is None:
            return False
        out[r0 // TILE:r0 // TILE + chunk.shape[0]] = chunk
    return True


def _compact_tiles(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor | None:
    grid = fp16_grid(scale, zero)
    if grid is None:
        return None
    s16, z8 = grid
    return torch.cat([_tile_coefficients(s16.unsqueeze(-1)).flatten(2).view(torch.uint8),
                      _tile_coefficients(z8.unsqueeze(-1)).flatten(2)], dim=-1)


def _fp32_tiles(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return _tile_coefficients(torch.stack([scale, -scale * zero], dim=-1))


_PACKERS = {"bitplane": _pack_bitplane, "uniform": _pack_uniform}
_LAYOUTS: LayoutCache[Packed] = LayoutCache(lambda fmt: _PACKERS[fmt.name](fmt) if fmt.name in _PACKERS else None)


def packed(fmt: WeightFormat) -> Packed | None:
    """The kernel layout of `fmt`, built on first call and cached while `fmt` lives.

    None if the format or shape is unsupported or the extension is unavailable.
    """
    return None if extension() is None else _LAYOUTS.get(fmt)


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ for a `BitplaneFormat` or a `UniformFormat` without act-order; None to decline."""
    if not takes(x, ctx):
        return None
    p = packed(fmt)
    return None if p is None else like(p.matmul(fp32_rows(x)), x)


def packed_alike(fmts: list[WeightFormat]) -> list[Packed] | None:
    """The kernel layouts of parts that one call can sum (same rows, block and group); None if a part does not
    pack or they differ."""
    layouts = [packed(f) for f in fmts]
    if not layouts or any(p is None for p in layouts):
        return None
    first = layouts[0]
    if any((p.out_features, p.block, p.group) != (first.out_features, first.block, first.group) for p in layouts):
        return None
    return layouts


def matmul_parts(fmts: list[WeightFormat], x: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] @ (Σ_p Ŵ_p)ᵀ for parts of one shape, block and group (MoBiQuant's slices up to a prefix) in one
    call: the lookup tables built once for every part (small batches), or each chunk of rows dequantized as the
    sum of the parts and multiplied once (from `sgemm_batch` of the parts' planes together): one product, not one
    per part; with int8 activations enabled, each token rounded to int8 per block of 32 (`plane_int8_matmul_parts`,
    csrc/kernels/plane_int8.h). None to decline (a part the kernel cannot pack, differing blocks or groups)."""
    if not fmts or not takes(x):
        return None
    layouts = packed_alike(fmts)
    if layouts is None:
        return None
    first = layouts[0]
    args = (fp32_rows(x), [p.planes for p in layouts], [p.coeffs for p in layouts], [p.bits for p in layouts],
            [p.uniform for p in layouts], first.out_features, first.block, first.group)
    if options().int8_activations:
        return like(_ext.plane_int8_matmul_parts(*args), x)
    if x.shape[0] >= sgemm_batch(sum(p.bits for p in layouts)):
        return like(_ext.dequant_matmul_parts(*args, _BYTE_OF_ROW), x)
    return like(_ext.lut_matmul_parts(*args), x)


def register() -> bool:
    """Register the kernels if the extension loads; False (torch reference path) otherwise."""
    if extension() is None:
        return False
    for name in _PACKERS:
        register_kernel(name, "cpu_lut", matmul)
    return True
