"""Hessian preparation shared by the GPTQ-family solvers (GPTQ, BPDQ, ...)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class HessianError(RuntimeError):
    pass


@dataclass
class PreparedHessian:
    """U: upper Cholesky factor of (H + λI)⁻¹; perm: column order (None = natural); damp used."""

    hinv_u: torch.Tensor
    perm: torch.Tensor | None
    damp: float
    dead: torch.Tensor


def prepare_hessian(
    hessian: torch.Tensor,
    weight: torch.Tensor,
    damp: float = 0.01,
    act_order: bool = False,
    max_retries: int = 6,
) -> tuple[PreparedHessian, torch.Tensor]:
    """Dampen, optionally reorder by diag(H) (act-order) and factor H⁻¹ = UᵀU.

    Dead input channels (H_jj = 0, never activated) get H_jj = 1 and zero weight, as GPTQ
    does. If the Cholesky factorisation fails, λ is multiplied by 10 and retried. Returns the
    prepared Hessian and the (possibly permuted, dead-zeroed) weight copy.
    """
    H = hessian.detach().float().clone()
    W = weight.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    mean_diag = torch.diag(H).mean()
    eye = torch.eye(H.shape[0], device=H.device)
    lam = damp
    for attempt in range(max_retries + 1):
        L, info = torch.linalg.cholesky_ex(H + lam * mean_diag * eye)
        if info == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0 and torch.isfinite(U).all():
                if attempt:
                    log.warning("Hessian not positive definite: dampening raised to %.3g", lam)
                return PreparedHessian(U, perm, lam, dead), W
        lam = lam * 10 if lam > 0 else 1e-4
    raise HessianError(f"Hessian could not be factorised even with damp={lam / 10:g}; calibration data degenerate?")


def invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
