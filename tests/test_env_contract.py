import json
import random

import pytest

from agentree.envs import (
    Env,
    EnvCheckError,
    EnvConfig,
    MoveGame,
    Task,
    check_env,
    env_class,
    make_env,
    register_env,
)
from agentree.envs.base import EVAL_SEED_OFFSET


class Drifting(Env):
    """Non-deterministic: ignores the seed."""

    def reset(self, *, seed=None, options=None):
        self.x = random.random()
        return f"{self.x}", {}

    def step(self, action):
        return "o", 0.0, False, False, {}

    def example_actions(self):
        return ["a"]


class LeakyFork(Env):
    """restore() forgets the counter: forks are not faithful."""

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return "0", {}

    def step(self, action):
        self.n += 1
        return str(self.n), float(self.n), False, False, {}

    def snapshot(self):
        return {"n": self.n}

    def restore(self, state):
        pass

    def example_actions(self):
        return ["a", "b", "c"]


class NoFork(Env):
    def reset(self, *, seed=None, options=None):
        return "s", {}

    def step(self, action):
        return "o", 0.0, True, False, {}

    def example_actions(self):
        return ["a"]


def test_frozenlake_and_user_env_pass():
    assert check_env(make_env("frozenlake"), seed=3)["forkable"]
    assert check_env(make_env("frozenlake", is_slippery=True), seed=4)["forkable"]
    assert check_env(make_env("custom_env.mygame:GuessEnv"), seed=1)["forkable"]


def test_nondeterministic_env_fails():
    with pytest.raises(EnvCheckError, match="not deterministic"):
        check_env(Drifting())


def test_unfaithful_fork_fails():
    with pytest.raises(EnvCheckError, match="fork is not faithful"):
        check_env(LeakyFork())


def test_env_without_fork():
    with pytest.raises(EnvCheckError, match="cannot be forked"):
        check_env(NoFork())
    assert check_env(NoFork(), require_fork=False)["forkable"] is False


class Counter(Env):
    """Deterministic and forkable; truncates at `limit` steps and declares `declared`."""

    def __init__(self, limit: int, declared: int):
        self.limit, self.declared = limit, declared

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return "0", {}

    def step(self, action):
        self.n += 1
        return str(self.n), 0.0, False, self.n >= self.limit, {}

    def snapshot(self):
        return self.n

    def restore(self, state):
        self.n = state

    def example_actions(self):
        return ["a", "b"]

    def turn_limit(self):
        return self.declared


def test_a_declared_turn_limit_is_checked():
    """`budget_reserve` trusts `turn_limit()`: check_env plays the sample actions in a cycle
    and fails an env still running after the limit it declares."""
    assert check_env(Counter(limit=5, declared=5))
    assert check_env(Counter(limit=3, declared=5))  # ending earlier is fine
    with pytest.raises(EnvCheckError, match="turn_limit\\(\\) is 4, but the episode was still"):
        check_env(Counter(limit=5, declared=4))
    for name in ("frozenlake", "sokoban", "babyai", "countdown"):
        env = make_env(name)
        assert env.turn_limit() == getattr(getattr(env, "cfg", None), "max_turns", 1)


class Corridor(MoveGame):
    """A user's move game: walk `right` from cell 0 to cell 3; `left` at cell 0 stays there."""

    class Config(EnvConfig):
        max_turns: int = 4
        invalid_penalty: float = 0.5

    def __init__(self, **kwargs):
        self.cfg = self.Config(**kwargs)
        self.cell = None

    def reset(self, *, seed=None, options=None):
        self.cell, self._turn, self._done = 0, 0, False
        return "cell 0", self.turn_info(valid=True, success=False)

    @property
    def started(self):
        return self.cell is not None

    def read_move(self, action):
        word = action.strip().lower()
        return (word, None) if word in ("left", "right") else (None, f"no move in {action!r}")

    def play(self, move):
        self.cell = max(0, self.cell + (1 if move == "right" else -1))
        return float(self.cell == 3), f"cell {self.cell}", self.cell == 3, self.cell == 3

    def invalid_turn(self, action, error):
        return -self.cfg.invalid_penalty, f"{error}; still cell {self.cell}"

    def turn_info(self, *, valid, success):
        return {"cell": self.cell, "valid": valid, "success": success}

    def snapshot(self):
        return (self.cell, self._turn, self._done)

    def restore(self, state):
        self.cell, self._turn, self._done = state

    def example_actions(self):
        return ["right", "left", "jump", "right"]


def test_a_move_game_needs_only_its_moves():
    """`MoveGame` owns the step: the turn count, the invalid turn (game unchanged, penalty,
    `invalid:` key), termination by a move, truncation at `max_turns`, and the info keys."""
    env = Corridor()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("right")
    env.reset(seed=0)
    assert env.step("right") == (
        "cell 1",
        0.0,
        False,
        False,
        {"cell": 1, "valid": True, "success": False, "action_key": "right", "format_error": False},
    )
    obs, reward, term, trunc, info = env.step("  jump   high ")
    assert (obs, reward, term, trunc) == (
        "no move in '  jump   high '; still cell 1",
        -0.5,
        False,
        False,
    )
    assert info == {
        "cell": 1,
        "valid": False,
        "success": False,
        "action_key": "invalid:jump high",
        "format_error": True,
    }
    assert env.step("right")[:4] == ("cell 2", 0.0, False, False)
    assert env.step("right")[:4] == ("cell 3", 1.0, True, False)  # turn 4: the move ends it
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("left")
    env.reset(seed=0)
    results = [env.step(a) for a in ("left", "right", "left", "left")]
    assert [r[3] for r in results] == [False, False, False, True]  # truncated at turn 4
    assert results[-1][4]["success"] is False and env.turn_limit() == 4
    assert check_env(Corridor(), seed=0)["forkable"]


def test_registry_and_import_paths():
    register_env("noforktest")(NoFork)
    assert env_class("noforktest") is NoFork
    assert type(make_env("custom_env.mygame:GuessEnv", high=5)).__name__ == "GuessEnv"
    with pytest.raises(ValueError, match="unknown env"):
        env_class("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        env_class("no_such_pkg.mod:Thing")
    with pytest.raises(ValueError, match=r"unknown config key 'env.hig'"):
        make_env("custom_env.mygame:GuessEnv", hig=5)


def test_task_sources(tmp_path):
    cls = env_class("frozenlake")
    train = cls.load_tasks(5, seed=0)
    held = cls.load_tasks("5", seed=0, split="eval")
    assert len(train) == len(held) == 5
    assert all(t.seed < EVAL_SEED_OFFSET for t in train)
    assert all(t.seed >= EVAL_SEED_OFFSET for t in held)
    records = [{"id": "a", "seed": 1}, {"id": "b", "seed": 2, "options": {"size": 3}}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "t.json").write_text(json.dumps(records))
    for name in ("t.jsonl", "t.json"):
        tasks = cls.load_tasks(str(tmp_path / name))
        assert tasks == [Task("a", 1), Task("b", 2, {"size": 3})]
    (tmp_path / "bad.jsonl").write_text('{"id": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        cls.load_tasks(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="no task source named"):
        cls.load_tasks("verified")
