"""How `agentree serve`'s batcher answers requests with different limits: eight greedy chat
requests (`--max-tokens` cycled, each value twice by default) are queued at once on one
`Batcher` over the transformers engine, or one every `--arrival` seconds (requests arriving
while a call runs), and the benchmark reports the engine calls made, the requests that joined
a running call, the time until every request was answered, each request's latency (from its
own submission) and the process's peak resident memory over the round (Linux).

    python benchmarks/serve_batching.py [--policy smollm2-135m] [--max-tokens 16,32,64,128]
                                        [--requests 8] [--repeats 2] [--arrival 0.5]

`--policy` takes what `agentree serve --policy` takes (`tiny` and `tiny-warm` are the default
config's FrozenLake policies).

The prompts ask for long stories, so that each request runs to its own `max_tokens` (the
table prints the lengths). Requests are submitted to the batcher directly (no HTTP), so the
figure is the batching alone. Run it on a quiet machine; compare two checkouts by running the
same script with `PYTHONPATH=OTHER_CHECKOUT`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from train_memory import peak_rss_mib, reset_peak_rss

from agentree.commands.serve import serve_config
from agentree.commands.serve_api import Batcher
from agentree.engines.base import SamplingParams
from agentree.engines.hf import HFEngine
from agentree.policy import resolve_policy
from agentree.signals import interrupt_on_sigterm


def one_round(
    engine: HFEngine,
    prompts: list[list[int]],
    limits: list[int],
    arrival: float,
    max_call: int | None = None,
) -> dict:
    """Request i submitted `i * arrival` seconds in; (wall seconds, calls, requests that joined
    a running call, latencies, lengths, peak resident memory)."""
    reset_peak_rss()
    batcher = Batcher(engine) if max_call is None else Batcher(engine, max_call=max_call)
    try:
        t0 = time.perf_counter()
        took: dict[int, float] = {}
        futures = []
        for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
            time.sleep(max(0.0, t0 + i * arrival - time.perf_counter()))
            sent = time.perf_counter()
            f = batcher.submit([p], SamplingParams(max_tokens=m, temperature=0.0))
            f.add_done_callback(
                lambda _f, i=i, sent=sent: took.setdefault(i, time.perf_counter() - sent)
            )
            futures.append(f)
        lengths = [len(f.result()[0][0].token_ids) for f in futures]
        wall = time.perf_counter() - t0
    finally:
        batcher.close()
        engine.prefix_cache.clear()
    latency = [took[i] for i in range(len(prompts))]
    return {
        "wall_s": wall,
        "calls": batcher.calls,
        "joined": getattr(batcher, "admitted", 0),  # a checkout without continuous batching
        "mean_latency_s": sum(latency) / len(latency),
        "latency_s": latency,
        "lengths": lengths,
        "peak_rss_gib": peak_rss_mib() / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="smollm2-135m", help="a named checkpoint or a path")
    ap.add_argument("--max-tokens", default="16,32,64,128", help="limits, cycled over requests")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds after a warm-up")
    ap.add_argument(
        "--arrival", type=float, default=0.0, help="seconds between submissions (0: at once)"
    )
    ap.add_argument(
        "--max-call", type=int, help="requests one engine call takes in (the batcher's default)"
    )
    ap.add_argument("--json", help="also write the rounds to this file")
    args = ap.parse_args()
    limits = [int(x) for x in args.max_tokens.split(",")]
    limits = [limits[i % len(limits)] for i in range(args.requests)]
    policy = resolve_policy(serve_config(args.policy), print)
    engine = HFEngine.from_pretrained(policy, seed=0)
    try:
        tok = engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": f"Write a long story number {i} about a frozen lake.",
                    }
                ],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for i in range(args.requests)
        ]
        one_round(engine, prompts, limits, 0.0, args.max_call)  # warm-up, not reported
        rounds = [
            one_round(engine, prompts, limits, args.arrival, args.max_call)
            for _ in range(args.repeats)
        ]
    finally:
        engine.close()
    print(
        f"# policy {args.policy}, {args.requests} requests, max_tokens {args.max_tokens} "
        f"cycled, one every {args.arrival} s, load {os.getloadavg()[0]:.2f}"
    )
    print(
        "| round | engine calls | joined a running call | all answered (s) | requests/s "
        "| mean latency (s) | peak memory (GiB) | latency by request (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, r in enumerate(rounds):
        lat = r["latency_s"]
        each = " ".join(f"{x:.1f}" for x in lat) if len(lat) <= 64 else "(in --json)"
        rate = len(lat) / r["wall_s"]
        print(
            f"| {k} | {r['calls']} | {r['joined']} | {r['wall_s']:.2f} | {rate:.1f} | "
            f"{r['mean_latency_s']:.2f} | {r['peak_rss_gib']:.2f} | {each} |"
        )
    if len(limits) <= 64:
        print(f"lengths: {rounds[0]['lengths']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "policy": args.policy,
                    "max_tokens": limits,
                    "arrival_s": args.arrival,
                    "rounds": rounds,
                },
                f,
            )


if __name__ == "__main__":
    with interrupt_on_sigterm():
        main()
