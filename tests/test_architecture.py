"""The package's floors: no module imports from a floor above its own (runtime never imports calibration)."""

from __future__ import annotations

import ast
from pathlib import Path

import bitquilt

ROOT = Path(bitquilt.__file__).parent

# Lowest floor first. A module may import its own floor and the floors below, never above.
FLOORS = [
    {"errors", "cache", "resources", "registry", "tables", "mapped", "heap", "isa", "decoding", "flag_checks",
     "__init__"},
    {"formats"},
    {"kernels"},
    {"nn"},
    {"models", "data", "standalone"},
    {"io", "export"},
    {"calib", "solvers"},
    {"transforms", "policies"},
    {"recipes", "pipeline"},
    {"eval"},
    {"api", "cli_common"},
    {"commands"},
    {"cli"},
]
RUNTIME = {"formats", "kernels", "nn", "io", "models", "standalone"}
# What the standalone runtime may import: modules that import no torch (tests/test_standalone.py runs it to check)
TORCH_FREE = {"bitquilt.errors", "bitquilt.cache", "bitquilt.heap", "bitquilt.isa", "bitquilt.decoding",
              "bitquilt.flag_checks", "bitquilt.resources", "bitquilt.models.tokenizer"}
ALGORITHMS = {"calib", "solvers", "transforms", "policies", "recipes", "pipeline"}


def room(module: str) -> str:
    """'bitquilt.nn.online' -> 'nn'; 'bitquilt' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor(name: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if name in rooms)


def _is_module(name: str) -> bool:
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


def imports() -> list[tuple[str, str, int]]:
    """(importing room, imported module, line) for every `bitquilt` import in the package, at any depth."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bitquilt"):
                targets = [node.module] if node.module != "bitquilt" else [
                    f"bitquilt.{a.name}" if _is_module(a.name) else "bitquilt" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("bitquilt")]
            else:
                continue
            found += [(room(module), t, node.lineno) for t in targets]
    return found


def test_every_room_has_a_floor():
    rooms = {room(m) for _, m, _ in imports()} | {src for src, _, _ in imports()}
    unknown = [r for r in rooms if not any(r in f for f in FLOORS)]
    assert not unknown, f"add these to FLOORS: {unknown}"


def violations(found: list[tuple[str, str, int]]) -> list[str]:
    """Imports from a higher floor, and runtime rooms importing calibration or algorithm code.
    (The package's own `__init__` only names lazy attributes, so it is exempt.)"""
    return [f"{src} -> {target} (line {line})" for src, target, line in found if src != "__init__" and (
        floor(room(target)) > floor(src) or (src in RUNTIME and room(target) in ALGORITHMS))]


def test_no_import_goes_up_a_floor():
    bad = violations(imports())
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def test_the_standalone_runtime_imports_only_torch_free_modules():
    bad = [f"{target} (line {line})" for src, target, line in imports()
           if src == "standalone" and room(target) != "standalone" and target not in TORCH_FREE]
    assert not bad, "the standalone runtime imports:\n" + "\n".join(bad)


def test_the_check_catches_forbidden_imports():
    assert violations([("nn", "bitquilt.calib.capture", 1)])  # runtime importing calibration
    assert violations([("io", "bitquilt.transforms.rotation", 1)])  # loading importing an algorithm
    assert violations([("eval", "bitquilt.api", 1)])  # any upward arrow
    assert not violations([("pipeline", "bitquilt.nn.online", 1)])
