"""The warm SWE policy on held-out generated tasks: well-formed actions, pass@1 and pass@k.

Runs `agentree eval --env swebench` as a user would, then reads the eval directory: the share of
actions that hold exactly one bash block (the env's format check), what the well-formed
commands were (their first word), and the resolved rates. `--offline N` also samples the
policy's action at every turn of the expert's conversations on N held-out tasks (no containers),
and `--match N` asks it greedily and counts, per turn, the answers that are exactly the expert's
command (copying the function name, the path and the line numbers right). `--no-docker` runs
only those two. The episodes in Docker are also read for where they break: how many grep the
definition around the bug, list its file, edit its line, make the fix, and submit
(`expert.episode_stages`).

    python benchmarks/swe_warm_policy.py --tasks gen/tasks.heldout.jsonl --policy DIR --samples 2
    python benchmarks/swe_warm_policy.py --tasks gen/tasks.heldout.jsonl --policy DIR \
        --config swebench_patr_smollm2 --samples 2 --max-tokens 96 \
        --chunk 10 --keep DIR                          # a SmolLM2 warm policy, resumable
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from agentree.signals import interrupt_on_sigterm, run_child


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", required=True, help="held-out generated tasks (JSONL)")
    ap.add_argument("--policy", required=True, help="the warm SWE policy directory")
    ap.add_argument(
        "--config",
        default="swebench_patr",
        help="the run's config (swebench_patr_smollm2 for a SmolLM2 policy: its context size)",
    )
    ap.add_argument("--n", type=int, default=0, help="first N tasks only (0: all)")
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="evaluate N tasks at a time, each chunk kept under --keep and reused on a rerun",
    )
    ap.add_argument("--samples", type=int, default=2, help="samples per task (pass@k)")
    ap.add_argument("--step-limit", type=int, default=12, help="actions per episode")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per action")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--offline", type=int, default=0, help="also the offline rate on N tasks")
    ap.add_argument("--match", type=int, default=0, help="also greedy per-turn match on N tasks")
    ap.add_argument("--no-docker", action="store_true", help="skip the episodes in Docker")
    ap.add_argument("--keep", help="keep the eval directory here")
    args = ap.parse_args()
    if not args.no_docker:
        episodes(args)
    records = [json.loads(x) for x in Path(args.tasks).read_text().splitlines() if x.strip()]
    if args.offline:
        from agentree.swe.expert import well_formed_rate

        rate, n = well_formed_rate(
            args.policy, records[: args.offline], max_new_tokens=args.max_tokens
        )
        print(f"offline, on the expert's contexts: {n} actions, {100 * rate:.1f}% well-formed")
    if args.match:
        from agentree.swe.expert import turn_match

        match = turn_match(args.policy, records[: args.match], max_new_tokens=args.max_tokens)
        print(
            "greedy, exactly the expert's command: "
            + ", ".join(f"{t} {hit}/{n}" for t, (hit, n) in match.items())
        )


def episodes(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="agentree-bench-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        lines = [x for x in Path(args.tasks).read_text().splitlines() if x.strip()]
        lines = lines[: args.n] if args.n else lines
        size = args.chunk or len(lines)
        chunks = [lines[i : i + size] for i in range(0, len(lines), size)]
        summaries = []
        for c, chunk in enumerate(chunks):  # a chunk already evaluated under --keep is reused
            where = out / (f"chunk{c:03d}" if args.chunk else ".")
            if not (where / "eval" / "eval.json").exists():
                print(f"chunk {c + 1}/{len(chunks)}: {len(chunk)} tasks", flush=True)
                evaluate_chunk(args, chunk, where)
            summaries.append(json.loads((where / "eval" / "eval.json").read_text())["summary"])
        actions, bad, first = 0, 0, Counter()
        for f in sorted(out.glob("chunk*/eval/trees/*.json")) + sorted(out.glob("eval/trees/*")):
            for node in json.loads(f.read_text())["nodes"]:
                env = (node.get("info") or {}).get("env") or {}
                if "action_key" not in env:
                    continue
                actions += 1
                if env.get("format_error"):
                    bad += 1
                else:
                    first[(env["action_key"].split() or ["?"])[0]] += 1
    tasks = sum(s["tasks"] for s in summaries)
    pass1 = sum(s["success_rate"] * s["tasks"] for s in summaries) / max(tasks, 1)
    passk = sum(s["pass_at_k"] * s["tasks"] for s in summaries) / max(tasks, 1)
    well = 1 - bad / max(actions, 1)
    print(
        f"{tasks} tasks x {args.samples} samples: {actions} actions, "
        f"{100 * well:.1f}% well-formed; resolved pass@1 {100 * pass1:.1f}%, "
        f"pass@{args.samples} {100 * passk:.1f}%"
    )
    print("commands: " + ", ".join(f"{k} {v}" for k, v in first.most_common(8)))
    stages(args, sorted(out.glob("chunk*/eval/trees/*.json")) + sorted(out.glob("eval/trees/*")))


def stages(args: argparse.Namespace, trees: list[Path]) -> None:
    """Where the episodes break: the share that reached each of the expert's steps
    (`expert.episode_stages`), over every sampled episode (a root-to-leaf path)."""
    from agentree.swe.expert import STAGES, episode_stages
    from agentree.tree import Tree

    records = {}
    for line in Path(args.tasks).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            records[r["instance_id"]] = r
    reached, episodes = Counter(), 0
    for f in trees:
        tree = Tree.load(f)
        for leaf in tree.leaves():
            commands = [c for n in tree.path(leaf.id) for c in node_commands(n)]
            got = episode_stages(records[tree.task_id], commands)
            reached.update(k for k, v in got.items() if v)
            episodes += 1
    print(
        f"episodes reaching the expert's steps (of {episodes}): "
        + ", ".join(f"{k} {reached[k]}" for k in STAGES)
    )


def node_commands(node: Any) -> list[str]:
    """The shell commands of one turn, for `episode_stages`: its bash blocks (text mode), or its
    `execute_bash` commands and a `submit` as the submission's echo (tool mode, read from the
    calls the rollout recorded)."""
    from agentree.envs.swe.env import SENTINEL, parse_commands

    calls = node.info.get("tool_calls")
    if calls is None:
        return parse_commands(node.action or "")
    commands = []
    for call in calls:
        if call["name"] == "execute_bash":
            commands.append(str((call.get("arguments") or {}).get("command", "")))
        elif call["name"] == "submit":
            commands.append(f"echo {SENTINEL}")
    return commands


def evaluate_chunk(args: argparse.Namespace, lines: list[str], where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    tasks = where / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable, "-m", "agentree", "eval", "--config", args.config,
        "--tasks", str(tasks), "--policy", args.policy, "--samples", str(args.samples),
        "--output", str(where / "eval"), "--set", f"env.step_limit={args.step_limit}",
        "--set", f"engine.max_tokens={args.max_tokens}",
    ]  # fmt: skip
    for s in args.set:
        cmd += ["--set", s]
    run_child(cmd, check=True)


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the episodes and removes the directory
        main()
