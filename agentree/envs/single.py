"""The skeleton of the single-step envs (Countdown, math): one question, one answer, graded.

`reset` poses the task its options give (`parse_task`) or generates one from the seed
(`generate`); `step` grades the one answer (`grade`) and ends the episode; the state a fork
copies is the task and whether it was answered. A subclass supplies those three and the prompt
(`observation`, `reset_info`).
"""

from __future__ import annotations

import random
from typing import Any

from agentree.envs.base import Env


class SingleStepEnv(Env):
    """One question per episode, answered in one step (see the module)."""

    episode_name: str = "single-step"
    """How errors name the episode ("the Countdown episode is over ...")."""

    def __init__(self) -> None:
        self._task: dict[str, Any] | None = None
        self._done = False

    # -- what a subclass supplies -------------------------------------------------------------
    @staticmethod
    def parse_task(options: dict[str, Any]) -> dict[str, Any]:
        """The task `options` pose (validated; raise ValueError naming what is wrong)."""
        raise NotImplementedError

    def generate(self, rng: random.Random) -> dict[str, Any]:
        """A task drawn from `rng` (the seed's stream)."""
        raise NotImplementedError

    def observation(self) -> str:
        """The prompt posing the current task."""
        raise NotImplementedError

    def reset_info(self) -> dict[str, Any]:
        """The reset's info for the current task."""
        return {}

    def turn_limit(self) -> int:
        return 1

    def grade(self, action: str) -> tuple[float, dict[str, Any]]:
        """(reward, info) of the answer `action`; info holds at least `success`, `action_key`
        and `format_error`."""
        raise NotImplementedError

    def task_state(self) -> dict[str, Any]:
        """The current task as a snapshot holds it."""
        assert self._task is not None
        return dict(self._task)

    # -- gymnasium API ------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            self._task = self.parse_task(options)
        else:
            rng = random.Random(seed if seed is not None else int(self.np_random.integers(2**62)))
            self._task = self.generate(rng)
        self._done = False
        return self.observation(), self.reset_info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._done:
            raise RuntimeError(f"the {self.episode_name} episode is over (one step); call reset()")
        reward, info = self.grade(action)
        self._done = True
        return "", float(reward), True, False, info

    # -- forking ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.snapshot() called before reset()")
        return {"task": self.task_state(), "done": self._done}

    def restore(self, state: dict[str, Any]) -> None:
        self._task = self.parse_task(state["task"])
        self._done = bool(state["done"])
