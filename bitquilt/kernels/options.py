"""What the kernels may do where they are called: run at all, and round activations to int8.

The options live in a context variable, set for a `with` block and restored after it, so that one caller's choice
(the CLI's `--int8-activations`, a test's reference run) never leaks into another's:

    with kernels.using(int8_activations=True):   # 4/2-bit and 8-bit linears on int8 activations (not exact)
        ...
    with kernels.using(enabled=False):           # the torch reference everywhere: the oracle of every kernel
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KernelOptions:
    enabled: bool = True  # False: every call takes the format's torch reference
    int8_activations: bool = False  # kernels that round activations to int8 (faster, not exact) may take calls


_DEFAULT = KernelOptions()
_current: ContextVar[KernelOptions] = ContextVar("bitquilt_kernel_options")


def options() -> KernelOptions:
    """The options in force here."""
    return _current.get(_DEFAULT)


@contextmanager
def using(**changes: bool) -> Iterator[KernelOptions]:
    """The current options with `changes` for the `with` block (unknown names: TypeError)."""
    token = _current.set(replace(options(), **changes))
    try:
        yield options()
    finally:
        _current.reset(token)
