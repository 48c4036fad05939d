"""The MXINT CPU kernel (bitquilt.kernels.mxint) against the format's torch reference, on every ISA path."""

import gc
import logging
import weakref

import pytest
import torch

from bitquilt import kernels
from bitquilt.formats import MatmulContext
from bitquilt.formats.mxint import BLOCK, MXIntFormat, dequantize_blocks
from bitquilt.kernels import cpu
from bitquilt.kernels import mxint as mk

needs_ext = pytest.mark.skipif(cpu.extension() is None, reason="CPU extension unavailable (no AVX2 or build failed)")
ISAS = mk.supported_isas() or ("avx2",)  # AVX2 always, AVX-512 where the CPU has it
TOKENS = (1, 3, 17, 64, 300)  # one token, token groups with a remainder, both sides of the sgemm switch


def random_format(n: int, widths: list[int], columns: list[int], permute: bool, seed: int = 0) -> MXIntFormat:
    """Heavy-tailed weights quantized into the given classes, optionally with a random column order."""
    gen = torch.Generator().manual_seed(seed)
    k = sum(columns)
    w = torch.randn(n, k, generator=gen) * torch.exp(0.7 * torch.randn(n, k, generator=gen)) * 0.02
    return MXIntFormat.quantize(w, widths, columns, torch.randperm(k, generator=gen) if permute else None)


def coded_format(n: int, widths: list[int], columns: list[int], exponents: tuple[int, int],
                 zero_blocks: float, seed: int = 0) -> MXIntFormat:
    """Random codes with exponents drawn from `exponents` and a fraction of all-zero blocks (some with
    e = −127, as quantization writes them, some with a random e)."""
    gen = torch.Generator().manual_seed(seed)
    k = sum(columns)
    parts = [torch.randint(-(2 ** (m - 1) - 1), 2 ** (m - 1), (n, c), generator=gen) for m, c in zip(widths, columns)]
    q = torch.cat(parts, 1)
    e = torch.randint(exponents[0], exponents[1] + 1, (n, k // BLOCK), generator=gen)
    zero = torch.rand(n, k // BLOCK, generator=gen) < zero_blocks
    q = q.view(n, -1, BLOCK).masked_fill(zero.unsqueeze(-1), 0).view(n, k)
    e = torch.where(zero & (torch.rand(n, k // BLOCK, generator=gen) < 0.5), -127, e)
    return MXIntFormat.from_codes(q, e, widths, columns, torch.randperm(k, generator=gen))


def assert_matches_reference(y: torch.Tensor, fmt: MXIntFormat, x: torch.Tensor) -> None:
    """|y − reference| ≤ 1e-5·|x|·|Ŵ|ᵀ, plus K subnormal ulps (2^-149) for weights near underflow."""
    ref = fmt.reference_matmul(x)
    scale = x.double().abs() @ fmt.dequantize().double().abs().T
    tol = 1e-5 * scale + x.shape[1] * 2.0**-149
    assert y.shape == ref.shape and y.dtype == ref.dtype
    excess = ((y.double() - ref.double()).abs() - tol).max().item()
    assert excess <= 0, f"kernel differs from the reference by up to {excess:.3g} beyond the tolerance"


def check_all_paths(fmt: MXIntFormat, isa: str, x_scale: float = 1.0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tokens in TOKENS:
        x = torch.randn(tokens, fmt.in_features, generator=gen) * x_scale
        assert_matches_reference(mk.matmul(fmt, x, isa=isa), fmt, x)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_single_class_matches_reference(isa, bits):
    check_all_paths(random_format(33, [bits], [160], permute=False, seed=bits), isa)  # 5 blocks: a padded group


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("classes", [([8, 6, 4], [32, 64, 480]), ([4, 8], [96, 32]), ([6, 4, 8, 4], [64, 32, 32, 128])])
def test_mixed_classes_match_reference(isa, permute, classes):
    check_all_paths(random_format(37, *classes, permute=permute), isa)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("exponents", "x_scale"),
                         [((-127, -118), 1.0), ((100, 127), 2.0**-110), ((-30, 30), 2.0**-20)])  # subnormal, huge, wide
def test_zero_blocks_and_extreme_exponents(isa, exponents, x_scale):
    fmt = coded_format(21, [8, 6, 4], [32, 32, 256], exponents, zero_blocks=0.3)
    check_all_paths(fmt, isa, x_scale)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_decoders_are_exact(isa):
    fmt = coded_format(19, [4, 8, 6, 4], [96, 32, 64, 128], (-127, 127), zero_blocks=0.2)
    lay = mk.layout(fmt)
    stored = torch.cat([dequantize_blocks(q, e, m) for m, q, e in fmt.classes()], 1)
    kept = lay.gather >= 0  # padding columns of the 4-bit classes dropped
    assert torch.equal(lay.dequantize(isa)[:, kept], stored)
    assert torch.equal(lay.gather[kept].long(), fmt.perm.long())


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_batch_size_picks_the_path(isa):
    fmt = random_format(40, [8, 4], [32, 224], permute=True)
    lay = mk.layout(fmt)
    big = torch.randn(mk.SGEMM_BATCH[isa], 256)
    assert torch.equal(lay.matmul(big, isa), lay.sgemm(lay.prepare(big), isa))
    assert torch.equal(lay.matmul(big[:-1], isa), lay.gemv(lay.prepare(big[:-1]), isa))


@needs_ext
def test_declines_what_it_cannot_run():
    fmt = random_format(32, [4], [128], permute=False)
    x = torch.randn(4, 128)
    per_token = MatmulContext(slices=torch.ones(4, dtype=torch.long))
    assert mk.matmul(fmt, x, per_token) is None
    assert kernels.quant_matmul(fmt, x, per_token) is None
    assert mk.matmul(fmt, x, MatmulContext()) is not None  # no per-token field: the kernel runs
    assert mk.matmul(fmt, x.unsqueeze(0)) is None  # not 2-D
    assert mk.matmul(fmt, x[:, :96]) is None  # wrong width: the reference reports it
    assert mk.matmul(fmt, x.clone().requires_grad_()) is None  # autograd wants the reference
    with torch.no_grad():
        assert mk.matmul(fmt, x.clone().requires_grad_()) is not None


@needs_ext
def test_layout_is_cached_in_the_kernel_and_the_4bit_class_stays_4bit():
    fmt = random_format(64, [8, 4], [32, 512], permute=True)
    attributes = set(vars(fmt))
    assert kernels.kernel_layout_bytes(fmt) == 0
    lay = mk.layout(fmt)
    assert mk.layout(fmt) is lay and set(vars(fmt)) == attributes
    assert kernels.kernel_layout_bytes(fmt) == lay.nbytes()
    assert lay.weights.nbytes == 64 * (64 + 512 // 2)  # int8 8-bit block padded to a cache line, 4-bit nibbles
    assert lay.class_bytes_per_weight() == {8: 33 / 32, 4: 17 / 32}  # with the E8M0 byte per block
    plain = mk.layout(random_format(64, [4], [512], permute=False))
    assert plain.weights.nbytes == 64 * 512 // 2 and plain.gather is None  # 0.5 byte per 4-bit weight
    assert lay.nbytes() <= 1.1 * sum(t.nbytes for t in fmt.tensors().values())
    dead = weakref.ref(lay)
    del fmt, lay
    gc.collect()
    assert dead() is None  # dropped with its format


@needs_ext
def test_isa_selection(monkeypatch, caplog):
    supported = mk.supported_isas()
    monkeypatch.delenv("BITQUILT_ISA", raising=False)
    assert supported[0] == "avx2" and mk.active_isa() == supported[-1]
    monkeypatch.setenv("BITQUILT_ISA", "avx2")
    assert mk.active_isa() == "avx2"
    assert mk.active_isa(supported[-1]) == supported[-1]  # an explicit path wins over the variable
    monkeypatch.setenv("BITQUILT_ISA", "sse9")
    with caplog.at_level(logging.WARNING, logger=mk.__name__):
        assert mk.active_isa() == supported[-1]
    assert "sse9" in caplog.text
    with pytest.raises(ValueError, match="unavailable"):
        mk.active_isa("sse9")


@needs_ext
@pytest.mark.parametrize("bits", range(2, 8))
def test_layouts_unpack_codes_as_the_format_does(bits):
    """csrc/kernels/repack.cpp's `unpack_signed`, which the layout is built from, is the format's own `unpack_signed`,
    rows taken apart from a larger weight included."""
    from bitquilt.formats.mxint import pack_signed, unpack_signed

    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (21, 160), generator=torch.Generator().manual_seed(bits))
    words = pack_signed(q, bits)
    assert torch.equal(cpu.extension().unpack_signed(words, bits, 160), unpack_signed(words, bits, 160))
    assert torch.equal(cpu.extension().unpack_signed(words[4:9], bits, 160), q[4:9].to(torch.int8))
