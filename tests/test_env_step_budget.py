"""`rollout.env_step_budget=N`: every turn-level controller spends between N - max_turns and N
env steps per task, counted on the tree (one node per env step) and on the envs themselves."""

from __future__ import annotations

import random

import pytest
from test_rollout import OPEN, CountingEnv, context, task
from transformers import AutoTokenizer

from agentree.config import load_config
from agentree.envs import Task
from agentree.rollout.base import make_controller
from agentree.run.trainer import Trainer
from agentree.scorers import make_scorer
from agentree.tree import EndReason

MAX_TURNS = 6
MOVES = ["```Up```", "```Down```", "```Left```", "```Right```", "no move"]

# small versions of every turn-level controller; ARPO's scripted policy has no entropies, so
# alpha > tau makes it branch wherever the budget allows
CONTROLLERS = {
    "grpo": {"G": 4},
    "patr": {"B0": 2, "K": 2, "M": 2, "top_k": 1},
    "tree-random": {"B0": 3, "K": 1, "M": 3, "top_k": 1},
    "arpo": {"N": 2, "Z": 2, "alpha": 1.0},
    "tree-grpo": {"M": 2, "N": 2},
    "tree-grpo-old": {"M": 2, "N": 2, "expand_root": False, "replace": False},
    "tsr": {"mode": "best_of_n", "G": 2, "N": 3},
    "tsr-beam": {"mode": "beam", "N": 3, "width": 2},
    "tsr-lookahead": {"mode": "lookahead", "G": 2, "N": 2, "depth": 2},
}


@pytest.fixture(scope="module")
def tokenizer(tiny_frozenlake):
    return AutoTokenizer.from_pretrained(tiny_frozenlake)


def random_policy(seed: int):
    """A seeded random walker (invalid answers included), so episodes end at varied turns."""
    rng = random.Random(seed)
    return lambda text, i: rng.choice(MOVES)


def tasks() -> list[Task]:
    """Random 4x4 maps with holes: episodes end by goal, hole or the turn limit."""
    return [Task(f"t{s}", seed=s, options={}) for s in range(3)]


def rollout(tokenizer, key: str, budget: int | None, seed: int = 0, **settings):
    name = key.split("-old")[0].split("-beam")[0].split("-lookahead")[0]
    ctx = context(tokenizer, random_policy(seed), make_scorer("bfs"), max_turns=MAX_TURNS, p=0.7)
    ctx.rng = random.Random(seed)
    ctrl = make_controller(name, env_step_budget=budget, **CONTROLLERS[key], **settings)
    trees, stats = ctrl.rollout(tasks(), ctx)
    return ctrl, trees, stats


@pytest.mark.parametrize("key", list(CONTROLLERS))
@pytest.mark.parametrize("budget", [9, 20, 37])
def test_every_controller_spends_its_budget_exactly(tokenizer, key, budget):
    ctrl, trees, stats = rollout(tokenizer, key, budget)
    per_task = [len(t.nodes) - 1 for t in trees]  # one node per env step below the root
    for steps in per_task:
        assert budget - MAX_TURNS <= steps <= budget
    assert sum(per_task) == stats.env_steps == CountingEnv.counts["step"]
    for tree in trees:
        group = ctrl.group(tree)  # may be empty: TSR pays N steps a turn
        leaves = tree.finished_leaves()
        assert all(leaf.end_reason is not None for leaf in tree.leaves())  # nothing silent
        cut = {n.id for n in leaves if n.end_reason == EndReason.BUDGET}
        assert not cut & {t.leaf for t in group}  # cut branches never train
    assert stats.trajectories == sum(len(ctrl.group(t)) for t in trees)


@pytest.mark.parametrize("key", list(CONTROLLERS))
@pytest.mark.parametrize("budget", [9, 20, 37])
def test_budget_reserve_cuts_nothing_and_stays_within_one_episode(tokenizer, key, budget):
    """With `budget_reserve` a branch starts only when the budget can finish it: no `budget`
    leaf anywhere, never more than N steps, and at most one turn limit (6) short of N."""
    ctrl, trees, stats = rollout(tokenizer, key, budget, budget_reserve=True)
    for tree in trees:
        steps = len(tree.nodes) - 1
        assert budget - MAX_TURNS <= steps <= budget
        assert all(leaf.end_reason is not None for leaf in tree.leaves())
        assert all(leaf.end_reason != EndReason.BUDGET for leaf in tree.leaves())
    assert sum(len(t.nodes) - 1 for t in trees) == stats.env_steps == CountingEnv.counts["step"]
    assert "budget_cut" not in stats.extra
    assert stats.trajectories == sum(len(ctrl.group(t)) for t in trees) > 0


def test_grpo_reserves_whole_episodes(tokenizer):
    # Always Right on the open map: every episode runs to the 4-turn limit. Budget 10 admits
    # two whole episodes (8 steps); the 2 steps left cannot finish a third, so none starts.
    ctx = context(tokenizer, lambda text, i: "```Right```", max_turns=4)
    ctrl = make_controller("grpo", G=2, env_step_budget=10, budget_reserve=True)
    (tree,), stats = ctrl.rollout([task()], ctx)
    assert [str(n.end_reason) for n in tree.finished_leaves()] == ["max_turns"] * 2
    assert stats.env_steps == 8 and stats.trajectories == 2
    assert CountingEnv.counts["reset"] == 2
    # 26 steps: two at a time, three times (24 steps); the last 2 cannot finish an episode
    ctrl = make_controller("grpo", G=2, env_step_budget=26, budget_reserve=True)
    (tree,), stats = ctrl.rollout([task()], ctx)
    assert stats.trajectories == 6 and stats.env_steps == 24 and "budget_cut" not in stats.extra


def test_patr_expands_only_what_the_reserve_can_finish(tokenizer):
    # B0=2 branches reserve 4 turns each (8 of 11); at the checkpoint after 2 turns they hold 4
    # more, so 11 - 2*2 - 4 = 3 unreserved steps admit one new branch at turn 2 (2 turns to go):
    # one of the two expansions top_k=2 asks for. 10 steps, and the last 1 cannot start a round.
    ctx = context(tokenizer, lambda text, i: "```Right```", make_scorer("bfs"), max_turns=4)
    cfg = {"B0": 2, "K": 2, "M": 2, "top_k": 2, "theta": None, "alpha": None}
    ctrl = make_controller("patr", **cfg, env_step_budget=11, budget_reserve=True)
    (tree,), stats = ctrl.rollout([task()], ctx)
    assert stats.forks == 1 + 1 and stats.expanded == 1  # the root's second branch, one fork
    assert stats.env_steps == 10 and stats.trajectories == 3
    assert all(str(n.end_reason) == "max_turns" for n in tree.finished_leaves())


def test_budget_reserve_needs_a_turn_limit_and_a_budget_that_can_finish_one(tokenizer):
    ctx = context(tokenizer, lambda text, i: "```Right```", max_turns=4)
    ctrl = make_controller("grpo", G=2, env_step_budget=3, budget_reserve=True)
    with pytest.raises(ValueError, match="cannot finish one episode of up to 4 turns"):
        ctrl.rollout([task()], ctx)
    env = ctx.env_factory()
    env.turn_limit = lambda: None  # an env that does not say how long its episodes run
    ctx.env_factory = lambda: env
    ctrl = make_controller("grpo", G=2, env_step_budget=8, budget_reserve=True)
    with pytest.raises(ValueError, match=r"turn_limit\(\) returns None"):
        ctrl.rollout([task()], ctx)


def nodes(trees) -> list[list[dict]]:
    """The trees' nodes without the env-step wall times."""
    out = [t.to_dict()["nodes"] for t in trees]
    for ns in out:
        for n in ns:
            n["info"].pop("step_s", None)
    return out


@pytest.mark.parametrize("key", ["grpo", "patr", "tree-grpo", "tsr"])
def test_no_budget_is_the_controllers_own_sizes(tokenizer, key):
    _, off, s_off = rollout(tokenizer, key, None)
    _, zero, s_zero = rollout(tokenizer, key, 0)
    assert nodes(off) == nodes(zero)
    assert "budget_cut" not in s_off.extra and s_off.env_steps == s_zero.env_steps


def test_grpo_draws_until_the_budget_is_spent_and_cuts_only_the_last(tokenizer):
    # Always Right on the open map: no goal on the top row, so every episode is 4 turns.
    ctx = context(tokenizer, lambda text, i: "```Right```", max_turns=4)
    ctrl = make_controller("grpo", G=2, env_step_budget=10)
    (tree,), stats = ctrl.rollout([task()], ctx)
    # two trajectories of 4 steps; 2 steps left: one more starts (none is live) and is cut
    # after 2 steps, out of the group
    reasons = sorted(str(n.end_reason) for n in tree.finished_leaves())
    assert reasons == ["budget", "max_turns", "max_turns"]
    assert stats.env_steps == 10 and stats.trajectories == 2
    assert stats.extra["budget_cut"] == 1
    assert CountingEnv.counts["reset"] == 3
    # with 26 steps: 6 whole trajectories (more than G), then 2 steps of a cut seventh
    (tree,), stats = make_controller("grpo", G=2, env_step_budget=26).rollout([task()], ctx)
    assert stats.trajectories == 6 and stats.env_steps == 26


def test_patr_restarts_below_the_same_root_while_steps_are_left(tokenizer):
    ctx = context(tokenizer, lambda text, i: "```Right```", make_scorer("bfs"), max_turns=4)
    cfg = {"B0": 2, "K": 4, "M": 2, "top_k": 1, "theta": None}
    (tree,), stats = make_controller("patr", **cfg, env_step_budget=20).rollout([task()], ctx)
    # round 1: two branches of 4 turns end at the checkpoint (8 steps); rounds 2 and 3 the
    # same (16, then 24 > 20): the third round's two branches are cut after 2 steps each
    assert stats.env_steps == 20
    assert len(tree.root.children) == 6
    reasons = [str(n.end_reason) for n in tree.finished_leaves()]
    assert reasons.count("budget") == 2 and reasons.count("max_turns") == 4
    assert stats.trajectories == 4
    assert OPEN[0] == "SFFF"  # the map the hand count above relies on


@pytest.mark.parametrize("reserve", [False, True])
def test_the_trainer_says_when_the_budget_cuts_most_of_a_step(tmp_path, tiny_frozenlake, reserve):
    """Eight 3-turn episodes started together on a map whose goal is 6 moves away (none ends
    early) and a budget of 19 steps: truncation lets 3 finish and cuts 5, and the trainer says
    so once; under the reserve only the 6 it can finish start, and it says nothing."""
    cfg = load_config(
        "frozenlake_patr",
        select={"rollout": "grpo", "output": str(tmp_path)},
        overrides=[
            f"policy.path={tiny_frozenlake}",
            "rollout.G=8",
            "env.max_turns=3",
            "rollout.env_step_budget=19",
            f"rollout.budget_reserve={str(reserve).lower()}",
            "train.tasks_per_step=1",
            "train.trees_every=0",
        ],
    )
    said: list[str] = []
    trainer = Trainer(cfg, tmp_path, log=said.append)
    open_field = {"desc": ["SFFF", "FFFF", "FFFF", "FFFG"]}
    trainer.train_tasks = [Task(t.id, None, open_field) for t in trainer.train_tasks[:2]]
    trainer._order, trainer._cursor = [], 0
    try:
        steps = [trainer.train_step() for _ in range(2)]
    finally:
        trainer.close()
    warnings = [m for m in said if "rollout.env_step_budget cut" in m]
    if reserve:
        assert [m["rollout/trajectories"] for m in steps] == [6, 6]
        assert all(m.get("rollout/budget_cut", 0) == 0 for m in steps) and warnings == []
    else:
        assert [(m["rollout/trajectories"], m["rollout/budget_cut"]) for m in steps] == [(3, 5)] * 2
        assert len(warnings) == 1 and "rollout.budget_reserve=true" in warnings[0]
