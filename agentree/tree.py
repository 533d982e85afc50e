"""Rollout trees: the one data structure every controller produces and the trainer consumes.

A node stores the exact token ids it appended to the context: the policy's sampled ids (with
their sampling log-probs) followed by the template/observation ids the environment added after
them. A trajectory is the concatenation of its root-to-leaf nodes' ids, with a loss mask that
is 1 only on policy ids. Nothing is ever re-tokenized, so the trainer optimises exactly what the
policy sampled, and shared prefixes are stored once.

Turn-level controllers (patr, grpo, ...) make one node per turn; token-level samplers (latr,
treepo, eptree) make one node per response segment and step the single-turn env at the leaves.

History window (`engine.history: last:k`, recorded as `meta["history"] = k`): a turn's prompt
is then the root's ids (the system prompt and the task's first observation) followed by the
last k turns' ids (each turn's sampled action and the observation after it), not the whole
path (`context_ids`). Every id is still one the tree stored, so nothing is re-tokenized; the
whole path (`trajectory`) stays what advantage estimators read, and `turn_trajectories` gives
the samples the update trains: each turn as its own sequence, its exact prompt then its action.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

TREE_FORMAT = "agentree.tree/1"


class EndReason(StrEnum):
    """Why a branch stopped. Every leaf carries one; nothing is dropped silently."""

    COMPLETED = "completed"  # the env terminated the episode (success or failure)
    MAX_TURNS = "max_turns"  # the env truncated the episode (turn/step limit)
    MAX_TOKENS = "max_tokens"  # the context would exceed the model's length budget
    PRUNED_LOW_SCORE = "pruned_low_score"  # PATR Eq. 5: score < median(active) - alpha
    PRUNED_REPEAT = "pruned_repeat"  # the same action repeated theta times in a row
    PRUNED_SIMILAR = "pruned_similar"  # LATR lookahead: too close to its sibling
    PRUNED_REPETITION = "pruned_repetition"  # TreePO early stop on repeated substrings
    ENV_ERROR = "env_error"  # env.step or env.restore raised
    TIMEOUT = "timeout"  # an env action or the branch ran past its time budget
    BUDGET = "budget"  # the task's env-step budget ran out (rollout.env_step_budget)


PRUNED = frozenset(
    {
        EndReason.PRUNED_LOW_SCORE,
        EndReason.PRUNED_REPEAT,
        EndReason.PRUNED_SIMILAR,
        EndReason.PRUNED_REPETITION,
    }
)


@dataclass(slots=True)
class Node:
    """One turn (or one response segment) of a rollout tree."""

    id: int
    parent: int | None
    turn: int
    action: str | None = None
    action_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observation: str | None = None
    obs_ids: list[int] = field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    score: float | None = None
    end_reason: EndReason | None = None
    children: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent": self.parent,
            "children": list(self.children),
            "turn": self.turn,
            "action": self.action,
            "action_ids": list(self.action_ids),
            "logprobs": [round(x, 6) for x in self.logprobs],
            "observation": self.observation,
            "obs_ids": list(self.obs_ids),
            "reward": self.reward,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "score": self.score,
            "end_reason": None if self.end_reason is None else str(self.end_reason),
            "info": _json_safe(self.info),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Node:
        return cls(
            id=d["id"],
            parent=d["parent"],
            turn=d["turn"],
            action=d.get("action"),
            action_ids=list(d.get("action_ids", [])),
            logprobs=list(d.get("logprobs", [])),
            observation=d.get("observation"),
            obs_ids=list(d.get("obs_ids", [])),
            reward=d.get("reward", 0.0),
            terminated=d.get("terminated", False),
            truncated=d.get("truncated", False),
            score=d.get("score"),
            end_reason=None if d.get("end_reason") is None else EndReason(d["end_reason"]),
            children=list(d.get("children", [])),
            info=dict(d.get("info", {})),
        )


@dataclass(slots=True)
class Trajectory:
    """A root-to-leaf path flattened for training.

    `token_ids[i]` was sampled by the policy iff `loss_mask[i] == 1`; `logprobs[i]` is its
    sampling log-prob (0.0 elsewhere). `node_of_token[i]` is the node that appended token i,
    which lets tree-aware advantage estimators assign per-segment advantages.
    """

    task_id: str
    leaf: int
    nodes: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    node_of_token: list[int]
    reward: float
    end_reason: EndReason
    num_turns: int
    trajectory_tokens: int | None = None
    """For a part of a trajectory trained as its own sequence (a turn under a history window):
    the policy tokens of the whole trajectory, which seq-mean weighs each of its tokens by.
    None for a whole trajectory."""

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def pruned(self) -> bool:
        return self.end_reason in PRUNED


class Tree:
    """A rollout tree for one task. Node 0 is the root (the initial prompt, no action)."""

    def __init__(self, task_id: str, task: dict[str, Any] | None = None) -> None:
        self.task_id = task_id
        self.task: dict[str, Any] = dict(task or {})
        self.nodes: list[Node] = []
        self.meta: dict[str, Any] = {}

    # -- building -------------------------------------------------------------------------
    def add_root(self, observation: str, obs_ids: list[int], info: dict | None = None) -> Node:
        if self.nodes:
            raise ValueError("tree already has a root")
        node = Node(id=0, parent=None, turn=0, observation=observation, obs_ids=list(obs_ids))
        node.info.update(info or {})
        self.nodes.append(node)
        return node

    def add_child(self, parent: int, **fields: Any) -> Node:
        p = self.nodes[parent]
        node = Node(
            id=len(self.nodes), parent=parent, turn=fields.pop("turn", p.turn + 1), **fields
        )
        self.nodes.append(node)
        p.children.append(node.id)
        return node

    # -- reading --------------------------------------------------------------------------
    @property
    def root(self) -> Node:
        return self.nodes[0]

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root down to `node_id`, inclusive."""
        out: list[Node] = []
        cur: int | None = node_id
        while cur is not None:
            n = self.nodes[cur]
            out.append(n)
            cur = n.parent
        return out[::-1]

    def success(self, leaf_id: int) -> bool:
        """Whether the trajectory ending at `leaf_id` solved its task: the env's `success` flag
        where it sets one, else a return of at least 1; never after an env error or a timeout.
        The one rule: training metrics, held-out evaluation, rollouts and the viewer use it."""
        node = self.nodes[leaf_id]
        if node.end_reason in (EndReason.ENV_ERROR, EndReason.TIMEOUT):
            return False
        reward = sum(n.reward for n in self.path(leaf_id))
        return bool(node.info.get("env", {}).get("success", reward >= 1.0))

    @property
    def history(self) -> int | None:
        """The history window k of `engine.history: last:k`, or None: every turn is kept."""
        k = self.meta.get("history")
        return None if k is None else int(k)

    def context_ids(self, node_id: int) -> list[int]:
        """The exact token ids the policy conditions on after `node_id`: the whole path, or
        with a history window k the root and the last k turns of it."""
        ids: list[int] = []
        for n in self.context_nodes(node_id):
            ids.extend(n.action_ids)
            ids.extend(n.obs_ids)
        return ids

    def context_nodes(self, node_id: int) -> list[Node]:
        """The nodes whose ids, in order, make the context after `node_id` (`context_ids`)."""
        path = self.path(node_id)
        if self.history is None:
            return path
        return path[:1] + path[1:][-self.history :]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if not n.children and n.parent is not None]

    def finished_leaves(self) -> list[Node]:
        return [n for n in self.leaves() if n.end_reason is not None]

    def subtree_leaves(self, node_id: int) -> list[int]:
        """Ids of the finished leaves at or below `node_id`."""
        out, stack = [], [node_id]
        while stack:
            n = self.nodes[stack.pop()]
            if n.children:
                stack.extend(n.children)
            elif n.end_reason is not None and n.parent is not None:
                out.append(n.id)
        return out

    def trajectory(self, leaf_id: int) -> Trajectory:
        path = self.path(leaf_id)
        leaf = path[-1]
        if leaf.end_reason is None:
            raise ValueError(f"node {leaf_id} of tree {self.task_id} is not a finished leaf")
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        owner: list[int] = []
        for k, n in enumerate(path):
            ids += n.action_ids
            mask += [1] * len(n.action_ids)
            lps += n.logprobs if len(n.logprobs) == len(n.action_ids) else [0.0] * len(n.action_ids)
            owner += [n.id] * len(n.action_ids)
            if k < len(path) - 1:  # tokens after the last action carry no learning signal
                ids += n.obs_ids
                mask += [0] * len(n.obs_ids)
                lps += [0.0] * len(n.obs_ids)
                owner += [n.id] * len(n.obs_ids)
        return Trajectory(
            task_id=self.task_id,
            leaf=leaf_id,
            nodes=[n.id for n in path],
            token_ids=ids,
            loss_mask=mask,
            logprobs=lps,
            node_of_token=owner,
            reward=sum(n.reward for n in path),
            end_reason=leaf.end_reason,
            num_turns=leaf.turn,
        )

    def turn_trajectories(self, traj: Trajectory) -> list[Trajectory]:
        """The training samples of `traj` (a trajectory of this tree): the trajectory itself,
        or with a history window one per turn, its prompt (`context_ids` of the turn's parent,
        exactly what the policy was sampled against) then the action it sampled, the only
        tokens with loss mask 1. `node_of_token` names the node each id came from, so a
        turn's action ids keep their node, and `trajectory_tokens` is the policy tokens of all
        the turns, so that seq-mean weighs the trajectory, not each turn, alike."""
        if self.history is None:
            return [traj]
        out = []
        for k in range(1, len(traj.nodes)):
            node = self.nodes[traj.nodes[k]]
            if not node.action_ids:
                continue
            ids: list[int] = []
            owner: list[int] = []
            for n in self.context_nodes(traj.nodes[k - 1]):
                ids += n.action_ids + n.obs_ids
                owner += [n.id] * (len(n.action_ids) + len(n.obs_ids))
            a = len(node.action_ids)
            lps = node.logprobs if len(node.logprobs) == a else [0.0] * a
            out.append(
                Trajectory(
                    task_id=traj.task_id,
                    leaf=traj.leaf,
                    nodes=traj.nodes[: k + 1],
                    token_ids=ids + node.action_ids,
                    loss_mask=[0] * len(ids) + [1] * a,
                    logprobs=[0.0] * len(ids) + list(lps),
                    node_of_token=owner + [node.id] * a,
                    reward=traj.reward,
                    end_reason=traj.end_reason,
                    num_turns=traj.num_turns,
                )
            )
        total = sum(t.num_policy_tokens for t in out)
        for t in out:
            t.trajectory_tokens = total
        return out

    def trajectories(self, *, include_pruned: bool = True) -> list[Trajectory]:
        """The rollout group: every finished leaf (PATR's "keep all"), or only unpruned ones.

        Leaves cut by the env-step budget (`EndReason.BUDGET`) are never in it: their outcome
        is unknown, and a reward of 0 for them would punish whichever branches happened to be
        live when the budget ran out. Their steps still count as spent."""
        leaves = [n for n in self.finished_leaves() if n.end_reason != EndReason.BUDGET]
        trajs = [self.trajectory(n.id) for n in leaves]
        return trajs if include_pruned else [t for t in trajs if not t.pruned]

    # -- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TREE_FORMAT,
            "task_id": self.task_id,
            "task": _json_safe(self.task),
            "meta": _json_safe(self.meta),
            "nodes": [n.to_dict() for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tree:
        if d.get("format") != TREE_FORMAT:
            raise ValueError(f"not an {TREE_FORMAT} tree (format={d.get('format')!r})")
        t = cls(d["task_id"], d.get("task"))
        t.meta = dict(d.get("meta", {}))
        t.nodes = [Node.from_dict(n) for n in d["nodes"]]
        return t

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Tree:
        return cls.from_dict(json.loads(Path(path).read_text()))


def save_trees(trees: Sequence[Tree], directory: str | Path, prefix: str = "") -> None:
    """Write each tree to DIRECTORY/{prefix}{index:03d}_{task id}.json (the directory is made)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for i, tree in enumerate(trees):
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in tree.task_id)[:80]
        tree.save(out / f"{prefix}{i:03d}_{name}.json")


def _json_safe(x: Any) -> Any:
    """Best-effort conversion to JSON types (numpy scalars, tuples, enums, non-finite floats)."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [_json_safe(v) for v in x]
    if isinstance(x, StrEnum):
        return str(x)
    if isinstance(x, bool | int | str) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        try:
            return _json_safe(x.item())
        except (TypeError, ValueError):
            pass
    if hasattr(x, "tolist"):
        return _json_safe(x.tolist())
    return repr(x)
