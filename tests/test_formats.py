import pytest
import torch

from bitquilt.formats import UniformFormat, UniformGrid, format_class
from bitquilt.formats.packing import pack, unpack
from bitquilt.solvers import LayerSpec, get_solver


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pack_roundtrip(bits):
    values = torch.randint(0, 2**bits, (7, 3, 96))
    words = pack(values, bits)
    assert words.dtype == torch.int32 and words.shape == (7, 3, 96 * bits // 32)
    assert torch.equal(unpack(words, bits, 96).long(), values)


def test_pack_rejects_ragged_width():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(torch.zeros(2, 40, dtype=torch.long), 4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [False, True])
def test_uniform_roundtrip_and_bits_per_weight(bits, group_size, sym):
    torch.manual_seed(bits)
    w = torch.randn(48, 256)
    fmt = get_solver("rtn")(w, None, LayerSpec(bits, group_size, sym))
    g = 256 if group_size == -1 else group_size
    expected_bpw = bits + (16 + (0 if sym else 8)) / g
    assert fmt.bits_per_weight() == pytest.approx(expected_bpw)
    assert fmt.qweight.numel() * 32 == 48 * 256 * bits  # truly packed, not one byte per weight
    again = format_class(fmt.name).from_tensors(fmt.tensors(), fmt.meta())
    assert torch.equal(again.dequantize(), fmt.dequantize())
    # the codes and dequantized values agree with the grid's own fake quantization
    grid = UniformGrid(bits, sym)
    groups = w.reshape(-1, g)
    scale, zero = grid.fit(groups)
    assert torch.allclose(fmt.dequantize(), grid.fake(groups, scale, zero).reshape(w.shape))


def test_rtn_error_falls_with_bits():
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    errors = [(get_solver("rtn")(w, None, LayerSpec(b, 128)).dequantize() - w).pow(2).sum() for b in (2, 3, 4, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:]))


def test_asym_beats_sym_on_skewed_weights():
    torch.manual_seed(0)
    w = torch.rand(64, 256) ** 2  # all positive, skewed: a symmetric grid wastes half its levels
    err = {sym: (get_solver("rtn")(w, None, LayerSpec(3, 64, sym)).dequantize() - w).pow(2).sum() for sym in (0, 1)}
    assert err[False] < 0.5 * err[True]


def test_uniform_describe_and_bytes():
    fmt = get_solver("rtn")(torch.randn(32, 128), None, LayerSpec(4, 64))
    assert isinstance(fmt, UniformFormat)
    assert fmt.describe() == "uniform w4 g64 asym"
    assert fmt.nbytes() == 32 * 128 // 2 + 32 * 2 * 2 + 32 * 2


@pytest.mark.parametrize("spec, message", [
    (LayerSpec(5, 128), "unsupported weight bits 5"),
    (LayerSpec(4, 100), "unsupported group size 100"),
])
def test_bad_spec_is_rejected(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_ragged_last_group(method):
    # smollm2's width 576 at g128: four groups of 128 and a last group of 64, as the GPTQ reference does
    from bitquilt.solvers import LinearStats

    torch.manual_seed(0)
    w = torch.randn(8, 576)
    w[:, 512:] *= 10  # the short group has its own range: it must get its own scale
    stats = LinearStats.empty(576)
    stats.update(torch.randn(1024, 576))
    fmt = get_solver(method)(w, stats, LayerSpec(8, 128))
    assert fmt.scales.shape == (8, 5)
    assert torch.allclose(fmt.dequantize(), w, atol=0.05 * w[:, 512:].abs().max().item() / 10 + 0.05)
    again = format_class(fmt.name).from_tensors(fmt.tensors(), fmt.meta())
    assert torch.equal(again.dequantize(), fmt.dequantize())
