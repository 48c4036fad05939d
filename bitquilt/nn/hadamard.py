"""Orthonormal Hadamard transforms of any size n = p·2^k, fast: O(n log n + n·p).

The matrix is M_n = F_p ⊗ H_{2^k} / √(2^k), with H_{2^k} the Sylvester–Hadamard matrix and F_p
an orthonormal p×p factor for the odd part m of n (n = 2^j·m, p = 2^i·m, i ≤ j):

  m = 1          F = [1]
  m > 1          F = H_p / √p, H_p a Paley Hadamard matrix for the smallest p = 2^i·m (i ≥ 2) that
                 Paley's constructions give: p = q + 1 (Paley I, q prime ≡ 3 mod 4) or
                 p = 2(q + 1) (Paley II, q prime ≡ 1 mod 4). This covers every size of the packaged
                 models: 576 = 36·16, 896 = 28·32, 1536 = 12·128, 4864 = 76·64, 8960 = 140·64.
  otherwise      F = a fixed random orthogonal m×m matrix (QR of a Gaussian seeded with m, R's
                 diagonal made positive so the result is unique): orthonormal, but it spreads
                 outliers only as a generic rotation does within the odd factor.

x ↦ x M_n is one butterfly pass per factor of two plus a p×p matmul. `signs` give QuaRot's
randomised Hadamard Q = diag(s) M_n, s ∈ {±1}ⁿ.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from bitquilt.kernels.hadamard import transform as kernel_transform


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q_ij = χ(j − i), χ the quadratic character of GF(q), q prime."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx.unsqueeze(0) - idx.unsqueeze(1)) % q]


def paley_hadamard(p: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order p (H Hᵀ = p I) from Paley's constructions, or None."""
    q = p - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: H = I + S, S = [[0, 1ᵀ], [−1, Q]] skew
        s = torch.zeros(p, p, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return torch.eye(p, dtype=torch.float64) + s
    q = p // 2 - 1
    if p % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: C = [[0, 1ᵀ], [1, Q]] symmetric
        c = torch.zeros(p // 2, p // 2, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron(torch.eye(p // 2, dtype=torch.float64), zero)
    return None


def sylvester(n: int) -> torch.Tensor:
    """The ±1 Sylvester–Hadamard matrix of order n = 2^k (explicit; the fast path never builds it)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


@cache
def odd_factor(n: int) -> torch.Tensor:
    """The orthonormal factor F_p (float64) of M_n; its order p divides n and n/p is a power of two."""
    if n < 1:
        raise ValueError(f"Hadamard size must be positive, got {n}")
    twos = (n & -n).bit_length() - 1
    m = n >> twos
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    for i in range(2, twos + 1):
        h = paley_hadamard(m << i)
        if h is not None:
            return h / math.sqrt(m << i)
    g = torch.randn(m, m, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def hadamard_matrix(n: int) -> torch.Tensor:
    """M_n explicitly (float64), built by Kronecker products: the reference for `hadamard_transform`."""
    f = odd_factor(n)
    k = n // f.shape[0]
    return torch.kron(f, sylvester(k) / math.sqrt(k))


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform along the last dimension (a power of two), on a copy:
    at stage h, pairs (a, b) h apart become (a + b, a − b)."""
    shape, n, h = x.shape, x.shape[-1], 1
    x = x.reshape(-1, n).clone()
    while h < n:
        pairs = x.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        a.add_(b)
        b.mul_(-2).add_(a)  # (a + b) − 2b
        h *= 2
    return x.reshape(shape)


@cache
def _kernel_factor(n: int) -> torch.Tensor:
    """F_p / √k in fp32, contiguous: what the compiled transform multiplies by."""
    f = odd_factor(n)
    return (f / math.sqrt(n // f.shape[0])).float().contiguous()


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """(x ⊙ s) M_n along the last dimension of x (n = x.shape[-1]); s = 1 if `signs` is None.

    fp32 CPU tensors without a gradient go through the compiled kernel (`bitquilt.kernels.hadamard`), the rest
    through the butterflies below (the reference the kernel is tested against)."""
    n = x.shape[-1]
    fast = kernel_transform(x, signs, _kernel_factor(n))
    return fast if fast is not None else reference_transform(x, signs)


def reference_transform(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """`hadamard_transform` in torch: one butterfly pass per factor of two, then the odd factor as a matmul."""
    n = x.shape[-1]
    f = odd_factor(n)
    p, k = f.shape[0], n // f.shape[0]
    if signs is not None:
        x = x * signs.to(x.dtype)
    y = _fwht(x.reshape(*x.shape[:-1], p, k))
    if p == 1:
        return y.mul_(1 / math.sqrt(k)).reshape(x.shape)
    # y[..., c, :] = Σ_a F[a, c] y[..., a, :] / √k, as one matmul
    f = (f / math.sqrt(k)).to(device=y.device, dtype=y.dtype)
    return (y.transpose(-1, -2) @ f).transpose(-1, -2).reshape(x.shape)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """The ±1 diagonal (float64) of QuaRot's randomised Hadamard, reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
