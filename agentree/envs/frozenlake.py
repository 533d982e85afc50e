"""FrozenLake as a text game, on gymnasium's FrozenLake, following rLLM's conventions.

Random valid maps from (size, p, seed) with S and G at distinct random cells, resampled until G
is reachable; non-slippery by default; the grid is rendered one row per line with P (player),
_ (ice), O (hole), G (goal). The model answers with its move in triple backticks; the last such
block counts. Reward 1 on reaching G, else 0 (an optional penalty for invalid actions); the
episode ends on G, a hole, or the turn limit.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from pydantic import Field

from agentree import prompts
from agentree.envs.base import EnvConfig
from agentree.envs.grid import (
    ActionFormat,
    GridGame,
    move_action,
    read_move_call,
)

ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
MOVES = ("Left", "Down", "Right", "Up")  # gymnasium's action order
_MOVE = re.compile(r"```\s*([A-Za-z]+)\s*```")
_DELTA = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
_PREFERENCE = ("Down", "Right", "Up", "Left")


class FrozenLakeConfig(EnvConfig):
    size: int = Field(4, ge=2, le=16)
    """Side length of the square map."""
    p: float = Field(0.8, gt=0.0, le=1.0)
    """Probability that a cell is ice rather than a hole."""
    max_turns: int = Field(10, ge=1)
    """Episode turn limit (the PATR paper uses 10)."""
    is_slippery: bool = False
    """gymnasium's slippery dynamics (moves may slide sideways)."""
    invalid_penalty: float = 0.0
    """Reward subtracted for an unparseable action (the position does not change)."""
    stop_after_move: bool = True
    """End the policy's turn once it has written a complete move (off: the whole response is
    read and its last move counts, as in rLLM)."""
    action_format: ActionFormat = "text"
    """text: a ```Move``` block; tools: a call of the `move(direction)` tool."""


def generate_map(size: int, p: float, rng: np.random.Generator) -> list[str]:
    """A size x size map of F/H with S and G on distinct cells and a path from S to G."""
    while True:
        grid = np.where(rng.random((size, size)) < p, "F", "H")
        cells = rng.choice(size * size, size=2, replace=False)
        (sr, sc), (gr, gc) = divmod(int(cells[0]), size), divmod(int(cells[1]), size)
        grid[sr, sc], grid[gr, gc] = "S", "G"
        desc = ["".join(row) for row in grid]
        if shortest_path(desc, (sr, sc), (gr, gc)) is not None:
            return desc


def distances(desc: Sequence[str], source: tuple[int, int]) -> dict[tuple[int, int], int]:
    """BFS distance from `source` to every cell it can reach, holes blocked (moves are
    symmetric, so this is also every cell's distance to `source`). The one BFS of FrozenLake:
    map generation, the BFS scorer and the scripted expert all read it."""
    n, m = len(desc), len(desc[0])
    dist = {source: 0}
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _DELTA.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < m and (nr, nc) not in dist and desc[nr][nc] != "H":
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def shortest_path(desc: Sequence[str], start: tuple[int, int], goal: tuple[int, int]) -> int | None:
    """BFS distance from start to goal with holes blocked; None if unreachable."""
    return distances(desc, start).get(goal)


def distances_to_goal(desc: Sequence[str]) -> dict[tuple[int, int], int]:
    """BFS distance from every cell that can reach G (holes blocked)."""
    n, m = len(desc), len(desc[0])
    return distances(desc, next((r, c) for r in range(n) for c in range(m) if desc[r][c] == "G"))


def valid_moves(desc: Sequence[str], pos: tuple[int, int]) -> list[str]:
    """Moves that stay on the map, in `MOVES` order (a hole is a valid, if fatal, move)."""
    n, m = len(desc), len(desc[0])
    out = []
    for move in MOVES:
        dr, dc = _DELTA[ACTIONS[move.lower()]]
        if 0 <= pos[0] + dr < n and 0 <= pos[1] + dc < m:
            out.append(move)
    return out


def shortest_moves(desc: Sequence[str], pos: tuple[int, int]) -> list[str]:
    """Moves that bring `pos` one step closer to G, in `_PREFERENCE` order (empty if G is out
    of reach). The expert takes the first, so its move is a function of the state rather than
    a coin flip a policy imitating it would have to learn too."""
    dist = distances_to_goal(desc)
    here = dist.get(pos)
    out = []
    for move in _PREFERENCE:
        dr, dc = _DELTA[ACTIONS[move.lower()]]
        step = (pos[0] + dr, pos[1] + dc)
        if move in valid_moves(desc, pos) and here is not None and dist.get(step) == here - 1:
            out.append(move)
    return out


def parse_action(text: str) -> int | None:
    """The last ```Move``` block, case-insensitive; None if absent or not a move."""
    blocks = _MOVE.findall(text)
    return ACTIONS.get(blocks[-1].lower()) if blocks else None


class FrozenLakeEnv(GridGame):
    """Text FrozenLake; a snapshot is a small dict, so forking is free.

    Scripted play: the expert takes a shortest-path move (BFS, holes blocked), the walker a
    random move that stays on the map.
    """

    invalid_prompt = "frozenlake/invalid.txt"
    tools_prompt = "frozenlake/system_tools.txt"

    Config = FrozenLakeConfig
    system_prompt = prompts.load("frozenlake/system.txt").strip()
    action_set = tuple(f"```{m}```" for m in MOVES)
    # the turn limit, stop sequences and reward levels change neither the expert's episodes
    # (they play to the default turn limit) nor the prompts
    expert_settings = ("size", "p", "is_slippery", "action_format")

    def __init__(self, **kwargs: Any) -> None:
        self.cfg = FrozenLakeConfig(**kwargs)
        self.use_action_format(ACTIONS)
        self._lake: GymFrozenLake | None = None
        self._desc: list[str] = []
        self._turn = 0
        self._done = False

    # -- episode ------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        opts = dict(options or {})
        if "desc" in opts:
            desc = list(opts["desc"])
        else:
            size, p = int(opts.get("size", self.cfg.size)), float(opts.get("p", self.cfg.p))
            desc = generate_map(size, p, np.random.default_rng(seed))
        self._build(desc)
        assert self._lake is not None
        self._lake.reset(seed=seed)
        self._turn, self._done = 0, False
        return self.render_grid(), self.turn_info(valid=True, success=False)

    # -- a turn (the step is `MoveGame`'s) ----------------------------------------------------
    @property
    def started(self) -> bool:
        return self._lake is not None

    def read_move(self, action: str) -> tuple[str | None, str | None]:
        if self.cfg.action_format == "tools":
            return read_move_call(action)
        move = parse_action(action)
        return (None if move is None else MOVES[move].lower()), None

    def play(self, move: str) -> tuple[float, str, bool, bool]:
        assert self._lake is not None
        _, r, terminated, _, _ = self._lake.step(ACTIONS[move])
        return float(r), self.render_grid(), bool(terminated), self.position == self.goal

    # -- forking ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        if self._lake is None:
            raise RuntimeError("call reset() before snapshot()")
        return {
            "desc": list(self._desc),
            "s": int(self._lake.s),
            "turn": self._turn,
            "done": self._done,
            "rng": self._lake.np_random.bit_generator.state,
        }

    def restore(self, state: dict[str, Any]) -> None:
        if self._lake is None or self._desc != state["desc"]:
            self._build(list(state["desc"]))
        assert self._lake is not None
        self._lake.s = int(state["s"])
        self._lake.np_random.bit_generator.state = state["rng"]
        self._turn, self._done = int(state["turn"]), bool(state["done"])

    def state_key(self) -> str:
        """The grid with the player: the whole state (an invalid-action notice is not)."""
        return self.render_grid()

    # -- scripted play ------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        best = shortest_moves(self._desc, self.position)
        return move_action(best[0], self.cfg.action_format) if best else None

    def random_action(self, rng: random.Random) -> str:
        move = rng.choice(valid_moves(self._desc, self.position))
        return move_action(move, self.cfg.action_format)

    def best_actions(self) -> list[str]:
        moves = shortest_moves(self._desc, self.position)
        return [move_action(m, self.cfg.action_format) for m in moves]

    # -- views --------------------------------------------------------------------------------
    @property
    def position(self) -> tuple[int, int]:
        assert self._lake is not None
        return divmod(int(self._lake.s), len(self._desc[0]))

    @property
    def goal(self) -> tuple[int, int]:
        return next(
            (r, c) for r, row in enumerate(self._desc) for c, ch in enumerate(row) if ch == "G"
        )

    def render_grid(self) -> str:
        pr, pc = self.position
        rows = []
        for r, row in enumerate(self._desc):
            cells = []
            for c, ch in enumerate(row):
                cells.append("P" if (r, c) == (pr, pc) else {"H": "O", "G": "G"}.get(ch, "_"))
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def _build(self, desc: list[str]) -> None:
        self._desc = desc
        self._lake = GymFrozenLake(desc=desc, is_slippery=self.cfg.is_slippery)
        self._lake.reset(seed=0)

    def turn_info(self, *, valid: bool, success: bool) -> dict[str, Any]:
        return {
            "pos": list(self.position),
            "goal": list(self.goal),
            "desc": list(self._desc),
            "valid": valid,
            "turn": self._turn,
            "success": success,
        }
