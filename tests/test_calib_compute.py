"""Calibration precision and device (`bitquilt.calib.compute`): the bf16 path's error on real layers, the choice of
precision, and the --calib-dtype, --device and --threads flags."""

from __future__ import annotations

import pytest
import torch

import bitquilt.calib.compute as compute
from bitquilt.api import calibration_compute
from bitquilt.calib.capture import capture_block_inputs, collect_stats, run_block
from bitquilt.calib.compute import CalibCompute, calibrating, choose_compute
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, gram, relative_error

BF16 = CalibCompute("bf16", "cpu", "test")
NAMES = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
# GPTQ on a bf16-calibrated Hessian may lose at most this much relative output error (measured on the fp32 Hessian)
# against GPTQ on the fp32 one, per linear.
LAYER_ERROR_BOUND = 0.05


@pytest.fixture(scope="module")
def stats_both(smollm, calib_ids):
    """{(block, linear): (weight, fp32 stats, bf16 stats)} of blocks 0 and 15 of smollm2-135m, both from the
    full-precision model's inputs, the bf16 ones through a bf16 calibration pass."""
    model = smollm[0]
    arch = architecture_of(model)
    inputs, kwargs = capture_block_inputs(model, arch, calib_ids)
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers(model, arch)[:16]):
            if i in (0, 15):
                fp32 = collect_stats(layer, NAMES, inputs, kwargs[i])
                with calibrating(BF16):
                    bf16 = collect_stats(layer, NAMES, inputs, kwargs[i])
                out.update({(i, n): (layer.get_submodule(n).weight.detach().float().clone(), fp32[n], bf16[n])
                            for n in NAMES})
            inputs = run_block(layer, inputs, kwargs[i])
    return out


def test_bf16_hessians_stay_close_and_factorable(stats_both):
    for (i, name), (_, fp32, bf16) in stats_both.items():
        h32, h16 = fp32.hessian.double(), bf16.hessian.double()
        assert bf16.hessian.dtype == torch.float32 and bf16.n_tokens == fp32.n_tokens
        assert (h16 - h32).norm() / h32.norm() < 1e-2, (i, name)
        damped = h16 + 0.01 * torch.diag(h32).mean() * torch.eye(len(h32), dtype=torch.float64)
        assert torch.linalg.eigvalsh(damped)[0] > 0, (i, name)  # GPTQ's dampening still makes it definite


def test_gptq_on_bf16_hessians_loses_little_layer_error(stats_both):
    """The bound of the bf16 path: per real linear, GPTQ W4g128 on the bf16 statistics leaves a relative output
    error (on the fp32 Hessian) within LAYER_ERROR_BOUND of GPTQ on the fp32 statistics."""
    gptq, spec = get_solver("gptq"), LayerSpec(4, 128)
    for (i, name), (w, fp32, bf16) in stats_both.items():
        e32 = relative_error(w, gptq(w, fp32, spec).dequantize(), fp32.hessian)
        e16 = relative_error(w, gptq(w, bf16, spec).dequantize(), fp32.hessian)
        assert e16 <= e32 * (1 + LAYER_ERROR_BOUND), (i, name, e32, e16)


def test_fp32_statistics_unchanged_by_the_precision_switch(stats_both, smollm, calib_ids):
    """fp32 calibration computes Hessians in fp32 alone: every window's product in fp32, whatever the switch."""
    (_, fp32, _) = stats_both[(0, "mlp.down_proj")]
    assert fp32.products == torch.float32
    with calibrating(CalibCompute("fp32")):
        model = smollm[0]
        arch = architecture_of(model)
        inputs, kwargs = capture_block_inputs(model, arch, calib_ids)
        again = collect_stats(decoder_layers(model, arch)[0], ["mlp.down_proj"], inputs, kwargs[0])
    assert torch.equal(again["mlp.down_proj"].hessian, fp32.hessian)


def test_auto_precision_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(compute, "fast_bf16", lambda: "avx512_bf16")
    chosen = choose_compute("auto", "cpu")
    assert chosen.precision == "bf16" and "avx512_bf16" in chosen.reason
    monkeypatch.setattr(compute, "fast_bf16", lambda: None)
    assert choose_compute("auto", "cpu").precision == "fp32"
    assert choose_compute("bf16", "cpu").precision == "bf16"  # asked for: taken even where slow
    with pytest.raises(ValueError, match="calibration dtype"):
        choose_compute("fp16")
    with pytest.raises(ValueError, match="calibration device"):
        choose_compute("auto", "tpu")
    with pytest.raises(UserError, match="calibration dtype 'fp16'"):
        calibration_compute("fp16")


def argv(command: str, tmp_path, *flags) -> list[str]:
    out = ["-o", str(tmp_path / "q")] if command == "quantize" else []
    return [command, "smollm2-135m", *out, *map(str, flags)]


@pytest.mark.parametrize("command", ["quantize", "compare"])
@pytest.mark.parametrize("flag, value", [("--calib-dtype", "fp16"), ("--device", "tpu"), ("--threads", "two")])
def test_flag_values_outside_their_choices_are_refused(tmp_path, capsys, command, flag, value):
    with pytest.raises(SystemExit) as e:
        main(argv(command, tmp_path, flag, value))
    assert e.value.code == 2 and f"argument {flag}: invalid" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["quantize", "compare", "eval"])
def test_thread_counts_below_one_are_refused(tmp_path, capsys, command):
    code = main(argv(command, tmp_path, "--threads", 0))
    err = capsys.readouterr().err
    assert code == 2 and err.strip().endswith("--threads must be ≥ 1, got 0") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    code = main(argv("quantize", tmp_path, "--device", "cuda"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no CUDA GPU" in err
    assert not (tmp_path / "q").exists()


def test_quantize_on_cpu_with_threads_and_precision(tmp_path, capsys):
    """--device cpu runs, --threads sets torch's thread count (the kernels split their work on torch's pool), and
    the summary says which precision calibration ran in and why."""
    threads = torch.get_num_threads()
    try:
        code = main(["quantize", "smollm2-135m", "--method", "gptq", "--calib-samples", "2", "--calib-seqlen", "64",
                     "--skip", "model.layers.[1-9]*.*", "--device", "cpu", "--threads", "2", "--calib-dtype", "bf16",
                     "-o", str(tmp_path / "q"), "--json"])
        out = capsys.readouterr().out
        assert code == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert '"calibration": "bf16 on cpu (bf16 asked for)"' in out


def test_quantized_stream_runs_on_one_dense_copy_per_block(tiny_llama, monkeypatch):
    """In a calibration pass a QuantLinear multiplies by its dequantized weight, dequantized once for the block:
    in fp32 exactly the torch reference's output, in bf16 close to it."""
    from bitquilt import kernels
    from bitquilt.calib.capture import block_output
    from bitquilt.nn.online import swap_host
    from bitquilt.nn.quant_linear import QuantLinear

    block = decoder_layers(tiny_llama, architecture_of(tiny_llama))[0]
    linear = block.get_submodule("mlp.down_proj")
    qlin = QuantLinear(get_solver("rtn")(linear.weight.detach(), None, LayerSpec(4, 128)))
    swap_host(block, "mlp.down_proj", qlin)
    calls = []
    dequantize = type(qlin.fmt).dequantize
    monkeypatch.setattr(type(qlin.fmt), "dequantize", lambda self, *a: calls.append(1) or dequantize(self, *a))
    x = [torch.randn(1, 16, 128), torch.randn(1, 16, 128)]
    kwargs = {"position_embeddings": tiny_llama.model.rotary_emb(x[0], torch.arange(16)[None]),
              "attention_mask": None}
    with kernels.using(enabled=False), torch.no_grad():
        reference = [block_output(block, xi, kwargs) for xi in x]
    calls.clear()
    with calibrating(CalibCompute("fp32")):
        fp32 = run_block(block, x, kwargs)
        run_block(block, x, kwargs)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(fp32, reference))
    assert "forward" not in qlin.__dict__  # the pass left the module as it was
    with calibrating(BF16), torch.no_grad():
        bf16 = run_block(block, x, kwargs)
    assert all(b.dtype == torch.float32 and torch.allclose(b, r, rtol=0.05, atol=0.05) for b, r in zip(bf16, reference))


@pytest.mark.parametrize("width", [100, 576, 1000, 8960])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_from_its_upper_panels_equals_the_full_product(width, dtype):
    """`gram` multiplies only the upper block rows of XᵀX and mirrors them: it must be symmetric and agree with the
    full product (torch's GEMM sums each entry in the same order here, so to the bit)."""
    x = torch.randn(300, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    got = gram(x)
    assert got.dtype == torch.float32 and torch.equal(got, got.T)
    torch.testing.assert_close(got, (x.T @ x).float(), rtol=1e-5, atol=1e-4)
