"""Warm-started tiny policies: the scripted experts, the built policy (in format, mediocre), and
the default run that starts from it."""

from __future__ import annotations

import random

import pytest

from agentree.config import load_config
from agentree.envs import Env, Task, has_expert
from agentree.envs.countdown import CountdownEnv
from agentree.envs.frozenlake import FrozenLakeEnv, distances_to_goal, shortest_path, valid_moves
from agentree.models.warm import scripted_action, walker_success
from agentree.rollout.turn.turns import scripted_episode

MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]
_DELTA = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def lake_at(cell: tuple[int, int]) -> FrozenLakeEnv:
    """The env on MAP with the player on `cell` (set through a snapshot, as a fork would)."""
    env = FrozenLakeEnv()
    env.reset(seed=0, options={"desc": MAP})
    state = env.snapshot()
    env.restore({**state, "s": cell[0] * len(MAP[0]) + cell[1]})
    return env


def test_expert_moves_along_a_shortest_path() -> None:
    rng = random.Random(0)
    dist = distances_to_goal(MAP)
    assert dist[(0, 0)] == shortest_path(MAP, (0, 0), (3, 3)) == 6
    for cell, d in dist.items():
        if d == 0:
            continue
        move = scripted_action(lake_at(cell), 1.0, rng).strip("`")
        dr, dc = _DELTA[move]
        assert dist.get((cell[0] + dr, cell[1] + dc)) == d - 1
    # equally short moves: the expert prefers Down, then Right (a function of the state)
    assert lake_at((0, 0)).best_actions() == ["```Down```", "```Right```"]
    assert lake_at((0, 0)).expert_action() == "```Down```"


def test_walker_moves_stay_on_the_map_and_cover_every_valid_move() -> None:
    rng = random.Random(0)
    assert valid_moves(MAP, (0, 0)) == ["Down", "Right"]
    env = lake_at((0, 0))
    seen = {scripted_action(env, 0.0, rng) for _ in range(200)}
    assert seen == {"```Down```", "```Right```"}


def test_noisy_expert_draws_once_then_takes_the_expert_or_the_walker() -> None:
    """One uniform draw per turn, then the expert's move below `expert_prob`, else the
    walker's draw from the same generator."""
    env = lake_at((0, 0))
    for seed in range(20):
        mine, ref = random.Random(seed), random.Random(seed)
        action = scripted_action(env, 0.4, mine)
        expected = "```Down```" if ref.random() < 0.4 else f"```{ref.choice(['Down', 'Right'])}```"
        assert action == expected and mine.random() == ref.random()


def test_a_scripted_episode_stops_after_max_steps_in_the_state_reached() -> None:
    """The expert's path on MAP is 6 steps, Down, Down, Right first: `max_steps` 3 records
    those three, leaves the leaf unended and the env on (2, 1), 3 steps from the goal by Down
    or by Right; 0 records the reset only; 99 plays the episode to its end."""
    task = Task(id="map", seed=0, options={"desc": MAP})
    expert = lambda _task, _history: scripted_action(env, 1.0, random.Random(0))  # noqa: E731
    env = FrozenLakeEnv()
    tree = scripted_episode(env, task, expert, max_steps=3)
    path = tree.nodes[1:]
    assert [n.action for n in path] == ["```Down```", "```Down```", "```Right```"]
    assert path[-1].end_reason is None and not path[-1].terminated
    assert env.snapshot()["s"] == 2 * len(MAP[0]) + 1
    assert env.best_actions() == ["```Down```", "```Right```"]
    assert len(scripted_episode(env, task, expert, max_steps=0).nodes) == 1
    full = scripted_episode(env, task, expert, max_steps=99)
    assert len(full.nodes) == 7 and full.nodes[-1].end_reason is not None


def test_an_env_without_an_expert_says_so() -> None:
    from agentree.hub.tiny import TinyModelConfig
    from agentree.models.warm import WarmConfig, warm_policy_for_env

    assert has_expert(FrozenLakeEnv) and has_expert(CountdownEnv)
    assert not has_expert(Env)
    with pytest.raises(ValueError, match="has no scripted expert") as err:
        warm_policy_for_env("math", {}, TinyModelConfig(), WarmConfig(), log=lambda _: None)
    assert "\n" not in str(err.value)


def test_walker_success_brackets() -> None:
    tasks = FrozenLakeEnv.generate_tasks(24, seed=0, split="eval")
    kwargs = {"size": 4}
    assert walker_success("frozenlake", kwargs, tasks, samples=2, expert_prob=1.0) == 1.0
    walker = walker_success("frozenlake", kwargs, tasks, samples=8)
    assert 0.0 < walker < 0.6


def test_countdown_expert_is_correct_and_noise_is_in_format() -> None:
    env = CountdownEnv()
    rng = random.Random(0)
    for seed in range(8):
        env.reset(seed=seed)
        _, reward, *_ = env.step(scripted_action(env, 1.0, rng))
        assert reward == 1.0
        env.reset(seed=seed)
        _, reward, *_ = env.step(scripted_action(env, 0.0, rng))
        assert reward >= 0.1  # an answer in tags using every number once


def test_default_run_is_the_warm_4x4_one() -> None:
    cfg = load_config()
    env_name, env_kwargs = cfg.component("env")
    assert env_name == "frozenlake" and env_kwargs["size"] >= 4
    assert cfg.policy.path == "tiny-warm"
    assert 0.0 < cfg.policy.warm.expert_prob < 1.0


def test_warm_build_is_keyed_on_what_changes_its_weights() -> None:
    """Turn limit, stop sequences and reward levels do not change the demonstrations or the
    prompts: a run that changes them reuses the build; map and task settings do not."""
    from agentree.models.warm import WarmConfig, build_key, build_settings, demonstrations

    warm = WarmConfig()

    def key(env: str, **kw) -> str:
        return build_key(env, kw, "tiny-base", warm)

    default = key("frozenlake")
    assert default == key("frozenlake", size=4, max_turns=10)  # the defaults, spelled out
    for irrelevant in ({"max_turns": 2}, {"stop_after_move": False}, {"invalid_penalty": 0.5}):
        assert key("frozenlake", **irrelevant) == default, irrelevant
    for relevant in ({"size": 5}, {"p": 0.7}, {"is_slippery": True}):
        assert key("frozenlake", **relevant) != default, relevant
    assert build_key("frozenlake", {}, "another-base", warm) != default
    assert build_key("frozenlake", {}, "tiny-base", WarmConfig(expert_prob=0.6)) != default
    # demonstrations laid out in a history window are their own build; without one the key
    # is the one it had before windows existed
    assert build_key("frozenlake", {}, "tiny-base", warm, history=None) == default
    assert build_key("frozenlake", {}, "tiny-base", warm, history=4) != default

    # tool mode is its own build; text mode (the default) keeps the key it had before the
    # setting existed, for FrozenLake and for Sokoban (whose builds read every setting)
    assert key("frozenlake", action_format="text") == default
    assert key("frozenlake", action_format="tools") != default
    from agentree.hub.store import content_key

    kw = {k: v for k, v in build_settings("sokoban", {}).items() if k != "action_format"}
    keep = warm.model_dump(exclude={"pretrain_turns"})
    before = {"base": "tiny-base", "env": "sokoban", "kw": kw, "warm": keep, "v": 3}
    assert key("sokoban") == content_key(before) != key("sokoban", action_format="tools")

    countdown = key("countdown")
    assert key("countdown", format_score=0.0, correct_score=2.0) == countdown
    assert key("countdown", max_target=50) != countdown

    # the build reads the same settings as the key: with a 2-turn limit the demonstrations are
    # the default ones (episodes past turn 2 included)
    few = WarmConfig(episodes=12)
    demos = demonstrations("frozenlake", build_settings("frozenlake", {"max_turns": 2}), few)
    assert demos == demonstrations("frozenlake", build_settings("frozenlake", {}), few)
    assert max(len(c) for c in demos) > 2 * 2
    bigger = demonstrations("frozenlake", build_settings("frozenlake", {"size": 5}), few)
    assert bigger != demos


def test_a_warm_build_with_tools_writes_its_calls_in_the_policys_format() -> None:
    """A tool-mode warm start learns the calls in `policy.tool_format`, the format its rollouts
    read (every build used to write Hermes calls, which a `pythonic` policy's rollouts read as
    no call at all), and each format that writes calls differently is a build of its own."""
    import torch

    from agentree.chat import ChatFormat
    from agentree.envs.base import reset_task
    from agentree.hub.load import load_policy
    from agentree.models.warm import WarmConfig, build_key
    from agentree.policy import resolve_policy
    from agentree.tools import ToolCall, call_format, tool_schemas

    warm = WarmConfig()
    key = build_key("frozenlake", {"action_format": "tools"}, "tiny-base", warm, calls="hermes")
    assert key == build_key("frozenlake", {"action_format": "tools"}, "tiny-base", warm)
    for fmt in ("pythonic", "llama3_json", "qwen3_coder"):
        assert (
            build_key("frozenlake", {"action_format": "tools"}, "tiny-base", warm, calls=fmt) != key
        )

    small = {"episodes": 64, "epochs": 2, "pretrain_episodes": 0, "expert_prob": 1.0}
    overrides = ["env.action_format=tools", "policy.tool_format=pythonic"]
    cfg = load_config(overrides=overrides + [f"policy.warm.{k}={v}" for k, v in small.items()])
    model, tokenizer = load_policy(resolve_policy(cfg, lambda _: None))
    env = FrozenLakeEnv(action_format="tools")
    tools = tool_schemas(env.tools())
    (task,) = FrozenLakeEnv.generate_tasks(1, seed=123, split="eval")
    observation, _ = reset_task(env, task)

    def best_move(fmt: str) -> float:
        """The highest mean log-probability per token of a `move` call written in `fmt`."""
        chat = ChatFormat(tokenizer, "pythonic")  # the prompt the rollouts build
        prompt = chat.prompt_ids(observation, env.system_prompt, tools)
        best = -float("inf")
        for direction in ("up", "down", "left", "right"):
            call = call_format(fmt).format([ToolCall("move", {"direction": direction})])
            ids = torch.tensor([prompt + chat.encode(call) + [chat.end_of_turn_id]])
            with torch.no_grad():
                logp = model(ids).logits[0, :-1].log_softmax(-1)
            taken = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1 :]
            best = max(best, taken.mean().item())
        return best

    # measured: pythonic -3.0 against Hermes -5.1; built on Hermes calls the other way round
    assert best_move("pythonic") > best_move("hermes") + 1.0
    # and its tokenizer can write every character of the format (it lost the `=`)
    for fmt in ("pythonic", "qwen3_coder"):
        tiny = ["env.action_format=tools", f"policy.tool_format={fmt}", "policy.path=tiny"]
        _, tokenizer = load_policy(resolve_policy(load_config(overrides=tiny), lambda _: None))
        call = call_format(fmt).format([ToolCall("move", {"direction": "up"})])
        assert tokenizer.decode(tokenizer.encode(call, add_special_tokens=False)) == call


@pytest.fixture(scope="module")
def warm_runtime():
    from agentree.run.runtime import Runtime

    cfg = load_config(overrides=["eval.tasks=24", "eval.samples=2"])
    rt = Runtime(cfg, log=lambda _: None)
    yield cfg, rt
    rt.close()


def test_warm_policy_answers_in_format_and_is_mediocre(warm_runtime) -> None:
    from agentree.run.evaluation import evaluate

    cfg, rt = warm_runtime
    result = evaluate(rt, cfg, seed=0)
    turns = [n for tree in result["trees"] for n in tree.nodes if n.parent is not None]
    valid = sum(bool(n.info.get("env", {}).get("valid")) for n in turns) / len(turns)
    assert valid >= 0.95
    tasks = rt.load_tasks(cfg.eval.tasks, split="eval")
    expert = walker_success("frozenlake", rt.env_kwargs, tasks, samples=2, expert_prob=1.0)
    success = result["summary"]["success_rate"]
    assert success <= expert - 0.25, (success, expert)


def test_warm_policy_knows_more_than_it_samples(warm_runtime) -> None:
    """The two-phase build (strong expert, then the noisy one) leaves a policy whose most
    likely first move is a shortest one on most held-out maps, while it samples those moves
    much less often: the knowledge RL sharpens. A policy that knows only the valid moves is at
    about 0.31 on both."""
    from agentree.models.warm import first_move_skill

    cfg, rt = warm_runtime
    assert cfg.policy.warm.pretrain_episodes > 0
    env = FrozenLakeEnv(**rt.env_kwargs)
    skill = first_move_skill(
        rt.model, rt.rollouts.chat, env, FrozenLakeEnv.load_tasks(100, split="eval")
    )
    assert skill["maps"] >= 90
    assert skill["top1"] >= 0.5, skill
    assert skill["p_best"] <= skill["top1"] - 0.1, skill


def test_a_tool_env_is_probed_over_its_calls_as_the_policy_writes_them(tiny_frozenlake) -> None:
    """In tool mode a grid game's actions and best actions are `move` calls (the class keeps
    the text moves), and `action_skill` scores each action written in the policy's call format
    after the rollouts' prompt: here pythonic, worked out by hand."""
    import torch

    from agentree.chat import ChatFormat
    from agentree.envs.frozenlake import MOVES
    from agentree.envs.grid import move_call
    from agentree.hub.load import load_policy
    from agentree.models.warm import action_probs, action_skill, first_move_skill
    from agentree.tools import tool_schemas

    text, tools = FrozenLakeEnv(size=4), FrozenLakeEnv(size=4, action_format="tools")
    assert tools.action_set == tuple(move_call(m) for m in MOVES)
    assert text.action_set == FrozenLakeEnv.action_set == tuple(f"```{m}```" for m in MOVES)
    obs, _ = tools.reset(seed=3)
    text.reset(seed=3)
    assert tools.best_actions() == [move_call(a.strip("`")) for a in text.best_actions()]
    assert tools.expert_action() in tools.best_actions()

    model, tokenizer = load_policy(str(tiny_frozenlake), dtype="float32", device="cpu")
    chat = ChatFormat(tokenizer, "pythonic")
    prompt = chat.prompt_ids(obs, tools.system_prompt, tool_schemas(tools.tools()))
    written = [chat.encode(f"[move(direction='{m.lower()}')]") for m in MOVES]
    with torch.no_grad():
        p = action_probs(model, prompt, written)
    best = [i for i, m in enumerate(MOVES) if move_call(m) in tools.best_actions()]
    skill = action_skill(model, chat, tools, [(prompt, tools.best_actions())])
    assert skill["p_best"] == pytest.approx(float(sum(p[i] for i in best)))
    assert skill["top1"] == float(int(p.argmax()) in best)
    task = Task("t", seed=3)
    first = first_move_skill(model, chat, tools, [task])
    assert (first["top1"], first["p_best"]) == (skill["top1"], pytest.approx(skill["p_best"]))


def test_tiny_policies_read_the_observation_without_the_instructions(tiny_frozenlake) -> None:
    from transformers import AutoTokenizer

    from agentree.chat import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(tiny_frozenlake))
    env = FrozenLakeEnv(size=4)
    obs, _ = env.reset(seed=0)
    assert chat.prompt_ids(obs, env.system_prompt) == chat.prompt_ids(obs)
