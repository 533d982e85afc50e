"""How ranks are launched: as Ray actors (`distributed.backend=ray`) they compute the same
update as the single-process trainer on the fixed batch of tests/test_parallel.py; under torchrun
`agentree train` joins torchrun's process group and writes one sharded checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from test_parallel import (  # the fixed batch and the single-process reference
    SMALL,
    VARIANTS,
    assert_same,
    cfg_for,
    fixed_batch,  # noqa: F401 (a fixture, used by name)
    full_state,
    quiet,
    single_process,
)


def _ray_rank(batch: Path, out: Path) -> dict[str, torch.Tensor] | None:
    """One rank, in a Ray actor: the `accumulate` variant's update; rank 0 returns the weights."""
    import torch.distributed as dist

    from agentree.run.trainer import Trainer

    torch.set_num_threads(1)
    trees, groups = torch.load(batch, weights_only=False)
    cfg = cfg_for(out, *VARIANTS["accumulate"], "train.fsdp=true", "train.world_size=2")
    tr = Trainer(cfg, out, log=quiet)
    try:
        tr.update(trees, groups)
        state = full_state(tr.model)
        return state if dist.get_rank() == 0 else None
    finally:
        tr.close()


def test_ray_launched_ranks_match_one_process(fixed_batch, tmp_path):  # noqa: F811
    """distributed.backend=ray launches the ranks as Ray actors (a real local Ray instance,
    the rendezvous at rank 0's node); their update is the single-process one."""
    ray = pytest.importorskip("ray", reason="pip install 'agentree[ray]'")
    from agentree.distributed.ranks import launch_on_ray

    init, want = single_process(fixed_batch, tmp_path / "ref", VARIANTS["accumulate"], updates=1)
    env = {"PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    env.update({k: os.environ[k] for k in ("AGENTREE_CACHE",) if k in os.environ})
    logs = tempfile.mkdtemp(prefix="atr", dir="/tmp")  # Ray's socket paths must stay short
    # room for what a real run reserves (2 ranks, and rank 0's 2 rollout workers) though only
    # the ranks start here: the pre-check refuses a cluster that cannot hold the run
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env}, _temp_dir=logs)
    try:
        cfg = cfg_for(tmp_path, "train.fsdp=true", "train.world_size=2", "distributed.backend=ray")
        got, none = launch_on_ray(cfg, _ray_rank, (fixed_batch, tmp_path / "run"))
    finally:
        ray.shutdown()
        shutil.rmtree(logs, ignore_errors=True)
    assert none is None
    assert_same(got, want, moved_from=init)


@pytest.mark.slow  # ~1 min on 2 idle cores: a whole `agentree train` step on 2 ranks
def test_torchrun_launches_the_ranks(tmp_path, tiny_frozenlake):
    """Under torchrun, `agentree train` joins the process group torchrun set up instead of
    spawning ranks itself: 2 ranks train a step and write one sharded checkpoint."""
    from agentree.learner.launch import free_port

    out = tmp_path / "run"
    sets = [a for o in [*SMALL, "train.world_size=2", "train.fsdp=true"] for a in ("--set", o)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", "-m", "agentree", "train", "--config", "frozenlake_patr",
        "--steps", "1", "--output", str(out), *sets,
    ]  # fmt: skip
    # torchrun's elastic agent keeps its per-rank logs in a temp dir it never removes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "checkpoints" / "step_000001"
    assert (ckpt / "dcp" / ".metadata").exists() and (ckpt / "trainer_state.pt").exists()
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # one shard file per rank


def test_a_launcher_stopped_alone_stops_its_ranks(tmp_path):
    """`kill` of the launching process only (a scheduler, a supervisor) reaches the ranks
    `spawn_ranks` started: they get SIGTERM and end, and the launcher exits. Before, it left
    them running, and its own exit waited on them for ever."""
    import signal

    from helpers import descendants, stop_when

    script = tmp_path / "launch.py"
    script.write_text(
        "import time\n"
        "from agentree.learner.launch import spawn_ranks\n"
        "from agentree.signals import interrupt_on_sigterm\n"
        "if __name__ == '__main__':\n"
        "    with interrupt_on_sigterm():\n"
        "        spawn_ranks(2, time.sleep, (3600,))\n"
    )

    def both_ranks(proc: subprocess.Popen) -> bool:
        ranks = [p for p in descendants(proc.pid).values() if "spawn_main" in p.cmdline]
        return len(ranks) == 2

    scratch = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    try:
        log = tmp_path / "output.log"
        code, output, left = stop_when([sys.executable, str(script)], scratch, both_ranks, 120, log)
        assert code not in (-signal.SIGTERM, -signal.SIGKILL), output
        assert "KeyboardInterrupt" in output  # it unwound, as from Ctrl-C
        assert not left, f"still running: {[p.cmdline for p in left.values()]}\n{output}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
