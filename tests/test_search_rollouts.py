"""Tree-GRPO and TSR controllers: budgets (env steps, forks, trajectories) counted exactly."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_rollout import CountingEnv, FixedScorer, context, task
from transformers import AutoTokenizer

from agentree.algorithms.advantages import compute_advantages
from agentree.envs import Task
from agentree.rollout.base import make_controller
from agentree.tree import EndReason


@pytest.fixture(scope="module")
def tokenizer(tiny_frozenlake):
    return AutoTokenizer.from_pretrained(tiny_frozenlake)


def always(move):
    return lambda text, i: f"```{move}```"


def by_index(*moves):
    """The i-th prompt of each engine call gets moves[i % len(moves)]."""
    return lambda text, i: f"```{moves[i % len(moves)]}```"


def last_action(values):
    return FixedScorer(lambda path: values[path[-1].info["env"]["action_key"]])


@pytest.mark.parametrize("L", [1, 2])
def test_tree_grpo_without_root_or_replacement_expands_distinct_inner_nodes(tokenizer, L):
    ctx = context(tokenizer, always("Right"), max_turns=4)  # no goal on the top row: 4 turns
    ctrl = make_controller("tree-grpo", M=2, N=2, L=L, expand_root=False, replace=False)
    (tree,), stats = ctrl.rollout([task()], ctx)
    trajs = ctrl.group(tree)
    assert len(trajs) == stats.trajectories == 2 * (1 + L * 2) == ctrl.group_size()
    # two chains of 4 turns from two resets, then one fork per expansion
    assert CountingEnv.counts["reset"] == 2
    assert stats.forks == stats.expanded == CountingEnv.counts["restore"] == 2 * L * 2
    # each expansion of a node at turn t takes 4 - t more steps; nothing is re-simulated
    picked = Counter()
    for n in tree.nodes:
        picked[n.id] = n.info.get("expanded", 0)
    extra = sum(k * (4 - tree.nodes[n].turn) for n, k in picked.items())
    assert stats.env_steps == 2 * 4 + extra == len(tree.nodes) - 1 == CountingEnv.counts["step"]
    # expansions are agent steps below the root, and every tree keeps its own first turn
    assert tree.root.info.get("expanded") is None and len(tree.root.children) == 2
    for n, k in picked.items():
        if k:
            assert 1 <= tree.nodes[n].turn <= 3
            for c in tree.nodes[n].children:  # the new branch starts where its parent stood
                assert tree.nodes[c].info["env"]["pos"] == [0, min(tree.nodes[n].turn + 1, 3)]
    firsts = Counter(t.nodes[1] for t in trajs)
    assert sorted(firsts.values()) == [1 + L * 2, 1 + L * 2]
    # every node records the env's state key (the grid), for the step-level estimators
    assert all("state_key" in n.info for n in tree.nodes)
    compute_advantages("treegrpo", [tree], [trajs])


class ScriptedDraws(random.Random):
    """Randomness whose `choices` takes a fixed position of the population (recorded)."""

    def __init__(self, position: int) -> None:
        super().__init__(0)
        self.position = position
        self.populations: list[list[int]] = []

    def choices(self, population, weights=None, *, cum_weights=None, k=1):
        self.populations.append(list(population))
        return [population[self.position]] * k


def test_tree_grpo_candidates_include_the_root_as_in_the_authors_code(tokenizer):
    # get_expand_node: candidate_set = [root] + non-leaf nodes of its subtree. Drawing the root
    # each time, every expansion is a new chain from the prompt inside the same tree.
    ctx = context(tokenizer, always("Right"), max_turns=4)
    ctx.rng = ScriptedDraws(0)
    ctrl = make_controller("tree-grpo", M=2, N=2, L=1)
    (tree,), stats = ctrl.rollout([task()], ctx)
    # each tree's candidates: the root, then its chain's nodes at turns 1-3 (turn 4 is a leaf)
    for pop in ctx.rng.populations:
        assert pop[0] == 0 and [tree.nodes[n].turn for n in pop[1:]] == [1, 2, 3]
    assert len({tuple(p) for p in ctx.rng.populations}) == 2  # one draw per tree
    # 2 trees x (1 chain + 2 root expansions), every chain 4 steps from a fresh reset
    trajs = ctrl.group(tree)
    assert len(trajs) == 6 and len(tree.root.children) == 6
    assert stats.env_steps == 6 * 4 and CountingEnv.counts["reset"] == 6
    assert tree.root.info["expanded"] == 4
    index = Counter(tree.nodes[t.nodes[1]].info["tree_index"] for t in trajs)
    assert index == {0: 3, 1: 3}  # 1 + L N leaves per tree, several first turns each


@pytest.mark.parametrize("L", [1, 2])
def test_tree_grpo_draws_with_replacement_so_trees_end_with_1_plus_l_n_leaves(tokenizer, L):
    # random.choices(candidate_set, k=n): the last candidate (the turn-3 node) drawn twice
    ctx = context(tokenizer, always("Right"), max_turns=4)
    ctx.rng = ScriptedDraws(-1)
    ctrl = make_controller("tree-grpo", M=2, N=2, L=L)
    (tree,), stats = ctrl.rollout([task()], ctx)
    deep = [n for n in tree.nodes if n.info.get("expanded")]
    assert [n.turn for n in deep] == [3, 3] and all(n.info["expanded"] == 2 * L for n in deep)
    trajs = ctrl.group(tree)
    index = Counter(tree.nodes[t.nodes[1]].info["tree_index"] for t in trajs)
    assert index == {0: 1 + L * 2, 1: 1 + L * 2} and len(trajs) == ctrl.group_size()
    # two chains of 4 steps, then one step per expansion of a turn-3 node
    assert stats.env_steps == 2 * 4 + 2 * 2 * L == CountingEnv.counts["step"]
    assert stats.forks == 2 * 2 * L == CountingEnv.counts["restore"]


def test_tsr_best_of_n_keeps_the_best_scored_candidate_each_turn(tokenizer):
    scorer = last_action({"right": 0.5, "down": 0.9, "left": 0.1})
    ctx = context(tokenizer, by_index("Right", "Down", "Left"), scorer, max_turns=3)
    ctrl = make_controller("tsr", mode="best_of_n", G=2, N=3)
    (tree,), stats = ctrl.rollout([task()], ctx)
    trajs = ctrl.group(tree)
    assert len(trajs) == stats.trajectories == 2
    for t in trajs:  # the trajectory continued with Down at every turn
        assert [tree.nodes[n].info["env"]["action_key"] for n in t.nodes[1:]] == ["down"] * 3
    # 3 turns x 2 trajectories x 3 candidates; forks: 1 at the root, then 2 per live branch
    assert stats.env_steps == 18 == CountingEnv.counts["step"] == len(tree.nodes) - 1
    assert stats.forks == 1 + 3 * 2 * 2 == CountingEnv.counts["restore"]
    assert scorer.seen == 18
    # rejected candidates: pruned while live (turns 1-2), marked rejected at the last turn
    assert stats.pruned == 2 * 2 * 2
    assert sum(1 for n in tree.nodes if n.info.get("rejected")) == 2 * 2


def test_tsr_beam_keeps_the_width_best_candidates_of_the_task(tokenizer):
    scorer = last_action({"right": 0.5, "down": 0.9})
    ctx = context(tokenizer, by_index("Right", "Down"), scorer, max_turns=2)
    ctrl = make_controller("tsr", mode="beam", width=2, N=2)
    (tree,), stats = ctrl.rollout([task()], ctx)
    trajs = ctrl.group(tree)
    # turn 1: one beam -> Right, Down (both kept); turn 2: 4 candidates, the two Downs win
    paths = sorted([tree.nodes[n].info["env"]["action_key"] for n in t.nodes[1:]] for t in trajs)
    assert paths == [["down", "down"], ["right", "down"]]
    assert stats.env_steps == 2 + 4 == CountingEnv.counts["step"]
    assert stats.forks == 1 + 2 == CountingEnv.counts["restore"]
    assert CountingEnv.counts["reset"] == 1 and ctrl.group_size() == 2


def test_tsr_lookahead_judges_candidates_by_the_state_after_depth_turns(tokenizer):
    # Candidates alternate Right/Down; the probe behind each takes one more move. Scoring the
    # row reached makes Down-then-probe (row 2 after a Down probe) win over Right.
    scorer = FixedScorer(lambda path: path[-1].info["env"]["pos"][0] / 3)
    ctx = context(tokenizer, by_index("Right", "Down"), scorer, max_turns=3)
    ctrl = make_controller("tsr", mode="lookahead", G=1, N=2, depth=1)
    (tree,), stats = ctrl.rollout([task()], ctx)
    (traj,) = ctrl.group(tree)
    assert traj.num_turns == 3 and traj.end_reason == EndReason.MAX_TURNS
    # per turn: 2 candidate steps, and a 1-step probe behind each live candidate (turns 1-2;
    # at turn 3 both candidates end the episode)
    assert stats.env_steps == 2 + 2 + 2 + 2 + 2 == CountingEnv.counts["step"]
    assert stats.forks == (1 + 2) + (1 + 2) + 1 == CountingEnv.counts["restore"]
    probes = [n for n in tree.nodes if n.info.get("lookahead")]
    assert len(probes) == 4
    assert all(tree.nodes[n].info["env"]["action_key"] == "down" for n in traj.nodes[1:2])


def test_tsr_instance_filtering_drops_uniform_groups(tokenizer):
    scorer = last_action({"right": 0.5, "down": 0.9})
    # Down is preferred. Task 0: every trajectory goes Down twice and stops at the turn limit
    # (all reward 0); task 1: the goal is two moves down, so both reach it (all reward 1) ...
    goal = ["SFFF", "FFFF", "GFFF", "FFFF"]
    tasks = [task(), Task("goal", options={"desc": goal})]
    ctx = context(tokenizer, by_index("Right", "Down"), scorer, max_turns=2)
    ctrl = make_controller("tsr", G=2, N=2, filter=True)
    trees, stats = ctrl.rollout(tasks, ctx)
    # ... both uniform: a batch with nothing left would train on nothing, so both are kept
    assert [len(ctrl.group(t)) for t in trees] == [2, 2]
    assert [t.reward for t in ctrl.group(trees[1])] == [1.0, 1.0]
    # with equal scores each pool keeps its first candidate, and the candidates alternate
    # (Right, Down) / (Down, Right) between the two trajectories of a task: on the goal maps
    # one trajectory goes Down twice (reward 1) and the other Right twice (0)
    ctx = context(
        tokenizer,
        by_index("Right", "Down", "Down", "Right"),
        FixedScorer(lambda p: 0.5),
        max_turns=2,
    )
    mixed = Task("mixed", options={"desc": goal})
    trees, stats = ctrl.rollout([*tasks, mixed], ctx)
    assert [sorted(t.reward for t in ctrl._kept(tree)) for tree in trees] == [
        [0.0, 0.0],
        [0.0, 1.0],
        [0.0, 1.0],
    ]
    assert [len(ctrl.group(t)) for t in trees] == [0, 2, 2]
    assert stats.extra["filtered"] == 1
