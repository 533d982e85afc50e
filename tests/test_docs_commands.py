"""Every `agentree` command in a code block of the README or `docs/` must still be accepted.

A command is parsed by the CLI's own parser; for `train`, `rollout`, `eval`, `sft` and `serve`
the config it selects is loaded as the command would load it, which validates every `--config`,
`--env`, `--rollout`, `--scorer` and `--set key=value` against the components' config types.
Nothing is run. An upper-case word standing alone or after `=` (`DIR`, `PATH`, `seed=S`) is a
placeholder for a value of the user's; usage synopses (`[--flag ...]`, `a|b`) are not commands.
The env example's command (`--env mypkg.guess:GuessEnv`) needs the module the README writes, so
`tests/test_readme_env.py` runs it for real instead.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from agentree.commands.cli import _load, build_parser
from agentree.commands.serve import serve_config
from agentree.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"(^|=)([A-Z][A-Z_]*)(\.\w+)?$")
VALUES = {"S": "0", "K": "2", "N": "1", "ENV": "frozenlake"}  # any other stands for a path
LOADED = {"train", "rollout", "eval"}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each `agentree ...` line in a fenced or indented code block, its
    continuation lines joined."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    out: list[tuple[str, str]] = []
    for page in pages:
        lines = iter(page.read_text().splitlines())
        fenced = False
        for line in lines:
            if line.lstrip().startswith("```"):
                fenced = not fenced
            cmd = line.strip().removeprefix("$ ")
            if not cmd.startswith("agentree ") or not (fenced or line.startswith("    ")):
                continue
            while cmd.endswith("\\"):
                cmd = cmd[:-1] + " " + next(lines).strip()
            cmd = re.split(r"\s+#|&&|\s\|\s", cmd)[0].strip()  # a comment, or what runs next
            if not any(s in cmd for s in ("[", "|", "(same", "mypkg.")):
                out.append((f"{page.relative_to(ROOT)}", cmd))
    return out


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    kinds = {shlex.split(c)[1] for _, c in COMMANDS}
    assert {"train", "rollout", "eval", "sft", "serve", "view", "plot", "swe", "models"} <= kinds


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_is_accepted(where: str, command: str):
    argv = [
        PLACEHOLDER.sub(lambda m: m[1] + VALUES.get(m[2], "x") + (m[3] or ""), word)
        for word in shlex.split(command)[1:]
    ]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: the CLI no longer parses `{command}`")
    if args.command in LOADED:
        _load(args)
    elif args.command == "sft":
        load_config(
            args.config, select={"env": args.env, "policy": args.policy}, overrides=args.set
        )
    elif args.command == "serve":
        serve_config(args.policy, env=args.env, config=args.config, overrides=args.set)
