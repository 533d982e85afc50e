"""Who makes the trees: the rollout seam of the training loop.

The loop (`agentree.run.trainer`), held-out evaluation (`agentree.run.evaluation`) and `agentree
rollout` ask a `Rollouts` for one tree per task and never learn who made them:

- `LocalRollouts` (here): the controller runs in this process against the local engine; a
  rollout submitted ahead (`train.async_steps=1`) runs on a thread against a snapshot engine
  (a second transformers engine over a copy of the policy), so the update of this step never
  changes the weights under it.
- `RayRollouts` (`agentree.distributed.scheduler`): the same controller on Ray rollout workers,
  each of which runs a `LocalRollouts` of its own.

`rollout_parts` assembles the rollout side of a config (env class, controller, scorer) for
both; an env that cannot fork meets a forking controller here, before any model is loaded.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentree.chat import ChatFormat
from agentree.config import ExperimentConfig
from agentree.engines.base import SamplingParams
from agentree.envs.base import Env, Task, env_class
from agentree.policy import hf_engine
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, make_controller
from agentree.scorers.base import NoScorer, Scorer, make_scorer, scorer_class
from agentree.tools import ToolCall, example_calls, tool_schemas
from agentree.tree import Tree


class PendingRollout(Protocol):
    def result(self, progress: Any = None) -> tuple[list[Tree], RolloutStats]: ...


class Rollouts(Protocol):
    """One tree per task, from whoever runs the controller."""

    controller: Controller

    def rollout(
        self,
        tasks: Sequence[Task],
        *,
        step: int = 0,
        progress: Any = None,
        controller: Controller | None = None,
        temperature: float | None = None,
        rng: random.Random | None = None,
    ) -> tuple[list[Tree], RolloutStats]:
        """Trees now; not a single trajectory among them is an error saying why."""
        ...

    def submit(self, tasks: Sequence[Task], *, step: int = 0) -> PendingRollout:
        """Start a rollout without waiting; `.result()` returns (trees, stats)."""
        ...

    def sync_weights(self, model: Any, *, busy: bool = False) -> None:
        """Give the engines `model`'s weights; `busy`: a submitted rollout is still sampling,
        so the engines it samples from keep their weights until it is collected."""
        ...

    def state(self) -> dict[str, Any]:
        """The random state the next rollout starts from, for a checkpoint."""
        ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class RolloutParts:
    """The rollout side of a config: what builds an env, the controller, the scorer."""

    env_cls: type[Env]
    env_kwargs: dict[str, Any]
    controller: Controller
    scorer: Scorer = field(default_factory=NoScorer)
    env_stop: tuple[str, ...] = ()
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The env's tool schemas (`tool_schemas(env.tools())`); empty: free-text actions. Like
    `env_stop`, read once from a probe env when the parts are built."""
    example_calls: list[tuple[ToolCall, ...]] = field(default_factory=list)
    """The calls of the env's example actions (`agentree.tools.example_calls`), from the same
    probe: the shortest must fit a turn (`check_room_for_a_call`)."""

    @property
    def make_env(self) -> Callable[[], Env]:
        """A new env of the config: the env class with its arguments bound (a controller calls
        it straight into the env layer, not back up through this module)."""
        return functools.partial(self.env_cls, **self.env_kwargs)


def rollout_parts(
    cfg: ExperimentConfig, *, scorer: Scorer | None = None, remote_scorer: bool = False
) -> RolloutParts:
    """Env class, controller and scorer of `cfg`. `scorer` replaces the configured one (a Ray
    worker's client of the shared scorer actor); `remote_scorer`: a scorer that holds a model
    is loaded elsewhere (in the Ray scorer actor), not here."""
    env_name, env_kwargs = cfg.component("env")
    env_cls = env_class(env_name)
    rollout_name, rollout_kwargs = cfg.component("rollout")
    controller = make_controller(rollout_name, **rollout_kwargs)
    if controller.requires_fork and env_cls.snapshot is Env.snapshot:
        raise ValueError(
            f"--rollout {rollout_name} forks environments, but {env_cls.__name__} does "
            "not implement snapshot()/restore(); use --rollout grpo or implement them"
        )
    if scorer is None:
        scorer = NoScorer()
        if controller.uses_scorer:
            scorer_name, scorer_kwargs = cfg.component("scorer")
            if not (remote_scorer and scorer_class(scorer_name).holds_model):
                scorer = make_scorer(scorer_name, **scorer_kwargs)
    parts = RolloutParts(env_cls, env_kwargs, controller, scorer)
    probe = parts.make_env()  # envs construct cheaply; resources come with reset()
    try:
        parts.env_stop = tuple(probe.stop_sequences)
        parts.tools = tool_schemas(probe.tools())
        parts.example_calls = example_calls(probe)
    finally:
        probe.close()
    return parts


class LocalRollouts:
    """The controller in this process, against `engine`."""

    def __init__(
        self, cfg: ExperimentConfig, parts: RolloutParts, engine: Any, tokenizer: Any
    ) -> None:
        self.cfg = cfg
        self.parts = parts
        self.controller = parts.controller
        self.scorer = parts.scorer
        self.engine = engine
        self.chat = ChatFormat(tokenizer, cfg.policy.tool_format)
        check_room_for_a_call(cfg, self.chat, parts)
        self.rng = random.Random(cfg.seed)
        self.make_env = parts.make_env
        self.history = cfg.engine.history_window
        self._snapshot: Any = None

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        e = self.cfg.engine
        return SamplingParams(
            max_tokens=e.max_tokens,
            temperature=e.temperature if temperature is None else temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            stop_token_ids=self.chat.stop_token_ids,
            stop=tuple(e.stop) + self.parts.env_stop,
        )

    def context(
        self, *, step: int = 0, temperature: float | None = None, progress: Any = None
    ) -> RolloutContext:
        return RolloutContext(
            engine=self.engine,
            chat=self.chat,
            sampling=self.sampling(temperature),
            env_factory=self.make_env,
            scorer=self.scorer,
            max_context=min(self.cfg.engine.max_context, self.engine.max_model_len),
            history=self.history,
            tools=self.parts.tools,
            rng=self.rng,
            env_workers=self.cfg.engine.env_workers,
            progress=progress,
            step=step,
        )

    def rollout(
        self,
        tasks: Sequence[Task],
        *,
        step: int = 0,
        progress: Any = None,
        controller: Controller | None = None,
        temperature: float | None = None,
        rng: random.Random | None = None,
    ) -> tuple[list[Tree], RolloutStats]:
        controller = controller or self.controller
        ctx = self.context(step=step, temperature=temperature, progress=progress)
        if rng is not None:
            ctx.rng = rng
        trees, stats = controller.rollout(list(tasks), ctx)
        check_not_empty(self.cfg, self.engine.max_model_len, controller, trees)
        return trees, stats

    def submit(self, tasks: Sequence[Task], *, step: int = 0) -> ThreadRollout:
        ctx = self.context(step=step)
        ctx.engine = self.snapshot_engine()
        ctx.rng = random.Random(self.rng.getrandbits(63))
        return ThreadRollout(self.controller, tasks, ctx)

    def snapshot_engine(self) -> Any:
        """A second local engine over a copy of the policy, for rollouts that overlap updates."""
        if self._snapshot is None:
            # deferred: torch is heavy, and only asynchronous steps need a second engine
            from agentree.engines.hf import HFEngine

            if not isinstance(self.engine, HFEngine):
                raise ValueError(
                    "train.async_steps=1 in-process needs engine.backend=transformers; "
                    "use distributed.backend=ray for other engines"
                )
            model = copy.deepcopy(self.engine.model).eval().requires_grad_(False)
            tok = self.engine.tokenizer
            self._snapshot = hf_engine(model, tok, self.cfg.engine, self.cfg.seed + 1)
        return self._snapshot

    def sync_weights(self, model: Any, *, busy: bool = False) -> None:
        self.engine.sync_weights(model)
        if self._snapshot is not None and not busy:
            self._snapshot.sync_weights(model)

    def state(self) -> dict[str, Any]:
        """The controller's random draws and the engine's sampler. A synchronous run resumes
        exactly; an asynchronous one samples the rollout that was in flight at the checkpoint
        again, on a fresh snapshot engine."""
        return {"rng": self.rng.getstate(), "engine": self.engine.rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.engine.set_rng_state(state["engine"])

    def close(self) -> None:
        try:
            self.scorer.close()
        finally:
            self.engine.close()


class ThreadRollout:
    """A rollout started now on a thread and collected with `result()`."""

    def __init__(self, controller: Controller, tasks: Sequence[Task], ctx: RolloutContext) -> None:
        self._out: tuple[list[Tree], RolloutStats] | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._out = controller.rollout(list(tasks), ctx)
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


def check_room_for_a_call(cfg: ExperimentConfig, chat: ChatFormat, parts: RolloutParts) -> None:
    """Raise, naming the fix, when `engine.max_tokens` cannot hold even the shortest of the env's
    example calls as the policy writes them: every action would be cut short and invalid (a
    `move` call is 25 tokens of the tiny tokenizer in Hermes, against FrozenLake's 8)."""
    if not parts.example_calls:
        return
    written = min(
        (chat.tool_format.format(c) for c in parts.example_calls), key=lambda t: len(chat.encode(t))
    )
    need = len(chat.encode(written)) + 1  # and the token that ends the turn
    limit = cfg.engine.max_tokens
    if need > limit:
        roomy = 16 * math.ceil(need * 1.25 / 16)  # a quarter more, for longer arguments
        raise ValueError(
            f"engine.max_tokens={limit} cuts every tool call short: the shortest example call of "
            f"the env's tools, {written!r}, is {need} tokens in policy.tool_format "
            f"{chat.tool_format.name} with the end of the turn; set --set engine.max_tokens="
            f"{roomy} (or more)"
        )


def check_not_empty(
    cfg: ExperimentConfig, model_len: int, controller: Controller, trees: Sequence[Tree]
) -> None:
    """Raise, saying why, when `trees` hold not a single trajectory."""
    if trees and not any(controller.group(tree) for tree in trees):
        raise ValueError(f"no trajectory could be produced: {why_empty(cfg, model_len, trees)}")


def why_empty(cfg: ExperimentConfig, model_len: int, trees: Sequence[Tree]) -> str:
    """Why `trees` hold not a single trajectory, in words a user can act on."""
    e = cfg.engine
    longest = max(trees, key=lambda t: len(t.root.obs_ids) if t.nodes else 0)
    n = len(longest.root.obs_ids) if longest.nodes else 0
    if n > min(e.max_context, model_len) - e.max_tokens:
        if e.max_context <= model_len:
            limit, fix = f"engine.max_context={e.max_context}", "raise engine.max_context"
        else:
            limit, fix = f"the policy's context of {model_len}", "use a longer-context policy"
        return (
            f"the prompt of task {longest.task_id} has {n} tokens, more than {limit} allows "
            f"with engine.max_tokens={e.max_tokens}; {fix} or shorten the task"
        )
    ended = [node for t in trees for node in t.nodes if node.end_reason is not None]
    reasons = Counter(str(node.end_reason) for node in ended)
    if reasons and set(reasons) == {"budget"}:
        budget = cfg.rollout.get("env_step_budget")
        return (
            f"the env-step budget (rollout.env_step_budget={budget}) ran out before any "
            "trajectory finished; raise it to a few episodes' worth of steps"
        )
    errors = [node.info["error"] for node in ended if "error" in node.info]
    detail = f"; first error: {errors[0]}" if errors else ""
    return (
        f"every branch of {len(trees)} task(s) ended before the policy acted "
        f"(end reasons: {dict(reasons)}){detail}"
    )
