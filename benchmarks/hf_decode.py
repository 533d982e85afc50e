"""Where the transformers engine's decode time goes: its per-step cost against the model's bare
forward and against `transformers`' own `generate`, with a profile of the engine's steps.

    python benchmarks/hf_decode.py [--device cuda|cpu] [--tokens 64] [--out FILE.json]

The model is `gpu_check`'s random-initialised Qwen2.5-0.5B-shaped causal LM in bf16 (on CPU,
its small shape in fp32). For batch 1 and 32, prompts of 256 random tokens (16 on CPU):

- `forward`: the bare decode loop, the model called once a step on a `DynamicCache` with the
  growing attention mask, the next token the argmax on the device (no host sync per step);
- `engine`: `HFEngine.generate` (sampling at temperature 1, no stop strings);
- `hf_generate`: `model.generate(do_sample=True)` forced to the same number of tokens.

Each is timed after one warm-up call of the same shape and reported as milliseconds per decode
step. Then `torch.profiler` records one engine call at batch 1 and the twenty operators with the
most host (CPU) time are listed: on a GPU a step's wall time is the host's time whenever the
device waits for launches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check import PROMPT_TOKENS, build_model, device_label, emit, sync


def tokenizer_for_check() -> Any:
    """A real tokenizer (the tiny policy's BPE) for the engine's pad and EOS ids."""
    from agentree.hub.tiny import TinyModelConfig, train_tokenizer

    corpus = ["the agent moves left right up down and reaches the goal"] * 64
    return train_tokenizer(corpus, TinyModelConfig())


def timed(fn: Any, device: torch.device) -> float:
    fn()  # warm-up: kernels, allocator, cuBLAS heuristics for these shapes
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def bare_decode(model: Any, prompts: torch.Tensor, steps: int) -> None:
    from transformers import DynamicCache

    mask = torch.ones_like(prompts)
    out = model(
        input_ids=prompts,
        attention_mask=mask,
        past_key_values=DynamicCache(),
        use_cache=True,
        logits_to_keep=1,
    )
    for _ in range(steps - 1):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(
            input_ids=nxt,
            attention_mask=mask,
            past_key_values=out.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )


def run(device_name: str, steps: int) -> dict[str, Any]:
    from agentree.engines.base import SamplingParams
    from agentree.engines.hf import HFEngine

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(device, dtype).eval()
    engine = HFEngine(model, tokenizer_for_check(), seed=0, prefix_cache_mb=0)
    gen = torch.Generator().manual_seed(1)
    plen = PROMPT_TOKENS[device.type]
    params = SamplingParams(max_tokens=steps, temperature=1.0)
    out: dict[str, Any] = {
        "device": device_label(device),
        "torch": torch.__version__,
        "prompt_tokens": plen,
        "steps": steps,
    }
    with torch.no_grad():
        for batch in (1, 32):
            prompts = torch.randint(10, 500, (batch, plen), generator=gen).to(device)
            rows = prompts.tolist()
            walls = {
                "forward": timed(lambda p=prompts: bare_decode(model, p, steps), device),
                "engine": timed(lambda r=rows: engine.generate(r, params), device),
                "hf_generate": timed(
                    lambda p=prompts: model.generate(
                        p,
                        attention_mask=torch.ones_like(p),
                        do_sample=True,
                        max_new_tokens=steps,
                        min_new_tokens=steps,
                        pad_token_id=0,
                    ),
                    device,
                ),
            }
            out[f"batch{batch}_ms_per_step"] = {
                k: round(1e3 * w / steps, 2) for k, w in walls.items()
            }
            print(f"batch {batch}: {out[f'batch{batch}_ms_per_step']}", file=sys.stderr, flush=True)
        rows = torch.randint(10, 500, (1, plen), generator=gen).tolist()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            engine.generate(rows, params)
            sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(table, file=sys.stderr)
    out["profile_top_self_cpu"] = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
            "cpu_total_ms": round(e.cpu_time_total / 1e3, 2),
        }
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    ]
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per call")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    summary = run(args.device, args.tokens)
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
