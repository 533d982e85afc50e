"""Nothing is left behind: Ctrl-C, SIGTERM, a closed terminal and exceptions mid-episode, and
crashed runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from helpers import interruptible
from swe_support import assert_no_leftovers, local_records_fixture, owned_by  # noqa: F401

from agentree.envs.swe import runtime

pytestmark = pytest.mark.docker

CHILD = """
import sys
from agentree.envs.swe.env import SWEEnv
from agentree.envs.swe import runtime

mode = sys.argv[1]
task = SWEEnv.load_tasks("local")[0]
env, twin = SWEEnv(), SWEEnv()
env.reset(options=task.options)
print(runtime.session_id(), flush=True)
states = []
for i in range(10_000):
    env.step(f"```bash\\necho {i} >> log.txt\\n```")
    states.append(env.snapshot())
    twin.restore(states[i // 2])
    if i == 3:
        print("ready", flush=True)
    if i == 5 and mode == "raise":
        raise RuntimeError("boom mid-episode")
"""


def _start(mode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    session = proc.stdout.readline().strip()
    assert session, proc.stderr.read()
    if mode != "raise":
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        containers, images = owned_by(session)
        assert containers and images  # the run really holds Docker resources
    return proc, session


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for the child (killed if it outlives `timeout`); its stderr."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.stderr.read()


@pytest.mark.parametrize(
    ("mode", "sig", "code"),
    [
        ("loop", signal.SIGINT, -signal.SIGINT),
        ("loop", signal.SIGTERM, 128 + signal.SIGTERM),
        ("loop", signal.SIGHUP, 128 + signal.SIGHUP),  # the terminal closed
        ("raise", None, 1),
    ],
)
def test_interrupted_or_failing_run_leaves_nothing(local_records, mode, sig, code):
    proc, session = _start(mode)
    if sig is not None:
        time.sleep(0.3)
        proc.send_signal(sig)
    err = _finish(proc, timeout=120)
    assert proc.returncode == code, err
    if mode == "raise":
        assert "boom mid-episode" in err
    assert owned_by(session) == ([], [])


def test_cleanup_removes_what_a_killed_run_left(local_records):
    proc, session = _start("loop")
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=30)
    containers, images = owned_by(session)
    assert containers and images
    report = runtime.cleanup()  # default: this session plus runs whose process is gone
    assert not report.errors
    # cleanup removed the run's resources (one caught mid-removal at the kill may vanish by
    # itself), and nothing of the run remains
    assert report.containers and report.images
    assert owned_by(session) == ([], [])
    assert_no_leftovers()


STUCK = """
import threading
from agentree.envs.swe.env import SWEEnv
from agentree.envs.swe import runtime, store

store.EXIT_WAIT_S = 2.0
task = SWEEnv.load_tasks("local")[0]
env = SWEEnv()
env.reset(options=task.options)
for i in range(3):
    env.step(f"```bash\\necho {i} >> log.txt\\n```")
    env.restore(env.snapshot())
print(runtime.session_id(), flush=True)
# every container removal from here on blocks for good: a request the daemon never answers, or
# a lock an interrupt left held
store._remove_container = lambda *a: threading.Event().wait()
env.restore(env.snapshot())  # the replaced container is removed in the background
raise RuntimeError("boom with Docker stuck")
"""


def test_a_stuck_background_docker_call_does_not_hold_up_exit(local_records):
    """The store's background Docker calls do not keep a finished run alive: exit waits for
    them at most `EXIT_WAIT_S`, then sweeps by label what they left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    session = proc.stdout.readline().strip()
    assert session, proc.stderr.read()
    err = _finish(proc, timeout=90)
    assert proc.returncode == 1, err
    assert "boom with Docker stuck" in err
    assert owned_by(session) == ([], [])
