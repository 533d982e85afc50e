"""GRPO's advantage on a rollout tree, kept on one part of the tree: which part trains it?

On a tree, GRPO gives every trajectory one advantage, and a turn that k trajectories share
(their common prefix, up to the state they forked from) is trained by the k of them: the
gradient there is the sum of their advantages, k times the subtree's mean advantage, a credit
that compares what followed each fork. A turn only one trajectory reaches (after its last
fork) gets that trajectory's advantage alone, as every turn of a flat group does. The first
two estimators keep one part and give the other zero advantage, so under a token-mean loss
(which divides by the policy tokens, not by those with an advantage) their per-token losses
add up to GRPO's on the same tree. Each starts from GRPO's advantage with its default options
(divided by the group's std, as the shipped configs train; `train.adv_scale` does not reach a
user's estimator):

- `shared`: the advantage on turns that two or more trajectories of the group pass through;
- `private`: the advantage on turns only one trajectory passes through;
- `shared_even`: `shared` with every shared node weighted alike: each trajectory's advantage on
  a turn k trajectories pass through divided by k (the node's summed credit is then its
  trajectories' mean advantage instead of k times it), times one constant per group that gives
  the group's shared tokens GRPO's total |A| mass back. It asks whether `shared` fails by what
  it credits or by how it weights the nodes: the number of trajectories through a node grows
  with the forks drawn below it, and fork points are drawn over the nodes of the episodes that
  ran longest;
- `shared_last`: `shared` plus each trajectory's last turn, the move that ends its episode
  (onto the goal, into a hole), which is always private;
- `last`: each trajectory's last turn alone, the control for `shared_last`: what the shared
  turns add to the episode-ending credit;
- `late`: for flat groups, which share no turn, the advantage on the later half of each
  trajectory's turns (turn i of n from 0 kept when i >= n // 2), the turns a fork at a random
  point would have left to it alone: where a tree's private turns are, without the tree;
- `spread`: the control for `late`: each trajectory's advantage times the share of its turns
  `late` keeps ((n - n // 2) / n), on every turn, so each trajectory carries the advantage
  mass `late` gives it, spread over all its turns instead of the later ones.
- `spread_last`: the same control for `last`: each trajectory's advantage times 1 / n on every
  one of its n turns, about the mass `last` gives it (turns of one length) spread over all of them.
  Under the token-mean loss it weighs every trajectory alike, as a sequence-mean loss does,
  where GRPO weighs a trajectory by its turns (and so does `spread`, whose share is about a
  half).
- `even`: `spread_last` at GRPO's scale: each trajectory's advantage times N / n on every one of
  its n turns, N the mean turns over all the step's trajectories (one constant a step), so
  every trajectory weighs alike as under `spread_last` while the step's advantage mass stays
  about GRPO's. It tells the weighting between trajectories from the size of the gradient.
  With one token a turn and no KL term it is GRPO under `train.loss_agg=seq-mean`
  (tests/test_turn_advantages.py checks it under a history window, where each turn is trained
  as its own row).

They plug in through the estimator seam, as any user's estimator would (`PYTHONPATH=benchmarks`
so that the runs can import this module):

    PYTHONPATH=benchmarks python benchmarks/learning_efficiency.py --seeds 0 1 ... 19 \
        --out DIR --methods tree-grpo+grpo --eval-tasks 64 --area-every 10 --budget-reserve \
        --set train.advantage=tree_credit:shared

Run as a script on the trees of a rollout, it says where GRPO's advantage lands: for the
shared and the private turns, their share of the policy tokens the loss counts (a shared
token once per trajectory through it), their share of the advantage mass (sum of |A| over
those tokens), and on the shared turns how much of that mass cancels (1 - |sum of A| / sum of
|A| per shared token, weighted by the mass: 0 when the trajectories through a turn agree,
1 when a success and a failure through it balance), and the mean advantage a token gets in
each part (GRPO's advantages sum to zero over a group's trajectories, not over its tokens),
and the mass pushing sampled tokens down against the mass pushing them up (sum of |A| over the
policy tokens with A < 0 over the sum with A > 0: 1 when every trajectory weighs alike, more
when the failures run longer than the successes); and, averaged over trajectories, the share
of a trajectory's turns that are private and the share `late` would keep:

    agentree rollout --config frozenlake_patr --rollout tree-grpo --policy tiny-warm \
        --tasks 64 --output DIR --set rollout.M=2 --set rollout.N=2 --set rollout.L=1 \
        --set rollout.env_step_budget=16 --set rollout.budget_reserve=true
    python benchmarks/tree_credit.py DIR [--json OUT]

With `--ends` it says instead how the rollout's episodes end (`how_they_end`): the shares that
succeed, that the env ends unsolved (FrozenLake's holes) and that reach the turn limit,
and their mean turns, e.g. for a trained checkpoint's flat samples (`--policy RUN/checkpoints/
step_000040 --rollout grpo`). With `--moves`, for grid envs whose nodes report `pos` and
`desc` (FrozenLake), GRPO's advantage summed by the kind of move each turn makes (`by_move`:
closer to G, no move, away, into a hole, onto G), on the shared and the private turns apart.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

from agentree.algorithms.advantages import advantage_estimator, treerl_node_values
from agentree.envs.frozenlake import distances_to_goal
from agentree.tree import EndReason, Trajectory, Tree

_GRPO = advantage_estimator("grpo", {})


def _through(trajectories: Sequence[Trajectory]) -> dict[int, int]:
    """How many of the group's trajectories pass through each node (TreeRL's |L(n)|)."""
    return treerl_node_values(trajectories)[1]


def _late_share(n: int) -> float:
    """The share of a trajectory's n turns that `late` keeps: its last n - n // 2."""
    return (n - n // 2) / n if n else 1.0


def _kept(
    trees: Sequence[Tree],
    groups: Sequence[Sequence[Trajectory]],
    keep: Callable[[Trajectory, int, dict[int, int]], bool],
) -> list[list[list[float]]]:
    """GRPO's per-token advantages, zero on the tokens of every node `keep(trajectory, node,
    through)` refuses (`through`: the group's trajectories through each node)."""
    out = _GRPO(trees, groups)
    for trajectories, advantages in zip(groups, out, strict=True):
        through = _through(trajectories)
        for t, adv in zip(trajectories, advantages, strict=True):
            for j, node in enumerate(t.node_of_token):
                if not keep(t, node, through):
                    adv[j] = 0.0
    return out


def shared(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages, zero on every turn only one trajectory of the group reaches."""
    return _kept(trees, groups, lambda _t, node, through: through[node] > 1)


def shared_even(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """`shared` with each node's credit its trajectories' mean advantage, rescaled per group to
    `shared`'s |A| mass on the shared tokens."""
    out = shared(trees, groups)
    for trajectories, advantages in zip(groups, out, strict=True):
        through = _through(trajectories)
        before = after = 0.0
        for t, adv in zip(trajectories, advantages, strict=True):
            for j, (node, m) in enumerate(zip(t.node_of_token, t.loss_mask, strict=True)):
                a = adv[j] / through[node]
                if m:  # the mass the loss sees: policy tokens
                    before, after = before + abs(adv[j]), after + abs(a)
                adv[j] = a
        if after:
            for adv in advantages:
                adv[:] = [a * before / after for a in adv]
    return out


def shared_last(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages on the shared turns and on each trajectory's last turn (the
    move that ends its episode), zero on its other private turns."""
    return _kept(trees, groups, lambda t, node, through: through[node] > 1 or node == t.leaf)


def last(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]) -> list[list[list[float]]]:
    """GRPO's per-token advantages on each trajectory's last turn alone, zero on the others."""
    return _kept(trees, groups, lambda t, node, _: node == t.leaf)


def private(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages, zero on every turn two or more trajectories share."""
    return _kept(trees, groups, lambda _t, node, through: through[node] == 1)


def late(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]) -> list[list[list[float]]]:
    """GRPO's per-token advantages, zero on the first n // 2 of each trajectory's n turns."""
    # t.nodes[0] is the root; turn i of n is t.nodes[1 + i], early when i < n // 2
    return _kept(
        trees, groups, lambda t, node, _: node not in t.nodes[1 : 1 + (len(t.nodes) - 1) // 2]
    )


def _scaled(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]], share: Callable[[int], float]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages times `share(n)` for a trajectory of n turns, on every turn."""
    out = _GRPO(trees, groups)
    for trajectories, advantages in zip(groups, out, strict=True):
        for t, adv in zip(trajectories, advantages, strict=True):
            k = share(len(t.nodes) - 1)
            adv[:] = [a * k for a in adv]
    return out


def spread(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages times (n - n // 2) / n for a trajectory of n turns."""
    return _scaled(trees, groups, _late_share)


def spread_last(
    trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> list[list[list[float]]]:
    """GRPO's per-token advantages times 1 / n for a trajectory of n turns."""
    return _scaled(trees, groups, lambda n: 1 / n if n else 1.0)


def even(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]) -> list[list[list[float]]]:
    """GRPO's per-token advantages times N / n for a trajectory of n turns, N the mean turns
    over every trajectory of the step."""
    turns = [len(t.nodes) - 1 for g in groups for t in g]
    mean = sum(turns) / len(turns) if turns else 1.0
    return _scaled(trees, groups, lambda n: mean / n if n else 1.0)


def where_it_lands(trees: Sequence[Tree]) -> dict[str, float | int]:
    """Token and advantage shares of the shared and private turns (the module docstring)."""
    groups = [t.trajectories() for t in trees]
    tokens = {"shared": 0, "private": 0}
    mass = {"shared": 0.0, "private": 0.0}
    signed = {"shared": 0.0, "private": 0.0}
    net: dict[tuple[int, int, int], float] = defaultdict(float)  # (tree, node, token) -> sum A
    gross: dict[tuple[int, int, int], float] = defaultdict(float)
    private_share, late_share = [], []  # per trajectory, of its turns
    for k, (trajectories, advantages) in enumerate(zip(groups, _GRPO(trees, groups), strict=True)):
        through = _through(trajectories)
        for t, adv in zip(trajectories, advantages, strict=True):
            turns = t.nodes[1:]
            if turns:
                private_share.append(sum(through[n] == 1 for n in turns) / len(turns))
                late_share.append(_late_share(len(turns)))
            start: dict[int, int] = {}
            for j, (node, m) in enumerate(zip(t.node_of_token, t.loss_mask, strict=True)):
                if not m:
                    continue
                part = "shared" if through[node] > 1 else "private"
                tokens[part] += 1
                mass[part] += abs(adv[j])
                signed[part] += adv[j]
                if part == "shared":
                    key = (k, node, j - start.setdefault(node, j))
                    net[key] += adv[j]
                    gross[key] += abs(adv[j])
    total_tokens, total_mass = sum(tokens.values()), sum(mass.values())
    net_mass = sum(signed.values())  # pushed up minus pushed down; their sum is total_mass
    up, down = (total_mass + net_mass) / 2, (total_mass - net_mass) / 2
    shared_gross = sum(gross.values())
    return {
        "trees": len(trees),
        "informative": sum(len({t.reward for t in g}) > 1 for g in groups),
        "trajectories_per_tree": sum(map(len, groups)) / max(len(trees), 1),
        "shared_token_share": tokens["shared"] / max(total_tokens, 1),
        "shared_mass_share": mass["shared"] / total_mass if total_mass else 0.0,
        "private_turn_share": sum(private_share) / max(len(private_share), 1),
        "late_turn_share": sum(late_share) / max(len(late_share), 1),
        "shared_mean_advantage": signed["shared"] / max(tokens["shared"], 1),
        "private_mean_advantage": signed["private"] / max(tokens["private"], 1),
        "shared_mass_cancelled": (
            1 - sum(abs(v) for v in net.values()) / shared_gross if shared_gross else 0.0
        ),
        "down_to_up_mass": down / up if up else 0.0,
    }


MOVES = ("closer", "stay", "away", "hole", "goal")


def _move(
    desc: Sequence[str],
    to_goal: dict[tuple[int, int], int],
    before: tuple[int, int],
    after: tuple[int, int],
) -> str:
    """A grid move's class: onto G, into a hole, no move (the map's edge), closer to G by the
    shortest path with holes blocked (`to_goal`, `distances_to_goal(desc)`), or away (not
    closer, though it moved)."""
    cell = desc[after[0]][after[1]]
    if cell == "G":
        return "goal"
    if cell == "H":
        return "hole"
    if after == before:
        return "stay"
    far = len(desc) * len(desc[0])  # a cell that cannot reach G
    return "closer" if to_goal.get(after, far) < to_goal.get(before, far) else "away"


def by_move(trees: Sequence[Tree]) -> dict[str, dict[str, dict[str, float]]]:
    """GRPO's advantage per (trajectory, turn) pair, summed by the turn's move (`_move`), on the
    shared and on the private turns apart: what each part pushes up (a positive sum) and down.
    For grid envs whose nodes report `pos` and `desc` (FrozenLake)."""
    out = {part: {m: {"pairs": 0, "sum": 0.0} for m in MOVES} for part in ("shared", "private")}
    for tree in trees:
        trajectories = tree.trajectories()
        through = _through(trajectories)
        desc = tree.nodes[0].info["env"]["desc"]  # one map a task
        to_goal = distances_to_goal(desc)
        for t, adv in zip(trajectories, _GRPO([tree], [trajectories])[0], strict=True):
            value = {}  # node -> the advantage on its first policy token
            for node, m, a in zip(t.node_of_token, t.loss_mask, adv, strict=True):
                if m:
                    value.setdefault(node, a)
            for parent, node in pairwise(t.nodes):
                env, before = tree.nodes[node].info["env"], tree.nodes[parent].info["env"]
                move = _move(desc, to_goal, tuple(before["pos"]), tuple(env["pos"]))
                cell = out["shared" if through[node] > 1 else "private"][move]
                cell["pairs"] += 1
                cell["sum"] += value.get(node, 0.0)
    for part in out.values():
        for cell in part.values():
            cell["mean"] = cell["sum"] / cell["pairs"] if cell["pairs"] else 0.0
    return out


def how_they_end(trees: Sequence[Tree]) -> dict[str, float | int]:
    """How a rollout's episodes end: the share that succeed (the tree's success rule), that the
    env ends without success (FrozenLake's holes), that reach the turn limit unsolved, and the
    mean turns of each kind."""
    kinds: dict[str, list[int]] = {"success": [], "failure": [], "turn_limit": [], "other": []}
    for tree in trees:
        for t in tree.trajectories():
            if tree.success(t.leaf):
                kind = "success"
            elif t.end_reason == EndReason.COMPLETED:
                kind = "failure"
            else:
                kind = "turn_limit" if t.end_reason == EndReason.MAX_TURNS else "other"
            kinds[kind].append(t.num_turns)
    n = sum(map(len, kinds.values()))
    out: dict[str, float | int] = {"episodes": n}
    for kind, turns in kinds.items():
        out[f"{kind}_share"] = len(turns) / max(n, 1)
        out[f"{kind}_turns"] = sum(turns) / len(turns) if turns else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("rollout", type=Path, help="an `agentree rollout --output` directory")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ends", action="store_true", help="how the episodes end, instead")
    ap.add_argument("--moves", action="store_true", help="the advantage by move, instead")
    args = ap.parse_args()
    paths = sorted((args.rollout / "trees").glob("*.json"))
    if not paths:
        raise SystemExit(
            f"no trees in {args.rollout / 'trees'}; give an agentree rollout's --output"
        )
    trees = [Tree.load(p) for p in paths]
    out = (
        how_they_end(trees)
        if args.ends
        else by_move(trees)
        if args.moves
        else where_it_lands(trees)
    )
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
