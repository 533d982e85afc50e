"""Turn-level controllers: structure, forking, pruning rules (PATR Eq. 5), end reasons."""

from __future__ import annotations

import random
from collections import Counter
from typing import ClassVar

import pytest
from helpers import ScriptedEngine
from transformers import AutoTokenizer

from agentree.chat import ChatFormat
from agentree.engines.base import SamplingParams
from agentree.envs import Task, make_env
from agentree.rollout.base import RolloutContext, RolloutStats, make_controller
from agentree.scorers import Score, Scorer, make_scorer
from agentree.tree import EndReason

OPEN = ["SFFF", "FFFF", "FFFF", "FFFG"]  # no holes: episodes end only by goal or turn limit


class CountingEnv:
    """Wraps FrozenLake to count resets, steps and restores."""

    counts: ClassVar[Counter] = Counter()

    def __new__(cls, **kw):
        env = make_env("frozenlake", **kw)
        for name in ("reset", "step", "restore"):
            orig = getattr(env, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                CountingEnv.counts[_name] += 1
                return _orig(*a, **k)

            setattr(env, name, wrapped)
        return env


class FixedScorer(Scorer):
    """Scores branches by a rule on their last action, so routing is hand-checkable."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.seen = 0

    def score(self, task, branches):
        self.seen += len(branches)
        return [Score(self.table(b)) for b in branches]


@pytest.fixture(scope="module")
def tokenizer(tiny_frozenlake):
    return AutoTokenizer.from_pretrained(tiny_frozenlake)


def context(tokenizer, choose, scorer=None, max_tokens=8, **kw):
    chat = ChatFormat(tokenizer)
    CountingEnv.counts = Counter()
    return RolloutContext(
        engine=ScriptedEngine(tokenizer, choose),
        chat=chat,
        sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=chat.stop_token_ids),
        env_factory=lambda: CountingEnv(**kw),
        scorer=scorer or make_scorer("none"),
        rng=random.Random(0),
    )


def first_moves(i_by_branch):
    moves = ["```Right```", "```Down```", "```Left```", "```Up```"]
    return lambda text, i: (
        moves[i % 4] if text.count("<|im_start|>assistant") == 1 else "```Right```"
    )


def task():
    return Task("open", options={"desc": OPEN})


def test_patr_routes_by_score_median_minus_alpha(tokenizer):
    # First moves by branch: Right, Down, Left, Up; then Right forever. After K=2 turns the
    # scorer gives Right 0.9, Down 0.8, Left 0.1, Up 0.5 (by first move).
    value = {"right": 0.9, "down": 0.8, "left": 0.1, "up": 0.5}

    def table(branch):
        return value[branch[1].info["env"]["action_key"]]

    ctx = context(tokenizer, first_moves(None), FixedScorer(table), max_turns=4)
    patr = make_controller("patr", B0=4, K=2, M=2, top_k=2, alpha=0.3, theta=None)
    (tree,), stats = patr.rollout([task()], ctx)
    # median(0.9, 0.8, 0.5, 0.1) = 0.65; cut = 0.35 -> Left pruned; Right and Down expanded;
    # Up survives. Active after the checkpoint: 2 + 2 + 1 = 5 branches.
    by_first = {}
    for leaf in tree.finished_leaves():
        first = tree.path(leaf.id)[1].info["env"]["action_key"]
        by_first.setdefault(first, []).append(leaf.end_reason)
    assert by_first["left"] == [EndReason.PRUNED_LOW_SCORE]
    assert by_first["up"] == [EndReason.MAX_TURNS]
    assert len(by_first["right"]) == len(by_first["down"]) == 2
    assert stats.expanded == 2 and stats.pruned == 1
    assert stats.forks == 3 + 2  # B0-1 root forks, then M-1 per expansion
    assert stats.trajectories == 6
    # every tree node below the root is exactly one env step: shared prefixes were not re-run
    assert stats.env_steps == len(tree.nodes) - 1 == CountingEnv.counts["step"]
    assert CountingEnv.counts["reset"] == 1 and CountingEnv.counts["restore"] == 5
    scored = [n for n in tree.nodes if n.score is not None]
    assert sorted(n.score for n in scored) == [0.1, 0.5, 0.8, 0.9]
    assert all(n.info.get("expanded") == 2 for n in scored if n.score >= 0.8)


def test_children_continue_from_the_parent_state(tokenizer):
    ctx = context(tokenizer, first_moves(None), FixedScorer(lambda b: 0.5), max_turns=6)
    patr = make_controller("patr", B0=2, K=2, M=3, top_k=1, alpha=None, theta=None)
    (tree,), stats = patr.rollout([task()], ctx)
    # checkpoints at turns 2 and 4 expand one branch each (2 -> 4 -> 6 live); turn 6 ends all
    assert stats.expanded == 2 and stats.forks == 1 + 2 * 2
    assert stats.trajectories == 6 and CountingEnv.counts["restore"] == 5
    expanded = [n for n in tree.nodes if n.parent is not None and len(n.children) > 1]
    assert [n.turn for n in expanded] == [2, 4] and all(len(n.children) == 3 for n in expanded)
    for node in expanded:
        pos = node.info["env"]["pos"]
        assert pos != [0, 0]  # a fresh env would stand at the start
        for c in node.children:
            # each child's first move (Right) starts where the parent stood
            assert tree.nodes[c].info["env"]["pos"] == [pos[0], min(pos[1] + 1, 3)]


def test_repeated_actions_are_pruned_after_theta_every_turn(tokenizer):
    ctx = context(tokenizer, lambda text, i: "```Up```", FixedScorer(lambda b: 0.5), max_turns=10)
    patr = make_controller("patr", B0=2, K=5, theta=3, alpha=None, top_k=0, theta_at="every_turn")
    (tree,), stats = patr.rollout([task()], ctx)
    leaves = tree.finished_leaves()
    assert [leaf.end_reason for leaf in leaves] == [EndReason.PRUNED_REPEAT] * 2
    assert all(leaf.turn == 3 for leaf in leaves)
    assert stats.pruned == 2


def test_theta_repeat_stop_applies_at_checkpoints_to_unexpanded_branches(tokenizer):
    # Algorithm 1, line 8: L is drawn from A \ E, at checkpoints. Both branches repeat Up from
    # turn 1; at the turn-5 checkpoint (5 repeats >= theta = 3) the expanded one forks into
    # M = 2 children, the other stops as pruned_repeat. The children run to the 10-turn limit.
    ctx = context(tokenizer, lambda text, i: "```Up```", FixedScorer(lambda b: 0.5), max_turns=10)
    patr = make_controller("patr", B0=2, K=5, M=2, top_k=1, theta=3, alpha=None)
    assert patr.config.theta_at == "checkpoint"  # the paper's placement is the default
    (tree,), stats = patr.rollout([task()], ctx)
    ends = sorted((leaf.turn, leaf.end_reason) for leaf in tree.finished_leaves())
    assert ends == [
        (5, EndReason.PRUNED_REPEAT),
        (10, EndReason.MAX_TURNS),
        (10, EndReason.MAX_TURNS),
    ]
    assert stats.pruned == 1 and stats.expanded == 1
    # top_k = 0: nothing is expanded, both stop at the first checkpoint, not at turn 3
    (tree,), stats = make_controller("patr", B0=2, K=5, theta=3, alpha=None, top_k=0).rollout(
        [task()], ctx
    )
    assert [(x.turn, x.end_reason) for x in tree.finished_leaves()] == [
        (5, EndReason.PRUNED_REPEAT)
    ] * 2


def test_scorer_failure_falls_back_to_survive(tokenizer):
    class Broken(Scorer):
        def score(self, task, branches):
            raise TimeoutError("judge did not answer")

    ctx = context(tokenizer, first_moves(None), Broken(), max_turns=4)
    patr = make_controller("patr", B0=3, K=2, theta=None)
    (tree,), stats = patr.rollout([task()], ctx)
    assert stats.scorer_fallbacks == 3 and stats.expanded == 0
    assert len(tree.finished_leaves()) == 3
    assert all(leaf.end_reason == EndReason.MAX_TURNS for leaf in tree.finished_leaves())


def test_best_n_group_drops_pruned(tokenizer):
    value = {"right": 0.9, "down": 0.8, "left": 0.1, "up": 0.5}
    ctx = context(
        tokenizer,
        first_moves(None),
        FixedScorer(lambda b: value[b[1].info["env"]["action_key"]]),
        max_turns=4,
    )
    patr = make_controller("patr", B0=4, K=2, alpha=0.3, theta=None, group="best-n")
    (tree,), stats = patr.rollout([task()], ctx)
    assert stats.trajectories == 5
    assert all(not t.pruned for t in patr.group(tree))


def test_flat_grpo_resets_every_trajectory(tokenizer):
    ctx = context(tokenizer, first_moves(None), max_turns=3)
    grpo = make_controller("grpo", G=5)
    trees, stats = grpo.rollout([task(), Task("b", seed=3)], ctx)
    assert stats.forks == 0 and CountingEnv.counts["reset"] == 10
    assert stats.trajectories == 10 and all(len(t.root.children) == 5 for t in trees)
    assert stats.env_steps == sum(len(t.nodes) - 1 for t in trees)
    # one batched engine call per turn for all 10 trajectories
    assert ctx.engine.calls[0] == 10


def test_tree_random_expands_without_pruning(tokenizer):
    ctx = context(tokenizer, first_moves(None), max_turns=6)
    tr = make_controller("tree-random", B0=4, K=2, top_k=2, M=2, theta=None)
    (_tree,), stats = tr.rollout([task()], ctx)
    assert stats.pruned == 0 and stats.expanded == 4 and stats.scorer_calls == 0
    assert stats.trajectories == 4 + 2 + 2


def test_context_budget_ends_branches(tokenizer):
    ctx = context(tokenizer, first_moves(None), max_turns=10)
    ctx.max_context = 200
    grpo = make_controller("grpo", G=2)
    (tree,), _ = grpo.rollout([task()], ctx)
    assert {leaf.end_reason for leaf in tree.finished_leaves()} == {EndReason.MAX_TOKENS}


def test_env_errors_end_the_branch_not_the_rollout(tokenizer):
    def choose(text, i):
        return "```Right```"

    ctx = context(tokenizer, choose, max_turns=5)
    real = ctx.env_factory

    def factory():
        env = real()
        orig = env.step
        env.step = lambda a: (
            (_ for _ in ()).throw(RuntimeError("sandbox died"))
            if env.snapshot()["turn"] == 2
            else orig(a)
        )
        return env

    ctx.env_factory = factory
    (tree,), stats = make_controller("grpo", G=2).rollout([task()], ctx)
    assert stats.env_errors == 2
    leaves = tree.finished_leaves()
    assert {leaf.end_reason for leaf in leaves} == {EndReason.ENV_ERROR}
    assert all("sandbox died" in leaf.info["error"] for leaf in leaves)


def test_arpo_branches_when_entropy_rises(tokenizer):
    class EntropyEngine(ScriptedEngine):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            for p, comps in zip(prompts, out, strict=True):
                turns = self.tokenizer.decode(list(p)).count("<|im_start|>assistant")
                h = 1.0 if turns == 1 else 2.0 if turns == 3 else 1.0
                for c in comps:
                    c.entropies = [h] * len(c.token_ids)
            return out

    ctx = context(tokenizer, first_moves(None), max_turns=4)
    ctx.engine = EntropyEngine(tokenizer, first_moves(None))
    arpo = make_controller("arpo", G=8, N=2, Z=2, k=4, tau=0.2)
    (tree,), stats = arpo.rollout([task()], ctx)
    # both initial branches branch at their third response (entropy doubled): 2 + 2*2 = 6,
    # then 2 fresh global samples top the group up to G
    assert stats.expanded == 2
    assert stats.trajectories == 8
    assert len(tree.root.children) >= 4


def test_user_env_runs_through_patr_by_import_path(tokenizer):
    chat = ChatFormat(tokenizer)
    ctx = RolloutContext(
        engine=ScriptedEngine(tokenizer, lambda text, i: str(1 + (i + text.count("lower")) % 9)),
        chat=chat,
        sampling=SamplingParams(max_tokens=4, stop_token_ids=chat.stop_token_ids),
        env_factory=lambda: make_env("custom_env.mygame:GuessEnv"),
        scorer=make_scorer("random"),
        rng=random.Random(0),
    )
    trees, stats = make_controller("patr", K=2).rollout([Task("g", seed=5)], ctx)
    tree = trees[0]
    assert all(leaf.end_reason is not None for leaf in tree.leaves())
    # Only expansion makes an inner node with several children and forks beyond the B0 - 1 of
    # the root; the children continue the parent's env state, so no episode outlives the
    # env's 6-guess limit (a fresh env would restart its count).
    expanded = [n for n in tree.nodes if n.parent is not None and len(n.children) > 1]
    assert stats.expanded >= 1 and len(expanded) == stats.expanded
    assert stats.forks == 3 + stats.expanded * (2 - 1)
    assert stats.trajectories == 4 + stats.expanded
    assert all(leaf.turn <= 6 for leaf in tree.leaves())
    assert any(leaf.end_reason == EndReason.MAX_TURNS and leaf.turn == 6 for leaf in tree.leaves())


def test_stats_of_two_rollouts_sum_amounts_and_combine_levels_by_hand():
    # a refill round or a saved block counted in: amounts add up, Ray's levels do not
    a = RolloutStats(trajectories=4, env_steps=10, wall_s=1.0)
    a.extra.update({"tool_calls": 3.0, "distributed/workers": 2.0, "distributed/busy_frac": 0.5})
    a.extra.update({"distributed/queue_depth": 3.0, "distributed/weight_sync_s": 0.2})
    b = RolloutStats(trajectories=6, env_steps=5, wall_s=3.0)
    b.extra.update({"tool_calls": 4.0, "distributed/workers": 2.0, "distributed/busy_frac": 0.9})
    b.extra.update({"distributed/queue_depth": 1.0, "distributed/weight_sync_s": 0.4})
    b.extra["budget_cut"] = 2.0  # an amount only the second has
    a.add(b)
    assert (a.trajectories, a.env_steps, a.wall_s) == (10, 15, 4.0)
    assert a.extra == {
        "tool_calls": 7.0,
        "budget_cut": 2.0,
        "distributed/workers": 2.0,  # the larger: the same two workers ran both
        "distributed/busy_frac": pytest.approx((0.5 * 1.0 + 0.9 * 3.0) / 4.0),  # 0.8
        "distributed/queue_depth": 3.0,
        "distributed/weight_sync_s": 0.4,  # the later
    }
