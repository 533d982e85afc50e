"""Advantage estimators: a rollout group's outcome rewards -> per-token advantages.

`group_normalized` returns one scalar per trajectory. The tree estimators return, for each
trajectory, a list aligned with `Trajectory.token_ids` that is 0.0 wherever `loss_mask` is 0;
the turn-level ones (GiGPO, RTMC) give each turn's policy tokens that turn's advantage.
`advantage_estimator` (resolved once, as the update does) and `compute_advantages` (in one
call, as the viewer does) are the entry points: per-token lists for every trajectory of every
tree, scalar advantages broadcast onto policy tokens.

The group of a tree is the list of trajectories passed in (e.g. `tree.trajectories()`, PATR's
"keep all", or only unpruned ones); subtree statistics are computed over that group only.
Pure Python on purpose: importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentree.registry import Registry
from agentree.tree import Node, Trajectory, Tree


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 denominator), 0.0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def _divide_by_std(xs: Sequence[float], eps: float) -> list[float]:
    # All-equal values carry no relative signal; return exact zeros instead of rounding noise
    # divided by eps (mean([0.1] * 3) != 0.1 in floating point).
    if len(xs) < 2 or max(xs) == min(xs):
        return [0.0] * len(xs)
    s = _std(xs)
    return [x / (s + eps) for x in xs]


def _broadcast(a: float, traj: Trajectory) -> list[float]:
    """A trajectory-level advantage on every policy token, 0 elsewhere."""
    return [a if m else 0.0 for m in traj.loss_mask]


def _per_segment(r: dict[int, float], traj: Trajectory) -> list[float]:
    """Each policy token gets the advantage of the node that appended it, 0 elsewhere."""
    return [
        r.get(n, 0.0) if m else 0.0 for n, m in zip(traj.node_of_token, traj.loss_mask, strict=True)
    ]


def _check_group(tree: Tree, trajectories: Sequence[Trajectory]) -> None:
    for t in trajectories:
        if t.task_id != tree.task_id or not t.nodes or t.nodes[0] != tree.root.id:
            raise ValueError(
                f"trajectory ending at leaf {t.leaf} (task {t.task_id!r}) is not a root-to-leaf "
                f"path of tree {tree.task_id!r}; pass each tree with its own trajectories"
            )


# -- GRPO / PATR ----------------------------------------------------------------------------
def group_normalized(
    rewards: Sequence[float],
    *,
    eps: float = 1e-6,
    scale: Literal["std", "none"] = "std",
    singleton: Literal["zero", "unit"] = "zero",
) -> list[float]:
    """GRPO outcome advantage, PATR Eq. 1 (Eq. 9 over the tree group).

    A_i = (r_i - mean(r)) / (std(r) + eps). The papers do not say which std; we use the sample
    std (n - 1), as `torch.std` computes it in verl (under rLLM, which PATR used, and TreePO)
    and in TRL. `scale="none"` is Dr. GRPO: A_i = r_i - mean(r). A group with all-equal rewards
    has no relative signal and gets zeros; so does a group of one trajectory, unless
    `singleton="unit"`: mean 0 and std 1 as Tree-GRPO's code takes them (`compute_grpo_outcome_
    advantage` in AMAP-ML/Tree-GRPO), so A = r / (1 + eps) (r with `scale="none"`).
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if singleton not in ("zero", "unit"):
        raise ValueError(f"singleton must be 'zero' or 'unit', got {singleton!r}")
    if len(rewards) == 1 and singleton == "unit":
        return [rewards[0] if scale == "none" else rewards[0] / (1.0 + eps)]
    if not rewards or max(rewards) == min(rewards):
        return [0.0] * len(rewards)  # exact zeros, not rounding noise (mean([0.1] * 3) != 0.1)
    mu = _mean(rewards)
    centred = [r - mu for r in rewards]
    return centred if scale == "none" else _divide_by_std(centred, eps)


# -- TreePO ---------------------------------------------------------------------------------
def treepo_pooled(
    trajectories: Sequence[Trajectory], *, distinct_subgroups: bool = False
) -> list[float]:
    """TreePO Eq. 5 numerator divided by |J|: the mean over sub-groups of R_i - mean(G_j).

    The sub-groups of trajectory i are G_j = the trajectories sharing its ancestor at depth j,
    for the root (j = 0, the whole group G) down to the leaf's parent (Eq. 4, Fig. 3). A
    sub-group holding only trajectory i has no relative signal (R_i - R_i) and is not counted
    in J; the root group always is. With `distinct_subgroups`, an ancestor whose sub-group
    equals the previous one (a chain without branching, e.g. a branch advanced K turns in a
    turn-level tree) is counted once instead of once per depth.
    """
    rewards = [t.reward for t in trajectories]
    members: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        for n in t.nodes[:-1]:  # ancestors root..parent; the leaf alone is not a sub-group
            members[n].append(i)
    baseline = {n: _mean([rewards[k] for k in idx]) for n, idx in members.items()}
    pooled = []
    for i, t in enumerate(trajectories):
        terms, prev_size = [], 0
        for depth, n in enumerate(t.nodes[:-1]):
            size = len(members[n])
            # Sub-groups nest (Eq. 4), so an ancestor's set equals its parent's iff same size.
            if depth > 0 and (size < 2 or (distinct_subgroups and size == prev_size)):
                continue
            terms.append(rewards[i] - baseline[n])
            prev_size = size
        pooled.append(_mean(terms) if terms else 0.0)
    return pooled


TreePONorm = Literal["batch", "batch-std", "tree-std", "none"]
TREEPO_NORMS: tuple[str, ...] = ("batch", "batch-std", "tree-std", "none")


def treepo_whiten(
    pooled: Sequence[Sequence[float]],
    groups: Sequence[Sequence[Trajectory]],
    *,
    eps: float = 1e-6,
    shift_mean: bool = True,
) -> list[list[float]]:
    """Global (batch) normalisation of pooled TreePO advantages, REINFORCE++ style.

    Every policy token carries its trajectory's pooled value; the mean and the sample std are
    taken over all policy tokens of the batch (as verl's `masked_whiten`, which REINFORCE++ and
    the TreePO code train with), and each value becomes (x - mean) / (std + eps), or x / (std
    + eps) without `shift_mean`. Trees whose rewards are all equal carry no signal; the paper
    drops them (Eq. 5: s.t. std({R_i}^G) != 0), so they stay at exactly 0 and are left out
    of the statistics.
    """
    live = [max(t.reward for t in g) != min(t.reward for t in g) if g else False for g in groups]
    values: list[float] = []
    for p, g, ok in zip(pooled, groups, live, strict=True):
        if ok:
            for a, t in zip(p, g, strict=True):
                values.extend([a] * t.num_policy_tokens)
    if len(values) < 2 or max(values) == min(values):
        return [[0.0] * len(g) for g in groups]
    mu = _mean(values) if shift_mean else 0.0
    s = _std(values)
    return [
        [(a - mu) / (s + eps) if ok else 0.0 for a in p] for p, ok in zip(pooled, live, strict=True)
    ]


def treepo_advantages(
    tree: Tree,
    trajectories: Sequence[Trajectory],
    *,
    eps: float = 1e-6,
    norm: TreePONorm = "batch",
    distinct_subgroups: bool = False,
) -> list[list[float]]:
    """TreePO advantage, Eq. 5, for one tree (a batch of one), broadcast onto its tokens.

    A_i = (1/|J|) sum_j (R_i - mean(G_j)), sub-group mean baselines averaged across depths
    (§4.2 found this better than the size-weighted Eq. 6), then normalised by `norm`:

    - `batch` (default): the paper's "global variance normalization as in REINFORCE++",
      whitening over the batch's policy tokens (`treepo_whiten`: subtract the mean, divide
      by the std). Use `compute_advantages("treepo", ...)` to whiten over many trees at once.
    - `batch-std`: divide by the batch std without subtracting the mean.
    - `tree-std`: divide by the sample std of the pooled values over this tree only, no mean
      shift (a reading of the conference Eq. 5's std(.)^G).
    - `none`: the pooled values as they are.

    Groups whose rewards are all equal get zeros (the paper rejects them).
    """
    if norm not in TREEPO_NORMS:
        raise ValueError(f"treepo norm must be one of {TREEPO_NORMS}, got {norm!r}")
    _check_group(tree, trajectories)
    pooled = treepo_pooled(trajectories, distinct_subgroups=distinct_subgroups)
    if norm in ("batch", "batch-std"):
        (pooled,) = treepo_whiten([pooled], [trajectories], eps=eps, shift_mean=norm == "batch")
    elif norm == "tree-std":
        pooled = _divide_by_std(pooled, eps)
    return [_broadcast(a, t) for a, t in zip(pooled, trajectories, strict=True)]


# -- TreeRL ---------------------------------------------------------------------------------
def treerl_node_values(
    trajectories: Sequence[Trajectory],
) -> tuple[dict[int, float], dict[int, int]]:
    """TreeRL V(n) = mean reward of the leaves L(n) at or below n, and |L(n)|, per node."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for t in trajectories:
        for n in t.nodes:
            total[n] += t.reward
            count[n] += 1
    return {n: total[n] / count[n] for n in total}, dict(count)


def treerl_advantages(tree: Tree, trajectories: Sequence[Trajectory]) -> list[list[float]]:
    """TreeRL process advantage (Eq. 2-4 with the 1/sqrt(|L(n)|) re-weighting of §3.2, Alg. 1).

    R(n) = [(V(n) - V(root)) + (V(n) - V(parent(n)))] / sqrt(|L(n)|): global plus local
    advantage, down-weighted for nodes shared by many trajectories. Every policy token gets
    the R of the node (segment or turn) that appended it. V is the mean outcome reward
    (TreeRL's fraction of correct leaves when rewards are 0/1); the tree's root plays the
    paper's virtual root over all of a prompt's chains.
    """
    _check_group(tree, trajectories)
    value, count = treerl_node_values(trajectories)
    root = tree.root.id
    r: dict[int, float] = {}
    for n, v in value.items():
        parent = tree.nodes[n].parent
        if parent is None:
            continue  # the root appends no policy tokens
        global_adv = v - value[root]  # Eq. 2
        local_adv = v - value[parent]  # Eq. 3
        r[n] = (global_adv + local_adv) / math.sqrt(count[n])  # Eq. 4, re-weighted
    return [_per_segment(r, t) for t in trajectories]


# -- turn-level rows: GiGPO, RTMC -----------------------------------------------------------
StateKey = Literal["env", "observation"]


def node_state_key(tree: Tree, node_id: int, source: StateKey = "env") -> str:
    """The environment state a node's turn ended in, as a comparable string.

    `env`: the key the env stated through `Env.state_key()` (recorded at rollout time as
    `node.info["state_key"]`), falling back to the observation text where the env states none;
    `observation`: always the observation text, as verl-agent's text envs key anchor states.
    """
    node = tree.nodes[node_id]
    if source == "env" and node.info.get("state_key") is not None:
        return str(node.info["state_key"])
    return node.observation or ""


def _action_key(node: Node) -> str:
    env_info = node.info.get("env")
    if isinstance(env_info, dict) and env_info.get("action_key") is not None:
        return str(env_info["action_key"])
    return " ".join((node.action or "").split())


@dataclass(frozen=True, slots=True)
class StepRow:
    """One turn of one trajectory: the unit GiGPO and RTMC assign advantages to."""

    traj: int
    node: int
    anchor: str
    """Key of the state the action was taken from (its parent node's state)."""
    action: str
    ret: float
    """Discounted return from this step: r_t + gamma r_{t+1} + ..."""


def step_rows(
    tree: Tree, trajectories: Sequence[Trajectory], *, gamma: float, source: StateKey = "env"
) -> list[StepRow]:
    """Every (trajectory, turn) of a group, in order, with its anchor state and return.

    A turn shared by several trajectories of a tree is one row per trajectory, as the same
    rollouts drawn flat would give; its return depends on the trajectory's own future.
    """
    rows: list[StepRow] = []
    for i, t in enumerate(trajectories):
        turns = t.nodes[1:]
        returns = [0.0] * len(turns)
        running = 0.0
        for k in range(len(turns) - 1, -1, -1):
            running = tree.nodes[turns[k]].reward + gamma * running
            returns[k] = running
        for n, g in zip(turns, returns, strict=True):
            anchor = node_state_key(tree, tree.nodes[n].parent or 0, source)
            rows.append(StepRow(i, n, anchor, _action_key(tree.nodes[n]), g))
    return rows


def _normalise_groups(
    values: Sequence[float], keys: Sequence[Any], *, norm: str, eps: float, single_mean: bool
) -> list[float]:
    """x - mean(group), optionally / (sample std + eps), over rows grouped by key.

    A group of one row has mean `x` itself (single_mean=True: advantage 0) or 0 (False: x,
    divided by 1 + eps under `norm: std`), and std 1, as verl-agent's GiGPO treats singletons
    at step and episode level respectively. All-equal groups give exact zeros.
    """
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    out = [0.0] * len(values)
    for idx in groups.values():
        xs = [values[i] for i in idx]
        if len(xs) == 1:  # verl-agent: mean x (or 0) and std 1
            out[idx[0]] = 0.0 if single_mean else xs[0] / (1.0 if norm == "mean" else 1.0 + eps)
            continue
        if max(xs) == min(xs):
            continue
        mu, sd = _mean(xs), _std(xs)
        for i in idx:
            out[i] = values[i] - mu if norm == "mean" else (values[i] - mu) / (sd + eps)
    return out


def gigpo_advantages(
    tree: Tree,
    trajectories: Sequence[Trajectory],
    *,
    step_gamma: float = 0.95,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    norm: Literal["mean", "std"] = "mean",
    episode_stats: Literal["steps", "trajectories"] = "steps",
    state_key: StateKey = "env",
    eps: float = 1e-6,
) -> list[list[float]]:
    """GiGPO (Feng et al., NeurIPS 2025): episode-level plus anchor-state step-level advantages.

    Episode level: A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm over the task's group.
    Step level: every turn is a row (anchor state s, action, discounted return
    R_t = sum_k gamma^(k-t) r_k with `step_gamma`); rows whose anchor states are equal form
    one step group G^S(s), and A^S = (R_t - mean_{G^S(s)} R) / F_norm. The turn's tokens
    get A = episode_weight * A^E + step_weight * A^S (the paper's omega is step_weight).

    F_norm is 1 with `norm: mean` (verl-agent's default `mean_norm`, which its example scripts
    use) or the sample std + eps with `norm: std` (`mean_std_norm`). As verl-agent computes it,
    the episode mean/std are taken over the group's step rows (`episode_stats: steps`, each
    trajectory weighted by its number of turns); `trajectories` takes them over trajectories as
    the paper's equation is written. A step group of one row gets A^S = 0; an episode group of
    one row gets mean 0 and std 1, as in verl-agent (`gigpo/core_gigpo.py`): A^E = R with
    `norm: mean` and R / (1 + eps) with `norm: std`. Anchor states are keyed by
    `state_key` (see `node_state_key`), within this tree's group only.
    """
    _check_group(tree, trajectories)
    rows = step_rows(tree, trajectories, gamma=step_gamma, source=state_key)
    if not rows:
        return [[0.0] * len(t.token_ids) for t in trajectories]
    rewards = [t.reward for t in trajectories]
    if episode_stats == "steps":
        episode = _normalise_groups(
            [rewards[r.traj] for r in rows], [0] * len(rows), norm=norm, eps=eps, single_mean=False
        )
    else:
        per_traj = _normalise_groups(
            rewards, [0] * len(rewards), norm=norm, eps=eps, single_mean=False
        )
        episode = [per_traj[r.traj] for r in rows]
    step = _normalise_groups(
        [r.ret for r in rows], [r.anchor for r in rows], norm=norm, eps=eps, single_mean=True
    )
    per_node: list[dict[int, float]] = [{} for _ in trajectories]
    for r, ae, as_ in zip(rows, episode, step, strict=True):
        per_node[r.traj][r.node] = episode_weight * ae + step_weight * as_
    return [_per_segment(d, t) for d, t in zip(per_node, trajectories, strict=True)]


def rtmc_advantages(
    tree: Tree,
    trajectories: Sequence[Trajectory],
    *,
    gamma: float = 1.0,
    signature: Literal["state", "history"] = "state",
    prior: float = 0.0,
    state_key: StateKey = "env",
) -> list[list[float]]:
    """RTMC, rollout-tree Monte Carlo (arXiv 2604.11037): A(s, a) = Q(s, a) - V(s), no critic.

    Rollouts of one task that pass through the same state signature s are pooled: Q(s, a) is
    the first-visit Monte Carlo mean of the return from step t over the rows that took action
    signature a at s, V(s) the first-visit mean over all rows at s (the visit-weighted mean of
    Q); each turn's tokens get Q(s, a) - V(s). A state met by one rollout only gives 0.

    Signatures: `state` keys s by the env's state key (`state_key()`; Markov envs such as
    FrozenLake and Sokoban); `history` keys it by the sequence of (state, action) signatures
    that led there, the paper's compressed interaction history. Actions are keyed by the env's
    `action_key` (else the whitespace-normalised action text). With `prior` = c > 0, Q is
    shrunk towards V as a Bayesian prior of c pseudo-visits: (n Q + c V) / (n + c).
    Departures: no code is public; the paper's signature system is designed for SWE tool calls,
    where these keys stand in for it, and the prior's form and default (off) are ours.
    """
    _check_group(tree, trajectories)
    rows = step_rows(tree, trajectories, gamma=gamma, source=state_key)
    sig: list[Any] = []
    history: dict[int, tuple] = {}
    for r in rows:
        if signature == "history":
            prev = tree.nodes[r.node].parent
            h = history.get(r.traj, ()) if prev != tree.root.id else ()
            sig.append((*h, r.anchor))
            history[r.traj] = (*h, r.anchor, r.action)
        else:
            sig.append(r.anchor)
    q_sum: dict[Any, float] = defaultdict(float)
    q_n: dict[Any, int] = defaultdict(int)
    v_sum: dict[Any, float] = defaultdict(float)
    v_n: dict[Any, int] = defaultdict(int)
    seen_sa: set[tuple[int, Any, str]] = set()
    seen_s: set[tuple[int, Any]] = set()
    for r, s in zip(rows, sig, strict=True):
        if (r.traj, s) not in seen_s:  # first visit of s in this rollout
            seen_s.add((r.traj, s))
            v_sum[s] += r.ret
            v_n[s] += 1
        if (r.traj, s, r.action) not in seen_sa:
            seen_sa.add((r.traj, s, r.action))
            q_sum[(s, r.action)] += r.ret
            q_n[(s, r.action)] += 1
    per_node: list[dict[int, float]] = [{} for _ in trajectories]
    for r, s in zip(rows, sig, strict=True):
        v = v_sum[s] / v_n[s]
        n = q_n[(s, r.action)]
        q = (q_sum[(s, r.action)] + prior * v) / (n + prior)
        per_node[r.traj][r.node] = q - v
    return [_per_segment(d, t) for d, t in zip(per_node, trajectories, strict=True)]


# -- Tree-GRPO ------------------------------------------------------------------------------
def treegrpo_advantages(
    tree: Tree, trajectories: Sequence[Trajectory], *, eps: float = 1e-6
) -> list[list[float]]:
    """Tree-GRPO (arXiv 2509.21240): intra-tree plus inter-tree group-relative advantages.

    A_i = A_intra(i) + A_inter(i), each the GRPO advantage (r - mean) / (std + eps): inter over
    all of the task's trajectories, intra over the trajectories of i's own tree. As the
    authors' code computes it (`adv_estimator == 'tree'` in `ray_trainer_ts.py`), a group of one
    trajectory has mean 0 and std 1, so its advantage is r / (1 + eps), not 0. The task's M
    trees hang below one agentree root: a trajectory's tree is the `tree_index` its first turn
    records (`--rollout tree-grpo`), else its first turn itself; under a flat rollout every
    intra group is a single trajectory, so A_i = A_GRPO(i) + r_i / (1 + eps).
    """
    _check_group(tree, trajectories)
    rewards = [t.reward for t in trajectories]
    inter = group_normalized(rewards, eps=eps, singleton="unit")
    by_tree: dict[Any, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        first = tree.nodes[t.nodes[1]] if len(t.nodes) > 1 else None
        key = -1 if first is None else first.info.get("tree_index", ("turn", first.id))
        by_tree[key].append(i)
    intra = [0.0] * len(trajectories)
    for idx in by_tree.values():
        group = group_normalized([rewards[i] for i in idx], eps=eps, singleton="unit")
        for i, a in zip(idx, group, strict=True):
            intra[i] = a
    return [_broadcast(a + b, t) for a, b, t in zip(inter, intra, trajectories, strict=True)]


# -- dispatcher -----------------------------------------------------------------------------
ESTIMATORS_BY_NAME: Registry[Callable[..., list[list[list[float]]]]] = Registry(
    "advantage estimator"
)
"""Name -> fn(trees, groups, **options) -> per-token advantages; "module:function" also works."""


@ESTIMATORS_BY_NAME.register("grpo")
def _grpo(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]], **kw: Any):
    out = []
    for tree, trajs in zip(trees, groups, strict=True):
        _check_group(tree, trajs)
        adv = group_normalized([t.reward for t in trajs], **kw)
        out.append([_broadcast(a, t) for a, t in zip(adv, trajs, strict=True)])
    return out


@ESTIMATORS_BY_NAME.register("treepo")
def _treepo(
    trees: Sequence[Tree],
    groups: Sequence[Sequence[Trajectory]],
    *,
    norm: str = "batch",
    eps: float = 1e-6,
    distinct_subgroups: bool = False,
):
    if norm not in TREEPO_NORMS:
        raise ValueError(f"treepo norm must be one of {TREEPO_NORMS}, got {norm!r}")
    if norm in ("tree-std", "none"):
        return [
            treepo_advantages(
                tree, trajs, eps=eps, norm=norm, distinct_subgroups=distinct_subgroups
            )  # type: ignore[arg-type]
            for tree, trajs in zip(trees, groups, strict=True)
        ]
    # Global normalisation (REINFORCE++): one mean and std over every policy token of the batch.
    for tree, trajs in zip(trees, groups, strict=True):
        _check_group(tree, trajs)
    pooled = [treepo_pooled(trajs, distinct_subgroups=distinct_subgroups) for trajs in groups]
    whitened = treepo_whiten(pooled, groups, eps=eps, shift_mean=norm == "batch")
    return [
        [_broadcast(a, t) for a, t in zip(adv, trajs, strict=True)]
        for adv, trajs in zip(whitened, groups, strict=True)
    ]


@ESTIMATORS_BY_NAME.register("treerl")
def _treerl(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]], **kw: Any):
    return [treerl_advantages(tree, trajs, **kw) for tree, trajs in zip(trees, groups, strict=True)]


def _per_tree(name: str, fn: Any) -> None:
    """Register a per-tree estimator (one tree and its group in, per-token advantages out)."""

    def run(trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]], **kw: Any):
        return [fn(tree, trajs, **kw) for tree, trajs in zip(trees, groups, strict=True)]

    ESTIMATORS_BY_NAME.register(name)(run)


_per_tree("gigpo", gigpo_advantages)
_per_tree("rtmc", rtmc_advantages)
_per_tree("treegrpo", treegrpo_advantages)
ESTIMATORS = tuple(ESTIMATORS_BY_NAME.names())


class _Options(BaseModel):
    """An estimator's keyword options as set in `train.advantage_options`; a field left unset
    keeps the estimator function's own default (its signature is the one copy of it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class GRPOOptions(_Options):
    eps: float | None = Field(None, ge=0)
    """Added to the group's std (1e-6)."""
    scale: Literal["std", "none"] | None = None
    """Divide by the group std (GRPO) or not (Dr. GRPO); set through `train.adv_scale`."""


class TreePOOptions(_Options):
    eps: float | None = Field(None, ge=0)
    """Added to the std (1e-6)."""
    norm: TreePONorm | None = None
    """batch (REINFORCE++ over the batch, the default), batch-std, tree-std or none."""
    distinct_subgroups: bool | None = None
    """Pool each sub-group once however many leaves share it (False)."""


class TreeRLOptions(_Options):
    pass


class GiGPOOptions(_Options):
    step_gamma: float | None = Field(None, ge=0)
    """Discount of the step-level returns (0.95)."""
    episode_weight: float | None = Field(None, ge=0)
    """Weight of the episode advantage (1)."""
    step_weight: float | None = Field(None, ge=0)
    """Weight of the step (anchor-state) advantage (1)."""
    norm: Literal["mean", "std"] | None = None
    """Subtract the group mean (mean, the default) or also divide by the std."""
    episode_stats: Literal["steps", "trajectories"] | None = None
    """Episode statistics over step rows (as verl-agent, the default) or trajectories."""
    state_key: StateKey | None = None
    """Anchor states by the env's `state_key` (env, the default) or the observation text."""
    eps: float | None = Field(None, ge=0)
    """Added to the std under norm: std (1e-6)."""


class RTMCOptions(_Options):
    gamma: float | None = Field(None, ge=0)
    """Discount (1)."""
    signature: Literal["state", "history"] | None = None
    """Pool returns over identical states (the default) or identical histories."""
    prior: float | None = Field(None, ge=0)
    """Pseudo-count shrinking Q towards V (0)."""
    state_key: StateKey | None = None
    """As for gigpo."""


class TreeGRPOOptions(_Options):
    eps: float | None = Field(None, ge=0)
    """Added to the std (1e-6)."""


ADVANTAGE_OPTIONS: dict[str, type[_Options]] = {
    "grpo": GRPOOptions,
    "treepo": TreePOOptions,
    "treerl": TreeRLOptions,
    "gigpo": GiGPOOptions,
    "rtmc": RTMCOptions,
    "treegrpo": TreeGRPOOptions,
}
"""Each shipped estimator's options; a user's estimator ("module:function") checks its own."""


_MUST = {
    "literal_error": "must be one of the allowed values",
    "bool_type": "must be a bool",
    "float_type": "must be a number",
    "greater_than_equal": "must be a number >= 0",
}


def estimator_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` validated for estimator `name`, as the keyword arguments it takes; a bad name
    or option raises a one-sentence ValueError."""
    if name not in ESTIMATORS_BY_NAME and ":" not in name:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)} "
            "or pass 'package.module:function'"
        )
    model = ADVANTAGE_OPTIONS.get(name)
    if model is None:
        return dict(options)
    try:
        return model.model_validate(options).kwargs()
    except ValidationError as e:
        errors = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                errors.append(
                    f"advantage {name!r} has no option {key!r}; its options are "
                    f"{sorted(model.model_fields)}"
                )
            else:
                errors.append(
                    f"advantage option {key!r} {_MUST.get(err['type'], 'is invalid')}, "
                    f"got {err['input']!r} ({err['msg']})"
                )
        raise ValueError("; ".join(errors)) from None


AdvantageFn = Callable[[Sequence[Tree], Sequence[Sequence[Trajectory]]], list[list[list[float]]]]
"""`(trees, trajectories_by_tree) -> out[k][i][t]`: an estimator with its options bound."""


def advantage_estimator(name: str, options: dict[str, Any]) -> AdvantageFn:
    """Estimator `name` with its `options` (the fields of its `ADVANTAGE_OPTIONS` model)
    validated and bound once; a bad name or option raises a one-sentence ValueError.

    `name` is one of `grpo` (group-normalised outcome over each tree's group, PATR Eq. 9),
    `treepo`, `treerl`, `gigpo`, `rtmc`, `treegrpo` or a user's `module:function`. The returned
    function gives per-token advantages `out[k][i][t]` for token t of trajectory i of tree k;
    gigpo and rtmc give each turn its own advantage. The update resolves it once and the viewer
    through `compute_advantages`, so both apply the same options."""
    kw = estimator_options(name, options)
    fn = ESTIMATORS_BY_NAME.get(name)

    def estimate(
        trees: Sequence[Tree], trajectories_by_tree: Sequence[Sequence[Trajectory]]
    ) -> list[list[list[float]]]:
        if len(trees) != len(trajectories_by_tree):
            raise ValueError(
                f"got {len(trees)} trees but {len(trajectories_by_tree)} trajectory groups; "
                "pass one group per tree, in the same order"
            )
        return fn(trees, trajectories_by_tree, **kw)

    return estimate


def compute_advantages(
    name: str,
    trees: Sequence[Tree],
    trajectories_by_tree: Sequence[Sequence[Trajectory]],
    **kw: Any,
) -> list[list[list[float]]]:
    """Per-token advantages `out[k][i][t]` for token t of trajectory i of tree k, from
    estimator `name` with options `kw` (`advantage_estimator` in one call)."""
    return advantage_estimator(name, kw)(trees, trajectories_by_tree)
