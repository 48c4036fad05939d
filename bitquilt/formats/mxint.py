"""MXINT-m: microscaling integers. Blocks of 32 consecutive values share one power-of-two scale.

Definition (one block v_1..v_32 of a row, m ∈ {4, 6, 8} mantissa bits)

  element    q_i ∈ [−(2^(m−1) − 1), 2^(m−1) − 1], an m-bit signed integer (symmetric clamp)
  scale      X = 2^e, e ∈ [−127, 127] stored as the E8M0 byte e + 127
  value      v̂_i = X · q_i / 2^(m−2)      (the element is a fixed-point number with m−2 fraction bits)
  rounding   q_i = clamp(round_half_even(v_i / step), ±(2^(m−1) − 1)),   step = 2^(e − (m − 2))
  exponent   the smallest e with round(max|v| / step) ≤ 2^(m−1) − 1 (e = −127 for an all-zero block)

Against the OCP Microscaling spec v1.0: MXINT8 there is exactly m = 8 (8-bit two's-complement
elements with an implicit 2^−6 scale, E8M0 shared scale, 32-element blocks). The spec's shared
exponent is ⌊log2 max|v|⌋ − emax_elem with emax_elem = 0, after which the largest elements of a
block may clamp (a block max in [2 − 2^−(m−2), 2)·X is cut to (2 − 2^−(m−2))·X, an error up to
a whole step); we take the exponent one higher exactly when that would happen, so every element's
error is at most half a step. We also never use the element −2^(m−1) (the spec allows it for
MXINT8), keeping the grid symmetric. MXINT4/6 are the same construction with narrower elements.

Bits per value: m + 8/32 (the shared exponent byte per block).
"""

from __future__ import annotations

import itertools

import torch

from bitquilt.formats.base import WeightFormat, register_format
from bitquilt.formats.packing import pack, packed_words, unpack
from bitquilt.formats.uniform import check_shapes

BLOCK = 32
MANTISSA_BITS = (4, 6, 8)
EXP_MIN, EXP_MAX = -127, 127
EXP_BIAS = 127


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def step_size(exponents: torch.Tensor, bits: int) -> torch.Tensor:
    """2^(e − (m − 2)) as fp32 (exact: a power of two; subnormal for the smallest e)."""
    return torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.to(torch.int32) - (bits - 2))


def check_bits(bits: int) -> None:
    if bits not in MANTISSA_BITS:
        raise ValueError(f"unsupported MXINT mantissa width {bits}; supported: {', '.join(map(str, MANTISSA_BITS))}")


def check_classes(widths: list[int], columns: list[int], in_features: int) -> None:
    """Column classes must be non-empty whole blocks of a supported width covering the row."""
    if len(widths) != len(columns) or sum(columns) != in_features or any(n <= 0 or n % BLOCK for n in columns):
        raise ValueError(f"MXINT classes {list(zip(widths, columns))} must be non-empty whole {BLOCK}-column "
                         f"blocks adding up to in_features {in_features}")
    for m in widths:
        check_bits(m)


def shared_exponents(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """e per block of `blocks` [..., 32] (int32): the smallest with no element clamped."""
    check_bits(bits)
    amax = blocks.abs().amax(dim=-1).float()
    # first guess from the logarithm, then corrected by one either way (log2 rounding at powers of two)
    guess = torch.ceil(torch.log2(amax.clamp(min=2.0**-149) * 2.0 ** (bits - 2) / (qmax(bits) + 0.5)))
    e = guess.clamp(EXP_MIN, EXP_MAX).to(torch.int32)
    fits = torch.round(amax / step_size(e, bits)) <= qmax(bits)
    e = torch.where(fits, e, (e + 1).clamp(max=EXP_MAX))
    lower = (e - 1).clamp(min=EXP_MIN)
    e = torch.where(torch.round(amax / step_size(lower, bits)) <= qmax(bits), lower, e)
    return torch.where(amax == 0, torch.full_like(e, EXP_MIN), e)


def quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., n], e int32 [..., n/32]) of x [..., n] along its last dimension (n a multiple of 32)."""
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"MXINT needs a multiple of {BLOCK} values per row, got {n}")
    if not torch.isfinite(x).all():
        raise ValueError(f"MXINT input contains {int((~torch.isfinite(x)).sum())} NaN/Inf value(s)")
    blocks = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    e = shared_exponents(blocks, bits)
    q = torch.clamp(torch.round(blocks / step_size(e, bits).unsqueeze(-1)), -qmax(bits), qmax(bits))
    return q.reshape(x.shape).to(torch.int8), e


def dequantize_blocks(q: torch.Tensor, e: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_blocks`: fp32 [..., n]."""
    n = q.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], n // BLOCK, BLOCK)
    return (blocks * step_size(e, bits).unsqueeze(-1)).reshape(q.shape)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x quantized to MXINT-`bits` and back, in x's dtype (activations, KV cache, solver evaluation)."""
    return dequantize_blocks(*quantize_blocks(x, bits), bits).to(x.dtype)


def pack_signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    """m-bit two's-complement elements: int8 as they are for m = 8, else bit-stream packed int32 words."""
    return q.to(torch.int8).contiguous() if bits == 8 else pack(q.to(torch.int64) & (2**bits - 1), bits)


def unpack_signed(stored: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_signed`: int8 [..., n]."""
    if bits == 8:
        return stored
    u = unpack(stored, bits, n).to(torch.int16)
    return torch.where(u >= 2 ** (bits - 1), u - 2**bits, u).to(torch.int8)


@register_format
class MXIntFormat(WeightFormat):
    """A weight whose columns fall into MXINT classes of whole 32-column blocks, each with its own
    mantissa width (MXSens: 8 for the most sensitive block, 6, then 4), in a permuted column order.

    Column order: the stored matrix is W[:, perm] (perm int32 [in], absent = identity); its first
    `columns[0]` columns form class 0 with `widths[0]` mantissa bits, and so on.
    Stored tensors, per class c: `q<c>` (m = 8: int8 [out, n_c]; else int32 bit-stream words of m-bit
    two's-complement elements, see `formats.packing`) and `e<c>` uint8 [out, n_c/32] (E8M0: e + 127);
    `perm` when the order is not the identity. Meta: widths, columns, in_features (the constructor checks the
    tensors' shapes against it).
    Cost: (Σ_c m_c·n_c)/in + 8/32 bits per weight (+ 32/out for the permutation).
    """

    name = "mxint"
    supported_bits = MANTISSA_BITS
    supported_group_sizes = (BLOCK,)
    default_group_size = BLOCK

    def __init__(self, tensors: dict[str, torch.Tensor], widths: list[int], columns: list[int], in_features: int):
        check_classes(widths, columns, in_features)
        out = tensors["e0"].shape[0]
        want = {"perm": (in_features,)}
        for c, (m, n) in enumerate(zip(widths, columns)):
            want |= {f"q{c}": (out, n if m == 8 else packed_words(n, m)), f"e{c}": (out, n // BLOCK)}
        check_shapes({k: tensors.get(k) if k == "perm" else tensors[k] for k in want}, want,
                     f"MXINT classes {list(zip(widths, columns))}")
        self.widths, self.columns, self.in_features = list(widths), list(columns), in_features
        self.stored = tensors
        self.perm = tensors.get("perm")
        self.out_features = out

    @classmethod
    def from_codes(cls, q: torch.Tensor, e: torch.Tensor, widths: list[int], columns: list[int],
                   perm: torch.Tensor | None = None) -> MXIntFormat:
        """Pack elements q int [out, in] and exponents e int [out, in/32], both in stored (permuted)
        column order, into the given classes."""
        tensors, start = {}, 0
        for c, (m, n) in enumerate(zip(widths, columns)):
            tensors[f"q{c}"] = pack_signed(q[:, start:start + n], m)
            tensors[f"e{c}"] = (e[:, start // BLOCK:(start + n) // BLOCK] + EXP_BIAS).to(torch.uint8).contiguous()
            start += n
        if perm is not None:
            tensors["perm"] = perm.to(torch.int32).contiguous()
        return cls(tensors, widths, columns, q.shape[1])

    @classmethod
    def quantize(cls, weight: torch.Tensor, widths: list[int], columns: list[int],
                 perm: torch.Tensor | None = None) -> MXIntFormat:
        """Quantize `weight` [out, in] (columns taken in `perm` order) into the given classes."""
        check_classes(widths, columns, weight.shape[1])
        w = weight if perm is None else weight[:, perm.long()]
        bounds = [0] + list(itertools.accumulate(columns))
        parts = [quantize_blocks(w[:, a:b], m) for m, a, b in zip(widths, bounds, bounds[1:])]
        return cls.from_codes(torch.cat([q for q, _ in parts], 1), torch.cat([e for _, e in parts], 1),
                              widths, columns, perm)

    def classes(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(mantissa bits, q int8 [out, n_c], e int32 [out, n_c/32]) per class, in stored column order."""
        return [(m, unpack_signed(self.stored[f"q{c}"], m, n), self.stored[f"e{c}"].to(torch.int32) - EXP_BIAS)
                for c, (m, n) in enumerate(zip(self.widths, self.columns))]

    def dequantize(self, selector=None) -> torch.Tensor:
        permuted = torch.cat([dequantize_blocks(q, e, m) for m, q, e in self.classes()], dim=1)
        if self.perm is None:
            return permuted
        w = torch.empty_like(permuted)
        w[:, self.perm.long()] = permuted
        return w

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.stored)

    def meta(self) -> dict:
        return {"widths": self.widths, "columns": self.columns, "in_features": self.in_features}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict) -> MXIntFormat:
        return cls(dict(tensors), list(meta["widths"]), list(meta["columns"]), int(meta["in_features"]))

    def permute_rows(self, order: torch.Tensor) -> MXIntFormat:
        rows = {k: v if k == "perm" else v[order.long()].contiguous() for k, v in self.stored.items()}
        return MXIntFormat(rows, self.widths, self.columns, self.in_features)

    def in_stored_order(self) -> MXIntFormat:
        """This weight without its permutation: for an input that already arrives as x[:, perm]."""
        return MXIntFormat({k: v for k, v in self.stored.items() if k != "perm"}, self.widths, self.columns,
                           self.in_features)

    def element_bits(self) -> float:
        """Mean element (mantissa) bits per weight, (Σ_c m_c·n_c)/in: the paper's accounting, without the
        shared exponent byte every MXINT block pays alike (`bits_per_weight` counts everything stored)."""
        return sum(m * n for m, n in zip(self.widths, self.columns)) / self.in_features

    def describe(self) -> str:
        split = "/".join(f"{m}:{n}" for m, n in zip(self.widths, self.columns) if n)
        return f"mxint {split}" + (" permuted" if self.perm is not None else "")
