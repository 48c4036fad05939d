"""llama.cpp's block layouts (ggml-common.h): the K-quants Q2_K–Q6_K and the 32-value types their mixes fall back to.

Every type here is, per sub-block s of `sub` consecutive values of a row,

    w = (d · (sc_s − scale_zero)) · (q − code_zero) − dmin · mn_s

with d, dmin fp16 per block of `block` values, sc_s / mn_s the sub-block's small integer scale and minimum, and q the
unsigned code. That is ggml's dequantization with its own operation order (`dequantize_row_*` in ggml-quants.c, the
`gguf` package's `dequantize_blocks`), so the fp32 values are bit-identical:

    type   block sub bytes  q bits  code_zero  sc            mn      stored as (per block, in order)
    Q2_K   256   16   84    2       0          4-bit         4-bit   scales[16] (sc | mn<<4), qs[64], d, dmin
    Q3_K   256   16  110    3       4          6-bit − 32    —       hmask[32], qs[64], scales[12], d
    Q4_K   256   32  144    4       0          6-bit         6-bit   d, dmin, scales[12], qs[128]
    Q5_K   256   32  176    5       0          6-bit         6-bit   d, dmin, scales[12], qh[32], qs[128]
    Q6_K   256   16  210    6       32         int8          —       ql[128], qh[64], scales[16], d
    Q4_0    32   32   18    4       8          1             —       d, qs[16]
    Q5_0    32   32   22    5       16         1             —       d, qh[4], qs[16]
    Q5_1    32   32   24    5       0          1             1       d, m, qh[4], qs[16]     (dmin = −m)
    Q8_0    32   32   34    8       128        1             —       d, qs[32] (int8 q − 128)

Codes are bit-split as ggml stores them: a "plane" of b bits (`_planes`) puts value k·32 + j of each group of
32·8/b values into byte j of the group's 32 at bit b·k (K-quants); the 32-value types hold values j and j + 16 in the
nibbles of byte j and Q5's fifth bits as one little-endian word. The 6-bit scales of Q3_K and Q4_K/Q5_K are packed
as `pack_scales3` / `pack_scales4` say.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class BlockType:
    """One ggml block type: sizes, code width and the zero offsets of `dequantize`."""

    name: str
    block: int  # values per block (one d, one dmin)
    sub: int  # values per sub-block (one sc, one mn)
    nbytes: int  # bytes per block
    bits: int  # code bits
    code_zero: int = 0
    scale_bits: int = 0  # bits of a sub-block scale (0: no sub-block scales, sc = 1)
    scale_zero: int = 0
    has_min: bool = False
    signed_scales: bool = False  # Q6_K: sc is int8

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def subs(self) -> int:
        return self.block // self.sub

    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.block


TYPES = {t.name: t for t in (
    BlockType("Q2_K", QK_K, 16, 84, 2, scale_bits=4, has_min=True),
    BlockType("Q3_K", QK_K, 16, 110, 3, code_zero=4, scale_bits=6, scale_zero=32),
    BlockType("Q4_K", QK_K, 32, 144, 4, scale_bits=6, has_min=True),
    BlockType("Q5_K", QK_K, 32, 176, 5, scale_bits=6, has_min=True),
    BlockType("Q6_K", QK_K, 16, 210, 6, code_zero=32, scale_bits=8, signed_scales=True),
    BlockType("Q4_0", 32, 32, 18, 4, code_zero=8),
    BlockType("Q5_0", 32, 32, 22, 5, code_zero=16),
    BlockType("Q5_1", 32, 32, 24, 5, has_min=True),
    BlockType("Q8_0", 32, 32, 34, 8, code_zero=128),
)}


def block_type(name: str) -> BlockType:
    try:
        return TYPES[name]
    except KeyError:
        raise ValueError(f"unknown ggml block type {name!r}; known: {', '.join(TYPES)}") from None


@dataclass
class Blocks:
    """The fields of a matrix's blocks, [rows, nb, ...]: codes q (uint8, element order), sub-block scales sc and
    minimums mn (int16 as stored: Q3_K's sc still offset by 32), d and dmin (fp16; dmin None without minimums)."""

    q: torch.Tensor  # uint8 [rows, nb, block]
    sc: torch.Tensor  # int16 [rows, nb, subs]
    mn: torch.Tensor | None  # int16 [rows, nb, subs]
    d: torch.Tensor  # fp16 [rows, nb]
    dmin: torch.Tensor | None  # fp16 [rows, nb]

    def steps(self, t: BlockType) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per sub-block (a, b) of w = a·(q − code_zero) − b, fp32 [rows, nb, subs], as ggml computes them."""
        a = self.d.float().unsqueeze(-1) * (self.sc - t.scale_zero).float()
        b = None if self.mn is None else self.dmin.float().unsqueeze(-1) * self.mn.float()
        return a, b

    def dequantize(self, t: BlockType) -> torch.Tensor:
        """fp32 [rows, nb·block]."""
        a, b = self.steps(t)
        rows, nb, _ = self.q.shape
        q = (self.q.view(rows, nb, t.subs, t.sub).float() - t.code_zero)
        w = a.unsqueeze(-1) * q
        if b is not None:
            w = w - b.unsqueeze(-1)
        return w.reshape(rows, nb * t.block)


# ---------------------------------------------------------------- bit planes
def _planes(q: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Codes [..., n] (n a multiple of `width`·8/bits) packed as ggml's planes: value k·width + j goes to byte j at bit
    bits·k, for j < width. Returns uint8 [..., n·bits/8]."""
    per = 8 // bits
    shape = q.shape[:-1]
    q = q.to(torch.uint8).reshape(*shape, -1, per, width)
    out = torch.zeros(*q.shape[:-2], width, dtype=torch.uint8)
    for k in range(per):
        out |= (q[..., k, :] & (2**bits - 1)) << (bits * k)
    return out.reshape(*shape, -1)


def _unplanes(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Inverse of `_planes`."""
    per = 8 // bits
    shape = packed.shape[:-1]
    p = packed.reshape(*shape, -1, 1, width)
    shifts = (torch.arange(per, dtype=torch.uint8) * bits).view(per, 1)
    return ((p >> shifts) & (2**bits - 1)).reshape(*shape, -1)


def _split(q: torch.Tensor, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes as their `low` low bits and the bits above."""
    return q & (2**low - 1), q >> low


# ---------------------------------------------------------------- 6-bit scales
def pack_scales3(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 6-bit scales [.., 16] -> 12 bytes: low nibbles of 0-7 | 8-15 in bytes 0-7, the high 2 bits of scale j
    in byte 8 + j mod 4 at bit 2·(j div 4)."""
    low, high = _split(sc.to(torch.uint8), 4)
    nibbles = low[..., :8] | (low[..., 8:] << 4)
    return torch.cat([nibbles, _planes(high, 2, 4)], dim=-1)


def unpack_scales3(b: torch.Tensor) -> torch.Tensor:
    low = torch.cat([b[..., :8] & 15, b[..., :8] >> 4], dim=-1)
    return (low | (_unplanes(b[..., 8:], 2, 4) << 4)).to(torch.int16)


def pack_scales4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 6-bit scales and 8 6-bit minimums -> 12 bytes (`get_scale_min_k4`): bytes 0-3 scales 0-3,
    4-7 minimums 0-3 (low 6 bits each; their top 2 bits hold the high bits of scales / minimums 4-7), bytes 8-11
    the low nibbles of scale j | minimum j << 4 for j = 4-7."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    first = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6)], dim=-1)
    return torch.cat([first, (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], dim=-1)


def unpack_scales4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc = torch.cat([b[..., :4] & 63, (b[..., 8:] & 15) | ((b[..., :4] >> 6) << 4)], dim=-1)
    mn = torch.cat([b[..., 4:8] & 63, (b[..., 8:] >> 4) | ((b[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.to(torch.int16), mn.to(torch.int16)


# ---------------------------------------------------------------- whole blocks
def _half(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)


def _k_codes(q: torch.Tensor, bits_low: int, high_bits: int) -> list[torch.Tensor]:
    """A K-quant block's codes [.., 256] as its stored arrays: the bits above the `bits_low` low ones as planes over
    32 values (Q3_K hmask, Q5_K qh), then the low bits as planes over 32 values (Q2_K/Q3_K qs: 4 per byte, Q4_K/Q5_K
    qs: 2 per byte)."""
    low, high = _split(q, bits_low)
    return ([_planes(high, high_bits, 32)] if high_bits else []) + [_planes(low, bits_low, 32)]


def _k_uncodes(high: torch.Tensor | None, low: torch.Tensor, bits_low: int, high_bits: int) -> torch.Tensor:
    q = _unplanes(low, bits_low, 32)
    return q if high is None else q | (_unplanes(high, high_bits, 32) << bits_low)


def _q6_codes(q: torch.Tensor) -> list[torch.Tensor]:
    """Q6_K: per half of 128 values, ql[64] holds the low nibbles of values l and l + 64 (byte l) and of l + 32,
    l + 96 (byte l + 32); qh[32] the high 2 bits of l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6 of byte l."""
    low, high = _split(q, 4)
    shape = q.shape[:-1]
    low = low.reshape(*shape, 2, 2, 2, 32)  # half, nibble (values 0-63 | 64-127), byte group, byte
    ql = (low[..., 0, :, :] | (low[..., 1, :, :] << 4)).reshape(*shape, 128)
    qh = _planes(high.reshape(*shape, 2, 128), 2, 32).reshape(*shape, 64)
    return [ql, qh]


def _q6_uncodes(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    shape = ql.shape[:-1]
    ql = ql.reshape(*shape, 2, 1, 64)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15  # [.., half, nibble, 64]
    high = _unplanes(qh.reshape(*shape, 2, 32), 2, 32)
    return (low.reshape(*shape, 2, 128) | (high << 4)).reshape(*shape, 256)


def _legacy_codes(q: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Q4_0/Q5_0/Q5_1: byte j holds values j (low nibble) and j + 16; Q5's fifth bits form one little-endian
    32-bit word, bit j for value j. Q8_0: one int8 per value."""
    if bits == 8:
        return [(q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)]
    low, high = _split(q, 4)
    nibbles = low[..., :16] | (low[..., 16:] << 4)
    if bits == 4:
        return [nibbles]
    bits = high.reshape(*high.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.uint8)
    return [bits.sum(-1).to(torch.uint8), nibbles]  # bit j of the word: byte j div 8, bit j mod 8


def _legacy_uncodes(parts: list[torch.Tensor], bits: int) -> torch.Tensor:
    if bits == 8:
        return (parts[0].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    nibbles = parts[-1]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    if bits == 4:
        return q
    high = (parts[0].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return q | (high.reshape(q.shape) << 4)


def pack(t: BlockType, blocks: Blocks) -> torch.Tensor:
    """The fields as ggml's bytes, uint8 [rows, nb·nbytes]."""
    rows, nb, _ = blocks.q.shape
    q, sc, mn = blocks.q, blocks.sc, blocks.mn
    if t.name == "Q2_K":
        parts = [(sc | (mn << 4)).to(torch.uint8), *_k_codes(q, 2, 0), _half(blocks.d), _half(blocks.dmin)]
    elif t.name == "Q3_K":
        parts = [*_k_codes(q, 2, 1), pack_scales3(sc), _half(blocks.d)]
    elif t.name in ("Q4_K", "Q5_K"):
        parts = [_half(blocks.d), _half(blocks.dmin), pack_scales4(sc, mn), *_k_codes(q, 4, t.bits - 4)]
    elif t.name == "Q6_K":
        parts = [*_q6_codes(q), sc.to(torch.int8).view(torch.uint8), _half(blocks.d)]
    else:
        head = [_half(blocks.d)] + ([_half(-blocks.dmin)] if t.has_min else [])
        parts = head + _legacy_codes(q, t.bits)
    out = torch.cat(parts, dim=-1)
    if out.shape[-1] != t.nbytes:
        raise AssertionError(f"{t.name}: packed {out.shape[-1]} bytes per block, expected {t.nbytes}")
    return out.reshape(rows, nb * t.nbytes)


def unpack(t: BlockType, data: torch.Tensor) -> Blocks:
    """Inverse of `pack`: uint8 [rows, nb·nbytes] -> fields."""
    rows = data.shape[0]
    b = data.reshape(rows, -1, t.nbytes)
    nb = b.shape[1]
    ones = torch.ones(rows, nb, 1, dtype=torch.int16)
    mn = dmin = None
    if t.name == "Q2_K":
        sc, mn = (b[..., :16] & 15).to(torch.int16), (b[..., :16] >> 4).to(torch.int16)
        q = _k_uncodes(None, b[..., 16:80], 2, 0)
        d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    elif t.name == "Q3_K":
        q = _k_uncodes(b[..., :32], b[..., 32:96], 2, 1)
        sc, d = unpack_scales3(b[..., 96:108]), _f16(b[..., 108:110])
    elif t.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
        sc, mn = unpack_scales4(b[..., 4:16])
        high = b[..., 16:48] if t.bits == 5 else None
        q = _k_uncodes(high, b[..., -128:], 4, t.bits - 4)
    elif t.name == "Q6_K":
        q = _q6_uncodes(b[..., :128], b[..., 128:192])
        sc, d = b[..., 192:208].contiguous().view(torch.int8).to(torch.int16), _f16(b[..., 208:210])
    else:
        d, rest = _f16(b[..., :2]), b[..., 2:]
        if t.has_min:
            dmin, rest, mn = -_f16(rest[..., :2]), rest[..., 2:], ones
        parts = [rest] if t.bits != 5 else [rest[..., :4], rest[..., 4:]]
        q, sc = _legacy_uncodes(parts, t.bits), ones
    return Blocks(q.to(torch.uint8), sc, mn, d, dmin)


# what llama.cpp writes when a row does not split into super-blocks of 256 (`tensor_type_fallback`)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def with_fallback(name: str, in_features: int) -> BlockType:
    """Block type `name`, or the 32-value type llama.cpp falls back to when rows of `in_features` values do not split
    into its blocks."""
    t = block_type(name)
    if in_features % t.block:
        t = block_type(FALLBACK.get(name, name))
    if in_features % t.block:
        raise ValueError(f"rows of {in_features} values split into no ggml block type (multiples of 32 only)")
    return t
