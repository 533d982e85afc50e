"""Shared-prefix compute of the token-level tree samplers versus independent sampling.

On the same prompts and with the same number of final trajectories per prompt, runs
stochastic sampling (the flat `grpo` controller), LATR, TreePO and EPTree through the same
transformers engine and reports, per method: forward tokens (every token the model computed:
prompt prefill plus tokens fed back while decoding; prefix-cache hits excluded), sampled
tokens, wall time, trajectories/s, trajectory tokens/s and the distinct final answers per
group. The prefix cache is cleared before each method so none inherits another's prompts.

A second table compares EPTree's leaf count with independent chains at an equal generated-token
budget, next to TreeRL's Theorem 1. The theorem assumes fixed generation lengths (a
continuation forked at relative position x runs for the remaining 1 - x), so EPTree runs with
`continuation: remaining` by default (`--eptree-continuation full` gives every continuation the
whole `max_tokens`, as the released code does): no leaf is longer than the response it forks
from. Independent chains are as long as EPTree's own first chains, which are independent
samples of the same policy. With one iteration the measured ratio is then (1 + NT) / (1 + NT c),
c the mean continuation length over the chain length (`cont/chain`); the theorem's uniform fork
points give c = 1/2, so c shows how far a real policy's fork points are from that assumption.

The default policy is the env's tiny policy, briefly fine-tuned on the env's well-formed
answers (`--warmup-steps`) so that its next-token distributions have the peaks and forks of a
trained model; an untrained one is nearly uniform and never passes LATR's thresholds. On a GPU,
pass `--policy PATH` (a chat checkpoint; `--warmup-steps 0` is then the default).

    python benchmarks/token_tree_compute.py --env countdown --prompts 8 --group 8
    python benchmarks/token_tree_compute.py --env countdown --prompts 8 --theorem1-only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentree.chat import ChatFormat
from agentree.engines.base import SamplingParams
from agentree.engines.hf import HFEngine
from agentree.envs.base import Task, env_class
from agentree.hub.load import load_policy
from agentree.hub.store import cache_root
from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env
from agentree.rollout.base import Controller, RolloutContext
from agentree.rollout.token.eptree import THEOREM1_BOUNDS, EPTree, EPTreeConfig, theorem1_ratio
from agentree.rollout.token.latr import LATR, LATRConfig
from agentree.rollout.token.tokentree import response_ids
from agentree.rollout.token.treepo import TreePO, TreePOConfig
from agentree.rollout.turn.flat import FlatConfig, FlatGRPO
from agentree.tree import Tree


# -- policy ------------------------------------------------------------------------------------
def warm_policy(env_name: str, base: Path, steps: int, seed: int) -> Path:
    """Fine-tune the tiny policy on the env's example answers; cached by its inputs."""
    key = hashlib.sha256(json.dumps([str(base), env_name, steps, seed, 1]).encode()).hexdigest()
    out = cache_root() / "warm" / key[:16]
    if (out / "config.json").exists():
        return out
    model, tok = load_policy(base, device="cpu")
    chat = ChatFormat(tok)
    env = env_class(env_name)()
    rng = random.Random(seed)
    pairs = []
    for task in env_class(env_name).generate_tasks(256, seed=seed, split="train"):
        obs, _ = env.reset(seed=task.seed, options=task.options)
        prompt = chat.prompt_ids(obs, env.system_prompt)
        for action in env.example_actions():
            pairs.append((prompt, [*chat.encode(action), chat.end_of_turn_id]))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    torch.manual_seed(seed)
    for _ in range(steps):
        batch = rng.sample(pairs, 16)
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((16, width), tok.pad_token_id)
        attn = torch.zeros(16, width, dtype=torch.long)
        labels = torch.full((16, width), -100)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            attn[i, : len(p) + len(a)] = 1
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# -- one method --------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    prompts: int
    trajectories: float
    """Per prompt."""
    forward: int
    prompt_tokens: int
    """Prompt tokens; every method prefills each prompt once, the rest is decoding."""
    generated: int
    traj_tokens: int
    """Response tokens over every trajectory of every group (what the trainer receives)."""
    wall_s: float
    distinct: float
    reward: float
    mean_len: float
    copies: float
    """Trajectories per prompt that copy another (LATR padding), not sampled."""
    calls: int
    """Engine calls (`generate` or decode sessions) the rollout made."""

    @property
    def decode(self) -> int:
        """Forward tokens beyond the prompts' prefill."""
        return self.forward - self.prompt_tokens


def answer_key(info: dict[str, Any]) -> str | None:
    """Countdown: the answer's evaluated value (LATR §5.1); math: the boxed answer."""
    if info.get("value") is not None:
        return str(info["value"])
    return None if info.get("answer") is None else str(info["answer"]).strip()


def timed_rollout(
    controller: Controller, engine: HFEngine, ctx: RolloutContext, tasks: list[Task], seed: int
) -> tuple[list[Tree], int, float, int]:
    """(trees, forward tokens, wall seconds, engine calls) of one rollout from a cold prefix
    cache."""
    engine.prefix_cache.clear()
    engine.seed(seed)
    ctx.rng = random.Random(seed)
    before = engine.stats.snapshot()
    t0 = time.perf_counter()
    trees, _ = controller.rollout(tasks, ctx)
    wall = time.perf_counter() - t0
    after = engine.stats.snapshot()
    forward = after["tokens_forward"] - before["tokens_forward"]
    return trees, forward, wall, after["calls"] - before["calls"]


def summarize(
    name: str,
    controller: Controller,
    trees: list[Tree],
    forward: int,
    walls: list[float],
    calls: int,
) -> Result:
    groups = [controller.group(t) for t in trees]
    flat = [t for g in groups for t in g]
    leaves = [(tree, t.leaf) for tree, g in zip(trees, groups, strict=True) for t in g]
    distinct = [
        len({k for t in g if (k := answer_key(tree.nodes[t.leaf].info.get("env", {})))})
        for tree, g in zip(trees, groups, strict=True)
    ]
    return Result(
        name=name,
        prompts=len(trees),
        trajectories=len(flat) / len(trees),
        forward=forward,
        prompt_tokens=sum(len(t.root.obs_ids) for t in trees),
        generated=sum(
            len(n.action_ids) for t in trees for n in t.nodes[1:] if "copy_of" not in n.info
        ),
        traj_tokens=sum(t.num_policy_tokens for t in flat),
        wall_s=min(walls),
        distinct=sum(distinct) / len(distinct),
        reward=sum(t.reward for t in flat) / len(flat),
        mean_len=sum(t.num_policy_tokens for t in flat) / len(flat),
        copies=sum("copy_of" in tree.nodes[leaf].info for tree, leaf in leaves) / len(trees),
        calls=calls,
    )


def bench(
    methods: list[tuple[str, Controller]],
    engine: HFEngine,
    ctx: RolloutContext,
    tasks: list[Task],
    repeats: int,
    seed: int,
) -> list[Result]:
    """Token counts from the first run (seeded); wall time is the best of `repeats` runs, the
    methods taking turns so that a change in machine load hits every method alike."""
    runs: dict[str, list[tuple[list[Tree], int, float, int]]] = {name: [] for name, _ in methods}
    for r in range(repeats):
        for name, controller in methods:
            runs[name].append(timed_rollout(controller, engine, ctx, tasks, seed + 1000 * r))
    out = []
    for name, controller in methods:
        trees, forward, _, calls = runs[name][0]
        walls = [wall for _, _, wall, _ in runs[name]]
        out.append(summarize(name, controller, trees, forward, walls, calls))
    return out


def print_table(results: list[Result]) -> None:
    base = results[0]
    head = (
        f"{'method':<15}{'traj/prompt':>12}{'forward tok':>12}{'vs stoch':>9}{'decode fwd':>11}"
        f"{'vs stoch':>9}{'sampled':>9}"
        f"{'wall s':>8}{'vs stoch':>9}{'traj/s':>8}{'tok/s':>8}{'answers':>8}{'copies':>7}"
        f"{'reward':>8}{'calls':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.name:<15}{r.trajectories:>12.1f}{r.forward:>12d}{r.forward / base.forward:>9.2f}"
            f"{r.decode:>11d}{r.decode / base.decode:>9.2f}"
            f"{r.generated:>9d}{r.wall_s:>8.2f}{r.wall_s / base.wall_s:>9.2f}"
            f"{r.trajectories * r.prompts / r.wall_s:>8.1f}"
            f"{r.traj_tokens / r.wall_s:>8.0f}{r.distinct:>8.2f}{r.copies:>7.1f}{r.reward:>8.3f}"
            f"{r.calls:>7d}"
        )


# -- TreeRL Theorem 1 --------------------------------------------------------------------------
def first_chains(controller: Controller, tree: Tree) -> list[int]:
    """Response lengths of EPTree's M first chains (leaves reached without a continuation)."""
    out = []
    for t in controller.group(tree):
        path = tree.path(t.leaf)[1:]
        if not any("iteration" in n.info.get("eptree", {}) for n in path):
            out.append(len(response_ids(tree, t.leaf)))
    return out


def theorem1_table(
    engine: HFEngine,
    ctx: RolloutContext,
    tasks: list[Task],
    settings: list[tuple[int, int, int, int]],
    continuation: str,
    seed: int,
) -> None:
    low, high = THEOREM1_BOUNDS
    print(
        f"\nEPTree leaves vs independent chains at equal generated tokens (continuation: "
        f"{continuation}; chains as long as EPTree's first chains)"
    )
    head = (
        f"{'(M,N,L,T)':<14}{'leaves':>8}{'tokens':>9}{'chain len':>10}{'cont/chain':>11}"
        f"{'chains@=tok':>12}{'ratio':>8}{'Thm 1':>8}  bounds [{low:.3f}, {high:.3f})"
    )
    print(head)
    print("-" * len(head))
    for m, n, iters, t in settings:
        ep = EPTree(EPTreeConfig(M=m, N=n, L=iters, T=t, continuation=continuation))  # type: ignore[arg-type]
        trees, *_ = timed_rollout(ep, engine, ctx, tasks, seed)
        firsts = [x for tree in trees for x in first_chains(ep, tree)]
        generated = sum(
            len(nd.action_ids)
            for tree in trees
            for nd in tree.nodes[1:]
            if "copy_of" not in nd.info
        )
        leaves = sum(len(ep.group(tree)) for tree in trees) / len(tasks)
        chain_len = sum(firsts) / len(firsts)
        continuations = leaves * len(tasks) - len(firsts)
        cont_len = (generated - sum(firsts)) / max(continuations, 1)
        tokens = generated / len(tasks)
        chains = tokens / chain_len
        theory = theorem1_ratio(n, t, iters)
        shown = f"{theory:>8.3f}" if theory is not None else f"{'-':>8}"
        print(
            f"{(m, n, iters, t)!s:<14}{leaves:>8.1f}{tokens:>9.1f}{chain_len:>10.1f}"
            f"{cont_len / chain_len:>11.3f}{chains:>12.2f}{leaves / chains:>8.3f}{shown}"
        )


# -- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="countdown", choices=["countdown", "math"])
    ap.add_argument("--policy", default="tiny", help="tiny, or a chat checkpoint path")
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="fine-tuning steps for the tiny policy (default 300; 0 for PATH)",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="final trajectories per prompt")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--segment", type=int, default=16, help="TreePO segment length l")
    ap.add_argument("--eptree", default="2,3,1,1", help="M,N,L,T with M(1+NLT) = group")
    ap.add_argument(
        "--eptree-continuation",
        default="remaining",
        choices=["remaining", "full"],
        help="continuation budget: what the forked response had left (Theorem 1's fixed-length "
        "setting) or max_tokens (released code)",
    )
    ap.add_argument(
        "--latr-loose",
        default="0.1,0.1",
        help="tau_abs,tau_rel of an extra LATR row with looser thresholds ('none' to skip): "
        "a small policy rarely puts > 0.25 on a second token, so the paper's thresholds "
        "leave its trees narrow and padded",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the best is shown")
    ap.add_argument(
        "--theorem1-only", action="store_true", help="skip the method table, run only Theorem 1's"
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build_context(args: argparse.Namespace) -> tuple[Path, HFEngine, RolloutContext]:
    if args.policy == "tiny":
        path = tiny_policy_for_env(args.env, {}, TinyModelConfig())
        steps = 300 if args.warmup_steps is None else args.warmup_steps
    else:
        path, steps = Path(args.policy), args.warmup_steps or 0
    if steps:
        path = warm_policy(args.env, path, steps, args.seed)
    engine = HFEngine.from_pretrained(path, seed=args.seed)
    chat = ChatFormat(engine.tokenizer)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stop_token_ids=chat.stop_token_ids,
    )
    ctx = RolloutContext(
        engine=engine,
        chat=chat,
        sampling=sampling,
        env_factory=env_class(args.env),
        max_context=engine.max_model_len,
    )
    return path, engine, ctx


def make_methods(args: argparse.Namespace) -> list[tuple[str, Controller]]:
    """Every sampler at the same group size; paper settings except where the CLI says."""
    g = args.group
    m, n, iters, t = (int(x) for x in args.eptree.split(","))
    if m * (1 + n * iters * t) != g:
        raise SystemExit(f"--eptree {args.eptree} gives {m * (1 + n * iters * t)} leaves, not {g}")
    depth = math.ceil(args.max_tokens / args.segment)
    cont = args.eptree_continuation
    methods: list[tuple[str, Controller]] = [
        ("stochastic", FlatGRPO(FlatConfig(G=g))),
        ("latr", LATR(LATRConfig(k=g))),  # paper thresholds, eta = 1 (training step 0)
        ("treepo", TreePO(TreePOConfig(w=g, d=depth, l=args.segment, b=2))),
        ("eptree", EPTree(EPTreeConfig(M=m, N=n, L=iters, T=t, continuation=cont))),
    ]
    if args.latr_loose != "none":
        tau_abs, tau_rel = (float(x) for x in args.latr_loose.split(","))
        loose = LATR(LATRConfig(k=g, tau_abs=tau_abs, tau_rel=tau_rel))
        methods.insert(2, (f"latr {tau_abs:g}/{tau_rel:g}", loose))
    return methods


def main() -> None:
    args = parse_args()
    path, engine, ctx = build_context(args)
    tasks = env_class(args.env).generate_tasks(args.prompts, seed=args.seed, split="eval")
    print(
        f"policy {path} | env {args.env} | {len(tasks)} prompts x {args.group} trajectories | "
        f"max {args.max_tokens} tokens | T={args.temperature} | EPTree continuation "
        f"{args.eptree_continuation} | torch threads "
        f"{torch.get_num_threads()} | device {engine.device}\n"
    )
    m, n, iters, t = (int(x) for x in args.eptree.split(","))
    settings = [(m, n, iters, t), (4, 1, 1, 1), (2, 2, 1, 2), (2, 2, 2, 1)]
    if args.theorem1_only:
        theorem1_table(engine, ctx, tasks, settings, args.eptree_continuation, args.seed)
        return
    results = bench(make_methods(args), engine, ctx, tasks, args.repeats, args.seed)
    print_table(results)
    print(f"(wall s: best of {args.repeats} runs per method, the methods taking turns)")
    base = results[0]
    print(
        "\nforward tokens saved vs stochastic (all / decode only): "
        + ", ".join(
            f"{r.name} {1 - r.forward / base.forward:.0%} / {1 - r.decode / base.decode:.0%}"
            for r in results[1:]
        )
    )
    theorem1_table(engine, ctx, tasks, settings, args.eptree_continuation, args.seed)


if __name__ == "__main__":
    main()
