"""Function-preserving rewrites applied before solving: registry by name.

A transform has a scope: "block" transforms run inside the sequential engine on each
decoder block with its calibration inputs (AWQ, SmoothQuant); "model" transforms rewrite
the whole model once before calibration (rotations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Transform:
    name: str
    scope: str  # "block" or "model"
    fn: Callable
    recipe_fields: tuple[str, ...] = ()  # Recipe attributes passed in its options (e.g. "act_config_for")


TRANSFORMS: dict[str, Transform] = {}


def register_transform(name: str, scope: str, recipe_fields: tuple[str, ...] = ()):
    if scope not in ("block", "model"):
        raise ValueError(f"transform scope must be 'block' or 'model', not {scope!r}")

    def wrap(fn):
        TRANSFORMS[name] = Transform(name, scope, fn, tuple(recipe_fields))
        return fn

    return wrap


def get_transform(name: str) -> Transform:
    _register_builtin()
    try:
        return TRANSFORMS[name]
    except KeyError:
        raise ValueError(f"unknown transform {name!r}; known: {', '.join(sorted(TRANSFORMS))}") from None


def _register_builtin() -> None:
    from bitquilt.transforms import awq, rotation, smoothquant  # noqa: F401
