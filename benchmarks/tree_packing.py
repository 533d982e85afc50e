"""Tree-packed versus padded policy updates on real rollout trees, in one run.

Rolls out trees with the tiny policy for five cases (PATR on FrozenLake and on the local SWE
suite in Docker, LATR / TreePO / EPTree on Countdown), then for each case runs the same
`PolicyUpdate` (advantages, KL to a reference, gradient accumulation, one AdamW step) with
`train.packing=padded` and `train.packing=tree` and reports, packed / padded:

- tokens_ratio: tokens the model forwards (row padding included) per update;
- wall_ratio: update wall time (median of `--repeats`, micro-batch building included);
- max_grad_diff: the largest |difference| of any parameter's accumulated gradient.

    python benchmarks/tree_packing.py --out tree_packing.json
    python benchmarks/tree_packing.py --cases countdown_latr --tasks 4 --max-tokens 128

Untrained tiny policies seldom pass LATR's thresholds, so they are loosened as in the tests.
`swe_patr` needs Docker and the local images (`agentree swe build-local`).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentree.algorithms.loss import loss_normalizer, policy_loss
from agentree.algorithms.packing import (
    attention_break_even,
    batch_logprobs,
    choose_layout,
    layout_cost,
)
from agentree.config import load_config
from agentree.learner.update import PolicyUpdate
from agentree.run.runtime import Runtime

CASES: dict[str, tuple[str | None, dict[str, str], list[str]]] = {
    "frozenlake_patr": ("frozenlake_patr", {}, ["env.max_turns=10", "rollout.K=5"]),
    "countdown_latr": (
        None,
        {"env": "countdown", "rollout": "latr"},
        ["rollout.k=8", "rollout.tau_abs=0.01", "rollout.tau_rel=0.03"],
    ),
    "countdown_treepo": (
        None,
        {"env": "countdown", "rollout": "treepo"},
        ["rollout.w=8", "rollout.d=4", "rollout.l=16"],
    ),
    "countdown_eptree": (
        None,
        {"env": "countdown", "rollout": "eptree"},
        ["rollout.M=2", "rollout.N=3", "rollout.L=1", "rollout.T=2"],
    ),
    # CPU-sized: 4 turns per branch, branching after 2, contexts cut at 2048 tokens.
    "swe_patr": (
        "swebench_patr",
        {},
        ["env.step_limit=4", "rollout.K=2", "engine.max_context=2048", "engine.env_workers=2"],
    ),
}


def rollout(name: str, tasks: int, max_tokens: int | None) -> tuple[Runtime, list, list]:
    cfg_name, select, overrides = CASES[name]
    extra = [] if max_tokens is None else [f"engine.max_tokens={max_tokens}"]
    cfg = load_config(cfg_name, select=select, overrides=overrides + extra)
    rt = Runtime(cfg, log=lambda m: None)
    trees, _ = rt.rollouts.rollout(rt.load_tasks(tasks, split="train"))
    groups = [rt.controller.group(t) for t in trees]
    keep = [(t, g) for t, g in zip(trees, groups, strict=True) if g]
    return rt, [k[0] for k in keep], [k[1] for k in keep]


def gradients(model: Any, micro: list, tc: Any, ref: Any) -> dict[str, torch.Tensor]:
    """The accumulated gradient of one optimiser step (on-policy, KL to `ref`)."""
    model.zero_grad(set_to_none=True)
    norm = sum(loss_normalizer(b.mask, tc.loss_agg, b.seq_tokens) for b in micro)
    for b in micro:
        lp = batch_logprobs(model, b, 1.0)
        with torch.no_grad():
            ref_lp = batch_logprobs(ref, b, 1.0)
        loss, _ = policy_loss(
            lp,
            lp.detach(),
            b.adv,
            b.mask,
            eps_low=tc.eps_low,
            eps_high=tc.eps_high,
            agg=tc.loss_agg,
            ref_logprobs=ref_lp,
            kl_coef=0.05,
            normalizer=norm,
            seq_tokens=b.seq_tokens,
        )
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def perturbed(model: Any, scale: float) -> Any:
    """A noisy copy of the policy: a reference whose KL gradient is not zero."""
    other = copy.deepcopy(model).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    rt, trees, groups = rollout(name, args.tasks, args.max_tokens)
    rollout_s = time.perf_counter() - t0
    base = copy.deepcopy(rt.model).float()
    rt.close()
    ref = perturbed(base, 0.02)
    tc0 = rt.cfg.train.model_copy(update={"kl_coef": max(rt.cfg.train.kl_coef, 1e-3)})
    # The untrained policy mostly earns equal rewards (zero advantages): the gradient check
    # uses seeded random per-trajectory advantages of both signs instead.
    g = torch.Generator().manual_seed(0)
    advs = [
        [[float(torch.randn(1, generator=g))] * len(t.token_ids) for t in grp] for grp in groups
    ]
    kappa = attention_break_even(base)
    upd: dict[str, PolicyUpdate] = {}
    out: dict[str, dict[str, Any]] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for packing in ("padded", "tree"):
        tc = tc0.model_copy(update={"packing": packing})
        upd[packing] = PolicyUpdate(copy.deepcopy(base), tc, ref=ref, pad_id=0)
        micro = choose_layout(groups, advs, 0, tc.micro_batch_size, packing, kappa)
        grads[packing] = gradients(upd[packing].model, micro, tc, ref)
        out[packing] = {
            "tokens": sum(int(b.ids.numel()) for b in micro),
            "micro_batches": len(micro),
            "rows": sum(int(b.ids.shape[0]) for b in micro),
            "longest_row": max(int(b.ids.shape[1]) for b in micro),
            "cost_estimate": layout_cost(micro, kappa),
            "walls": [],
        }
    # Alternate the layouts so that load from other processes hits both alike.
    for _ in range(args.repeats):
        for packing in ("padded", "tree"):
            upd[packing].model.load_state_dict(base.state_dict())
            t = time.perf_counter()
            upd[packing](trees, groups, lr=1e-6)
            out[packing]["walls"].append(time.perf_counter() - t)
    for o in out.values():
        o["wall_s"] = statistics.median(o["walls"])
    trajs = [t for grp in groups for t in grp]
    diff = max(float((grads["tree"][n] - x).abs().max()) for n, x in grads["padded"].items())
    scale = max(float(x.abs().max()) for x in grads["padded"].values())
    return {
        "tokens_ratio": out["tree"]["tokens"] / out["padded"]["tokens"],
        "wall_ratio": out["tree"]["wall_s"] / out["padded"]["wall_s"],
        "max_grad_diff": diff,
        "max_grad": scale,
        "trees": len(trees),
        "trajectories": len(trajs),
        "trajectory_tokens": sum(len(t.token_ids) for t in trajs),
        "longest_trajectory": max(len(t.token_ids) for t in trajs),
        "padded": out["padded"],
        "packed": out["tree"],
        "auto_picks": "tree"
        if out["tree"]["cost_estimate"] < out["padded"]["cost_estimate"]
        else "padded",
        "rollout_s": rollout_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--tasks", type=int, default=2, help="trees (tasks) per case")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per response")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per layout")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict[str, Any] = {"cases": {}, "args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.cases:
        result["cases"][name] = r = run_case(name, args)
        print(
            f"{name:18s} trajectories {r['trajectories']:3d}  tokens_ratio "
            f"{r['tokens_ratio']:.3f}  wall_ratio {r['wall_ratio']:.3f}  "
            f"(padded {r['padded']['wall_s']:.2f}s, packed {r['packed']['wall_s']:.2f}s)  "
            f"max_grad_diff {r['max_grad_diff']:.2e}",
            flush=True,
        )
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
