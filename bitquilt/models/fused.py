"""Fused projections (Phi-3's `qkv_proj`, `gate_up_proj`): split into the adapter's linears, and fused back.

bitquilt works on the split, llama-like layout wherever it owns the model. `split_fused` replaces each fused linear
of a loaded model by its parts (q/k/v, gate/up: row slices of the weight, so the model computes exactly what it did)
and leaves a `SplitLinear` in its place whose output is the parts' outputs concatenated, so the family's own forward
runs unchanged. Every method, the true-sequential engine, scale folding, rotations, saved directories (the parts'
names) and bitquilt's runtime then see a llama-like block. `fuse_parts` stacks the parts again for the exports whose
target reads the fused tensors (GGUF's phi3 `attn_qkv` and `ffn_up`, compressed-tensors' Phi-3 checkpoint): full-
precision weights by row concatenation, packed formats by `concat_rows` (exact for formats that store rows apart, of
one grid; anything else is refused).

An MoE family's experts (3D tensors, `Architecture.experts`) are split the same way, each expert's rows of them
becoming its own `gate_proj`/`up_proj`/`down_proj` inside a `bitquilt.models.experts.ExpertLinears`, which stands
where the experts module was and computes what it computed. Both splits are row slices of a tensor viewed as
[rows, in]; `fused_source` says which rows of which checkpoint tensor a part is, for streaming's reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bitquilt.errors import UserError
from bitquilt.formats.base import concat_rows
from bitquilt.models.adapters import Architecture, Experts, Fusion, architecture_for, decoder_layers
from bitquilt.models.experts import Expert, ExpertLinears
from bitquilt.nn.quant_linear import QuantLinear


class SplitLinear(nn.Module):
    """Stands where a fused linear was: the concatenated outputs of its parts, which are its parent's own linears
    (looked up at each call, so a part replaced by a quantized one is the one called)."""

    def __init__(self, parent: nn.Module, parts: tuple[str, ...]):
        super().__init__()
        object.__setattr__(self, "_parent", parent)  # not a submodule: the parts stay the parent's
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self._parent, name)(x) for name in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"parts={', '.join(self.parts)}"


def _fusions(model: nn.Module) -> tuple[Architecture | None, tuple[Fusion, ...]]:
    arch = architecture_for(getattr(getattr(model, "config", None), "model_type", None))
    return arch, arch.fusions if arch is not None else ()


def _row_linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An nn.Linear holding copies of `weight` [out, in] and `bias` (no initialisation run: built on meta)."""
    with torch.device("meta"):
        part = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    part.weight = nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    if bias is not None:
        part.bias = nn.Parameter(bias.detach().clone(), requires_grad=requires_grad)
    return part


def _held(block: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module | None]:
    """(the parent of module `name` of `block`, the module's own name, the module or None if it has none)."""
    parent_name, _, own = name.rpartition(".")
    parent = block.get_submodule(parent_name)
    return parent, own, getattr(parent, own, None)


def _split(block: nn.Module, fusion: Fusion, config: Any) -> None:
    parent, fused_name, linear = _held(block, fusion.fused)
    if isinstance(linear, SplitLinear):
        return
    rows = fusion.rows(config)
    if sum(rows) != linear.out_features:
        raise UserError(f"{fusion.fused} has {linear.out_features} rows, the config implies {sum(rows)}; the model "
                        "is corrupt")
    biases = linear.bias.split(rows) if linear.bias is not None else [None] * len(rows)
    for name, weight, bias in zip(fusion.parts, linear.weight.split(rows), biases, strict=True):
        setattr(parent, name.rpartition(".")[2], _row_linear(weight, bias, linear.weight.requires_grad))
    setattr(parent, fused_name, SplitLinear(parent, tuple(p.rpartition(".")[2] for p in fusion.parts)))


def _expert_rows(experts: Experts, config: Any) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """{an expert's linear: (the 3D tensor holding it, its index among that tensor's parts, each part's rows)}."""
    rows = experts.rows(config)
    return {part: (tensor, k, rows[tensor]) for tensor, parts in experts.tensors for k, part in enumerate(parts)}


def _split_experts(block: nn.Module, experts: Experts, config: Any) -> None:
    parent, name, stacked = _held(block, experts.module)
    if isinstance(stacked, ExpertLinears):
        return
    if not hasattr(stacked, "gate_up_proj"):
        raise UserError(f"{type(block).__name__} has a dense MLP where its family has experts ({experts.module}: "
                        f"{type(parent).__name__}); MoE models whose blocks mix dense and routed MLPs (Qwen3-MoE's "
                        "mlp_only_layers, decoder_sparse_step > 1) are not supported")
    count = experts.count(config)
    layout = _expert_rows(experts, config)
    linears: list[dict[str, nn.Linear]] = [{} for _ in range(count)]
    for part, (tensor, k, rows) in layout.items():
        t = getattr(stacked, tensor)
        if tuple(t.shape[:2]) != (count, sum(rows)):
            raise UserError(f"{experts.module}.{tensor} has shape {tuple(t.shape)}, the config implies "
                            f"({count}, {sum(rows)}, …); the model is corrupt")
        for e in range(count):
            linears[e][part] = _row_linear(t[e].split(rows)[k], None, t.requires_grad)
    setattr(parent, name, ExpertLinears(Expert(**parts, act_fn=stacked.act_fn) for parts in linears))


def split_fused(model: nn.Module) -> nn.Module:
    """`model` with its fused projections and its experts split in place into the adapter's linears (module
    docstring); a model of a family without either, or split already, is returned unchanged. Works on meta-device
    skeletons too."""
    arch, fusions = _fusions(model)
    experts = arch.experts if arch is not None else None
    for block in decoder_layers(model, arch) if fusions or experts else ():
        for fusion in fusions:
            _split(block, fusion, model.config)
        if experts is not None:
            _split_experts(block, experts, model.config)
    return model


def _fused(parts: list[nn.Module], where: str) -> nn.Module:
    """One linear computing what `parts` compute, their output rows stacked; UserError naming `where` if it
    cannot be exact."""
    if all(type(p) is nn.Linear for p in parts):
        biases = [p.bias for p in parts]
        with torch.device("meta"):
            fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=biases[0] is not None)
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if biases[0] is not None:
            fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
        return fused
    if not all(isinstance(p, QuantLinear) and not p._modules and p.slices is None for p in parts):
        raise UserError(f"cannot fuse {where}: its parts are not all plain linears of one kind (full precision, or "
                        "quantized without online modules)")
    if len({p.bias is None for p in parts}) != 1:
        raise UserError(f"cannot fuse {where}: some of its parts have a bias and some do not")
    try:
        fmt = concat_rows([p.fmt for p in parts])
    except ValueError as e:
        raise UserError(f"cannot fuse {where} exactly: {e}; quantize its parts alike (one format, bits and group "
                        "size)") from None
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    return QuantLinear(fmt, bias)


def fuse_parts(model: nn.Module) -> nn.Module:
    """The inverse of `split_fused`, in place: each fusion's parts stacked into one linear under the fused name, as
    the family's checkpoints hold it (module docstring); UserError naming the first that cannot be fused exactly."""
    arch, fusions = _fusions(model)
    for i, block in enumerate(decoder_layers(model, arch) if fusions else ()):
        for fusion in fusions:
            parent_name, _, fused_name = fusion.fused.rpartition(".")
            parent = block.get_submodule(parent_name)
            if not isinstance(getattr(parent, fused_name), SplitLinear):
                continue
            names = [p.rpartition(".")[2] for p in fusion.parts]
            fused = _fused([getattr(parent, n) for n in names], f"{arch.layers}.{i}.{fusion.fused}")
            for n in names:
                delattr(parent, n)
            setattr(parent, fused_name, fused)
    return model


def checkpoint_name(model: nn.Module, name: str) -> str | None:
    """The name tensor `name` (model-level) has in its family's per-expert checkpoint layout (Mixtral's
    `block_sparse_moe.experts.{e}.w1`, ...; `Experts.renames`), None outside an MoE block or where it is the same."""
    arch = architecture_for(getattr(getattr(model, "config", None), "model_type", None))
    if arch is None or arch.experts is None or f".{arch.experts.module.split('.')[0]}." not in name:
        return None
    renamed = name
    for ours, theirs in arch.experts.renames:
        renamed = renamed.replace(ours, theirs)
    return renamed if renamed != name else None


def fused_source(model: nn.Module, name: str) -> tuple[str, slice, tuple[int, ...]] | None:
    """(the checkpoint tensor holding the split tensor `name` (a part's weight or bias, by its model-level name), the
    rows of it, viewed as [rows, …the part's own trailing dims], that are `name`, its leading dims before those) for
    a part of a fusion or an expert's linear; None if `name` is neither."""
    arch, fusions = _fusions(model)
    prefix = f"{arch.layers}." if arch is not None else None
    if prefix is None or not name.startswith(prefix):
        return None
    index, _, rest = name[len(prefix):].partition(".")
    module, _, tensor = rest.rpartition(".")
    for fusion in fusions:
        if module in fusion.parts:
            rows = fusion.rows(model.config)
            k = fusion.parts.index(module)
            return f"{prefix}{index}.{fusion.fused}.{tensor}", slice(sum(rows[:k]), sum(rows[: k + 1])), (sum(rows),)
    experts = arch.experts
    if experts is None or tensor != "weight" or not module.startswith(f"{experts.module}."):
        return None
    expert, _, part = module[len(experts.module) + 1:].partition(".")
    layout = _expert_rows(experts, model.config)
    if not expert.isdigit() or part not in layout:
        return None
    stacked, k, rows = layout[part]
    first = int(expert) * sum(rows) + sum(rows[:k])
    return (f"{prefix}{index}.{experts.module}.{stacked}", slice(first, first + rows[k]),
            (experts.count(model.config), sum(rows)))
