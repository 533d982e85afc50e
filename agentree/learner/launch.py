"""Starting training ranks on this machine, as torchrun would: one process per rank with
`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set, each calling the same
entry-point function. Ray actors as ranks: `agentree.distributed.ranks.launch_on_ray`."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, addr: str, port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def spawn_ranks(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = ()) -> int:
    """`fn(*args)` in `world_size` local rank processes; 0 if every rank returned 0 or None,
    else the first failing exit code. `fn` must be importable by name (spawned processes)."""
    # deferred: torch is heavy and the launcher module is imported by the CLI
    import torch.multiprocessing as mp

    port = free_port()
    ctx = None
    try:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, port, fn, tuple(args)), nprocs=world_size,
            join=False, start_method="spawn",
        )  # fmt: skip
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:  # torch has stopped the other ranks
        return int(e.exit_code or 1)
    except BaseException:
        # Ctrl-C, or `kill` of this process alone (as SIGTERM: `interrupt_on_sigterm`), here or
        # while the ranks were still being started
        stop_ranks(ctx.processes if ctx is not None else multiprocessing.active_children())
        raise
    return 0


def stop_ranks(ranks: Sequence[Any]) -> None:
    """SIGTERM each live rank process and wait for them all: a rank stops as its own stop signal
    says (a trainer checkpoints first), one still starting ends at once. A second interrupt
    while waiting kills them. Without this, a launcher stopped alone leaves its ranks waiting
    for each other, and its exit waits on them."""
    for p in ranks:
        if p.is_alive():
            p.terminate()
    try:
        for p in ranks:
            p.join()
    except BaseException:
        for p in ranks:
            p.kill()
        for p in ranks:
            p.join()
        raise


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:  # fmt: skip
    os.environ.update(rank_env(rank, world_size, "127.0.0.1", port))
    code = fn(*args)
    if code:
        sys.exit(int(code))
