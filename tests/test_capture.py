"""Capturing linear inputs inside a block: statistics, sharing, ranges-only mode, early stop."""

import torch

from bitquilt.calib.capture import capture_block_inputs, collect_stats, sample_inputs
from bitquilt.models.adapters import architecture_of, decoder_layers
from tests.conftest import make_tiny


def _block_and_inputs():
    model = make_tiny("llama")
    ids = torch.randint(0, 320, (3, 16), generator=torch.Generator().manual_seed(0))
    arch = architecture_of(model)
    inputs, kwargs = capture_block_inputs(model, arch, ids)
    return decoder_layers(model, arch)[0], inputs, kwargs[0]


def _seen_inputs(block, names, inputs, kwargs):
    """What each linear receives on a full forward, by plain hooks (the reference)."""
    got = {n: [] for n in names}
    handles = [block.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: got[n].append(args[0].reshape(-1, args[0].shape[-1]))) for n in names]
    with torch.no_grad():
        for x in inputs:
            block(x, **kwargs)
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


def test_statistics_match_the_inputs_and_twins_share_them():
    block, inputs, kwargs = _block_and_inputs()
    names = ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"]
    stats = collect_stats(block, names, inputs, kwargs)
    seen = _seen_inputs(block, names, inputs, kwargs)
    assert stats["self_attn.q_proj"] is stats["self_attn.k_proj"]  # one input, one Hessian
    assert stats["mlp.gate_proj"] is not stats["mlp.down_proj"]
    for n, x in seen.items():
        assert stats[n].n_tokens == x.shape[0] == 3 * 16
        torch.testing.assert_close(stats[n].hessian, x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats[n].act_absmax, x.abs().amax(0))
    ranges = collect_stats(block, names, inputs, kwargs, hessian=False)
    assert all(s.hessian is None for s in ranges.values())
    assert torch.equal(ranges["mlp.down_proj"].act_absmax, stats["mlp.down_proj"].act_absmax)


def test_capture_stops_each_forward_after_the_last_linear_needed():
    block, inputs, kwargs = _block_and_inputs()
    calls = []
    handle = block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    samples = sample_inputs(block, ["self_attn.q_proj"], inputs, kwargs, max_tokens=20)
    assert calls == []  # the MLP never ran
    handle.remove()
    full = _seen_inputs(block, ["self_attn.q_proj"], inputs[:4], kwargs)["self_attn.q_proj"]
    assert samples["self_attn.q_proj"].shape == (20, 128)
    assert torch.equal(samples["self_attn.q_proj"], full[torch.linspace(0, full.shape[0] - 1, 20).long()])
