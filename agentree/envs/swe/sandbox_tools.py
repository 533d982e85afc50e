"""The file editor and search tools, run inside the sandbox as one `python3 -` program.

Standard library only, and no agentree import: `agentree.envs.swe.tools` sends this file's
text to the container's Python with the call's arguments (base64 JSON in argv[1]), so the
filesystem stays the only state of an episode and a filesystem snapshot still forks it. The
semantics and messages follow SWE-agent's `str_replace_editor` and R2E-Gym's `file_editor` and
`search`: absolute paths, `view` of a file as `cat -n` (optionally a `view_range`) or of a
directory two levels deep, `create` only of new files, `str_replace` only of a unique
`old_str`, `insert` after line `insert_line` (0: at the top). The exit status is 0 on success,
1 on an error the message explains.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

SNIPPET_LINES = 4
MAX_SEARCH_FILES = 100


class ToolError(Exception):
    """A call the agent can correct; the message is what it sees."""


def numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start))


def check_path(command: str, path: str) -> None:
    if not os.path.isabs(path):
        suggestion = os.path.join(os.getcwd(), path)
        raise ToolError(
            f"The path {path} is not an absolute path, it should start with `/`. "
            f"Maybe you meant {suggestion}?"
        )
    if not os.path.exists(path) and command != "create":
        raise ToolError(f"The path {path} does not exist. Please provide a valid path.")
    if os.path.exists(path) and command == "create":
        raise ToolError(
            f"File already exists at: {path}. Cannot overwrite files using command `create`."
        )
    if os.path.isdir(path) and command != "view":
        raise ToolError(
            f"The path {path} is a directory and only the `view` command can be used on directories"
        )


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise ToolError(f"The file {path} is not a text file (not UTF-8).") from None


def write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def view(path: str, view_range: list | None) -> str:
    if os.path.isdir(path):
        if view_range:
            raise ToolError(
                "The `view_range` parameter is not allowed when `path` points to a directory."
            )
        out = subprocess.run(
            ["find", path, "-maxdepth", "2", "-not", "-path", "*/.*"],
            capture_output=True,
            text=True,
        ).stdout
        return (
            f"Here's the files and directories up to 2 levels deep in {path}, excluding hidden "
            f"items:\n{out}"
        )
    text = read(path)
    start = 1
    if view_range:
        lines = text.split("\n")
        n = len(lines)
        if len(view_range) != 2 or not all(isinstance(i, int) for i in view_range):
            raise ToolError("Invalid `view_range`. It should be a list of two integers.")
        first, last = view_range
        if not 1 <= first <= n:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its first element `{first}` should be "
                f"within the range of lines of the file: [1, {n}]"
            )
        if last != -1 and last > n:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its second element `{last}` should be "
                f"smaller than the number of lines in the file: `{n}`"
            )
        if last != -1 and last < first:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its second element `{last}` should be "
                f"larger or equal than its first `{first}`"
            )
        text = "\n".join(lines[first - 1 :] if last == -1 else lines[first - 1 : last])
        start = first
    return f"Here's the result of running `cat -n` on {path}:\n{numbered(text, start)}\n"


def snippet(text: str, line: int, extra: int) -> tuple[str, int]:
    lines = text.split("\n")
    start = max(0, line - SNIPPET_LINES)
    end = line + extra + SNIPPET_LINES
    return "\n".join(lines[start : end + 1]), start + 1


def str_replace(path: str, old_str: str | None, new_str: str | None) -> str:
    if old_str is None:
        raise ToolError("Parameter `old_str` is required for command: str_replace")
    text = read(path)
    new_str = new_str or ""
    count = text.count(old_str)
    if count == 0:
        raise ToolError(
            f"No replacement was performed, old_str `{old_str}` did not appear verbatim in {path}."
        )
    if count > 1:
        lines = [i for i, ln in enumerate(text.split("\n"), 1) if old_str.split("\n")[0] in ln]
        raise ToolError(
            f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in "
            f"lines {lines}. Please ensure it is unique"
        )
    line = text.split(old_str)[0].count("\n")
    text = text.replace(old_str, new_str)
    write(path, text)
    shown, first = snippet(text, line, new_str.count("\n"))
    return (
        f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet "
        f"of {path}:\n{numbered(shown, first)}\nReview the changes and make sure they are as "
        "expected. Edit the file again if necessary."
    )


def insert(path: str, insert_line: int | None, new_str: str | None) -> str:
    if insert_line is None:
        raise ToolError("Parameter `insert_line` is required for command: insert")
    if new_str is None:
        raise ToolError("Parameter `new_str` is required for command: insert")
    lines = read(path).split("\n")
    n = len(lines)
    if not 0 <= insert_line <= n:
        raise ToolError(
            f"Invalid `insert_line` parameter: {insert_line}. It should be within the range "
            f"of lines of the file: [0, {n}]"
        )
    new_lines = new_str.split("\n")
    text = "\n".join(lines[:insert_line] + new_lines + lines[insert_line:])
    write(path, text)
    shown, first = snippet(text, insert_line, len(new_lines) - 1)
    return (
        f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet "
        f"of the edited file:\n{numbered(shown, first)}\nReview the changes and make sure they "
        "are as expected (correct indentation, no duplicate lines, etc). Edit the file again "
        "if necessary."
    )


def create(path: str, file_text: str | None) -> str:
    if file_text is None:
        raise ToolError("Parameter `file_text` is required for command: create")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write(path, file_text)
    return f"File created successfully at: {path}"


def file_editor(args: dict) -> str:
    command, path = args.get("command"), args.get("path", "")
    if command not in ("view", "create", "str_replace", "insert"):
        raise ToolError(
            f"Unrecognized command {command}. The allowed commands for the file_editor tool "
            "are: view, create, str_replace, insert"
        )
    check_path(command, path)
    if command == "view":
        return view(path, args.get("view_range"))
    if command == "create":
        return create(path, args.get("file_text"))
    if command == "str_replace":
        return str_replace(path, args.get("old_str"), args.get("new_str"))
    return insert(path, args.get("insert_line"), args.get("new_str"))


def search(args: dict) -> str:
    term, path = args.get("search_term", ""), args.get("path") or "."
    if not term:
        raise ToolError("Parameter `search_term` is required for search")
    if not os.path.exists(path):
        raise ToolError(f"The path {path} does not exist. Please provide a valid path.")
    if os.path.isfile(path):
        hits = [f"{i}:{line}" for i, line in enumerate(read(path).split("\n"), 1) if term in line]
        if not hits:
            return f'No matches found for "{term}" in {path}'
        return f'Matches for "{term}" in {path}:\n' + "\n".join(hits)
    out = subprocess.run(
        ["grep", "-rIc", "--exclude-dir=.git", "-F", "--", term, path],
        capture_output=True,
        text=True,
    ).stdout
    counts = []
    for row in out.splitlines():
        name, _, count = row.rpartition(":")
        if count.isdigit() and int(count) > 0:
            counts.append((name, int(count)))
    if not counts:
        return f'No matches found for "{term}" in {path}'
    if len(counts) > MAX_SEARCH_FILES:
        return (
            f'More than {MAX_SEARCH_FILES} files matched for "{term}" in {path}. '
            "Please narrow your search."
        )
    total = sum(c for _, c in counts)
    listing = "\n".join(f"{name} ({c} matches)" for name, c in sorted(counts))
    return (
        f'Found {total} matches for "{term}" in {path}:\n{listing}\n'
        f'End of matches for "{term}" in {path}'
    )


def main() -> int:
    call = json.loads(base64.b64decode(sys.argv[1]).decode("utf-8"))
    tools = {"file_editor": file_editor, "search": search}
    try:
        print(tools[call["name"]](call["arguments"]), end="")
    except ToolError as e:
        print(f"ERROR: {e}", end="")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
