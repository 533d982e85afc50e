"""A real pretrained model on this machine: fetch + convert time, generation and update
throughput, and zero-shot held-out success and well-formed actions per env with its config.

    python benchmarks/real_model.py --out docs/results/real_model.json            # everything
    python benchmarks/real_model.py --only throughput zero-shot --envs frozenlake countdown
    python benchmarks/real_model.py --only judge --out docs/results/real_model_judge.json

Sections:
- `convert`: `agentree models pull smollm2-135m` into an empty temp cache (download, sha256
  checks, de-quantization, save), wall time.
- `throughput`: the transformers engine's sampled tokens/s at batch 1 and batch 8 (64 new
  tokens after a ~90-token prompt, no early stop), the prefill and the decoding at batch 8 after
  contexts of 1,800-2,500 tokens of different lengths (a SWE turn), and trained tokens/s of one
  forward+backward+AdamW step on 4 x 512 tokens (the update's cost without the rollout).
- `zero-shot`: `agentree eval --config <env>_smollm2 --policy smollm2-135m` on held-out tasks;
  success (resolved) rate and the share of well-formed actions from the saved trees.
- `judge` (needs Docker and the local SWE images, `agentree swe build-local`): the model as
  PATR's LLM judge. `agentree serve --policy smollm2-135m` in a child process, then
  `agentree rollout --config swebench_patr_smollm2 --scorer judge` against it on the local
  suite; from the saved trees, the share of judge calls whose reply parsed as {"score": x}
  against those that fell back to the heuristic (by error), and the parsed scores' spread.
Say in the results whether other work shared the machine: every figure here is wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from agentree.signals import interrupt_on_sigterm, run_child

ZERO_SHOT = {
    "frozenlake": ("frozenlake_patr_smollm2", "32", 2),
    "countdown": ("countdown_latr_smollm2", "32", 2),
    "math": ("math_treepo_smollm2", "32", 2),
    "swebench": ("swebench_patr_smollm2", "local", 1),
}
"""env -> (config, held-out tasks, samples per task)."""


def convert(policy: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="agentree-bench-cache-") as cache:
        t0 = time.perf_counter()
        run_child(
            ["agentree", "models", "pull", policy],
            env={**os.environ, "AGENTREE_CACHE": cache},
            check=True,
        )
        return {"fetch_and_convert_s": round(time.perf_counter() - t0, 1)}


def throughput(policy: str, threads: int) -> dict[str, float]:
    import torch

    from agentree.engines.base import SamplingParams
    from agentree.engines.hf import HFEngine
    from agentree.hub.load import load_policy

    torch.set_num_threads(threads)
    model, tok = load_policy(policy, dtype="float32", device="cpu")
    engine = HFEngine(model, tok, prefix_cache_mb=0, seed=0)
    prompt = tok.encode("Write a short story about a robot that learns to paint. " * 8)[:90]
    params = SamplingParams(max_tokens=64, temperature=1.0, stop_token_ids=())
    out: dict[str, float] = {"prompt_tokens": len(prompt)}
    for batch in (1, 8):
        engine.generate([prompt] * batch, params)  # warm-up
        t0 = time.perf_counter()
        done = engine.generate([prompt] * batch, params)
        n = sum(len(c.token_ids) for row in done for c in row)
        out[f"generate_tokens_per_s_batch{batch}"] = round(n / (time.perf_counter() - t0), 1)
    # a SWE turn: 8 contexts of 1,800-2,500 tokens, each its own length (left-padded with a
    # mask, as the rows of a multi-turn rollout are); the prefill alone (one new token), then
    # 32 more tokens, whose extra time is the decoding's
    words = tok.encode("def f(x):\n    return x + 1  # a line of code in a long listing\n" * 400)
    long = [words[k : k + 1800 + 100 * k] for k in range(8)]
    one, more = (SamplingParams(max_tokens=n, stop_token_ids=()) for n in (1, 33))
    engine.generate(long[:2], one)  # warm-up
    t0 = time.perf_counter()
    engine.generate(long, one)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(long, more)
    decode = time.perf_counter() - t0 - prefill
    out["long_context_prefill_tokens_per_s"] = round(sum(map(len, long)) / prefill, 1)
    out["long_context_decode_tokens_per_s_batch8"] = round(8 * 32 / decode, 1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, len(tok), (4, 512))
    times = []
    for _ in range(3):  # the first step allocates the optimiser state
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    out["update_step_4x512_s"] = round(min(times[1:]), 1)
    out["update_tokens_per_s"] = round(ids.numel() / min(times[1:]), 1)
    engine.close()
    return out


def zero_shot(policy: str, envs: list[str], out_dir: Path) -> dict[str, dict]:
    from agentree.rollout.base import action_format
    from agentree.tree import Tree

    results = {}
    for env in envs:
        config, tasks, samples = ZERO_SHOT[env]
        run = out_dir / f"zero-shot-{env}"
        cmd = ["agentree", "eval", "--config", config, "--policy", policy, "--tasks", tasks]
        cmd += ["--samples", str(samples), "--output", str(run)]
        t0 = time.perf_counter()
        run_child(cmd, check=True)
        summary = json.loads((run / "eval.json").read_text())["summary"]
        well, judged = action_format([Tree.load(f) for f in sorted((run / "trees").glob("*.json"))])
        results[env] = {
            "config": config,
            "tasks": summary["tasks"],
            "samples": samples,
            summary["metric"]: summary[summary["metric"]],
            "pass_at_k": summary["pass_at_k"],
            "well_formed_actions": well / judged if judged else None,
            "actions_judged": judged,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(env, json.dumps(results[env]), flush=True)
    return results


def judge(policy: str, tasks: str, timeout: float, out_dir: Path) -> dict:
    from agentree.learner.launch import free_port
    from agentree.tree import Tree

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        ["agentree", "serve", "--policy", policy, "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    try:
        t0 = time.perf_counter()
        while True:  # the server loads (and on a first run converts) the model before it binds
            if server.poll() is not None:
                raise RuntimeError(f"agentree serve exited with {server.returncode}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if time.perf_counter() - t0 > 600:
                    raise TimeoutError("agentree serve did not answer within 600 s") from None
                time.sleep(1)
        run = out_dir / "judge"
        cmd = ["agentree", "rollout", "--config", "swebench_patr_smollm2", "--policy", policy]
        cmd += ["--tasks", tasks, "--scorer", "judge", "--output", str(run)]
        for key, value in {"base_url": f"{url}/v1", "model": policy, "timeout": timeout}.items():
            cmd += ["--set", f"scorer.{key}={value}"]
        t1 = time.perf_counter()
        run_child(cmd, check=True)
        wall = time.perf_counter() - t1
    finally:
        server.terminate()
        server.wait(timeout=60)
    infos = [
        n.info["scorer"]
        for f in sorted((run / "trees").glob("*.json"))
        for n in Tree.load(f).nodes
        if "scorer" in n.info
    ]
    parsed = [i["judge"] for i in infos if "judge" in i]
    errors = Counter(str(i["judge_error"]).split(":")[0] for i in infos if "judge_error" in i)
    result = {
        "tasks": tasks,
        "scored_branches": len(infos),
        "parsed": len(parsed),
        "fell_back": sum(errors.values()),
        "fallback_errors": dict(errors),
        "phases": dict(Counter(i["phase"] for i in infos)),
        "judge_score_histogram": dict(sorted(Counter(round(x, 1) for x in parsed).items())),
        "judge_score_mean": round(statistics.fmean(parsed), 3) if parsed else None,
        "judge_score_stdev": round(statistics.pstdev(parsed), 3) if parsed else None,
        "latency_s_median": round(statistics.median(i["latency_s"] for i in infos), 2)
        if infos
        else None,
        "rollout_wall_s": round(wall, 1),
        "reply_examples": list(dict.fromkeys(str(i["reply"])[:160] for i in infos))[:4],
    }
    print("judge", json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="smollm2-135m")
    sections = ["convert", "throughput", "zero-shot", "judge"]
    p.add_argument("--only", nargs="+", default=sections, choices=sections)
    p.add_argument("--envs", nargs="+", default=list(ZERO_SHOT), choices=list(ZERO_SHOT))
    p.add_argument("--threads", type=int, default=2, help="torch threads for throughput")
    p.add_argument("--judge-tasks", default="local", help="SWE tasks the judge run rolls out")
    p.add_argument(
        "--judge-timeout",
        type=float,
        default=120.0,
        help="seconds per judge request (a CPU server answers 8 at once slower than a GPU)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/real_model.json"))
    args = p.parse_args()
    report: dict = {"policy": args.policy, "load_at_start": os.getloadavg()[0]}
    if "convert" in args.only:
        report["convert"] = convert(args.policy)
        print("convert", report["convert"], flush=True)
    if "throughput" in args.only:
        from agentree.hub.pretrained import local_policy

        report["throughput"] = throughput(local_policy(args.policy), args.threads)
        print("throughput", report["throughput"], flush=True)
    if "zero-shot" in args.only:
        with tempfile.TemporaryDirectory(prefix="agentree-zero-shot-") as tmp:
            report["zero_shot"] = zero_shot(args.policy, args.envs, Path(tmp))
    if "judge" in args.only:
        with tempfile.TemporaryDirectory(prefix="agentree-judge-") as tmp:
            report["judge"] = judge(args.policy, args.judge_tasks, args.judge_timeout, Path(tmp))
    report["load_at_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the children and removes the directories
        main()
