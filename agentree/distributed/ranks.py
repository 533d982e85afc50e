"""Training ranks as Ray actors (`train.world_size > 1` with `distributed.backend=ray`).

One actor per rank, each holding a GPU when the cluster has them. The rank-0 actor reports its
node's address and a free port there; every actor then sets the variables torchrun would set
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`) and calls the entry-point
function it was given, as the local launcher (`agentree.learner.launch.spawn_ranks`) does in a
process, so `init_distributed` joins the group as under torchrun (NCCL on GPUs, gloo on CPU).
Rank 0's trainer then starts its rollout workers and engine replicas in the same Ray cluster
(an actor is already connected to it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from agentree.config import ExperimentConfig
from agentree.distributed.cluster import (
    check_cluster,
    connect,
    disconnect,
    engine_replicas,
    import_ray,
    rank_gpus,
    run_needs,
    scorer_actor_needed,
    total,
)
from agentree.learner.launch import free_port


class RankActor:
    """A process for one training rank."""

    def node(self) -> tuple[str, int]:
        """(this node's address, a port free on it): the rendezvous of the process group."""
        ray = import_ray()
        return ray.util.get_node_ip_address(), free_port()

    def run(self, env: dict[str, str], fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        ray = import_ray()
        os.environ.update(env)
        # Ray hands each rank actor its own GPU(s) as CUDA_VISIBLE_DEVICES: device 0 is its own
        os.environ["LOCAL_RANK"] = "0" if ray.get_gpu_ids() else env["RANK"]
        return fn(*args)


def launch_on_ray(
    cfg: ExperimentConfig, fn: Callable[..., Any], args: Sequence[Any] = ()
) -> list[Any]:  # fmt: skip
    """`fn(*args)` on `train.world_size` rank actors joined as one process group; the ranks'
    results in rank order. Connects to `distributed.address` (starting a private instance for
    `local`, with room for the ranks and rank 0's rollout actors)."""
    ray = import_ray()
    world, dc = cfg.train.world_size, cfg.distributed
    scorer = scorer_actor_needed(cfg)
    most = engine_replicas(dc, cluster_gpus=dc.engine_gpus)
    need = run_needs(cfg, replicas=most, scorer_actor=scorer, cluster_gpus=0.0)
    started = connect(dc, num_cpus=total(need, "CPU"))
    try:
        check_cluster(cfg, scorer_actor=scorer)  # the ranks and rank 0's rollout actors
        gpus = rank_gpus(cfg, ray.cluster_resources().get("GPU", 0.0))
        cls = ray.remote(RankActor).options(num_cpus=1, num_gpus=gpus, max_restarts=0)
        actors = [cls.remote() for _ in range(world)]
        addr, port = ray.get(actors[0].node.remote(), timeout=dc.start_timeout_s)
        env = {"WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
        refs = [a.run.remote({**env, "RANK": str(r)}, fn, args) for r, a in enumerate(actors)]
        try:
            return ray.get(refs)
        finally:
            for a in actors:
                ray.kill(a)
    finally:
        if started:
            disconnect(started)
