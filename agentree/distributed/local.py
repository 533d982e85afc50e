"""In-process asynchronous rollout: the controller runs on a thread against a snapshot engine.

`train.async_steps=1` without Ray: step t+1's trees are sampled on a thread while step t
trains. The thread must not see weights change mid-rollout, so it samples from a second
transformers engine over a copy of the policy (`Runtime.snapshot_engine`), refreshed by
`Runtime.sync_weights` between rollouts.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentree.envs.base import Task
from agentree.rollout.base import RolloutStats
from agentree.tree import Tree

if TYPE_CHECKING:
    from agentree.runtime import Runtime


class ThreadRollout:
    """A rollout started now and collected with `result()`."""

    def __init__(self, rt: Runtime, tasks: Sequence[Task], step: int) -> None:
        ctx = rt.context(step=step)
        ctx.engine = rt.snapshot_engine()
        ctx.rng = random.Random(rt.rng.getrandbits(63))
        self._out: tuple[list[Tree], RolloutStats] | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._out = rt.controller.rollout(list(tasks), ctx)
            except BaseException as e:  # re-raised in the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="agentree-rollout", daemon=True)
        self._thread.start()

    def result(self, progress: Any = None) -> tuple[list[Tree], RolloutStats]:
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)  # short joins keep Ctrl-C responsive
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out
