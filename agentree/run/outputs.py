"""Output directories: a command writes only into a new or empty directory, or one that the same
command wrote before, so nothing it did not write is ever replaced.

`train`, `rollout` and `eval` each mark the directory they write (`.agentree`, naming the
command) once their inputs are validated, just before their first file. A directory from before
the marker is recognised by what it holds: `checkpoints/` or `metrics.jsonl` (a training run),
`rollout_stats.json` (a rollout), `eval.json` (an evaluation). `claim` is called before anything
is built or written; `mark` when the first file is about to be.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = ".agentree"
COMMANDS = ("train", "rollout", "eval")
BLOCKS = "blocks"
"""Where `agentree eval` and `agentree rollout` keep the blocks of tasks they have finished until
their last one is done (`agentree.run.blocks`)."""
WHAT = {"train": "training run", "rollout": "rollout", "eval": "evaluation"}
_LEGACY = {"checkpoints": "train", "metrics.jsonl": "train", "rollout_stats.json": "rollout"}


def owner(path: Path) -> str | None:
    """The command that wrote `path` (`train`, `rollout`, `eval`), `""` for a missing or empty
    directory, None for anything else (a user's own folder, a file)."""
    if not path.exists():
        return ""
    if not path.is_dir():
        return None
    try:
        command = json.loads((path / MARKER).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    if command in COMMANDS:
        return command
    names = {p.name for p in path.iterdir()}
    if not names:
        return ""
    for name, command in _LEGACY.items():
        if name in names:
            return command
    return "eval" if "eval.json" in names else None


def claim(path: Path, command: str, *, resume: bool = False) -> None:
    """Raise a ValueError (one sentence) unless `command` may write into `path`; writes nothing.

    `train` takes a new or empty directory, or (`resume`) a training run; `rollout` and `eval`
    take a new or empty directory or one they wrote before (their outputs are replaced) unless
    it was stopped before its last task, and (`resume`) one they wrote before."""
    who = owner(path)
    if resume:
        if who != command:
            what = WHAT[command]
            raise ValueError(
                f"{path} is not an agentree {what} directory, so there is nothing to resume; "
                f"pass the --output of a run that agentree {command} wrote"
            )
        return
    if who == "":
        return
    if who == command != "train" and any((path / BLOCKS).glob("block_*")):
        what = f"{'an' if command == 'eval' else 'a'} {WHAT[command]}"
        raise ValueError(
            f"{path} holds {what} stopped before its last task; pass --resume to finish it, or "
            "another --output"
        )
    if command == "train" and who == "train":
        if (path / "checkpoints").exists() or (path / "metrics.jsonl").exists():
            raise ValueError(
                f"{path} already holds a run; pass --resume to continue it, or another --output"
            )
        return  # a run stopped before its first step: starting it again loses nothing
    if who == command:
        return
    if who == "train":
        raise ValueError(
            f"{path} holds a training run, which agentree {command} would overwrite; pass "
            f"another --output, e.g. {path / command}"
        )
    what = f"the output of agentree {who}" if who else "files agentree did not write"
    raise ValueError(
        f"{path} holds {what}; pass a new or empty --output directory for agentree {command}"
    )


def mark(path: Path, command: str) -> None:
    """Create `path` if needed and record that `command` writes it (atomically)."""
    path.mkdir(parents=True, exist_ok=True)
    write_whole(path / MARKER, json.dumps({"command": command}) + "\n")


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: written beside it, then renamed over it, so
    a stop at any moment leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
