"""LoRA weight sync into vLLM: the adapters alone against the merged full weights.

    python benchmarks/lora_sync.py [--policy tiny|smollm2-135m|PATH] [--r 8] [--syncs 3]

Starts one vLLM engine with LoRA enabled on the policy, wraps a copy of the policy in rank-r
adapters on every projection (agentree's defaults), gives B random values (as after some
training), and syncs it into the engine both ways, `--syncs` times each:

- `merged`: what an engine without adapter support gets, base + (alpha / r) B A under the
  Hugging Face names (`plain_state_dict`), loaded in place by `sync_weights`;
- `adapter`: `lora_adapter` (A and B only) loaded as a new vLLM LoRA adapter per sync.

Per path: bytes per sync (exact: the tensors handed to the engine), seconds to build the
payload (merge, or collect the adapters) and seconds for `sync_weights`, the median over the
syncs. Times depend on the machine and its load; bytes do not. Prints one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentree.config import LoraSettings, load_config
    from agentree.engines.vllm import VLLMEngine
    from agentree.learner.lora import add_lora, lora_adapter, plain_state_dict
    from agentree.policy import resolve_policy, vllm_lora_kwargs

    cfg = load_config("frozenlake_patr", select={"policy": args.policy})
    path = resolve_policy(cfg, log=lambda m: None)
    t0 = time.perf_counter()
    kv = {} if args.kv_share is None else {"gpu_memory_utilization": args.kv_share}
    engine = VLLMEngine(path, dtype="float32", **vllm_lora_kwargs(args.r), **kv)
    startup = time.perf_counter() - t0
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        parameters = sum(p.numel() for p in model.parameters())
        peft = add_lora(model, LoraSettings(r=args.r))  # wraps `model`'s layers in place
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.01 * torch.randn(p.shape, generator=gen))
        out: dict[str, Any] = {
            "policy": args.policy,
            "r": args.r,
            "parameters": parameters,
            "startup_s": round(startup, 1),
        }
        build = {
            # the engine reads `.state_dict()` of what it is given, as the learner publishes
            "merged": lambda: merged(plain_state_dict(peft)),
            "adapter": lambda: lora_adapter(peft),
        }
        for name, make in build.items():
            prep, sync = [], []
            for _ in range(args.syncs):
                t1 = time.perf_counter()
                payload = make()
                t2 = time.perf_counter()
                engine.sync_weights(payload)
                prep.append(t2 - t1)
                sync.append(engine.stats.extra["weight_sync_s"])
            out[name] = {
                "bytes_per_sync": engine.stats.extra["weight_sync_bytes"],
                "prepare_s": round(statistics.median(prep), 4),
                "sync_s": round(statistics.median(sync), 4),
            }
        out["bytes_ratio"] = out["merged"]["bytes_per_sync"] / out["adapter"]["bytes_per_sync"]
        return out
    finally:
        engine.close()


def merged(state: dict[str, Any]) -> SimpleNamespace:
    """What the learner publishes to an engine without adapters: an object with the merged
    state dict behind `.state_dict()`."""
    return SimpleNamespace(state_dict=lambda: state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="tiny")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument(
        "--kv-share",
        type=float,
        help="vLLM's gpu_memory_utilization (on CPU: the share of host memory for the KV cache)",
    )
    print(json.dumps(run(ap.parse_args(argv)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
