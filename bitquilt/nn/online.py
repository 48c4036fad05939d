"""Online modules: small run-time transforms attached to a host module at a named slot.

A *slot* is a named place in the forward pass of a host:

  site "input"      a linear's input, before its matmul        slots input_rotation → act_quant
  site "output"     a module's output (e.g. a norm's)           slot  output_rotation
  site "attention"  (q, k, v) after RoPE, before attention     slots qk_rotation → kv_quant
  site "context"    read by the host itself, no hook            slot  router (per-token slice counts)

Every slot of a site runs in the order above. A module attached to a slot becomes a submodule
of its host under the slot's name (so its buffers are saved with the model), and one hook per
host and site runs them (for inputs, a pre-hook that runs before any other, so calibration
hooks see what the matmul sees). Online module classes register
here by name (`register_online`), so `bitquilt.io` can save and restore any of them from
`to_dict()` / `from_dict()` without knowing what they are. Other slots are added with
`register_slot`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

SITES = ("input", "output", "attention", "context")


@dataclass(frozen=True)
class Slot:
    name: str  # attribute on the host
    site: str  # one of SITES


SLOTS: dict[str, Slot] = {}
ONLINE_CLASSES: dict[str, type[nn.Module]] = {}
# where bitquilt's own online classes are defined (`restore` imports them)
BUILTIN_MODULES = ("bitquilt.nn.act_quant", "bitquilt.nn.kv_quant", "bitquilt.nn.rotation", "bitquilt.nn.slice_router")
_hooked: dict[str, weakref.WeakSet] = {site: weakref.WeakSet() for site in SITES}


def register_slot(name: str, site: str) -> Slot:
    """Declare a slot (idempotent for the same site); slots of a site run in registration order."""
    if site not in SITES:
        raise ValueError(f"unknown online site {site!r}; sites: {', '.join(SITES)}")
    slot = SLOTS.setdefault(name, Slot(name, site))
    if slot.site != site:
        raise ValueError(f"slot {name!r} is already registered at site {slot.site!r}")
    return slot


for _name, _site in (("input_rotation", "input"), ("act_quant", "input"), ("output_rotation", "output"),
                     ("qk_rotation", "attention"), ("kv_quant", "attention"), ("router", "context")):
    register_slot(_name, _site)


def register_online(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: an online module restorable by its class name (needs to_dict / from_dict)."""
    if not (hasattr(cls, "to_dict") and hasattr(cls, "from_dict")):
        raise TypeError(f"{cls.__name__} needs to_dict() and from_dict() to be saved and restored")
    ONLINE_CLASSES[cls.__name__] = cls
    return cls


def slots_at(site: str) -> list[str]:
    return [s.name for s in SLOTS.values() if s.site == site]


def get(host: nn.Module, slot: str) -> nn.Module | None:
    """The module at `slot` of `host`, or None."""
    return host._modules.get(slot)


def run_site(host: nn.Module, site: str, *values: Any) -> Any:
    """Pass `values` through every module attached at `site` of `host`, in slot order."""
    for name in slots_at(site):
        module = host._modules.get(name)
        if module is not None:
            values = module(*values)
            values = values if isinstance(values, tuple) else (values,)
    return values[0] if len(values) == 1 else values


def _input_hook(module: nn.Module, args: tuple) -> tuple:
    return (run_site(module, "input", args[0]), *args[1:])


def _output_hook(module: nn.Module, _args: tuple, output: Any) -> Any:
    return run_site(module, "output", output)


def _attention(base: str) -> Callable:
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        query, key, value = run_site(module, "attention", query, key, value)
        return _base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)

    return attention


def _base_attention(module: nn.Module, base: str) -> Callable:
    if base == "eager":  # each family's own eager function (e.g. with softcapping)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


ATTENTION_PREFIX = "bitquilt_"


def enable_attention_site(model: nn.Module) -> None:
    """Switch `model` to the attention implementation `bitquilt_<base>` (idempotent).

    transformers' attention modules apply RoPE, update the cache and call
    `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`; the
    registered implementation runs the attention site of `module` and hands over to the base
    implementation (sdpa, eager, ...) with the base's mask function: no modeling code is copied.
    """
    if getattr(model, "runs_attention_site", False):  # a runtime that calls the site itself (LeanDecoder's)
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation or "eager"
    if base.startswith(ATTENTION_PREFIX):
        return
    name = ATTENTION_PREFIX + base
    AttentionInterface.register(name, _attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


def swap_host(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace submodule `name` of `root` by `new`, which takes over the old module's input-site
    online modules (rotations, activation quantizer)."""
    old = root.get_submodule(name)
    for slot in slots_at("input"):
        attach(new, slot, get(old, slot))
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def attach(host: nn.Module, slot: str, module: nn.Module | None) -> None:
    """Put `module` at `slot` of `host` (None: empty the slot). The attention site also needs
    `enable_attention_site(model)` once per model."""
    if slot not in SLOTS:
        raise ValueError(f"unknown online slot {slot!r}; slots: {', '.join(SLOTS)}")
    site = SLOTS[slot].site
    setattr(host, slot, module)
    if module is None or site in ("attention", "context") or host in _hooked[site]:
        return
    if site == "input":  # before any other pre-hook: calibration hooks see what the matmul sees
        host.register_forward_pre_hook(_input_hook, prepend=True)
    else:
        host.register_forward_hook(_output_hook)
    _hooked[site].add(host)


def online_modules(model: nn.Module) -> dict[str, dict[str, nn.Module]]:
    """{host name: {slot: module}} of every attached online module."""
    out: dict[str, dict[str, nn.Module]] = {}
    for host_name, host in model.named_modules():
        for slot in SLOTS:
            module = host._modules.get(slot)
            if module is not None:
                out.setdefault(host_name, {})[slot] = module
    return out


def import_builtin_classes() -> None:
    """Import the modules defining bitquilt's own online classes, which register them: a process that loads a saved
    model may not have imported the stage that attached them (e.g. QuaRot's rotations)."""
    import importlib

    for name in BUILTIN_MODULES:
        importlib.import_module(name)


def online_state(model: nn.Module) -> dict[str, dict[str, dict[str, Any]]]:
    """What `restore` needs: {host: {slot: {"class": name, "config": to_dict()}}}."""
    return {host: {slot: {"class": type(m).__name__, "config": m.to_dict()} for slot, m in slots.items()}
            for host, slots in online_modules(model).items()}


def restore(model: nn.Module, state: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Re-attach the online modules described by `online_state` (their tensors load afterwards)."""
    import_builtin_classes()
    for host, slots in state.items():
        for slot, entry in slots.items():
            cls = ONLINE_CLASSES.get(entry["class"])
            if cls is None:
                raise ValueError(f"online module class {entry['class']!r} at {host}.{slot} is not registered; "
                                 f"known: {', '.join(sorted(ONLINE_CLASSES))}")
            attach(model.get_submodule(host), slot, cls.from_dict(entry["config"]))
            if SLOTS[slot].site == "attention":
                enable_attention_site(model)


def has_input_transform(linear: nn.Module) -> bool:
    """True if `linear` transforms its input online before quantizing it (per-channel scales cannot cross it)."""
    return get(linear, "input_rotation") is not None
