"""`agentree serve` under concurrent load: requests/s and p50/p99 latency at 1, 8, 32 and 64
concurrent clients, and how many requests failed (a refused or reset connection, an HTTP error).

    python benchmarks/serve_load.py [--agentree CMD] [--url http://127.0.0.1:PORT/v1]
                                    [--levels 1,8,32,64] [--requests 128] [--max-seconds 60]
                                    [--max-tokens 8 | --max-tokens 4,8,16,32] [--policy tiny]

By default it starts `python -m agentree serve --policy tiny --backend transformers` (or
`--policy NAME`) on a free port of 127.0.0.1, measures, and stops it (SIGTERM, then SIGKILL
after 30 s). `--agentree CMD` starts another installation's server (e.g.
`/work/venv-base/bin/agentree` for the code before the move to FastAPI); `--url` measures a
server that is already running on 127.0.0.1. Each
client sends greedy chat requests (`--max-tokens` tokens, one new connection per request, as
simple clients and the judge do; several comma-separated values are cycled through, request i
asking for the i-th, as clients that want different lengths do) until `--requests` requests
were sent at that level or `--max-seconds` passed; nothing is sent anywhere but 127.0.0.1.

Numbers depend on the machine and its load: run it on a quiet machine, before and after a
change, with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from agentree.signals import interrupt_on_sigterm, stop_children

LOCAL_HOSTS = {"127.0.0.1", "localhost"}
MAX_REQUESTS = 2000
"""Most requests one level may send, whatever `--requests` says."""


def start_server(cmd: str, port: int, timeout: float, policy: str = "tiny") -> subprocess.Popen:
    """`CMD serve --policy POLICY` on 127.0.0.1:`port`, returned once `/v1/models` answers."""
    argv = [*shlex.split(cmd), "serve", "--policy", policy, "--backend", "transformers"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited with status {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    return proc
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"{' '.join(argv)} did not answer within {timeout:.0f}s")
    except BaseException:  # it failed to come up, or the benchmark was stopped meanwhile
        stop_children([proc], grace_s=30)
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, i: int, max_tokens: int) -> float | None:
    """Seconds one chat request took, or None if it failed."""
    body = {
        "messages": [{"role": "user", "content": f"P _ _ G request {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return time.perf_counter() - t0


def level(url: str, clients: int, requests: int, max_seconds: float, max_tokens: list[int]) -> dict:
    """`clients` threads sending requests back to back until `requests` were sent or
    `max_seconds` passed."""
    sent = 0
    lock = threading.Lock()
    deadline = time.monotonic() + max_seconds
    latencies: list[float] = []
    failed = 0

    def client() -> None:
        nonlocal sent, failed
        while True:
            with lock:
                if sent >= requests or time.monotonic() > deadline:
                    return
                sent += 1
                i = sent
            took = one_request(url, i, max_tokens[i % len(max_tokens)])
            with lock:
                if took is None:
                    failed += 1
                else:
                    latencies.append(took)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    wall = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float | None:
        if not latencies:
            return None
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    return {
        "clients": clients,
        "sent": sent,
        "answered": len(latencies),
        "failed": failed,
        "req_per_s": len(latencies) / wall if wall else 0.0,
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agentree", default=f"{sys.executable} -m agentree", help="command to start")
    p.add_argument("--url", help="an already running server on 127.0.0.1 (…/v1)")
    p.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=128, help="requests per level")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time limit per level")
    p.add_argument(
        "--max-tokens", default="8", help="completion tokens per request (comma-separated: cycled)"
    )
    p.add_argument("--policy", default="tiny", help="the policy the started server serves")
    p.add_argument("--start-timeout", type=float, default=300.0, help="server start limit (s)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    requests = min(args.requests, MAX_REQUESTS)

    proc = None
    if args.url:
        host = urllib.parse.urlsplit(args.url).hostname
        if host not in LOCAL_HOSTS:
            p.error(f"--url must point at 127.0.0.1, not {host}")
        url = args.url.rstrip("/")
    else:
        port = free_port()
        proc = start_server(args.agentree, port, args.start_timeout, args.policy)
        url = f"http://127.0.0.1:{port}/v1"
    try:
        level(url, 1, 2, args.max_seconds, max_tokens)  # warm-up, not reported
        rows = [level(url, c, requests, args.max_seconds, max_tokens) for c in levels]
    finally:
        if proc is not None:
            stop_children([proc], grace_s=30)
    header = {
        "server": args.url or args.agentree,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "policy": args.policy,
        "max_tokens": max_tokens if len(max_tokens) > 1 else max_tokens[0],
    }
    print(f"# {json.dumps(header)}")
    print("| clients | answered/sent | failed | req/s | p50 (s) | p99 (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p50 = "-" if r["p50_s"] is None else f"{r['p50_s']:.3f}"
        p99 = "-" if r["p99_s"] is None else f"{r['p99_s']:.3f}"
        print(
            f"| {r['clients']} | {r['answered']}/{r['sent']} | {r['failed']} | "
            f"{r['req_per_s']:.1f} | {p50} | {p99} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "levels": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the server it started, as Ctrl-C does
        raise SystemExit(main())
