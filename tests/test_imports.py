"""The module graph of `agentree` has no cycle, and an import inside a function is there only
to defer a heavy optional dependency, which a comment right above it names.

Read with `ast` from the source files: module-level imports give the graph (a cycle means a
missing seam); function-level imports of agentree modules count too, since a deferred import
of the package itself hides an edge of that graph rather than a cost.
"""

from __future__ import annotations

import ast
from pathlib import Path

import agentree

ROOT = Path(agentree.__file__).parent
MAPPED = {"agentree.envs": ROOT.parent / "envs", "agentree.scorers": ROOT.parent / "scorers"}


def modules() -> dict[str, Path]:
    out = {}
    roots = {"agentree": ROOT, **MAPPED}
    for pkg, base in roots.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if "local_suite" in name:  # SWE task repositories shipped as data
                continue
            out[name] = path
    return out


def imported(name: str, tree: ast.Module, known: set[str], in_functions: bool) -> set[str]:
    """agentree modules `tree` imports (at module level, or inside functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not in_functions:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = name.rsplit(".", node.level)[0]
                base = f"{pkg}.{node.module}"
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def graph(in_functions: bool) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    out = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        if not in_functions:
            tree.body = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
            tree.body += [
                n
                for c in ast.parse(path.read_text()).body
                if isinstance(c, ast.ClassDef)
                for n in c.body
                if isinstance(n, ast.Import | ast.ImportFrom)
            ]
        out[name] = imported(name, tree, known, in_functions)
    return out


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_module_level_imports_are_acyclic():
    assert find_cycle(graph(in_functions=False)) is None


def test_all_imports_of_agentree_modules_are_acyclic():
    """Deferred imports of agentree's own modules included: no hidden circle either."""
    assert find_cycle(graph(in_functions=True)) is None
