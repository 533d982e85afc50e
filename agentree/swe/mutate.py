"""Source-level bug injection for generated SWE tasks (SWE-smith's procedural mutations).

`mutations(path, source)` lists every single-site mutation of one Python file, each as the
whole mutated file text. An edit touches only the characters of the mutated site (an operator
token, a literal, two argument spans, whole statement lines), so formatting elsewhere is kept
and the fix (the reverse diff) is as small as the bug. Every candidate is checked: the mutated
text must parse to exactly the syntax tree obtained by applying the same change to the tree, so
a textual edit can never mean something other than what its kind says.

Kinds (`KINDS`): operator flips (`+`/`-`, `*`/`/`, `//`/`/`, `and`/`or`, dropped `not`,
augmented assignments), comparison flips (`<`/`<=`, `==`/`!=`, `in`/`not in`, ...),
off-by-one integer literals, wrong constants (another string of the file, True/False, x10),
dropped branches (a guard `if` or an `else`/`elif` tail), dropped `return`s, and swapped
positional arguments of a call.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = (
    "operator",
    "comparison",
    "off_by_one",
    "constant",
    "drop_branch",
    "drop_return",
    "swap_args",
)

_BINOP = {
    ast.Add: (ast.Sub, "+", "-"),
    ast.Sub: (ast.Add, "-", "+"),
    ast.Mult: (ast.Div, "*", "/"),
    ast.Div: (ast.Mult, "/", "*"),
    ast.FloorDiv: (ast.Div, "//", "/"),
    ast.Mod: (ast.FloorDiv, "%", "//"),
}
_CMP = {
    ast.Lt: (ast.LtE, "<", "<="),
    ast.LtE: (ast.Lt, "<=", "<"),
    ast.Gt: (ast.GtE, ">", ">="),
    ast.GtE: (ast.Gt, ">=", ">"),
    ast.Eq: (ast.NotEq, "==", "!="),
    ast.NotEq: (ast.Eq, "!=", "=="),
    ast.In: (ast.NotIn, "in", "not in"),
    ast.NotIn: (ast.In, "not in", "in"),
    ast.Is: (ast.IsNot, "is", "is not"),
    ast.IsNot: (ast.Is, "is not", "is"),
}
_BOOL = {ast.And: (ast.Or, "and", "or"), ast.Or: (ast.And, "or", "and")}

Edit = tuple[int, int, bytes]
"""Replace bytes [start, end) of the file with the given bytes."""


@dataclass(frozen=True)
class Mutation:
    """One injected bug: the mutated text of one file."""

    path: str
    kind: str
    line: int
    """1-based line of the mutated site in the original file."""
    description: str
    """What changed, e.g. "`<` -> `<=`"."""
    source: str
    """The whole file after the mutation."""


def mutations(path: str, source: str) -> list[Mutation]:
    """Every checked single-site mutation of `source` (a Python file at `path`)."""
    tree = ast.parse(source)
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    nodes = list(_walk(tree))
    out: list[Mutation] = []
    seen: set[str] = set()
    strings = _strings(tree)
    blocks = [getattr(n, f, None) for n in ast.walk(tree) for f in ("body", "orelse")]
    sole = {id(b[0]) for b in blocks if isinstance(b, list) and len(b) == 1}
    pos = _Pos(data, starts, sole)
    for index, node in enumerate(nodes):
        for kind, desc, edits, change in _candidates(node, pos, strings):
            text = _apply(data, edits)
            if text is None or text in seen:
                continue
            expected = copy.deepcopy(tree)
            change(list(_walk(expected))[index], _parents(expected))
            if not _same_tree(text, expected):
                continue
            seen.add(text)
            out.append(Mutation(path, kind, node.lineno, desc, text))
    return out


# -- traversal -------------------------------------------------------------------------------
def _walk(tree: ast.AST) -> Iterator[ast.AST]:
    """Nodes in a fixed order, skipping docstrings, annotations and f-string internals."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        children: list[ast.AST] = []
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "type_comment", "decorator_list"):
                continue
            if isinstance(node, ast.JoinedStr):
                continue
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if not isinstance(item, ast.AST):
                    continue
                if name == "body" and i == 0 and _is_docstring(item):
                    continue
                children.append(item)
        stack.extend(reversed(children))


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _parents(tree: ast.AST) -> dict[int, tuple[ast.AST, str]]:
    """id(child) -> (parent, field name)."""
    out: dict[int, tuple[ast.AST, str]] = {}
    for node in ast.walk(tree):
        for name, value in ast.iter_fields(node):
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, ast.AST):
                    out[id(item)] = (node, name)
    return out


def _strings(tree: ast.AST) -> list[str]:
    """Distinct plain string literals of the file (outside docstrings and f-strings)."""
    found = [
        n.value
        for n in _walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value
    ]
    return list(dict.fromkeys(found))


# -- candidates ------------------------------------------------------------------------------
def _candidates(node: ast.AST, pos: _Pos, strings: list[str]) -> Iterator:
    """(kind, description, edits, change) for each mutation of `node`; `change(node, parents)`
    applies the same mutation to a copy of the tree."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
        new, old_s, new_s = _BINOP[type(node.op)]
        edit = pos.token(node.left, node.right, old_s, new_s)
        if edit:
            yield "operator", f"`{old_s}` -> `{new_s}`", [edit], _set_op(new)
    if isinstance(node, ast.AugAssign) and type(node.op) in _BINOP:
        new, old_s, new_s = _BINOP[type(node.op)]
        edit = pos.token(node.target, node.value, old_s + "=", new_s + "=")
        if edit:
            yield "operator", f"`{old_s}=` -> `{new_s}=`", [edit], _set_op(new)
    if isinstance(node, ast.BoolOp):
        new, old_s, new_s = _BOOL[type(node.op)]
        edits = [
            pos.token(a, b, old_s, new_s)
            for a, b in zip(node.values, node.values[1:], strict=False)
        ]
        if all(edits):
            yield "operator", f"`{old_s}` -> `{new_s}`", edits, _set_op(new)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        edit = (pos.start(node), pos.start(node.operand), b"")
        yield "operator", "dropped `not`", [edit], _unwrap_not
    if isinstance(node, ast.Compare):
        left = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if type(op) not in _CMP:
                continue
            new, old_s, new_s = _CMP[type(op)]
            edit = pos.token(left[i], left[i + 1], old_s, new_s)
            if edit:
                yield "comparison", f"`{old_s}` -> `{new_s}`", [edit], _set_cmp(i, new)
    if isinstance(node, ast.Constant):
        yield from _constant(node, pos, strings)
    if isinstance(node, ast.Call):
        args = node.args
        for i in range(len(args) - 1):
            a, b = args[i], args[i + 1]
            if isinstance(a, ast.Starred) or isinstance(b, ast.Starred):
                continue
            if ast.dump(a) == ast.dump(b):
                continue
            ta, tb = pos.text(a), pos.text(b)
            edits = [(pos.start(a), pos.end(a), tb), (pos.start(b), pos.end(b), ta)]
            desc = f"swapped arguments {i + 1} and {i + 2} of a call"
            yield "swap_args", desc, edits, _swap(i)
    if isinstance(node, ast.Return) and node.value is not None:
        edit = pos.drop_lines(node)
        if edit:
            yield "drop_return", "dropped a `return`", [edit], _drop_stmt
    if isinstance(node, ast.If):
        if not node.orelse:
            edit = pos.drop_lines(node)
            if edit:
                yield "drop_branch", "dropped an `if` block", [edit], _drop_stmt
        else:
            edit = pos.drop_else(node)
            if edit:
                yield "drop_branch", "dropped an `else`/`elif` branch", [edit], _drop_else


def _constant(node: ast.Constant, pos: _Pos, strings: list[str]) -> Iterator:
    v = node.value
    if isinstance(v, bool):
        yield "constant", f"`{v}` -> `{not v}`", [pos.replace(node, str(not v))], _set_value(not v)
    elif isinstance(v, int):
        if pos.text(node).decode() != str(v):  # hex, underscores: leave alone
            return
        for new in (v + 1, v - 1):
            if new >= 0:
                yield (
                    "off_by_one",
                    f"`{v}` -> `{new}`",
                    [pos.replace(node, str(new))],
                    _set_value(new),
                )
        if v >= 2:
            yield (
                "constant",
                f"`{v}` -> `{v * 10}`",
                [pos.replace(node, str(v * 10))],
                _set_value(v * 10),
            )
    elif isinstance(v, str) and v:
        raw = pos.text(node).decode()
        quote = raw[:1]
        if quote not in ("'", '"') or raw[1:2] == quote or raw[:-1].count(quote) != 1:
            return  # triple-quoted, prefixed or escaped literals
        others = [s for s in strings if s != v and re.fullmatch(r"[\w .:,/-]*", s)]
        if others:
            new = others[0]
            edit = pos.replace(node, f"{quote}{new}{quote}")
            yield "constant", f"`{raw}` -> `{quote}{new}{quote}`", [edit], _set_value(new)


# -- applying a change to a tree copy --------------------------------------------------------
def _set_op(op: type) -> object:
    def change(node: ast.AST, parents: dict) -> None:
        node.op = op()  # type: ignore[attr-defined]

    return change


def _set_cmp(i: int, op: type) -> object:
    def change(node: ast.AST, parents: dict) -> None:
        node.ops[i] = op()  # type: ignore[attr-defined]

    return change


def _set_value(value: object) -> object:
    def change(node: ast.AST, parents: dict) -> None:
        node.value = value  # type: ignore[attr-defined]

    return change


def _swap(i: int) -> object:
    def change(node: ast.AST, parents: dict) -> None:
        a = node.args  # type: ignore[attr-defined]
        a[i], a[i + 1] = a[i + 1], a[i]

    return change


def _unwrap_not(node: ast.AST, parents: dict) -> None:
    parent, name = parents[id(node)]
    value = getattr(parent, name)
    if isinstance(value, list):
        value[[id(x) for x in value].index(id(node))] = node.operand  # type: ignore[attr-defined]
    else:
        setattr(parent, name, node.operand)  # type: ignore[attr-defined]


def _drop_stmt(node: ast.AST, parents: dict) -> None:
    parent, name = parents[id(node)]
    body = getattr(parent, name)
    body[:] = [s for s in body if s is not node] or [ast.Pass()]


def _drop_else(node: ast.AST, parents: dict) -> None:
    node.orelse = []  # type: ignore[attr-defined]


# -- text edits ------------------------------------------------------------------------------
class _Pos:
    """Byte offsets of AST nodes (col_offset counts UTF-8 bytes)."""

    def __init__(self, data: bytes, starts: list[int], sole: set[int]) -> None:
        self.data, self.starts = data, starts
        self.sole = sole
        """ids of statements that are alone in their block."""

    def start(self, n: ast.AST) -> int:
        return self.starts[n.lineno - 1] + n.col_offset  # type: ignore[attr-defined]

    def end(self, n: ast.AST) -> int:
        return self.starts[n.end_lineno - 1] + n.end_col_offset  # type: ignore[attr-defined]

    def text(self, n: ast.AST) -> bytes:
        return self.data[self.start(n) : self.end(n)]

    def replace(self, n: ast.AST, new: str) -> Edit:
        return (self.start(n), self.end(n), new.encode())

    def token(self, a: ast.AST, b: ast.AST, old: str, new: str) -> Edit | None:
        """Replace the operator token `old` in the gap between nodes a and b."""
        lo, hi = self.end(a), self.start(b)
        gap = self.data[lo:hi].decode()
        core = " ".join(gap.strip(" ()\t\n\\").split())
        if core != old:
            return None
        at = gap.index(old.split()[0])
        tail = gap[at:]
        m = re.match(r"\s+".join(map(re.escape, old.split())), tail)
        if not m:
            return None
        return (lo + at, lo + at + len(m.group(0).encode()), new.encode())

    def line_span(self, first: int, last: int) -> tuple[int, int]:
        return self.starts[first - 1], self.starts[last]

    def drop_lines(self, stmt: ast.stmt) -> Edit | None:
        """Remove the statement's whole lines (only when it owns them)."""
        lo, hi = self.line_span(stmt.lineno, stmt.end_lineno or stmt.lineno)
        if self.data[lo : self.start(stmt)].strip() or self.data[self.end(stmt) : hi].strip():
            return None
        # A block emptied by the drop needs a `pass` (the tree copy gets one too).
        fill = self.data[lo : self.start(stmt)] + b"pass\n" if id(stmt) in self.sole else b""
        return (lo, hi, fill)

    def drop_else(self, node: ast.If) -> Edit | None:
        """Remove an `else:` or `elif ...:` tail through the end of the `if` statement."""
        first = node.orelse[0]
        lo_line = first.lineno
        if not (isinstance(first, ast.If) and self._line(lo_line).lstrip().startswith(b"elif")):
            lo_line -= 1
            while lo_line > node.lineno and self._line(lo_line).strip() in (b"",):
                lo_line -= 1
            if not self._line(lo_line).strip().startswith(b"else"):
                return None
        lo, hi = self.line_span(lo_line, node.end_lineno or node.lineno)
        if self.data[self.end(node) : hi].strip():
            return None
        return (lo, hi, b"")

    def _line(self, n: int) -> bytes:
        return self.data[self.starts[n - 1] : self.starts[n]]


def _apply(data: bytes, edits: list[Edit | None]) -> str | None:
    if any(e is None for e in edits):
        return None
    out = data
    for lo, hi, new in sorted(edits, key=lambda e: e[0], reverse=True):  # type: ignore[index]
        out = out[:lo] + new + out[hi:]
    return out.decode()


def _same_tree(text: str, expected: ast.AST) -> bool:
    try:
        got = ast.parse(text)
    except SyntaxError:
        return False
    return _dump(got) == _dump(expected)


def _dump(tree: ast.AST) -> str:
    return ast.dump(tree)
