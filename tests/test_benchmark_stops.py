"""A benchmark stopped by `kill` (SIGTERM) leaves nothing behind: no temporary directory and
no child process (`agentree` commands, rank processes), as Ctrl-C leaves nothing; and
`agentree.signals.run_child` / `stop_children`, through which they stop their children, on
real processes."""

from __future__ import annotations

import contextlib
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
from typing import NamedTuple

import pytest

from agentree.signals import interrupt_on_sigterm, run_child, stop_children

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "benchmarks"


class Proc(NamedTuple):
    ppid: int
    started: int  # clock ticks after boot: with the pid, names one process (pids are reused)
    zombie: bool
    cmdline: str


def processes() -> dict[int, Proc]:
    """Every process on the machine, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # the command name (field 2) may hold spaces: the fields after its ")" are fixed
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = Proc(int(fields[1]), int(fields[19]), fields[0] == "Z", cmd)
    return found


def descendants(pid: int) -> dict[int, Proc]:
    """The processes below `pid`: its children, their children, ..."""
    table, found, frontier = processes(), {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, proc in table.items():
            if proc.ppid == p and child not in found:
                found[child] = proc
                frontier.append(child)
    return found


def still_running(below: dict[int, Proc], mentions: list[str]) -> dict[int, Proc]:
    """Of the processes `below` a benchmark (when it was stopped), those still running, and
    any other process whose command line mentions one of `mentions` (a child started later)."""
    now = {pid: p for pid, p in processes().items() if not p.zombie and pid != os.getpid()}
    return {
        pid: p
        for pid, p in now.items()
        if (pid in below and below[pid].started == p.started)
        or any(m in p.cmdline for m in mentions)
    }


Ready = Callable[[subprocess.Popen], bool]
SETTLE_S = 30.0
"""How long processes below a benchmark may take to exit after it did: Ray's agents leave
by themselves a few seconds after their driver."""


def stop_when(
    argv: list[str], scratch: Path, ready: Ready, timeout: float, log: Path
) -> tuple[int, str, dict[int, Proc]]:
    """Run `argv` with `scratch` as its temporary root, SIGTERM it once `ready(proc)`, and
    return its exit status, its output and the processes still running after it ended that
    were below it when it was stopped or that mention `scratch` or `log`'s directory (all
    killed). Its output goes to `log`."""
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONUNBUFFERED": "1"}
    # the `agentree` command on the PATH, as in an activated environment
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    below: dict[int, Proc] = {}
    left: dict[int, Proc] = {}
    try:
        deadline = time.monotonic() + timeout
        while not ready(proc):
            assert proc.poll() is None, f"ended before it was stopped:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"never got going:\n{log.read_text()}"
            time.sleep(0.1)
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mentions = [str(scratch), str(log.parent)]
        settle = time.monotonic() + SETTLE_S
        while (left := still_running(below, mentions)) and time.monotonic() < settle:
            time.sleep(0.5)
        for pid in left:  # whatever the benchmark left, so that nothing outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        gone = time.monotonic() + 10  # and gone before the test removes their directories
        while still_running(left, []) and time.monotonic() < gone:
            time.sleep(0.1)
    return code, log.read_text(), left


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
# benchmark -> (its arguments, from tmp_path; when to stop it, from its temporary root)
CASES: dict[str, tuple[Callable[[Path], list[str]], Callable[[Path], Ready]]] = {
    "step_walk": (
        lambda t: [*TINY, "--set", "train.steps=1"],
        lambda s: temp_dir("agentree-walk-", s),
    ),
    "gpu_check": (
        lambda t: ["--device", "cpu", "--out", str(t / "gpu.json")],
        lambda s: temp_dir("agentree-gpu-check-", s),
    ),
    "async_steps": (
        lambda t: ["--steps", "1", "--backend", "local", *TINY],
        lambda s: child("agentree", "train"),
    ),
    "frozenlake_learning": (
        lambda t: ["--seeds", "0", *TINY, "--set", "train.steps=1"],
        lambda s: child("agentree", "train"),
    ),
    "train_memory": (
        lambda t: ["--models", "tiny", "--ranks", "2", "--lora", "0"],
        lambda s: child("multiprocessing"),
    ),
    "learning_efficiency": (  # its calibration's rollouts
        lambda t: ["--case", "frozenlake", "--calibrate", "2", "--out", str(t / "runs")],
        lambda s: child("agentree", "rollout"),
    ),
    "real_model": (
        lambda t: [
            *("--policy", "tiny", "--only", "zero-shot", "--envs", "frozenlake"),
            *("--out", str(t / "real_model.json")),
        ],
        lambda s: child("agentree", "eval"),
    ),
    "swe_warm_policy": (
        lambda t: ["--tasks", swe_tasks(t) + ".jsonl", "--policy", "tiny"],
        lambda s: child("agentree", "eval"),
    ),
    "serve_load": (
        lambda t: ["--levels", "1", "--requests", "2"],
        lambda s: child("agentree", "serve"),
    ),
    "ray_rollout": (  # stopped by Ray's own SIGTERM handling once `ray.init` ran
        lambda t: ["--envs", "frozenlake", "--tasks", "2", "--rounds", "1", "--workers", "1"],
        lambda s: child("raylet"),
    ),
    "swe_learning": (
        lambda t: [
            *("--tasks", swe_tasks(t), "--policy", "tiny", "--rollouts", "grpo"),
            *("--seeds", "0", "--steps", "1"),
        ],
        lambda s: child("agentree", "train"),
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
        argv = [sys.executable, str(BENCH / f"{name}.py"), *args(tmp_path)]
        log = tmp_path / "output.log"
        code, output, left = stop_when(argv, scratch, ready(scratch), 300, log)
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
