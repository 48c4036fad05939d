import pytest
import torch

from bitquilt.models.adapters import UnsupportedArchitecture, architecture_of
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.pipeline.engine import quantize_model
from bitquilt.recipes import Recipe
from tests.conftest import block_context, make_tiny


def _ids(n=8, seqlen=64, vocab=320):
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                                        "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_every_adapter_quantizes_every_linear(model_type, method):
    model = make_tiny(model_type)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids[:2]).logits
    report = quantize_model(model, Recipe(method, w_bits=8, group_size=32), ids, progress=False)
    qlins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qlins) == len(report.linears) == 2 * len(architecture_of(model).linear_names())  # MoE: every expert
    with torch.no_grad():
        out = model(ids[:2]).logits
    rel = (out - ref).pow(2).mean() / ref.pow(2).mean()
    assert rel < 1e-3, rel


def test_awq_scaling_is_function_preserving_before_quantization():
    from bitquilt.transforms.awq import AWQOptions, awq

    for model_type in ("llama", "gemma3_text"):
        model = make_tiny(model_type)
        ids = _ids()
        with torch.no_grad():
            ref = model(ids[:2]).logits
            report = awq(block_context(model, Recipe("awq", 3, 32), ids), AWQOptions())
            out = model(ids[:2]).logits
        assert report and all(r["alpha"] >= 0 for r in report.values())
        assert torch.allclose(out, ref, atol=1e-4), (model_type, (out - ref).abs().max())


def _awq_layer(seed=0, rows=(192, 160, 48), width=96, tokens=512):
    """Linears reading one input with a few heavy output rows and outlier input channels, as LLM layers have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g) * (1 + 20 * (torch.rand(width, generator=g) > 0.95))
    weights = []
    for n in rows:
        w = torch.randn(n, width, generator=g) * 0.02
        w[torch.randperm(n, generator=g)[: n // 32]] *= 15
        weights.append(w)
    return weights, x.T @ x / tokens, x.abs().mean(0)


def test_awq_sampled_search_picks_an_alpha_as_good_as_the_exhaustive_one():
    """A few hundred output rows (the heaviest half and an even sample of the rest) estimate the loss at α > 0;
    the best 3 estimates are then scored on all rows: the chosen α's exact loss is within 0.5% of the best."""
    from bitquilt.solvers.base import LayerSpec, hessian_error
    from bitquilt.solvers.rtn import fake_quantize
    from bitquilt.transforms.awq import normalised, search_scales

    spec = LayerSpec(3, 32)
    for seed in range(4):
        weights, hessian, absmean = _awq_layer(seed)
        specs = [spec] * len(weights)
        s_all, best_all, gain_all = search_scales(weights, specs, hessian, absmean, 20)
        s_sub, best_sub, gain_sub = search_scales(weights, specs, hessian, absmean, 20, rows=32)

        def loss(s, weights=weights, hessian=hessian):
            return sum(hessian_error(w, fake_quantize(w * s, spec) / s, hessian) for w in weights)

        assert loss(s_all) == pytest.approx(min(loss(normalised(absmean.clamp(min=1e-8).pow(i / 20)))
                                                for i in range(20)),
                                            rel=1e-5)
        assert loss(s_sub) <= loss(s_all) * 1.005, (seed, best_sub, best_all)
        assert gain_sub == pytest.approx(gain_all * loss(s_all) / loss(s_sub), rel=1e-4)
        # a sample as large as every linear is the exhaustive search
        assert search_scales(weights, specs, hessian, absmean, 20, rows=192)[1:] == (best_all, gain_all)


def test_stratified_rows_keep_the_heaviest_and_weight_the_rest():
    from bitquilt.transforms.awq import stratified_rows

    errors = torch.arange(1000, dtype=torch.float32).flip(0)  # row r has error 999 − r
    idx, weight = stratified_rows(errors, 100)
    assert set(idx[:50].tolist()) == set(range(50)) and torch.equal(weight[:50], torch.ones(50))
    assert weight.sum().item() == pytest.approx(1000)
    assert (errors[idx] * weight).sum().item() == pytest.approx(errors.sum().item(), rel=0.01)
    idx, weight = stratified_rows(errors[:80], 100)
    assert torch.equal(idx, torch.arange(80)) and torch.equal(weight, torch.ones(80))


def test_awq_bits_searches_as_a_layer_of_that_width_would():
    """awq.bits: a MoBiQuant layer (6 bits of slices) gets the scales a 3-bit layer gets, not those of its own
    6-bit search; `awq+mobiquant` names that method."""
    from bitquilt.transforms.awq import AWQOptions, awq

    ids = _ids()
    mobi = Recipe("awq+mobiquant", 6, 32)
    assert mobi.method == "awq+mobiroute+mobislice" and mobi.transforms == ["awq"]
    runs = []
    for recipe, opts in ((mobi, AWQOptions(bits=3)), (Recipe("awq", 3, 32), AWQOptions()), (mobi, AWQOptions())):
        model = make_tiny("llama")
        with torch.no_grad():
            report = awq(block_context(model, recipe, ids), opts)
        runs.append((report, model.model.layers[0].input_layernorm.weight.clone()))
    (at_3, norm_3), (rtn_3, norm_rtn), (own, norm_own) = runs
    assert at_3 == rtn_3 and torch.equal(norm_3, norm_rtn)
    assert own != at_3 and not torch.equal(norm_own, norm_3)
    with pytest.raises(ValueError, match="awq: bits must be 0 .* or one of 2, 3, 4, 8; got 5"):
        AWQOptions(bits=5)


def test_gptq_true_sequential_beats_rtn_on_tiny_model():
    ids = _ids(16)
    errs = {}
    for method in ("rtn", "gptq"):
        model = make_tiny("llama")
        with torch.no_grad():
            ref = model(ids).logits
        quantize_model(model, Recipe(method, w_bits=3, group_size=32), ids, progress=False)
        with torch.no_grad():
            errs[method] = (model(ids).logits - ref).pow(2).mean().item()
    assert errs["gptq"] < errs["rtn"]


def test_skip_and_overrides():
    model = make_tiny("llama")
    recipe = Recipe("rtn", w_bits=4, group_size=32, skip=("*.mlp.down_proj",),
                    overrides={"model.layers.1.*": {"bits": 2, "group_size": 64}})
    report = quantize_model(model, recipe, None, progress=False)
    names = {r.name: r for r in report.linears}
    assert "model.layers.0.mlp.down_proj" not in names
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert names["model.layers.1.self_attn.q_proj"].format == "uniform w2 g64 asym"
    assert names["model.layers.0.self_attn.q_proj"].format == "uniform w4 g32 asym"


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'.*supported model types: gemma2, gemma3_text, llama"):
        architecture_of(model)


def test_bad_recipe_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="unsupported weight bits 5"):
        Recipe("gptq", w_bits=5)
    with pytest.raises(ValueError, match="unsupported group size 100"):
        Recipe("gptq", group_size=100)
    with pytest.raises(ValueError, match="unknown solver 'gptx'"):
        Recipe("gptx")
    with pytest.raises(ValueError, match="unknown stage 'rotate'"):
        Recipe("rotate+gptq")
    with pytest.raises(ValueError, match="unsupported weight bits 8 by solver 'bpdq'"):
        Recipe("bpdq", w_bits=8)  # what the format can hold, checked before any calibration
    with pytest.raises(ValueError, match=r"transform 'awq' has no option\(s\) \['grdi'\]; it accepts: grid=20"):
        Recipe("awq+gptq", stage_options={"awq": {"grdi": 10}})
    with pytest.raises(ValueError, match="solver 'gptq' option damp='x'"):
        Recipe("gptq", options={"damp": "x"})
    with pytest.raises(ValueError, match="override 'model.layers.0.\\*': unsupported weight bits 8 by solver 'bpdq'"):
        Recipe("bpdq", w_bits=2, group_size=64, overrides={"model.layers.0.*": {"bits": 8}})
    with pytest.raises(ValueError, match="stage options for \\['smoothquant'\\], which recipe 'awq\\+gptq'"):
        Recipe("awq+gptq", stage_options={"smoothquant": {"alpha": 0.5}})


def test_solving_a_linear_keeps_no_fp32_copy_of_the_weight():
    """The error report must not leave a cached dequantized matrix behind (it doubled peak memory)."""
    from torch import nn

    from bitquilt.calib.plan import LinearPlan, Plan
    from bitquilt.calib.stages import BlockContext
    from bitquilt.solvers import get_solver
    from bitquilt.solvers.base import LayerSpec, LinearStats
    from bitquilt.stages.solve import solve_linear

    block = nn.Module()
    block.proj = nn.Linear(64, 32)
    stats = LinearStats.empty(64)
    stats.update(torch.randn(256, 64, generator=torch.Generator().manual_seed(0)))
    solver = get_solver("gptq")
    model = make_tiny("llama")
    plan = Plan({"model.layers.0.proj": LinearPlan(LayerSpec(4, 32), None)}, {})
    ctx = BlockContext(model, architecture_of(model), plan, None, index=0, block=block)
    report = solve_linear(ctx, "proj", solver, solver.make_options(), stats)
    assert isinstance(block.proj, QuantLinear) and block.proj._dequantized is None
    assert 0 < report.rel_error < 0.05


def test_too_few_calibration_tokens_for_a_layer_warn_once(caplog):
    model = make_tiny("llama")  # MLP width 256: 2 × 64 = 128 tokens leave down_proj's Hessian rank-deficient
    with caplog.at_level("WARNING", logger="bitquilt.stages.solve"):
        quantize_model(model, Recipe("gptq", w_bits=4, group_size=32), _ids(2), progress=False)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "model.layers.0.mlp.down_proj: 128 calibration tokens for 256 inputs" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="bitquilt.stages.solve"):
        quantize_model(make_tiny("llama"), Recipe("gptq", w_bits=4, group_size=32), _ids(8), progress=False)
    assert not caplog.records


REUSE_RECIPES = [Recipe("gptq", w_bits=4, group_size=32),
                 Recipe("quarot+gptq", w_bits=4, group_size=32, a_bits=4, kv_bits=4),
                 Recipe("smoothquant+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4, a_clip=None),
                 Recipe("awq+gptq", w_bits=3, group_size=32)]


@pytest.mark.parametrize("model_type,recipe", [
    pytest.param(m, r, id=f"{r.label()}-{m}") for m in ("llama", "qwen2", "gemma3_text", "phi3")
    for r in REUSE_RECIPES
    if not (m == "gemma3_text" and "quarot" in r.transforms)])  # QuaRot refuses Gemma 3 (its post-norms)
def test_reusing_the_final_attention_is_bit_identical_and_skips_its_passes(model_type, recipe, monkeypatch):
    """Once a block's attention linears are solved, the MLP groups' passes and the block's final pass reuse its
    output (`attention_reused`), and once the linears before a writer (o_proj, down_proj) are solved, later passes
    compute only the writer on its recorded input (`writer_input_reused`): the quantized model must be the very
    same, with fewer attention and MLP computations."""
    import contextlib

    import bitquilt.pipeline.engine as engine

    calls = {"sdpa": 0, "silu": 0}
    sdpa, silu = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.silu

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    ids = _ids(4)
    states, counts = [], []
    for reuse in (False, True):
        monkeypatch.undo()
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted("sdpa", sdpa))
        monkeypatch.setattr(torch.nn.functional, "silu", counted("silu", silu))
        if not reuse:
            monkeypatch.setattr(engine, "attention_reused", lambda *_: contextlib.nullcontext())
            monkeypatch.setattr(engine, "writer_input_reused", lambda *_: contextlib.nullcontext())
        model = make_tiny(model_type)
        calls.update(sdpa=0, silu=0)
        quantize_model(model, recipe, ids, progress=False)
        states.append(model.state_dict())
        counts.append(dict(calls))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    if model_type != "gemma3_text":  # gemma's MLP uses gelu
        assert counts[1]["silu"] < counts[0]["silu"], counts
    assert counts[1]["sdpa"] < counts[0]["sdpa"], counts


def test_writer_shortcut_turns_itself_off_where_the_module_does_more_than_its_writer():
    """A module whose output is not its writer's (here the MLP adds a constant after down_proj): the first later
    pass compares the shortcut with the full computation and keeps computing in full."""
    from bitquilt.calib.capture import run_block, writer_input_reused

    model = make_tiny("llama")
    block = model.model.layers[0]
    mlp_forward = block.mlp.forward
    block.mlp.forward = lambda x: mlp_forward(x) + 1.0
    x = [torch.randn(1, 16, model.config.hidden_size) for _ in range(3)]
    kwargs = {"position_embeddings": model.model.rotary_emb(x[0], torch.arange(16)[None])}
    expected = run_block(block, x, kwargs)
    with writer_input_reused(block, "mlp.down_proj"):
        run_block(block, x, kwargs)  # records down_proj's inputs
        calls = [0]
        block.mlp.down_proj.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        got = run_block(block, x, kwargs)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert calls[0] == 4  # 3 passes in full + the one shortcut it checked and turned off
