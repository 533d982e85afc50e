"""The folders of `agentree` are its layers: no cycle between modules or between folders, and
no import from a lower layer to a higher one (the layers of docs/architecture.md).

A room is `agentree.X`: a folder (`agentree.run`) or a top-level module (`agentree.tree`); each
room belongs to one layer. Read with `ast` from the source files: module-level imports give the
graph (a cycle means a missing seam); function-level imports of agentree modules count too,
since a deferred import of the package itself hides an edge of that graph rather than a cost.
An import inside a function says why it is there (`# deferred: ...`): a heavy or optional
dependency (torch, transformers, vLLM, Ray, Docker, an extra) kept off the import of the
module.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

from helpers import load_benchmark

import agentree

ROOT = Path(agentree.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(["agentree", *[p for p in rel.parts if p != "__init__"]])
        if "local_suite" in name:  # SWE task repositories shipped as data
            continue
        out[name] = path
    return out


def room(module: str) -> str:
    """`agentree.run.trainer` -> `agentree.run`; `agentree.tree` -> itself."""
    return ".".join(module.split(".")[:2])


def room_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph(in_functions=True).items():
        out.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
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


def test_no_cycle_between_folders():
    """Modules may be acyclic while their folders are not (`config` -> `models` -> `config`):
    a circle between rooms means two folders each hold part of one layer."""
    assert find_cycle(room_graph()) is None


LAYERS = [
    ("contracts", ["agentree", "agentree.tree", "agentree.registry", "agentree.chat",
                   "agentree.signals", "agentree.tools", "agentree.tool_messages",
                   "agentree.prompts", "agentree.configs"]),
    ("algorithms", ["agentree.algorithms"]),
    ("envs", ["agentree.envs"]),
    ("hub", ["agentree.hub"]),
    ("engines", ["agentree.engines"]),
    ("scorers", ["agentree.scorers"]),
    ("controllers", ["agentree.rollout"]),
    ("built models", ["agentree.models", "agentree.swe"]),
    ("configuration", ["agentree.config", "agentree.policy"]),
    ("seams", ["agentree.rollouts", "agentree.learner", "agentree.distributed",
               "agentree.viewer"]),
    ("run", ["agentree.run"]),
    ("commands", ["agentree.commands", "agentree.__main__"]),
]  # fmt: skip
"""Rooms by layer, lowest first: a room imports only rooms of its own layer or below."""


def layer_of(module: str) -> int:
    found = [i for i, (_, rooms) in enumerate(LAYERS) if room(module) in rooms]
    assert found, f"{room(module)} (of {module}) is in no layer of LAYERS: add it"
    return found[0]


def test_no_import_points_up_a_layer():
    up = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
        for m, deps in sorted(graph(in_functions=True).items())
        for d in sorted(deps)
        if layer_of(d) > layer_of(m)
    ]
    assert up == []


def function_level_imports(tree: ast.Module) -> Iterator[tuple[ast.stmt, bool]]:
    """(import, whether it opens its group) for each import inside a function; a group is a run
    of import statements one after another in the same block (blank lines allowed)."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.stmt, bool]]:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            after_import = False
            for stmt in block:
                is_import = isinstance(stmt, ast.Import | ast.ImportFrom)
                if in_function and is_import:
                    yield stmt, not after_import
                after_import = is_import
        for child in ast.iter_child_nodes(node):
            inner = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            yield from visit(child, in_function or inner)

    yield from visit(tree, False)


def reason(lines: list[str], comments: dict[int, str], lineno: int) -> str:
    """The comment on line `lineno` and the block of comment lines right above it."""
    above = []
    i = lineno - 1
    while i >= 1 and lines[i - 1].lstrip().startswith("#"):
        above.insert(0, lines[i - 1].strip())
        i -= 1
    return " ".join([*above, comments.get(lineno, "")])


def test_imports_inside_functions_say_why():
    """Every import inside a function (the first of a group of them) has a comment, on the line
    above or on its own line, saying why it is deferred (`# deferred: torch takes seconds to
    import; the CLI imports this module at start`); anything else belongs at the module's top."""
    silent = []
    for name, path in sorted(modules().items()):
        source = path.read_text()
        lines = source.splitlines()
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        comments = {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}
        for stmt, first in function_level_imports(ast.parse(source)):
            if first and "deferred" not in reason(lines, comments, stmt.lineno):
                silent.append(f"{name}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}")
    assert silent == [], "imports inside functions without a `# deferred: why` comment"


def test_one_training_step_goes_down_the_layers_once():
    """benchmarks/step_walk.py on one PATR step of the embedded default's env (the tiny policy,
    so nothing is built but the model): no call goes up a layer (no callback back into the run
    or the seams) and the step enters no module beyond the 22 of docs/architecture.md's walk.
    The walk follows the env turns the turn runner plays on its worker threads."""
    step_walk = load_benchmark("step_walk")
    overrides = ["train.steps=1", "policy.path=tiny", "train.tasks_per_step=2", "eval.tasks=1"]
    out = step_walk.walk(None, overrides)
    assert out["upward_calls"] == []
    assert "MoveGame.step" in out["functions"]["agentree.envs.base"]
    assert out["count"] <= 22, out["modules"]
    assert {"agentree.config", "agentree.registry", "agentree.hub.load"}.isdisjoint(out["modules"])
