"""Where can trees help? The mechanism measured from rollouts alone, before any training.

For each method (`grpo`, `patr`, `tree-random`, `arpo`, `tree-grpo`, `tsr`) and each level of
policy strength, the same held-out tasks are rolled out at the same exact env-step budget per
task (`rollout.env_step_budget`, so no method draws more environment than another) and we count:

- `informative_share`: the share of tasks whose rollout group has rewards not all equal (a
  group with one reward for all teaches GRPO-style objectives nothing; an empty group counts
  as uninformative), and `informative_per_1k_steps`;
- `outcome_informative_share`: the share whose group holds both a success and a failure, the
  task's own signal (an invalid-action penalty alone makes rewards differ);
- `successes_per_1k_steps`: successful trajectories of the groups per 1,000 env steps;
- `distinct_states`: distinct env states visited per task (`Env.state_key`, else the text);
- `forward_tokens_per_step`: tokens the policy computed (sampled + prefilled, prefix-cache hits
  excluded) per env step; on the transformers engine a method's cost only when
  `engine.prefix_cache_mb` holds the branches it keeps live (a smaller cache computes dropped
  histories again: `rollout/policy_tokens_evicted` in training; raise it here);
- `budget_cut_per_task`: branches the budget ended (out of the groups). The branches live when
  it runs out are more often long ones, so many cuts bias a group towards short episodes: give
  the budget room for several rounds of each method (e.g. 2 x G x the mean episode length),
  or `--budget-reserve` (every method starts only what the budget can finish: no cuts, up to
  one turn limit of steps unspent).

Policy strength is swept by sampling temperature (`--temperatures`) and, optionally, by warm
starts of different skill (`--policy A B ...`, default the env's warm start `tiny-warm`;
`tiny-warm@0.6` is the config's warm start rebuilt with `policy.warm.expert_prob=0.6`,
`tiny-warm@0.9,pretrain_epochs=6` also with another field of the recipe): a level
is one (policy, temperature), named by its base success rate, flat sampling's (`grpo`) success
rate there. Choose levels that take it from about 2% to about 60% (the summary prints it per
level; add levels and rerun: finished ones are kept). Methods use their controllers' defaults,
except TSR: best of 2 candidates per turn, one trajectory at a time (G=1), so the budget cuts at
most one of its searches (a beam of width W costs W x N steps a turn and would mostly be cut);
`--method-set tsr.mode=beam` changes one. An ablation is a variant beside its controller:
`--methods grpo tree-grpo tree-grpo-noroot=tree-grpo --method-set
tree-grpo-noroot.expand_root=false` measures both at every level (the variant's files record the
controller they ran) and pairs the variant with Tree-GRPO task by task as well as with GRPO.

Any env and scorer a user can name work (`--env NAME|module:Class --scorer NAME|module:Class`,
`--config`, `--set key=value`); `--label` names the env in the results (default: the env's
name), so one output directory can hold several envs. `--seed` draws the tasks (and seeds the
sampling); `--sample-seed S` reseeds only the sampling, so replicates of a level on the same
tasks (each in its own `--out`) tell sampling noise from a method's effect; `--replicates DIR...`
pools them (`replicates`: shares per replicate and their mean, methods paired task by task on
the share over replicates) into `--out/replicates.json`.

    python benchmarks/tree_mechanism.py --out DIR --set env.size=8 --set env.max_turns=30 \\
        --label frozenlake8 --budget 120 --tasks 256 --temperatures 0.5 0.8 1 1.3 1.7 2.2 3
    python benchmarks/tree_mechanism.py --out DIR --config sokoban_patr --set env.size=7 \\
        --set env.boxes=2 --set env.max_turns=30 --label sokoban2 --budget 120 --tasks 256
    python benchmarks/tree_mechanism.py --out DIR --policy tiny --tasks 2 --budget 12 \\
        --temperatures 1 --methods grpo patr                                         # smoke

Each (env, method, level) is written to `DIR/<label>/<method>/<policy>-T<temperature>.json` as
soon as it finishes and skipped when present, so a stopped run resumes where it stopped. `DIR/
summary.json` holds {"budget": {label: N}, "budget_reserve": {label: bool}, "levels": {label:
[{"policy", "temperature", "base_success"}]},
"mechanism": {label: {method: {"base_success": [...], "informative_share": [...], ...}}},
"paired": {label: [{"policy", "temperature", "patr - grpo": {"diff", "se", ...}, ...}]}}
(lists aligned with the levels, sorted by base success; `paired` compares methods task by task
on the same tasks, so its standard errors are those of a difference), and
`DIR/<label>_mechanism.png` plots the informative-group share against base success, a line per
method. `--merge SUMMARY...` joins the levels of earlier summaries (another directory's, or one
kept in the docs) into this summary and plot: one table and one plot per env across runs, a
level measured twice, or an env at another budget or under the other budget rule (with and
without `--budget-reserve`), refused. Summaries written before the rule was recorded in them
lack `budget_reserve`; their rule is unknown, so only the budget is checked for them.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentree.algorithms.advantages import node_state_key
from agentree.config import load_config, parse_override
from agentree.envs.base import Task
from agentree.rollout.base import RolloutStats, controller_names, make_controller
from agentree.run.runtime import Runtime
from agentree.tree import Tree

METHODS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "patr": {},
    "tree-random": {},
    "arpo": {},
    "tree-grpo": {},
    "tsr": {"mode": "best_of_n", "G": 1, "N": 2},
}
METRICS = (
    "informative_share",
    "outcome_informative_share",
    "informative_per_1k_steps",
    "successes_per_1k_steps",
    "success_rate",
    "distinct_states",
    "forward_tokens_per_step",
    "env_steps_per_task",
    "trajectories_per_task",
    "budget_cut_per_task",
)


def counts(controller: Any, trees: list[Tree], stats: RolloutStats) -> dict[str, Any]:
    """The raw counts of one rollout; `metrics` turns summed counts into the reported rates.
    `mixed_by_task` keeps each task's outcome flag (1: its group holds a success and a
    failure), in task order, so two methods can be compared task by task."""
    out: dict[str, Any] = {"tasks": 0, "informative": 0, "empty": 0, "trajectories": 0}
    out.update(successes=0, states=0, mixed_by_task=[])
    for tree in trees:
        group = controller.group(tree)
        out["tasks"] += 1
        out["empty"] += not group
        out["informative"] += len({t.reward for t in group}) > 1
        out["mixed_by_task"].append(int(len({tree.success(t.leaf) for t in group}) > 1))
        out["trajectories"] += len(group)
        out["successes"] += sum(tree.success(t.leaf) for t in group)
        out["states"] += len({node_state_key(tree, n.id) for n in tree.nodes})
    out["env_steps"] = stats.env_steps
    out["forward_tokens"] = stats.policy_tokens_generated + stats.policy_tokens_prefilled
    out["budget_cut"] = int(stats.extra.get("budget_cut", 0))
    return out


def metrics(c: dict[str, Any]) -> dict[str, float]:
    steps, tasks = max(c["env_steps"], 1), max(c["tasks"], 1)
    return {
        "informative_share": c["informative"] / tasks,
        # groups that hold both a success and a failure: the task's outcome signal alone (an
        # invalid-action penalty makes rewards differ without any success)
        "outcome_informative_share": sum(c["mixed_by_task"]) / tasks,
        "informative_per_1k_steps": 1000 * c["informative"] / steps,
        "successes_per_1k_steps": 1000 * c["successes"] / steps,
        "success_rate": c["successes"] / max(c["trajectories"], 1),
        "distinct_states": c["states"] / tasks,
        "forward_tokens_per_step": c["forward_tokens"] / steps,
        "env_steps_per_task": c["env_steps"] / tasks,
        "trajectories_per_task": c["trajectories"] / tasks,
        "budget_cut_per_task": c["budget_cut"] / tasks,
    }


def method_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each method's controller settings: the defaults above, `--method-set` on top. A variant
    (`NAME=CONTROLLER` in `--methods`) starts from its controller's defaults and records the
    controller it runs (`controller`)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in args.methods:
        name, eq, base = spec.partition("=")
        if not eq:
            out[name] = dict(METHODS.get(name, {}))
            continue
        if name in controller_names() or base not in controller_names():
            raise ValueError(
                f"--methods {spec}: a variant is NEW_NAME=CONTROLLER, its name not a "
                f"controller's and CONTROLLER one of {controller_names()}"
            )
        out[name] = {"controller": base, **METHODS.get(base, {})}
    for item in args.method_set:
        keys, value = parse_override(item)
        if len(keys) != 2 or keys[0] not in out:
            raise ValueError(f"--method-set expects METHOD.key=value for a chosen method: {item}")
        out[keys[0]][keys[1]] = value
    return out


def run_level(
    rt: Runtime,
    method: str,
    settings: dict[str, Any],
    tasks: list[Task],
    temperature: float,
    args: argparse.Namespace,
    policy: str,
) -> dict[str, Any]:
    """One method at one level (`policy`, the engine's, at `temperature`) over every task, in
    batches of `--batch` tasks."""
    kwargs = run_settings(settings, args)
    controller = make_controller(kwargs.pop("controller", method), **kwargs)
    total: dict[str, Any] = {}
    t0 = time.perf_counter()
    seed = args.seed if args.sample_seed is None else args.sample_seed
    rt.engine.seed(seed)
    rng = random.Random(seed)
    for i in range(0, len(tasks), args.batch):
        rt.engine.sync_weights(rt.model)  # a cold prefix cache: prefill counts compare
        ctx = rt.rollouts.context(temperature=temperature)
        ctx.rng = rng
        # the controller itself, not `Rollouts.rollout`: an empty group is a measurement here
        trees, stats = controller.rollout(tasks[i : i + args.batch], ctx)
        for k, v in counts(controller, trees, stats).items():
            total[k] = [*total.get(k, []), *v] if isinstance(v, list) else total.get(k, 0) + v
        done = min(i + args.batch, len(tasks))
        if done < len(tasks):  # progress on long levels (BabyAI: minutes a batch)
            print(
                f"[{time.strftime('%H:%M:%S')}]   {method} T={temperature:g}: {done}/"
                f"{len(tasks)} tasks, {total.get('env_steps', 0):.0f} env steps, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return {
        "method": method,
        "policy": policy_tag(policy),
        "temperature": temperature,
        "settings": recorded_settings(settings, args),
        "counts": total,
        **metrics(total),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def warm_recipe(policy: str) -> tuple[str, list[str]]:
    """`tiny-warm@0.9,pretrain_epochs=6` -> ("tiny-warm", the `policy.warm` overrides): after the
    `@`, comma-separated, a bare number is `expert_prob` and `key=value` any other field of the
    warm recipe (`agentree.models.warm.WarmConfig`)."""
    path, _, spec = policy.partition("@")
    overrides = []
    for part in filter(None, spec.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            try:
                float(part)
            except ValueError:
                raise SystemExit(
                    f"--policy {policy}: {part!r} is neither an expert probability nor key=value"
                ) from None
            key, value = "expert_prob", part
        overrides.append(f"policy.warm.{key.strip()}={value.strip()}")
    return path, overrides


def policy_tag(policy: str) -> str:
    """A policy's name in file names: the last part of a path or hub id."""
    return policy.rstrip("/").rsplit("/", 1)[-1]


def run_settings(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A method's controller settings with the budget every method shares."""
    return {**settings, "env_step_budget": args.budget, "budget_reserve": args.budget_reserve}


def recorded_settings(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What a level's file records of how it was measured: the controller's settings and, where
    `--sample-seed` gives one, the sampling seed (a level is resumed only under the same)."""
    out = run_settings(settings, args)
    if args.sample_seed is not None:
        out["sample_seed"] = args.sample_seed
    return out


def level_path(out: Path, label: str, method: str, policy: str, temperature: float) -> Path:
    return out / label / method / f"{policy_tag(policy)}-T{temperature:g}.json"


def measure(args: argparse.Namespace) -> None:
    """Every missing (method, level) of this env, written as it finishes."""
    out, label = Path(args.out), args.label
    settings = method_settings(args)
    if "grpo" not in settings:
        raise ValueError("--methods must include grpo: flat sampling's success names the levels")
    for policy in args.policy:
        todo = []
        for t in args.temperatures:
            for m in settings:
                path = level_path(out, label, m, policy, t)
                if not path.exists():
                    todo.append((m, t))
                    continue
                kept = {"budget_reserve": False, **json.loads(path.read_text())["settings"]}
                want = recorded_settings(settings[m], args)
                if kept != want:  # never mix two setups in one table
                    raise SystemExit(
                        f"{path} was measured with {kept}, not {want}: give these settings "
                        "another --out (or delete it to measure again)"
                    )
        print(f"[{time.strftime('%H:%M:%S')}] {label} {policy}: {len(todo)} runs to do", flush=True)
        if todo:
            measure_policy(args, settings, todo, policy)


def measure_policy(
    args: argparse.Namespace,
    settings: dict[str, dict[str, Any]],
    todo: list[tuple[str, float]],
    policy: str,
) -> None:
    """The `todo` (method, temperature) runs of one policy, on one engine."""
    out, label = Path(args.out), args.label
    path, warm = warm_recipe(policy)
    cfg = load_config(
        args.config,
        select={"env": args.env, "rollout": "patr", "scorer": args.scorer, "policy": path},
        overrides=[*args.set, *warm, f"seed={args.seed}"],
    )
    rt = Runtime(cfg, log=lambda s: print(s, flush=True))
    try:
        tasks = rt.load_tasks(args.tasks, split="eval")
        for k, (method, temperature) in enumerate(todo, 1):
            result = run_level(rt, method, settings[method], tasks, temperature, args, policy)
            result.update({"label": label, "tasks": len(tasks)})
            path = level_path(out, label, method, policy, temperature)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
            print(
                f"[{time.strftime('%H:%M:%S')}] {label} {k}/{len(todo)}: {method} "
                f"{policy_tag(policy)} T={temperature:g} success {result['success_rate']:.3f}, "
                f"informative {result['informative_share']:.3f}, "
                f"{result['env_steps_per_task']:.1f} steps/task ({result['wall_s']:.0f} s)",
                flush=True,
            )
    finally:
        rt.close()


PAIRS = (("patr", "tree-random"),)
"""Pairs compared task by task besides every method against `grpo`: PATR's scorer against
random branch points (and each variant against the controller it varies, `pairs`)."""


def pairs(runs: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """The pairs compared task by task among the measured methods (`runs`: a level file of each):
    every method against `grpo`, the `PAIRS`, and each variant against its controller."""
    variants = [(m, r["settings"].get("controller")) for m, r in runs.items()]
    return (
        [(m, "grpo") for m in runs if m != "grpo"]
        + list(PAIRS)
        + [(m, base) for m, base in variants if base in runs]
    )


def task_difference(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Per-task values x minus y over the same tasks: the mean difference and its standard error
    (sample std of the per-task differences / sqrt n; None for one task)."""
    d = [i - j for i, j in zip(x, y, strict=True)]
    n, mean = len(d), sum(d) / len(d)
    se = (sum((v - mean) ** 2 for v in d) / (n - 1) / n) ** 0.5 if n > 1 else None
    return {"diff": mean, "se": se, "tasks": n}


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Method a's outcome-informative share minus method b's, task by task over the same tasks
    (`task_difference`), and the tasks where only a's group, or only b's, holds both outcomes.
    None for runs measured before the per-task flags were kept."""
    x, y = a["counts"].get("mixed_by_task"), b["counts"].get("mixed_by_task")
    if not x or not y or len(x) != len(y):
        return None
    only_a = sum(i > j for i, j in zip(x, y, strict=True))
    only_b = sum(i < j for i, j in zip(x, y, strict=True))
    return {**task_difference(x, y), "only_a": only_a, "only_b": only_b}


def summarize(out: Path, merge: Sequence[Path] = ()) -> dict[str, Any]:
    """summary.json over every env and level found under `out` (and the levels of the earlier
    summaries in `merge`), and one plot per env; `paired` holds, per env and level, each method
    against GRPO (and the `PAIRS`) task by task (see `paired`)."""
    # label -> {"budget": N, "budget_reserve": bool | None, "levels": {(policy, T): ...}}
    envs: dict[str, dict[str, Any]] = {}
    for env_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        results: dict[str, dict[tuple[str, float], dict[str, Any]]] = {}
        budget = None
        for f in sorted(env_dir.glob("*/*.json")):
            r = json.loads(f.read_text())
            results.setdefault(r["method"], {})[(r["policy"], r["temperature"])] = r
            budget = r["settings"]["env_step_budget"]
        # one rule per directory (`measure` refuses a mix); a level file written before the
        # rule existed ran without the reserve
        reserve = {
            r["settings"].get("budget_reserve", False)
            for by_level in results.values()
            for r in by_level.values()
        }
        if len(reserve) > 1:
            raise SystemExit(f"{env_dir} holds levels with and without the budget reserve")
        base = {lv: r["success_rate"] for lv, r in results.get("grpo", {}).items()}
        if not base:
            continue
        compared = pairs({m: next(iter(by_level.values())) for m, by_level in results.items()})
        envs[env_dir.name] = {
            "budget": budget,
            "budget_reserve": reserve.pop(),
            "levels": {
                lv: {
                    "base_success": b,
                    "methods": {
                        m: {k: by_level[lv].get(k) for k in METRICS}
                        for m, by_level in results.items()
                        if lv in by_level
                    },
                    "paired": {
                        f"{a} - {b_}": paired(results[a][lv], results[b_][lv])
                        for a, b_ in compared
                        if lv in results.get(a, {}) and lv in results.get(b_, {})
                    },
                }
                for lv, b in base.items()
            },
        }
    for path in merge:
        merge_summary(envs, json.loads(path.read_text()), path)
    summary: dict[str, Any] = {
        "budget": {},
        "budget_reserve": {},
        "levels": {},
        "mechanism": {},
        "paired": {},
    }
    for label, env in sorted(envs.items()):
        levels = env["levels"]
        order = sorted(levels, key=lambda lv: (levels[lv]["base_success"], lv))
        summary["budget"][label] = env["budget"]
        summary["budget_reserve"][label] = env["budget_reserve"]
        summary["levels"][label] = [
            {"policy": p, "temperature": t, "base_success": levels[(p, t)]["base_success"]}
            for p, t in order
        ]
        methods = dict.fromkeys(m for lv in levels.values() for m in lv["methods"])
        mech: dict[str, Any] = {}
        for method in methods:
            lvs = [lv for lv in order if method in levels[lv]["methods"]]
            mech[method] = {
                "policy": [p for p, _ in lvs],
                "temperature": [t for _, t in lvs],
                "base_success": [levels[lv]["base_success"] for lv in lvs],
                **{k: [levels[lv]["methods"][method][k] for lv in lvs] for k in METRICS},
            }
        summary["mechanism"][label] = mech
        summary["paired"][label] = [
            {"policy": p, "temperature": t, **levels[(p, t)]["paired"]} for p, t in order
        ]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for label, mech in summary["mechanism"].items():
        plot(label, mech, out)
    return summary


def replicates(dirs: Sequence[Path]) -> dict[str, Any]:
    """Levels measured in several directories on the same tasks under different sampling seeds
    (`--sample-seed`), pooled: per env and level, each method's outcome-informative share in
    every replicate and their mean, and each method against GRPO (and the `PAIRS`) task by task
    on the per-task share over the replicates (a task counts 2/3 if two replicates of three held
    both outcomes), so its standard error holds the sampling's spread as well as the tasks'.
    Replicates must agree on everything but the sampling seed."""
    runs: dict[tuple[str, str, float], dict[str, list[dict[str, Any]]]] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("*/*/*.json")):
            r = json.loads(f.read_text())
            lv = (f.parent.parent.name, r["policy"], r["temperature"])
            runs.setdefault(lv, {}).setdefault(r["method"], []).append(r)
    out: dict[str, Any] = {}
    for (label, policy, temperature), by_method in sorted(runs.items()):
        shares, flags = {}, {}
        for method, rs in by_method.items():
            settings = [{k: v for k, v in r["settings"].items() if k != "sample_seed"} for r in rs]
            # None: measured without --sample-seed, so sampled under the task seed
            seeds = [r["settings"].get("sample_seed") for r in rs]
            tasks = {len(r["counts"]["mixed_by_task"]) for r in rs}
            if any(x != settings[0] for x in settings) or len(set(seeds)) < len(seeds):
                raise SystemExit(
                    f"{label} {policy} T={temperature:g} {method}: replicates must differ in "
                    f"the sampling seed alone (seeds {seeds})"
                )
            if len(tasks) != 1:
                raise SystemExit(f"{label} {policy} {method}: replicates on different task sets")
            shares[method] = {
                "seeds": seeds,
                "per_replicate": [r["outcome_informative_share"] for r in rs],
                "mean": sum(r["outcome_informative_share"] for r in rs) / len(rs),
                "success_rate": sum(r["success_rate"] for r in rs) / len(rs),
            }
            per_task = zip(*(r["counts"]["mixed_by_task"] for r in rs), strict=True)
            flags[method] = [sum(t) / len(rs) for t in per_task]
        diffs = {
            f"{a} - {b}": task_difference(flags[a], flags[b])
            for a, b in pairs({m: rs[0] for m, rs in by_method.items()})
            if a in flags and b in flags and len(flags[a]) == len(flags[b])
        }
        out.setdefault(label, []).append(
            {"policy": policy, "temperature": temperature, "methods": shares, "paired": diffs}
        )
    return out


def merge_summary(envs: dict[str, dict[str, Any]], earlier: dict[str, Any], path: Path) -> None:
    """The levels of an earlier summary.json joined into `envs` (as `summarize` builds it): a
    level measured twice, or an env at another budget or under the other budget rule, is
    refused rather than mixed in. A summary that does not record its rule (`None`: written
    before it was kept) joins on its budget alone."""
    for label, levels in earlier["levels"].items():
        budget = earlier["budget"][label]
        reserve = earlier.get("budget_reserve", {}).get(label)
        env = envs.setdefault(label, {"budget": budget, "budget_reserve": reserve, "levels": {}})
        if env["budget"] != budget:
            raise SystemExit(
                f"{path}: {label} was measured at {budget} env steps a task, not "
                f"{env['budget']}: levels of two budgets are not one table"
            )
        if reserve is not None and env["budget_reserve"] is not None:
            if reserve != env["budget_reserve"]:
                rules = {True: "with", False: "without"}
                raise SystemExit(
                    f"{path}: {label} was measured {rules[reserve]} the budget reserve, the "
                    f"other levels {rules[env['budget_reserve']]}: two budget rules are not "
                    "one table"
                )
        elif env["budget_reserve"] is None:
            env["budget_reserve"] = reserve
        mech = earlier["mechanism"][label]
        pairs = {
            (p["policy"], p["temperature"]): p for p in earlier.get("paired", {}).get(label, [])
        }
        for level in levels:
            lv = (level["policy"], level["temperature"])
            if lv in env["levels"]:
                raise SystemExit(f"{path}: {label} level {lv} is measured twice: merge it once")
            methods = {}
            for method, row in mech.items():
                for i, at in enumerate(zip(row["policy"], row["temperature"], strict=True)):
                    if at == lv:  # metrics an older summary lacks are None, as in the plot
                        methods[method] = {k: row[k][i] if k in row else None for k in METRICS}
            env["levels"][lv] = {
                "base_success": level["base_success"],
                "methods": methods,
                "paired": {
                    k: v for k, v in pairs.get(lv, {}).items() if k not in ("policy", "temperature")
                },
            }


def plot(label: str, mech: dict[str, Any], out: Path) -> None:
    """Informative shares against base success: a colour per method and, where the levels span
    several temperatures, a line per (method, temperature) through its policies (a line style
    per temperature), so a line never zigzags between temperatures."""
    try:  # deferred: matplotlib is only needed for the figure (the `view` extra)
        import matplotlib
    except ModuleNotFoundError:
        print(
            f"no plot for {label}: matplotlib is not installed (pip install 'agentree[view]'); "
            "summary.json holds every figure",
            flush=True,
        )
        return

    matplotlib.use("Agg")
    # deferred: pyplot after the backend is chosen
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    panels = (
        ("informative_share", "groups whose rewards differ"),
        ("outcome_informative_share", "groups with a success and a failure"),
    )
    temps = sorted({t for m in mech.values() for t in m["temperature"]})
    styles = dict(zip(temps, ["-", "--", ":", "-."] * len(temps), strict=False))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, m in enumerate(mech.values()):
            for t in temps:
                points = sorted(
                    (b, v)
                    for b, v, at in zip(m["base_success"], m[key], m["temperature"], strict=True)
                    if v is not None and at == t  # levels measured before a metric have none
                )
                if points:
                    ax.plot(
                        *zip(*points, strict=True), marker="o", color=f"C{i}", linestyle=styles[t]
                    )
        ax.set_xlabel("base success rate (flat sampling)")
        ax.set_title(f"{label}: {title}")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of groups (equal env steps per task)")
    # a legend entry per method (its colour) and, with several, per temperature (its style)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i}", marker="o", label=m) for i, m in enumerate(mech)]
    if len(temps) > 1:
        handles += [Line2D([], [], color="k", linestyle=styles[t], label=f"T={t:g}") for t in temps]
    axes[0].legend(handles=handles, fontsize="small", ncol=1 + (len(temps) > 1))
    fig.tight_layout()
    fig.savefig(out / f"{label}_mechanism.png", dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results directory (resumable)")
    ap.add_argument("--env", default=None, help="NAME or module:Class (default: the config's)")
    ap.add_argument("--scorer", default=None, help="NAME or module:Class (PATR and TSR use it)")
    ap.add_argument("--config", default=None, help="config NAME or FILE (default: the env's)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--label", default=None, help="the env's name in the results")
    ap.add_argument(
        "--policy",
        nargs="+",
        default=["tiny-warm"],
        help="tiny-warm, tiny, paths or hub ids; tiny-warm@P is the warm start built with "
        "policy.warm.expert_prob=P, tiny-warm@P,key=value,... with other policy.warm fields "
        "too (warm starts of other skill, each built once and cached)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="SUMMARY",
        help="summary.json files of earlier runs (same env labels and budgets) whose levels "
        "join this directory's in its summary and plots",
    )
    ap.add_argument(
        "--replicates",
        nargs="+",
        default=[],
        metavar="DIR",
        help="measure nothing: pool the levels of these --out directories (the same tasks, each "
        "under its own --sample-seed) into --out/replicates.json",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        help="controllers, and variants NEW_NAME=CONTROLLER (set with --method-set NEW_NAME.key=v)",
    )
    ap.add_argument("--method-set", action="append", default=[], help="METHOD.key=value")
    ap.add_argument("--budget", type=int, default=64, help="env steps per task, every method")
    ap.add_argument(
        "--budget-reserve",
        action="store_true",
        help="rollout.budget_reserve for every method: start only what the budget can finish",
    )
    ap.add_argument("--tasks", type=int, default=128, help="held-out tasks per level")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.4, 2.0, 3.0])
    ap.add_argument("--batch", type=int, default=32, help="tasks per rollout call")
    ap.add_argument("--seed", type=int, default=0, help="the tasks, and the sampling's default")
    ap.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="the sampling seed (engine and branch points) apart from --seed: replicates on the "
        "same tasks, each in its own --out",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    args = ap.parse_args(argv)
    if args.budget < 1:
        ap.error("--budget must be at least 1 env step per task")
    if args.label is None:
        name = args.env or load_config(args.config, overrides=args.set).component("env")[0]
        args.label = name.rsplit(":", 1)[-1].lower()
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replicates:  # measures nothing: no engine, no threads to set
        pooled = replicates([Path(d) for d in args.replicates])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "replicates.json").write_text(json.dumps(pooled, indent=1))
        for label, levels in pooled.items():
            for lv in levels:
                means = ", ".join(f"{m} {v['mean']:.3f}" for m, v in lv["methods"].items())
                print(f"{label} {lv['policy']} T={lv['temperature']:g}: {means}")
                for k, v in lv["paired"].items():
                    print(f"  {k}: {v['diff']:+.3f} +- {v['se']:.3f} ({v['tasks']} tasks)")
        return pooled
    before = 0
    if args.threads:
        # deferred: torch is heavy and only the engine needs it
        import torch

        # one thread per job where several jobs share a few cores: oversubscribed threads
        # slow every job down
        before = torch.get_num_threads()
        torch.set_num_threads(args.threads)
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        measure(args)
        summary = summarize(Path(args.out), [Path(m) for m in args.merge])
    finally:
        if before:
            torch.set_num_threads(before)
    for method, m in summary["mechanism"].get(args.label, {}).items():
        cells = ", ".join(
            f"{b:.2f}->{s:.2f}"
            for b, s in zip(m["base_success"], m["informative_share"], strict=True)
        )
        print(f"{args.label} {method:<12} base success -> informative share: {cells}")
    return summary


if __name__ == "__main__":
    main()
