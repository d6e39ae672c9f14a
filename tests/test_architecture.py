"""The package's layers, read from its source: who may import whom, and what stays small.

fzero's folders are floors (fzero/_core/__init__.py and its siblings state each floor's
contract): a module imports only its own package and the floors below it, other private
packages only through their faces, and nothing imports in a cycle, counting imports
inside functions and under `TYPE_CHECKING`. A face (an `__init__.py` of re-exports only)
is resolved to the module that defines each name it re-exports, so it hides no edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fzero"

# Lowest first; a module may import its own package and any package on a lower floor.
FLOORS: list[set[str]] = [
    {"_core"},
    {"_comm"},
    {"optim"},
    {"_engine"},
    {"_state"},
    {"_step"},
    {"checkpoint"},
    {"_tools"},
    {"", "__main__", "init", "units", "testing"},  # the public faces
]
PRIVATE = {"_core", "_comm", "_engine", "_state", "_step", "_tools"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["fzero", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(mod: str) -> str:
    """The top-level entry a module belongs to ("" for fzero/__init__.py)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(mod: str) -> int:
    return next(i for i, f in enumerate(FLOORS) if _package(mod) in f)


def _is_face(mod: str) -> bool:
    path = MODULES[mod]
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(s, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign)) for s in body
    )


def _absolute(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if MODULES[mod].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _raw_imports(mod: str) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for every import of fzero in `mod`."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "fzero"]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(mod, node)
            if base.split(".")[0] == "fzero":
                out += [(base, a.name) for a in node.names]
    return out


def _defining(base: str, name: str | None) -> str:
    """The module that `from base import name` really depends on, through faces."""
    if name is not None and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    if name is not None and base in MODULES and _is_face(base):
        for node in ast.parse(MODULES[base].read_text()).body:
            if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names
            ):
                source = _absolute(base, node)
                real = next(a.name for a in node.names if (a.asname or a.name) == name)
                return _defining(source, real)
    return base


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod in MODULES:
        targets = {_defining(b, n) for b, n in _raw_imports(mod)}
        edges[mod] = {t for t in targets if t in MODULES and t != mod and not _is_face(t)}
    return edges


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a higher floor, or of another package on the same floor (the public
    faces, all on the top floor, may import one another)."""
    top = len(FLOORS) - 1
    return [
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, targets in edges.items()
        for t in targets
        if _floor(t) > _floor(m) or (_floor(t) == _floor(m) != top and _package(t) != _package(m))
    ]


@pytest.mark.slow
def test_every_module_imports_only_its_own_floor_or_below() -> None:
    wrong = _upward(_edges())
    assert not wrong, "\n".join(wrong)


def test_private_packages_are_entered_through_their_faces() -> None:
    wrong = []
    for mod in MODULES:
        for base, name in _raw_imports(mod):
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base
            pkg = _package(target)
            inner = target.count(".") >= 2
            if pkg in PRIVATE and pkg != _package(mod) and inner:
                wrong.append(f"{mod} imports {target}, not fzero.{pkg}")
    assert not wrong, "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return cycles


@pytest.mark.slow
def test_no_import_cycles() -> None:
    assert not _cycles(_edges())


@pytest.mark.slow
def test_the_checks_see_a_planted_back_arrow_and_cycle() -> None:
    # Neither check is vacuous: one import from the core up into the step's body fails
    # the floors, and one back from the tree to the layout closes a cycle.
    edges = _edges()
    assert "fzero._core._tree" in edges["fzero._core._layout"]
    body = "fzero._step._body"
    planted = {**edges, "fzero._core._tree": {body}}
    assert _upward(planted) == [f"fzero._core._tree (floor 0) imports {body} (floor 5)"]
    planted = {**edges, "fzero._core._tree": {"fzero._core._layout"}}
    assert ["fzero._core._layout", "fzero._core._tree"] in _cycles(planted)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_module_is_longer_than_the_limit(mod: str) -> None:
    lines = MODULES[mod].read_text().count("\n")
    assert lines <= MAX_LINES, f"{mod}: {lines} lines (limit {MAX_LINES})"


def test_stage_numbers_appear_only_in_the_stage_table() -> None:
    # Code asks a `Stage` what it does (`stage.shards_params`, `stage.reduce`), never
    # which number it has: a comparison of a stage with 0-3 is a branch on the number.
    wrong = []
    for mod, path in MODULES.items():
        if mod == "fzero._core._stages":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            numbers = [s for s in sides if _is_stage_number(s)]
            named = [s for s in sides if "stage" in ast.unparse(s)]
            if numbers and named:
                wrong.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def _is_stage_number(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) is int and node.value in (0, 1, 2, 3)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_stage_number(e) for e in node.elts)
    return False
