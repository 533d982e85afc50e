"""BabyAI (minigrid) as a text env: rendering, parsing, forking, the planner, the `babyai`
scorer and the scripted expert."""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("minigrid")

from agentree.config import load_config
from agentree.envs import check_env, has_expert, make_env
from agentree.envs.babyai import _PLANS, LEVELS, BabyAIEnv, parse_action, plan
from agentree.scorers import make_scorer
from agentree.tree import Node

ACTS = ["```forward```", "```turn left```", "```pickup```", "no action", "```toggle```"]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_level_passes_check_env(level: str) -> None:
    env = make_env("babyai", level=level)
    report = check_env(env, seed=3, actions=[*ACTS, "```forward```", "```drop```"])
    assert report["forkable"] and report["steps_checked"] >= 4


def test_a_snapshot_restores_into_a_fresh_instance() -> None:
    env = BabyAIEnv(level="GoToObjMazeS4")
    env.reset(seed=5)
    for a in ("```forward```", "```turn right```", "```forward```"):
        env.step(a)
    state = env.snapshot()
    expected = [env.step(a)[:4] for a in ("```forward```", "```turn left```", "```toggle```")]
    fresh = BabyAIEnv(level="GoToObjMazeS4")  # never reset
    fresh.restore(state)
    got = [fresh.step(a)[:4] for a in ("```forward```", "```turn left```", "```toggle```")]
    assert got == expected
    # the random state travels too: the same draw after restoring
    env.restore(state)
    fresh.restore(state)
    assert env._level.np_random.random() == fresh._level.np_random.random()


def test_actions_parse_robustly() -> None:
    assert parse_action("I will go.\n```forward```") == "forward"
    assert parse_action("```Turn   Left```") == "turn left"
    assert parse_action("``` TOGGLE ```") == "toggle"
    assert parse_action("```go forward```") == "forward"  # BALROG's names
    assert parse_action("```pick up```") == "pickup"
    assert parse_action("```drop``` no, ```turn right```") == "turn right"  # the last block
    assert parse_action("forward") is None
    assert parse_action("```jump```") is None


def test_an_invalid_action_changes_nothing_and_is_flagged() -> None:
    env = BabyAIEnv(level="GoToObj", invalid_penalty=0.1)
    obs0, _ = env.reset(seed=4)
    key = env.state_key()
    obs, reward, terminated, truncated, info = env.step("walk east")
    assert info["format_error"] and not info["valid"]
    assert reward == pytest.approx(-0.1) and not terminated and not truncated
    assert obs.startswith("Invalid action.") and obs.endswith(obs0)
    assert env.state_key() == key
    _, _, _, _, info = env.step("```turn left```")
    assert info["format_error"] is False and info["action_key"] == "turn left"


def test_observation_reads_like_balrog() -> None:
    """Seed 3 of GoToObj: the agent at (1, 1) facing east in an 8x8 room (walls on the border),
    the red box at (3, 4): two cells ahead (east) and three to the right (south). The wall ahead
    is at x=7, six steps; the one on the left (north) at y=0, one step; to the right the box
    is not in the way (it is off the line), but the view ends before the south wall."""
    env = BabyAIEnv(level="GoToObj")
    obs, info = env.reset(seed=3)
    assert obs.splitlines() == [
        "Mission: go to the red box",
        "a wall 6 steps forward",
        "a wall 1 step left",
        "a red box 3 steps right and 2 steps forward",
    ]
    assert info["mission"] == "go to the red box"
    # seed 4: the agent at (3, 4) facing south, the grey ball at (6, 4) three steps to its
    # left (east); the ball hides the east wall behind it, the west wall is 3 steps right
    obs, _ = env.reset(seed=4)
    assert obs.splitlines()[1:] == [
        "a wall 3 steps forward",
        "a wall 3 steps right",
        "a grey ball 3 steps left",
    ]


def test_carried_object_is_described() -> None:
    env = BabyAIEnv(level="UnlockLocal")
    env.reset(seed=0)
    actions = plan(env._level)
    assert actions is not None and "pickup" in actions and actions[-1] == "toggle"
    for a in actions[: actions.index("pickup") + 1]:
        obs, *_ = env.step(f"```{a}```")
    assert obs.splitlines()[-1].startswith("you carry a ") and "key" in obs.splitlines()[-1]


def test_planner_length_worked_by_hand() -> None:
    """GoToObj seed 4: facing south at (3, 4), the ball at (6, 4). Turn left (face east), two
    steps forward to (5, 4): the ball is in front. Three actions."""
    env = BabyAIEnv(level="GoToObj")
    _, info = env.reset(seed=4)
    assert plan(env._level) == ["turn left", "forward", "forward"]
    assert info["start_plan"] == info["plan_left"] == 3
    # turned right instead (facing west): turn around (2), then 2 forward = 4
    env.step("```turn right```")
    assert env.plan_left() == 4
    _PLANS.clear()  # found plans are kept; a search of 2 states finds none
    assert plan(env._level, limit=2) is None
    assert plan(env._level) == ["turn left", "turn left", "forward", "forward"]


def test_planner_agrees_with_minigrid_from_random_states() -> None:
    """From states a random walk reached (objects picked up, doors opened), following the
    plan completes the mission in exactly as many steps as it has."""
    rng = random.Random(0)
    for level in sorted(LEVELS):
        env = BabyAIEnv(level=level, max_turns=200)
        for seed in range(3):
            env.reset(seed=seed)
            for _ in range(rng.randint(0, 12)):
                _, _, terminated, _, _ = env.step(env.random_action(rng))
                if terminated:
                    break
            else:
                actions = plan(env._level)
                assert actions is not None, (level, seed)
                for i, a in enumerate(actions):
                    _, reward, terminated, _, info = env.step(f"```{a}```")
                    assert terminated == (i == len(actions) - 1), (level, seed, i)
                    assert info["plan_left"] == len(actions) - i - 1
                assert reward == 1.0 and info["success"]


def node(info: dict) -> Node:
    return Node(id=0, parent=None, turn=0, info={"env": info})


def test_scorer_is_one_minus_plan_left_over_plan_at_start() -> None:
    """Hand-worked on GoToObj seed 4 (plan 3 at the start): after turning left 2 are left,
    1 - 2/3; after one more forward 1 - 1/3; turned the wrong way 4 are left, clipped to 0;
    done: 1; no plan left: 0."""
    scorer = make_scorer("babyai")
    env = BabyAIEnv(level="GoToObj")
    _, first = env.reset(seed=4)
    *_, left = env.step("```turn left```")
    *_, ahead = env.step("```forward```")
    *_, done = env.step("```forward```")
    env.reset(seed=4)
    *_, away = env.step("```turn right```")
    stuck = {**away, "plan_left": None}
    paths = [[node(first), node(i)] for i in (left, ahead, away, done, stuck)]
    values = [s.value for s in scorer.score(None, paths)]
    assert values == pytest.approx([1 - 2 / 3, 1 - 1 / 3, 0.0, 1.0, 0.0])
    assert done["success"] and done["plan_left"] == 0
    assert scorer.score(None, [[node({})]])[0].value is None


def test_expert_solves_every_level_and_the_walker_rarely_does() -> None:
    from agentree.models.warm import walker_success

    assert has_expert(BabyAIEnv)
    tasks = BabyAIEnv.generate_tasks(4, seed=0, split="eval")
    for level in ("GoToLocal", "PickupLoc", "UnlockLocal", "GoToObjMazeS4"):
        kwargs = {"level": level, "max_turns": 64}
        assert walker_success("babyai", kwargs, tasks, samples=1, expert_prob=1.0) == 1.0
    walker = walker_success("babyai", {"level": "GoToObjMazeS4"}, tasks, samples=4)
    assert walker < 0.5


def test_best_actions_begin_shortest_plans() -> None:
    env = BabyAIEnv(level="GoToObj")
    # seed 3: at (1, 1) facing east, the box at (3, 4). Forward twice, turn right, forward
    # twice faces it from (3, 3): 5. Turning right first needs 3 forward, a left turn and 1
    # forward to face it from (2, 4): 6. Only forward begins a shortest plan.
    env.reset(seed=3)
    assert env.plan_left() == 5
    assert env.best_actions() == ["```forward```"] == [env.expert_action()]
    env.step("```forward```")
    env.step("```forward```")  # at (3, 1): turning right is the one shortest move
    assert env.best_actions() == ["```turn right```"]


def test_state_key_names_the_state_not_the_path() -> None:
    env = BabyAIEnv(level="GoToLocal")
    env.reset(seed=1)
    start = env.state_key()
    env.step("```turn left```")
    assert env.state_key() != start
    env.step("```turn right```")
    env.step("nonsense")
    assert env.state_key() == start


def test_tasks_split_train_and_held_out() -> None:
    train = BabyAIEnv.load_tasks(8, split="train")
    held_out = BabyAIEnv.load_tasks(8, split="eval")
    assert not {t.seed for t in train} & {t.seed for t in held_out}


def test_shipped_configs_load() -> None:
    for name in ("babyai_patr", "babyai_grpo"):
        cfg = load_config(name)
        env_name, kwargs = cfg.component("env")
        assert env_name == "babyai" and 32 <= kwargs["max_turns"] <= 64
        assert cfg.policy.path == "tiny-warm"
    assert load_config("babyai_patr").component("scorer")[0] == "babyai"


def test_warm_demonstrations_are_in_format() -> None:
    from agentree.models.warm import WarmConfig, build_settings, demonstrations

    kwargs = build_settings("babyai", {"level": "GoToLocal", "invalid_penalty": 0.5})
    assert kwargs == {"level": "GoToLocal", "max_turns": 32}
    convs = demonstrations("babyai", kwargs, WarmConfig(episodes=3, expert_prob=0.5))
    assert len(convs) == 3
    for conv in convs:
        assert conv[0]["content"].startswith("Mission: ")
        assert all(parse_action(m["content"]) for m in conv[1::2])


def test_resets_in_worker_threads_leave_stdout_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """Rollouts reset envs in worker threads: silencing minigrid's rejection-sampling notes
    must not swap `sys.stdout` (threads racing on the swap leave it pointing at a buffer, and
    every later print of the run vanishes), and the notes stay off the output."""
    before = sys.stdout
    envs = [BabyAIEnv(level="GoToObjMazeS4") for _ in range(8)]

    def resets(i: int) -> None:
        for seed in range(i * 40, i * 40 + 40):  # minigrid rejects about one layout a reset in four
            envs[i].reset(seed=seed)

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(resets, range(8)))
    finally:
        for env in envs:
            env.close()
    assert sys.stdout is before
    print("still here")
    out = capsys.readouterr().out
    assert out == "still here\n"
