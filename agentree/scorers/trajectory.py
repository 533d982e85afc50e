"""Reading a partial trajectory the way the SWE scorers need it (PATR appendix B).

Turns a branch (root-to-leaf nodes) into `StepView`s: the bash command inside each action, the
tool types it uses (search, read, edit, test, run, finish), and what its observation says (exit
code, test outcome, traceback, discovered code). The heuristic scores these, the judge shows
them to the LLM, and the phase rules read them. Anything that is not a bash agent (FrozenLake's
```Up```) has no command and tool type `other`, so every env works and SWE signals stay quiet.

Commands are classified by patterns over the whole command (chains with && / | and heredocs
included), not by a shell parser: agents write one-liners, and a pattern that misses one costs
a little signal, never a crash.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentree.tools import readable_action
from agentree.tree import Node

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's submit command is `echo` of this line."""

TOOLS = ("finish", "test", "edit", "run", "read", "search", "other")
"""Tool types, most telling first: a step's `tool` is the first of these it uses."""

_BASH_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.S)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_OUTPUT = re.compile(r"<output>\n?(.*?)</output>", re.S)
# a command word at the start of the command or after a separator (&&, ||, ;, |, newline, $( )
_CMD = r"(?:^|[;&|(\n]|\$\()\s*(?:sudo\s+|timeout\s+\d+\s+)?"

_PATTERNS: dict[str, list[re.Pattern[str]]] = {
    "finish": [
        re.compile(rf"{_CMD}echo\s+['\"]?{SUBMIT_SENTINEL}"),
        re.compile(rf"{_CMD}submit\s*$", re.M),
    ],
    "test": [
        re.compile(rf"{_CMD}(?:python[\d.]*\s+-m\s+)?(?:pytest|py\.test|nosetests|tox|nox)\b"),
        re.compile(rf"{_CMD}python[\d.]*\s+-m\s+(?:unittest|django\s+test)\b"),
        re.compile(r"\bruntests\.py\b|\bmanage\.py\s+test\b|\bmake\s+(?:test|check)\b"),
        re.compile(rf"{_CMD}python[\d.]*\s+\S*\btests?(?:_\w+)?\.py\b"),
        re.compile(rf"{_CMD}python[\d.]*\s+\S*/tests?/\S+\.py\b"),
    ],
    "edit": [
        re.compile(rf"{_CMD}sed\s+(?:-\w*\s+)*-i"),
        re.compile(rf"{_CMD}perl\s+-\w*p\w*i"),
        re.compile(rf"{_CMD}(?:patch|ed)\b(?!\S)"),
        re.compile(rf"{_CMD}git\s+(?:apply|am|checkout\s+--|restore)\b"),
        re.compile(r"\.write(?:_text|_bytes)?\(|open\([^)]*['\"][wa]b?\+?['\"]"),
    ],
    "run": [
        re.compile(rf"{_CMD}python[\d.]*\s+(?:-c\b|-\s|\S+\.py\b|-m\s+\w)"),
        re.compile(rf"{_CMD}(?:bash|sh|node|ruby|go\s+run|cargo\s+run|make)\b"),
    ],
    "read": [
        re.compile(rf"{_CMD}(?:cat|head|tail|nl|less|more|view|bat|awk|wc)\s+[^<>|]"),
        re.compile(rf"{_CMD}sed\s+(?:-\w+\s+)*-n\b"),
        re.compile(rf"{_CMD}git\s+(?:show|diff|blame)\b"),
    ],
    "search": [
        re.compile(rf"{_CMD}(?:grep|egrep|rg|ag|ack|find|ls|tree|locate|which|fd)\b"),
        re.compile(rf"{_CMD}git\s+(?:grep|log|status|ls-files)\b"),
    ],
}
# Writing a file through the shell: `cat <<EOF > f`, `> f`, `tee f`. Writes to /dev/null, to
# /tmp and to reproduction scripts are scaffolding, not edits of the repository.
_REDIRECT = re.compile(r"(?<![0-9&<>])>>?\s*([^\s&|;<>]+)")
_QUOTED = re.compile(r"'[^']*'|\"(?:\\.|[^\"\\])*\"")
_TEE = re.compile(rf"{_CMD}tee\s+(?:-a\s+)?([^\s&|;<>]+)")
_SCRATCH = re.compile(
    r"^(?:/dev/|/tmp/|&)|(?:^|/)(?:repro\w*|reproduce\w*|test_\w+|scratch\w*)\.py$"
)

_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_FRAME = re.compile(r'File "([^"]+)", line \d+')
_EXCEPTION = re.compile(
    r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Warning|Exit)|AssertionError)\b.*$", re.M
)
_STDLIB = re.compile(r"/(?:usr/lib|lib/python[\d.]+|site-packages|dist-packages)/|^<")
_PYTEST_SUMMARY = re.compile(r"=+ (.*\b(?:passed|failed|error|errors|no tests ran)\b.*) in [\d.]+s")
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in", re.M)
_UNITTEST_RESULT = re.compile(r"^(OK|FAILED)\b", re.M)
_SHELL_ERROR = re.compile(
    r"command not found|No such file or directory|Permission denied|syntax error|"
    r"can't read|cannot open|unrecognized option|invalid option|fatal: |^Usage: ",
    re.M | re.I,
)
_CODE_HIT = re.compile(
    r"^[\w./-]+\.\w+:\d+[:-]|^\s*(?:\d+\s+)?(?:def|class|function|fn|func)\s\w", re.M
)
_PATH = re.compile(r"\b[\w-]+(?:/[\w.-]+)*\.(?:py|pyx|js|ts|go|rs|c|h|cpp|java|rb|cfg|toml|txt)\b")


def bash_command(action: str | None) -> str:
    """The command of a mini-swe-agent style response (its first bash block), or ''."""
    if not action:
        return ""
    m = _BASH_BLOCK.search(action)
    return m.group(1).strip() if m else ""


def tool_types(command: str) -> frozenset[str]:
    """Every tool type a bash command uses; empty for no command."""
    if not command.strip():
        return frozenset()
    found = {tool for tool, pats in _PATTERNS.items() if any(p.search(command) for p in pats)}
    shell = _QUOTED.sub("Q", _strip_heredoc_bodies(command))  # `a > b` inside code is no write
    written = [m.group(1) for m in _REDIRECT.finditer(shell)]
    written += [m.group(1) for m in _TEE.finditer(command)]
    if any(not _SCRATCH.search(path) for path in written):
        found.add("edit")
    if "test" in found:
        found.discard("run")  # running tests is the more specific reading
    if "edit" in found and "read" in found and re.search(r"\bcat\s*(?:<<|>)", command):
        # `cat <<'EOF' > file` is a write, not a read
        found.discard("read")
    return frozenset(found) or frozenset({"other"})


def _strip_heredoc_bodies(command: str) -> str:
    """The command without heredoc bodies, so `x > y` inside a Python script is not a redirect."""
    out, lines, i = [], command.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        i += 1
        if m:
            while i < len(lines) and lines[i].strip() != m.group(1):
                i += 1
            i += 1
    return "\n".join(out)


def primary_tool(tools: frozenset[str]) -> str:
    return next((t for t in TOOLS if t in tools), "other")


@dataclass
class StepView:
    """One agent step of a branch with everything the SWE scorers extract from it."""

    index: int
    """1-based position of the step in the branch."""
    action: str
    command: str
    """The bash command ('' when the action is not a bash call)."""
    tools: frozenset[str]
    observation: str
    output: str
    """The command output inside <output>...</output>, else the whole observation."""
    key: str
    """Canonical action (the env's `action_key` when it gives one)."""
    reward: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    format_error: bool = False
    failed: bool = False
    """The command did not do what was asked (non-zero exit of a non-test command, shell error
    text, a timeout, or a malformed action)."""
    traceback: bool = False
    informative_traceback: bool = False
    """A Python traceback from running code whose frames point into the project."""
    tests_passed: bool | None = None
    """Outcome of a test run (None: not a test run or no recognisable summary)."""
    targeted: bool = False
    """A test run aimed at specific tests (file, node id, -k, dotted module)."""
    discovered: bool = False
    """A search/read that returned code or file locations."""
    files: list[str] = field(default_factory=list)

    @property
    def tool(self) -> str:
        return primary_tool(self.tools)


_CALL_KINDS = {
    ("file_editor", "view"): "read",
    ("file_editor", "create"): "edit",
    ("file_editor", "str_replace"): "edit",
    ("file_editor", "insert"): "edit",
    ("search", None): "search",
    ("submit", None): "finish",
}
"""Tool types of SWE tool mode's calls other than execute_bash (by name and editor command)."""


def step_views(branch: Sequence[Node]) -> list[StepView]:
    """Every step after the root, analysed."""
    return [view_step(i, n) for i, n in enumerate(branch[1:], start=1)]


def view_step(index: int, node: Node) -> StepView:
    env: dict[str, Any] = node.info.get("env") or {}
    action = readable_action(node.action, node.info)
    command, tools = bash_command(node.action), frozenset()
    for call in node.info.get("tool_calls") or []:  # tool mode: the calls say what was done
        args = call.get("arguments") or {}
        if call["name"] == "execute_bash":
            command = str(args.get("command", ""))
            tools |= tool_types(command)
        else:
            tools |= {_CALL_KINDS.get((call["name"], args.get("command")), "other")}
    tools = tools or (tool_types(command) if command else frozenset({"other"}))
    observation = node.observation or ""
    m = _OUTPUT.search(observation)
    output = m.group(1) if m else observation
    rc = env.get("returncode")
    if rc is None:
        rm = _RETURNCODE.search(observation)
        rc = int(rm.group(1)) if rm else None
    v = StepView(
        index=index,
        action=action,
        command=command,
        tools=tools,
        observation=observation,
        output=output,
        key=str(env.get("action_key") or " ".join((command or action).split())),
        reward=float(node.reward),
        returncode=None if rc is None else int(rc),
        timed_out=bool(env.get("timed_out")) or "seconds and was stopped" in observation[:200],
        format_error=bool(env.get("format_error")),
    )
    if command:
        _read_output(v)
    else:
        v.failed = v.timed_out or v.format_error  # e.g. a reply without exactly one bash block
        v.failed = v.failed or observation.startswith("ERROR:")  # a file_editor/search error
    return v


def _read_output(v: StepView) -> None:
    """Fill the observation-derived signals of a bash step."""
    out = v.output
    v.traceback = bool(_TRACEBACK.search(out))
    if v.traceback and v.tools & {"run", "test"}:
        frames = _FRAME.findall(out)
        v.informative_traceback = any(not _STDLIB.search(f) for f in frames) and bool(
            _EXCEPTION.search(out)
        )
    if "test" in v.tools:
        v.tests_passed = _test_outcome(out)
        v.targeted = is_targeted_test(v.command)
    nonzero = v.returncode not in (None, 0)
    if "search" in v.tools and v.returncode == 1 and not out.strip():
        nonzero = False  # grep found nothing: an answer, not a failure
    if v.tools & {"test", "run"} and (v.tests_passed is not None or v.informative_traceback):
        nonzero = False  # failing tests and reproduced bugs are evidence, not broken commands
    shell_error = bool(_SHELL_ERROR.search(out)) and not v.informative_traceback
    v.failed = v.timed_out or v.format_error or nonzero or shell_error
    if v.tools & {"search", "read"} and not v.failed and out.strip():
        v.files = sorted(set(_PATH.findall(out)))[:20]
        v.discovered = bool(_CODE_HIT.search(out) or v.files)


_RUNNER = re.compile(r"\S*\b(?:runtests|manage|setup)\.py\b|\bpython[\d.]*\b")
_TARGET = re.compile(
    r"::|\s-k\s|\s\S+\.py\b|(?:unittest|runtests|test)\s+(?:-\S+\s+)*[A-Za-z_]\w*(?:\.\w+)+"
)


_LABELLED = re.compile(r"(?:runtests\.py|manage\.py\s+test)\s+(?:-\S+\s+)*[A-Za-z_]")


def is_targeted_test(command: str) -> bool:
    """A test command aimed at specific tests: a file, a node id, `-k`, a module or label."""
    return bool(_LABELLED.search(command) or _TARGET.search(_RUNNER.sub("test", command)))


def _test_outcome(out: str) -> bool | None:
    m = _PYTEST_SUMMARY.findall(out)
    if m:
        last = m[-1]
        return "passed" in last and not re.search(r"\bfailed|\berrors?\b", last)
    if _UNITTEST_RAN.search(out):
        r = _UNITTEST_RESULT.findall(out)
        return bool(r) and r[-1] == "OK"
    return None


def clip_middle(text: str, limit: int, marker: str = " [...] ") -> str:
    """`text` cut to at most `limit` characters by eliding its middle (head and tail kept)."""
    if limit <= 0:
        return ""
    if len(text) <= limit:
        return text
    if limit <= len(marker) + 2:
        return text[:limit]
    keep = limit - len(marker)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def one_line(text: str) -> str:
    """`text` with each newline written as a literal backslash-n (a single-line rendering)."""
    return text.replace("\r\n", "\n").replace("\n", "\\n")
