"""AVX2 CPU kernels: bit-plane lookup-table matmul for the `bitplane` and `uniform` formats.

Importing this module builds (once, cached under `$BITQUILT_CACHE/ext`, default
`~/.cache/bitquilt/ext`) and loads the C++ extension in `csrc/`, then registers the kernels
with `bitquilt.kernels`. If the build or load fails, one warning is logged and nothing is
registered, so `QuantLinear` keeps the torch reference path. `python -m bitquilt.kernels.cpu`
builds ahead of time (called by `make kernels`).

Both formats run through one kernel: a weight matrix is k binary planes with per-(row, group)
coefficients (a b-bit uniform grid is b planes with C_i = s·2^(i-1), C0 = −s·z). The packed
layout the kernel wants is built from the format's own tensors on first use and cached on the
format object (`fmt._cpu_lut`); the stored format is unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.kernels import register_kernel

log = logging.getLogger(__name__)

TILE = 32  # output rows per kernel tile
_SOURCES = [Path(__file__).parent / "csrc" / "lut_matmul.cpp"]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_ext: ModuleType | None = None
_failed = False


def cache_dir() -> Path:
    return Path(os.environ.get("BITQUILT_CACHE", Path.home() / ".cache" / "bitquilt")) / "ext"


def _load_extension(verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load

    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        raise RuntimeError("the CPU lacks AVX2")
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name="bitquilt_cpu", sources=[str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose)


def extension() -> ModuleType | None:
    """The compiled extension, built on first call; None (after one warning) if it cannot be."""
    global _ext, _failed
    if _ext is None and not _failed:
        try:
            _ext = _load_extension()
        except Exception as e:  # any build/load failure means: no kernels, torch reference path
            _failed = True
            log.warning("bitquilt: CPU kernels unavailable (%s); using the torch reference path",
                        str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    return _ext


# Byte t of a packed 32-byte vector holds tile row _ROW_OF_BYTE[t] (see csrc/lut_matmul.cpp).
_ROW_OF_BYTE = [8 * (t % 16 // 4) + (t >= 16) * 4 + t % 4 for t in range(TILE)]


def _block(group: int) -> int | None:
    return next((b for b in (128, 64, 32) if group % b == 0), None)


def _pad_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = -t.shape[dim] % TILE
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pack_planes(plane_bytes: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 [k, N, K/8] (bit j of byte p = column 8p+j) -> kernel layout [tiles, blocks, k, block/8, 32]."""
    k, n, kb = plane_bytes.shape
    t = _pad_rows(plane_bytes, 1).view(k, -1, TILE, kb * 8 // block, block // 8)
    return t[:, :, _ROW_OF_BYTE].permute(1, 3, 0, 4, 2).contiguous()


def _tile_coefficients(c: torch.Tensor) -> torch.Tensor:
    """[N, G, m] -> [tiles, G, m, 32] (rows in natural order within a tile)."""
    n, g, m = c.shape
    return _pad_rows(c, 0).view(-1, TILE, g, m).permute(0, 2, 3, 1).contiguous()


def codes_to_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [N, K] -> bit-plane bytes uint8 [bits, N, K/8] (bit j of byte p = column 8p+j)."""
    n, k = codes.shape
    c = codes.to(torch.int32).view(n, k // 8, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32)
    return torch.stack([(((c >> i) & 1) * weights).sum(-1) for i in range(bits)]).to(torch.uint8)


def _prepare_bitplane(fmt) -> tuple | None:
    block = _block(fmt.group_size)
    if block is None or fmt.in_features % 8:
        return None
    planes = fmt.planes.contiguous().view(torch.uint8)  # little-endian: byte p of row = columns 8p..8p+7
    w = pack_planes(planes.view(fmt.bits, fmt.out_features, -1), block)
    coef = _tile_coefficients(fmt.coeffs.to(torch.float16))
    return w, coef, fmt.bits, block, fmt.group_size, False


def _prepare_uniform(fmt) -> tuple | None:
    group = fmt.group_size if fmt.group_size > 0 else fmt.in_features
    block = _block(group)
    if fmt.g_idx is not None or block is None or fmt.in_features % group:
        return None
    w = pack_planes(codes_to_planes(fmt.codes(), fmt.bits), block)
    scale = fmt.scales.float()
    zero = fmt.zeros.float() if fmt.zeros is not None else torch.full_like(scale, 2 ** (fmt.bits - 1))
    coef = _tile_coefficients(torch.stack([scale, -scale * zero], dim=-1))
    return w, coef, fmt.bits, block, group, True


def _run(fmt: WeightFormat, x: torch.Tensor, prepare) -> torch.Tensor | None:
    if x.device.type != "cpu" or x.dim() != 2 or (x.requires_grad and torch.is_grad_enabled()):
        return None
    ext = extension()
    if ext is None:
        return None
    packed = getattr(fmt, "_cpu_lut", None)
    if packed is None:
        packed = prepare(fmt) or ()
        fmt._cpu_lut = packed
    if not packed:
        return None
    w, coef, bits, block, group, uniform = packed
    y = ext.lut_matmul(x.float().contiguous(), w, coef, fmt.out_features, bits, block, group, uniform)
    return y.to(x.dtype)


def bitplane_matmul(fmt: WeightFormat, x: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ for a `BitplaneFormat`; None when the shape is unsupported."""
    return _run(fmt, x, _prepare_bitplane)


def uniform_matmul(fmt: WeightFormat, x: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ for a `UniformFormat` without act-order (g_idx); None otherwise."""
    return _run(fmt, x, _prepare_uniform)


def register() -> bool:
    """Register the kernels if the extension loads; False (torch reference path) otherwise."""
    if extension() is None:
        return False
    register_kernel("bitplane", "cpu_lut", bitplane_matmul)
    register_kernel("uniform", "cpu_lut", uniform_matmul)
    return True


def build() -> bool:
    """Build (or find cached) the extension, print one status line; for `make kernels`."""
    global _ext, _failed
    _ext, _failed = None, False
    try:
        _ext = _load_extension()
    except Exception as e:
        print(f"bitquilt: CPU kernel build failed: {e}", file=sys.stderr)
        return False
    print(f"bitquilt: CPU kernels ready in {cache_dir()}")
    return True


if __name__ == "__main__":
    sys.exit(0 if build() else 1)
else:
    register()
