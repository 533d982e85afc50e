"""A benchmark stopped by `kill` (SIGTERM) leaves nothing behind: no temporary directory and
no child process (`agentree` commands, rank processes), as Ctrl-C leaves nothing; and
`agentree.signals.run_child` / `stop_children` / `Children`, through which they stop their
children, on real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BENCHMARKS, Ready, descendants, printed, stop_when

from agentree.signals import Children, Stopping, interrupt_on_sigterm, run_child, stop_children


def temp_dir(prefix: str, scratch: Path) -> Ready:
    return lambda _proc: any(p.name.startswith(prefix) for p in scratch.iterdir())


def child(*words: str) -> Ready:
    """Ready once a process below the benchmark runs a command holding every word."""

    def ready(proc: subprocess.Popen) -> bool:
        return any(all(w in p.cmdline for w in words) for p in descendants(proc.pid).values())

    return ready


def swe_tasks(tmp: Path) -> str:
    """Task files for the SWE benchmarks: they are stopped before a task is read."""
    prefix = tmp / "tasks"
    for suffix in ("", ".train", ".heldout"):
        Path(f"{prefix}{suffix}.jsonl").write_text('{"instance_id": "unused"}\n')
    return str(prefix)


KEPT_ON_PURPOSE = {"torchinductor_root", "ray"}
"""What libraries keep in the temporary root after a clean run too: torch's compiler cache,
Ray's session logs."""
TINY = ["--set", "policy.path=tiny"]
# benchmark -> (its arguments, from tmp_path; when to stop it, from its temporary root and
# its output)
CASES: dict[str, tuple[Callable[[Path], list[str]], Callable[[Path, Path], Ready]]] = {
    "step_walk": (
        lambda t: [*TINY, "--set", "train.steps=1"],
        lambda s, _log: temp_dir("agentree-walk-", s),
    ),
    "gpu_check": (
        lambda t: ["--device", "cpu", "--out", str(t / "gpu.json")],
        lambda s, _log: temp_dir("agentree-gpu-check-", s),
    ),
    "async_steps": (
        lambda t: ["--steps", "1", "--backend", "local", *TINY],
        lambda s, _log: child("agentree", "train"),
    ),
    "frozenlake_learning": (
        lambda t: ["--seeds", "0", *TINY, "--set", "train.steps=1"],
        lambda s, _log: child("agentree", "train"),
    ),
    "train_memory": (
        lambda t: ["--models", "tiny", "--ranks", "2", "--lora", "0"],
        lambda s, _log: child("multiprocessing"),
    ),
    "learning_efficiency": (  # its calibration's rollouts
        lambda t: ["--case", "frozenlake", "--calibrate", "2", "--out", str(t / "runs")],
        lambda s, _log: child("agentree", "rollout"),
    ),
    "real_model": (
        lambda t: [
            *("--policy", "tiny", "--only", "zero-shot", "--envs", "frozenlake"),
            *("--out", str(t / "real_model.json")),
        ],
        lambda s, _log: child("agentree", "eval"),
    ),
    "swe_warm_policy": (
        lambda t: ["--tasks", swe_tasks(t) + ".jsonl", "--policy", "tiny"],
        lambda s, _log: child("agentree", "eval"),
    ),
    "serve_load": (
        lambda t: ["--levels", "1", "--requests", "2"],
        lambda s, _log: child("agentree", "serve"),
    ),
    # stopped once `ray.init` returned (stopped inside it, `connect` stops what the start
    # made: tests/test_ray_resources.py)
    "ray_rollout": (
        lambda t: ["--envs", "frozenlake", "--tasks", "2", "--rounds", "1", "--workers", "1"],
        lambda s, log: printed(log, "# private Ray instance started"),
    ),
    "swe_learning": (
        lambda t: [
            *("--tasks", swe_tasks(t), "--policy", "tiny", "--rollouts", "grpo"),
            *("--seeds", "0", "--steps", "1"),
        ],
        lambda s, _log: child("agentree", "train"),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_benchmark_leaves_nothing(name: str, tmp_path: Path) -> None:
    """SIGTERM once the benchmark holds its temporary directory or runs its first child:
    it unwinds (it is not killed by the signal), its children stop, and its temporary root
    is empty. Before, each died where it stood and left both behind."""
    args, ready = CASES[name]
    # the benchmark's temporary root, where nothing else writes; short, as Ray's socket paths
    # under it must stay within 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="bs", dir="/tmp"))
    try:
        argv = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args(tmp_path)]
        log = tmp_path / "output.log"
        code, output, left = stop_when(argv, scratch, ready(scratch, log), 300, log)
        assert code not in (-signal.SIGTERM, -signal.SIGKILL), output
        running = [p.cmdline for p in left.values()]
        assert not running, f"still running: {running}\n{output}"
        kept = [p.name for p in scratch.iterdir() if p.name not in KEPT_ON_PURPOSE]
        assert not kept, f"left behind in the temporary root: {kept}\n{output}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- run_child / stop_children on real processes ---------------------------------------------
@pytest.fixture
def stray_sigterm_ignored():
    """These tests signal their own process: a signal that lands after the block under test
    is ignored instead of ending the test process."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGTERM, previous)


def child_script(tmp: Path, on_term: str) -> list[str]:
    """A child that says it started (`started.PID`) once its SIGTERM handler is in place; on
    SIGTERM it runs `on_term` (Python) and exits 0."""
    script = tmp / "child.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, pathlib, signal, sys, time
        def term(*_):
            {on_term}
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        pathlib.Path({str(tmp)!r}, f"started.{{os.getpid()}}").touch()
        time.sleep(600)
        """)
    )
    return [sys.executable, str(script)]


def until_started(tmp: Path, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while len(list(tmp.glob("started.*"))) < n:
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.05)


def stop_self_later(tmp: Path, times: int = 1) -> None:
    """SIGTERM this process once the child has started (`times` signals, 0.5 s apart)."""

    def send() -> None:
        until_started(tmp)
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.usefixtures("stray_sigterm_ignored")
def test_run_child_passes_one_sigterm_on_and_waits_for_the_child(tmp_path: Path) -> None:
    """Stopped by SIGTERM while its child runs, run_child sends the child one SIGTERM and
    waits while it cleans up (here 1 s), then the stop goes on; the child was not killed."""
    done = tmp_path / "cleaned"
    cmd = child_script(tmp_path, f"time.sleep(1); pathlib.Path({str(done)!r}).touch()")
    procs: list[subprocess.Popen] = []
    stop_self_later(tmp_path)
    with pytest.raises(KeyboardInterrupt), interrupt_on_sigterm():
        run_child(cmd, started=procs.append)
    assert done.exists()
    assert procs[0].returncode == 0  # it exited by itself, after its clean-up


@pytest.mark.usefixtures("stray_sigterm_ignored")
def test_run_child_kills_a_child_past_its_grace_or_on_a_second_stop(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "time.sleep(600)")  # takes the stop, never finishes it
    for grace, times in ((1.0, 1), (120.0, 2)):  # the grace runs out; a second stop cuts it
        for f in tmp_path.glob("started.*"):
            f.unlink()
        procs: list[subprocess.Popen] = []
        stop_self_later(tmp_path, times)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt), interrupt_on_sigterm():
            run_child(cmd, grace_s=grace, started=procs.append)
        assert procs[0].returncode == -signal.SIGKILL
        assert time.monotonic() - t0 < 30


def test_run_child_checks_and_runs_the_child_in_its_own_session() -> None:
    own = "import os; raise SystemExit(7 if os.getsid(0) == os.getpid() else 0)"
    assert run_child([sys.executable, "-c", own]) == 7
    with pytest.raises(subprocess.CalledProcessError):
        run_child([sys.executable, "-c", "raise SystemExit(3)"], check=True)


def test_stop_children_gives_them_one_grace_together(tmp_path: Path) -> None:
    """Two children that each take 5 s to stop: one SIGTERM each, about 5 s in all (waited
    for one after the other, 10)."""
    cmd = child_script(tmp_path, "time.sleep(5)")
    procs = [subprocess.Popen(cmd) for _ in range(2)]
    until_started(tmp_path, 2)
    t0 = time.monotonic()
    stop_children(procs, grace_s=30.0)
    assert [p.returncode for p in procs] == [0, 0]
    assert time.monotonic() - t0 < 8.5


def test_children_run_on_threads_are_stopped_together_and_no_more_start(tmp_path: Path) -> None:
    """Two children run from worker threads, one of which ignores its SIGTERM: `stop` from the
    main thread sends each one SIGTERM, kills the deaf one after the grace and says which; the
    threads' `run` return; a `run` after the stop starts nothing."""
    done = tmp_path / "cleaned"
    (tmp_path / "polite").mkdir(), (tmp_path / "deaf").mkdir()
    polite = child_script(tmp_path / "polite", f"pathlib.Path({str(done)!r}).touch()")
    deaf = child_script(tmp_path / "deaf", "time.sleep(600)")
    children = Children()
    codes: list[int] = []
    procs: list[subprocess.Popen] = []
    threads = [
        threading.Thread(target=lambda c=cmd: codes.append(children.run(c, started=procs.append)))
        for cmd in (polite, deaf)
    ]
    for t in threads:
        t.start()
    until_started(tmp_path / "polite"), until_started(tmp_path / "deaf")
    t0 = time.monotonic()
    live, killed = children.stop(grace_s=2.0)
    assert 2.0 <= time.monotonic() - t0 < 30
    for t in threads:
        t.join(timeout=30)
    assert set(live) == set(procs) and done.exists()
    assert [p.args for p in killed] == [deaf]
    assert sorted(codes) == [-signal.SIGKILL, 0]
    with pytest.raises(Stopping):
        children.run(polite)
    assert len(list((tmp_path / "polite").glob("started.*"))) == 1  # the refused one never ran
