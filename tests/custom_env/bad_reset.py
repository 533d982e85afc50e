"""Envs whose `reset` breaks the contract, as a user's first draft might."""

from __future__ import annotations

from typing import Any

from agentree.envs import Env


class NumberObservation(Env):
    """`reset` returns an int observation instead of text."""

    system_prompt = "Answer."

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        return 42, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return "done", 0.0, True, False, {}

    def snapshot(self) -> Any:
        return None

    def restore(self, state: Any) -> None:
        pass


class BareObservation(NumberObservation):
    """`reset` returns the observation alone, not `(observation, info)`."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        return "a bare string"
