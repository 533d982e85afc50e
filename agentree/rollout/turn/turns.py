"""Turn-level branch machinery shared by the multi-turn controllers.

A `Branch` is a live path of a tree: its leaf node, the exact context ids the policy conditions
on, and an env positioned at that node's state. `TurnRunner.advance` takes one turn for every
given branch with a single batched engine call and concurrent env steps; `TurnRunner.fork`
splits a branch into children that continue from the same env state via snapshot/restore, so
the shared prefix is never re-simulated.

With an env-step budget (`rollout.env_step_budget=N`) the runner counts each task's env steps
and `advance` never lets a task take more than N: when fewer steps are left than the task has
branches to step, the first ones (in the order given) step and the others end with
`EndReason.BUDGET`. Controllers ask `left(tree)` to decide what to start.

With `rollout.budget_reserve` the runner itself admits new branches: each one reserves the
steps it may take up to the env's turn limit (`Env.turn_limit()`) when it starts (`start`,
`add_root_branches`, `fork`, `branch_at`), and gives back the rest when it ends. A request the
unreserved budget cannot cover gets fewer branches (`branch_at`: None), so no branch is ever
cut; `left(tree)` is then the unreserved budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from agentree.engines.base import Completion
from agentree.envs.base import Env, ScriptedPolicy, Task, reset_task
from agentree.rollout.base import RolloutContext, RolloutStats, call_info
from agentree.scorers.base import Score
from agentree.tools import ToolAction
from agentree.tree import EndReason, Tree


def _key_info(key: str | None) -> dict[str, str]:
    """The env's state key for a node's info (see `Env.state_key`); nothing when it has none."""
    return {} if key is None else {"state_key": str(key)}


@dataclass
class Branch:
    tree: Tree
    task: Task
    node: int
    env: Env | None
    context: list[int]
    keys: list[str] = field(default_factory=list)
    """Canonical action keys along the path, for repeated-action pruning."""

    @property
    def turn(self) -> int:
        return self.tree.nodes[self.node].turn

    def repeats(self) -> int:
        """How many times the last action was repeated consecutively (1 = not repeated)."""
        if not self.keys:
            return 0
        n = 1
        while n < len(self.keys) and self.keys[-1 - n] == self.keys[-1]:
            n += 1
        return n


class TurnRunner:
    """Owns the envs of one rollout call; use as a context manager so they are always closed."""

    def __init__(
        self,
        ctx: RolloutContext,
        stats: RolloutStats,
        budget: int | None = None,
        *,
        reserve: bool = False,
    ) -> None:
        self.ctx = ctx
        self.stats = stats
        self.budget = budget or None
        """Env steps each task may take; None: no limit."""
        self.reserve = reserve and self.budget is not None
        """Admit a branch only when the budget can finish it (see the module)."""
        self.spent: dict[int, int] = {}
        """id(tree) -> env steps its task has taken."""
        self._live: dict[int, dict[int, Branch]] = {}
        """id(tree) -> its live branches by id(), whose remaining turns are reserved."""
        self._limit: int | None = None
        self.cut: set[int] = set()
        """id() of the branches the budget ended in the last `advance` (they took no step)."""
        self._envs: list[Env] = []
        self._free: list[Env] = []
        self._pool = ThreadPoolExecutor(max_workers=max(1, ctx.env_workers))

    def __enter__(self) -> TurnRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        errors = []
        for env in self._envs:
            try:
                env.close()
            except Exception as e:  # keep closing the others
                errors.append(e)
        self._envs.clear()
        self._free.clear()
        if errors:
            raise errors[0]

    # -- envs --------------------------------------------------------------------------------
    def _new_env(self) -> Env:
        if self._free:
            return self._free.pop()
        env = self.ctx.env_factory()
        self._envs.append(env)
        return env

    def release(self, branch: Branch) -> None:
        """The branch ended: its env may host another branch later."""
        if branch.env is not None:
            self._free.append(branch.env)
            branch.env = None

    def _map(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    # -- the env-step budget ------------------------------------------------------------------
    def left(self, tree: Tree) -> int:
        """Env steps `tree`'s task may still take (a large number without a budget); with
        `reserve`, those not reserved by its live branches."""
        if self.budget is None:
            return 1 << 62
        left = self.budget - self.spent.get(id(tree), 0)
        if self.reserve:
            limit = self.turn_limit()
            left -= sum(limit - b.turn for b in self._live.get(id(tree), {}).values())
        return left

    def turn_limit(self) -> int:
        """The env's turn limit, which `reserve` needs (read once, from the first env)."""
        if self._limit is None:
            env = self._new_env()
            self._free.append(env)
            limit = env.turn_limit()
            if limit is None:
                raise ValueError(
                    f"rollout.budget_reserve needs the env's turn limit, and "
                    f"{type(env).__name__}.turn_limit() returns None: implement it, or leave "
                    "budget_reserve off (branches the budget ends are then cut)"
                )
            if self.budget is not None and self.budget < limit:
                raise ValueError(
                    f"rollout.env_step_budget={self.budget} cannot finish one episode of up to "
                    f"{limit} turns, which rollout.budget_reserve requires: raise the budget"
                )
            self._limit = limit
        return self._limit

    def room(self, tree: Tree, turn: int) -> int:
        """How many new branches standing at `turn` the budget admits now (no limit without
        `reserve`)."""
        if not self.reserve:
            return 1 << 62
        return max(0, self.left(tree)) // max(1, self.turn_limit() - turn)

    def _admit(self, branches: list[Branch]) -> list[Branch]:
        """New branches; with `reserve` their remaining turns are now reserved."""
        if self.reserve:
            for b in branches:
                self._live.setdefault(id(b.tree), {})[id(b)] = b
        return branches

    def _within_budget(
        self, branches: list[Branch], completions: list[Completion] | None
    ) -> tuple[list[Branch], list[Completion] | None, list[Branch]]:
        """(branches that may step, their completions, branches the budget cuts)."""
        if self.budget is None:
            return branches, completions, []
        taken: dict[int, int] = {}
        keep: list[int] = []
        for i, b in enumerate(branches):
            t = id(b.tree)  # steps not yet taken, reserved or not (with `reserve` none is cut)
            if taken.get(t, 0) < self.budget - self.spent.get(t, 0):
                taken[t] = taken.get(t, 0) + 1
                keep.append(i)
        kept = set(keep)
        cut = [b for i, b in enumerate(branches) if i not in kept]
        comps = None if completions is None else [completions[i] for i in keep]
        return [branches[i] for i in keep], comps, cut

    # -- starting ----------------------------------------------------------------------------
    def start(
        self, tasks: Sequence[Task], branches_per_task: int, *, fork: bool
    ) -> list[list[Branch]]:
        """One tree per task with `branches_per_task` branches at the root.

        With `fork=True` the env is reset once per task and the other branches restore its
        snapshot; with `fork=False` every branch resets its own env (flat sampling).
        """
        if self.reserve:  # a fresh tree admits budget // limit whole episodes
            branches_per_task = min(branches_per_task, self.budget // self.turn_limit())
        resets = [(t, i) for t in tasks for i in range(1 if fork else branches_per_task)]
        envs = [self._new_env() for _ in resets]

        def reset(args: tuple[Env, tuple[Task, int]]) -> tuple[str, dict, str | None]:
            env, (task, _) = args
            return (*reset_task(env, task), env.state_key())

        results = self._map(reset, list(zip(envs, resets, strict=True)))
        out: list[list[Branch]] = []
        k = 0
        for task in tasks:
            obs, info, key = results[k]
            tree = Tree(task.id, task.to_dict())
            if self.ctx.history is not None:  # every turn's prompt comes from the window
                tree.meta["history"] = self.ctx.history
            env0 = envs[k]
            prompt = self.ctx.chat.prompt_ids(obs, env0.system_prompt, self.ctx.tools)
            tree.add_root(obs, prompt, {"env": info, **_key_info(key)})
            if fork:
                (root,) = self._admit([Branch(tree, task, 0, env0, list(prompt))])
                out.append(self.fork(root, branches_per_task))
                k += 1
            else:
                branches = []
                for _ in range(branches_per_task):
                    branches.append(Branch(tree, task, 0, envs[k], list(prompt)))
                    k += 1
                out.append(self._admit(branches))
        return out

    def add_root_branches(self, tree: Tree, task: Task, n: int) -> list[Branch]:
        """`n` more branches at `tree`'s root, each on a freshly reset env (no fork); fewer
        when `reserve` admits fewer."""
        envs = [self._new_env() for _ in range(min(n, self.room(tree, 0)))]
        self._map(lambda e: reset_task(e, task), envs)
        return self._admit([Branch(tree, task, 0, env, list(tree.root.obs_ids)) for env in envs])

    # -- forking -----------------------------------------------------------------------------
    def fork(self, branch: Branch, m: int) -> list[Branch]:
        """`m` branches continuing from `branch`'s state; the first keeps its env. Fewer
        when `reserve` admits fewer (`branch` itself is always the first)."""
        m = 1 + min(m - 1, self.room(branch.tree, branch.turn))
        if m <= 1:
            return [branch]
        assert branch.env is not None
        state = branch.env.snapshot()
        targets = [self._new_env() for _ in range(m - 1)]
        self._map(lambda e: e.restore(state), targets)
        self.stats.forks += m - 1
        children = [
            replace(branch, env=env, context=list(branch.context), keys=list(branch.keys))
            for env in targets
        ]
        return [branch, *self._admit(children)]

    def branch_at(self, tree: Tree, task: Task, node: int, state: Any) -> Branch | None:
        """A new branch continuing from `node` of `tree`, on an env restored to `state` (the
        snapshot taken when a branch stood at that node): one fork. None when `reserve`
        admits no branch there."""
        if self.room(tree, tree.nodes[node].turn) < 1:
            return None
        env = self._new_env()
        env.restore(state)
        self.stats.forks += 1
        keys = [
            str(n.info.get("env", {}).get("action_key", " ".join((n.action or "").split())))
            for n in tree.path(node)[1:]
        ]
        (branch,) = self._admit([Branch(tree, task, node, env, tree.context_ids(node), keys)])
        return branch

    # -- stepping ----------------------------------------------------------------------------
    def generate(self, branches: Sequence[Branch], **overrides: Any) -> list[Completion]:
        params = replace(self.ctx.sampling, **overrides) if overrides else self.ctx.sampling
        before = self.ctx.engine.stats.snapshot()
        outs = self.ctx.engine.generate([b.context for b in branches], params)
        after = self.ctx.engine.stats.snapshot()
        self.stats.policy_tokens_generated += after["tokens_generated"] - before["tokens_generated"]
        self.stats.policy_tokens_prefilled += after["tokens_prefilled"] - before["tokens_prefilled"]
        self.stats.policy_tokens_cached += after["tokens_cached"] - before["tokens_cached"]
        self.stats.policy_tokens_evicted += after["tokens_evicted"] - before["tokens_evicted"]
        return [o[0] for o in outs]

    def advance(
        self,
        branches: Sequence[Branch],
        completions: Sequence[Completion] | None = None,
        *,
        theta: int | None = None,
    ) -> tuple[list[Branch], list[Branch]]:
        """Take one turn for each branch; returns (still active, ended).

        Branches whose context leaves no room for a response end with `max_tokens` before
        generating; `completions`, when given, are aligned with `branches`. With `theta`, a
        branch that has now taken the same action `theta` times in a row ends as
        `pruned_repeat`. Branches beyond their task's env-step budget end with `budget`
        after the others stepped (so a node a sibling continued from is not marked a leaf).
        """
        room = self.ctx.max_context - self.ctx.sampling.max_tokens
        ended = [b for b in branches if len(b.context) > room]
        for b in ended:
            self._end(b, EndReason.MAX_TOKENS)
        fits = [i for i, b in enumerate(branches) if len(b.context) <= room]
        live = [branches[i] for i in fits]
        if completions is not None:
            completions = [completions[i] for i in fits]
        live, completions, cut = self._within_budget(live, completions)
        self.cut = {id(b) for b in cut}
        active, ended = self._step(live, completions, ended, theta)
        for b in cut:
            self._end(b, EndReason.BUDGET)
        if cut:
            self.stats.extra["budget_cut"] = self.stats.extra.get("budget_cut", 0.0) + len(cut)
        return active, ended + cut

    def _step(
        self,
        live: list[Branch],
        completions: Sequence[Completion] | None,
        ended: list[Branch],
        theta: int | None,
    ) -> tuple[list[Branch], list[Branch]]:
        if not live:
            return [], ended
        if completions is None:
            completions = self.generate(live)
        chat = self.ctx.chat
        actions = [
            chat.parse_action(chat.decode_action(c.token_ids), self.ctx.tools) for c in completions
        ]

        def step(args: tuple[Branch, str]) -> tuple[Any, float]:
            b, action = args
            t0 = time.perf_counter()
            try:
                assert b.env is not None
                res = b.env.step(action)
                return (res, b.env.state_key()), time.perf_counter() - t0
            except Exception as e:  # the branch ends; the rollout goes on
                return e, time.perf_counter() - t0

        results = self._map(step, list(zip(live, actions, strict=True)))
        active: list[Branch] = []
        for b, comp, action, (res, dt) in zip(live, completions, actions, results, strict=True):
            self.stats.env_steps += 1
            self.spent[id(b.tree)] = self.spent.get(id(b.tree), 0) + 1
            node_fields: dict[str, Any] = {
                "action": action,
                "action_ids": list(comp.token_ids),
                "logprobs": list(comp.logprobs),
            }
            if isinstance(res, Exception):
                self.stats.env_errors += 1
                node = b.tree.add_child(b.node, **node_fields, info={"error": repr(res)})
                b.node = node.id
                self._end(b, EndReason.ENV_ERROR)
                ended.append(b)
                continue
            (obs, reward, terminated, truncated, info), key = res
            finished = terminated or truncated
            results = self._tool_results(action, obs, info)
            obs_ids = [] if finished else chat.observation_ids(obs, comp.token_ids, results)
            extra = {"env": info, "step_s": round(dt, 4), "finish": comp.finish_reason}
            extra.update(call_info(action))
            extra.update(_key_info(key))
            if comp.entropies is not None:
                extra["entropy"] = comp.entropies
            node = b.tree.add_child(
                b.node,
                **node_fields,
                observation=obs,
                obs_ids=obs_ids,
                reward=float(reward),
                terminated=bool(terminated),
                truncated=bool(truncated),
                info=extra,
            )
            b.node = node.id
            if b.tree.history is None:
                b.context += list(comp.token_ids) + obs_ids
            else:  # the root and the last k turns: the prompt the update trains this turn on
                b.context = b.tree.context_ids(node.id)
            b.keys.append(str(info.get("action_key", " ".join(action.split()))))
            if terminated:
                self._end(b, EndReason.COMPLETED)
            elif truncated:
                self._end(b, EndReason.MAX_TURNS)
            elif theta is not None and b.repeats() >= theta:
                self._end(b, EndReason.PRUNED_REPEAT)
            else:
                active.append(b)
                continue
            ended.append(b)
        return active, ended

    def _tool_results(self, action: str, obs: str, info: dict[str, Any]) -> list[str] | None:
        """The tool messages answering `action`'s calls (None: a user turn), counted."""
        if not isinstance(action, ToolAction):
            return None
        self.stats.count_calls(action, info)
        if not action.calls:  # nothing was called: the notice comes back as a user turn
            return None
        results = info.get("tool_results")
        ok = isinstance(results, list) and len(results) == len(action.calls)
        return [str(r) for r in results] if ok else [obs]

    def end(self, branch: Branch, reason: EndReason) -> None:
        """End a live branch early (e.g. pruned by score)."""
        self._end(branch, reason)

    def _end(self, b: Branch, reason: EndReason) -> None:
        node = b.tree.nodes[b.node]
        if node.end_reason is None and not node.children:
            node.end_reason = reason
        if reason in (EndReason.PRUNED_LOW_SCORE, EndReason.PRUNED_REPEAT):
            self.stats.pruned += 1
        self._live.get(id(b.tree), {}).pop(id(b), None)  # its unused reservation goes back
        self.release(b)

    # -- scoring -----------------------------------------------------------------------------
    def score(self, task: Task, branches: Sequence[Branch]) -> list[float | None]:
        """Score live branches; values land on their nodes, failures count as fallbacks."""
        if not branches:
            return []
        paths = [b.tree.path(b.node) for b in branches]
        self.stats.scorer_calls += len(branches)
        try:
            scores = self.ctx.scorer.score(task, paths)
        except Exception as e:  # a broken scorer must not kill the rollout
            scores = [Score(None, {"error": repr(e)}) for _ in branches]
        if len(scores) != len(branches):
            raise RuntimeError(
                f"scorer {type(self.ctx.scorer).__name__} returned {len(scores)} scores for "
                f"{len(branches)} branches"
            )
        values: list[float | None] = []
        for b, s in zip(branches, scores, strict=True):
            node = b.tree.nodes[b.node]
            v = s.value
            if v is not None and not (0.0 <= v <= 1.0):
                s.info["out_of_range"] = v
                v = None
            node.score = v
            if s.info:
                node.info["scorer"] = s.info
            if v is None:
                self.stats.scorer_fallbacks += 1
            elif isinstance(s.info.get("fallback"), str):
                # the scorer substituted a score of its own (e.g. the judge's heuristic): still
                # a fallback, and broken down by kind
                self.stats.scorer_fallbacks += 1
                key = f"scorer_fallback_{s.info['fallback']}"
                self.stats.extra[key] = self.stats.extra.get(key, 0.0) + 1
            values.append(v)
        return values


def scripted_episode(
    env: Env,
    task: Task,
    policy: ScriptedPolicy,
    *,
    tree: Tree | None = None,
    stop: threading.Event | None = None,
    max_steps: int | None = None,
) -> Tree:
    """One episode of a scripted policy (an env's expert, walker or sanity policy: no engine,
    one action a turn) on `env` from `task`, recorded as a one-path tree in the same shape as a
    sampled one: the reset's observation at the root, a child per step with its action, reward
    and `info["env"]`, and the leaf's end reason. The one loop behind scripted evaluation,
    warm-start demonstrations, the walker reference and the PRM's labelled episodes.

    `tree` is filled in place when given, so a caller that records failures keeps the steps
    taken before an error; `stop` set ends the episode with `KeyboardInterrupt` before its next
    step. `max_steps` stops it after that many steps, its leaf not ended and `env` left in the
    state reached (a probe of the states an episode passes through). Errors propagate.
    """
    tree = Tree(task.id, task.to_dict()) if tree is None else tree
    obs, info = reset_task(env, task)
    tree.add_root(obs, [], {"env": info})
    node, history = 0, []
    while max_steps is None or len(history) < max_steps:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        action = policy(task, history)
        obs, reward, terminated, truncated, info = env.step(action)
        history.append((action, obs))
        child = tree.add_child(
            node,
            action=action,
            observation=obs,
            reward=float(reward),
            terminated=terminated,
            truncated=truncated,
            info={"env": info},
        )
        node = child.id
        if terminated or truncated:
            child.end_reason = EndReason.COMPLETED if terminated else EndReason.MAX_TURNS
            return tree
    return tree
