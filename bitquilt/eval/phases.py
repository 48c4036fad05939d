"""Residual-stream phase plot (DynamicPTQ's analysis): Jump Ratio and Historical-Feature SNR per layer."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from bitquilt.cache import write_figure
from bitquilt.calib.residual import LayerPhase


def plot_phases(phases: list[LayerPhase], path: str | Path, title: str, chosen: list[int] = ()) -> Path:
    """Two panels over depth: JR (whole layer, attention and MLP halves; log scale) and SNR in dB at each
    measured bit width; `chosen` layers (e.g. those given 8-bit activations) are marked. Written atomically."""
    layers = [p.layer for p in phases]
    fig = Figure(figsize=(7.5, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.semilogy(layers, [p.jump_ratio for p in phases], "o-", label="JR = ‖Δx‖/‖x‖")
    top.semilogy(layers, [p.jump_ratio_attn for p in phases], ".--", label="attention half")
    top.semilogy(layers, [p.jump_ratio_mlp for p in phases], ".--", label="MLP half")
    top.set_ylabel("jump ratio")
    top.legend(fontsize=8)
    for bits in phases[0].snr_db:
        bottom.plot(layers, [p.snr_db[bits] for p in phases], "o-", label=f"{bits}-bit")
    bottom.set_ylabel("historical SNR (dB)")
    bottom.set_xlabel("decoder layer")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        for i in chosen:
            ax.axvspan(i - 0.4, i + 0.4, color="orange", alpha=0.25, lw=0)
    top.set_title(title + (" (shaded: 8-bit activations)" if chosen else ""))
    fig.tight_layout()
    return write_figure(fig, path)
