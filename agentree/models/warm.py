"""Warm-started tiny policies: the tiny policy fine-tuned on a weak scripted expert.

The papers start RL from an instruction-tuned model that already answers in format and is
mediocre at the task. At toy scale the same starting point is the locally built tiny policy
(`agentree.hub.tiny`) supervised with `agentree.models.sft.run_sft` on demonstrations of a noisy
expert, so that it answers in format and succeeds only part of the time. The expert is the
env's own (`Env.expert_action`, `Env.random_action`; any env that implements them can be warm
started): each turn the expert's action with probability `expert_prob`, otherwise a random
valid one (`scripted_action`). On FrozenLake that is the BFS-optimal move or a move that stays
on the map; imitating the mixture puts the optimal move at probability about
expert_prob + (1 - expert_prob) / 4 in the policy, and RL then has to sharpen it. On Countdown
it is the exhaustive solver's expression or the numbers joined by random operators (in format,
mostly wrong), after a short think block.

With `pretrain_episodes` the build has two phases: the tiny model is first fine-tuned on a
strong expert (`pretrain_expert_prob`), which teaches it to read the task (where the goal is,
which moves are shortest), then on the noisy expert, whose behaviour it takes on. The result
knows the shortest move but samples it only part of the time, the way an instruct model knows
more than it reliably does; RL has that knowledge to sharpen. (Measured: a 4-layer model
supervised on 450 batches of the 0.5-expert's demonstrations alone stays at the walker's level,
while 450 batches of the 0.9-expert's teach it to read the map. `first_move_skill` tells the
two apart: how often the policy's most likely move is a shortest one, against the probability
it puts on those moves.)

Builds are cached like `tiny` (content hash of the base policy and the settings).
The walker (`expert_prob=0`: random valid actions), the reference a learning curve is read
against, is `walker_success`.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentree.envs.base import Env, env_class, has_expert, validate_env_kwargs
from agentree.hub.pretrained import local_policy
from agentree.hub.store import build_once, cache_root, content_key
from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env
from agentree.models.sft import SFTConfig, run_sft, windowed_all
from agentree.rollout.turn.turns import scripted_episode
from agentree.tools import ToolCall, as_tool_action, tool_schemas, written_format


class WarmConfig(BaseModel):
    """How the warm-started tiny policy (`policy.path: tiny-warm`) is built."""

    model_config = ConfigDict(extra="forbid")

    base: str = "tiny"
    """The policy the expert's demonstrations fine-tune: `tiny` (built for the env), or any
    `--policy` value, such as `smollm2-135m` or a checkpoint directory (`policy.path: warm`)."""
    expert_prob: float = Field(0.5, ge=0.0, le=1.0)
    """Probability that a demonstrated action is the expert's (else a random valid one)."""
    episodes: int = Field(400, ge=1)
    """Demonstration episodes (one per task; a single-step env's are its problems)."""
    epochs: int = Field(2, ge=1)
    """SFT passes over the demonstrations."""
    lr: float = Field(2e-3, gt=0.0)
    """SFT peak learning rate (a from-scratch tiny model takes a large one)."""
    batch_size: int = Field(4, ge=1)
    """SFT examples per optimiser step."""
    seed: int = 0
    """Seeds the demonstrations and the SFT order."""
    pretrain_episodes: int = Field(0, ge=0)
    """Episodes of a strong expert the tiny model is fine-tuned on first, so that it learns to
    read the task before it imitates the noisy expert (0: no such phase)."""
    pretrain_expert_prob: float = Field(0.9, ge=0.0, le=1.0)
    """The strong expert's `expert_prob`: a few random moves take its episodes off the shortest
    path, so the model also sees the states it will reach by its own mistakes."""
    pretrain_epochs: int = Field(3, ge=1)
    """SFT passes over the strong expert's demonstrations."""
    pretrain_lr: float = Field(3e-3, gt=0.0)
    """SFT peak learning rate of that first phase."""
    pretrain_turns: Literal["episode", "single"] = "episode"
    """What one example of the first phase holds: a whole episode of the strong expert, or
    (`single`) one of its turns, the observation it saw and the move it made, so every prompt
    holds one map. Measured on Sokoban 6x6 (`benchmarks/warm_probe.py --env sokoban`, 4-layer
    tiny model, lr 1e-3, batch 32): single turns put the most likely first move on a shortest
    path on 61% of 100 held-out rooms after 200 steps, whole episodes on 46% after 200 steps
    of five times the moves; whole episodes at lr 3e-3, batch 16 stayed at chance (loss ln 4
    a move) for 3 epochs."""


# -- scripted play -------------------------------------------------------------------------------
def scripted_action(env: Env, expert_prob: float, rng: random.Random) -> str:
    """The noisy expert's action in `env`'s current state: `env.expert_action()` with
    probability `expert_prob`, else (or where the expert has no action) `env.random_action`.

    `expert_prob=0` is the walker, 1 the expert. One uniform draw per turn comes first whatever
    `expert_prob` is, so the walker's draws line up with the expert's.
    """
    if rng.random() < expert_prob:
        action = env.expert_action()
        if action is not None:
            return action
    return env.random_action(rng)


def expert_steps(
    env: Env, task: Any, expert_prob: float, rng: random.Random
) -> tuple[tuple[str, dict[str, Any]], list[tuple[str, str, float, bool, bool, dict[str, Any]]]]:
    """One episode of the noisy expert (`scripted_action`) on `env`: the first observation and
    info, then (action, observation, reward, terminated, truncated, info) for every step."""
    tree = scripted_episode(
        env, task, lambda _task, _history: scripted_action(env, expert_prob, rng)
    )
    root, *path = tree.nodes
    steps = [
        (n.action, n.observation, n.reward, n.terminated, n.truncated, n.info["env"]) for n in path
    ]
    return (root.observation, root.info["env"]), steps


def expert_episode(
    env: Env, task: Any, expert_prob: float, rng: random.Random
) -> tuple[list[dict[str, str]], bool]:
    """(chat messages, success) of one episode of the noisy expert (`expert_steps`). In tool
    mode the moves are OpenAI `tool_calls` answered by `tool` messages, so `agentree sft`
    writes them in the policy's call format."""
    (obs, _), steps = expert_steps(env, task, expert_prob, rng)
    messages = episode_messages(env, obs, [(action, o) for action, o, *_ in steps])
    info = steps[-1][-1]
    return messages[:-1], bool(info.get("success", steps[-1][2] >= 1.0))


def episode_messages(
    env: Env, observation: str, steps: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """Chat messages of an episode on `env` from its first `observation` and its (action,
    observation) steps, ending with the last observation. Where the env has tools the actions
    are OpenAI `tool_calls` answered by `tool` messages, which the policy's chat format writes
    in its call format (`agentree.models.sft.example_from_messages`)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": observation}]
    tools = env.tools()
    for i, (action, obs) in enumerate(steps):
        if tools:
            (call,) = as_tool_action(action, tools).calls
            call = ToolCall(call.name, call.arguments, f"call_{i}")
            messages.append({"role": "assistant", "content": "", "tool_calls": [call.to_openai()]})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": obs})
        else:
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
    return messages


def walker_success(
    env_name: str,
    env_kwargs: dict[str, Any],
    tasks: Sequence[Any],
    *,
    samples: int = 4,
    expert_prob: float = 0.0,
    seed: int = 0,
) -> float:
    """Success rate of the noisy expert of `env_name` on `tasks` (`samples` episodes each).

    With the default `expert_prob=0` this is the walker (random valid actions): the figure a
    learning curve on the same tasks has to beat to show the policy learned the task.
    """
    env = env_class(env_name)(**env_kwargs)
    rng = random.Random(seed)
    try:
        wins = sum(
            expert_episode(env, task, expert_prob, rng)[1] for task in tasks for _ in range(samples)
        )
    finally:
        env.close()
    return wins / max(len(tasks) * samples, 1)


def walker_baseline(cfg: Any) -> float | None:
    """The walker's success on an experiment's held-out tasks; None for an env without a
    scripted expert or without a fixed action set (`Env.action_set`: a free-form answer such
    as Countdown's drawn at random is no reference for a curve)."""
    env_name, env_kwargs = cfg.component("env")
    cls = env_class(env_name)
    if not has_expert(cls) or not cls.action_set:
        return None
    tasks = cls.load_tasks(cfg.eval.tasks, seed=cfg.seed, split="eval")
    # at least 32 walks per task: the walker costs no model call, and a handful of walks would
    # make the reference noisier than the curve it is read against
    samples = max(cfg.eval.samples, 32)
    return walker_success(env_name, env_kwargs, tasks, samples=samples, seed=cfg.seed)


def first_move_skill(
    model: Any, chat: Any, env: Env, tasks: Sequence[Any], prefix: Sequence[int] = ()
) -> dict[str, float]:
    """What a policy knows against what it samples, on the first action of `tasks`, for an env
    with a small fixed action set (`Env.action_set`) and `Env.best_actions` (`action_skill`
    over each task's first observation; `maps` counts the tasks with a best action).

    `top1` for a policy that knows nothing much: FrozenLake about 0.31 (it knows only which
    moves stay on the map), Sokoban about 0.27 (most rooms have one shortest first move).
    The prompt is the rollouts' (the env's system prompt and tools); `prefix` goes before it.
    """
    tools = tool_schemas(env.tools()) or None

    def first_states() -> Iterator[tuple[list[int], list[str]]]:
        for task in tasks:
            obs, _ = env.reset(seed=task.seed, options=task.options)
            best = env.best_actions()
            if best:
                yield [*prefix, *chat.prompt_ids(obs, env.system_prompt, tools)], best

    skill = action_skill(model, chat, env, first_states())
    return {"top1": skill["top1"], "p_best": skill["p_best"], "maps": skill["states"]}


def action_skill(
    model: Any, chat: Any, env: Env, states: Iterable[tuple[Sequence[int], Sequence[str]]]
) -> dict[str, float]:
    """What a policy knows against what it samples over `states`, each the prompt ids it is
    asked with and the env's best actions there (`Env.best_actions`), for an env with a small
    fixed action set (`Env.action_set`).

    `top1`: share of states where the policy's most likely action is a best one; `p_best`: the
    mean probability it puts on best actions, which is what sampling at temperature 1 gets;
    `states`: how many. Probabilities are over `env.action_set` only (an action of several
    tokens: the product of its tokens'), each written as the policy writes it: a tool env's
    calls in the chat's call format.
    """
    # deferred: torch takes seconds to import; config (which the CLI imports at start) imports
    # this module
    import torch

    actions = list(env.action_set)
    if not actions:
        raise ValueError(f"{type(env).__name__} has no fixed action set (Env.action_set)")
    tools = env.tools()
    written = [chat.render_calls(as_tool_action(a, tools)) if tools else a for a in actions]
    action_ids = [chat.encode(a) for a in written]
    hits, mass, n = 0, 0.0, 0
    with torch.no_grad():
        for prompt, best in states:
            p = action_probs(model, prompt, action_ids)
            hits += actions[int(p.argmax())] in best
            mass += float(sum(p[actions.index(a)] for a in best if a in actions))
            n += 1
    return {"top1": hits / max(n, 1), "p_best": mass / max(n, 1), "states": n}


def action_probs(model: Any, prompt: Sequence[int], actions: Sequence[Sequence[int]]) -> Any:
    """The policy's probabilities of the token sequences `actions` after `prompt`, normalised
    over them (one forward per distinct action prefix; single-token actions share one)."""
    # deferred: torch takes seconds to import (see first_move_skill)
    import torch

    device = next(model.parameters()).device
    logps: dict[tuple[int, ...], Any] = {}
    for ids in actions:
        for i in range(len(ids)):
            head = tuple(ids[:i])
            if head not in logps:
                x = torch.tensor([[*prompt, *head]], device=device)
                logps[head] = model(input_ids=x).logits[0, -1].float().log_softmax(-1)
    lp = torch.stack([sum(logps[tuple(a[:i])][t] for i, t in enumerate(a)) for a in actions])
    p = lp.exp()
    return p / p.sum()


# -- building ------------------------------------------------------------------------------------
def build_settings(env_name: str, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The validated env settings a warm build of `env_name` reads (`Env.expert_settings`):
    the others keep their defaults in the build, so a run that changes them reuses it."""
    cls = env_class(env_name)
    kwargs = validate_env_kwargs(cls, env_kwargs)
    keep = cls.expert_settings
    return kwargs if keep is None else {k: v for k, v in kwargs.items() if k in keep}


def build_key(
    env_name: str,
    env_kwargs: dict[str, Any],
    base: str,
    warm: WarmConfig,
    history: int | None = None,
    calls: str | None = None,
) -> str:
    """The cache name of a warm build: what determines its weights (the base policy, the env
    settings the build reads, the warm-start settings, the history window its demonstrations
    are laid out in, the format their tool calls are written in where the env has tools:
    `calls`, None without tools), nothing else."""
    kw = build_settings(env_name, env_kwargs)
    if kw.get("action_format") == "text":  # added after builds were cached: default stays out
        del kw["action_format"]
    # v3: tiny builds train on one thread (`one_thread`)
    # a setting at its default stays out of the key when it was added after builds were cached
    keep = warm.model_dump(exclude={"pretrain_turns"} if warm.pretrain_turns == "episode" else None)
    window = {} if history is None else {"history": history}
    # Hermes, the format every build with tools wrote before the setting reached builds, keeps
    # their key
    written = {} if calls in (None, "hermes") else {"calls": calls}
    return content_key(
        {"base": base, "env": env_name, "kw": kw, "warm": keep, "v": 3, **window, **written}
    )


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside: a tiny build's weights then depend on its key
    alone. Sums split across threads round differently, and the build amplifies that: the
    default FrozenLake warm start built on 2 threads put its most likely first move on a
    shortest path on 49.5% of 200 held-out maps, built on 1 thread 63.5%
    (`first_move_skill`). One thread costs the default build about 90 s (3.5 min against 2)."""
    # deferred: torch takes seconds to import; config (which the CLI imports at start) imports
    # this module
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def demonstrations(
    env_name: str, env_kwargs: dict[str, Any], warm: WarmConfig
) -> list[list[dict[str, str]]]:
    """Chat conversations of the noisy expert on training tasks (seeds apart from RL's)."""
    cls = env_class(env_name)
    # a seed block of its own, so RL's training tasks (seed * 100003 + i) are not the demos
    tasks = cls.generate_tasks(warm.episodes, seed=7 + warm.seed, split="train")
    rng = random.Random(warm.seed)
    env = cls(**env_kwargs)
    try:
        return [expert_episode(env, t, warm.expert_prob, rng)[0] for t in tasks]
    finally:
        env.close()


def single_turns(convs: Sequence[list[dict[str, str]]]) -> list[list[dict[str, str]]]:
    """Every turn of the conversations as its own example: the observation, then the move."""
    return [
        [{"role": "user", "content": c[i]["content"]}, c[i + 1]]
        for c in convs
        for i in range(0, len(c) - 1, 2)
    ]


def warm_policy_for_env(
    env_name: str,
    env_kwargs: dict[str, Any],
    tiny: TinyModelConfig,
    warm: WarmConfig,
    log: Callable[[str], None] = print,
    history: int | None = None,
    tool_format: str = "text",
) -> Path:
    """Build (or reuse) `warm.base` (by default the tiny policy for `env_name`) fine-tuned on
    the noisy expert. With `history` (the window k of `engine.history: last:k`) the episodes are
    shown turn by turn as the rollouts show them (`windowed`); single turns stay single. Where
    the env has tools, the demonstrations' calls are written in `tool_format`
    (`policy.tool_format`), the format the rollouts will read."""
    cls = env_class(env_name)
    if not has_expert(cls):
        raise ValueError(
            f"env {env_name!r} has no scripted expert (Env.expert_action) to warm-start a "
            "policy with; use policy tiny, or fine-tune one with agentree sft"
        )
    kwargs = build_settings(env_name, env_kwargs)  # all the build below reads
    if warm.base == "tiny":
        base = tiny_policy_for_env(env_name, kwargs, tiny, log=log, tool_format=tool_format)
        base_id = base.name
    else:
        base = Path(local_policy(warm.base, log)).resolve()
        base_id = str(base)
    env = cls(**kwargs)
    try:
        system, tools = env.system_prompt, tool_schemas(env.tools())
    finally:
        env.close()
    calls = written_format(tool_format).name if tools else None
    key = build_key(env_name, kwargs, base_id, warm, history, calls)

    def phase(
        start: Path,
        out: Path,
        expert: WarmConfig,
        epochs: int,
        lr: float,
        system: str,
        turns: str = "episode",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        convs = demonstrations(env_name, kwargs, expert)
        shown = f"{turns}s"
        if turns == "single":
            convs = single_turns(convs)
        elif history is not None:
            convs = windowed_all(convs, history)
            shown = f"turns, each with the last {history}"
        sft = SFTConfig(
            epochs=epochs,
            lr=lr,
            batch_size=warm.batch_size,
            seed=warm.seed,
            dtype="float32",
            device="cpu",
        )
        name = f"warm {env_name} policy"
        log(
            f"{name}: fine-tuning on {len(convs)} demonstrations ({shown}) of the expert at "
            f"{expert.expert_prob} ({epochs} epochs; built once, then cached)"
        )
        run_sft(
            start,
            convs,
            out,
            sft,
            system=system,
            tools=tools,
            log=lambda m: log(f"{name}: {m}"),
            tool_format=tool_format,
            action_format=kwargs.get("action_format"),
        )
        log(f"{name}: done in {time.perf_counter() - t0:.0f}s")

    def write(tmp: Path) -> None:
        # a real base keeps every thread: one would double its build; its weights then depend
        # on the thread count too
        with one_thread() if warm.base == "tiny" else nullcontext():
            run_phases(tmp)

    def run_phases(tmp: Path) -> None:
        if not warm.pretrain_episodes:
            phase(base, tmp, warm, warm.epochs, warm.lr, system, tools=tools)
            return
        strong = warm.model_copy(
            update={
                "expert_prob": warm.pretrain_expert_prob,
                "episodes": warm.pretrain_episodes,
                "seed": warm.seed + 1,
            }
        )
        first = tmp / "strong-expert"
        phase(
            base,
            first,
            strong,
            warm.pretrain_epochs,
            warm.pretrain_lr,
            system,
            warm.pretrain_turns,
            tools,
        )
        phase(first, tmp, warm, warm.epochs, warm.lr, system, tools=tools)
        shutil.rmtree(first)

    phases = "two SFT phases" if warm.pretrain_episodes else "one SFT phase"
    return build_once(
        cache_root() / "tiny-warm" / key,
        write,
        what=f"warm policy for {env_name} ({warm.base} fine-tuned on the scripted expert)",
        expected=f"{phases}, about 3-4 min for tiny (one thread), longer for a real model "
        "or under load; built once",
        log=log,
    )
