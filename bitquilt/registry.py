"""Named registries and option dataclasses: the one way methods, stages, solvers and formats are
looked up, and the one place their options are checked.

Every pluggable piece (a solver, a transform or policy stage) registers under a name with an
options dataclass whose fields all have defaults. `make_options` turns a user's dict into that
dataclass, refusing unknown names and ill-typed values with one line naming what is accepted,
so a recipe is fully validated when it is built, not hours into a run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from bitquilt.flag_checks import is_integer, is_number

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> item, for one kind of pluggable piece (named in errors)."""

    def __init__(self, kind: str):
        self.kind, self._items = kind, {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove `name` (for tests and plug-ins that register temporarily)."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())


def _accepts(hint: Any, value: Any) -> bool:
    """Whether `value` fits the annotation `hint` (bool is not an int here; an int is a float)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, (tuple, list)) and all(_accepts(args[0], v) for v in value) if args else True
    if hint is float:
        return is_number(value)
    if hint is int:
        return is_integer(value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # callables and other annotations: not checked


def option_fields(options: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(options)}


def describe_options(options: type) -> str:
    """'name=default, ...' of an options dataclass, for error messages."""
    def default(f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    return ", ".join(f"{f.name}={default(f)!r}" for f in dataclasses.fields(options)) or "none"


def _type_name(hint: Any) -> str:
    """A type hint as a message says it: "a float", "an int", "tuple[int, ...]"."""
    if isinstance(hint, type):
        return ("an " if hint.__name__[0] in "aeiou" else "a ") + hint.__name__
    return str(hint).replace("typing.", "")


def make_options(options: type, values: dict[str, Any] | None, owner: str) -> Any:
    """`options(**values)` after checking every name and value type; `owner` names it in errors."""
    values = dict(values or {})
    fields = option_fields(options)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{owner} has no option(s) {unknown}; it accepts: {describe_options(options)}")
    hints = typing.get_type_hints(options)
    for name, value in values.items():
        if not _accepts(hints[name], value):
            raise ValueError(f"{owner} option {name}={value!r}: expected {_type_name(hints[name])}")
        if isinstance(value, list):
            values[name] = tuple(value)  # JSON gives lists; options hold tuples
    return options(**values)


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and its help text (shown by `--help` and in errors); a
    mutable default (dict, list) is copied for every instance."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})
