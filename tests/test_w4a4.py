"""W4A4KV4 backbone: Hadamard transforms, norm fusion and QuaRot, activation/KV quantizers, SmoothQuant."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bitquilt import kernels
from bitquilt.calib.stages import ModelContext
from bitquilt.io import load_quantized, quantization_record, save
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.nn.act_quant import ActQuantConfig, ActQuantizer, fake_quantize
from bitquilt.nn.hadamard import (
    hadamard_matrix,
    hadamard_transform,
    odd_factor,
    paley_hadamard,
    random_signs,
    reference_transform,
    sylvester,
)
from bitquilt.nn.kv_quant import KVQuantizer
from bitquilt.nn.online import attach
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.nn.rotation import HadamardRotation
from bitquilt.pipeline.engine import quantize_model
from bitquilt.recipes import Recipe
from bitquilt.transforms.rotation import QuaRotOptions, _rowwise_float64, fuse_norms, quarot
from tests.conftest import attach_kv_quantizers, block_context, make_tiny
from tests.test_kernels import needs_ext

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "olmoe"]
GEMMA = ("gemma2", "gemma3_text")
PACKAGED_SIZES = [64, 128, 576, 896, 1536, 4864, 8960]  # head_dim, hidden and FFN widths of the packaged models


def _ids(n=8, seqlen=64, vocab=320, seed=0):
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _loss(model, ids):
    return float(nn.functional.cross_entropy(_logits(model, ids)[0, :-1], ids[0, 1:]))


# ---------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("p", [12, 20, 28, 36, 76, 140])
def test_paley_matrices_are_hadamard(p):
    h = paley_hadamard(p)
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, p * torch.eye(p, dtype=torch.float64))


@pytest.mark.parametrize("n", PACKAGED_SIZES + [14])
def test_fast_transform_matches_explicit_matrix_and_is_orthogonal(n):
    x = torch.randn(6, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x)
    assert torch.allclose(y @ y.T, x @ x.T, atol=1e-9 * n)  # norms and angles kept
    f = odd_factor(n)
    k = n // f.shape[0]
    assert f.shape[0] == ({576: 36, 896: 28, 1536: 12, 4864: 76, 8960: 140, 14: 7}.get(n, 1))
    if n <= 1536:
        m = hadamard_matrix(n)
        assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(y, x @ m, atol=1e-12)
    else:  # rows of M_n = F ⊗ H_k / √k, built directly, against the transform of unit vectors
        rows = torch.tensor([0, 1, k - 1, k, n // 2 + 3, n - 1])
        explicit = torch.stack([torch.kron(f[r // k], sylvester(k)[r % k] / math.sqrt(k)) for r in rows.tolist()])
        assert torch.allclose(hadamard_transform(torch.eye(n, dtype=torch.float64)[rows]), explicit, atol=1e-12)


def test_signs_randomise_the_rotation():
    x = torch.randn(3, 576, dtype=torch.float64)
    s = torch.randint(0, 2, (576,), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    assert torch.allclose(hadamard_transform(x, s), (x * s) @ hadamard_matrix(576), atol=1e-12)


def test_rotating_a_large_matrix_in_row_chunks_is_exact():
    """Embeddings and LM heads are rotated a chunk of rows at a time (bounded float64 memory); the result
    must be the whole-matrix transform, bit for bit, including a short last chunk."""
    w = torch.randn(23, 576, generator=torch.Generator().manual_seed(1))
    s = random_signs(576, 0)
    whole = hadamard_transform(w.double(), s).float()
    assert torch.equal(_rowwise_float64(w, lambda rows: hadamard_transform(rows, s), rows=5), whole)
    assert torch.equal(_rowwise_float64(w.T.contiguous().T, lambda rows: hadamard_transform(rows, s), rows=4), whole)


@needs_ext
@pytest.mark.parametrize("n", PACKAGED_SIZES + [1, 2, 4, 8, 12, 14, 3])
@pytest.mark.parametrize("signed", [False, True])
def test_compiled_transform_matches_the_torch_reference(n, signed):
    """fp32 rows go through csrc/kernels/hadamard.cpp (in-register butterflies below 8, the odd factor four columns at a
    time): it must give the torch butterflies' result and x M_n to fp32 rounding, for any leading shape."""
    x = torch.randn(5, 3, n, generator=torch.Generator().manual_seed(n))
    s = random_signs(n, 3) if signed else None
    y = hadamard_transform(x, s)
    reference = reference_transform(x, s)
    exact = ((x.double() * (1 if s is None else s)) @ hadamard_matrix(n)).float() if n <= 1536 else reference
    tol = 4e-7 * math.log2(2 * n) * x.abs().max()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y - reference).abs().max() <= tol and (y - exact).abs().max() <= tol
    with kernels.using(enabled=False):
        assert torch.equal(hadamard_transform(x, s), reference)  # kernels off: the torch path itself


def test_compiled_transform_declines_gradients_and_other_dtypes():
    """A gradient wanted, or float64/bf16 input, takes the torch path (which autograd and exact float64 need)."""
    x = torch.randn(4, 576, requires_grad=True)
    hadamard_transform(x).sum().backward()
    assert torch.allclose(x.grad, hadamard_matrix(576).sum(1).float().expand(4, -1), atol=1e-5)
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.randn(2, 64).to(dtype)
        assert torch.equal(hadamard_transform(x), reference_transform(x))


# ---------------------------------------------------------------- norm fusion and rotation
@pytest.mark.parametrize("model_type", FAMILIES)
def test_norm_fusion_and_quarot_are_function_preserving_on_tiny_models(model_type):
    model = make_tiny(model_type)
    if model_type == "llama":  # a tied LM head must be untied before the final norm is fused into it
        model.config.tie_word_embeddings = True
        model.tie_weights()
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    ids = _ids(2)
    ref = _logits(model, ids)
    fused = copy.deepcopy(model)
    fuse_norms(fused, architecture_of(fused))
    assert torch.allclose(_logits(fused, ids), ref, atol=1e-5)
    report = quarot(ModelContext(model, architecture_of(model), None, None), QuaRotOptions())
    assert torch.allclose(_logits(model, ids), ref, atol=1e-5), (_logits(model, ids) - ref).abs().max()
    assert report["tied_lm_head"] == tied and tied == (model_type in ("llama", *GEMMA))
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied  # a tied head stays one table


@pytest.fixture(scope="module")
def rotated_smollm(smollm):
    model = copy.deepcopy(smollm[0])
    quarot(ModelContext(model, architecture_of(model), None, None), QuaRotOptions())
    return model


def test_quarot_is_function_preserving_on_the_default_model(smollm, rotated_smollm):
    """Hidden 576 = 36·16 and FFN 1536 = 12·128: the Paley factors, the tied LM head, the online transforms."""
    model, tok = smollm
    ids = tok("The tallest mountain on Earth is Mount Everest, which rises", return_tensors="pt").input_ids
    ref, out = _logits(model, ids), _logits(rotated_smollm, ids)
    assert (out - ref).abs().max() < 2e-5 * ref.abs().max()
    assert rotated_smollm.config.tie_word_embeddings and model.config.tie_word_embeddings
    assert rotated_smollm.lm_head.weight is rotated_smollm.get_input_embeddings().weight


def _input_outlierness(model, ids, names):
    """Mean over tokens of max|x| / rms(x) of the inputs of `names` in every block."""
    arch = architecture_of(model)
    ratios = []

    def hook(_m, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        ratios.append((x.abs().amax(1) / x.pow(2).mean(1).sqrt()).mean().item())

    handles = [b.get_submodule(n).register_forward_pre_hook(hook) for b in decoder_layers(model, arch) for n in names]
    try:
        _logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return sum(ratios) / len(ratios)


def test_rotation_reduces_outliers_of_real_layer_inputs(smollm, rotated_smollm, calib_ids):
    ids = calib_ids[:1, :128]
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        before = _input_outlierness(smollm[0], ids, [name])
        after = _input_outlierness(rotated_smollm, ids, [name])
        assert after < 0.5 * before, (name, before, after)


# ---------------------------------------------------------------- activation and KV quantizers
def test_fake_quantize_grids():
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 64)
    for bits, sym in ((4, False), (4, True), (8, False)):
        q = fake_quantize(x, ActQuantConfig(bits, sym))
        for row in q:  # per token, at most 2^b levels
            assert row.unique().numel() <= 2**bits
    err4 = (fake_quantize(x, ActQuantConfig(4)) - x).pow(2).mean()
    err8 = (fake_quantize(x, ActQuantConfig(8)) - x).pow(2).mean()
    assert err8 < err4 / 100
    grouped = fake_quantize(x, ActQuantConfig(4, group_size=16))
    assert (grouped - x).pow(2).mean() < err4
    assert torch.equal(fake_quantize(x, ActQuantConfig(16)), x)


def test_per_layer_activation_bits_are_honoured():
    model = make_tiny("llama")
    recipe = Recipe("rtn", w_bits=4, group_size=32, a_bits=4, overrides={"*.mlp.down_proj": {"a_bits": 8}},
                    skip=("*.self_attn.o_proj",))
    quantize_model(model, recipe, None, progress=False)
    block = decoder_layers(model, architecture_of(model))[0]
    down, up, o = block.mlp.down_proj, block.mlp.up_proj, block.self_attn.o_proj
    assert down.act_quant.config.bits == 8 and up.act_quant.config.bits == 4
    assert type(o) is nn.Linear and getattr(o, "act_quant", None) is None  # skipped: full precision
    seen = {}  # what each linear receives, before its input quantizer (prepended: runs before the input site)
    for name, lin in (("down", down), ("up", up)):
        lin.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, a[0]), prepend=True)
    _logits(model, _ids(1))
    errors = {name: ((getattr(block.mlp, f"{name}_proj").act_quant(x) - x).pow(2).mean() / x.pow(2).mean()).item()
              for name, x in seen.items()}
    assert errors["down"] < errors["up"] / 50, errors


def test_act_quantizer_on_a_plain_linear_runs_before_other_hooks():
    lin = nn.Linear(64, 8)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    attach(lin, "act_quant", ActQuantizer(ActQuantConfig(4)))
    attach(lin, "input_rotation", HadamardRotation(64))  # runs first, whatever the order of attaching
    x = torch.randn(3, 64)
    y = lin(x)
    expected = fake_quantize(hadamard_transform(x), ActQuantConfig(4))
    assert torch.equal(seen[0], expected) and torch.allclose(y, nn.functional.linear(expected, lin.weight, lin.bias))


def test_kv_quantization_is_the_same_with_and_without_cache():
    model = make_tiny("llama")
    arch = architecture_of(model)
    attach_kv_quantizers(model, ActQuantConfig(4, group_size=16))
    assert all(isinstance(b.self_attn.kv_quant, KVQuantizer) for b in decoder_layers(model, arch))
    ids = _ids(1, 24)
    full = _logits(model, ids)[0, -1]
    with torch.no_grad():
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=out.past_key_values, use_cache=True).logits[0, -1]
    assert torch.allclose(step, full, atol=1e-5)
    plain = make_tiny("llama")
    assert not torch.allclose(_logits(plain, ids)[0, -1], full, atol=1e-3)  # it does quantize


def test_kv4_costs_less_than_a4_on_the_default_model(smollm, calib_ids):
    base = smollm[0]
    arch = architecture_of(base)
    ids = calib_ids[:1, :128]
    fp = _loss(base, ids)
    kv = copy.deepcopy(base)
    attach_kv_quantizers(kv, ActQuantConfig(4))
    act = copy.deepcopy(base)
    for block in decoder_layers(act, arch):
        for name in arch.linear_names():
            attach(block.get_submodule(name), "act_quant", ActQuantizer(ActQuantConfig(4)))
    kv_cost, act_cost = _loss(kv, ids) - fp, _loss(act, ids) - fp
    assert 0 < kv_cost < act_cost, (kv_cost, act_cost)


def test_key_centring_rescues_keys_with_a_large_constant_part():
    # Qwen2.5's k_proj biases make most of each key the same for every token; a 4-bit grid spanning
    # that leaves almost nothing for the part attention depends on, unless keys are centred first.
    # (Large constant parts sit in slowly rotating RoPE channels: fast ones would average out over positions.)
    model = make_tiny("qwen2")
    arch = architecture_of(model)
    with torch.no_grad():
        for block in decoder_layers(model, arch):
            block.self_attn.k_proj.bias[15::16] += 100.0  # the slowest RoPE pair of each head: ~constant
            block.self_attn.q_proj.weight *= 20  # sharp attention, as in a trained model: keys matter
            block.self_attn.k_proj.weight *= 20
    ids = _ids()
    ref = _logits(model, ids[:2])
    errors = {}
    for center in (False, True):
        m = copy.deepcopy(model)
        quantize_model(m, Recipe("rtn", w_bits=8, group_size=32, kv_bits=4, kv_center=center), ids, progress=False)
        centres = [b.self_attn.kv_quant.key_center for b in decoder_layers(m, arch)]
        assert all((c is not None) == center for c in centres)
        errors[center] = float((_logits(m, ids[:2]) - ref).pow(2).mean())
    assert centres[0].shape == (2, 1, 32)  # kv heads, broadcast over tokens, head_dim
    assert errors[True] < 0.3 * errors[False], errors


# ---------------------------------------------------------------- SmoothQuant and recipes
def test_smoothquant_scaling_is_function_preserving_before_quantization():
    from bitquilt.transforms.smoothquant import SmoothQuantOptions, smoothquant

    model = make_tiny("llama")
    ids = _ids()
    ref = _logits(model, ids[:2])
    recipe = Recipe("smoothquant+rtn", w_bits=4, group_size=32, a_bits=4)
    with torch.no_grad():
        report = smoothquant(block_context(model, recipe, ids), SmoothQuantOptions())
    assert set(report) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}  # v→o: GQA, not foldable
    assert torch.allclose(_logits(model, ids[:2]), ref, atol=1e-4)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f not in GEMMA])  # QuaRot refuses post-norms
def test_w4a4kv4_save_load_gives_identical_logits(tmp_path, model_type):
    model = make_tiny(model_type)
    recipe = Recipe("quarot+gptq", w_bits=4, group_size=32, a_bits=4, kv_bits=4, a_clip=None)
    quantize_model(model, recipe, _ids(), progress=False)
    ids = _ids(2, seed=1)
    ref = _logits(model, ids)
    save(model, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    assert torch.equal(_logits(loaded, ids), ref)
    record = quantization_record(loaded)
    assert record["recipe"]["a_bits"] == 4 and record["recipe"]["kv_bits"] == 4
    clips = {m.act_quant.config.clip_ratio for m in loaded.modules() if isinstance(m, QuantLinear)}
    assert clips and all(c is not None for c in clips)
    saved, restored = ([m.kv_quant.key_center for m in mm.modules() if getattr(m, "kv_quant", None) is not None]
                       for mm in (model, loaded))
    assert len(restored) == 2 and all(torch.equal(a, b) for a, b in zip(saved, restored))


def test_a_fresh_process_loads_a_saved_quarot_model(tmp_path):
    """Loading imports the modules of bitquilt's online classes itself: the process that saved the model had imported
    QuaRot's rotations through the stage, a fresh one (`bitquilt eval`) has not."""
    import subprocess
    import sys

    model = make_tiny("llama")
    quantize_model(model, Recipe("quarot+rtn", w_bits=8, group_size=32), _ids(), progress=False)
    save(model, tmp_path / "q")
    code = ("import sys; from bitquilt.io import load_quantized; m, _ = load_quantized(sys.argv[1]); "
            "print(sum(type(x).__name__ == 'QKRotation' for x in m.modules()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "q")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == sum(type(x).__name__ == "QKRotation" for x in model.modules()) > 0


def _tensor_bytes(directory) -> dict[str, tuple[tuple[int, ...], int]]:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as f:
        return {k: (tuple(t.shape), t.numel() * t.element_size()) for k in f.keys() for t in [f.get_tensor(k)]}


@pytest.mark.parametrize("stream", [False, True])
def test_quarot_keeps_a_tied_head_one_table(tmp_path, stream):
    """A W4A4KV4 QuaRot model of a tied-embedding model stores its [vocab, hidden] table once, as the model without
    QuaRot does: what it adds is the final norm's rotated scale ([hidden, hidden]), not a second fp32 table; it loads
    back tied, to the logits it had (in memory, and streamed block by block)."""
    from bitquilt.api import quantize_streaming

    model = make_tiny("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "fp")
    sizes, ids = {}, _ids(1, seed=3)
    for method in ("rtn", "quarot+rtn"):
        recipe = Recipe(method, w_bits=4, group_size=32, a_bits=4, kv_bits=4)
        if stream:
            quantized, _, _ = quantize_streaming(tmp_path / "fp", recipe, _ids())
        else:
            quantized = copy.deepcopy(model)
            quantize_model(quantized, recipe, _ids(), progress=False)
        save(quantized, tmp_path / method)
        tensors = _tensor_bytes(tmp_path / method)
        assert [k for k, (shape, _) in tensors.items() if shape == (320, 128)] == ["model.embed_tokens.weight"]
        sizes[method] = sum(n for _, n in tensors.values())
    assert _tensor_bytes(tmp_path / "quarot+rtn")["model.norm.output_rotation.matrix"] == ((128, 128), 128 * 128 * 4)
    assert sizes["quarot+rtn"] <= sizes["rtn"] + 128 * 128 * 4
    loaded, _ = load_quantized(tmp_path / "quarot+rtn")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert torch.equal(_logits(loaded, ids), _logits(quantized, ids))


def test_recipe_validation_and_cli_flags():
    from bitquilt.cli import build_parser
    from bitquilt.commands import _recipe_from_args

    args = build_parser().parse_args(["quantize", "m", "-o", "x", "--recipe", "quarot+gptq", "--w-bits", "4",
                                      "--a-bits", "4", "--kv-bits", "4", "--a-clip", "search"])
    recipe = _recipe_from_args(args, args.method, args.w_bits, args.group_size)
    assert (recipe.method, recipe.a_bits, recipe.kv_bits, recipe.a_clip) == ("quarot+gptq", 4, 4, None)
    assert recipe.needs_calibration and recipe.label() == "quarot+gptq w4g128 a4 kv4"
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    with pytest.raises(ValueError, match="unsupported activation bits 12"):
        Recipe("rtn", a_bits=12)
    with pytest.raises(ValueError, match="awq cannot follow quarot"):
        Recipe("quarot+awq+rtn")


@pytest.mark.slow
def test_quarot_gptq_beats_rtn_at_w4a4kv4(smollm):
    from bitquilt.data.windows import calibration_windows, eval_windows
    from bitquilt.eval.ppl import window_losses

    model, tok = smollm
    calib = calibration_windows(tok, "sciq", n_samples=8, seqlen=256, seed=0)
    windows = eval_windows(tok, "wiki", 256, 4)
    ppl = {}
    for method in ("rtn", "quarot+gptq"):
        m = copy.deepcopy(model)
        quantize_model(m, Recipe(method, w_bits=4, a_bits=4, kv_bits=4), calib, progress=False)
        losses = window_losses(m, windows)
        ppl[method] = math.exp(sum(losses) / len(losses))
    assert ppl["quarot+gptq"] < ppl["rtn"] / 3, ppl
