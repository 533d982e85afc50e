"""Scripted expert trajectories on generated tasks, and the warm-started tiny SWE policy.

The expert works the way a mini-swe-agent run on these tasks does, one bash command a turn, and
every command takes its arguments from text shown earlier in the conversation, so a small model
can learn it as copying rather than memorising repositories: grep the definition around the bug
(its name is in the failing tests' output), show 24 numbered lines from the line grep printed
(`cat -n PATH | tail -n +N | head -n 24`), edit the faulty line with `sed -i 'Ns|old|new|'`
using a line number from that listing (a short python script when lines were dropped), run the
tests, submit. Like a weak agent it searches: before the fix it may try wrong one-line edits
(other injected-bug mutations of the listed lines), see the tests still fail and undo each
with `git checkout`, and some trajectories give up after `WarmConfig.tries` edits and submit
unresolved, so the policy resolves some tasks but not most and RL has something to learn.
`renamed` copies make the repositories' identifiers up anew, so names and paths are copied from
the conversation rather than recalled.

Observations are computed from the task's files rather than recorded from a container: grep's
matches, the numbered listing and an edit's empty output are exact; the test run is shown as
pytest's summary line (after a wrong edit, with the task's failing tests: one that breaks more
tests shows fewer failures than the container would). `check_edit` replays every edit
command's effect in Python and drops a trajectory whose edit would not reproduce the fixed
file, and the tests replay whole trajectories in Docker through `SWEEnv`, graded.

`warm_policy` builds (once, cached by content) a tokenizer trained on the trajectories with the
command vocabulary and the literal text of the prompt templates as single tokens, a Qwen2 model
larger than the default tiny one, and fine-tunes it with `agentree.models.sft.run_sft`.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import json
import keyword
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentree.chat import ChatFormat
from agentree.envs.base import ActionFormat
from agentree.envs.swe.env import SENTINEL, SUBMIT_ACTION, SWEEnv, parse_commands
from agentree.hub.pretrained import local_policy
from agentree.hub.store import build_once, cache_root, content_key
from agentree.hub.tiny import TinyModelConfig, build_tiny_policy
from agentree.models.sft import SFTConfig, example_from_messages, run_sft, windowed_all
from agentree.prompts import load, placeholders, render
from agentree.swe.generate import fixed_files
from agentree.swe.mutate import mutations
from agentree.tools import ToolCall, call_format, tool_schemas, written_format

TEST_RUN = "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -n 3"
GREP = 'grep -rnF --include=*.py --exclude-dir=tests "'
THOUGHTS = {
    "grep": "find the definition.",
    "show": "read the code around it.",
    "sed": "fix the faulty line.",
    "python": "restore the missing logic.",
    "test": "run the tests again.",
    "undo": "the tests still fail; undo the edit.",
}
"""The expert's THOUGHT lines: fixed phrases, so names and numbers appear once, in the command,
and a weak policy has less text to garble before its bash block (renaming keeps their words)."""
WINDOW = 24
"""Lines of a file the expert shows at once (short observations, as mini-swe-agent keeps them)."""
ATOMIC = (
    GREP,
    " | tail -n +",
    " | head -n ",
    "THOUGHT:",
    "```bash\n",
    "cat -n ",
    "sed -i '",
    "python3 - <<'EOF'",
    "import pathlib",
    TEST_RUN,
    f"echo {SENTINEL}",
)
"""Command pieces that become single tokens: well-formed actions are then short sequences."""
TEMPLATES = (
    "swe/system.txt",
    "swe/instance.txt",
    "swe/generated_issue.txt",
    "swe/observation.txt",
    "swe/submitted.txt",
)


def template_pieces(min_chars: int = 12) -> list[str]:
    """The literal text between the placeholders of the SWE prompt templates.

    Each becomes one token: the fixed instructions (about 1,000 tokens of every conversation
    with a 1,024-entry BPE vocabulary) then cost a few positions, which is what makes fine-tuning
    on a few hundred trajectories affordable on two CPU cores.
    """
    mark = "\x00"
    out: list[str] = []
    for name in TEMPLATES:
        text = load(name)
        for key in placeholders(text):
            text = text.replace("{" + key + "}", mark)
        pieces = [p.rstrip() for p in text.split(mark)]
        out += [p for p in pieces if len(p.strip()) >= min_chars and p not in out]
    return out


# -- trajectories ----------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


Edit = Literal["sed", "line", "change"]
EDITS: tuple[str, ...] = get_args(Edit)
"""How the expert writes a one-line fix: `sed`, the changed words (`sed -i 'Ns|old|new|'`);
`line`, the whole new line (`sed -i 'Nc\\NEW LINE'`), which copies the listing's `N<tab>LINE`
and changes a word of it: what a pretrained model, which copies well, learns from fewer
examples; `change`, the same command after a THOUGHT that names the change first ("change
`<=` to `<` on line 13"), so a small model picks the tokens to swap before it copies the line
with them swapped."""


def fix_action(path: str, buggy: str, fixed: str, edit: str = "sed") -> str:
    """A command that turns `buggy` into `fixed`: sed for a one-line change (`s|old|new|`, or
    `s/old/new/` when the line holds a `|`; with `edit="line"` or `"change"`, `Nc\\` and the
    new line when it holds no quote or backslash), python otherwise."""
    a, b = _lines(buggy), _lines(fixed)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b).get_opcodes() if op[0] != "equal"]
    if (
        len(ops) == 1
        and ops[0][0] == "replace"
        and ops[0][2] - ops[0][1] == 1 == ops[0][4] - ops[0][3]
    ):
        _, i, _, j, _ = ops[0]
        old, new = a[i].rstrip("\n"), b[j].rstrip("\n")
        thought = change_thought(old, new, i + 1) if edit == "change" else THOUGHTS["sed"]
        if edit != "sed" and new.strip() and not set("'\\") & set(new):
            return _action(thought, f"sed -i '{i + 1}c\\{new}' {path}")
        lo, hi = _core(old, new)
        sep = next((c for c in "|/" if c not in old + new), None)
        if sep and "'" not in old[lo:] + new[lo:]:
            pat = _sed_escape(old[lo : len(old) - hi])
            rep = new[lo : len(new) - hi].replace("\\", "\\\\").replace("&", "\\&")
            command = f"sed -i '{i + 1}s{sep}{pat}{sep}{rep}{sep}' {path}"
            return _action(thought, command)
    old_text, new_text = _hunk(a, b, ops)
    script = (
        "python3 - <<'EOF'\nimport pathlib\n"
        f"p = pathlib.Path({path!r})\n"
        f"p.write_text(p.read_text().replace({old_text!r}, {new_text!r}, 1))\nEOF"
    )
    return _action(THOUGHTS["python"], script)


_TOKEN = re.compile(r"\w+|[<>=!]=|//|\*\*|\S")
"""Python-ish tokens: words, numbers, two-character operators, any other character."""


def change_thought(old: str, new: str, line: int) -> str:
    """The THOUGHT before a whole-line edit: the text it swaps and where ("change `<=` to `<`
    on line 13"). The swapped tokens are widened by whole tokens until the old text occurs
    once in the line (and a deletion or insertion names a neighbouring token)."""
    a = [m.span() for m in re.finditer(_TOKEN, old)]
    b = [m.span() for m in re.finditer(_TOKEN, new)]
    same = lambda i, j: old[slice(*a[i])] == new[slice(*b[j])]  # noqa: E731
    lo = 0
    while lo < min(len(a), len(b)) and same(lo, lo):
        lo += 1
    hi = 0
    while hi < min(len(a), len(b)) - lo and same(-1 - hi, -1 - hi):
        hi += 1

    def text(spans: list[tuple[int, int]], line_text: str) -> str:
        cut = spans[lo : len(spans) - hi]
        return line_text[cut[0][0] : cut[-1][1]] if cut else ""

    while (lo or hi) and (not text(a, old) or not text(b, new) or old.count(text(a, old)) > 1):
        if lo > 0:
            lo -= 1
        else:
            hi -= 1
    return f"change `{text(a, old)}` to `{text(b, new)}` on line {line}."


def _core(old: str, new: str) -> tuple[int, int]:
    """Lengths of the common prefix and suffix, widened to whitespace-separated words."""
    lo = 0
    while lo < min(len(old), len(new)) and old[lo] == new[lo]:
        lo += 1
    hi = 0
    while hi < min(len(old), len(new)) - lo and old[-1 - hi] == new[-1 - hi]:
        hi += 1
    while lo > 0 and not old[lo - 1].isspace():
        lo -= 1
    while hi > 0 and not old[len(old) - hi].isspace():
        hi -= 1
    if old[lo : len(old) - hi] == "":  # pure insertion: anchor on the previous character
        lo = max(lo - 1, 0)
    while old.find(old[lo : len(old) - hi]) != lo:  # sed edits the first match: make it this one
        lo -= 1
    return lo, hi


def _sed_escape(s: str) -> str:
    return re.sub(r"([\\.*\[\]^$])", r"\\\1", s)


def _hunk(a: list[str], b: list[str], ops: list) -> tuple[str, str]:
    """The smallest span of lines covering every change, with one line of context each side."""
    i0 = max(min(op[1] for op in ops) - 1, 0)
    i1 = min(max(op[2] for op in ops) + 1, len(a))
    j0 = max(min(op[3] for op in ops) - 1, 0)
    j1 = min(max(op[4] for op in ops) + 1, len(b))
    return "".join(a[i0:i1]), "".join(b[j0:j1])


def _action(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```bash\n{command}\n```"


def check_edit(command: str, buggy: str, fixed: str) -> bool:
    """Replay an edit command's effect in Python: does it turn `buggy` into `fixed`?"""
    return apply_edit(command, buggy) == fixed


def apply_edit(command: str, text: str) -> str | None:
    """The file `text` after a one-line sed edit (`Nc\\` or `Ns|old|new|`) or a python
    `replace` edit, replayed in Python; None for another command or one that cannot apply."""
    m = re.fullmatch(r"sed -i '(\d+)c\\([^'\\]*)' \S+", command)
    if m:  # GNU sed keeps the new line's leading blanks after `c\`
        n, lines = int(m.group(1)), _lines(text)
        if not 1 <= n <= len(lines):
            return None
        lines[n - 1] = m.group(2) + "\n"
        return "".join(lines)
    part = r"((?:(?!\2)[^\\]|\\.)*)"
    m = re.fullmatch(rf"sed -i '(\d+)s([/|]){part}\2{part}\2' \S+", command)
    if m:
        n, pat, rep = int(m.group(1)), m.group(3), m.group(4)
        lines = _lines(text)
        if not 1 <= n <= len(lines):  # a policy's edit can name any line
            return None
        body = lines[n - 1].rstrip("\n")
        rep_py = rep.replace("\\&", "\0").replace("\\\\", "\\").replace("\0", "&")
        # the pattern is a sed basic regex whose only escapes are literal characters
        literal = re.sub(r"\\(.)", r"\1", pat)
        if literal not in body:
            return None
        lines[n - 1] = body.replace(literal, rep_py, 1) + "\n"
        return "".join(lines)
    m = re.search(r"replace\((.*), 1\)\)\nEOF$", command, re.S)
    if m:
        try:
            old, new = ast.literal_eval(f"({m.group(1)})")
        except (ValueError, SyntaxError, TypeError):  # a policy's garbled edit
            return None
        if isinstance(old, str) and isinstance(new, str) and old in text:
            return text.replace(old, new, 1)
    return None


def _source_file(record: dict[str, Any]) -> str:
    return record["mutation"]["file"]


def _files(record: dict[str, Any]) -> tuple[str, str]:
    """(buggy, fixed) text of the mutated file of a generated record."""
    slug = record["repo"].split("/", 1)[1]
    path = _source_file(record)
    fixed = fixed_files(slug)[path].decode()
    patch = record["patch"]
    buggy = _reverse_apply(fixed, patch, path)
    return buggy, fixed


def _reverse_apply(fixed: str, patch: str, path: str) -> str:
    """Undo the gold fix on the fixed text (git apply -R in a scratch directory)."""
    with tempfile.TemporaryDirectory(prefix="agentree-expert-") as tmp:
        target = Path(tmp, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(fixed)
        Path(tmp, "fix.patch").write_text(patch)
        subprocess.run(
            ["git", "apply", "-R", "fix.patch"], cwd=tmp, check=True, capture_output=True
        )
        return target.read_text()


def _anchor(buggy: str, line: int) -> tuple[str, int]:
    """The definition the buggy line belongs to: (text to grep for, its line number).

    The innermost function or class around `line`, else the top-level statement (a module
    constant's `NAME =`); the expert greps for it, so the file path and the line numbers it
    uses next are copied from the output of its own commands.
    """
    tree = ast.parse(buggy)
    best: tuple[str, int] | None = None
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if end is None or not node.lineno <= line <= end:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            word = "class" if isinstance(node, ast.ClassDef) else "def"
            if best is None or node.lineno >= best[1]:
                best = (f"{word} {node.name}", node.lineno)
    if best is not None:
        return best
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                return f"{node.targets[0].id} =", node.lineno
            return _lines(buggy)[node.lineno - 1].strip()[:30], node.lineno
    return _lines(buggy)[line - 1].strip()[:30], line


def _changed_line(buggy: str, fixed: str) -> int:
    """The first line of `buggy` the fix changes (for dropped lines, the one before the gap)."""
    a, b = _lines(buggy), _lines(fixed)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b).get_opcodes() if op[0] != "equal"]
    i1, i2 = ops[0][1], ops[0][2]
    return min(i1 + 1 if i2 > i1 else i1, len(a)) or 1


def _window(buggy: str, start: int, line: int) -> tuple[int, str]:
    """(first line, `cat -n` text) of the WINDOW lines from `start`, moved to show `line`."""
    lines = _lines(buggy)
    first = start if line < start + WINDOW else line - WINDOW // 2
    shown = lines[first - 1 : first - 1 + WINDOW]
    return first, "".join(f"{i:6d}\t{text}" for i, text in enumerate(shown, first))


def _misses(
    path: str,
    buggy: str,
    fixed: str,
    window: range,
    n: int,
    rng: random.Random,
    edit: str,
    line: int,
) -> list[str]:
    """`n` wrong one-line edits on lines of `window`: injected-bug mutations of the buggy file
    (`agentree.swe.mutate`), the same kinds of change as the fix, at other sites. With whole-line
    edits they are changes of the faulty `line` itself where it has any: the expert knows where
    the bug is and searches for the change."""
    by_line: dict[int, list[str]] = {}
    for m in mutations(path, buggy):
        if m.source == fixed or m.line not in window or m.kind.startswith("drop"):
            continue
        action = fix_action(path, buggy, m.source, edit)
        if parse_commands(action)[0].startswith("sed -i"):
            by_line.setdefault(m.line, []).append(action)
    if edit != "sed" and line in by_line:
        out = by_line[line]
    else:
        out = [a for actions in by_line.values() for a in actions]
    rng.shuffle(out)
    return out[:n]


def trajectory(
    record: dict[str, Any],
    step_limit: int = 50,
    *,
    misses: int = 0,
    give_up: bool = False,
    rng: random.Random | None = None,
    edit: str = "sed",
) -> list[dict[str, str]] | None:
    """The expert's conversation on a generated task (None when its edit cannot be checked).

    grep for the definition around the bug, show it (`cat -n | tail | head`), edit, run the
    tests, submit: each command's path and line numbers appear in an earlier observation.
    Before the fix come `misses` wrong one-line edits on lines of the listing, each tested
    (the tests fail) and undone with `git checkout` (with whole-line edits, changes of the faulty
    line itself, each rewritten by the next edit); with `give_up` the expert submits after
    them without fixing anything, so the policy resolves some tasks but not all. `edit` is how
    one-line edits are written (`EDITS`).
    """
    rng = rng or random.Random(0)
    path = _source_file(record)
    buggy, fixed = _files(record)
    fix = fix_action(path, buggy, fixed, edit)
    command = fix.split("```bash\n", 1)[1].rsplit("\n```", 1)[0]
    if not check_edit(command, buggy, fixed):
        return None
    line = _changed_line(buggy, fixed)
    anchor, start = _anchor(buggy, line)
    first, shown = _window(buggy, start, line)
    f2p = json.loads(record["FAIL_TO_PASS"])
    tests = len(f2p) + len(json.loads(record["PASS_TO_PASS"]))
    hits = _grep(record, buggy, anchor)
    first_prompt = render(
        "swe/instance.txt",
        problem_statement=record["problem_statement"].strip(),
        workdir="/testbed",
        step_limit=step_limit,
        sentinel=SENTINEL,
    )
    quoted = anchor.replace('"', '\\"')
    steps = [
        (_action(THOUGHTS["grep"], f'{GREP}{quoted}" *'), hits),
        (_action(THOUGHTS["show"], _show(path, first)), shown),
    ]
    window = range(first, first + WINDOW)
    wrong = _misses(path, buggy, fixed, window, misses, rng, edit, line) if misses else []
    rewrite = f"sed -i '{line}c\\"
    for k, miss in enumerate(wrong):
        steps += [(miss, ""), (_action(THOUGHTS["test"], TEST_RUN), _pytest_tail(tests, f2p))]
        # a whole-line edit of the faulty line is rewritten by the next one: nothing to undo
        same_line = rewrite in miss and rewrite in fix
        if (k + 1 < len(wrong) or not give_up) and not same_line:
            steps.append((_action(THOUGHTS["undo"], _undo(path)), ""))
    if not (give_up and wrong):
        steps += [(fix, ""), (_action(THOUGHTS["test"], TEST_RUN), _pytest_tail(tests))]
    msgs = [{"role": "user", "content": first_prompt}]
    for action, output in steps:
        msgs.append({"role": "assistant", "content": action})
        # every command exits 0: grep matches, and a test run's status is `tail`'s
        msgs.append(
            {"role": "user", "content": render("swe/observation.txt", returncode=0, output=output)}
        )
    msgs.append({"role": "assistant", "content": SUBMIT_ACTION})
    return msgs


def _undo(path: str) -> str:
    return f"git checkout -q -- {path}"


def _grep(record: dict[str, Any], buggy: str, anchor: str) -> str:
    """What the expert's grep prints: matching lines of the repository's non-test sources."""
    files = {p: b.decode() for p, b in fixed_files(record["repo"].split("/", 1)[1]).items()}
    files[_source_file(record)] = buggy
    out = []
    for p in sorted(files):
        if not p.endswith(".py") or p.startswith("tests/") or "/tests/" in p:
            continue
        out += [f"{p}:{i}:{t.rstrip()}" for i, t in enumerate(_lines(files[p]), 1) if anchor in t]
    return "".join(x + "\n" for x in out)


def _show(path: str, first: int) -> str:
    return f"cat -n {path} | tail -n +{first} | head -n {WINDOW}"


def _pytest_tail(tests: int, failing: Sequence[str] = ()) -> str:
    """What `pytest -q | tail -n 3` prints when all `tests` pass, or the `failing` ones fail
    (the duration varies; a failure's message is left out)."""
    if failing:
        passed = tests - len(failing)
        return f"FAILED {failing[-1]}\n{len(failing)} failed, {passed} passed in 0.05s\n"
    return f"{'.' * tests}{'[100%]':>{80 - tests}}\n{tests} passed in 0.05s\n"


# -- renamed copies --------------------------------------------------------------------------
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
"""Pieces of made-up identifiers (70 of them: a small model learns to copy them, not know them)."""


def repo_names(repo: str) -> list[str]:
    """The identifiers a repository defines (modules, packages, functions, classes, their
    parameters and module-level names) that a renamed copy of its conversations replaces.

    Python's keywords and builtins, the methods of builtin types (a repository's `get` would
    otherwise rename `dict.get` too) and every word of the prompt templates and the expert's
    commands are kept, so the scaffold around the names stays what the policy sees in use.
    """
    keep = set(keyword.kwlist) | set(dir(builtins))
    keep |= {n for t in (str, list, dict, set, tuple, int, float, bytes) for n in dir(t)}
    keep |= {"self", "cls"}
    scaffold = " ".join([*ATOMIC, *template_pieces(0), TEST_RUN, *THOUGHTS.values(), SUBMIT_ACTION])
    keep |= set(re.findall(r"\w+", scaffold))
    names: set[str] = set()
    for path, data in fixed_files(repo.split("/", 1)[1]).items():
        if not path.endswith(".py"):
            continue
        names.update(Path(path).with_suffix("").parts)
        for node in ast.walk(ast.parse(data.decode())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return sorted(n for n in names if len(n) >= 3 and n not in keep and not n.startswith("__"))


def made_up_name(name: str, rng: random.Random) -> str:
    """A made-up identifier of the same shape as `name` (snake_case parts, CamelCase, case)."""

    def word() -> str:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))

    if name[:1].isupper() and not name.isupper():
        parts = re.findall(r"[A-Z][a-z0-9]*", name) or [name]
        return "".join(word().capitalize() for _ in parts)
    parts = name.strip("_").split("_")
    out = "_".join(word() for _ in parts)
    out = "_" * (len(name) - len(name.lstrip("_"))) + out
    return out.upper() if name.isupper() else out


def rename_table(names: Sequence[str], rng: random.Random) -> dict[str, str]:
    """A made-up identifier for each of `names`, all distinct and none a name of the repo."""
    table: dict[str, str] = {}
    taken = set(names)
    for n in names:
        new = made_up_name(n, rng)
        while new in taken:
            new = made_up_name(n, rng)
        taken.add(new)
        table[n] = new
    return table


def apply_renames(text: str, table: dict[str, str]) -> str:
    """`text` with each key of `table` replaced wherever it stands as a whole word."""
    if not table:
        return text
    pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, table)) + r")(?!\w)")
    return pattern.sub(lambda g: table[g.group(1)], text)


def renamed(
    conv: list[dict[str, str]], names: Sequence[str], rng: random.Random
) -> list[dict[str, str]]:
    """The conversation with the repository's `names` made up anew, consistently in the problem
    statement, the outputs and the commands (every edit still applies to the listing shown)."""
    table = rename_table(names, rng)
    return [{**m, "content": apply_renames(m["content"], table)} for m in conv]


def conversations(
    records: Sequence[dict[str, Any]],
    per_task: int = 1,
    tries: int = 1,
    seed: int = 0,
    renamed_copies: int = 0,
    edit: str = "sed",
) -> list[list[dict[str, str]]]:
    """`per_task` expert conversations per record, plus `renamed_copies` of each with the
    repository's identifiers made up anew (`renamed`).

    Each conversation draws how many wrong edits come first, uniformly from 0 to `tries`: at
    `tries` the expert gives up after them and submits (so `tries` = 1 never misses).
    """
    rng = random.Random(seed)
    names = {r["repo"]: repo_names(r["repo"]) for r in records} if renamed_copies else {}
    out = []
    for r in records:
        for _ in range(per_task):
            m = rng.randint(0, tries) if tries > 1 else 0
            t = trajectory(r, misses=m, give_up=m == tries, rng=rng, edit=edit)
            if t is not None:
                out.append(t)
                out += [renamed(t, names[r["repo"]], rng) for _ in range(renamed_copies)]
    return out


def write_trajectories(
    records: Sequence[dict[str, Any]], output: Path, cfg: WarmConfig | None = None
) -> tuple[int, int]:
    """Chat JSONL of the expert on `records` (as `warm_policy` sees them); returns (written,
    tasks skipped)."""
    cfg = cfg or WarmConfig()
    rows = _conversations(records, cfg)
    output.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return len(rows), len(records) - len(rows) // (cfg.per_task * (1 + cfg.renamed_copies))


def _conversations(
    records: Sequence[dict[str, Any]], cfg: WarmConfig
) -> list[list[dict[str, Any]]]:
    convs = conversations(records, cfg.per_task, cfg.tries, cfg.seed, cfg.renamed_copies, cfg.edit)
    return [tool_form(c) for c in convs] if cfg.action_format == "tools" else convs


def tool_form(messages: Sequence[dict[str, Any]], step_limit: int = 50) -> list[dict[str, Any]]:
    """An expert conversation as SWEEnv's tool mode plays it: the tool-mode task prompt, each
    command an `execute_bash` call (the submit command a `submit` call) after the THOUGHT,
    each output a `tool` message answering it."""
    issue = re.search(r"<issue>\n(.*)\n</issue>", messages[0]["content"], re.S)
    if issue is None:
        raise ValueError("the conversation does not open with the SWE task prompt")
    first = render(
        "swe/instance_tools.txt",
        problem_statement=issue.group(1),
        workdir="/testbed",
        step_limit=step_limit,
    )
    out: list[dict[str, Any]] = [{"role": "user", "content": first}]
    call_id = ""
    for i, m in enumerate(messages[1:]):
        if m["role"] != "assistant":
            out.append({"role": "tool", "tool_call_id": call_id, "content": m["content"]})
            continue
        (command,) = parse_commands(m["content"])
        thought = m["content"].split("```", 1)[0].strip()
        submit = command.strip() == f"echo {SENTINEL}"
        call = ToolCall("submit") if submit else ToolCall("execute_bash", {"command": command})
        call_id = f"call_{i}"
        call = ToolCall(call.name, call.arguments, call_id)
        out.append({"role": "assistant", "content": thought, "tool_calls": [call.to_openai()]})
    return out


def expert_policy(
    records: Sequence[dict[str, Any]], misses: int = 0, edit: str = "sed"
) -> Callable[[Any, Sequence[tuple[str, str]]], str]:
    """A scripted policy replaying the expert's actions (for checking them in Docker)."""
    by_id = {r["instance_id"]: r for r in records}

    def act(task: Any, history: Sequence[tuple[str, str]]) -> str:
        msgs = trajectory(by_id[task.id], misses=misses, edit=edit) or []
        actions = [m["content"] for m in msgs if m["role"] == "assistant"]
        return actions[min(len(history), len(actions) - 1)]

    return act


# -- the warm policy -------------------------------------------------------------------------
class WarmConfig(BaseModel):
    """The warm-started SWE policy: tokenizer, model shape and fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    model: TinyModelConfig = Field(
        default_factory=lambda: TinyModelConfig(
            vocab_size=1024,
            min_frequency=2,
            hidden_size=192,
            num_layers=3,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=768,
        )
    )
    """Tokenizer and model shape: a BPE vocabulary trained on the trajectories (keeps
    identifiers and operators whole) and a model wider and deeper than the default tiny one."""
    per_task: int = Field(1, ge=1)
    """Expert trajectories per task, each with its own draw of wrong edits."""
    tries: int = Field(3, ge=1)
    """Most edits the expert tries on a task (`conversations`): wrong ones are tested and
    undone, and a quarter of the trajectories (at 3) give up and submit unresolved, so the
    policy learns to search by editing and testing, and RL has something to learn."""
    renamed_copies: int = Field(3, ge=0)
    """Copies of each expert conversation with the repository's identifiers made up anew
    (`renamed`): held-out files name functions the policy never saw, so it has to copy names
    from the conversation rather than recall them."""
    max_trajectories: int = Field(1000, ge=1)
    """Expert trajectories fine-tuned on (a seeded sample of them; a CPU-time budget)."""
    epochs: int = Field(3, ge=1)
    """Passes over the expert trajectories."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (a randomly initialised model needs a large one)."""
    batch_size: int = Field(4, ge=1)
    """Trajectories per optimiser step."""
    micro_batch_size: int = Field(0, ge=0)
    """Trajectories forwarded together in a step (`SFTConfig.micro_batch_size`; 0: all)."""
    seed: int = 0
    """Seed of the weights and the example order."""
    base: str = "tiny"
    """The model fine-tuned: `tiny` (a tokenizer and model built from the trajectories, the
    shape above), or any `--policy` value such as `smollm2-135m` or a checkpoint directory."""
    max_length: int = Field(4096, ge=64)
    """Tokens of a trajectory kept for fine-tuning (longer ones are cut at the end); the
    token budget that makes a real model's fine-tune fit a CPU."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank for a real base model (merged into the saved weights); 0 trains all weights."""
    edit: Edit = "sed"
    """How the expert writes one-line edits (`EDITS`); kept in the checkpoint
    (`WARM_CONFIG`) so the per-turn match compares the policy with the expert it learned."""
    action_format: ActionFormat = "text"
    """text: bash blocks; tools: the same commands as `execute_bash` calls and `submit`
    (`tool_form`), for SWEEnv's tool mode."""
    tool_format: str = "hermes"
    """With `action_format: tools`, the format the calls are written in (`policy.tool_format`
    of the runs that will use the policy: hermes, llama3_json, pythonic, qwen3_coder, mistral,
    mistral_json)."""
    history: int | None = Field(None, ge=1)
    """The window k of `engine.history: last:k` the policy will roll out with: each trajectory
    is then trained turn by turn as the rollouts show it (`agentree.models.sft.windowed`: the
    task, the last k turns as context, the turn's answer); None: whole trajectories."""

    @field_validator("tool_format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        call_format(name)  # an unknown name fails here, naming the known ones
        return name


WARM_CONFIG = "swe_warm.json"
"""The `WarmConfig` a warm SWE policy was made with, saved in its checkpoint directory."""


def edit_style(policy: str | Path) -> str:
    """How the expert a warm policy learned from wrote its edits (`sed` when not recorded)."""
    saved = Path(policy) / WARM_CONFIG
    return WarmConfig.model_validate_json(saved.read_text()).edit if saved.is_file() else "sed"


TRAINED_TOKENS_PER_S = 250.0
"""Trained tokens per second of SmolLM2-135M (fp32, full fine-tune, 2 quiet CPU cores, one
trajectory per forward): 250 measured on the 176 SWE train trajectories cut at 2048 tokens
(298k tokens in 1,194 s); earlier runs of the same recipe measured 104. The estimate printed
before a real model's fine-tune starts."""


def warm_policy(
    records: Sequence[dict[str, Any]],
    cfg: WarmConfig | None = None,
    *,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) the SWE policy fine-tuned on the expert's trajectories: the tiny one
    built from them, or `cfg.base` (a real model)."""
    cfg = cfg or WarmConfig()
    convs = _conversations(records, cfg)
    if not convs:
        raise ValueError("no expert trajectory could be made from these tasks")
    if len(convs) > cfg.max_trajectories:
        convs = random.Random(cfg.seed).sample(convs, cfg.max_trajectories)
    # a setting at its default stays out of the key when it was added after builds were cached
    fmt = written_format(cfg.tool_format)
    late = {
        "action_format": cfg.action_format == "text",
        "history": cfg.history is None,
        "tool_format": fmt.name == "hermes" or cfg.action_format == "text",
    }
    dumped = cfg.model_dump(exclude={k for k, default in late.items() if default})
    key = content_key({"convs": convs, "cfg": dumped, "v": 3})
    target = out_dir or cache_root() / "swe-warm" / key
    if (target / "config.json").exists():
        return target
    env = SWEEnv(action_format=cfg.action_format)
    system, tools = env.system_prompt, tool_schemas(env.tools())
    env.close()
    examples = windowed_all(convs, cfg.history)
    if cfg.base != "tiny":
        return _warm_real_model(examples, cfg, system, target, log, tools)
    corpus = [system, "system\nuser\nassistant\n"] + [m["content"] for c in convs for m in c]
    if tools:  # the generic tools rendering and the calls as the policy writes them
        assert fmt.generic_prompt is not None
        chat_text = [json.dumps(t) for t in tools] + [load(fmt.generic_prompt)]
        written = [c["function"] for cv in convs for m in cv for c in m.get("tool_calls", [])]
        if fmt.name == "hermes":  # as every build before other formats wrote it
            calls = [json.dumps(c) for c in written]
        else:
            calls = [
                fmt.format([ToolCall(c["name"], json.loads(c["arguments"] or "{}"))])
                for c in written
            ]
        corpus += chat_text + calls
    shape = cfg.model.model_copy(update={"seed": cfg.seed})

    def write(tmp: Path) -> None:
        atomic = (*ATOMIC, *template_pieces())
        base = build_tiny_policy(corpus, shape, atomic, out_dir=tmp / "base", log=log)
        sft = SFTConfig(epochs=cfg.epochs, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed)
        run_sft(
            base,
            examples,
            tmp,
            sft,
            system=system,
            tools=tools,
            log=log,
            state_dir=_sft_state(target),
            tool_format=cfg.tool_format,
            action_format=cfg.action_format,
        )
        shutil.rmtree(tmp / "base")
        (tmp / WARM_CONFIG).write_text(cfg.model_dump_json(indent=1))

    return build_once(
        target,
        write,
        what=f"SWE warm policy ({len(convs)} trajectories{_shown(cfg)}, {cfg.epochs} epochs)",
        expected="about 20 min on 2 CPU cores",
        log=log,
    )


def _shown(cfg: WarmConfig) -> str:
    return "" if cfg.history is None else f" turn by turn, each with the last {cfg.history}"


def _warm_real_model(
    convs: list[list[dict[str, Any]]],
    cfg: WarmConfig,
    system: str,
    target: Path,
    log: Callable[[str], None],
    tools: list[dict[str, Any]] | None = None,
) -> Path:
    """Fine-tune a pretrained model on the trajectories, saying beforehand how many tokens that
    is and about how long it takes on a CPU."""
    # deferred: transformers takes seconds to import; the CLI imports this module at start
    from transformers import AutoTokenizer

    base = local_policy(cfg.base, log)
    chat = ChatFormat(AutoTokenizer.from_pretrained(base), cfg.tool_format)
    lengths = [len(example_from_messages(chat, c, system, tools).token_ids) for c in convs]
    tokens = sum(min(n, cfg.max_length) for n in lengths) * cfg.epochs
    cut = sum(n > cfg.max_length for n in lengths)
    minutes = tokens / TRAINED_TOKENS_PER_S / 60
    log(
        f"{len(convs)} examples{_shown(cfg)}, {tokens} tokens to train over {cfg.epochs} epoch(s) "
        f"({cut} cut at {cfg.max_length} tokens): about {minutes:.0f} min for a 135M model on "
        "2 quiet CPU cores (full fine-tune; scale by model size, less on a GPU)"
    )
    sft = SFTConfig(
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size,
        seed=cfg.seed,
        max_length=cfg.max_length,
        lora_r=cfg.lora_r,
    )

    def write(tmp: Path) -> None:
        run_sft(
            base,
            convs,
            tmp,
            sft,
            system=system,
            tools=tools,
            log=log,
            state_dir=_sft_state(target),
            tool_format=cfg.tool_format,
            action_format=cfg.action_format,
        )
        (tmp / WARM_CONFIG).write_text(cfg.model_dump_json(indent=1))

    return build_once(
        target,
        write,
        what=f"SWE warm policy ({cfg.base} on {len(convs)} trajectories)",
        expected=f"about {minutes:.0f} min",
        log=log,
    )


def _sft_state(target: Path) -> Path:
    """Where the fine-tune of `target` keeps its resumable state: beside the build, which
    removes its partial directory when interrupted."""
    return target.with_name(target.name + ".sft-state")


STAGES = ("grep", "show", "edit_line", "swap", "fix", "submit")
"""How far an episode gets along the expert's path (`episode_stages`)."""


def episode_stages(record: dict[str, Any], commands: Sequence[str]) -> dict[str, bool]:
    """Which of the expert's steps an episode's `commands` (in order) contain: `grep`, a grep
    for the definition around the bug (the expert's anchor); `show`, a `cat -n` of the buggy
    file; `edit_line`, a `sed -i` (`s` or `c`) at the changed line of that file; `swap`, such
    an edit that makes the file one of the buggy file's injected-bug mutations (an operator,
    a comparison, a literal, two arguments swapped: a step of the expert's search, as against
    rewriting the line), or the fix; `fix`, an edit that turns the buggy file into the fixed
    one (`apply_edit`); `submit`, the submission. Tells where a policy's episodes break when
    none resolves."""
    path = _source_file(record)
    buggy, fixed = _files(record)
    line = _changed_line(buggy, fixed)
    anchor, _ = _anchor(buggy, line)
    seen = dict.fromkeys(STAGES, False)
    mutated: set[str] | None = None  # listed at the first edit of the line
    for c in commands:
        seen["grep"] |= c.startswith("grep") and anchor in c.replace('\\"', '"')
        seen["show"] |= c.startswith("cat -n") and path in c.split()
        m = re.match(r"sed -i '(\d+)[sc]", c)
        at_line = bool(m) and int(m.group(1)) == line and c.endswith(f" {path}")
        seen["edit_line"] |= at_line
        after = apply_edit(c, buggy)
        fix = after == fixed
        if at_line and not fix and mutated is None:
            mutated = {mutant.source for mutant in mutations(path, buggy)}
        seen["swap"] |= fix or (at_line and after in (mutated or ()))
        seen["fix"] |= fix
        seen["submit"] |= SENTINEL in c
    return seen


TURNS = ("grep", "show", "edit", "test", "submit")
"""The expert's turns on a task when it makes no wrong edit (what `turn_match` reports)."""


def _answers(
    policy: str | Path,
    records: Sequence[dict[str, Any]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> Iterator[tuple[int, list[str], list[str]]]:
    """(turn, the policy's commands, the expert's) at every turn of the expert's conversation
    on each task, the expert's earlier actions and observations as the policy's context."""
    # deferred: torch (and agentree.engines.hf, which imports it) take seconds to import; the
    # CLI imports this module at start
    import torch

    from agentree.hub.load import load_policy

    model, tokenizer = load_policy(policy)
    chat = ChatFormat(tokenizer)
    env = SWEEnv()
    system = env.system_prompt
    env.close()
    torch.manual_seed(seed)
    edit = edit_style(policy)
    for record in records:
        conv = trajectory(record, edit=edit)
        if conv is None:
            continue
        ids = chat.prompt_ids(conv[0]["content"], system)
        for k in range(1, len(conv), 2):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=list(chat.stop_token_ids),
                    pad_token_id=tokenizer.pad_token_id,
                )
            action = chat.decode_action(out[0, len(ids) :].tolist())
            yield k // 2, parse_commands(action), parse_commands(conv[k]["content"])
            expert_ids = [*chat.encode(conv[k]["content"]), chat.end_of_turn_id]
            ids = ids + expert_ids
            if k + 1 < len(conv):
                ids += chat.observation_ids(conv[k + 1]["content"], expert_ids)


def well_formed_rate(
    policy: str | Path,
    records: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int = 160,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[float, int]:
    """(share of sampled actions holding exactly one bash block, actions sampled).

    The policy answers at every turn of the expert's conversation on each task (the expert's
    earlier actions and observations as its context), so the format is measured on held-out
    tasks in seconds, without containers; `benchmarks/swe_warm_policy.py` measures it on the
    policy's own episodes in Docker.
    """
    good = total = 0
    for _, commands, _ in _answers(policy, records, max_new_tokens, temperature, seed):
        good += len(commands) == 1
        total += 1
    return good / max(total, 1), total


def turn_match(
    policy: str | Path, records: Sequence[dict[str, Any]], *, max_new_tokens: int = 160
) -> dict[str, tuple[int, int]]:
    """Per turn of the expert's episode (`TURNS`): (greedy answers exactly the expert's command,
    turns asked). Tells copying from recall: the grep must name the function in the task's
    traceback and the listing must copy grep's path and line."""
    out = {t: (0, 0) for t in TURNS}
    for turn, commands, wanted in _answers(policy, records, max_new_tokens, 0.0, 0):
        name = TURNS[min(turn, len(TURNS) - 1)]
        hit, n = out[name]
        out[name] = (hit + (commands == wanted), n + 1)
    return out
