"""4- and 2-bit uniform weights times int8-rounded activations (bitquilt.kernels.q4_int8) against the torch
reference."""

import pytest
import torch
from conftest import make_tiny
from test_kernels import llm_like, make_uniform, needs_ext, term_magnitudes

from bitquilt import kernels
from bitquilt.api import quantize
from bitquilt.cli import main
from bitquilt.formats.uniform import UniformFormat
from bitquilt.isa import INT8_ISAS
from bitquilt.kernels import cpu, huge_pages, q4_int8
from bitquilt.kernels.layouts import PACK_ROWS
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode
from bitquilt.runtime.lean import LeanDecoder


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x with every block of 32 values rounded to int8 steps of max|x_b| / 127 (the kernel's x̂)."""
    tokens, k = x.shape
    blocks = x.view(tokens, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / max|x| as one fp32 division, as the kernel computes it (`127 / amax`, a scalar over a tensor, is a
    # reciprocal times 127 in torch: an ulp off at times, which moves an x·127/max|x| that lands on .5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    codes = (blocks * inv).round()
    return (codes * (amax / 127)).view(tokens, k)


ISAS = q4_int8.supported_isas() or ("avx2",)  # AVX2 always, AVX-VNNI and AVX-512 VNNI where the CPU has them


@pytest.fixture(params=ISAS)
def isa(request):
    """Each path this CPU runs, the default restored after."""
    q4_int8.set_isa(request.param)
    assert q4_int8.active_isa() == request.param
    yield request.param
    q4_int8.set_isa()


@needs_ext
@pytest.mark.parametrize("bits", q4_int8.BITS)
@pytest.mark.parametrize(("n", "k", "group", "tokens"),
                         [(70, 256, 128, 1), (64, 192, 64, 3), (33, 512, 64, 17), (5, 128, -1, 2), (4, 64, 64, 80),
                          (40, 576, 128, 3),  # a last group narrower than the others (smollm2-135m's rows)
                          (4102, 64, 64, 2),  # more rows than the layout converts at a time
                          (1030, 4416, 192, 1),  # and long rows too
                          (9, 8960, 128, 1), (6, 4416, 192, 3),  # long rows, groups of 64 and 192
                          (4, 4160, -1, 2)])  # one group per row
def test_kernel_is_the_exact_product_with_the_rounded_activations(n, k, group, tokens, bits, isa):
    w, x = llm_like(n, k)
    x = torch.cat([x, torch.randn(tokens, k)])[:tokens].contiguous()
    x[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    fmt = make_uniform(w, bits, group, sym=False)
    lay = q4_int8.layout(fmt)
    assert lay.codes.nbytes == -(-n // 32) * 32 * k * bits // 8  # bits per code, rows padded to the 32-row tile
    y = cpu.extension().q4_int8_matmul(x, lay.codes, lay.scales, n, lay.group, lay.bits)
    w_hat = fmt.dequantize().double()
    ref = rounded(x).double() @ w_hat.T
    fp32_scale = (x.double().abs() @ term_magnitudes(fmt).double().abs().T) * 2**-19  # fp32 sums of |terms|
    assert ((y.double() - ref).abs() <= fp32_scale + 1e-6).all()
    # the rounding is the only error: ≤ half a step per activation, weighted by |Ŵ|
    step = x.view(tokens, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(tokens, k) / 127
    bound = (step.double() / 2) @ w_hat.abs().T + fp32_scale + 1e-6
    exact = x.double() @ w_hat.T
    assert ((y.double() - exact).abs() <= bound).all()
    assert (y.double() - exact).abs().max() > 0  # it really rounds


@needs_ext
@pytest.mark.parametrize("bits", q4_int8.BITS)
def test_a_prompt_gives_each_token_the_single_token_result_bit_for_bit(bits, isa):
    """Prefill passes (two tokens on VNNI, a block decoded once for up to 16 on AVX2, the rest one by one) add in
    the order one token does: a prompt's rows equal the decode step's."""
    w, x = llm_like(70, 576)
    x = torch.cat([x, torch.randn(35, 576)])[:35].contiguous()
    lay = q4_int8.layout(make_uniform(w, bits, 128, sym=False))
    matmul = cpu.extension().q4_int8_matmul
    prompt = matmul(x, lay.codes, lay.scales, 70, lay.group, lay.bits)
    one_by_one = torch.cat([matmul(x[t:t + 1], lay.codes, lay.scales, 70, lay.group, lay.bits) for t in range(35)])
    assert torch.equal(prompt, one_by_one)


@needs_ext
@pytest.mark.parametrize(("sym", "tokens"), [(True, 1), (False, 3), (True, 16)])
def test_8bit_gemv_on_int8_activations_is_the_exact_product_with_the_rounded_activations(sym, tokens, int8_on, isa):
    from bitquilt.kernels import uniform8

    w, x = llm_like(48, 256)
    x = torch.cat([x] * 4)[:tokens].contiguous()
    fmt = make_uniform(w, 8, 64, sym=sym)
    y = uniform8.matmul(fmt, x)
    w_hat = fmt.dequantize().double()
    fp32_scale = (x.double().abs() @ term_magnitudes(fmt).double().abs().T) * 2**-19
    assert ((y.double() - rounded(x).double() @ w_hat.T).abs() <= fp32_scale + 1e-6).all()
    with kernels.using(int8_activations=False):
        exact = uniform8.matmul(fmt, x)
    assert (y - exact).abs().max() > 10 * (exact.double() - x.double() @ w_hat.T).abs().max()  # it really rounds


@needs_ext
def test_quant_linear_takes_the_int8_kernel_only_when_switched_on(int8_on):
    w, x = llm_like(96, 256)
    linear = QuantLinear(make_uniform(w, 4, 128, sym=False))
    ref = x @ linear.fmt.dequantize().T
    on = linear(x)
    assert torch.allclose(on, rounded(x) @ linear.fmt.dequantize().T, rtol=1e-5, atol=1e-4)
    with kernels.using(int8_activations=False):
        off = linear(x)  # the exact kernels (21-bit activation tables)
    assert (on - ref).abs().max() > 100 * (off - ref).abs().max()
    assert q4_int8.layout(make_uniform(w, 4, 32, sym=False)) is None  # groups of 32: the exact kernels take it
    fmt = make_uniform(w, 4, 128, sym=False)
    fp32_scales = UniformFormat(fmt.qweight, fmt.scales.float() * (1 + 2**-15), fmt.zeros, 4, 128, 256)
    assert q4_int8.layout(fp32_scales) is None  # the layout keeps scales in fp16: only those exact in fp16
    two_bit = QuantLinear(make_uniform(w, 2, 128, sym=True))  # 2-bit codes take the same kernel
    assert torch.allclose(two_bit(x), rounded(x) @ two_bit.fmt.dequantize().T, rtol=1e-5, atol=1e-4)
    three_bit = QuantLinear(make_uniform(w, 3, 128, sym=False))  # other widths keep their exact kernels
    assert torch.allclose(three_bit(x), x @ three_bit.fmt.dequantize().T, rtol=1e-4, atol=1e-3)


@needs_ext
def test_a_grid_refused_past_its_first_rows_takes_no_layout_room():
    """Layouts are cut from shared huge-page blocks that keep their room: every chunk of the grid is checked before
    any room is taken."""
    w, _ = llm_like(PACK_ROWS + 76, 64)
    fmt = make_uniform(w, 4, 64, sym=False)
    scales = fmt.scales.float().clone()
    scales[PACK_ROWS + 3] *= 1 + 2**-15  # not an fp16 value, in the second chunk
    late = UniformFormat(fmt.qweight, scales, fmt.zeros, 4, 64, 64)
    used = sum(u for _, u in huge_pages._slabs.blocks)
    assert q4_int8.layout(late) is None
    assert sum(u for _, u in huge_pages._slabs.blocks) == used
    lay = q4_int8.layout(fmt)
    assert lay is not None and sum(u for _, u in huge_pages._slabs.blocks) > used


@needs_ext
@pytest.mark.parametrize(("model_type", "bits"), [("llama", 4), ("qwen2", 4), ("llama", 2), ("llama", 8)])
def test_fused_decode_with_int8_activations_matches_module_by_module(model_type, bits, int8_on, isa):
    """4- and 2-bit linears on the low-bit × int8 kernel, 8-bit ones on the GEMV's int8 path, in the fused step as
    module by module (the 8-bit head runs the GEMV's int8 path in both).

    The two sum fp32 in different orders (C++ norms and attention vs torch's, which differ by CPU), so an activation
    on a rounding boundary can round to the neighbouring int8 level in one of them and shift that step and, through
    the cache, the next ones: the steps before a flip agree to 1e-4, and none differs by more than int8 rounding itself
    does (a fused step on the exact kernels would differ by that at every step)."""
    model = make_tiny(model_type)
    quantize(model, Recipe("rtn", w_bits=bits, group_size=64, head_bits=8), torch.randint(0, 320, (2, 32)),
             progress=False)
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))

    def steps(decoder: LeanDecoder) -> list[torch.Tensor]:
        return [decoder.forward(ids[:, :8])] + [decoder.forward(ids[:, t:t + 1]) for t in range(8, 12)]

    fused = LeanDecoder(model, 12)
    assert fused.fused is not None
    on, eager = steps(fused), steps(LeanDecoder(model, 12, fuse=False))
    with kernels.using(int8_activations=False):
        exact = steps(LeanDecoder(model, 12, fuse=False))
    close = [torch.allclose(a, b, atol=1e-4) for a, b in zip(on, eager)]
    assert close[0] and any(close[1:]), close  # the prompt (module by module in both) and the steps before a flip
    for a, b, e in zip(on, eager, exact):
        assert (a - b).abs().max() < 2 * (b - e).abs().max()  # a flip moves a step less than int8 rounding does
    assert decode(model, ids[:, :6], 5, engine="fused").new_ids == decode(model, ids[:, :6], 5, engine="lean").new_ids


@needs_ext
def test_cli_flag_switches_int8_activations_on_for_its_run_alone(tmp_path, capsys, monkeypatch):
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), torch.randint(0, 320, (2, 32)), progress=False)
    from bitquilt.eval import speed
    from bitquilt.io import save

    save(model, tmp_path / "m")
    seen = []
    measure = speed.measure_speed
    monkeypatch.setattr(speed, "measure_speed", lambda *a, **k: seen.append(kernels.options()) or measure(*a, **k))
    for flag in (["--int8-activations"], []):
        assert main(["bench", str(tmp_path / "m"), "--prompt-tokens", "8", "--new-tokens", "3", "--repeats", "1",
                     "--json", *flag]) == 0
        assert '"decode_tokens_per_s"' in capsys.readouterr().out
    assert [o.int8_activations for o in seen] == [True, False]
    assert not kernels.options().int8_activations  # the command's choice ended with it


@needs_ext
def test_isa_follows_the_variable_and_explicit_choices(monkeypatch):
    """`set_isa()` takes `$BITQUILT_ISA` when the CPU runs it, else the widest path; a path the CPU lacks is refused."""
    monkeypatch.setenv("BITQUILT_ISA", "avx2")
    assert q4_int8.set_isa() == "avx2" == q4_int8.active_isa()
    monkeypatch.delenv("BITQUILT_ISA")
    assert q4_int8.set_isa() == q4_int8.supported_isas()[-1] == q4_int8.active_isa()
    with pytest.raises(ValueError, match="unavailable"):
        q4_int8.set_isa("sse9")
    for index, isa in enumerate(INT8_ISAS):
        if isa not in q4_int8.supported_isas():
            with pytest.raises(RuntimeError, match="not supported by this CPU"):
                cpu.extension().q4_int8_set_isa(index)
