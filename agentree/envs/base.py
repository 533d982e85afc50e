"""The environment contract: text in, text out, and forkable.

Subclass `Env`, implement `reset`/`step` (gymnasium semantics) and, if the env can be forked
mid-episode, `snapshot`/`restore`. Register it with `@register_env("name")` or point agentree at
it with `--env package.module:Class`. Run `check_env(env)` to verify it is deterministic under a
seed and that snapshot/restore reproduces the same futures.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import gymnasium
from pydantic import BaseModel, ConfigDict, ValidationError

from agentree.registry import Registry
from agentree.tools import ToolSpec

ActionFormat = Literal["text", "tools"]
"""How a policy acts in an env that offers both (`action_format` of the grid games and SWE):
free text, or calls of the env's tools."""

EVAL_SEED_OFFSET = 1_000_000_000
"""Held-out tasks draw seeds from here up, train tasks from below: the splits never overlap."""


class ForkNotSupported(NotImplementedError):
    """Raised by `snapshot`/`restore` on an env that cannot be forked mid-episode."""


class NoExpert(NotImplementedError):
    """Raised by `expert_action`/`random_action` on an env without a scripted expert."""


class EnvCheckError(AssertionError):
    """`check_env` found the env non-deterministic, unforkable or off-contract."""


@dataclass(frozen=True)
class Task:
    """What one episode is about. `reset(seed=task.seed, options=task.options)` starts it."""

    id: str
    seed: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "seed": self.seed, "options": self.options}


class EnvConfig(BaseModel):
    """Base for an env's constructor arguments; unknown keys are an error naming the key."""

    model_config = ConfigDict(extra="forbid")


class Env(gymnasium.Env):
    """A text environment: observations and actions are strings.

    `reset(*, seed, options) -> (obs, info)` and
    `step(action) -> (obs, reward, terminated, truncated, info)` follow gymnasium.
    `snapshot()` returns an opaque state capturing everything `step` depends on; `restore(state)`
    returns the env to it, any number of times and in any order, and also on a *different*
    instance built with the same config (that is how a branch forks into a new env), even one
    that was never reset. `close()` is idempotent and releases every resource the env holds
    (processes, containers, temp dirs).

    Info keys agentree reads: `action_key` (canonical form of the parsed action; repeated-action
    pruning compares these, default: the stripped action text), `success` (episode solved;
    default: reward >= 1), `prediction` (a SWE-bench style prediction dict, written to
    predictions.jsonl by `agentree eval`), `format_error` (True when the action could not be
    parsed into a well-formed action, False when it could; summaries report the well-formed
    fraction and warn when it is zero).

    Scripted play (optional): an env that implements `expert_action` and `random_action` has a
    scripted expert and a walker. The noisy expert (`agentree.models.warm.scripted_action`)
    plays `expert_action()` with probability `expert_prob`, else `random_action(rng)`; its
    episodes warm-start a policy (`policy.path: tiny-warm`/`warm`), and at `expert_prob=0` it
    is the walker whose success a learning curve is read against. Both read the env's current
    state (after `reset`/`step`); `random_action` draws from `rng` alone, so a seeded run
    replays the same demonstrations.
    """

    Config: ClassVar[type[EnvConfig]] = EnvConfig
    """Validated constructor kwargs; subclasses narrow it."""

    system_prompt: str | None = None
    """Optional system message placed before the first observation."""

    stop_sequences: tuple[str, ...] = ()
    """Strings that complete an action: the policy's turn ends as soon as it writes one."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    action_set: tuple[str, ...] = ()
    """Every action as the policy writes it, when the set is small and fixed (grid games);
    empty for free-form actions. `first_move_skill` scores a policy's choice over it. An env
    whose actions take another form in another mode (a grid game's `move` calls with tools)
    sets its instance's."""

    expert_settings: ClassVar[tuple[str, ...] | None] = None
    """The `Config` fields the expert's episodes and the prompts depend on: a warm build is
    keyed on (and built with) these alone, so a run that changes another (a turn limit, a
    reward level) reuses it. None: every field."""

    # -- tools ------------------------------------------------------------------------------
    def tools(self) -> list[ToolSpec]:
        """The functions the policy may call: OpenAI function schemas or typed, documented
        Python functions (see `agentree.tools`). Empty (the default): free-text actions.

        With tools, `step` receives a `ToolAction`: the raw text (it is a `str`) with `.calls`
        parsed in the policy's call format and `.error` when the turn is not a well-formed call;
        `agentree.tools.as_tool_action` parses plain text from scripted policies. An info key
        `tool_results` (one string per call) delivers the results as one tool message each;
        otherwise the observation is one tool message. Read once per run from a freshly built
        env (`agentree.rollouts.rollout_parts`), so they follow the env's config, not a task.
        """
        return []

    # -- forking ----------------------------------------------------------------------------
    def snapshot(self) -> Any:
        raise ForkNotSupported(
            f"{type(self).__name__} does not implement snapshot()/restore(), so it cannot be "
            "forked mid-episode; use a flat rollout (--rollout grpo) or implement them."
        )

    def restore(self, state: Any) -> None:
        raise ForkNotSupported(
            f"{type(self).__name__} does not implement snapshot()/restore(), so it cannot be "
            "forked mid-episode; use a flat rollout (--rollout grpo) or implement them."
        )

    def close(self) -> None:
        """Release resources; safe to call more than once."""

    # -- state identity ---------------------------------------------------------------------
    def state_key(self) -> str | None:
        """A string equal for two positions of the env iff they are the same state, or None.

        Step-level estimators (GiGPO's anchor states, RTMC's signatures) group the turns of a
        task's rollouts taken from equal keys. agentree records the key on each tree node
        (`node.info["state_key"]`) right after `reset`/`step`; None (the default) means the
        observation text stands for the state. Override it when the observation carries more
        than the state (an invalid-action notice, a turn counter) or less.
        """
        return None

    def turn_limit(self) -> int | None:
        """The most steps an episode can take (it is truncated there), or None: unknown.

        `rollout.budget_reserve` reserves a trajectory's remaining steps up to it when the
        trajectory starts, so a branch is started only when the env-step budget can finish it.
        """
        return None

    # -- tasks ------------------------------------------------------------------------------
    @classmethod
    def load_tasks(
        cls, spec: int | str | Path | None = None, *, seed: int = 0, split: str = "train"
    ) -> list[Task]:
        """Tasks from a count (seeded, split-disjoint), a JSON/JSONL file, or a named source."""
        if spec is None:
            spec = 16
        if isinstance(spec, str) and spec.isdigit():
            spec = int(spec)
        if isinstance(spec, int):
            return cls.generate_tasks(spec, seed=seed, split=split)
        path = Path(spec)
        if path.suffix in {".json", ".jsonl"} or path.exists():
            return records_to_tasks(cls, read_records(path), path)
        return cls.named_tasks(str(spec), seed=seed, split=split)

    @classmethod
    def generate_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """The first `n` tasks of the env's default source: one reset seed per task."""
        base = (EVAL_SEED_OFFSET if split == "eval" else 0) + seed * 100_003
        return [Task(id=f"{split}-{seed}-{i}", seed=base + i) for i in range(n)]

    @classmethod
    def named_tasks(cls, name: str, *, seed: int = 0, split: str = "train") -> list[Task]:
        raise ValueError(
            f"{cls.__name__} has no task source named {name!r} and no file {name!r} exists; "
            "pass a count, a JSON/JSONL file of tasks, or a source the env documents."
        )

    @classmethod
    def task_from_record(cls, record: dict[str, Any]) -> Task:
        """Map one JSON record to a Task; the default reads {"id", "seed", "options"}."""
        known = {"id", "seed", "options"}
        if not isinstance(record, dict) or not known.issuperset(record) or "id" not in record:
            raise ValueError(
                f"{cls.__name__} expects task records like "
                '{"id": "...", "seed": 1, "options": {...}}, got keys '
                f"{sorted(record) if isinstance(record, dict) else type(record).__name__}"
            )
        seed, options = record.get("seed"), record.get("options")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f'"seed" must be an integer or null, got {seed!r}')
        if options is not None and not isinstance(options, dict):
            raise ValueError(f'"options" must be a mapping of reset options, got {options!r}')
        return Task(str(record["id"]), seed, dict(options or {}))

    @classmethod
    def prepare_tasks(
        cls,
        tasks: Sequence[Task],
        *,
        progress: Callable[[str], None] | None = None,
        **config: Any,
    ) -> None:
        """Make sure `tasks` can run with env settings `config` (e.g. build missing images,
        reporting through `progress`); the default does nothing."""

    @classmethod
    def scripted_policy(
        cls, name: str, tools: Sequence[dict[str, Any]] = ()
    ) -> ScriptedPolicy | None:
        """A non-model policy by name (e.g. SWE's `gold`/`empty` sanity checks), or None;
        `tools`: the env's tool schemas when it acts through tools (the policy then calls them)."""
        return None

    # -- scripted play ----------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The scripted expert's action in the current state, None where it has none (e.g. the
        goal is out of reach: the noisy expert then plays `random_action`)."""
        raise NoExpert(
            f"{type(self).__name__} has no scripted expert; implement expert_action() and "
            "random_action() to warm-start a policy on it, or fine-tune one with agentree sft."
        )

    def random_action(self, rng: random.Random) -> str:
        """The walker's action: a valid action drawn at random from `rng` (and nothing else)."""
        raise NoExpert(
            f"{type(self).__name__} has no walker; implement random_action() beside "
            "expert_action()."
        )

    def best_actions(self) -> list[str]:
        """Every action that begins a shortest solution from the current state (what
        `first_move_skill` checks a policy's most likely action against); the default is the
        expert's action alone."""
        action = self.expert_action()
        return [] if action is None else [action]

    # -- helpers for tooling ----------------------------------------------------------------
    def example_actions(self) -> list[str]:
        """A few well-formed actions, used by `check_env` and to build tiny tokenizers.

        The default samples `action_space` when the env defines one (gymnasium leaves it
        unset on text envs), else returns none: agentree then asks for them where it needs them.
        """
        space = getattr(self, "action_space", None)
        return [str(space.sample()) for _ in range(4)] if space is not None else []

    def corpus(self, tasks: Sequence[Task]) -> list[str]:
        """Representative text (observations and actions) for training a tiny tokenizer."""
        texts = [self.system_prompt or ""]
        for task in tasks:
            obs, _ = reset_task(self, task)
            texts.append(obs)
            for a in self.example_actions():
                texts.append(a)
                obs, _, term, trunc, _ = self.step(a)
                texts.append(obs)
                if term or trunc:
                    break
        return texts


class MoveGame(Env):
    """The step of a game played one move a turn (FrozenLake, Sokoban, BabyAI).

    A turn reads one move from the action (`read_move`). A turn without one leaves the game as
    it was (`invalid_turn` says what it costs and shows); a move is played (`play`). The episode
    ends when a move ends it, or is truncated at `cfg.max_turns`. Each turn's info is the game's
    (`turn_info`) with `action_key` (the move, or `invalid:` and the action's first 64
    characters) and `format_error`. A subclass sets `_turn` and `_done` in `reset` and keeps
    them in its snapshot.
    """

    _turn: int = 0
    _done: bool = False

    # -- what a subclass supplies -------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether `reset` has set a game up (`step` and `snapshot` need one)."""
        raise NotImplementedError

    def read_move(self, action: str) -> tuple[str | None, str | None]:
        """(move, None) for one well-formed move, else (None, why not in a sentence, or None
        for the game's own notice)."""
        raise NotImplementedError

    def play(self, move: str) -> tuple[float, str, bool, bool]:
        """Play a well-formed move: (reward, observation, terminated, success)."""
        raise NotImplementedError

    def invalid_turn(self, action: str, error: str | None) -> tuple[float, str]:
        """(reward, observation) of a turn that holds no well-formed move (`error` from
        `read_move`); the game is unchanged."""
        raise NotImplementedError

    def turn_info(self, *, valid: bool, success: bool) -> dict[str, Any]:
        """The info of the current state after a turn (`valid`: it held a move)."""
        raise NotImplementedError

    # -- gymnasium API ------------------------------------------------------------------------
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self.started:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("episode is over; call reset()")
        self._turn += 1
        move, error = self.read_move(action)
        if move is None:
            reward, obs = self.invalid_turn(action, error)
            terminated = success = False
            key = "invalid:" + " ".join(action.split())[:64]
        else:
            reward, obs, terminated, success = self.play(move)
            key = move
        truncated = not terminated and self._turn >= self.cfg.max_turns
        self._done = terminated or truncated
        info = self.turn_info(valid=move is not None, success=success)
        info.update(action_key=key, format_error=move is None)
        return obs, reward, terminated, truncated, info

    def turn_limit(self) -> int:
        return self.cfg.max_turns


def reset_task(env: Env, task: Task) -> tuple[str, dict[str, Any]]:
    """`env.reset` for `task`; whatever goes wrong, a reset that raises or one that breaks the
    contract (not a `(str, dict)` pair), becomes one `ValueError` naming the task."""
    try:
        out = env.reset(seed=task.seed, options=task.options)
    except Exception as e:
        raise ValueError(
            f"task {task.id} ({_preview(task.to_dict())}) could not be reset: "
            f"{type(e).__name__}: {e}"
        ) from e
    problems: list[str] = []
    if isinstance(out, tuple) and len(out) == 2:
        _check_reset(*out, problems)
    else:
        problems.append(f"reset() must return (observation, info), got {_preview(out, 60)}")
    if problems:
        raise ValueError(
            f"{type(env).__name__}.{problems[0]} (task {task.id}); check_env(env) checks the "
            "whole env contract"
        )
    return out


def has_expert(cls: type[Env]) -> bool:
    """Whether `cls` implements the scripted expert and walker (`Env.expert_action`)."""
    return cls.expert_action is not Env.expert_action and cls.random_action is not Env.random_action


ScriptedPolicy = Callable[[Task, list[tuple[str, str]]], str]
"""(task, [(action, observation), ...] so far) -> next action text."""


def records_to_tasks(cls: type[Env], records: Iterable[Any], source: str | Path) -> list[Task]:
    """Map records through `cls.task_from_record`; an error names `source` and the record."""
    tasks = []
    for i, record in enumerate(records, 1):
        try:
            tasks.append(cls.task_from_record(record))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{source}: record {i} ({_preview(record)}): {e}") from None
    return tasks


def _preview(record: Any, limit: int = 120) -> str:
    try:
        text = json.dumps(record, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(record)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records from a JSON list/object file or a JSONL file, with errors naming the line."""
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        return out
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    return data if isinstance(data, list) else [data]


# -- registry -------------------------------------------------------------------------------
ENVS: Registry[type[Env]] = Registry(
    "env",
    Env,
    {
        "frozenlake": "agentree.envs.frozenlake:FrozenLakeEnv",
        "swebench": "agentree.envs.swe.env:SWEEnv",
        "countdown": "agentree.envs.countdown:CountdownEnv",
        "math": "agentree.envs.math:MathEnv",
        "sokoban": "agentree.envs.sokoban:SokobanEnv",
        "babyai": "agentree.envs.babyai:BabyAIEnv",
    },
)


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    """Class decorator: make an Env subclass available as `make_env(name)` / `--env name`."""
    return ENVS.register(name)


def env_names() -> list[str]:
    return ENVS.names()


def env_class(name: str) -> type[Env]:
    """Resolve a registered name or a `module:Class` path to an Env subclass."""
    return ENVS.get(name)


def validate_env_kwargs(cls: type[Env], kwargs: dict[str, Any], where: str = "env") -> dict:
    """Check kwargs against `cls.Config`; returns them with defaults filled in."""
    try:
        return cls.Config(**kwargs).model_dump()
    except ValidationError as e:
        raise ValueError(format_validation_error(e, where)) from None


def make_env(name: str, **kwargs: Any) -> Env:
    """Instantiate an env by registered name or `module:Class`, validating its kwargs."""
    cls = env_class(name)
    return cls(**validate_env_kwargs(cls, kwargs))


def format_validation_error(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors():
        key = ".".join([where, *[str(x) for x in err["loc"]]])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown config key '{key}'")
        else:
            parts.append(f"bad value for '{key}': {err['msg']}")
    return "; ".join(parts)


# -- checker --------------------------------------------------------------------------------
def check_env(
    env: Env,
    *,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    actions: Sequence[str] | None = None,
    require_fork: bool = True,
) -> dict[str, Any]:
    """Check an env against the contract; raise `EnvCheckError` listing what failed.

    Checks: reset/step types; seeded reset is deterministic; the same seed and actions give the
    same episode; snapshot/restore reproduces the next step exactly, also when one snapshot is
    restored several times and snapshots are restored out of order; an env that declares a
    `turn_limit()` ends every episode by then (the sample actions played in a cycle); close is
    idempotent. Returns a small report ({"deterministic": True, "forkable": bool, ...}).
    """
    acts = list(actions) if actions is not None else list(env.example_actions())
    if not acts:
        raise EnvCheckError(
            "check_env needs sample actions: pass actions=[...] or implement "
            f"{type(env).__name__}.example_actions()"
        )
    problems: list[str] = []

    def episode() -> list[tuple]:
        obs, info = env.reset(seed=seed, options=options)
        _check_reset(obs, info, problems)
        out: list[tuple] = [(obs,)]
        for a in acts:
            res = env.step(a)
            _check_step(res, problems)
            out.append(tuple(res[:4]))
            if res[2] or res[3]:
                break
        return out

    first, second = episode(), episode()
    if first[0] != second[0]:
        problems.append(
            "reset(seed=...) is not deterministic: two resets gave different observations"
        )
    elif first != second:
        problems.append(
            "the same seed and actions gave different episodes (step is not deterministic)"
        )

    limit = env.turn_limit()
    if limit is not None:
        env.reset(seed=seed, options=options)
        for t in range(1, limit + 1):
            res = env.step(acts[(t - 1) % len(acts)])
            if res[2] or res[3]:
                break
        else:
            problems.append(
                f"turn_limit() is {limit}, but the episode was still running after {limit} steps"
            )

    forkable = True
    try:
        _check_fork(env, seed, options, acts, problems)
    except ForkNotSupported as e:
        forkable = False
        if require_fork:
            problems.append(str(e))
    env.close()
    try:
        env.close()
    except Exception as e:  # any exception here is a contract violation
        problems.append(f"close() is not idempotent: second call raised {e!r}")
    if problems:
        raise EnvCheckError(f"{type(env).__name__} failed check_env:\n- " + "\n- ".join(problems))
    return {"deterministic": True, "forkable": forkable, "steps_checked": len(first) - 1}


def _check_reset(obs: Any, info: Any, problems: list[str]) -> None:
    if not isinstance(obs, str):
        problems.append(f"reset() must return a str observation, got {type(obs).__name__}")
    if not isinstance(info, dict):
        problems.append(f"reset() must return an info dict, got {type(info).__name__}")


def _check_step(res: Any, problems: list[str]) -> None:
    if not (isinstance(res, tuple) and len(res) == 5):
        problems.append("step() must return (obs, reward, terminated, truncated, info)")
        return
    obs, reward, term, trunc, info = res
    if not isinstance(obs, str):
        problems.append(f"step() observation must be str, got {type(obs).__name__}")
    if not isinstance(reward, int | float):
        problems.append(f"step() reward must be a number, got {type(reward).__name__}")
    if not isinstance(term, bool) or not isinstance(trunc, bool):
        problems.append("step() terminated/truncated must be bools")
    if not isinstance(info, dict):
        problems.append("step() info must be a dict")


def _check_fork(
    env: Env, seed: int, options: dict | None, acts: list[str], problems: list[str]
) -> None:
    """Snapshot at two points, then replay the next step from each in a scrambled order."""
    env.reset(seed=seed, options=options)
    snaps: list[tuple[Any, tuple]] = []
    for i, a in enumerate(acts):
        state = env.snapshot()
        state_copy = copy.deepcopy(state) if _cheap_to_copy(state) else None
        res = env.step(a)
        snaps.append((state, tuple(res[:4]), a))
        if state_copy is not None and not _same(state_copy, state):
            problems.append("stepping the env mutated a snapshot taken before the step")
        if res[2] or res[3] or i >= 3:
            break
    order = list(range(len(snaps)))
    order = order[::-1] + order + [order[0]]  # out of order, then in order, then one again
    for k in order:
        state, expected, a = snaps[k]
        try:
            env.restore(state)
            got = tuple(env.step(a)[:4])
        except ForkNotSupported:
            raise
        except Exception as e:  # report, don't crash the checker
            problems.append(f"restore/step from snapshot {k} raised {e!r}")
            return
        if got != expected:
            problems.append(
                f"restoring snapshot {k} and repeating action {a!r} gave {got[:2]!r}, "
                f"expected {expected[:2]!r} (fork is not faithful)"
            )
            return


def _cheap_to_copy(state: Any) -> bool:
    return isinstance(state, dict | list | tuple | str | int | float | bytes)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays inside: treat as unknown, not failure
        return True
