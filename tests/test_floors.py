"""The product's packages stand on floors: each imports only the floors below it, and no module imports itself
back through others. ``references`` (the float64 truth) at the bottom, ``strategies`` (cases) on it, then the
kernels we ship (``flashverify_kernels``) and the report writers (``reports``, which read streams and render,
and run nothing), and ``verify`` (the suite, which uses them all) on top. Imports inside functions count: they
are imports all the same, only later."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"references": 0, "strategies": 1, "flashverify_kernels": 2, "reports": 2, "verify": 3}


def _modules() -> dict[str, Path]:
    found = {}
    for package in FLOORS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The product modules ``module`` imports (a ``from pkg import mod`` counts ``pkg`` and ``pkg.mod``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != module}
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(p, m, known) for m, p in known.items()}


def test_each_package_imports_only_the_floors_below_it():
    wrong = sorted(f"{m} imports {i}" for m, targets in _graph().items() for i in targets
                   if (a := m.split(".")[0]) != (b := i.split(".")[0]) and FLOORS[b] >= FLOORS[a])
    assert not wrong, "imports that run up or across the floors " + str(FLOORS) + ":\n  " + "\n  ".join(wrong)


def test_no_module_imports_itself_back():
    graph, cycles = _graph(), []
    index, low, stack, on = {}, {}, [], set()

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)
