"""One prepared check for a GPU machine: engine, rollout, update and FSDP2 on the accelerator.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--out FILE.json]

Written for a machine with torch, transformers, peft and accelerate but no network and no vLLM,
to which no checkpoint can be copied: the large model is a random-initialised causal LM built
from a Qwen2.5-0.5B-shaped config (24 layers, 896 wide, 14 query / 2 KV heads, vocabulary
151936), the small one the tiny FrozenLake policy built locally. In one run (under 8 minutes on
an H100) it measures

1. `generation`: the transformers engine (`HFEngine`) on the Qwen2.5-shaped model in bf16,
   generated tokens/s at batch 1 and batch 32;
2. `patr`: a PATR rollout on FrozenLake with the tiny policy on the device (paper defaults, BFS
   scorer): trajectories, forks, generated tokens/s;
3. `grpo_update`: one GRPO loss forward + backward of the Qwen2.5-shaped model under bf16
   autocast on those trees (rewards set so the advantages are not all zero), in the padded and
   the tree-packed layout: policy tokens/s, peak memory, and the relative difference of the two
   layouts' gradients (equal up to bf16 rounding);
4. `fsdp2`: the same model saved and loaded by the learner's FSDP2 path on one rank
   (`train.fsdp=true`, `train.dtype=bf16`), one update: wall time, loss, peak memory.

It prints one JSON summary (and writes it to `--out`). `--device cpu` runs the same steps with
small shapes (a 2-layer, 64-wide model, short generations), which is how the test suite runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from agentree.signals import interrupt_on_sigterm

QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""Qwen2.5-0.5B's shape (its config.json), the weights drawn at random."""

SMALL = {
    **QWEN25_05B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The CPU run's shape: the same architecture, small enough for a test."""

GEN_TOKENS = {"cuda": 128, "cpu": 8}
PROMPT_TOKENS = {"cuda": 256, "cpu": 16}
PATR_TASKS = {"cuda": 8, "cpu": 1}
PATR_SHORT = ["env.max_turns=3", "engine.max_tokens=8", "rollout.K=2"]
"""The CPU run's rollout: short turns and episodes (the paper's K=5, 10 turns on a GPU)."""


def build_model(device: torch.device, dtype: torch.dtype) -> Any:
    """A random-initialised Qwen2 causal LM of the check's shape (no download)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = QWEN25_05B if device.type == "cuda" else SMALL
    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def peak_memory_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def device_label(device: torch.device) -> str:
    """The device as a summary names it: the GPU's model, or `cpu`."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def emit(summary: dict[str, Any], out: Path | None) -> None:
    """Print the JSON summary, and write it to `out` when given."""
    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_generation(model: Any, tokenizer: Any, device: torch.device) -> dict[str, Any]:
    """Generated tokens/s of the transformers engine at batch 1 and 32 (random prompts)."""
    from agentree.engines.base import SamplingParams
    from agentree.engines.hf import HFEngine

    engine = HFEngine(model, tokenizer, seed=0, prefix_cache_mb=0)
    new, plen = GEN_TOKENS[device.type], PROMPT_TOKENS[device.type]
    gen = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"prompt_tokens": plen, "max_tokens": new}
    for batch in (1, 32):
        prompts = torch.randint(10, 500, (batch, plen), generator=gen).tolist()
        params = SamplingParams(max_tokens=new, temperature=1.0)
        # warm-up of the same shapes: kernels, allocator, attention and cuBLAS heuristics (a
        # cold first call cost 2.5x the warm one per step on an H200)
        engine.generate(prompts, params)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        comps = engine.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - t0
        tokens = sum(len(c[0].token_ids) for c in comps)
        out[f"batch{batch}"] = {
            "generated_tokens": tokens,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "peak_memory_mb": peak_memory_mb(device),
        }
    engine.close()
    return out


def check_patr(device: torch.device) -> tuple[dict[str, Any], list[Any], list[Any], Any]:
    """A PATR rollout on FrozenLake with the tiny policy on `device`; returns its trees."""
    from agentree.config import load_config
    from agentree.run.runtime import Runtime

    cfg = load_config(
        "frozenlake_patr",
        overrides=[
            "policy.path=tiny",
            f"policy.device={device.type}",
            "seed=0",
            *(PATR_SHORT if device.type == "cpu" else []),
        ],
    )
    t0 = time.perf_counter()
    rt = Runtime(cfg, log=lambda m: None)
    startup = time.perf_counter() - t0
    try:
        tasks = rt.load_tasks(PATR_TASKS[device.type])
        sync(device)
        t1 = time.perf_counter()
        trees, stats = rt.rollouts.rollout(tasks)
        sync(device)
        wall = time.perf_counter() - t1
        groups = [rt.controller.group(t) for t in trees]
        tokenizer = rt.tokenizer
    finally:
        rt.close()
    n = sum(len(g) for g in groups)
    out = {
        "tasks": len(tasks),
        "startup_s": round(startup, 2),
        "wall_s": round(wall, 3),
        "trajectories": n,
        "forks": stats.forks,
        "generated_tokens": stats.policy_tokens_generated,
        "tokens_per_s": round(stats.policy_tokens_generated / wall, 1),
        "trajectories_per_s": round(n / wall, 2),
    }
    return out, trees, groups, tokenizer


def informative(groups: list[list[Any]]) -> None:
    """Give every group differing rewards (the random tiny policy rarely wins), so the GRPO
    advantages and hence the gradients are not all zero."""
    for g in groups:
        for i, t in enumerate(g):
            t.reward = float(i % 2)


def loss_grads(model: Any, micro: list[Any], device: torch.device, upd: Any) -> dict[str, Any]:
    """One GRPO loss forward + backward over `micro` under bf16 autocast, each micro-batch's
    term as the update computes it (`PolicyUpdate.micro_loss`): time, tokens, grads."""
    from agentree.algorithms.loss import loss_normalizer
    from agentree.algorithms.packing import batch_logprobs

    tc = upd.tc

    model.zero_grad(set_to_none=True)
    norm = sum(loss_normalizer(b.mask, tc.loss_agg, b.seq_tokens) for b in micro)
    tokens = sum(float(b.mask.sum()) for b in micro)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for b in micro:
            lp = batch_logprobs(model, b, 1.0)
            loss, _ = upd.micro_loss(b, lp, lp.detach(), None, norm)
            loss.backward()
    sync(device)
    wall = time.perf_counter() - t0
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    return {
        "wall_s": round(wall, 3),
        "policy_tokens": int(tokens),
        "forward_tokens": int(sum(b.ids.numel() for b in micro)),
        "tokens_per_s": round(tokens / wall, 1),
        "peak_memory_mb": peak_memory_mb(device),
        "grads": grads,
    }


def check_update(
    model: Any, trees: list[Any], groups: list[list[Any]], device: torch.device
) -> dict[str, Any]:
    """Padded against tree-packed: throughput, memory, and the gradients' agreement."""
    from agentree.algorithms.advantages import compute_advantages
    from agentree.algorithms.packing import choose_layout
    from agentree.config import TrainConfig
    from agentree.learner.update import PolicyUpdate

    tc = TrainConfig(kl_coef=0.0, micro_batch_size=8)
    upd = PolicyUpdate(model, tc)
    informative(groups)
    advs = compute_advantages("grpo", trees, groups, scale="std")
    out: dict[str, Any] = {}
    for layout in ("padded", "tree"):
        micro = choose_layout(groups, advs, 0, tc.micro_batch_size, layout)
        # an untimed pass first, so that the layout timed first does not also pay the kernels'
        # first-use costs
        loss_grads(model, micro, device, upd)
        out[layout] = loss_grads(model, micro, device, upd)
    a, b = out["padded"].pop("grads"), out["tree"].pop("grads")
    diff = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
    norm = math.sqrt(sum(float(a[n].pow(2).sum()) for n in a))
    out["grad_norm"] = round(norm, 6)
    out["grad_rel_diff"] = diff / max(norm, 1e-30)
    out["grads_equal"] = out["grad_rel_diff"] < 2e-2  # bf16 keeps ~3 significant digits
    model.zero_grad(set_to_none=True)
    return out


def check_fsdp2(
    model: Any, trees: list[Any], groups: list[list[Any]], device: torch.device, tmp: Path
) -> dict[str, Any]:
    """The learner's FSDP2 path on one rank, bf16 mixed precision: one update."""
    from agentree.config import load_config
    from agentree.learner.sharding import (
        ShardedUpdate,
        build_trainable,
        init_distributed,
        release_distributed,
    )

    path = tmp / "qwen2.5-shaped"
    model.save_pretrained(path)
    cfg = load_config(
        "frozenlake_grpo",
        overrides=[
            "train.fsdp=true",
            "train.dtype=bf16",
            "train.kl_coef=0",
            "train.micro_batch_size=8",
            f"policy.device={device.type}",
        ],
    )
    rank, world = init_distributed(cfg)
    try:
        trainable, ref = build_trainable(str(path), cfg, device)
        update = ShardedUpdate(trainable, cfg.train, ref=ref, rank=rank, world=world, device=device)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        metrics = update(trees, groups, lr=1e-6)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        release_distributed()
    return {
        "world_size": world,
        "wall_s": round(wall, 3),
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "policy_tokens": int(metrics["train/policy_tokens"]),
        "tokens_per_s": round(metrics["train/policy_tokens"] / wall, 1),
        "packed": bool(metrics["train/packed"]),
        "peak_memory_mb": peak_memory_mb(device),
    }


def run(device_name: str, save: Any = lambda summary: None) -> dict[str, Any]:
    """The four checks in order. The summary is handed to `save` after each, so a run cut off
    by a machine's time limit still leaves its finished steps; a step that raises is recorded
    as `{"error": ...}` and the steps that need its result are skipped, not the others."""
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible; run with --device cpu for the small check")
    t0 = time.perf_counter()
    summary: dict[str, Any] = {
        "device": device_label(device),
        "torch": torch.__version__,
        "shape": "qwen2.5-0.5b" if device.type == "cuda" else "small",
    }

    def step(name: str, fn: Any, figures: Any = lambda result: result) -> Any:
        """Run one check, keep its figures in the summary, save, and return its result."""
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            result = fn()
            summary[name] = figures(result)
        except Exception as exc:
            traceback.print_exc()
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            result = None
        print(f"[gpu_check] {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        save(summary)
        return result

    with tempfile.TemporaryDirectory(prefix="agentree-gpu-check-") as tmp:
        # the tiny policy is built into a private cache unless AGENTREE_CACHE names one, so
        # nothing is left in the user's home
        os.environ.setdefault("AGENTREE_CACHE", str(Path(tmp) / "cache"))
        rollout = step("patr", lambda: check_patr(device), lambda r: r[0])
        gen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(device, gen_dtype)
        summary["parameters"] = sum(p.numel() for p in model.parameters())
        if rollout is not None:
            _, trees, groups, tokenizer = rollout
            step("generation", lambda: check_generation(model, tokenizer, device))
            model = model.float()  # fp32 master weights; the update runs under bf16 autocast
            step("grpo_update", lambda: check_update(model, trees, groups, device))
            step("fsdp2", lambda: check_fsdp2(model, trees, groups, device, Path(tmp)))
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    save(summary)
    return summary


def passed(summary: dict[str, Any]) -> bool:
    """Every step ran and the two layouts' gradients agree."""
    steps = ("patr", "generation", "grpo_update", "fsdp2")
    if any(not isinstance(summary.get(k), dict) or "error" in summary[k] for k in steps):
        return False
    return bool(summary["grpo_update"]["grads_equal"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the full check) or cpu (small)")
    ap.add_argument("--out", type=Path, help="also write the JSON summary here (after each step)")
    args = ap.parse_args(argv)

    def save(summary: dict[str, Any]) -> None:
        if args.out:
            args.out.write_text(json.dumps(summary, indent=2) + "\n")

    summary = run(args.device, save)
    emit(summary, args.out)
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` removes the directory and the cache in it, as Ctrl-C
        sys.exit(main())
