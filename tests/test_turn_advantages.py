"""Turn-level estimators (GiGPO, RTMC) and Tree-GRPO against numbers worked out by hand.

GiGPO is also checked against an independent numpy transcription of how verl-agent's
`gigpo/core_gigpo.py` computes it (one row per step, groups keyed by task and anchor state),
on batches built from agentree trees.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest
from helpers import load_benchmark

from agentree.algorithms.advantages import (
    compute_advantages,
    estimator_options,
    gigpo_advantages,
    group_normalized,
    rtmc_advantages,
    treegrpo_advantages,
)
from agentree.tree import EndReason, Tree

DONE = EndReason.COMPLETED


def build(paths: list[list[tuple[str, str, float]]], start: str = "S0") -> Tree:
    """A tree from trajectories given as [(action, next state key, reward), ...].

    Trajectories sharing a prefix of identical (action, state, reward) steps share its nodes,
    as a forking controller builds them; each turn's node appends one distinct token id.
    """
    t = Tree("task")
    t.add_root("grid " + start, [100], {"state_key": start})
    next_id = 1
    for path in paths:
        cur = 0
        for k, (action, state, reward) in enumerate(path):
            last = k == len(path) - 1
            match = [
                c
                for c in t.nodes[cur].children
                if t.nodes[c].action == action
                and t.nodes[c].info["state_key"] == state
                and not last
                and t.nodes[c].children
            ]
            if match:
                cur = match[0]
                continue
            node = t.add_child(
                cur,
                action=action,
                action_ids=[next_id],
                obs_ids=[] if last else [50],
                observation="grid " + state,
                reward=reward,
                end_reason=DONE if last else None,
                info={"state_key": state, "env": {"action_key": action}},
            )
            next_id += 1
            cur = node.id
    return t


def flat(paths: list[list[tuple[str, str, float]]]) -> Tree:
    """Every trajectory its own chain below the root (flat GRPO sampling)."""
    t = Tree("task")
    t.add_root("grid S0", [100], {"state_key": "S0"})
    for path in paths:
        cur = 0
        for k, (action, state, reward) in enumerate(path):
            last = k == len(path) - 1
            cur = t.add_child(
                cur,
                action=action,
                action_ids=[len(t.nodes)],
                observation="grid " + state,
                reward=reward,
                end_reason=DONE if last else None,
                info={"state_key": state, "env": {"action_key": action}},
            ).id
    return t


# tau1 reaches the goal through A; tau2 passes through A too and fails; tau3 goes via C.
GIGPO_PATHS = [
    [("down", "A", 0.0), ("right", "G", 1.0)],
    [("down", "A", 0.0), ("down", "B", 0.0), ("up", "B", 0.0)],
    [("right", "C", 0.0), ("up", "C", 0.0)],
]


def per_turn(tree: Tree, adv: list[list[float]]) -> list[list[float]]:
    """Each trajectory's advantage per turn (the value on that turn's one policy token)."""
    out = []
    for t, a in zip(tree.trajectories(), adv, strict=True):
        out.append([x for x, m in zip(a, t.loss_mask, strict=True) if m])
    return out


def test_gigpo_two_trajectories_through_one_state_share_a_step_group():
    tree = flat(GIGPO_PATHS)
    adv = per_turn(tree, gigpo_advantages(tree, tree.trajectories()))
    # Episode level (mean over the 7 step rows, verl-agent's default): R = 1,1,0,0,0,0,0
    # -> mean 2/7; tau1 +5/7, the others -2/7.
    e1, e0 = 5 / 7, -2 / 7
    # Step returns, gamma 0.95: tau1 (0.95, 1), tau2 (0, 0, 0), tau3 (0, 0).
    # Step groups: S0 {0.95, 0, 0} (mean 0.95/3); A {1 (tau1), 0 (tau2)} (mean 1/2);
    # B {0} and C {0} alone -> 0.
    s0 = 0.95 / 3
    expected = [
        [e1 + (0.95 - s0), e1 + 0.5],
        [e0 - s0, e0 - 0.5, e0 + 0.0],
        [e0 - s0, e0 + 0.0],
    ]
    for got, want in zip(adv, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-12)


def test_gigpo_std_normalisation_weights_and_trajectory_statistics():
    tree = flat(GIGPO_PATHS)
    trajs = tree.trajectories()
    adv = per_turn(tree, gigpo_advantages(tree, trajs, norm="std", step_weight=0.5, step_gamma=1.0))
    # Episode: 7 rows [1,1,0,0,0,0,0], mean 2/7, sample var (2 (5/7)^2 + 5 (2/7)^2) / 6 = 5/21.
    sd_e = math.sqrt(5 / 21)
    e1, e0 = (5 / 7) / (sd_e + 1e-6), (-2 / 7) / (sd_e + 1e-6)
    # gamma 1: tau1 returns (1, 1). S0 {1, 0, 0}: mean 1/3, sample std sqrt(1/3).
    # A {1, 0}: mean 1/2, std sqrt(1/2).
    sd_s0, sd_a = math.sqrt(1 / 3), math.sqrt(1 / 2)
    a_s0_hit, a_s0_miss = (2 / 3) / (sd_s0 + 1e-6), (-1 / 3) / (sd_s0 + 1e-6)
    a_a = 0.5 / (sd_a + 1e-6)
    assert adv[0] == pytest.approx([e1 + 0.5 * a_s0_hit, e1 + 0.5 * a_a], abs=1e-9)
    assert adv[1] == pytest.approx([e0 + 0.5 * a_s0_miss, e0 - 0.5 * a_a, e0], abs=1e-9)
    # episode statistics over trajectories (the paper's equation): R = 1, 0, 0.
    adv = per_turn(tree, gigpo_advantages(tree, trajs, episode_stats="trajectories"))
    assert adv[0][1] == pytest.approx(2 / 3 + 0.5)
    assert adv[2][1] == pytest.approx(-1 / 3)


def test_gigpo_state_key_falls_back_to_the_observation():
    tree = flat(GIGPO_PATHS)
    # observations "grid X" key the same states as the env's keys here ...
    by_env = gigpo_advantages(tree, tree.trajectories())
    by_obs = gigpo_advantages(tree, tree.trajectories(), state_key="observation")
    assert by_env == by_obs
    # ... and a node without a state key is keyed by its observation text
    for n in tree.nodes:
        n.info.pop("state_key", None)
    assert gigpo_advantages(tree, tree.trajectories()) == by_env
    # an observation that carries more than the state (a notice) splits the step group A
    tree.nodes[1].observation = "invalid action!\ngrid A"
    split = per_turn(tree, gigpo_advantages(tree, tree.trajectories(), state_key="observation"))
    assert split[0][1] == pytest.approx(5 / 7)  # A's group now holds tau1 alone


def test_gigpo_turn_advantages_land_on_each_turns_policy_tokens():
    tree = build(GIGPO_PATHS)  # tau1 and tau2 share their first turn's node
    trajs = tree.trajectories()
    adv = gigpo_advantages(tree, trajs)
    for t, a in zip(trajs, adv, strict=True):
        assert len(a) == len(t.token_ids)
        assert all(x == 0.0 for x, m in zip(a, t.loss_mask, strict=True) if not m)
    # the shared first turn is one row per trajectory: same anchor, own returns
    (out,) = compute_advantages("gigpo", [tree], [trajs])
    assert out == adv
    assert per_turn(tree, adv) == per_turn(
        flat(GIGPO_PATHS), gigpo_advantages(flat(GIGPO_PATHS), flat(GIGPO_PATHS).trajectories())
    )


# -- GiGPO as verl-agent computes it -------------------------------------------------------
def verl_agent_gigpo(tree: Tree, mode: str, gamma: float, w: float, eps: float = 1e-6):
    """numpy transcription of verl-agent's GiGPO over a batch of step rows.

    A row per (trajectory, step) with: `index` (the task's group uid), `traj_index`,
    `anchor_obs` (the observation the step acted from), `rewards` (the step's env reward) and
    the episode score (sum of the trajectory's rewards). Discounted returns per trajectory;
    episode mean/std over all rows of the group (a group of one row: mean 0, std 1); step
    groups = identical anchor_obs within a group (one row: mean = itself, std 1); torch.std
    is the sample std; scores = episode + w * step.
    """
    index, traj_index, anchor, rewards, episode, where = [], [], [], [], [], []
    for i, t in enumerate(tree.trajectories()):
        for k, n in enumerate(t.nodes[1:]):
            index.append("task")
            traj_index.append(i)
            anchor.append(tree.nodes[tree.nodes[n].parent].info["state_key"])
            rewards.append(tree.nodes[n].reward)
            episode.append(t.reward)
            where.append((i, k))
    index, traj_index = np.array(index), np.array(traj_index)
    rewards = np.array(rewards, dtype=np.float32)
    returns = np.zeros_like(rewards)
    for uid in np.unique(traj_index):
        rows = np.where(traj_index == uid)[0]
        running = 0.0
        for r in rows[::-1]:
            running = rewards[r] + gamma * running
            returns[r] = running

    def norm(values: np.ndarray, keys: list, single_mean_is_self: bool) -> np.ndarray:
        out = np.zeros(len(values), dtype=np.float64)
        groups = defaultdict(list)
        for i, k in enumerate(keys):
            groups[k].append(i)
        for idx in groups.values():
            xs = values[idx].astype(np.float64)
            if len(xs) == 1:
                mean, std = (xs[0] if single_mean_is_self else 0.0), 1.0
            else:
                mean, std = xs.mean(), xs.std(ddof=1)
            for i in idx:
                out[i] = (
                    values[i] - mean if mode == "mean_norm" else (values[i] - mean) / (std + eps)
                )
        return out

    ep = norm(np.array(episode, dtype=np.float32), list(index), False)
    st = norm(returns, [(index[i], anchor[i]) for i in range(len(anchor))], True)
    scores = ep + w * st
    per_traj = defaultdict(list)
    for (i, _), s in zip(where, scores, strict=True):
        per_traj[i].append(float(s))
    return [per_traj[i] for i in range(len(per_traj))]


def random_tree(rng: random.Random) -> Tree:
    """Random paths over a few states with sparse rewards, grown as a forking tree."""
    paths = []
    for _ in range(rng.randint(2, 7)):
        steps, n = [], rng.randint(1, 5)
        for k in range(n):
            reward = float(rng.random() < 0.4) if k == n - 1 else rng.choice([0.0, 0.0, 0.1])
            steps.append((rng.choice("ab"), rng.choice(["A", "B", "C", "D"]), reward))
        paths.append(steps)
    return build(paths)


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_gigpo_matches_verl_agent_on_batches_from_trees(mode):
    rng = random.Random(7)
    for _ in range(40):
        tree = random_tree(rng)
        trajs = tree.trajectories()
        gamma, w = rng.choice([0.95, 0.9, 1.0]), rng.choice([1.0, 0.5])
        ours = gigpo_advantages(
            tree,
            trajs,
            norm="mean" if mode == "mean_norm" else "std",
            step_gamma=gamma,
            step_weight=w,
        )
        ref = verl_agent_gigpo(tree, mode, gamma, w)
        for got, want in zip(per_turn(tree, ours), ref, strict=True):
            assert got == pytest.approx(want, abs=1e-6)


# -- RTMC -------------------------------------------------------------------------------------
RTMC_PATHS = [
    [("down", "A", 0.0), ("right", "G", 1.0)],
    [("down", "A", 0.0), ("down", "B", 0.0)],
    [("right", "C", 0.0), ("up", "A", 0.0), ("down", "B", 0.0)],
]


def test_rtmc_q_minus_v_over_shared_states():
    tree = build(RTMC_PATHS)
    adv = per_turn(tree, rtmc_advantages(tree, tree.trajectories()))
    # gamma 1 returns: tau1 (1, 1), tau2 (0, 0), tau3 (0, 0, 0).
    # S0: V = 1/3, Q(down) = (1 + 0)/2, Q(right) = 0. C: one rollout -> 0.
    # A (met by all three): V = 1/3, Q(right) = 1, Q(down) = 0.
    assert adv[0] == pytest.approx([1 / 2 - 1 / 3, 1 - 1 / 3])
    assert adv[1] == pytest.approx([1 / 2 - 1 / 3, 0 - 1 / 3])
    assert adv[2] == pytest.approx([0 - 1 / 3, 0.0, 0 - 1 / 3])


def test_rtmc_history_signatures_and_prior():
    tree = build(RTMC_PATHS)
    trajs = tree.trajectories()
    hist = per_turn(tree, rtmc_advantages(tree, trajs, signature="history"))
    # A reached by (S0, down) for tau1/tau2 is a different signature from tau3's route
    # via C: V = 1/2 over tau1, tau2; tau3's step at A stands alone.
    assert hist[0][1] == pytest.approx(1 / 2) and hist[1][1] == pytest.approx(-1 / 2)
    assert hist[2] == pytest.approx([-1 / 3, 0.0, 0.0])
    # prior c = 1 shrinks Q(S0, down) towards V(S0): (1 + 0 + 1/3) / 3 = 4/9
    prior = per_turn(tree, rtmc_advantages(tree, trajs, prior=1.0))
    assert prior[0][0] == pytest.approx(4 / 9 - 1 / 3)


def test_rtmc_counts_first_visits_only():
    # tau1 bumps into a wall twice at S0 ("up" keeps it there), then goes down to the goal;
    # tau2 goes down and fails. gamma 0.5: tau1's returns are (0.25, 0.5, 1), tau2's (0).
    tree = flat([[("up", "S0", 0.0), ("up", "S0", 0.0), ("down", "G", 1.0)], [("down", "B", 0.0)]])
    adv = per_turn(tree, rtmc_advantages(tree, tree.trajectories(), gamma=0.5))
    # First visits: V(S0) = (0.25 + 0) / 2; Q(S0, up) = 0.25 (not the mean of 0.25 and 0.5);
    # Q(S0, down) = (1 + 0) / 2, tau1's first "down" at S0 being its third step.
    v = 0.125
    assert adv[0] == pytest.approx([0.25 - v, 0.25 - v, 0.5 - v])
    assert adv[1] == pytest.approx([0.5 - v])


# -- Tree-GRPO --------------------------------------------------------------------------------
def test_treegrpo_sums_intra_and_inter_tree_group_advantages():
    paths = [
        [("a", "A", 0.0), ("x", "X", 1.0)],
        [("a", "A", 0.0), ("y", "Y", 0.0)],
        [("b", "B", 0.0), ("x", "X", 1.0)],
        [("b", "B", 0.0), ("y", "Y", 1.0)],
        [("b", "B", 0.0), ("z", "Z", 0.0)],
    ]
    tree = build(paths)
    trajs = tree.trajectories()
    adv = [
        a[m.index(1)]
        for a, m in (
            (a, t.loss_mask) for a, t in zip(treegrpo_advantages(tree, trajs), trajs, strict=True)
        )
    ]
    # inter: R = 1,0,1,1,0 -> mean 0.6, sample std sqrt(0.3)
    sd = math.sqrt(0.3) + 1e-6
    inter = [0.4 / sd, -0.6 / sd, 0.4 / sd, 0.4 / sd, -0.6 / sd]
    # intra: tree a {1, 0}: +-0.5/sqrt(1/2); tree b {1, 1, 0}: mean 2/3, std sqrt(1/3)
    sa, sb = math.sqrt(0.5) + 1e-6, math.sqrt(1 / 3) + 1e-6
    intra = [0.5 / sa, -0.5 / sa, (1 / 3) / sb, (1 / 3) / sb, (-2 / 3) / sb]
    assert adv == pytest.approx([a + b for a, b in zip(inter, intra, strict=True)])


def test_treegrpo_single_trajectory_groups_get_r_over_one_plus_eps():
    # compute_grpo_outcome_advantage (AMAP-ML/Tree-GRPO): a group of one has mean 0, std 1.
    # Tree 0 holds one trajectory (R = 1); tree 1 three (R = 1, 0, 0), two of them starting
    # with a root expansion: a tree is its `tree_index`, not its first turn.
    eps = 0.5
    tree = flat([[("a", "A", 1.0)], [("b", "B", 1.0)], [("c", "C", 0.0)], [("d", "D", 0.0)]])
    for first, k in zip(tree.root.children, [0, 1, 1, 1], strict=True):
        tree.nodes[first].info["tree_index"] = k
    trajs = tree.trajectories()
    adv = [
        a[m.index(1)]
        for a, m in zip(
            treegrpo_advantages(tree, trajs, eps=eps), (t.loss_mask for t in trajs), strict=True
        )
    ]
    # inter over R = 1, 1, 0, 0: mean 1/2, sample std sqrt(1/3)
    si = math.sqrt(1 / 3) + eps
    inter = [0.5 / si, 0.5 / si, -0.5 / si, -0.5 / si]
    # intra: tree 0 alone: 1 / (1 + eps); tree 1 over 1, 0, 0: mean 1/3, std sqrt(1/3)
    s1 = math.sqrt(1 / 3) + eps
    intra = [1 / (1 + eps), (2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1]
    assert adv == pytest.approx([a + b for a, b in zip(inter, intra, strict=True)])
    # a lone trajectory: inter and intra are both r / (1 + eps)
    one = flat([[("a", "A", 1.0)]])
    assert per_turn(one, treegrpo_advantages(one, one.trajectories(), eps=eps)) == [
        [pytest.approx(2 / (1 + eps))]
    ]


def test_treegrpo_on_flat_groups_is_grpo_plus_the_reward():
    # Under a flat rollout every trajectory is its own tree (no `tree_index`, a first-turn node
    # of its own), so each intra group is one trajectory: A_i = A_GRPO(i) + r_i / (1 + eps). An
    # all-success group, which GRPO zeroes, gets 1 / (1 + eps) on every trajectory.
    eps = 0.25
    same = flat([[("a", "A", 1.0)], [("b", "B", 1.0)], [("c", "C", 1.0)]])
    assert (
        per_turn(same, treegrpo_advantages(same, same.trajectories(), eps=eps))
        == [[pytest.approx(1 / (1 + eps))]] * 3
    )
    mixed = flat([[("a", "A", 1.0)], [("b", "B", 0.0)]])
    # GRPO over R = 1, 0: mean 1/2, sample std sqrt(1/2)
    grpo = 0.5 / (math.sqrt(0.5) + eps)
    assert per_turn(mixed, treegrpo_advantages(mixed, mixed.trajectories(), eps=eps)) == [
        [pytest.approx(grpo + 1 / (1 + eps))],
        [pytest.approx(-grpo)],
    ]


def test_grpo_keeps_zero_for_a_group_of_one():
    assert group_normalized([1.0]) == [0.0]
    assert group_normalized([1.0], eps=0.5, singleton="unit") == [1 / 1.5]
    assert group_normalized([1.0], scale="none", singleton="unit") == [1.0]


def test_gigpo_std_norm_divides_a_single_member_episode_group_by_one_plus_eps():
    # verl-agent gigpo/core_gigpo.py, episode level: a group of one row has mean 0, std 1, so
    # A^E = R / (1 + eps) under mean_std_norm and R under mean_norm; its lone step group: 0.
    one = flat([[("right", "G", 1.0)]])
    std = per_turn(one, gigpo_advantages(one, one.trajectories(), norm="std", eps=0.5))
    mean = per_turn(one, gigpo_advantages(one, one.trajectories(), norm="mean", eps=0.5))
    assert std == [[1 / 1.5]] and mean == [[1.0]]


def test_new_estimator_options_are_checked():
    estimator_options("gigpo", {"step_gamma": 0.9, "norm": "std", "state_key": "env"})
    estimator_options("rtmc", {"signature": "history", "prior": 1.0})
    with pytest.raises(ValueError, match="must be one of"):
        estimator_options("gigpo", {"norm": "max"})
    with pytest.raises(ValueError, match="has no option"):
        estimator_options("rtmc", {"step_gamma": 0.9})


def test_grpo_split_into_shared_and_private_turns_adds_up_to_grpo():
    # benchmarks/tree_credit.py: tau1 and tau2 share their first turn (down to A); tau3 shares
    # nothing. R = 1, 0, 0: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    credit = load_benchmark("tree_credit")
    tree = build(GIGPO_PATHS)
    trajs = tree.trajectories()
    s = math.sqrt(1 / 3) + 1e-6
    win, lose = (2 / 3) / s, (-1 / 3) / s
    shared = per_turn(tree, credit.shared([tree], [trajs])[0])
    private = per_turn(tree, credit.private([tree], [trajs])[0])
    assert shared == [
        [pytest.approx(win), 0.0],
        [pytest.approx(lose), 0.0, 0.0],
        [0.0, 0.0],
    ]
    assert private == [
        [0.0, pytest.approx(win)],
        [0.0, pytest.approx(lose), pytest.approx(lose)],
        [pytest.approx(lose), pytest.approx(lose)],
    ]
    # `shared_last` adds each trajectory's last turn (all three leaves are private)
    assert per_turn(tree, credit.shared_last([tree], [trajs])[0]) == [
        [pytest.approx(win), pytest.approx(win)],
        [pytest.approx(lose), 0.0, pytest.approx(lose)],
        [0.0, pytest.approx(lose)],
    ]
    # `last` keeps the last turn alone
    assert per_turn(tree, credit.last([tree], [trajs])[0]) == [
        [0.0, pytest.approx(win)],
        [0.0, 0.0, pytest.approx(lose)],
        [0.0, pytest.approx(lose)],
    ]
    # the estimator seam resolves it as a run does (`train.advantage=tree_credit:shared`)
    grpo = compute_advantages("grpo", [tree], [trajs])[0]
    split = compute_advantages("tree_credit:shared", [tree], [trajs])[0]
    rest = compute_advantages("tree_credit:private", [tree], [trajs])[0]
    for g, a, b in zip(grpo, split, rest, strict=True):
        assert [x + y for x, y in zip(a, b, strict=True)] == pytest.approx(g)
    # where GRPO's advantage lands: 2 of the 7 (trajectory, policy token) pairs are shared;
    # the shared mass is |win| + |lose| = 1/s of 3/s in all; on the shared turn win + lose =
    # (1/3)/s of the 1/s there survives, so two thirds of it cancel
    lands = credit.where_it_lands([tree])
    assert lands["informative"] == 1 and lands["trajectories_per_tree"] == 3
    assert lands["shared_token_share"] == pytest.approx(2 / 7)
    assert lands["shared_mass_share"] == pytest.approx(1 / 3)
    assert lands["shared_mass_cancelled"] == pytest.approx(2 / 3)
    # pushed down against up: 5 losing tokens of |lose| against 2 winning ones of win
    assert lands["down_to_up_mass"] == pytest.approx(5 * (1 / 3) / (2 * (2 / 3)))
    # mean advantage a token gets: shared (win + lose) / 2, private (win + 4 lose) / 5
    assert lands["shared_mean_advantage"] == pytest.approx((win + lose) / 2)
    assert lands["private_mean_advantage"] == pytest.approx((win + 4 * lose) / 5)
    # private turns 1/2, 2/3 and 2/2 of the three trajectories; late keeps 1/2, 2/3 and 1/2
    assert lands["private_turn_share"] == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    assert lands["late_turn_share"] == pytest.approx((1 / 2 + 2 / 3 + 1 / 2) / 3)


def test_grpo_on_the_later_half_of_flat_trajectories():
    # benchmarks/tree_credit.py `late`: turn i of n (from 0) keeps GRPO's advantage when
    # i >= n // 2. R = 1, 0, 0, 0: mean 1/4, sample std sqrt((9/16 + 3/16) / 3) = 1/2.
    credit = load_benchmark("tree_credit")
    tree = flat(
        [
            [("a", "G", 1.0)],
            [("b", "B", 0.0), ("c", "H", 0.0)],
            [("d", "D", 0.0), ("e", "E", 0.0), ("f", "H", 0.0)],
            [("g", "D", 0.0), ("h", "E", 0.0), ("i", "F", 0.0), ("j", "H", 0.0)],
        ]
    )
    win, lose = 0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6)
    got = per_turn(tree, credit.late([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(win)],
        [0.0, pytest.approx(lose)],
        [0.0, pytest.approx(lose), pytest.approx(lose)],
        [0.0, 0.0, pytest.approx(lose), pytest.approx(lose)],
    ]
    # `spread`: the same mass per trajectory on every turn, 1, 1/2, 2/3 and 1/2 of it a turn
    got = per_turn(tree, credit.spread([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(win)],
        [pytest.approx(lose / 2)] * 2,
        [pytest.approx(lose * 2 / 3)] * 3,
        [pytest.approx(lose / 2)] * 4,
    ]
    # `last` keeps the last turn alone; `spread_last`, its control, 1/n of the advantage a turn
    got = per_turn(tree, credit.last([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(win)],
        [0.0, pytest.approx(lose)],
        [0.0, 0.0, pytest.approx(lose)],
        [0.0, 0.0, 0.0, pytest.approx(lose)],
    ]
    got = per_turn(tree, credit.spread_last([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(win)],
        [pytest.approx(lose / 2)] * 2,
        [pytest.approx(lose / 3)] * 3,
        [pytest.approx(lose / 4)] * 4,
    ]
    # `even`: spread_last times the mean turns over the step's trajectories, here 2.5
    got = per_turn(tree, credit.even([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(win * 2.5)],
        [pytest.approx(lose * 2.5 / 2)] * 2,
        [pytest.approx(lose * 2.5 / 3)] * 3,
        [pytest.approx(lose * 2.5 / 4)] * 4,
    ]
    # ... over every group of the step: with a second of two 6-turn trajectories, (10 + 12) / 6
    other = flat([[(f"w{i}", "W", 0.0) for i in range(6)], [(f"l{i}", "L", 0.0) for i in range(6)]])
    both = [tree, other]
    got = per_turn(tree, credit.even(both, [t.trajectories() for t in both])[0])
    assert got[3] == [pytest.approx(lose * 11 / 3 / 4)] * 4


def test_even_under_token_mean_trains_what_seq_mean_trains_under_a_window():
    """With one token a move, benchmarks/tree_credit.py `even` (GRPO x N / n, token-mean) gives
    every token of trajectory i the weight A_i / (n_i T) that GRPO under seq-mean gives it when
    a history window trains each turn as its own row (Eq. 2 as printed)."""
    import torch

    from agentree.algorithms.loss import loss_normalizer, policy_loss
    from agentree.algorithms.packing import make_batch, turn_samples

    credit = load_benchmark("tree_credit")
    win, lose = [("r", "G", 1.0)], [("d", "B", 0.0)]
    trees = [
        flat([win, lose + lose, lose * 3, lose * 4]),
        flat([win * 1, lose * 6, win * 1]),
    ]
    for tree in trees:
        tree.meta["history"] = 1
    groups = [t.trajectories() for t in trees]

    def grads(advs, agg):
        samples, sample_advs = turn_samples(trees, groups, advs)
        rows = [t for g in samples for t in g]
        b = make_batch(rows, [a for g in sample_advs for a in g], 0)
        lp = torch.zeros_like(b.mask, dtype=torch.float64).requires_grad_()
        loss, _ = policy_loss(
            lp, lp.detach(), b.adv.double(), b.mask, eps_low=0.2, eps_high=0.2, agg=agg,
            normalizer=loss_normalizer(b.mask, agg, b.seq_tokens), seq_tokens=b.seq_tokens,
        )  # fmt: skip
        loss.backward()
        return (lp.grad * b.mask).sum(-1)  # one policy token a row

    grpo = [[list(a) for a in g] for g in credit._GRPO(trees, groups)]
    seq = grads(grpo, "seq-mean")
    even = grads(credit.even(trees, groups), "token-mean")
    torch.testing.assert_close(seq, even, rtol=1e-6, atol=0)
    assert not torch.allclose(grads(grpo, "token-mean"), even)  # token-mean GRPO differs


def test_grpo_on_shared_turns_with_every_node_weighted_alike():
    # benchmarks/tree_credit.py `shared_even`: tau1-tau3 share A, tau2 and tau3 also B; tau4
    # shares nothing. R = 1, 0, 0, 0: mean 1/4, sample std 1/2, so win 3/2 and lose -1/2.
    credit = load_benchmark("tree_credit")
    tree = build(
        [
            [("down", "A", 0.0), ("right", "G", 1.0)],
            [("down", "A", 0.0), ("down", "B", 0.0), ("left", "H", 0.0)],
            [("down", "A", 0.0), ("down", "B", 0.0), ("up", "D", 0.0)],
            [("right", "C", 0.0), ("up", "C", 0.0)],
        ]
    )
    s = 0.5 + 1e-6
    win, lose = 0.75 / s, -0.25 / s
    assert per_turn(tree, credit.shared([tree], [tree.trajectories()])[0]) == [
        [pytest.approx(win), 0.0],
        [pytest.approx(lose), pytest.approx(lose), 0.0],
        [pytest.approx(lose), pytest.approx(lose), 0.0],
        [0.0, 0.0],
    ]
    # divided by the trajectories through each node (A: 3, B: 2), the shared |A| mass falls
    # from |win| + 4 |lose| = 3.5/(2s) to |win|/3 + 2 |lose|/3 + 2 |lose|/2 = (4/3)/(2s);
    # the constant 3.5 / (4/3) = 21/8 gives it back
    c = 21 / 8
    got = per_turn(tree, credit.shared_even([tree], [tree.trajectories()])[0])
    assert got == [
        [pytest.approx(c * win / 3), 0.0],
        [pytest.approx(c * lose / 3), pytest.approx(c * lose / 2), 0.0],
        [pytest.approx(c * lose / 3), pytest.approx(c * lose / 2), 0.0],
        [0.0, 0.0],
    ]
    # each node's summed credit is c times its trajectories' mean advantage
    assert got[0][0] + got[1][0] + got[2][0] == pytest.approx(c * (win + 2 * lose) / 3)
    assert got[1][1] + got[2][1] == pytest.approx(c * lose)


def test_how_a_rollouts_episodes_end():
    # benchmarks/tree_credit.py `how_they_end`: GIGPO_PATHS' three episodes all end in DONE,
    # one with reward 1 (two turns), two without (three turns and two)
    # and a fourth of one turn that the env truncates at its turn limit
    credit = load_benchmark("tree_credit")
    tree = flat(GIGPO_PATHS)
    tree.add_child(
        0,
        action="up",
        action_ids=[99],
        observation="grid S0",
        reward=0.0,
        end_reason=EndReason.MAX_TURNS,
        info={"state_key": "S0"},
    )
    ends = credit.how_they_end([tree])
    assert ends["episodes"] == 4
    assert ends["success_share"] == 0.25 and ends["success_turns"] == 2
    assert ends["failure_share"] == 0.5 and ends["failure_turns"] == 2.5
    assert ends["turn_limit_share"] == 0.25 and ends["turn_limit_turns"] == 1
    assert ends["other_share"] == 0


def test_grpo_advantage_summed_by_move_on_shared_and_private_turns():
    # benchmarks/tree_credit.py `by_move` on the 2x2 map S F / H G (distance to G: F 1, S 2).
    # tau1: right (closer), down (onto G), R = 1; tau2: the same right, then left (away: back
    # to S) and down (into the hole); tau3: up (the map's edge: stay), down (into the hole).
    # R = 1, 0, 0: win (2/3)/s, lose (-1/3)/s with s = sqrt(1/3); only the first right is shared.
    credit = load_benchmark("tree_credit")
    desc = ["SF", "HG"]
    t = Tree("task")

    def env(pos: tuple[int, int]) -> dict:
        return {"env": {"pos": list(pos), "goal": [1, 1], "desc": desc}}

    t.add_root("grid", [100], env((0, 0)))

    def step(parent: int, action: str, pos: tuple[int, int], reward: float = 0.0, end=None) -> int:
        return t.add_child(
            parent,
            action=action,
            action_ids=[len(t.nodes)],
            observation="grid",
            reward=reward,
            end_reason=end,
            info=env(pos),
        ).id

    right = step(0, "right", (0, 1))
    step(right, "down", (1, 1), 1.0, DONE)
    step(step(right, "left", (0, 0)), "down", (1, 0), 0.0, DONE)
    step(step(0, "up", (0, 0)), "down", (1, 0), 0.0, DONE)
    s = math.sqrt(1 / 3) + 1e-6
    win, lose = (2 / 3) / s, (-1 / 3) / s
    got = credit.by_move([t])
    assert got["shared"]["closer"]["pairs"] == 2
    assert got["shared"]["closer"]["sum"] == pytest.approx(win + lose)
    assert all(got["shared"][m]["pairs"] == 0 for m in ("stay", "away", "hole", "goal"))
    private = {m: (c["pairs"], c["sum"]) for m, c in got["private"].items()}
    assert private == {
        "closer": (0, 0.0),
        "stay": (1, pytest.approx(lose)),
        "away": (1, pytest.approx(lose)),
        "hole": (2, pytest.approx(2 * lose)),
        "goal": (1, pytest.approx(win)),
    }
    assert got["private"]["hole"]["mean"] == pytest.approx(lose)
