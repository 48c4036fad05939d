"""The engine's own stages (`solve` and `kv_quant`, `fp_reference` and `recon`, `mobiroute`), and the one explicit
call that registers every built-in piece.

Every built-in registers itself where it is defined (`@register_solver`, `@register_stage`), so registering them is
importing the modules that define them: `register_builtins` is the one list of those modules. `Recipe` calls it before
it looks a method's names up, and the command line before it lists what exists; a plug-in registers its own pieces
the same way, by being imported (docs/extending.md).
"""

from __future__ import annotations


def register_builtins() -> None:
    """Register every built-in piece (a module is imported once, so later calls cost nothing)."""
    from bitquilt import policies, solvers, transforms  # noqa: F401  (each package imports its pieces)
    from bitquilt.stages import recon, route, solve  # noqa: F401  (kv_quant, solve, fp_reference, recon, mobiroute)
