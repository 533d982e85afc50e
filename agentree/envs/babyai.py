"""BabyAI as a text game, on the `minigrid` package's procedural levels (nothing downloaded).

The agent sees the 7x7 patch in front of it (minigrid's partial view, walls occlude), rendered
as text the way BALROG's BabyAI wrapper renders it: the mission, then one line per thing in
view with its distance (``a red ball 1 step left and 2 steps forward``; the nearest wall straight
ahead, left and right when nothing stands in between), then what the agent carries. The
policy answers with one action in triple backticks, the last such block counting, as in the
other grid games: ```turn left```, ```turn right```, ```forward```, ```pickup```, ```drop``` or
```toggle``` (case and spacing are free; BALROG's ``go forward`` and ``pick up`` are read too). An
unparseable answer changes nothing (an optional penalty, `info["format_error"]`). Reward 1 when
minigrid's own verifier says the mission is done (the episode ends), else 0; the episode is
truncated at `max_turns` (minigrid's own step limit is lifted).

`plan` is a breadth-first planner over the true grid (agent position and direction, door
states, object positions, what is carried): the fewest actions that complete the mission. The
env reports its length (`info["plan_left"]`, and `info["start_plan"]` at the start), which the
`babyai` process scorer turns into progress; its first action is the scripted expert's.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
import re
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium
from pydantic import Field

from agentree import prompts
from agentree.envs.base import EnvConfig, MoveGame, Task

log = logging.getLogger(__name__)

LEVELS = {
    "GoToObj": "BabyAI-GoToObj-v0",
    "GoToLocal": "BabyAI-GoToLocal-v0",
    "PickupLoc": "BabyAI-PickupLoc-v0",
    "OpenDoor": "BabyAI-OpenDoor-v0",
    "UnlockLocal": "BabyAI-UnlockLocal-v0",
    "GoToObjMazeS4R2": "BabyAI-GoToObjMazeS4R2-v0",
    "GoToObjMazeS4": "BabyAI-GoToObjMazeS4-v0",
}
"""Shipped levels (`level`) and their minigrid ids: one object in a room; one of several in a
room; a described object to pick up; a described door to open among several rooms; a locked
door whose key lies in the room; and two mazes of 2x2 and 3x3 small rooms joined by doors."""

ACTIONS = ("turn left", "turn right", "forward", "pickup", "drop", "toggle")
"""The action vocabulary, in minigrid's action order (left, right, forward, pickup, drop,
toggle)."""
_ALIASES = {"go forward": "forward", "pick up": "pickup"}
_BLOCK = re.compile(r"```([^`]*)```")
_DIRS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's DIR_TO_VEC: east, south, west, north
_PLAN_ORDER = (2, 0, 1, 3, 5, 4)  # forward first: between equally short plans, fewer turns early
_NO_PLAN_LIMIT = 200_000
Pos = tuple[int, int]


def _minigrid_note(*args: object, **_kwargs: object) -> None:
    """minigrid's notes while it samples a level ("Sampling rejected: ..."), as debug log lines."""
    log.debug(" ".join(map(str, args)))


class BabyAIConfig(EnvConfig):
    level: Literal[tuple(LEVELS)] = "GoToLocal"  # type: ignore[valid-type]
    """Which BabyAI level generates the episodes (see `LEVELS`)."""
    max_turns: int = Field(32, ge=1)
    """Episode turn limit (one action per turn)."""
    invalid_penalty: float = 0.0
    """Reward subtracted for an unparseable action (nothing changes)."""
    stop_after_move: bool = True
    """End the policy's turn once it has written a complete action."""


def parse_action(text: str) -> str | None:
    """The last ```...``` block as a canonical action (case and spacing free), else None."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return None
    words = " ".join(blocks[-1].lower().split())
    words = _ALIASES.get(words, words)
    return words if words in ACTIONS else None


# -- rendering ---------------------------------------------------------------------------------
def _steps(n: int, where: str) -> str:
    return f"{n} step{'s' if n > 1 else ''} {where}"


def _name(obj: Any) -> str:
    if obj.type != "door":
        return f"a {obj.color} {obj.type}"
    state = "locked" if obj.is_locked else "open" if obj.is_open else "closed"
    return f"{'an' if state == 'open' else 'a'} {state} {obj.color} door"


def describe(env: Any) -> list[str]:
    """What the agent sees, one line each, as BALROG's BabyAI text describes it: the nearest
    wall forward, left and right (if nothing stands before it), every other visible thing
    with its offset, then what is carried."""
    grid, visible = env.gen_obs_grid()
    ax, ay = grid.width // 2, grid.height - 1  # the agent's cell in its own view

    def seen(x: int, y: int) -> Any:
        return grid.get(x, y) if visible[x, y] else None

    lines = []
    for name, (dx, dy) in (("forward", (0, -1)), ("left", (-1, 0)), ("right", (1, 0))):
        x, y, n = ax + dx, ay + dy, 1
        while 0 <= x < grid.width and 0 <= y < grid.height:
            cell = seen(x, y)
            if cell is not None:
                if cell.type == "wall":
                    lines.append(f"a wall {_steps(n, name)}")
                break
            x, y, n = x + dx, y + dy, n + 1
    for x in range(grid.width):
        for y in range(grid.height):
            cell = seen(x, y)
            if (x, y) == (ax, ay) or cell is None or cell.type == "wall":
                continue
            parts = []
            if x != ax:
                parts.append(_steps(abs(x - ax), "left" if x < ax else "right"))
            if y != ay:
                parts.append(_steps(ay - y, "forward"))
            lines.append(f"{_name(cell)} {' and '.join(parts)}")
    if env.carrying is not None:
        lines.append(f"you carry {_name(env.carrying)}")
    return lines


# -- planner -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _World:
    """The parts of a level that no action changes, and the mission's targets."""

    size: tuple[int, int]
    blocked: frozenset[Pos]  # walls and lava: never entered
    filled: frozenset[Pos]  # static cells that are not empty (nothing can be dropped there)
    doors: tuple[tuple[Pos, str], ...]  # (position, colour)
    door_at: dict[Pos, int]
    kinds: tuple[tuple[str, str], ...]  # (type, colour) of each movable object
    pickable: frozenset[int]  # objects a plan may pick up: mission targets, keys of locked doors
    mission: str  # "goto" | "pickup" | "open"
    goto: frozenset[Pos]
    targets: frozenset[int]  # object indices (pickup) or door indices (open)

    @property
    def key(self) -> tuple[Any, ...]:
        """Everything but `door_at` (derived from `doors`): equal keys plan alike."""
        return (
            self.size,
            self.blocked,
            self.filled,
            self.doors,
            self.kinds,
            self.pickable,
            self.mission,
            self.goto,
            self.targets,
        )


# (position, direction, carried object or -1, object positions (None: carried), open doors
# bitmask, locked doors bitmask)
_State = tuple[Pos, int, int, tuple[Pos | None, ...], int, int]


def _abstract(env: Any) -> tuple[_World, _State]:
    """The planner's view of a minigrid level: static world plus the state actions change."""
    # deferred: minigrid is an optional extra (`pip install agentree[babyai]`)
    from minigrid.envs.babyai.core.verifier import GoToInstr, OpenInstr, PickupInstr

    blocked, filled, doors, door_objs, objs, positions = set(), set(), [], [], [], []
    open_bits = locked_bits = 0
    for x in range(env.grid.width):
        for y in range(env.grid.height):
            cell = env.grid.get(x, y)
            if cell is None:
                continue
            if cell.type == "door":
                if cell.is_open:
                    open_bits |= 1 << len(doors)
                if cell.is_locked:
                    locked_bits |= 1 << len(doors)
                doors.append(((x, y), cell.color))
                door_objs.append(cell)
            elif cell.type in ("key", "ball", "box"):
                objs.append(cell)
                positions.append((x, y))
            else:
                filled.add((x, y))
                if not cell.can_overlap() or cell.type == "lava":
                    blocked.add((x, y))
    carried = -1
    if env.carrying is not None:
        carried = len(objs)
        objs.append(env.carrying)
        positions.append(None)
    instr = env.instrs
    if isinstance(instr, GoToInstr):
        mission, targets = "goto", frozenset()
    elif isinstance(instr, PickupInstr):
        mission = "pickup"
        wanted = instr.desc.obj_set
        targets = frozenset(i for i, o in enumerate(objs) if any(o is t for t in wanted))
    elif isinstance(instr, OpenInstr):
        mission = "open"
        targets = frozenset(
            i for i, d in enumerate(door_objs) if any(d is t for t in instr.desc.obj_set)
        )
    else:
        raise ValueError(f"the babyai planner cannot plan for a {type(instr).__name__} mission")
    locked_colours = {c for i, (_, c) in enumerate(doors) if locked_bits >> i & 1}
    keys = {i for i, o in enumerate(objs) if o.type == "key" and o.color in locked_colours}
    world = _World(
        size=(env.grid.width, env.grid.height),
        blocked=frozenset(blocked),
        filled=frozenset(filled),
        doors=tuple(doors),
        door_at={p: i for i, (p, _) in enumerate(doors)},
        kinds=tuple((o.type, o.color) for o in objs),
        pickable=frozenset(keys | (targets if mission == "pickup" else set())),
        mission=mission,
        goto=frozenset(tuple(int(v) for v in p) for p in getattr(instr.desc, "obj_poss", []))
        if mission == "goto"
        else frozenset(),
        targets=targets,
    )
    pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    return world, (pos, int(env.agent_dir), carried, tuple(positions), open_bits, locked_bits)


def _successors(w: _World, s: _State) -> list[tuple[int, _State, bool]]:
    """minigrid's dynamics on the abstract state: (action, next state, mission done by it) for
    every action, in `_PLAN_ORDER`."""
    pos, d, carried, objpos, opened, locked = s
    front = (pos[0] + _DIRS[d][0], pos[1] + _DIRS[d][1])
    obj = objpos.index(front) if front in objpos else -1
    door = w.door_at.get(front, -1)
    out = []
    for action in _PLAN_ORDER:
        nxt, done = s, False
        if action == 0:
            nxt = (pos, (d - 1) % 4, carried, objpos, opened, locked)
        elif action == 1:
            nxt = (pos, (d + 1) % 4, carried, objpos, opened, locked)
        elif action == 2:
            if front not in w.blocked and obj < 0 and (door < 0 or opened >> door & 1):
                nxt = (front, d, carried, objpos, opened, locked)
        elif action == 3:
            if carried < 0 and obj >= 0 and obj in w.pickable:
                moved = (*objpos[:obj], None, *objpos[obj + 1 :])
                nxt = (pos, d, obj, moved, opened, locked)
                done = w.mission == "pickup" and obj in w.targets
        elif action == 4:
            if carried >= 0 and obj < 0 and door < 0 and front not in w.filled:
                moved = (*objpos[:carried], front, *objpos[carried + 1 :])
                nxt = (pos, d, -1, moved, opened, locked)
        elif door >= 0:  # toggle
            bit = 1 << door
            if locked & bit:
                if carried >= 0 and w.kinds[carried] == ("key", w.doors[door][1]):
                    nxt = (pos, d, carried, objpos, opened | bit, locked & ~bit)
            else:
                nxt = (pos, d, carried, objpos, opened ^ bit, locked)
            done = w.mission == "open" and door in w.targets and bool(nxt[4] & bit)
        if w.mission == "goto":
            (px, py), nd = nxt[0], nxt[1]
            done = (px + _DIRS[nd][0], py + _DIRS[nd][1]) in w.goto
        out.append((action, nxt, done))
    return out


_PLANS: OrderedDict[tuple[Any, _State], tuple[int, ...]] = OrderedDict()
"""Plans already found, by (world, state): a walker revisits states, and every state on a
found plan gets the rest of it. Bounded (`_PLAN_CACHE`), least recently used out first."""
_PLAN_CACHE = 200_000


def plan(env: Any, limit: int = _NO_PLAN_LIMIT) -> list[str] | None:
    """A shortest action sequence that completes `env`'s mission from its current state (BFS
    over the true grid), None when there is none within `limit` states.

    The plans move only what the mission needs: they pick up its target (pickup missions) and
    keys of locked doors, drop what is carried, and open and close doors; they never move a
    distractor (which a shortest plan would do only to clear a blocked way, and the levels'
    generators keep ways clear). A mission that is done by any next action (GoTo while already
    facing the target) has a plan of one action.
    """
    world, start = _abstract(env)
    wkey = world.key
    if (wkey, start) in _PLANS:  # plans only: "none found" depends on `limit`
        _PLANS.move_to_end((wkey, start))
        return [ACTIONS[a] for a in _PLANS[(wkey, start)]]
    prev: dict[_State, tuple[_State, int] | None] = {start: None}
    queue = deque([start])
    result: tuple[int, ...] | None = None
    while queue and len(prev) < limit and result is None:
        s = queue.popleft()
        for action, nxt, done in _successors(world, s):
            if done:
                path, cur = [(s, action)], s
                while prev[cur] is not None:
                    cur, a = prev[cur]  # type: ignore[misc]
                    path.append((cur, a))
                path.reverse()
                result = tuple(a for _, a in path)
                for i, (state, _) in enumerate(path):
                    _PLANS[(wkey, state)] = result[i:]
                break
            if nxt not in prev:
                prev[nxt] = (s, action)
                queue.append(nxt)
    while len(_PLANS) > _PLAN_CACHE:
        _PLANS.popitem(last=False)
    return None if result is None else [ACTIONS[a] for a in result]


# -- the env -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Snapshot:
    """A fork point: a private copy of the minigrid level (grid, agent, carried object, step
    count, random state, verifier) and the wrapper's own counters."""

    level: Any
    turn: int
    done: bool
    plan: tuple[str, ...] | None
    known: bool
    start_plan: int | None


class BabyAIEnv(MoveGame):
    """Text BabyAI on minigrid; a snapshot is a deep copy of the level, so a fork costs a few
    milliseconds.

    Scripted play: the expert takes the planner's next action (`plan`), the walker any of the
    six actions at random.
    """

    Config = BabyAIConfig
    system_prompt = prompts.load("babyai/system.txt").strip()
    action_set = tuple(f"```{a}```" for a in ACTIONS)
    # the expert's episodes play to the run's turn limit (a wandering noisy expert fills it);
    # stop sequences and the penalty change neither them nor the prompts
    expert_settings = ("level", "max_turns")

    def __init__(self, **kwargs: Any) -> None:
        self.cfg = BabyAIConfig(**kwargs)
        if self.cfg.stop_after_move:
            self.stop_sequences = self.action_set
        self._level: Any = None
        self._turn = 0
        self._done = False
        self._plan: tuple[str, ...] | None = None
        self._known = False  # whether self._plan is the current state's
        self._start_plan: int | None = None

    def _make(self) -> Any:
        try:
            # deferred: minigrid is an optional extra (`pip install agentree[babyai]`);
            # importing it registers the BabyAI levels with gymnasium
            import minigrid  # noqa: F401
        except ImportError:
            raise ImportError(
                "--env babyai needs the minigrid package: pip install 'agentree[babyai]'"
            ) from None
        # deferred: part of the optional minigrid, imported just above
        from minigrid.envs.babyai.core import roomgrid_level

        # minigrid prints every layout it rejects while it samples one, which is not news here:
        # its module-level `print` goes to the debug log instead. Not `redirect_stdout`: rollouts
        # reset envs in worker threads, and threads swapping `sys.stdout` at once leave it
        # pointing at a buffer, after which every print of the run is lost.
        roomgrid_level.print = _minigrid_note
        # the turn limit is the wrapper's: lift minigrid's own
        return gymnasium.make(LEVELS[self.cfg.level], max_steps=10**9).unwrapped

    # -- episode ------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"babyai tasks take no reset options, got {sorted(options)}")
        if self._level is None:
            self._level = self._make()
        self._level.reset(seed=seed)
        self._turn, self._done, self._known = 0, False, False
        self._start_plan = self.plan_left()
        return self.render(), self.turn_info(valid=True, success=False)

    # -- a turn (the step is `MoveGame`'s) ----------------------------------------------------
    @property
    def started(self) -> bool:
        return self._level is not None

    def read_move(self, action: str) -> tuple[str | None, str | None]:
        return parse_action(action), None

    def play(self, move: str) -> tuple[float, str, bool, bool]:
        on_plan = self._known and self._plan is not None and self._plan[:1] == (move,)
        _, r, terminated, _, _ = self._level.step(ACTIONS.index(move))
        success = bool(terminated and r > 0)
        # a step along the plan leaves the rest of it a shortest plan; a finished episode
        # has none (a failed one, which minigrid's strict verifiers end, cannot be done)
        self._plan = self._plan[1:] if on_plan and self._plan else None
        self._known = on_plan
        if terminated:
            self._plan, self._known = ((), True) if success else (None, True)
        return float(success), self.render(), bool(terminated), success

    def invalid_turn(self, action: str, error: str | None) -> tuple[float, str]:
        obs = prompts.render("babyai/invalid.txt", observation=self.render()).strip()
        return -self.cfg.invalid_penalty, obs

    # -- forking ------------------------------------------------------------------------------
    def snapshot(self) -> _Snapshot:
        if self._level is None:
            raise RuntimeError("call reset() before snapshot()")
        return _Snapshot(
            copy.deepcopy(self._level),
            self._turn,
            self._done,
            self._plan,
            self._known,
            self._start_plan,
        )

    def restore(self, state: _Snapshot) -> None:
        self._level = copy.deepcopy(state.level)
        self._turn, self._done = state.turn, state.done
        self._plan, self._known, self._start_plan = state.plan, state.known, state.start_plan

    def state_key(self) -> str:
        """Agent position and direction, what it carries, and the whole grid: equal keys are
        equal states (the invalid-action notice and the turn count are not part of it)."""
        lv = self._level
        grid = hashlib.sha1(lv.grid.encode().tobytes()).hexdigest()[:16]
        held = "" if lv.carrying is None else f"{lv.carrying.color} {lv.carrying.type}"
        return f"{tuple(int(v) for v in lv.agent_pos)}:{lv.agent_dir}:{held}:{grid}"

    # -- planning and scripted play -----------------------------------------------------------
    def plan_left(self) -> int | None:
        """Length of a shortest plan from the current state: 0 once the mission is done, None
        when it cannot be done from here (or the episode ended in failure)."""
        if not self._known:
            found = plan(self._level)
            self._plan, self._known = (None if found is None else tuple(found)), True
        return None if self._plan is None else len(self._plan)

    def expert_action(self) -> str | None:
        if self.plan_left() is None or not self._plan:
            return None
        return f"```{self._plan[0]}```"

    def random_action(self, rng: random.Random) -> str:
        return f"```{rng.choice(ACTIONS)}```"

    def best_actions(self) -> list[str]:
        """Every action after which a plan one action shorter exists (or that completes the
        mission)."""
        left = self.plan_left()
        if left is None:
            return []
        out = []
        for action in ACTIONS:
            trial = copy.deepcopy(self._level)
            _, r, terminated, _, _ = trial.step(ACTIONS.index(action))
            if terminated:
                rest = 0 if r > 0 else None
            else:
                found = plan(trial)
                rest = None if found is None else len(found)
            if rest is not None and rest == left - 1:
                out.append(f"```{action}```")
        return out

    # -- views --------------------------------------------------------------------------------
    @property
    def mission(self) -> str:
        return str(self._level.mission)

    def render(self) -> str:  # type: ignore[override]
        view = describe(self._level) or ["nothing in view"]
        text = prompts.render("babyai/observation.txt", mission=self.mission, view="\n".join(view))
        return text.strip()

    def example_actions(self) -> list[str]:
        return [*self.action_set[:3], "```Turn  Left```", "no action", "```toggle```"]

    def corpus(self, tasks: list[Task]) -> list[str]:
        """Observations and actions in the proportions the policy sees them (tiny
        tokenizers): a few scripted steps per task."""
        texts = [prompts.load("babyai/invalid.txt")]
        rng = random.Random(0)
        for task in tasks:
            texts.append(self.system_prompt or "")
            texts.append(self.reset(seed=task.seed, options=task.options)[0])
            for _ in range(4):
                action = self.random_action(rng)
                texts.append(action)
                obs, _, term, trunc, _ = self.step(action)
                texts.append(obs)
                if term or trunc:
                    break
        return texts

    def turn_info(self, *, valid: bool, success: bool) -> dict[str, Any]:
        return {
            "valid": valid,
            "turn": self._turn,
            "success": success,
            "mission": self.mission,
            "plan_left": self.plan_left(),
            "start_plan": self._start_plan,
        }
