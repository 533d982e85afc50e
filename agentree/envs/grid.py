"""The `move(direction)` tool shared by the grid games (FrozenLake, Sokoban).

With `action_format: tools` a grid env declares one tool, `move`, and reads the direction from
the call; with `text` (the default) it reads its ```Move``` block as before. Either way a turn
that is not exactly one well-formed move leaves the board unchanged and costs the env's
invalid-action penalty.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from agentree import prompts
from agentree.envs.base import ActionFormat, MoveGame, Task
from agentree.tools import ToolCall, ToolSpec, as_tool_action, call_format

DIRECTIONS = ("up", "down", "left", "right")

MOVE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move one cell in a direction.",
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {
                    "type": "string",
                    "enum": list(DIRECTIONS),
                    "description": "Where to move: up, down, left or right.",
                }
            },
            "required": ["direction"],
            "additionalProperties": False,
        },
    },
}


def read_move_call(action: str) -> tuple[str | None, str | None]:
    """(direction, None) for one well-formed `move` call, else (None, why not) in a sentence.

    A plain string (a scripted policy, `check_env`) is read as hermes calls."""
    parsed = as_tool_action(action, [MOVE_TOOL])
    if parsed.error:
        return None, parsed.error
    if len(parsed.calls) != 1:
        return None, f"call move exactly once per turn, not {len(parsed.calls)} times."
    return str(parsed.calls[0].arguments["direction"]), None


def move_call(direction: str) -> str:
    """A `move` call as hermes text (demonstrations, example actions)."""
    return call_format("hermes").format([ToolCall("move", {"direction": direction.lower()})])


def move_action(direction: str, action_format: ActionFormat) -> str:
    """A move as the policy writes it in `action_format`: ```Down``` or a `move` call."""
    return move_call(direction) if action_format == "tools" else f"```{direction}```"


def example_moves(action_format: ActionFormat) -> list[str]:
    """Four moves and one invalid answer, in the env's action format."""
    moves = ["Right", "Down", "Left", "Up"]
    if action_format == "text":
        return [f"```{m}```" for m in moves] + ["no move"]
    return [move_call(m) for m in moves] + ["no move"]


def tool_corpus(action_format: ActionFormat) -> list[str]:
    """The tool-mode texts a tiny tokenizer must cover: the generic tools rendering, the
    schema and the invalid-call notice (none in text mode)."""
    if action_format == "text":
        return []
    listing = json.dumps(MOVE_TOOL)
    return [
        prompts.render("tools/hermes.txt", system="", tools=listing),
        prompts.load("tools/invalid_move.txt"),
        "Invalid action: bad arguments for move: direction: 'north' is not one of "
        "['up', 'down', 'left', 'right']. malformed tool call: unknown tool",
    ]


class GridGame(MoveGame):
    """What the grid games share beyond a move a turn (`MoveGame`): their moves as ```Move```
    text or a `move` call (`cfg.action_format`), the example moves, and a tokenizer corpus in
    the proportions the policy sees. A subclass names its invalid-action notice
    (`invalid_prompt`).

    A subclass reads its moves itself (`read_move`: `read_move_call` with tools, its ```Move```
    block otherwise), since each game names and checks its moves its own way."""

    invalid_prompt: str = ""
    """The prompts path of the env's invalid-action notice, e.g. `frozenlake/invalid.txt`."""
    tools_prompt: str = ""
    """The prompts path of the system prompt with tools, e.g. `frozenlake/system_tools.txt`."""

    def use_action_format(self, moves: Iterable[str]) -> None:
        """What `cfg.action_format` changes, set once the config is read: with tools, the
        system prompt that explains the `move` tool and the actions as `move` calls; with text
        and `stop_after_move`, a stop sequence at each ```Move``` block, so a turn ends at its
        move."""
        if self.cfg.action_format == "tools":
            self.system_prompt = prompts.load(self.tools_prompt).strip()
            self.action_set = tuple(move_call(a.strip("`")) for a in type(self).action_set)
        elif self.cfg.stop_after_move:
            self.stop_sequences = tuple(f"```{m.capitalize()}```" for m in moves)

    def tools(self) -> list[ToolSpec]:
        return [MOVE_TOOL] if self.cfg.action_format == "tools" else []

    def example_actions(self) -> list[str]:
        return example_moves(self.cfg.action_format)

    def corpus(self, tasks: list[Task]) -> list[str]:
        """Boards and moves in the proportions the policy sees them (for tiny tokenizers)."""
        texts = [prompts.load(self.invalid_prompt), *tool_corpus(self.cfg.action_format)]
        for task in tasks:
            texts.append(self.system_prompt or "")
            texts.append(self.reset(seed=task.seed, options=task.options)[0])
            texts.extend(self.example_actions()[:4])
        return texts

    def invalid_turn(self, action: str, error: str | None) -> tuple[float, str]:
        """The invalid-action penalty, and the board unchanged under the env's notice (or the
        call's error)."""
        grid = self.render_grid()
        if error is None:
            obs = prompts.render(self.invalid_prompt, grid=grid)
        else:
            obs = prompts.render("tools/invalid_move.txt", error=error, grid=grid)
        return -self.cfg.invalid_penalty, obs
