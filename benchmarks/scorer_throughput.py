"""Scoring throughput of the process scorers, in branches scored per second.

    python benchmarks/scorer_throughput.py [--branches 32] [--quick]

- PRM: the tiny Skywork-layout PRM (built locally) on SWE-like branches of 4-14 steps,
  one branch per call (batch 1) vs batched calls.
- Judge vs a fixed-latency server (a local OpenAI-compatible server that answers after
  `--latency` seconds): concurrency 1 vs more, prompt cache off, so every branch is one request;
  shows that concurrency hides the judge's latency.
- Judge vs `agentree serve` with the tiny policy: concurrency 1 vs 8; the server batches
  concurrent requests into shared engine calls. (The tiny policy's answers are garbage, so these
  branches end on the heuristic fallback; the cost measured is the full request.)

Numbers depend on the machine and its load (reported in the header).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentree.tree import Tree


def swe_branch(i: int, steps: int, lines: int = 8) -> list:
    tree = Tree(f"b{i}")
    node = tree.add_root(f"<issue>\nParser.parse crashes on input {i}\n</issue>", []).id
    for k in range(steps):
        cmd = f"grep -rn 'case{i}_{k}' src/" if k % 3 else f"sed -n '{k},{k + 20}p' src/m{i}.py"
        out = "\n".join(f"src/m{i}.py:{k + j}:    value_{j} = parse(x{j})" for j in range(lines))
        node = tree.add_child(
            node,
            action=f"THOUGHT: step {k}.\n\n```bash\n{cmd}\n```",
            observation=f"<returncode>0</returncode>\n<output>\n{out}\n</output>",
            info={"env": {"returncode": 0}},
        ).id
    return tree.path(node)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class FixedLatencyServer:
    """OpenAI chat endpoint that answers {"score": 0.7} after a fixed delay."""

    def __init__(self, latency: float) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(latency)
                msg = {"role": "assistant", "content": '{"score": 0.7}'}
                data = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False
        self.httpd.block_on_close = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.thread.join()
        self.httpd.server_close()


def bench_prm(branches: list, rows: list) -> None:
    from agentree.hub.tiny_prm import build_tiny_prm
    from agentree.scorers.prm import PRMConfig, PRMScorer

    path = str(build_tiny_prm())
    tokens = 0
    for bs in (1, 8, 32):
        scorer = PRMScorer(PRMConfig(model=path, batch_size=bs, device="cpu"))
        scorer.score(None, branches[:2])  # warm-up
        if bs == 1:
            dt = timed(lambda: [scorer.score(None, [b]) for b in branches])  # noqa: B023
            mode = "one call per branch"
        else:
            dt = timed(lambda: scorer.score(None, branches))  # noqa: B023
            mode = f"one call, batch {bs}"
        if not tokens:  # input length (the serialised last 10 steps), for the table
            enc = [scorer.encode(b[0].observation, scorer.step_texts(b))[0] for b in branches]
            tokens = sum(map(len, enc)) // len(branches)
        rows.append((f"tiny PRM, ~{tokens} tok/branch", mode, len(branches), dt))
        scorer.close()


def bench_judge_latency(branches: list, rows: list, latency: float) -> None:
    from agentree.scorers.judge import JudgeConfig, JudgeScorer

    server = FixedLatencyServer(latency)
    try:
        for conc in (1, 8, 32):
            judge = JudgeScorer(
                JudgeConfig(
                    base_url=server.url, model="m", concurrency=conc, cache_size=0, retries=0
                )
            )
            dt = timed(lambda: judge.score(None, branches))  # noqa: B023
            rows.append(
                (f"judge, {latency * 1000:.0f} ms server", f"concurrency {conc}", len(branches), dt)
            )
            judge.close()
    finally:
        server.close()


def bench_judge_serve(branches: list, rows: list) -> None:
    from agentree.commands.serve import start_server
    from agentree.scorers.judge import JudgeConfig, JudgeScorer

    handle = start_server("tiny", served_model_name="tiny", log_fn=lambda m: None)
    try:
        for conc in (1, 8):
            judge = JudgeScorer(
                JudgeConfig(
                    base_url=handle.url,
                    model="tiny",
                    concurrency=conc,
                    cache_size=0,
                    retries=0,
                    max_tokens=16,
                )
            )
            judge.score(None, branches[:1])  # warm-up
            calls = handle.api.batcher.calls
            dt = timed(lambda: judge.score(None, branches))  # noqa: B023
            merged = handle.api.batcher.calls - calls
            rows.append(
                (
                    "judge, agentree serve tiny",
                    f"concurrency {conc} ({merged} engine calls)",
                    len(branches),
                    dt,
                )
            )
            judge.close()
    finally:
        handle.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--branches", type=int, default=32)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true", help="8 branches, fewer settings")
    args = ap.parse_args()
    n = 8 if args.quick else args.branches
    branches = [swe_branch(i, 4 + i % 11) for i in range(n)]
    import logging

    logging.getLogger("agentree.scorers.judge").setLevel(logging.ERROR)  # expected fallbacks
    load = os.getloadavg()
    print(f"cpus={os.cpu_count()} load average={load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows: list = []
    bench_prm([swe_branch(i, 2 + i % 3, lines=1) for i in range(n)], rows)  # short inputs
    bench_prm(branches, rows)  # long inputs: ten steps of eight output lines, near 4k tokens
    bench_judge_latency(branches, rows, args.latency)
    bench_judge_serve(branches[: max(4, n // 2)], rows)
    print(f"{'scorer':<30} {'mode':<36} {'branches':>8} {'seconds':>8} {'branches/s':>11}")
    for name, mode, count, dt in rows:
        print(f"{name:<30} {mode:<36} {count:>8} {dt:>8.3f} {count / dt:>11.1f}")


if __name__ == "__main__":
    main()
