"""Outlier migration (MoBiQuant's motivation): the tokens that suffer most from quantization change with the
bit-width, so a static grid calibrated at one precision protects the wrong tokens at another.

For every token position t of some evaluation windows and every precision setting s of one model,
the error is the divergence of the quantized model's next-token distribution from the full-precision one's:

    e_s(t) = KL(p_fp(·|x_≤t) ‖ p_s(·|x_≤t)) = Σ_v p_fp(v) · (log p_fp(v) − log p_s(v))   (nats)

Across settings a and b (N tokens):
  ρ(a, b)       Spearman rank correlation of e_a and e_b: the Pearson correlation of their ranks, tied
                values sharing their average rank (exact; NaN where one setting's errors are all equal);
  shared(a, b)  |T_a ∩ T_b| / k, T_s the k = ⌈top_fraction · N⌉ tokens with the largest e_s: the fraction
                of one setting's worst tokens that are also the other's worst (both sets have k tokens, so it
                is symmetric; rankings independent of each other share k/N on average).
ρ well below 1 and a small share mean the worst tokens migrate between precisions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitquilt.cache import write_figure
from bitquilt.errors import UserError
from bitquilt.nn.quant_linear import multi_part_linears, set_slices
from bitquilt.progress import progress_bar

log = logging.getLogger(__name__)

NOT_SLICED = ("the outlier-migration analysis needs a sliced checkpoint, one weight serving several precisions: "
              "quantize the model with `bitquilt quantize --method mobislice` (or mobiquant)")
SAME_MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


# ---------------------------------------------------------------- rank statistics
def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks (float64) of the values of 1-D x; equal values share the mean of the ranks they span.

    A group of c equal values whose largest rank is r spans ranks r − c + 1 .. r, mean r − (c − 1)/2.
    """
    _, group, counts = torch.unique(x, return_inverse=True, return_counts=True)  # groups in increasing order
    last = counts.cumsum(0).double()
    return (last - (counts.double() - 1) / 2)[group]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    za, zb = a - a.mean(), b - b.mean()
    return float((za @ zb) / (za.norm() * zb.norm()))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's ρ of two equal-length 1-D tensors (module docstring); NaN if either is constant."""
    if a.dim() != 1 or a.shape != b.shape or len(a) < 2:
        raise ValueError(f"spearman needs two 1-D tensors of one length ≥ 2, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    return _pearson(average_ranks(a), average_ranks(b))


# ---------------------------------------------------------------- per-token errors
def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(· | x_≤t) [seqlen, vocab] in fp32 for one window of ids [seqlen]."""
    device = next(model.parameters()).device
    logits = model(ids.unsqueeze(0).to(device), use_cache=False).logits[0]
    return logits.float().log_softmax(-1).cpu()


@torch.no_grad()
def token_errors(fp_model: nn.Module, model: nn.Module, windows: torch.Tensor,
                 settings: dict[str, Callable[[nn.Module], Any]], progress: bool = False) -> dict[str, torch.Tensor]:
    """{label: e_label [n_windows · seqlen]}: KL(p_fp ‖ p_q) at every position of windows [n, seqlen] (module
    docstring), with `model` put into each precision by `settings[label](model)`.

    Windows run one at a time: the fp log-probs are computed once per window and reused by every setting, so
    memory holds one window's [seqlen, vocab] distributions, not all of them. Leaves `model` in the last setting.
    """
    if windows.dim() != 2 or windows.numel() == 0:
        raise ValueError(f"windows must be token ids [n, seqlen] with n, seqlen ≥ 1, got {tuple(windows.shape)}")
    if not settings:
        raise ValueError("token_errors needs at least one precision setting")
    errors: dict[str, list[torch.Tensor]] = {label: [] for label in settings}
    for ids in progress_bar(windows, desc="outlier migration", unit="window", disable=not progress):
        log_p = _log_probs(fp_model, ids)
        for label, apply in settings.items():
            apply(model)
            kl = F.kl_div(_log_probs(model, ids), log_p, reduction="none", log_target=True).sum(-1)
            errors[label].append(kl.clamp(min=0))  # ≥ 0 exactly; the sum may round a hair below
    return {label: torch.cat(e) for label, e in errors.items()}


# ---------------------------------------------------------------- across precisions
@dataclass
class MigrationResult:
    """ρ and top-token sharing between every pair of settings (module docstring), in `labels` order."""

    labels: list[str]
    mean_error: list[float]  # mean KL(p_fp ‖ p_q) per token, nats
    spearman: torch.Tensor  # [L, L] float64, symmetric, unit diagonal
    top_shared: torch.Tensor  # [L, L] float64, symmetric, unit diagonal
    top_fraction: float
    top_k: int
    n_tokens: int

    @property
    def chance_shared(self) -> float:
        """The share two independent rankings would have on average: k/N."""
        return self.top_k / self.n_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels, "mean_kl": dict(zip(self.labels, self.mean_error)),
                "spearman": self.spearman.tolist(), "top_shared": self.top_shared.tolist(),
                "top_shared_measure": "fraction of the top tokens shared, |A ∩ B| / k",
                "top_fraction": self.top_fraction, "top_k": self.top_k, "n_tokens": self.n_tokens,
                "chance_shared": self.chance_shared}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrationResult:
        """Inverse of `to_dict` (a stored result plotted again)."""
        labels = list(d["labels"])
        return cls(labels, [d["mean_kl"][label] for label in labels],
                   torch.tensor(d["spearman"], dtype=torch.float64), torch.tensor(d["top_shared"], dtype=torch.float64),
                   d["top_fraction"], d["top_k"], d["n_tokens"])


def migration(errors: dict[str, torch.Tensor], top_fraction: float = 0.01) -> MigrationResult:
    """Spearman ρ and the shared fraction of the top `top_fraction` tokens between every pair of the per-token
    errors of `token_errors` (module docstring)."""
    if not errors:
        raise ValueError("migration needs the errors of at least one setting")
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    labels = list(errors)
    e = torch.stack([errors[label].double() for label in labels])  # [L, N]: every setting saw the same tokens
    n = e.shape[1]
    k = max(1, math.ceil(top_fraction * n))
    ranks = [average_ranks(row) for row in e]
    top = torch.zeros_like(e, dtype=torch.bool).scatter_(1, e.topk(k, dim=1).indices, True)
    rho = torch.empty(len(labels), len(labels), dtype=torch.float64)
    for i in range(len(labels)):
        for j in range(i, len(labels)):
            rho[i, j] = rho[j, i] = _pearson(ranks[i], ranks[j])
    shared = (top.double() @ top.double().T) / k  # integer counts: exactly symmetric
    return MigrationResult(labels, [float(row.mean()) for row in e], rho, shared, top_fraction, k, n)


# ---------------------------------------------------------------- precisions of a sliced model
def slice_precisions(model: nn.Module) -> dict[float, int]:
    """{bits: k}: the element bits per weight when every token uses the first k slices, for k = 1 .. the fewest
    slices any sliced linear has (Σ of those slices' widths, averaged over weights, as `set_slices` returns)."""
    linears = list(multi_part_linears(model).values())
    if not linears:
        raise UserError(NOT_SLICED)
    widths = [[p.bits for p in m.fmt.parts.values()] for m in linears]
    numel = [m.in_features * m.out_features for m in linears]
    out = {}
    for k in range(1, min(map(len, widths)) + 1):
        out[sum(n * sum(w[:k]) for n, w in zip(numel, widths)) / sum(numel)] = k
    return out


def precision_settings(model: nn.Module, bits: list[float] | None = None) -> dict[str, Callable[[nn.Module], Any]]:
    """Settings for `token_errors` of a sliced model: "static b" (every token uses the slices whose widths sum to
    b, `set_slices`) and, if the model has routers, "routed b" (tokens routed to average b, `set_precision`).

    `bits` None: every static precision. A b that neither a prefix of the slices nor the routers reach is
    refused, naming what is reachable; one only the routers (or only the slices) reach gets that setting alone.
    """
    from bitquilt.nn.slice_router import has_routers, set_precision

    static = slice_precisions(model)
    routers = has_routers(model)
    reachable = ", ".join(f"{b:g}" for b in static)
    bits = list(static) if bits is None else bits
    settings: dict[str, Callable[[nn.Module], Any]] = {}
    routed: dict[str, Callable[[nn.Module], Any]] = {}
    for b in dict.fromkeys(bits):
        k = next((k for s, k in static.items() if math.isclose(s, b, abs_tol=1e-6)), None)
        if k is not None:
            settings[f"static {b:g}"] = lambda m, k=k: set_slices(m, k)
        why = "the model has no slice routers"
        if routers:
            try:
                set_precision(model, b)  # checks b against the routed range
                routed[f"routed {b:g}"] = lambda m, b=b: set_precision(m, b)
            except ValueError as e:
                why = str(e)
                if k is not None:
                    log.warning("no routed %g-bit setting: %s", b, why)
        if k is None and f"routed {b:g}" not in routed:
            raise UserError(f"{b:g} bits: no prefix of this checkpoint's slices reaches it (static precisions: "
                            f"{reachable} bits), and {why}")
    return {**settings, **routed}


def check_same_model(fp_model: nn.Module, model: nn.Module) -> None:
    """Refuse a full-precision reference that is not the architecture `model` was quantized from."""
    diff = {f: (getattr(fp_model.config, f, None), getattr(model.config, f, None)) for f in SAME_MODEL_FIELDS}
    diff = {f: v for f, v in diff.items() if v[0] != v[1]}
    if diff:
        shown = ", ".join(f"{f} {a} there, {b} in the checkpoint" for f, (a, b) in diff.items())
        raise UserError(f"the full-precision model is not the one the checkpoint was quantized from ({shown}); "
                        "give the model it was quantized from")


# ---------------------------------------------------------------- plot
def plot_migration(result: MigrationResult, path: str | Path, title: str) -> Path:
    """Two heatmaps over the settings: Spearman ρ of the per-token errors and the shared fraction of the top
    tokens, each cell annotated; the mean KL of each setting labels its row. Written atomically."""
    from matplotlib.figure import Figure

    n = len(result.labels)
    size = max(3.2, 0.55 * n + 1.8)
    fig = Figure(figsize=(2 * size + 1.5, size + 0.6))
    panels = [(result.spearman, "Spearman ρ of per-token KL", -1.0),
              (result.top_shared, f"top {100 * result.top_fraction:g}% tokens shared "
                                  f"(chance {result.chance_shared:.2g})", 0.0)]
    rows = [f"{label}  (KL {e:.3g})" for label, e in zip(result.labels, result.mean_error)]
    for ax, (matrix, name, low) in zip(fig.subplots(1, 2), panels):
        image = ax.imshow(matrix.numpy(), vmin=low, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(n), result.labels, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(n), rows if low < 0 else result.labels, fontsize=8)
        for i in range(n):
            for j in range(n):
                value = float(matrix[i, j])
                ax.text(j, i, "–" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if value > low + 0.6 * (1 - low) else "white")
        ax.set_title(name, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{title}: {result.n_tokens} tokens", fontsize=10)
    fig.tight_layout()
    return write_figure(fig, path)
