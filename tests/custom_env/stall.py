"""A user's env whose odd-seeded episodes stall on their first step, as a hung sandbox does."""

from __future__ import annotations

import time
from typing import Any

from custom_env.mygame import GuessEnv


class StallEnv(GuessEnv):
    stalls = False

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.stalls = seed is not None and seed % 2 == 1
        return super().reset(seed=seed, options=options)

    def step(self, action: str) -> Any:
        if self.stalls:
            time.sleep(3600)
        return super().step(action)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "stalls": self.stalls}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.stalls = state["stalls"]
