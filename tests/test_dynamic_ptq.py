"""DynamicPTQ: residual-stream metrics, the 8-bit-activation layer policy, its CLI and saved config."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from bitquilt.api import quantize, residual_phases
from bitquilt.calib.residual import historical_snr_db, jump_ratio, maxabs_jump_ratio
from bitquilt.cli import main
from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.nn.online import get
from bitquilt.policies.dynamic_a8 import DynamicA8Options, choose_layers
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny, reload_bit_exact


def _synthetic_stream(jump_at: int, n_layers: int = 6, tokens: int = 64, d: int = 128) -> list[torch.Tensor]:
    """x^(0..n): small updates everywhere, a large one (a new massive channel) at layer `jump_at`."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tokens, d, generator=g)]
    for layer in range(n_layers):
        update = 0.1 * torch.randn(tokens, d, generator=g)
        if layer == jump_at:
            update[:, 7] += 40.0
        xs.append(xs[-1] + update)
    return xs


def test_metrics_find_the_jump_of_a_synthetic_stream():
    xs = _synthetic_stream(jump_at=3)
    config = ActQuantConfig(4)
    jr = [float(jump_ratio(a, b).mean()) for a, b in zip(xs, xs[1:])]
    jr_max = [float(maxabs_jump_ratio(a, b).mean()) for a, b in zip(xs, xs[1:])]
    snr = [float(historical_snr_db(a, b, config).mean()) for a, b in zip(xs, xs[1:])]
    assert max(range(6), key=jr.__getitem__) == 3 and max(range(6), key=jr_max.__getitem__) == 3
    assert min(range(6), key=snr.__getitem__) == 3
    snr8 = [float(historical_snr_db(a, b, ActQuantConfig(8)).mean()) for a, b in zip(xs, xs[1:])]
    assert all(s8 > s4 + 15 for s4, s8 in zip(snr, snr8))  # 4 more bits: ~24 dB less noise


def test_jump_ratio_is_invariant_under_an_orthogonal_rotation():
    xs = _synthetic_stream(jump_at=2)
    q, _ = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)))
    for a, b in zip(xs, xs[1:]):
        torch.testing.assert_close(jump_ratio(a @ q, b @ q), jump_ratio(a, b), rtol=1e-4, atol=1e-6)


def test_quarot_keeps_the_jump_ratios_of_a_model():
    ids = torch.randint(0, 320, (3, 48), generator=torch.Generator().manual_seed(3))
    plain = residual_phases(make_tiny("llama"), ids)
    rotated = residual_phases(make_tiny("llama"), ids, rotation="quarot")
    for p, r in zip(plain, rotated):
        assert r.jump_ratio == pytest.approx(p.jump_ratio, rel=1e-3)
        assert r.jump_ratio_attn == pytest.approx(p.jump_ratio_attn, rel=1e-3)


@pytest.mark.parametrize("select, expected", [("jr", [1, 4]), ("snr", [1, 3]), ("ends", [0, 5])])
def test_choose_layers(select, expected):
    from bitquilt.calib.residual import LayerPhase

    jr = [0.2, 5.0, 0.1, 0.3, 2.0, 0.2]
    snr = [20, -3, 18, 1, 9, 19]
    phases = [LayerPhase(i, jr[i], 0, 0, 0, 0, 0, {4: snr[i]}) for i in range(6)]
    assert choose_layers(phases, 4, DynamicA8Options(layers=2, select=select)) == expected
    assert choose_layers(phases, 4, DynamicA8Options(snr_db=10.0)) == [1, 3, 4]
    assert len(choose_layers(phases, 4, DynamicA8Options(layers=2, select="random"))) == 2


def test_the_measured_choice_beats_random_layers_on_the_default_model(smollm, calib_ids):
    held_out = calib_ids[8:11]
    losses, chosen = {}, {}
    for select in ("jr", "random"):
        model = copy.deepcopy(smollm[0])
        recipe = Recipe("quarot+rtn", a_bits=4, a8_layers=2, stage_options={"dynamic_a8": {"select": select,
                                                                                           "samples": 4}})
        report = quantize(model, recipe, calib_ids[:4], progress=False)
        chosen[select] = report.plan["decisions"]["dynamic_a8"]["layers"]
        with torch.no_grad():  # (the rotated model's hidden states live in another basis: compare the loss)
            losses[select] = float(model(held_out, labels=held_out).loss)
    assert 0 in chosen["jr"]  # the massive-activation jump of the first layer
    assert losses["jr"] < losses["random"], (losses, chosen)


def test_a8_layers_round_trip_through_save_and_load(tmp_path):
    model = make_tiny("qwen2")
    ids = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(4))
    report = quantize(model, Recipe("quarot+rtn", a_bits=4, kv_bits=4, a8_layers=1), ids, progress=False)
    layer = report.plan["decisions"]["dynamic_a8"]["layers"]
    assert len(layer) == 1
    loaded = reload_bit_exact(model, ids[:2], tmp_path / "q")
    for i, block in enumerate(loaded.model.layers):
        assert get(block.mlp.down_proj, "act_quant").config.bits == (8 if i in layer else 4)
    saved = json.loads((tmp_path / "q" / "quantization_config.json").read_text())
    assert saved["recipe"]["a8_layers"] == 1
    assert saved["report"]["plan"]["decisions"]["dynamic_a8"]["layers"] == layer


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_analyze_and_quantize(tmp_path, capsys):
    code, stdout, err = _cli(capsys, "analyze", "smollm2-135m", "--residual-stream", "--rotation", "quarot",
                             "--calib-samples", "2", "--calib-seqlen", "64", "--plot", tmp_path / "p.png", "--json")
    assert code == 0, err
    got = json.loads(stdout)
    layers = got["layers"]
    assert len(layers) == 30 and max(layers, key=lambda r: r["jump_ratio"])["layer"] == 0
    # the order --a8-layers K takes its K layers from: by Jump Ratio (the default), and by SNR
    assert got["a8_order"]["jr"] == sorted(range(30), key=lambda i: -layers[i]["jump_ratio"])
    assert got["a8_order"]["snr"] == sorted(range(30), key=lambda i: layers[i]["snr4_db"])
    assert (tmp_path / "p.png").stat().st_size > 10_000
    code, _, err = _cli(capsys, "analyze", "smollm2-135m")
    assert code == 2 and "--residual-stream" in err
    code, _, err = _cli(capsys, "quantize", "smollm2-135m", "--method", "rtn", "--a8-layers", "2", "-o", tmp_path / "q")
    assert code == 2 and "use --a-bits 4" in err and not (tmp_path / "q").exists()
