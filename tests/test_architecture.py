"""The package's floors: no module imports from a floor above its own, no import circle, and the run-time code
imports no calibration (docs/extending.md's floor table is checked against the list here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import bitquilt

ROOT = Path(bitquilt.__file__).parent
EXTENDING = ROOT.parent / "docs" / "extending.md"

# Lowest floor first. A module may import its own floor and the floors below, never above.
FLOORS = [
    {"errors", "cache", "resources", "registry", "tables", "mapped", "heap", "isa", "flag_checks", "native_build",
     "tensor_header", "tensor_writer", "progress", "__init__"},
    {"formats"},
    {"kernels"},
    {"nn"},
    {"models", "data"},
    {"runtime"},
    {"io", "export", "serve"},
    {"calib", "solvers"},
    {"transforms", "policies", "stages"},
    {"recipes", "pipeline"},
    {"eval"},
    {"api", "cli_common"},
    {"commands"},
    {"cli", "entry"},
]
RUNTIME = {"formats", "kernels", "nn", "io", "models", "runtime", "serve"}
ALGORITHMS = {"calib", "solvers", "transforms", "policies", "stages", "recipes", "pipeline"}
STANDALONE = "bitquilt.runtime.standalone"
# What the standalone runtime may import besides itself: modules that import no torch (tests/test_standalone.py
# runs it in a process without torch to check)
TORCH_FREE = {"bitquilt.errors", "bitquilt.tensor_header", "bitquilt.cache", "bitquilt.heap", "bitquilt.isa",
              "bitquilt.flag_checks", "bitquilt.resources", "bitquilt.native_build", "bitquilt.runtime",
              "bitquilt.runtime.loop", "bitquilt.runtime.tokenizer"}


def room(module: str) -> str:
    """'bitquilt.nn.online' -> 'nn'; 'bitquilt' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor(name: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if name in rooms)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def is_module(name: str) -> bool:
    """Whether the dotted name is a module or package of bitquilt (not a name defined inside one)."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def resolve(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The absolute module an ImportFrom names, relative ones (`from .x import y`) resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def dynamic_target(node: ast.Call) -> str | None:
    """The module named by `import_module("bitquilt...")` or `__import__("bitquilt...")` with a literal name."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) and value.startswith("bitquilt") else None
    return None


def imports_of(source: str, module: str, package: bool = False) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every `bitquilt` import in `source`, at any depth, relative
    imports resolved and `import_module` calls on a literal name included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node, module, package)
            if not target.startswith("bitquilt"):
                continue
            targets = [f"{target}.{a.name}" if is_module(f"{target}.{a.name}") else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("bitquilt")]
        elif isinstance(node, ast.Call) and dynamic_target(node):
            targets = [dynamic_target(node)]
        else:
            continue
        found += [(module, t, node.lineno) for t in targets]
    return found


def imports() -> list[tuple[str, str, int]]:
    """Every bitquilt import of the package (`imports_of` over each file)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += imports_of(path.read_text(), module_name(path), path.name == "__init__.py")
    return found


def test_every_room_has_a_floor():
    rooms = {room(t) for _, t, _ in imports()} | {room(s) for s, _, _ in imports()}
    unknown = [r for r in rooms if not any(r in f for f in FLOORS)]
    assert not unknown, f"add these to FLOORS: {unknown}"


def violations(found: list[tuple[str, str, int]]) -> list[str]:
    """Imports from a higher floor, and runtime rooms importing calibration or algorithm code.
    (The package's own `__init__` only names lazy attributes, so it is exempt.)"""
    bad = []
    for src, target, line in found:
        here, there = room(src), room(target)
        if here != "__init__" and (floor(there) > floor(here) or (here in RUNTIME and there in ALGORITHMS)):
            bad.append(f"{src} -> {target} (line {line})")
    return bad


def cycles(found: list[tuple[str, str, int]]) -> list[list[str]]:
    """Import circles between modules (a package counts as its `__init__`), found by depth-first search."""
    graph: dict[str, set[str]] = {}
    for src, target, _ in found:
        if src != target:
            graph.setdefault(src, set()).add(target)
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return circles


def test_no_import_goes_up_a_floor():
    bad = violations(imports())
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def test_no_import_circle():
    circles = cycles(imports())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_standalone_runtime_imports_only_torch_free_modules():
    bad = [f"{src} -> {target} (line {line})" for src, target, line in imports()
           if src.startswith(STANDALONE) and not target.startswith(STANDALONE) and target not in TORCH_FREE]
    assert not bad, "the standalone runtime imports:\n" + "\n".join(bad)


def test_the_checks_catch_forbidden_imports():
    assert violations([("bitquilt.nn.x", "bitquilt.calib.capture", 1)])  # runtime importing calibration
    assert violations([("bitquilt.io", "bitquilt.transforms.rotation", 1)])  # loading importing an algorithm
    assert violations([("bitquilt.eval.x", "bitquilt.api", 1)])  # any upward arrow
    assert not violations([("bitquilt.pipeline.x", "bitquilt.nn.online", 1)])
    relative = imports_of("from ..calib import capture\nfrom . import fused\n", "bitquilt.runtime.lean")
    assert [t for _, t, _ in relative] == ["bitquilt.calib.capture", "bitquilt.runtime.fused"]
    assert violations(relative)
    dynamic = imports_of("import importlib\nimportlib.import_module('bitquilt.solvers.gptq')\n", "bitquilt.nn.x")
    assert violations(dynamic)
    assert cycles([("a", "b", 1), ("b", "c", 1), ("c", "a", 1)]) == [["a", "b", "c", "a"]]
    assert not cycles([("a", "b", 1), ("b", "c", 1), ("a", "c", 1)])


def test_the_floor_table_in_docs_matches():
    """docs/extending.md's floor table lists the same rooms on the same floors, in order."""
    table = re.findall(r"^\| (\d+) \| ([^|]+) \|", EXTENDING.read_text(), flags=re.M)
    documented = [set(re.findall(r"`(\w+)/?`", rooms)) for _, rooms in table]
    assert [int(n) for n, _ in table] == list(range(len(FLOORS)))
    assert documented == [rooms - {"__init__"} for rooms in FLOORS]
