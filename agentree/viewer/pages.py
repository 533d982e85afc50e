"""`agentree view`: one self-contained HTML page showing a run's rollout trees, step by step.

Reads the `agentree.tree/1` files of a train, rollout or eval directory (`RUN_DIR/trees/`),
adds what a reader needs that the files do not hold directly (each node's role in the tree:
expanded, surviving, pruned; each leaf's return, success and advantage), and inlines the data,
script and style of `agentree/viewer/` into one HTML file that opens from disk with no network.

Advantages are recomputed here with `agentree.algorithms.advantages.compute_advantages`, using the
run's `train.advantage` estimator over each tree's rollout group (the controller's group: every
finished leaf, only unpruned ones for PATR's `best-n`, or the leaves a token-level sampler
recorded in `meta.group`), exactly as the trainer computes them before its update.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agentree.algorithms.advantages import compute_advantages
from agentree.config import TrainConfig
from agentree.tree import PRUNED, EndReason, Trajectory, Tree

_STEP_FILE = re.compile(r"^step(\d+)_")
_ERRORS = frozenset({EndReason.ENV_ERROR, EndReason.TIMEOUT})


# -- reading a run directory --------------------------------------------------------------------
def tree_files(run_dir: Path) -> list[Path]:
    """The tree files of a run/rollout/eval directory, of its `trees/` folder, or one file."""
    if run_dir.is_file():
        return [run_dir]
    folder = run_dir / "trees" if (run_dir / "trees").is_dir() else run_dir
    if folder == run_dir and (run_dir / "config.yaml").exists():
        # a run directory whose JSON files (summary.json, eval.json) are not trees
        raise FileNotFoundError(
            f"{run_dir} has no trees/ folder, so there are no trees to view; a training run "
            "saves them every train.trees_every steps (set it above 0), an evaluation or a "
            "rollout once its last task is done (a stopped one finishes with agentree eval "
            "--resume or agentree rollout --resume)"
        )
    files = sorted(p for p in folder.glob("*.json") if p.name != "eval.json")
    if not files:
        raise FileNotFoundError(
            f"no tree files in {folder}: pass a run, rollout or eval directory (one with trees/)"
        )
    return files


def run_kind(run_dir: Path) -> str:
    if (run_dir / "metrics.jsonl").exists():
        return "train"
    if (run_dir / "eval.json").exists():
        return "eval"
    if (run_dir / "rollout_stats.json").exists():
        return "rollout"
    return "trees"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _estimator(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """The advantage estimator and its options as the run trained with them
    (`TrainConfig.advantage_kwargs`), from its config.yaml; GRPO's defaults without one."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    try:
        train = TrainConfig.model_validate(cfg.get("train") or {})
    except ValidationError:
        train = TrainConfig()
    return train.advantage, train.advantage_kwargs()


def _step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Training metrics per step from metrics.jsonl (evaluation rows are kept apart)."""
    out: dict[int, dict[str, float]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        keep = {k: v for k, v in row.items() if isinstance(v, int | float) and "/" in k}
        out.setdefault(int(row.get("step", 0)), {}).update(keep)
    return out


# -- per-node annotations -----------------------------------------------------------------------
def rollout_group(tree: Tree) -> list[Trajectory]:
    """The trajectories the trainer optimises for this tree (see the module docstring)."""
    finished = {n.id for n in tree.finished_leaves()}
    if isinstance(tree.meta.get("group"), list):
        leaves = [i for i in tree.meta["group"] if i in finished]
        return [tree.trajectory(i) for i in leaves]
    best_n = (tree.meta.get("config") or {}).get("group") == "best-n"
    return tree.trajectories(include_pruned=not best_n)


def node_kind(tree: Tree, node_id: int) -> str:
    """root, expanded (a branch point), pruned, error, leaf (finished), surviving or plain."""
    n = tree.nodes[node_id]
    if n.parent is None:
        return "root"
    if n.end_reason in PRUNED:
        return "pruned"
    if n.end_reason in _ERRORS:
        return "error"
    if "expanded" in n.info or len(n.children) > 1:
        return "expanded"
    if not n.children:
        return "leaf"
    return "surviving" if n.score is not None else "plain"


def node_advantages(
    tree: Tree, group: Sequence[Trajectory], per_token: Sequence[Sequence[float]]
) -> tuple[dict[int, float], dict[int, float]]:
    """(leaf -> its trajectory's advantage, node -> its segment's advantage).

    A leaf's advantage is the mean over its trajectory's policy tokens (the scalar itself for
    GRPO). A node's segment advantage is the value on the tokens it appended, shown only where
    every trajectory through the node gives it the same value (TreePO/TreeRL per-segment).
    """
    leaf_adv: dict[int, float] = {}
    seen: dict[int, set[float]] = {}
    for traj, adv in zip(group, per_token, strict=True):
        policy = [a for a, m in zip(adv, traj.loss_mask, strict=True) if m]
        leaf_adv[traj.leaf] = sum(policy) / len(policy) if policy else 0.0
        for node, a, m in zip(traj.node_of_token, adv, traj.loss_mask, strict=True):
            if m:
                seen.setdefault(node, set()).add(round(a, 9))
    segment = {n: next(iter(v)) for n, v in seen.items() if len(v) == 1}
    return leaf_adv, segment


def tree_payload(tree: Tree, estimator: str, kw: dict[str, Any], file: str) -> dict[str, Any]:
    """One tree as the viewer draws it: nodes without token ids, plus the annotations."""
    group = rollout_group(tree)
    per_token = compute_advantages(estimator, [tree], [group], **kw)[0] if group else []
    leaf_adv, segment_adv = node_advantages(tree, group, per_token)
    in_group = {t.leaf for t in group}
    returns: dict[int, float] = {}
    nodes = []
    for n in tree.nodes:
        d = n.to_dict()
        ret = n.reward + (returns[n.parent] if n.parent is not None else 0.0)
        returns[n.id] = ret
        d.pop("action_ids")
        d.pop("obs_ids")
        d.pop("logprobs")
        d.update(
            tokens=len(n.action_ids),
            obs_tokens=len(n.obs_ids),
            logprob=round(sum(n.logprobs), 4) if n.logprobs else None,
            kind=node_kind(tree, n.id),
            ret=round(ret, 6),
            advantage=leaf_adv.get(n.id, segment_adv.get(n.id)),
            in_group=n.id in in_group,
            success=tree.success(n.id) if n.end_reason is not None else None,
        )
        nodes.append(d)
    d = tree.to_dict()
    return {
        "file": file,
        "task_id": tree.task_id,
        "task": d["task"],
        "meta": d["meta"],
        "advantage": estimator,
        "nodes": nodes,
    }


# -- the page ------------------------------------------------------------------------------------
def view_data(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, grouped by training step (one group for rollout/eval)."""
    files = tree_files(run_dir)
    base = run_dir if run_dir.is_dir() else run_dir.parent
    if base.name == "trees" and not (base / "config.yaml").exists():
        base = base.parent
    kind = run_kind(base)
    estimator, kw = _estimator(base)
    metrics = _step_metrics(base)
    steps: dict[int | None, list[dict[str, Any]]] = {}
    for f in files:
        m = _STEP_FILE.match(f.name)
        step = int(m.group(1)) if m else None
        steps.setdefault(step, []).append(tree_payload(Tree.load(f), estimator, kw, f.name))
    groups = []
    for step, trees in sorted(steps.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        label = kind if step is None else f"step {step}"
        groups.append({"label": label, "step": step, "metrics": metrics.get(step or -1, {})})
        groups[-1]["trees"] = trees
    summary = _read_json(base / "rollout_stats.json") or _read_json(base / "eval.json").get(
        "summary", {}
    )
    return {"run": base.resolve().name, "kind": kind, "summary": summary, "steps": groups}


def _asset(name: str) -> str:
    return resources.files("agentree.viewer").joinpath(name).read_text(encoding="utf-8")


def render_html(data: dict[str, Any]) -> str:
    """The page: template with the style, script and data inlined (no network access)."""
    # "<" escaped so no string in the data can close the script element
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    page = _asset("template.html")
    for key, value in (
        ("__TITLE__", html.escape(f"agentree view: {data['run']}")),
        ("/*__STYLE__*/", _asset("viewer.css")),
        ("__DATA__", blob),
        ("/*__SCRIPT__*/", _asset("viewer.js")),
    ):
        page = page.replace(key, value, 1)
    return page


def write_view(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, dict]:
    """Render RUN_DIR's trees to OUTPUT (default RUN_DIR/view.html); returns (path, data)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"{run_dir} does not exist")
    default = (run_dir if run_dir.is_dir() else run_dir.parent) / "view.html"
    out = Path(output) if output else default
    data = view_data(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data), encoding="utf-8")
    return out, data


# -- CLI ---------------------------------------------------------------------------------------
def add_view_command(sub: Any) -> None:
    p = sub.add_parser("view", help="render a run's rollout trees as one self-contained HTML page")
    p.add_argument("run_dir", help="a train, rollout or eval directory (or one tree file)")
    p.add_argument("--output", help="HTML file to write (default RUN_DIR/view.html)")
    p.set_defaults(func=_cmd_view)


def _cmd_view(args: Any) -> int:
    out, data = write_view(args.run_dir, args.output)
    trees = [t for g in data["steps"] for t in g["trees"]]
    nodes = sum(len(t["nodes"]) for t in trees)
    steps = len(data["steps"])
    trained = f"{steps} step{'s' if steps != 1 else ''}, " if data["kind"] == "train" else ""
    print(f"wrote {out}: {trained}{len(trees)} trees, {nodes} nodes")
    return 0
