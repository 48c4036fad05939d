"""CPU kernel for `MXIntFormat` (microscaled integers): x @ Ŵᵀ with AVX2 or AVX-512, picked at run time.

The kernel lives in the same C++ extension as `bitquilt.kernels.cpu` (csrc/kernels/mxint_matmul.cpp) and is
registered as "cpu_mxint" when that extension loads. Its layout, cut on first use from the
format's stored classes and `perm` (`build_layout`, csrc/kernels/repack.cpp) and kept in a `LayoutCache`:

- the 4-bit class nibble-packed (0.5 byte per weight), padded with zero blocks to a multiple of 4
  blocks per row so that one 64-byte vector holds 4 blocks: 32-bit word i of each 128-column group
  holds, in nibble j, column 16·(j % 2) + i of block j // 2;
- the 6- and 8-bit classes as int8 (1 byte per weight): decoding 6-bit elements from 4+2 bit
  planes would save 0.25 byte on that small class but cost shifts and merges on every call,
  and the kernel is decode-bound while weights sit in cache;
- the format's E8M0 exponent bytes as they are (1 byte per 32 weights), turned into exact fp32
  steps 2^(e − (m − 2)) through a 256-entry table in the kernel;
- each class's bytes padded to whole 64-byte lines (at most 32 bytes a row: a lone 8-bit block),
  so that no 64-byte load straddles two cache lines;
- a gather index: x is reordered once per call to the stored (permuted, padded) column order,
  which costs a copy of x, small against reading the weights.

Small batches decode each weight row in registers and multiply it with up to 4 tokens in fp32
FMAs; from `SGEMM_BATCH[isa]` tokens on, row chunks are dequantized to fp32 and multiplied with
at::mm. Both compute the exact dequantized weights, so results differ from the torch reference
only in fp32 summation order. The path is AVX-512 when the CPU has it, else AVX2; `BITQUILT_ISA`
(avx2 or avx512) or an `isa` argument forces one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.mxint import BLOCK, EXP_BIAS, MXIntFormat
from bitquilt.isa import choose
from bitquilt.kernels import cpu
from bitquilt.kernels.layouts import LayoutCache
from bitquilt.kernels.registry import fp32_rows, like, register_kernel, takes

ISAS = ("avx2", "avx512")
_ISA_CODE = {"avx2": 0, "avx512": 1}
GROUP = 4 * BLOCK  # columns of one 4-bit group (64 bytes per row)
ALIGN = 64  # bytes: a 4-bit group never straddles two cache lines
# Batch size from which dequantize + sgemm beats decoding in registers, per path: the crossover of
# `python bench/kernel_speed.py --mxint` (bench/results/mxint_kernels.md); AVX-512 decodes twice the width per
# instruction, so its crossover lies later.
SGEMM_BATCH = {"avx2": 14, "avx512": 28}
_avx512: bool | None = None


def supported_isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs (empty without the extension)."""
    global _avx512
    ext = cpu.extension()
    if ext is None:
        return ()
    if _avx512 is None:
        _avx512 = bool(ext.mxint_has_avx512())
    return ISAS if _avx512 else ISAS[:1]


def active_isa(isa: str | None = None) -> str | None:
    """The path a call runs (`bitquilt.isa.choose`): `isa` if given, else `$BITQUILT_ISA` if supported,
    else the widest supported; None without the extension."""
    return choose("MXINT", supported_isas(), isa)


@dataclass(frozen=True)
class MXLayout:
    """An `MXIntFormat` in the kernel's layout (see csrc/kernels/mxint_matmul.cpp)."""

    weights: torch.Tensor  # uint8 [out, row bytes]: per class, nibble-packed (m = 4) or int8 (m = 6, 8)
    exponents: torch.Tensor  # uint8 [out, padded in / 32]: E8M0 bytes, stored (padded) block order
    segments: torch.Tensor  # int64 [classes, 4]: (m, first padded column, first byte, blocks)
    gather: torch.Tensor | None  # int32 [padded in]: source column of each stored one, −1 for padding
    in_features: int

    def nbytes(self) -> int:
        gather = 0 if self.gather is None else self.gather.nbytes
        return self.weights.nbytes + self.exponents.nbytes + self.segments.nbytes + gather

    def class_bytes_per_weight(self) -> dict[int, float]:
        """Weight and exponent bytes per (unpadded) weight of each class width."""
        per_block = {4: BLOCK // 2 + 1, 6: BLOCK + 1, 8: BLOCK + 1}
        return {int(m): per_block[int(m)] / BLOCK for m in self.segments[:, 0].tolist()}

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] fp32 contiguous -> x in stored, padded column order (a copy only if reordered)."""
        return x if self.gather is None else cpu.extension().mxint_gather(x, self.gather)

    def gemv(self, xs: torch.Tensor, isa: str) -> torch.Tensor:
        """Weights decoded in registers; `xs` from `prepare`."""
        return cpu.extension().mxint_gemv(xs, self.weights, self.exponents, self.segments, _ISA_CODE[isa])

    def sgemm(self, xs: torch.Tensor, isa: str) -> torch.Tensor:
        """Row chunks dequantized to fp32, then at::mm; `xs` from `prepare`."""
        return cpu.extension().mxint_dequant_matmul(xs, self.weights, self.exponents, self.segments,
                                                   _ISA_CODE[isa])

    def dequantize(self, isa: str | None = None) -> torch.Tensor:
        """fp32 [out, padded in] in stored column order, through the kernel's decoders (for tests)."""
        return cpu.extension().mxint_dequantize(self.weights, self.exponents, self.segments,
                                               _ISA_CODE[active_isa(isa)])

    def matmul(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """x [T, in] fp32 contiguous -> x @ Ŵᵀ [T, out], by whichever path is faster at this batch."""
        isa = active_isa(isa)
        xs = self.prepare(x)
        return self.sgemm(xs, isa) if x.shape[0] >= SGEMM_BATCH[isa] else self.gemv(xs, isa)


def _exponent_bytes(codes: torch.Tensor, e: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored E8M0 bytes e [out, n/32] (e + 127), with e = 0 for blocks whose codes are all zero (`codes`: the
    class's stored words or int8, 32·bits/8 bytes a block): their step is irrelevant, and the e = −127 that
    quantization gives them makes a subnormal step, which costs a microcode assist per use (as much as the rest of a
    short row on the AVX-512 path)."""
    words = codes.contiguous().view(torch.int64).view(codes.shape[0], e.shape[1], 4 * bits // 8)  # 8 bytes a compare
    return torch.where((words == 0).all(-1), EXP_BIAS, e)


def build_layout(fmt: MXIntFormat) -> MXLayout:
    """The kernel layout of `fmt`, cut from its stored classes (`MXIntFormat`: q<c> packed words, or int8 at 8 bits,
    e<c> E8M0 bytes) by csrc/kernels/repack.cpp: 4-bit codes into the group order of the module's docstring (a class's
    last group padded with zero blocks, x zeros), 6-bit ones widened to int8."""
    ext = cpu.extension()
    source = torch.arange(fmt.in_features) if fmt.perm is None else fmt.perm.long()
    weights, exponents, segments, columns = [], [], [], []
    start = col = byte = 0
    for c, (m, n) in enumerate(zip(fmt.widths, fmt.columns)):
        codes = fmt.stored[f"q{c}"]
        src, eb = source[start:start + n], _exponent_bytes(codes, fmt.stored[f"e{c}"], m)
        start += n
        if m == 4:
            pad = -n % GROUP
            src, eb = F.pad(src, (0, pad), value=-1), F.pad(eb, (0, pad // BLOCK), value=EXP_BIAS)
            w, n = ext.mxint_pack_nibbles(codes, n), n + pad
        else:
            w = F.pad((codes if m == 8 else ext.unpack_signed(codes, m, n)).view(torch.uint8), (0, -n % ALIGN))
        segments.append((m, col, byte, n // BLOCK))  # every segment (and row) starts on a cache line
        weights.append(w)
        exponents.append(eb)
        columns.append(src)
        col, byte = col + n, byte + w.shape[1]
    gather = torch.cat(columns)
    identity = len(gather) == fmt.in_features and torch.equal(gather, torch.arange(fmt.in_features))
    one = len(weights) == 1  # one class: its tensors are the layout's (no copy)
    return MXLayout(weights[0] if one else torch.cat(weights, 1), exponents[0] if one else torch.cat(exponents, 1),
                    torch.tensor(segments, dtype=torch.int64), None if identity else gather.to(torch.int32),
                    fmt.in_features)


_LAYOUTS: LayoutCache[MXLayout] = LayoutCache(build_layout)


def layout(fmt: WeightFormat) -> MXLayout | None:
    """The kernel layout of `fmt`, built on first call and cached while `fmt` lives; None if the
    format is not MXINT or the extension is unavailable."""
    return _LAYOUTS.get(fmt) if isinstance(fmt, MXIntFormat) and cpu.extension() is not None else None


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None,
           isa: str | None = None) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ for an `MXIntFormat`; None to decline (not CPU, not 2-D, autograd, per-token context)."""
    if not takes(x, ctx) or x.shape[1] != getattr(fmt, "in_features", None):
        return None
    lay = layout(fmt)
    return None if lay is None else like(lay.matmul(fp32_rows(x), isa), x)


def register() -> bool:
    """Register the kernel if the extension loads; False (torch reference path) otherwise."""
    if cpu.extension() is None:
        return False
    register_kernel("mxint", "cpu_mxint", matmul)
    return True
