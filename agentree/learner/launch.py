"""Starting training ranks on this machine, as torchrun would: one process per rank with
`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set, each calling the same
entry-point function. Ray actors as ranks: `agentree.distributed.ranks.launch_on_ray`."""

from __future__ import annotations

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
    ctx = mp.start_processes(
        _rank_main, args=(world_size, port, fn, tuple(args)), nprocs=world_size, join=False,
        start_method="spawn",
    )  # fmt: skip
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        return int(e.exit_code or 1)
    return 0


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:  # fmt: skip
    os.environ.update(rank_env(rank, world_size, "127.0.0.1", port))
    code = fn(*args)
    if code:
        sys.exit(int(code))
