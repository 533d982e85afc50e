"""Sokoban as a text game: push every box onto a target.

Rooms are generated as gym-sokoban and RAGEN generate them: a room topology is carved by a
random walk inside the walls, targets are placed with their boxes on them (the solved state)
and the player on a free cell, and then the game is played in reverse (the player walks at
random and may pull an adjacent box behind it); the reverse-played state with the boxes
farthest from their targets becomes the start, so every room is solvable. Sizes and box
counts are configurable (default 6x6 with one box).

The grid is one row per line: # wall, _ floor, O target, X box, * box on a target, P player,
S player on a target. The policy answers with its move in triple backticks (```Up```,
```Down```, ```Left```, ```Right```), the last such block counting, as in FrozenLake; an
unparseable answer leaves the room as it was. Reward 1 when every box is on a target (the
episode ends), else 0, minus an optional penalty for invalid answers; the episode is
truncated at `max_turns`. `solve_pushes` (fewest pushes, BFS over box positions) is the
env's own solver behind the `sokoban` process scorer; `solve_moves` (fewest moves) drives the
scripted expert of `tiny-warm`.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Iterable
from typing import Any

from pydantic import Field

from agentree import prompts
from agentree.envs.base import EnvConfig
from agentree.envs.grid import (
    ActionFormat,
    GridGame,
    move_action,
    read_move_call,
)

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
WALK = ("Left", "Down", "Right", "Up")
"""The walker's moves, in the order its random draw indexes them."""
_MOVE = re.compile(r"```\s*([A-Za-z]+)\s*```")
Cell = tuple[int, int]


class SokobanConfig(EnvConfig):
    size: int = Field(6, ge=5, le=12)
    """Side length of the square room, walls included."""
    boxes: int = Field(1, ge=1, le=4)
    """Boxes (and targets) per room."""
    max_turns: int = Field(12, ge=1)
    """Episode turn limit (one move per turn)."""
    reverse_steps: int = Field(100, ge=1)
    """Random reverse-play moves from the solved state when a room is generated."""
    invalid_penalty: float = 0.0
    """Reward subtracted for an unparseable action (nothing moves)."""
    stop_after_move: bool = True
    """End the policy's turn once it has written a complete move."""
    action_format: ActionFormat = "text"
    """text: a ```Move``` block; tools: a call of the `move(direction)` tool."""


# -- rooms ----------------------------------------------------------------------------------
def _neighbours(cell: Cell) -> Iterable[Cell]:
    for dr, dc in MOVES.values():
        yield cell[0] + dr, cell[1] + dc


def generate_room(size: int, boxes: int, reverse_steps: int, rng: random.Random) -> dict[str, Any]:
    """A solvable room: {"walls", "targets", "boxes", "player"} as lists of [row, col]."""
    for _ in range(1000):
        floor = _carve(size, rng)
        if len(floor) < boxes + 2:
            continue
        cells = sorted(floor)
        targets = rng.sample(cells, boxes)
        player = rng.choice([c for c in cells if c not in targets])
        start = _reverse_play(floor, set(targets), player, reverse_steps, rng)
        if start is None:
            continue
        box_set, player = start
        # reverse play may walk without pulling: any cell the player reaches is a start
        player = rng.choice(sorted(_reach(floor_walls(size, floor), frozenset(box_set), player)))
        walls = floor_walls(size, floor)
        room = {
            "walls": sorted(map(list, walls)),
            "targets": sorted(map(list, targets)),
            "boxes": sorted(map(list, box_set)),
            "player": list(player),
        }
        if solve_pushes(room):
            return room
    raise RuntimeError(f"could not generate a {size}x{size} room with {boxes} boxes")


def floor_walls(size: int, floor: set[Cell]) -> set[Cell]:
    """Every cell of the size x size square that is not floor."""
    return {(r, c) for r in range(size) for c in range(size)} - floor


def _carve(size: int, rng: random.Random) -> set[Cell]:
    """Floor cells carved by a random walk inside the border walls (gym-sokoban topology)."""
    inner = size - 2
    cur = (rng.randint(1, inner), rng.randint(1, inner))
    floor = {cur}
    for _ in range(int(1.5 * inner * inner)):
        dr, dc = rng.choice(list(MOVES.values()))
        nxt = (cur[0] + dr, cur[1] + dc)
        if 1 <= nxt[0] <= inner and 1 <= nxt[1] <= inner:
            cur = nxt
            floor.add(cur)
    return floor


def _reverse_play(
    floor: set[Cell], targets: set[Cell], player: Cell, steps: int, rng: random.Random
) -> tuple[set[Cell], Cell] | None:
    """Play backwards from the solved state: moving away from an adjacent box may pull it.

    Returns the visited state whose boxes are farthest (summed Manhattan distance) from the
    targets, None when no box ever left its target.
    """
    boxes = set(targets)
    best, best_d = None, 0
    for _ in range(steps):
        dr, dc = rng.choice(list(MOVES.values()))
        nxt = (player[0] + dr, player[1] + dc)
        if nxt not in floor or nxt in boxes:
            continue
        behind = (player[0] - dr, player[1] - dc)
        if behind in boxes:  # pull: the box follows into the cell the player leaves
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
        d = sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes)
        if d > best_d and boxes != targets:
            best, best_d = (set(boxes), player), d
    return best


# -- solvers --------------------------------------------------------------------------------
def _parts(room: dict[str, Any]) -> tuple[set[Cell], frozenset[Cell], frozenset[Cell], Cell]:
    walls = {tuple(c) for c in room["walls"]}
    return (
        walls,
        frozenset(tuple(c) for c in room["targets"]),
        frozenset(tuple(c) for c in room["boxes"]),
        tuple(room["player"]),
    )


def _reach(walls: set[Cell], boxes: frozenset[Cell], player: Cell) -> set[Cell]:
    seen, queue = {player}, deque([player])
    while queue:
        for n in _neighbours(queue.popleft()):
            if n not in seen and n not in walls and n not in boxes:
                seen.add(n)
                queue.append(n)
    return seen


def solve_pushes(room: dict[str, Any], limit: int = 200_000) -> int | None:
    """Fewest box pushes that solve `room` (0 if solved), or None if it cannot be solved.

    Breadth-first over (box positions, the player's reachable region), one push per edge.
    """
    walls, targets, boxes, player = _parts(room)
    if boxes == targets:
        return 0
    start_reach = _reach(walls, boxes, player)
    start = (boxes, min(start_reach))
    seen = {start}
    queue = deque([(boxes, start_reach, 0)])
    while queue and len(seen) < limit:
        bx, reach, depth = queue.popleft()
        for b in bx:
            for dr, dc in MOVES.values():
                stand, dest = (b[0] - dr, b[1] - dc), (b[0] + dr, b[1] + dc)
                if stand not in reach or dest in walls or dest in bx:
                    continue
                nb = (bx - {b}) | {dest}
                if nb == targets:
                    return depth + 1
                r = _reach(walls, nb, b)
                key = (nb, min(r))
                if key not in seen:
                    seen.add(key)
                    queue.append((nb, r, depth + 1))
    return None


def solve_moves(room: dict[str, Any], limit: int = 200_000) -> list[str] | None:
    """A shortest move sequence (e.g. ["Up", "Left"]) that solves `room`, or None."""
    walls, targets, boxes, player = _parts(room)
    if boxes == targets:
        return []
    start = (player, boxes)
    prev: dict[Any, tuple[Any, str] | None] = {start: None}
    queue = deque([start])
    while queue and len(prev) < limit:
        state = queue.popleft()
        for name, (p, bx) in _successors(walls, *state):
            nxt = (p, bx)
            if nxt in prev:
                continue
            prev[nxt] = (state, name)
            if bx == targets:
                plan = []
                cur: Any = nxt
                while prev[cur] is not None:
                    cur, mv = prev[cur]
                    plan.append(mv)
                return plan[::-1]
            queue.append(nxt)
    return None


def shortest_first_moves(room: dict[str, Any]) -> list[str]:
    """The moves (e.g. ["Up"]) that begin some shortest solution of `room`: those after which
    a solution one move shorter exists. Empty when `room` is solved or cannot be solved."""
    plan = solve_moves(room)
    if not plan:
        return []
    walls, _targets, boxes, player = _parts(room)
    out = []
    for name, (p, bx) in _successors(walls, player, boxes):
        rest = solve_moves({**room, "player": list(p), "boxes": sorted(map(list, bx))})
        if rest is not None and len(rest) == len(plan) - 1:
            out.append(name)
    return out


def _successors(walls: set[Cell], player: Cell, boxes: frozenset[Cell]):
    for name, (dr, dc) in MOVES.items():
        nxt = (player[0] + dr, player[1] + dc)
        if nxt in walls:
            continue
        if nxt in boxes:
            dest = (nxt[0] + dr, nxt[1] + dc)
            if dest in walls or dest in boxes:
                continue
            yield name.capitalize(), (nxt, (boxes - {nxt}) | {dest})
        else:
            yield name.capitalize(), (nxt, boxes)


def parse_action(text: str) -> str | None:
    """The last ```Move``` block, lower-cased; None if absent or not a move."""
    blocks = _MOVE.findall(text)
    move = blocks[-1].lower() if blocks else None
    return move if move in MOVES else None


# -- the env --------------------------------------------------------------------------------
class SokobanEnv(GridGame):
    """Text Sokoban; a snapshot is a small dict, so forking is free.

    Scripted play: the expert takes the first move of a shortest solution (`solve_moves`), the
    walker any of the four moves at random (one into a wall leaves the room as it was).
    """

    invalid_prompt = "sokoban/invalid.txt"
    tools_prompt = "sokoban/system_tools.txt"

    Config = SokobanConfig
    system_prompt = prompts.load("sokoban/system.txt").strip()
    action_set = tuple(f"```{m}```" for m in WALK)

    def __init__(self, **kwargs: Any) -> None:
        self.cfg = SokobanConfig(**kwargs)
        self.use_action_format(MOVES)
        self._room: dict[str, Any] | None = None
        self._turn = 0
        self._done = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        opts = dict(options or {})
        if "room" in opts:
            room = {k: [list(c) for c in v] for k, v in opts["room"].items() if k != "player"}
            room["player"] = list(opts["room"]["player"])
        else:
            size = int(opts.get("size", self.cfg.size))
            boxes = int(opts.get("boxes", self.cfg.boxes))
            room = generate_room(size, boxes, self.cfg.reverse_steps, random.Random(seed))
        self._room, self._turn, self._done = room, 0, False
        self._start_pushes = solve_pushes(room)
        return self.render_grid(), self.turn_info(valid=True, success=self.solved)

    # -- a turn (the step is `MoveGame`'s) ----------------------------------------------------
    @property
    def started(self) -> bool:
        return self._room is not None

    def read_move(self, action: str) -> tuple[str | None, str | None]:
        if self.cfg.action_format == "tools":
            return read_move_call(action)
        return parse_action(action), None

    def play(self, move: str) -> tuple[float, str, bool, bool]:
        walls, _targets, boxes, player = _parts(self.room)
        for name, (p, bx) in _successors(walls, player, boxes):
            if name.lower() == move:
                self.room["player"] = list(p)
                self.room["boxes"] = sorted(map(list, bx))
        solved = self.solved
        return float(solved), self.render_grid(), solved, solved

    # -- forking ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        if self._room is None:
            raise RuntimeError("call reset() before snapshot()")
        return {
            "room": {
                k: [list(c) for c in v] if k != "player" else list(v) for k, v in self._room.items()
            },
            "turn": self._turn,
            "done": self._done,
            "start_pushes": self._start_pushes,
        }

    def restore(self, state: dict[str, Any]) -> None:
        room = state["room"]
        self._room = {
            k: [list(c) for c in v] if k != "player" else list(v) for k, v in room.items()
        }
        self._turn, self._done = int(state["turn"]), bool(state["done"])
        self._start_pushes = state["start_pushes"]

    def state_key(self) -> str:
        """The grid: the whole state (an invalid-action notice is not part of it)."""
        return self.render_grid()

    # -- scripted play ------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        plan = solve_moves(self.room)
        return move_action(plan[0], self.cfg.action_format) if plan else None

    def random_action(self, rng: random.Random) -> str:
        return move_action(rng.choice(WALK), self.cfg.action_format)

    def best_actions(self) -> list[str]:
        return [move_action(m, self.cfg.action_format) for m in shortest_first_moves(self.room)]

    # -- views --------------------------------------------------------------------------------
    @property
    def room(self) -> dict[str, Any]:
        assert self._room is not None
        return self._room

    @property
    def solved(self) -> bool:
        _walls, targets, boxes, _ = _parts(self.room)
        return boxes == targets

    def render_grid(self) -> str:
        walls, targets, boxes, player = _parts(self.room)
        size = 1 + max(max(r for r, _ in walls), max(c for _, c in walls))
        rows = []
        for r in range(size):
            cells = []
            for c in range(size):
                cell = (r, c)
                if cell in walls:
                    ch = "#"
                elif cell == player:
                    ch = "S" if cell in targets else "P"
                elif cell in boxes:
                    ch = "*" if cell in targets else "X"
                else:
                    ch = "O" if cell in targets else "_"
                cells.append(ch)
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def turn_info(self, *, valid: bool, success: bool) -> dict[str, Any]:
        return {
            "room": {k: v for k, v in self.room.items()},
            "start_pushes": self._start_pushes,
            "valid": valid,
            "turn": self._turn,
            "success": success,
        }
