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
    W = weight.detach().float().clone()
    diagonal = torch.diag(hessian).float()
    dead = diagonal == 0
    W[:, dead] = 0.0
    diagonal = diagonal.masked_fill(dead, 1.0)
    perm = torch.argsort(diagonal, descending=True) if act_order else None
    dead_at = dead if perm is None else dead[perm]  # the dead channels in the swept order
    if perm is not None:
        W = W[:, perm]
    mean_diag = diagonal.mean()
    lam = damp
    for attempt in range(max_retries + 1):
        # A fresh damped copy per attempt, and each factor freed once the next is made: an 8B model's down_proj
        # Hessian is 0.8 GB in fp32, and this holds at most two such matrices at a time.
        factor, info = torch.linalg.cholesky_ex(damped(hessian, perm, dead_at, lam * mean_diag))
        if info == 0:
            factor = torch.cholesky_inverse(factor)
            U, info = torch.linalg.cholesky_ex(factor, upper=True)
            if info == 0 and torch.isfinite(U).all():
                if attempt:
                    log.warning("Hessian not positive definite: dampening raised to %.3g", lam)
                return PreparedHessian(U, perm, lam, dead), W
        del factor
        lam = lam * 10 if lam > 0 else 1e-4
    raise HessianError(f"Hessian could not be factorised even with damp={lam / 10:g}; calibration data degenerate?")


def damped(hessian: torch.Tensor, perm: torch.Tensor | None, dead: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """H + shift·I in fp32, in `perm`'s order, with the diagonal of `dead` (in that order) set to 1 before the shift."""
    H = hessian.detach().float()
    H = H[perm][:, perm] if perm is not None else H.clone()
    diagonal = H.diagonal()
    diagonal.masked_fill_(dead, 1.0)
    diagonal.add_(shift)
    return H


def invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
