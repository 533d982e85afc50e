"""TreePO sampling against hand-set policies (budgets and fallbacks worked out by hand from
§2.2 and Algorithm 1), and end to end with the tiny policy on the math env."""

from __future__ import annotations

import os

from tiny_setup import check_group, tiny_context, tiny_engine
from toy_policy import EOS, toy_context

from agentree.config import load_config
from agentree.envs.base import Task
from agentree.rollout.token.tokentree import response_ids
from agentree.rollout.token.treepo import TreePO, TreePOConfig, has_repetition, spread_budget
from agentree.run.trainer import Trainer
from agentree.tree import EndReason


def run(dist, max_tokens: int = 64, **cfg):
    ctx, engine = toy_context(dist, max_tokens=max_tokens)
    treepo = TreePO(TreePOConfig(**cfg))
    trees, stats = treepo.rollout([Task("t", 0)], ctx)
    return treepo, trees[0], stats, engine


def depth(tree, node: int) -> int:
    return len(tree.path(node)) - 1


def test_repetition_is_a_substring_seen_count_times():
    assert has_repetition("abababab", 4, 3)  # "abab" at 0, 2, 4
    assert not has_repetition("abababab", 4, 4)
    assert not has_repetition("abc", 4, 2)


def test_branching_budget_transfer_by_hand():
    # b=2 per path that reached the depth, capped by the places left, spread evenly.
    assert spread_budget(2, 0, 0, w=16, b=2) == [2, 2]
    assert spread_budget(3, 1, 5, w=16, b=2) == [3, 3, 2]  # min(11, 2*4) = 8
    assert spread_budget(4, 0, 2, w=8, b=2) == [2, 2, 1, 1]  # min(6, 8) = 6
    assert spread_budget(4, 0, 6, w=8, b=2) == [1, 1, 1, 1]  # 2 places, but none is dropped
    assert spread_budget(0, 3, 3, w=8, b=2) == []


def never_stops(resp):
    return {4: 1.0}


def test_binary_tree_grows_to_width_w():
    # w=8, b=2, no early stop: 2 -> 4 -> 8 paths, leaves at depth d=3 (2^d = 8).
    treepo, tree, stats, engine = run(never_stops, w=8, d=3, l=2)
    leaves = tree.leaves()
    assert len(leaves) == 8 and len(treepo.group(tree)) == 8
    assert all(depth(tree, n.id) == 3 and n.info["finish"] == "max_depth" for n in leaves)
    assert all(len(n.children) == 2 for n in tree.nodes if n.children)
    assert all(len(n.action_ids) == 2 for n in tree.nodes[1:])
    # one engine call per depth; copies of a path share one context
    assert len(engine.prompts_seen) == 2 + 4 + 8
    assert stats.expanded == 7 and stats.extra["branches"] == 7


def test_width_caps_the_budget():
    # w=4: 2 -> min(4, 2*2) = 4 -> min(4, 2*4) = 4, one copy each at the last depth.
    _, tree, _, _ = run(never_stops, w=4, d=3, l=2)
    assert len(tree.leaves()) == 4
    per_depth = [sum(1 for n in tree.nodes[1:] if depth(tree, n.id) == j) for j in (1, 2, 3)]
    assert per_depth == [2, 4, 4]


def stops_at(n_tokens):
    def dist(resp):
        return {EOS: 1.0} if len(resp) >= n_tokens else {4: 1.0}

    return dist


def test_fallback_restarts_from_a_segment_boundary_of_a_finished_path():
    # Responses are [4, 4, 4, EOS]: with l=2 they stop at depth 2. w=6, b=2: depth 1 has 2
    # paths, depth 2 has min(6, 4) = 4, all stop -> no active path and 4 < 6 leaves, so the
    # fallback restarts b=2 copies from a boundary of one finished path (the root or its
    # depth-1 node), which end as 2 more leaves.
    _, tree, stats, _ = run(stops_at(3), w=6, d=5, l=2)
    leaves = tree.leaves()
    assert len(leaves) == 6 and all(n.info["finish"] == "stop" for n in leaves)
    assert stats.extra["fallback_paths"] == 2
    (restart,) = [n for n in tree.nodes if "fallbacks" in n.info]
    assert restart.info["fallbacks"] == 2
    assert len(response_ids(tree, restart.id)) in (0, 2)  # token-aligned at a segment boundary
    for leaf in leaves:
        assert response_ids(tree, leaf.id) == [4, 4, 4, EOS]


def test_fallback_window_bounds_how_far_back_paths_restart():
    # window 1: the restart is the parent of a depth-2 leaf, so the root keeps 2 children.
    _, tree, _, _ = run(stops_at(3), w=6, d=5, l=2, fallback_window=1)
    assert len(tree.leaves()) == 6 and len(tree.root.children) == 2
    (restart,) = [n for n in tree.nodes if "fallbacks" in n.info]
    assert depth(tree, restart.id) == 1


def test_without_finished_answers_fallback_restarts_from_the_prompt():
    # d=1: every path ends at depth 1 as max_depth, which is no fallback candidate.
    _, tree, stats, _ = run(never_stops, w=4, d=1, l=2)
    assert len(tree.root.children) == 4 and stats.extra["fallback_paths"] == 2
    assert all(n.info["finish"] == "max_depth" for n in tree.leaves())


def alternating(resp):
    return {7: 1.0} if len(resp) % 2 == 0 else {6: 1.0}


def test_repetition_in_the_new_segment_stops_the_path_but_keeps_it_in_the_group():
    # "7 6 7 6 7 6 7 6": the 4-character "7 6 " occurs 4 times in the 8-token segment.
    treepo, tree, stats, _ = run(alternating, w=2, d=5, l=8, rep_chars=4, rep_count=3)
    group = treepo.group(tree)
    assert len(group) == 2 and all(t.end_reason == EndReason.PRUNED_REPETITION for t in group)
    assert all(t.reward == 0.4 for t in group)  # stepped: four 7s
    assert stats.pruned == 2 and stats.env_steps == 2
    # 4-token segments hold "7 6 7 6" (each 4-character substring once): never stopped early.
    _, tree, _, _ = run(alternating, w=2, d=3, l=4, rep_chars=4, rep_count=3)
    assert all(n.info["finish"] == "max_depth" for n in tree.leaves())


def test_a_complete_answer_ends_the_path():
    def dist(resp):
        return {7: 1.0} if len(resp) == 2 else {8: 1.0} if len(resp) == 3 else {4: 1.0}

    _, tree, _, _ = run(dist, w=2, d=6, l=2, answer_pattern=r"7 8")
    assert all(n.info["finish"] == "answer" and depth(tree, n.id) == 2 for n in tree.leaves())


def test_treepo_on_math_with_the_tiny_policy(tmp_path_factory):
    engine = tiny_engine("math", tmp_path_factory.mktemp("cache"))
    ctx = tiny_context(engine, "math", max_tokens=24)
    treepo = TreePO(TreePOConfig(w=4, d=3, l=8, rep_chars=6, rep_count=4))
    trees, stats = treepo.rollout([Task("a", 1), Task("b", 2)], ctx)
    assert stats.trajectories == 8
    for tree in trees:
        group = treepo.group(tree)
        assert len(group) == 4
        check_group(tree, group, ctx)
    # Continuing paths reuse their cached context: only the last token of a segment is
    # recomputed, so the model runs over at most the prompts plus the sampled tokens.
    prompts = sum(len(t.root.obs_ids) for t in trees)
    assert stats.policy_tokens_cached > 0
    assert stats.extra["policy_tokens_forward"] <= prompts + stats.policy_tokens_generated


def test_train_step_with_treepo_sampling_and_advantage(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTREE_CACHE", os.environ.get("AGENTREE_CACHE", str(tmp_path)))
    cfg = load_config(
        None,
        select={"env": "math", "rollout": "treepo"},
        overrides=[
            "rollout.w=4",
            "rollout.d=2",
            "rollout.l=8",
            "engine.max_tokens=16",
            "train.tasks_per_step=2",
            "train.advantage=treepo",
            "train.kl_coef=0",
        ],
    )
    trainer = Trainer(cfg, tmp_path, log=lambda m: None)
    metrics = trainer.train_step()
    assert metrics["rollout/trajectories"] == 8 and metrics["train/group_size"] == 4
    assert metrics["train/policy_tokens"] > 0 and "train/loss" in metrics
    assert metrics["rollout/policy_tokens_forward"] > 0
