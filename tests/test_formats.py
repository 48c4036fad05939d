import json

import pytest
import torch

from bitquilt.formats import BitplaneFormat, CompositeFormat, MatmulContext, UniformFormat, UniformGrid, format_class
from bitquilt.formats.base import buffer_name, split_buffers, tensor_name
from bitquilt.formats.packing import bit_planes, pack, unpack
from bitquilt.solvers import LayerSpec, get_solver


def rtn(w: torch.Tensor, bits: int = 3, group: int = 64, sym: bool = False) -> UniformFormat:
    return get_solver("rtn")(w, None, LayerSpec(bits, group, sym))


def residual_slices(w: torch.Tensor, n: int) -> CompositeFormat:
    """n cumulative slices: slice e quantizes what slices 1..e−1 left of w."""
    parts, rest = {}, w
    for e in range(1, n + 1):
        parts[f"slice{e}"] = rtn(rest)
        rest = rest - parts[f"slice{e}"].dequantize()
    return CompositeFormat(parts)


def reference_plane_bytes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [bits, *lead, n/8], bit j of byte p of plane i = bit i of values[..., 8p + j], one bit at a time."""
    *lead, n = values.shape
    out = torch.zeros(bits, *lead, n // 8, dtype=torch.int64)
    for i in range(bits):
        for j in range(8):
            out[i] |= ((values[..., j::8].long() >> i) & 1) << j
    return out.to(torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pack_roundtrip(bits):
    values = torch.randint(0, 2**bits, (7, 3, 96))
    words = pack(values, bits)
    assert words.dtype == torch.int32 and words.shape == (7, 3, 96 * bits // 32)
    assert torch.equal(unpack(words, bits, 96).long(), values)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_unpack_reads_strided_words(bits):
    """Every other row of a packed tensor (a strided view, as a row gather may leave) unpacks to those rows."""
    values = torch.randint(0, 2**bits, (6, 64))
    assert torch.equal(unpack(pack(values, bits)[::2], bits, 64).long(), values[::2])


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


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_bit_planes_match_a_bitwise_reference(bits):
    values = torch.randint(0, 2**bits, (5, 2, 96))
    planes = bit_planes(pack(values, bits), bits, 96)
    assert planes.dtype == torch.uint8 and planes.shape == (bits, 5, 2, 12)
    assert torch.equal(planes, reference_plane_bytes(values, bits))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [False, True])
def test_uniform_accessors(bits, sym):
    fmt = rtn(torch.randn(16, 128), bits, 32, sym)
    scale, zero = fmt.scale_zero()
    assert scale.dtype == zero.dtype == torch.float32 and scale.shape == zero.shape == (16, 4)
    assert torch.equal(scale, fmt.scales.float())
    assert torch.equal(zero, torch.full_like(scale, 2 ** (bits - 1)) if sym else fmt.zeros.float())


def test_bitplane_accessors_and_width():
    planes = torch.randint(0, 2, (3, 8, 64))
    fmt = BitplaneFormat.from_codes(planes[0] + 2 * planes[1] + 4 * planes[2], torch.randn(8, 2, 4), 3, 32)
    assert torch.equal(fmt.plane_bytes(), reference_plane_bytes(planes, 1)[0])
    assert torch.equal(fmt.plane_bytes(slice(5, None)), fmt.plane_bytes()[:, 5:])
    BitplaneFormat.check_width(64)
    with pytest.raises(ValueError, match="in_features divisible by 32, got 80"):
        BitplaneFormat.check_width(80)


def test_formats_declare_what_they_hold():
    assert UniformFormat.supported_bits == (2, 3, 4, 8) and BitplaneFormat.supported_bits == (2, 3, 4)
    assert UniformFormat.supported_group_sizes == BitplaneFormat.supported_group_sizes == (32, 64, 128, 256, -1)
    assert LayerSpec(8, 128).validate(UniformFormat)
    with pytest.raises(ValueError, match="unsupported weight bits 8"):
        LayerSpec(8, 128).validate(BitplaneFormat)


def test_buffer_names():
    assert buffer_name("qweight") == "packed_qweight" and buffer_name("base.qweight") == "packed_base__qweight"
    assert tensor_name("packed_base__qweight") == "base.qweight" and tensor_name("bias") is None
    with pytest.raises(ValueError, match="cannot contain"):
        buffer_name("a__b")
    state = {"m.q.packed_qweight": 1, "m.q.packed_a__scales": 2, "m.q.bias": 3, "m.q.router.packed_x": 4,
             "m.qk.packed_qweight": 5}
    assert split_buffers(state, "m.q") == {"qweight": 1, "a.scales": 2}
    assert state == {"m.q.bias": 3, "m.q.router.packed_x": 4, "m.qk.packed_qweight": 5}
    assert split_buffers({"packed_perm": 6, "bias": 7}) == {"perm": 6}


def test_matmul_context():
    assert not MatmulContext().per_token() and MatmulContext(slices=torch.ones(2, 3)).per_token()
    assert MatmulContext(slices=torch.ones(2, 3)).flat().slices.shape == (6,)
    assert MatmulContext().flat().slices is None


def test_single_part_reference_matmul():
    fmt = rtn(torch.randn(24, 64))
    x = torch.randn(5, 64)
    torch.testing.assert_close(fmt.reference_matmul(x), x @ fmt.dequantize().T)
    assert torch.equal(fmt.reference_matmul(x, weight=torch.zeros(24, 64)), torch.zeros(5, 24))  # cache reused
    assert torch.equal(fmt.dequantize(selector=0), fmt.dequantize())  # one part: the selector is ignored
    ctx = MatmulContext(slices=torch.tensor([1, 0, 2, 1, 1]))
    torch.testing.assert_close(fmt.reference_matmul(x, ctx), fmt.reference_matmul(x))
    with pytest.raises(ValueError, match="for 4 tokens"):
        fmt.reference_matmul(x[:4], ctx)


def test_composite_round_trip_is_bit_exact():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    base = rtn(w, 4, 64)
    residual = BitplaneFormat.from_uniform(rtn(w - base.dequantize(), 2, 32, sym=True))
    fmt = CompositeFormat({"base": base, "residual": residual}, perm=torch.randperm(128))
    tensors, meta = fmt.tensors(), json.loads(json.dumps(fmt.meta()))
    assert set(tensors) == {"base.qweight", "base.scales", "base.zeros", "residual.planes", "residual.coeffs", "perm"}
    again = format_class("composite").from_tensors(dict(tensors), meta)
    assert again.tensors().keys() == tensors.keys()
    assert all(torch.equal(again.tensors()[k], t) for k, t in tensors.items())
    assert torch.equal(again.dequantize(), fmt.dequantize()) and again.describe() == fmt.describe()
    assert fmt.describe() == "composite(base: uniform w4 g64 asym + residual: bitplane w2 g32) permuted"
    assert fmt.nbytes() == base.nbytes() + residual.nbytes() + 128 * 4
    assert fmt.bits_per_weight() == pytest.approx(8 * fmt.nbytes() / (32 * 128))


def test_composite_selector_sums_leading_parts():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    fmt = residual_slices(w, 3)
    parts = [p.dequantize() for p in fmt.parts.values()]
    assert torch.equal(fmt.dequantize(0), torch.zeros_like(w))
    assert torch.equal(fmt.dequantize(2), torch.zeros_like(w) + parts[0] + parts[1])
    assert torch.equal(fmt.dequantize(), fmt.dequantize(3))
    errors = [(fmt.dequantize(k) - w).norm().item() for k in range(4)]
    assert all(a > 2 * b for a, b in zip(errors, errors[1:]))  # each slice refines the last
    with pytest.raises(ValueError, match="4 slices asked of a weight of 3"):
        fmt.dequantize(4)


def test_composite_per_token_slices():
    torch.manual_seed(0)
    fmt = residual_slices(torch.randn(24, 64), 3)
    x = torch.randn(7, 64)
    slices = torch.tensor([3, 0, 1, 3, 2, 1, 3])
    y = fmt.reference_matmul(x, MatmulContext(slices=slices))
    expected = torch.stack([x[t] @ fmt.dequantize(int(s)).T for t, s in enumerate(slices)])
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[1], torch.zeros(24))
    torch.testing.assert_close(fmt.reference_matmul(x), x @ fmt.dequantize().T)


def test_composite_permutation_and_inverse():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    perm = torch.randperm(64)
    fmt = CompositeFormat({"a": rtn(w[:, perm], 8, 32)}, perm=perm)
    part = fmt.parts["a"].dequantize()
    assert torch.equal(fmt.dequantize()[:, perm], part) and torch.equal(part[:, fmt.inverse], fmt.dequantize())
    assert torch.equal(perm[fmt.inverse], torch.arange(64)) and torch.equal(fmt.inverse[perm], torch.arange(64))
    assert (fmt.dequantize() - w).abs().max() < 0.02  # 8 bits: the permuted columns land back in place
    assert CompositeFormat({"a": rtn(w)}).inverse is None


def test_composite_rejects_bad_parts():
    a, b = rtn(torch.randn(16, 64)), rtn(torch.randn(16, 128))
    with pytest.raises(ValueError, match="share one"):
        CompositeFormat({"a": a, "b": b})
    with pytest.raises(ValueError, match="at least one part"):
        CompositeFormat({})
    with pytest.raises(ValueError, match="part names"):
        CompositeFormat({"a.b": a})
    with pytest.raises(ValueError, match="permutation"):
        CompositeFormat({"a": a}, perm=torch.zeros(64, dtype=torch.long))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_writes_the_documented_bit_stream(bits):
    """Value j at bits [b·j, b·j + b) of a little-endian stream cut into 32-bit words (the saved layout)."""
    values = torch.randint(0, 2**bits, (3, 64))
    for row, words in zip(values.tolist(), pack(values, bits).tolist()):
        stream = sum(v << (bits * j) for j, v in enumerate(row))
        assert [(w + 2**32) % 2**32 for w in words] == [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(len(words))]
    assert pack(values[:0], bits).shape == (0, 2 * bits)  # no rows (a residual with no blocks): no words
