"""Bit-stream packing of small unsigned integers into int32 words.

Layout (stable, documented in the README): along the last dimension, value j occupies
bits [b*j, b*j + b) of a little-endian bit stream cut into 32-bit words. Every 32 values
fill exactly b words, so for b in {1, 2, 4, 8} a word holds 32/b whole values and for b = 3
a value may straddle two words. The last dimension must be a multiple of 32.

`bit_planes` re-cuts a packed stream into one bit per value, 8 values a byte: the layout the
lookup-table kernels read.
"""

from __future__ import annotations

import sys

import torch

WORD_BITS = 32


def packed_words(n: int, bits: int) -> int:
    if n % WORD_BITS:
        raise ValueError(f"cannot pack {n} values: the packed dimension must be a multiple of {WORD_BITS}")
    return n // WORD_BITS * bits


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers in [0, 2**bits) along the last dim into int32 words. For 1, 2, 4 and 8 bits the values are
    OR-ed into the stream's bytes directly (a word-by-word loop of int64 arithmetic otherwise, ≈ 1.5 s for the
    linears of a 0.5B model at 4 bits)."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    *lead, n = values.shape
    nw = packed_words(n, bits)
    if 8 % bits == 0 and sys.byteorder == "little":  # whole values per byte: value k of a byte at bits kb..
        v = values.to(torch.uint8).reshape(*lead, n * bits // 8, 8 // bits)
        stream = v[..., 0].clone(memory_format=torch.contiguous_format)  # also when empty: strides of its shape
        for k in range(1, 8 // bits):
            stream |= v[..., k] << (bits * k)
        return stream.view(torch.int32)
    words = torch.zeros(*lead, nw, dtype=torch.int64, device=values.device)
    v = values.to(torch.int64).reshape(*lead, n // WORD_BITS, WORD_BITS)
    w = words.view(*lead, n // WORD_BITS, bits)
    for j in range(WORD_BITS):
        offset = bits * j
        word, shift = divmod(offset, WORD_BITS)
        w[..., word] |= (v[..., j] << shift) & 0xFFFFFFFF
        if shift + bits > WORD_BITS:
            w[..., word + 1] |= v[..., j] >> (WORD_BITS - shift)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: int32 words -> uint8/int16 values. For 1, 2, 4 and 8 bits the words' bytes are cut into
    values with one shift (a word-by-word loop of int64 arithmetic otherwise, much slower per row)."""
    *lead, nw = words.shape
    if nw != packed_words(n, bits):
        raise ValueError(f"{nw} words cannot hold {n} values of {bits} bits")
    mask = (1 << bits) - 1
    if 8 % bits == 0 and sys.byteorder == "little":  # whole values per byte: the words' bytes are the stream
        stream = words.contiguous().view(torch.uint8)
        if bits == 8:
            return stream.clone()
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)  # value k of a byte: bits kb..
        return ((stream.unsqueeze(-1) >> shifts) & mask).reshape(*lead, n)
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.view(*lead, n // WORD_BITS, bits)
    out = torch.empty(*lead, n // WORD_BITS, WORD_BITS, dtype=torch.int64, device=words.device)
    for j in range(WORD_BITS):
        offset = bits * j
        word, shift = divmod(offset, WORD_BITS)
        value = w[..., word] >> shift
        if shift + bits > WORD_BITS:
            value = value | (w[..., word + 1] << (WORD_BITS - shift))
        out[..., j] = value & mask
    dtype = torch.uint8 if bits <= 8 else torch.int16
    return out.reshape(*lead, n).to(dtype)


def bit_planes(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Bit planes of `pack`ed values: uint8 [bits, *lead, n/8] from int32 words [*lead, n·bits/32].

    Bit j of byte p of plane i is bit i of value 8p + j. (The kernels cut uniform codes with csrc/kernels/repack.cpp;
    this is its reference, and the planes of bit-plane formats, which at one bit are the stream's bytes.)
    """
    *lead, nw = words.shape
    if nw != packed_words(n, bits):
        raise ValueError(f"{nw} words cannot hold {n} values of {bits} bits")
    if bits == 1 and sys.byteorder == "little":
        return words.contiguous().view(torch.uint8).reshape(1, *lead, n // 8).clone()
    shifts = torch.arange(0, WORD_BITS, 8, dtype=torch.int32, device=words.device)
    stream = ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)  # byte m of a word: its bits 8m..8m+7
    bit = torch.arange(8, dtype=torch.uint8, device=words.device)
    # 8 values fill `bits` whole bytes: bit t of byte m of such a group is bit i of value j, bits·j + i = 8m + t
    values = ((stream.reshape(*lead, n // 8, bits, 1) >> bit) & 1).reshape(*lead, n // 8, 8, bits)
    return (values << bit.unsqueeze(-1)).sum(-2, dtype=torch.uint8).movedim(-1, 0).contiguous()
