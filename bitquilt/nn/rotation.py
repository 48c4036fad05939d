"""Online rotations (QuaRot): orthogonal transforms applied at run time, matched by their inverses
folded into the weights (see `bitquilt.transforms.rotation` for the algebra)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bitquilt.nn.hadamard import hadamard_matrix, hadamard_transform, random_signs
from bitquilt.nn.online import register_online


@register_online
class HadamardRotation(nn.Module):
    """x ↦ (x ⊙ s) M_n along the last dimension: s = 1 without a `seed`, else QuaRot's random signs.

    Unsigned, it is the online Hadamard on a writer's input (o_proj, down_proj, slot `input_rotation`);
    signed, the residual rotation applied to a norm's output (Gemma 3's post-norms, `output_rotation`).
    """

    def __init__(self, size: int, seed: int | None = None):
        super().__init__()
        self.size, self.seed = size, seed
        signs = None if seed is None else random_signs(size, seed).float()
        self.register_buffer("signs", signs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"a Hadamard rotation of size {self.size} got inputs of width {x.shape[-1]}")
        return hadamard_transform(x, self.signs)

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HadamardRotation:
        return cls(d["size"], d.get("seed"))

    def extra_repr(self) -> str:
        return f"size={self.size}" + ("" if self.seed is None else f", seed={self.seed}")


@register_online
class QKRotation(nn.Module):
    """(q, k, v) ↦ (q H, k H, v) per head after RoPE (H = M_head_dim): QKᵀ is unchanged while the
    keys' outliers are spread before KV quantization (slot `qk_rotation`)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        return hadamard_transform(query), hadamard_transform(key), value

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, _d: dict[str, Any]) -> QKRotation:
        return cls()


@register_online
class RotatedScale(nn.Module):
    """x ↦ x Qᵀ diag(g) Q, Q = diag(s) M_n QuaRot's residual rotation (`seed`): a norm's scale g applied to the
    rotated stream as the norm applied it before the rotation (slot `output_rotation` of the final norm, whose own
    weight is then 1). It lets an LM head tied to the embedding stay tied: the head reads E Q, the rotated embedding,
    where folding g into it would make a second table E diag(g) Q. One dense [n, n] product per token (`matrix`,
    saved with the model), against the head's [vocab, n]."""

    def __init__(self, size: int, seed: int, scale: torch.Tensor | None = None):
        super().__init__()
        self.size, self.seed = size, seed
        matrix = torch.zeros(size, size)  # a placeholder until the saved matrix loads
        if scale is not None:
            q = random_signs(size, seed)[:, None] * hadamard_matrix(size)
            matrix = (q.T * scale.double()) @ q
        self.register_buffer("matrix", matrix.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"a rotated scale of size {self.size} got inputs of width {x.shape[-1]}")
        return x @ self.matrix.to(x.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RotatedScale:
        return cls(d["size"], d["seed"])

    def extra_repr(self) -> str:
        return f"size={self.size}, seed={self.seed}"
