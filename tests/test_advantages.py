"""Advantage estimators against numbers worked out by hand from the papers' equations."""

import math

import pytest

from agentree.algorithms.advantages import (
    compute_advantages,
    estimator_options,
    group_normalized,
    treepo_advantages,
    treepo_pooled,
    treerl_advantages,
    treerl_node_values,
)
from agentree.tree import EndReason, Tree

DONE = EndReason.COMPLETED


def toy_tree() -> Tree:
    """Three levels below the root; leaf rewards in brackets, node ids in parentheses.

    root(0) ── a(1) ── a1(3)[1]
            │       └─ a2(4)[0]
            └─ b(2) ── b1(5) ── b1x(7)[1]
                    │        └─ b1y(8)[1]
                    └─ b2(6)[0]
    """
    t = Tree("toy")
    t.add_root("q", [100, 101])
    a = t.add_child(0, action_ids=[1, 2], logprobs=[-0.1, -0.2], obs_ids=[50])
    b = t.add_child(0, action_ids=[3], obs_ids=[51, 52])
    t.add_child(a.id, action_ids=[4], obs_ids=[60], reward=1.0, end_reason=DONE)
    t.add_child(a.id, action_ids=[5], reward=0.0, end_reason=DONE)
    b1 = t.add_child(b.id, action_ids=[6, 7], obs_ids=[54])
    t.add_child(b.id, action_ids=[8], reward=0.0, end_reason=DONE)
    t.add_child(b1.id, action_ids=[9], reward=1.0, end_reason=DONE)
    t.add_child(b1.id, action_ids=[10, 11], reward=1.0, end_reason=DONE)
    return t


def chain_tree() -> Tree:
    """Branches that advance without forking, as a turn-level controller builds them.

    root(0) ── c(1) ── d(2) ── l1(4)[1]
            │               └─ l2(5)[0]
            └─ e(3) ── e1(6)[0]
    """
    t = Tree("chain")
    t.add_root("q", [100])
    c = t.add_child(0, action_ids=[1], obs_ids=[50])
    d = t.add_child(c.id, action_ids=[2], obs_ids=[51])
    e = t.add_child(0, action_ids=[3])
    t.add_child(d.id, action_ids=[4], reward=1.0, end_reason=DONE)
    t.add_child(d.id, action_ids=[5], reward=0.0, end_reason=DONE)
    t.add_child(e.id, action_ids=[6], reward=0.0, end_reason=DONE)
    return t


def test_toy_tree_layout():
    # The tests below rely on this order and token layout of the contract's trajectories.
    trajs = toy_tree().trajectories()
    assert [t.leaf for t in trajs] == [3, 4, 6, 7, 8]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0, 1.0]
    b1x = trajs[3]
    assert b1x.token_ids == [100, 101, 3, 51, 52, 6, 7, 54, 9]
    assert b1x.loss_mask == [0, 0, 1, 0, 0, 1, 1, 0, 1]
    assert b1x.node_of_token == [0, 0, 2, 2, 2, 5, 5, 5, 7]


# -- GRPO / PATR Eq. 1, 9 -------------------------------------------------------------------
def test_group_normalized_by_hand():
    # r = [1, 0, 0, 1, 1]: mean 3/5; deviations 2/5, -3/5, -3/5, 2/5, 2/5;
    # sample variance (3 * 4/25 + 2 * 9/25) / (5 - 1) = (30/25) / 4 = 0.3.
    std = math.sqrt(0.3)
    got = group_normalized([1.0, 0.0, 0.0, 1.0, 1.0], eps=0.0)
    want = [0.4 / std, -0.6 / std, -0.6 / std, 0.4 / std, 0.4 / std]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == pytest.approx(0.7302967433, abs=1e-9)
    # eps sits in the denominator, next to the std.
    assert group_normalized([1.0, 0.0], eps=0.5)[0] == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5))


def test_group_normalized_dr_grpo_skips_the_std():
    assert group_normalized([1.0, 0.0, 0.0, 1.0, 1.0], scale="none") == pytest.approx(
        [0.4, -0.6, -0.6, 0.4, 0.4]
    )


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_normalized_all_equal_and_tiny_groups_give_exact_zeros(scale):
    assert group_normalized([0.1, 0.1, 0.1], scale=scale) == [0.0, 0.0, 0.0]
    assert group_normalized([1.0], scale=scale) == [0.0]
    assert group_normalized([], scale=scale) == []


def test_group_normalized_rejects_unknown_scale():
    with pytest.raises(ValueError, match="scale"):
        group_normalized([1.0, 0.0], scale="mad")


# -- TreePO Eq. 5 ---------------------------------------------------------------------------
# Sub-group means: G (root) 3/5; a {a1, a2} 1/2; b {b2, b1x, b1y} 2/3; b1 {b1x, b1y} 1.
# Mean over each leaf's ancestors (root .. parent) of R_i - mean(G_j):
TOY_POOLED = [
    ((1 - 3 / 5) + (1 - 1 / 2)) / 2,  # a1: 9/20
    ((0 - 3 / 5) + (0 - 1 / 2)) / 2,  # a2: -11/20
    ((0 - 3 / 5) + (0 - 2 / 3)) / 2,  # b2: -19/30
    ((1 - 3 / 5) + (1 - 2 / 3) + (1 - 1)) / 3,  # b1x: 11/45
    ((1 - 3 / 5) + (1 - 2 / 3) + (1 - 1)) / 3,  # b1y: 11/45
]


def test_treepo_pooled_by_hand():
    assert treepo_pooled(toy_tree().trajectories()) == pytest.approx(TOY_POOLED, abs=1e-12)
    assert TOY_POOLED[0] == pytest.approx(9 / 20) and TOY_POOLED[3] == pytest.approx(11 / 45)


def test_treepo_tree_std_divides_by_the_tree_std():
    tree = toy_tree()
    trajs = tree.trajectories()
    # Sample std over G of the pooled values: mean = (81 - 99 - 114 + 44 + 44)/180/5 = -11/225.
    mean = -11 / 225
    std = math.sqrt(sum((x - mean) ** 2 for x in TOY_POOLED) / 4)
    assert std == pytest.approx(0.5034050722, abs=1e-9)
    adv = treepo_advantages(tree, trajs, eps=0.0, norm="tree-std")
    for per_token, traj, pooled in zip(adv, trajs, TOY_POOLED, strict=True):
        assert len(per_token) == len(traj.token_ids)
        want = [pooled / std if m else 0.0 for m in traj.loss_mask]
        assert per_token == pytest.approx(want, abs=1e-12)
    # b1x: a policy token of b, an observation token of b (0), a policy token of b1.
    assert adv[3][2] == pytest.approx(0.4855820054, abs=1e-9)
    assert adv[3][3] == 0.0
    raw = treepo_advantages(tree, trajs, norm="none")
    assert raw[0][2] == pytest.approx(9 / 20)


def test_treepo_counts_each_depth_unless_asked_to_merge_chains():
    trajs = chain_tree().trajectories()  # leaves l1, l2, e1 with rewards 1, 0, 0
    # G mean 1/3; c and d both hold {l1, l2}, mean 1/2. e holds e1 alone: R - R carries no
    # relative signal, so e1 keeps only the root term.
    per_depth = [((1 - 1 / 3) + 0.5 + 0.5) / 3, ((0 - 1 / 3) - 0.5 - 0.5) / 3, 0 - 1 / 3]
    merged = [((1 - 1 / 3) + 0.5) / 2, ((0 - 1 / 3) - 0.5) / 2, 0 - 1 / 3]
    assert treepo_pooled(trajs) == pytest.approx(per_depth, abs=1e-12)
    assert treepo_pooled(trajs, distinct_subgroups=True) == pytest.approx(merged, abs=1e-12)
    assert per_depth[0] == pytest.approx(5 / 9) and merged[0] == pytest.approx(7 / 12)


def test_treepo_all_equal_rewards_give_zeros():
    tree = toy_tree()
    for n in tree.leaves():
        n.reward = 1.0
    adv = treepo_advantages(tree, tree.trajectories())
    assert all(x == 0.0 for per_token in adv for x in per_token)


# -- TreeRL Eq. 2-4 and the 1/sqrt(|L(n)|) re-weighting -------------------------------------
# V: root 3/5, a 1/2, b 2/3, b1 1, leaves their reward. |L|: a 2, b 3, b1 2, leaves 1.
TOY_TREERL = {
    1: ((1 / 2 - 3 / 5) + (1 / 2 - 3 / 5)) / math.sqrt(2),  # a: -0.2/sqrt(2)
    2: ((2 / 3 - 3 / 5) + (2 / 3 - 3 / 5)) / math.sqrt(3),  # b: (2/15)/sqrt(3)
    3: (1 - 3 / 5) + (1 - 1 / 2),  # a1: 0.9
    4: (0 - 3 / 5) + (0 - 1 / 2),  # a2: -1.1
    5: ((1 - 3 / 5) + (1 - 2 / 3)) / math.sqrt(2),  # b1: (11/15)/sqrt(2)
    6: (0 - 3 / 5) + (0 - 2 / 3),  # b2: -19/15
    7: (1 - 3 / 5) + (1 - 1),  # b1x: 0.4
    8: (1 - 3 / 5) + (1 - 1),  # b1y: 0.4
}


def test_treerl_node_values_by_hand():
    value, count = treerl_node_values(toy_tree().trajectories())
    assert value == pytest.approx({0: 0.6, 1: 0.5, 2: 2 / 3, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1, 8: 1})
    assert count == {0: 5, 1: 2, 2: 3, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1, 8: 1}


def test_treerl_per_segment_advantages_by_hand():
    tree = toy_tree()
    trajs = tree.trajectories()
    adv = treerl_advantages(tree, trajs)
    assert TOY_TREERL[1] == pytest.approx(-0.1414213562, abs=1e-9)
    assert TOY_TREERL[2] == pytest.approx(0.0769800359, abs=1e-9)
    assert TOY_TREERL[5] == pytest.approx(0.5185449729, abs=1e-9)
    for per_token, traj in zip(adv, trajs, strict=True):
        want = [
            TOY_TREERL[n] if m else 0.0
            for n, m in zip(traj.node_of_token, traj.loss_mask, strict=True)
        ]
        assert per_token == pytest.approx(want, abs=1e-12)
    # b1x, token by token: root prompt, b's action, b's observation, b1's two actions, b1's
    # observation, b1x's action.
    r = TOY_TREERL
    assert adv[3] == pytest.approx([0, 0, r[2], 0, 0, r[5], r[5], 0, r[7]], abs=1e-12)


def test_treerl_uses_only_the_group_it_is_given():
    tree = toy_tree()
    tree.nodes[6].end_reason = EndReason.PRUNED_LOW_SCORE  # b2 leaves the group
    trajs = tree.trajectories(include_pruned=False)
    assert [t.leaf for t in trajs] == [3, 4, 7, 8]
    # V(root) = 3/4, V(b) = 1 with |L(b)| = 2.
    adv = treerl_advantages(tree, trajs)
    assert adv[2][2] == pytest.approx(((1 - 3 / 4) + (1 - 3 / 4)) / math.sqrt(2), abs=1e-12)


# -- dispatcher -----------------------------------------------------------------------------
def test_compute_advantages_broadcasts_grpo_onto_policy_tokens():
    tree = toy_tree()
    trajs = tree.trajectories()
    out = compute_advantages("grpo", [tree], [trajs], eps=0.0)
    std = math.sqrt(0.3)  # as in test_group_normalized_by_hand: rewards 1, 0, 0, 1, 1
    a = 0.4 / std
    assert out[0][3] == pytest.approx([0, 0, a, 0, 0, a, a, 0, a], abs=1e-12)
    b = -0.6 / std  # a2: root prompt, a's two actions, a's observation, a2's action
    assert out[0][1] == pytest.approx([0, 0, b, b, 0, b], abs=1e-12)


def test_compute_advantages_tree_estimators_match_the_functions():
    trees = [toy_tree(), chain_tree()]
    groups = [t.trajectories() for t in trees]
    assert compute_advantages("treerl", trees, groups) == [
        treerl_advantages(t, g) for t, g in zip(trees, groups, strict=True)
    ]
    for norm in ("tree-std", "none"):
        assert compute_advantages("treepo", trees, groups, eps=0.0, norm=norm) == [
            treepo_advantages(t, g, eps=0.0, norm=norm) for t, g in zip(trees, groups, strict=True)
        ]


# Global whitening (TreePO §3.3 "global variance normalization as in REINFORCE++"): every
# policy token carries its trajectory's pooled value; policy tokens per trajectory, by hand:
# toy a1 = a(2) + a1(1) = 3, a2 = 3, b2 = b(1) + b2(1) = 2, b1x = 1 + 2 + 1 = 4, b1y = 1 + 2 + 2
# = 5; chain l1 = c + d + l1 = 3, l2 = 3, e1 = e + e1 = 2.
CHAIN_POOLED = [5 / 9, -4 / 9, -1 / 3]  # see test_treepo_counts_each_depth...
TOY_TOKENS, CHAIN_TOKENS = [3, 3, 2, 4, 5], [3, 3, 2]


def token_stats(pooled, tokens):
    values = [x for x, n in zip(pooled, tokens, strict=True) for _ in range(n)]
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))


def test_treepo_batch_whitening_subtracts_the_batch_mean_and_divides_by_its_std():
    trees = [toy_tree(), chain_tree()]
    groups = [t.trajectories() for t in trees]
    assert [t.num_policy_tokens for t in groups[0]] == TOY_TOKENS
    assert [t.num_policy_tokens for t in groups[1]] == CHAIN_TOKENS
    mean, std = token_stats(TOY_POOLED + CHAIN_POOLED, TOY_TOKENS + CHAIN_TOKENS)
    # 25 tokens: sum = 3(9/20) - 3(11/20) - 2(19/30) + 9(11/45) + 3(5/9) - 3(4/9) - 2/3
    assert mean == pytest.approx((1.35 - 1.65 - 19 / 15 + 2.2 + 5 / 3 - 4 / 3 - 2 / 3) / 25)
    out = compute_advantages("treepo", trees, groups, eps=0.0)  # norm="batch" is the default
    a = (TOY_POOLED[0] - mean) / std
    assert out[0][0] == pytest.approx([0, 0, a, a, 0, a], abs=1e-12)  # a1: prompt, a, obs, a1
    c = (5 / 9 - mean) / std  # l1: root prompt, c's action and observation, d's, l1's action
    assert out[1][0] == pytest.approx([0, c, 0, c, 0, c], abs=1e-12)
    # whitened: the batch's policy tokens now have mean 0 and std 1
    flat = [
        x
        for g, o in zip(groups, out, strict=True)
        for t, a in zip(g, o, strict=True)
        for x, m in zip(a, t.loss_mask, strict=True)
        if m
    ]
    assert sum(flat) / len(flat) == pytest.approx(0.0, abs=1e-12)
    assert token_stats(flat, [1] * len(flat))[1] == pytest.approx(1.0, abs=1e-12)
    # batch-std keeps the old, unshifted scaling by the same token std
    out = compute_advantages("treepo", trees, groups, eps=0.0, norm="batch-std")
    assert out[0][0][2] == pytest.approx(TOY_POOLED[0] / std, abs=1e-12)


def test_treepo_batch_whitening_leaves_out_trees_without_signal():
    trees = [toy_tree(), chain_tree()]
    for n in trees[1].leaves():
        n.reward = 1.0  # all equal: rejected by the paper (s.t. std({R_i}^G) != 0)
    groups = [t.trajectories() for t in trees]
    out = compute_advantages("treepo", trees, groups, eps=0.0)
    assert all(x == 0.0 for per_token in out[1] for x in per_token)
    mean, std = token_stats(TOY_POOLED, TOY_TOKENS)  # statistics over the toy tree alone
    assert out[0][3][2] == pytest.approx((TOY_POOLED[3] - mean) / std, abs=1e-12)
    single = treepo_advantages(trees[0], groups[0], eps=0.0)  # one tree: a batch of one
    assert single == out[0]


def test_advantage_options_are_validated():
    estimator_options("treepo", {"norm": "tree-std", "distinct_subgroups": True})
    with pytest.raises(ValueError, match="has no option 'norm'"):
        estimator_options("grpo", {"norm": "batch"})
    with pytest.raises(ValueError, match="must be one of"):
        estimator_options("treepo", {"norm": "group"})
    with pytest.raises(ValueError, match="must be a bool"):
        estimator_options("treepo", {"distinct_subgroups": "yes"})


def test_compute_advantages_rejects_bad_input():
    tree, other = toy_tree(), chain_tree()
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", [tree], [tree.trajectories()])
    with pytest.raises(ValueError, match="one group per tree"):
        compute_advantages("grpo", [tree, other], [tree.trajectories()])
    for name in ("grpo", "treepo", "treerl"):
        with pytest.raises(ValueError, match="not a root-to-leaf path"):
            compute_advantages(name, [tree], [other.trajectories()])
