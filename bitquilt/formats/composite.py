"""Multi-part weights: Ŵ is a sum of named parts, each a registered format of the same shape.

This covers a dense base plus a residual (sparse or low-bit), k cumulative slices of which a
token may use only the first s (`dequantize(selector=s)`, `MatmulContext.slices`), and column
classes stored in permuted column order.

Definition: parts P_1..P_n in order and an optional column permutation perm int32 [in]:
  S_k = Σ_{e ≤ k} P_e.dequantize()          (S_0 = 0; summed in fp32, in part order)
  Ŵ_k[:, perm] = S_k,  i.e.  Ŵ_k = S_k[:, inverse],  inverse = argsort(perm)
so column j of the parts is column perm[j] of the weight (without perm, Ŵ_k = S_k).
`dequantize(selector=k)` is Ŵ_k and None the full Ŵ_n; for x [tokens, in],
x Ŵ_kᵀ = Σ_{e ≤ k} x[:, perm] P_eᵀ.

Stored tensors: `<part>.<tensor>` for every tensor of every part, and `perm` if given.
Meta: {"parts": [{"name", "format", "meta"}, ...]} in part order.
"""

from __future__ import annotations

from typing import Any

import torch

from bitquilt.formats.base import PART_SEP, WeightFormat, format_class, register_format


@register_format
class CompositeFormat(WeightFormat):
    name = "composite"
    # built from parts of other formats, not from one (bits, group size) grid: a solver producing
    # composites validates its spec against the format of its parts
    supported_bits = ()
    supported_group_sizes = ()

    def __init__(self, parts: dict[str, WeightFormat], perm: torch.Tensor | None = None):
        if not parts:
            raise ValueError("a composite format needs at least one part")
        shapes = {name: (p.out_features, p.in_features) for name, p in parts.items()}
        self.out_features, self.in_features = next(iter(shapes.values()))
        if len(set(shapes.values())) > 1:
            raise ValueError(f"composite parts must share one [out, in] shape; got {shapes}")
        bad = [name for name in parts if not name or PART_SEP in name]
        if bad:
            raise ValueError(f"part names must be non-empty and free of {PART_SEP!r}; got {bad}")
        if perm is not None:
            perm = perm.to(torch.int32)
            identity = torch.arange(self.in_features, dtype=torch.int32, device=perm.device)
            if perm.shape != identity.shape or not torch.equal(torch.sort(perm).values, identity):
                raise ValueError(f"perm must be a permutation of the {self.in_features} input columns")
        self.parts = dict(parts)
        self.perm = perm

    @property
    def inverse(self) -> torch.Tensor | None:
        """argsort(perm): Ŵ = S[:, inverse] (None without a permutation)."""
        return None if self.perm is None else torch.argsort(self.perm)

    def leading_parts(self, k: Any = None) -> int:
        """k as a number of leading parts (None: all of them), checked to lie in [0, number of parts]."""
        n = len(self.parts)
        if k is None:
            return n
        if not 0 <= int(k) <= n:
            raise ValueError(f"{k} slices asked of a weight of {n} (accepted: 0 to {n})")
        return int(k)

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        """Ŵ_k, k = `selector` leading parts (None: all of them)."""
        k = self.leading_parts(selector)
        device = next(iter(self.tensors().values())).device
        total = torch.zeros(self.out_features, self.in_features, device=device)
        for part in list(self.parts.values())[:k]:
            total = total + part.dequantize()
        return total if self.perm is None else total[:, self.inverse]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{name}{PART_SEP}{t}": v for name, part in self.parts.items() for t, v in part.tensors().items()}
        if self.perm is not None:
            out["perm"] = self.perm
        return out

    def meta(self) -> dict[str, Any]:
        return {"parts": [{"name": name, "format": p.name, "meta": p.meta()} for name, p in self.parts.items()]}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> CompositeFormat:
        parts = {}
        for entry in meta["parts"]:
            prefix = entry["name"] + PART_SEP
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            parts[entry["name"]] = format_class(entry["format"]).from_tensors(own, entry["meta"])
        return cls(parts, tensors.get("perm"))

    def describe(self) -> str:
        parts = " + ".join(f"{name}: {p.describe()}" for name, p in self.parts.items())
        return f"composite({parts}){' permuted' if self.perm is not None else ''}"
