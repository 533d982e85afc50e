"""SWE in tool mode: the R2E-Gym / SWE-agent tool set over the same sandbox.

`execute_bash` runs a command as the text mode's bash block does (a fresh `bash -lc` in the
repository); `file_editor` (`view`, `create`, `str_replace`, `insert`) and `search` run as one
Python program inside the container (`sandbox_tools.py`), so nothing but the filesystem carries
over between calls and forking by filesystem snapshot stays faithful; `submit` ends the episode
(the patch is `git diff`, graded as in text mode).
"""

from __future__ import annotations

import base64
import json
import re
from functools import cache
from importlib import resources

from agentree.tools import ToolCall

EXECUTE_BASH = {
    "type": "function",
    "function": {
        "name": "execute_bash",
        "description": (
            "Run a bash command in the repository (a fresh shell each time: `cd` and variables "
            "do not carry over, file changes do). Avoid interactive programs and servers."
        ),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}
FILE_EDITOR = {
    "type": "function",
    "function": {
        "name": "file_editor",
        "description": (
            "View, create and edit files. `view` shows a file as `cat -n` (optionally "
            "`view_range` [first, last], last -1 for the end) or lists a directory two levels "
            "deep; `create` writes a new file (`file_text`); `str_replace` replaces `old_str`, "
            "which must occur exactly once, with `new_str`; `insert` inserts `new_str` after "
            "line `insert_line` (0: at the top). Paths are absolute."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "enum": ["view", "create", "str_replace", "insert"],
                    "description": "The editor command.",
                },
                "path": {"type": "string", "description": "Absolute path of a file or folder."},
                "file_text": {"type": "string", "description": "Content of the new file."},
                "old_str": {"type": "string", "description": "The exact text to replace."},
                "new_str": {"type": "string", "description": "The replacement or new text."},
                "insert_line": {"type": "integer", "description": "Insert after this line."},
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "Lines to view: [first, last].",
                },
            },
            "required": ["command", "path"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": (
            "Search for a literal term: in a folder, the files that contain it with their match "
            "counts; in a file, the matching lines with their numbers."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "search_term": {"type": "string", "description": "The text to look for."},
                "path": {"type": "string", "description": "File or folder (default: `.`)."},
            },
            "required": ["search_term"],
            "additionalProperties": False,
        },
    },
}
SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the changes (the `git diff` of the repository); ends the task.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
SWE_TOOLS = [EXECUTE_BASH, FILE_EDITOR, SEARCH, SUBMIT]
IN_SANDBOX = frozenset({"file_editor", "search"})
"""Tools run by the in-sandbox program (the others are the env's own)."""


@cache
def _program_b64() -> str:
    text = resources.files("agentree.envs.swe").joinpath("sandbox_tools.py").read_text()
    return base64.b64encode(text.encode()).decode()


def sandbox_command(call: ToolCall) -> str:
    """The bash line that runs `call` (file_editor or search) inside the container."""
    args = base64.b64encode(json.dumps({"name": call.name, "arguments": call.arguments}).encode())
    return f"printf %s {_program_b64()} | base64 -d | python3 - {args.decode()}"


def call_key(call: ToolCall) -> str:
    """Canonical form of a call for repeated-action pruning (PATR's theta)."""
    if call.name == "execute_bash":
        return "\n".join(
            " ".join(ln.split()) for ln in str(call.arguments.get("command", "")).splitlines()
        )
    return call.name + json.dumps(call.arguments, sort_keys=True)


# -- the gold patch through the tools ------------------------------------------------------------
_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def patch_calls(patch: str, workdir: str = "/testbed") -> list[ToolCall]:
    """Tool calls that make `patch`'s changes: a `str_replace` per hunk (context and removed
    lines -> context and added lines), `create` for a new file, `rm` for a deleted one."""
    calls: list[ToolCall] = []
    sections = _FILE.split(patch)
    for i in range(1, len(sections), 3):
        path, body = f"{workdir}/{sections[i + 1]}", sections[i + 2]
        if "\ndeleted file mode" in body:
            calls.append(ToolCall("execute_bash", {"command": f"rm {path}"}))
            continue
        hunks = re.split(r"^@@[^\n]*@@[^\n]*\n", body, flags=re.M)[1:]
        if "\nnew file mode" in body or body.startswith("new file mode"):
            text = "".join(ln[1:] + "\n" for ln in _lines(hunks[0]) if ln.startswith("+"))
            calls.append(
                ToolCall("file_editor", {"command": "create", "path": path, "file_text": text})
            )
            continue
        for hunk in hunks:
            old, new = [], []
            for ln in _lines(hunk):
                if ln.startswith("\\"):  # "\ No newline at end of file"
                    continue
                tag, text = ln[:1], ln[1:]
                if tag in (" ", "-"):
                    old.append(text)
                if tag in (" ", "+"):
                    new.append(text)
            calls.append(
                ToolCall(
                    "file_editor",
                    {
                        "command": "str_replace",
                        "path": path,
                        "old_str": "\n".join(old),
                        "new_str": "\n".join(new),
                    },
                )
            )
    return calls


def _lines(hunk: str) -> list[str]:
    lines = hunk.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines
