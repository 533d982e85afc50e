"""LATR against hand-set next-token distributions (decisions worked out from Eq. 5-10 and
Algorithm 1 by hand), and end to end with the tiny policy on Countdown."""

from __future__ import annotations

import math
import os

import pytest
from tiny_setup import check_group, tiny_context, tiny_engine
from toy_policy import EOS, PROMPT, toy_context

from agentree.config import load_config
from agentree.envs.base import Task
from agentree.rollout.base import make_controller
from agentree.rollout.token.latr import LATR, LATRConfig, edit_distance
from agentree.run.trainer import Trainer
from agentree.tree import EndReason


def run(dist, step: int = 0, max_tokens: int = 64, **cfg):
    ctx, engine = toy_context(dist, max_tokens=max_tokens, step=step)
    latr = LATR(LATRConfig(**cfg))
    trees, stats = latr.rollout([Task("t", 0)], ctx)
    tree = trees[0]
    return latr, tree, stats, engine


def responses(latr, tree) -> list[list[int]]:
    return sorted(t.token_ids[len(PROMPT) :] for t in latr.group(tree))


def test_edit_distance_is_levenshtein_over_token_ids():
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([], [4, 5]) == 2
    # kitten -> sitting: substitute k->s, e->i, insert g
    assert edit_distance([11, 9, 20, 20, 5, 14], [19, 9, 20, 20, 9, 14, 7]) == 3


def fixed_tail(first_to_tail, length):
    """pos 0 from `first`, then each first token's own deterministic continuation, EOS at end."""

    def dist(resp):
        if not resp:
            return first_to_tail["first"]
        if len(resp) >= length:
            return {EOS: 1.0}
        return first_to_tail[resp[0]](resp)

    return dist


def test_dual_threshold_branching_eq5():
    # p(top)=.40. Token 2: .30 > .25 and .40-.30 < .15 -> branch. Token 3: .26 > .25 and
    # .40-.26 = .14 < .15 -> branch. Token 4: .04 < tau_abs -> no. At pos 1 branch 1 sees
    # {5: .55, 6: .30}: .30 > .25 but .55-.30 = .25 >= .15 -> no branch (relative test).
    dist = fixed_tail(
        {
            "first": {1: 0.40, 2: 0.30, 3: 0.26, 4: 0.04},
            1: lambda r: {5: 0.55, 6: 0.30, 9: 0.15} if len(r) == 1 else {5: 1.0},
            2: lambda r: {6: 1.0},
            3: lambda r: {7: 1.0},
        },
        length=4,
    )
    latr, tree, stats, _ = run(dist, k=3, r=[50])
    assert responses(latr, tree) == [[1, 5, 5, 5, EOS], [2, 6, 6, 6, EOS], [3, 7, 7, 7, EOS]]
    births = sorted(n.info["latr"]["p"] for n in tree.nodes if "latr" in n.info)
    assert births == [0.26, 0.3]
    assert stats.extra["branches"] == 2 and stats.pruned == 0
    assert tree.meta["padded"] == 0


def test_width_cap_admits_the_most_probable_candidates_first():
    # pos 0: {1: .45, 2: .35} -> one child (2). pos 1: branch 1 offers 6 (.30), branch 2
    # offers 7 (.35); with k=3 one place is left and the more probable 7 takes it.
    dist = fixed_tail(
        {
            "first": {1: 0.45, 2: 0.35, 9: 0.20},
            1: lambda r: {5: 0.40, 6: 0.30, 4: 0.15, 9: 0.15} if len(r) == 1 else {8: 1.0},
            2: lambda r: {5: 0.40, 7: 0.35, 9: 0.25} if len(r) == 1 else {8: 1.0},
        },
        length=3,
    )
    latr, tree, _, _ = run(dist, k=3, r=[50])
    assert responses(latr, tree) == [[1, 5, 8, EOS], [2, 5, 8, EOS], [2, 7, 8, EOS]]
    latr, tree, _, _ = run(dist, k=2, r=[50])  # only the first child fits
    assert responses(latr, tree) == [[1, 5, 8, EOS], [2, 5, 8, EOS]]


def test_lookahead_prunes_a_similar_child_with_its_descendants():
    # Child "2" copies its parent after the branching token: over r=3 tokens [2,5,5] vs
    # [1,5,5] the normalised edit distance is 1/3 < 0.4 -> pruned at its 3rd token, with the
    # grandchild "6" it opened at pos 1 (which itself diverges). Child "3" differs in all 3
    # positions (distance 1) and survives.
    def tail(r):
        if r[0] == 3:
            return {7: 1.0}
        if r[:2] == [2, 6]:
            return {8: 1.0}
        if r == [2]:
            return {5: 0.40, 6: 0.35, 9: 0.25}
        return {5: 1.0}

    dist = fixed_tail({"first": {1: 0.36, 2: 0.34, 3: 0.30}, 1: tail, 2: tail, 3: tail}, 6)
    latr, tree, stats, _ = run(dist, k=8, r=[3])
    pruned = {
        tuple(t for p in tree.path(n.id)[1:] for t in p.action_ids): n
        for n in tree.leaves()
        if n.end_reason == EndReason.PRUNED_SIMILAR
    }
    assert pruned[(2, 5, 5)].end_reason == EndReason.PRUNED_SIMILAR
    assert pruned[(2, 5, 5)].info["pruned"]["edit_distance"] == pytest.approx(1 / 3, abs=1e-4)
    assert pruned[(2, 6, 8)].info["finish"] == "pruned"  # a descendant, its tokens kept
    assert tree.nodes[pruned[(2, 6, 8)].parent].action_ids == [2]
    assert stats.pruned == 2
    # Group: the root branch, the survivor and 6 copies of the root branch; no pruned ones.
    group = responses(latr, tree)
    assert group.count([1, 5, 5, 5, 5, 5, EOS]) == 7
    assert [3, 7, 7, 7, 7, 7, EOS] in group and len(group) == 8
    assert all(not t.pruned for t in latr.group(tree))
    assert len(tree.trajectories()) == 10  # the tree keeps the pruned branches
    assert pruned[(2, 5, 5)].id not in tree.meta["group"] and len(tree.meta["group"]) == 8


def test_every_lookahead_window_must_pass():
    # r = {2, 4}. Child "2" = [2,5,5,5] vs parent [1,5,5,5]: window 2 gives 1/2 (kept),
    # window 4 gives 1/4 < 0.4 (pruned at its 4th token). Child "3" = [3,6,6,5]: 2/2, then
    # 3/4 -> kept.
    def tail(r):
        if r[0] == 3 and len(r) < 3:
            return {6: 1.0}
        return {5: 1.0}

    dist = fixed_tail({"first": {1: 0.36, 2: 0.34, 3: 0.30}, 1: tail, 2: tail, 3: tail}, 6)
    latr, tree, _, _ = run(dist, k=3, r=[2, 4])
    (pruned,) = [n for n in tree.leaves() if n.end_reason == EndReason.PRUNED_SIMILAR]
    assert pruned.action_ids == [2, 5, 5, 5]
    assert pruned.info["pruned"]["window"] == 4
    assert pruned.info["pruned"]["edit_distance"] == 0.25
    assert [3, 6, 6, 5, 5, 5, EOS] in responses(latr, tree)


def two_then(after):
    """pos 0 opens one child (1 | 2), pos 1 makes them differ, then `after` until length 30."""

    def dist(resp):
        if not resp:
            return {1: 0.4, 2: 0.3, 9: 0.2, 4: 0.1}
        if len(resp) == 1:
            return {7: 1.0} if resp[0] == 1 else {8: 1.0}
        return {EOS: 1.0} if len(resp) >= 30 else after

    return dist


def test_full_tree_switches_to_sampling_once_no_check_is_pending():
    # k=2 is reached at pos 0; the child's only check (r=2) happens at pos 1, so from pos 2 on
    # both branches sample from {5: .6, 6: .4} (greedy decoding would only ever pick 5).
    latr, tree, _, _ = run(two_then({5: 0.6, 6: 0.4}), k=2, r=[2])
    assert tree.meta["saturation"] == 2
    group = latr.group(tree)
    tails = [t for traj in group for t in traj.token_ids[len(PROMPT) + 2 : -1]]
    assert set(tails) == {5, 6}
    for traj in group:
        n = len(PROMPT) + 2
        for t, lp in zip(traj.token_ids[n:-1], traj.logprobs[n:-1], strict=True):
            assert lp == pytest.approx(math.log(0.6 if t == 5 else 0.4), abs=1e-6)


def test_tree_below_width_stays_greedy_and_is_padded_with_its_first_branch():
    latr, tree, stats, _ = run(two_then({5: 0.6, 6: 0.4}), k=3, r=[2])
    assert tree.meta["saturation"] is None
    group = responses(latr, tree)
    first = [1, 7, *[5] * 28, EOS]
    assert group == sorted([first, first, [2, 8, *[5] * 28, EOS]])
    (copy,) = [n for n in tree.leaves() if "copy_of" in n.info]
    assert copy.reward == 0.1 and copy.end_reason == EndReason.COMPLETED  # the env's reward
    assert stats.policy_tokens_generated == 2 * 31  # the copy was not sampled
    assert stats.extra["padded"] == 1


def test_hybrid_share_anneals_with_the_training_step():
    latr = LATR(LATRConfig(k=4, eta0=1.0, gamma=0.5))
    # eta * k = 4, 2, 1, 0.5, 0.25 -> round to nearest (halves up)
    assert [latr.tree_share(s) for s in range(5)] == [4, 2, 1, 1, 0]
    dist = two_then({5: 0.6, 6: 0.4})
    latr, tree, _, _ = run(dist, step=1, k=4, gamma=0.5, r=[2])
    assert (tree.meta["k_latr"], tree.meta["k_std"]) == (2, 2)
    roots = [tree.nodes[c] for c in tree.root.children]
    # the LATR tree (its root branch and one child at pos 0) plus two independent samples
    assert len(latr.group(tree)) == 4 and len(roots) == 4
    assert sum("latr" in n.info for n in roots) == 1


def test_stats_count_forward_and_sampled_tokens():
    # Three branches from pos 0, each 4 tokens with EOS: the prompt is computed once, then 3
    # rows are fed at pos 0, 1 and 2; the EOS sampled at pos 3 is never fed back.
    dist = fixed_tail(
        {
            "first": {1: 0.40, 2: 0.30, 3: 0.30},
            1: lambda r: {5: 1.0},
            2: lambda r: {6: 1.0},
            3: lambda r: {7: 1.0},
        },
        length=3,
    )
    _, _, stats, engine = run(dist, k=3, r=[50])
    assert stats.extra["policy_tokens_forward"] == len(PROMPT) + 3 * 3
    assert stats.policy_tokens_prefilled == len(PROMPT)
    assert stats.policy_tokens_generated == 12
    assert engine.forks == [[0, 0, 0]]  # one fork opens the children; KV is copied once


def test_latr_on_countdown_with_the_tiny_policy(tmp_path_factory):
    engine = tiny_engine("countdown", tmp_path_factory.mktemp("cache"))
    ctx = tiny_context(engine, "countdown", max_tokens=24)
    # The untrained policy spreads its mass over ~100 tokens (top p ~ 0.04), so the paper's
    # thresholds would never fire: loosen them to force branching on real distributions.
    latr = make_controller("latr", k=4, tau_abs=0.01, tau_rel=0.03, r=[4, 8])
    tasks = [Task("a", 1), Task("b", 2)]
    trees, stats = latr.rollout(tasks, ctx)
    assert stats.trajectories == 8 and stats.expanded >= 1
    for tree in trees:
        group = latr.group(tree)
        assert len(group) == 4
        check_group(tree, group, ctx)
    assert stats.policy_tokens_generated <= 8 * 24
    assert stats.extra["policy_tokens_forward"] > 0


def test_train_step_with_latr_on_countdown(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTREE_CACHE", os.environ.get("AGENTREE_CACHE", str(tmp_path)))
    cfg = load_config(
        None,
        select={"env": "countdown", "rollout": "latr"},
        overrides=[
            "rollout.k=4",
            "rollout.tau_abs=0.01",
            "rollout.tau_rel=0.03",
            "engine.max_tokens=16",
            "train.tasks_per_step=2",
            "train.kl_coef=0",
        ],
    )
    trainer = Trainer(cfg, tmp_path, log=lambda m: None)
    metrics = trainer.train_step()
    assert metrics["rollout/trajectories"] == 8 and metrics["train/group_size"] == 4
    assert metrics["train/policy_tokens"] > 0 and "train/loss" in metrics
