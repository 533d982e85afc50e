"""The Docker sandbox: bounded exec, fork fidelity, image lifetime, cleanup. Real containers."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from swe_support import (
    assert_no_leftovers,
    local_records_fixture,  # noqa: F401
    require_docker,
    settle,
)

from agentree.envs.swe import runtime
from agentree.envs.swe.sandbox import ImageStore, Sandbox, SandboxConfig, SandboxError

pytestmark = pytest.mark.docker


@pytest.fixture
def image(local_records):
    """A local-suite image (repo at /testbed with git history)."""
    return local_records[0]["image"]


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "local_records" in request.fixturenames or "docker" in request.fixturenames:
        assert_no_leftovers()


@pytest.fixture
def docker():
    return require_docker()


def _processes(sb: Sandbox) -> list[str]:
    """Command lines of the processes in the container (PID 1's own `sleep 3600` aside)."""
    out = sb.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done").output
    return [ln.strip() for ln in out.splitlines() if ln.strip() and ln.strip() != "sleep 3600"]


def _sleeping(sb: Sandbox) -> list[str]:
    return [p for p in _processes(sb) if p.startswith("sleep") or "sh -c sleep" in p]


STATE_CMD = (
    "git status --porcelain; cat /root/outside.txt 2>&1; ls /testbed; "
    "md5sum /testbed/*.md /etc/agentree-test.conf 2>&1; cat /testbed/new_dir/untracked.txt 2>&1"
)


# -- exec ------------------------------------------------------------------------------------
def test_exec_output_returncode_and_workdir(image):
    with Sandbox(image) as sb:
        r = sb.exec("pwd; echo out; echo err >&2; exit 3")
        assert r.returncode == 3 and not r.timed_out
        assert r.output.split() == ["/testbed", "out", "err"]
        assert sb.exec("git log --oneline | wc -l").output.strip() == "1"


def test_exec_timeout_kills_the_process_and_everything_it_started(image):
    with Sandbox(image) as sb:
        start = time.monotonic()
        r = sb.exec("echo begin; (sleep 41 &); setsid sleep 42 & sleep 43", timeout=1.5)
        assert r.timed_out and r.output.strip() == "begin"
        assert time.monotonic() - start < 1.5 + 3
        assert _sleeping(sb) == []
        # the sandbox is still usable afterwards
        assert sb.exec("echo alive").output == "alive\n"


@pytest.mark.parametrize("clear_env", [False, True])
def test_processes_escaping_the_group_are_killed(image, clear_env):
    # a setsid'd child keeps the output pipe open outside the process group (with `env -i` it
    # also sheds every marker); it must neither block the action nor outlive it
    with Sandbox(image) as sb:
        start = time.monotonic()
        holder = "env -i setsid sh -c 'sleep 60'" if clear_env else "setsid sh -c 'sleep 60'"
        r = sb.exec(f"{holder} & echo early", timeout=5)
        assert r.output == "early\n" and not r.timed_out
        assert time.monotonic() - start < 5  # not the 60 s the holder sleeps
        assert _sleeping(sb) == []


def test_stuck_action_is_ended_by_restarting_the_container(image):
    # the action stops its own wrapper shell, so nothing inside the container can end the exec
    with Sandbox(image) as sb:
        sb.exec("echo kept > /root/state.txt")
        start = time.monotonic()
        r = sb.exec("kill -STOP \"$(cut -d' ' -f4 /proc/$PPID/stat)\"; sleep 60", timeout=1)
        assert r.timed_out
        assert time.monotonic() - start < 1 + 3 + 5 + 2
        assert sb.exec("cat /root/state.txt").output == "kept\n"
        assert _sleeping(sb) == []


def test_background_processes_do_not_outlive_the_action(image):
    with Sandbox(image) as sb:
        r = sb.exec("nohup sleep 300 >/dev/null 2>&1 & echo started")
        assert r.output == "started\n" and r.elapsed < 5
        assert _sleeping(sb) == []


def test_output_is_truncated_keeping_head_and_tail(image):
    with Sandbox(image) as sb:
        r = sb.exec(
            "echo HEAD-MARK; head -c 300000 /dev/zero | tr '\\0' x; echo; echo TAIL-MARK",
            max_output=2000,
        )
        assert r.output.startswith("HEAD-MARK\n")
        assert r.output.rstrip().endswith("TAIL-MARK")
        assert "bytes of output elided" in r.output
        assert r.elided == len("HEAD-MARK\n") + 300000 + 1 + len("TAIL-MARK\n") - 2000
        assert len(r.output) < 2200


def test_network_is_off_and_limits_are_applied(image, docker):
    cfg = SandboxConfig(mem_limit="512m", cpus=0.5, pids_limit=64)
    with Sandbox(image, cfg) as sb:
        assert sb.exec("ls /sys/class/net").output.split() == ["lo"]
        info = docker.api.inspect_container(sb.container_id)
        hc = info["HostConfig"]
        assert hc["NetworkMode"] == "none"
        assert (hc["Memory"], hc["NanoCpus"], hc["PidsLimit"]) == (512 * 2**20, 5 * 10**8, 64)
        labels = info["Config"]["Labels"]
        assert labels[runtime.LABEL] == "1" and labels[runtime.SESSION] == runtime.session_id()
        assert labels[runtime.OWNER] == f"{socket.gethostname()}:{os.getpid()}"


def test_large_files_and_commands(image):
    with Sandbox(image) as sb:
        payload = "y" * 300_000
        sb.write_file("/tmp/big.txt", payload)
        assert sb.exec("wc -c < /tmp/big.txt").output.strip() == "300000"
        r = sb.exec(f"printf '%s' '{'z' * 150_000}' | wc -c")
        assert r.output.strip() == "150000"


# -- forking ---------------------------------------------------------------------------------
def _mutate_a(sb: Sandbox) -> None:
    sb.exec(
        "echo tracked-a >> README.md && mkdir -p new_dir"
        " && echo untracked-a > new_dir/untracked.txt"
        " && echo outside-a > /root/outside.txt && echo etc-a > /etc/agentree-test.conf"
    )


def _mutate_b(sb: Sandbox) -> None:
    sb.exec(
        "git rm -q -r tests && echo untracked-b > new_dir/untracked.txt && rm /root/outside.txt"
        " && echo tracked-b > README.md"
    )


@pytest.mark.parametrize("prewarm", [0, 1])
def test_fork_fidelity_repeated_out_of_order_and_cross_instance(image, prewarm):
    cfg = SandboxConfig(prewarm=prewarm)
    with Sandbox(image, cfg) as sb:
        s0 = sb.snapshot()
        want0 = sb.exec(STATE_CMD).output
        _mutate_a(sb)
        s1 = sb.snapshot()
        cid = sb.container_id
        sb.restore(s1)  # nothing ran since the commit: the container already is that state
        assert sb.container_id == cid
        want1 = sb.exec(STATE_CMD).output
        _mutate_b(sb)
        s2 = sb.snapshot()
        want2 = sb.exec(STATE_CMD).output
        assert len({want0, want1, want2}) == 3
        assert "outside-a" in want1 and "untracked-a" in want1 and "tests" not in want2.split()
        # several restores, out of order, and after the sandbox moved on
        for snap, want in [(s1, want1), (s0, want0), (s2, want2), (s1, want1), (s1, want1)]:
            sb.restore(snap)
            assert sb.exec(STATE_CMD).output == want
            sb.exec("echo scribble > README.md && rm -rf new_dir /root/outside.txt")
        # restore into a different sandbox, built from the snapshot alone
        with Sandbox(s1, cfg) as other:
            assert other.exec(STATE_CMD).output == want1
            _mutate_b(other)
            # a snapshot of a restored snapshot chains on top of it
            s3 = other.snapshot()
            sb.restore(s3)
            assert sb.exec(STATE_CMD).output == other.exec(STATE_CMD).output
        del s0, s1, s2, s3


def test_snapshot_images_are_freed_when_unreferenced(image, docker):
    store = settle()
    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        sb.exec("echo 1 > /root/a")
        parent = sb.snapshot()
        sb.exec("true")  # so the restore really swaps in a container from the snapshot
        sb.restore(parent)
        sb.exec("echo 2 > /root/a")
        child = sb.snapshot()
        ids = parent.image_id, child.image_id

        def exists(i):
            try:
                docker.api.inspect_image(i)
                return True
            except Exception:
                return False

        assert all(map(exists, ids))
        parent_id = parent.image_id
        del parent
        settle()
        # the child image (and the container running from the parent) still need the parent
        assert exists(parent_id)
        sb.exec("true")
        sb.restore(child)
        del child
        settle()
        assert exists(ids[1])  # the sandbox's container runs from it
    settle()
    assert not exists(ids[0]) and not exists(ids[1])
    assert store.stats()["images"] == 0


def test_released_snapshot_cannot_be_restored(image):
    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        snap = sb.snapshot()
        snap.release()
        settle()
        with pytest.raises(SandboxError, match="already removed"):
            sb.restore(snap)


def test_deep_snapshot_chains_are_flattened(image):
    # the image has 2 layers: snapshots 1 and 2 stack on it, the 3rd is flattened, the 4th
    # stacks on the flattened one
    cfg = SandboxConfig(prewarm=0, max_layers=4)
    with Sandbox(image, cfg) as sb:
        snaps = []
        for i in range(4):
            sb.exec(f"echo {i} >> /root/chain.txt")
            snaps.append(sb.snapshot())
            sb.exec("true")  # so the restore really swaps in a container from the snapshot
            sb.restore(snaps[-1])
        assert [s.node.depth for s in snaps] == [3, 4, 1, 2]
        assert snaps[2].node.parent is None
        assert sb.exec("cat /root/chain.txt").output.split() == ["0", "1", "2", "3"]
        assert sb.exec("pwd; git status --porcelain").output.strip() == "/testbed"
        sb.restore(snaps[1])
        assert sb.exec("cat /root/chain.txt").output.split() == ["0", "1"]
        del snaps


def test_concurrent_sandboxes_from_threads(image):
    def work(i: int) -> bool:
        with Sandbox(image) as sb:
            sb.exec(f"echo {i} > mine.txt")
            snap = sb.snapshot()
            sb.exec("echo other > mine.txt")
            with Sandbox(snap) as twin:
                ok = twin.exec("cat mine.txt").output.strip() == str(i)
            sb.restore(snap)
            return ok and sb.exec("cat mine.txt").output.strip() == str(i)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(6)))


# -- failures and cleanup --------------------------------------------------------------------
def test_killed_container_is_restarted_removed_container_is_a_clear_error(image, docker):
    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        sb.exec("echo keep > /root/state.txt")
        docker.api.kill(sb.container_id)
        # a killed container keeps its filesystem: the sandbox starts it again
        assert sb.exec("cat /root/state.txt").output == "keep\n"
        snap = sb.snapshot()
        docker.api.remove_container(sb.container_id, force=True)
        with pytest.raises(SandboxError, match="no longer exists"):
            sb.exec("true")
        sb.restore(snap)  # a snapshot brings it back
        assert sb.exec("cat /root/state.txt").output == "keep\n"
        del snap


def test_missing_image_is_a_clear_error(docker):
    with pytest.raises(SandboxError, match="not available locally"):
        Sandbox("agentree-test/does-not-exist:never")


def test_cleanup_removes_what_dead_runs_left(image, docker):
    # a container and a snapshot image as a crashed process would leave them
    dead = f"{socket.gethostname()}:{_dead_pid()}"
    labels = runtime.labels("sandbox") | {runtime.SESSION: "deadbeef0000", runtime.OWNER: dead}
    ct = docker.api.create_container(image, "true", labels=labels)
    img = docker.api.commit(
        ct["Id"],
        repository="agentree-snapshot",
        tag="deadbeef0000-1",
        changes=[
            f"LABEL {runtime.KIND}=snapshot {runtime.SESSION}=deadbeef0000 {runtime.OWNER}={dead}"
        ],
    )
    with Sandbox(image) as alive:
        dry = runtime.cleanup(dry_run=True)
        assert ct["Id"][:12] in {docker.api.inspect_container(n)["Id"][:12] for n in dry.containers}
        assert img["Id"] in dry.images
        report = runtime.cleanup()
        assert not report.errors
        with pytest.raises(Exception, match="No such"):
            docker.api.inspect_container(ct["Id"])
        with pytest.raises(Exception, match="No such"):
            docker.api.inspect_image(img["Id"])
        # the live run's container is untouched
        assert alive.exec("echo still here").output == "still here\n"
    # cached images are never removed
    assert docker.api.inspect_image(image)


def test_cli_cleanup_and_build_local(local_records):
    env = dict(os.environ)
    run = [sys.executable, "-m", "agentree.commands.swe", "swe"]
    r = subprocess.run([*run, "cleanup", "--dry-run"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "would remove" in r.stdout
    r = subprocess.run([*run, "build-local"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "up to date" in r.stdout
    r = subprocess.run([*run, "build-local", "--only", "nope"], capture_output=True, text=True)
    assert r.returncode == 1 and "not in the local suite" in r.stderr


def test_unclosed_sandbox_is_collected(image):
    sb = Sandbox(image, SandboxConfig(prewarm=0))
    cid = sb.container_id
    del sb
    gc.collect()
    settle()
    with pytest.raises(Exception, match="No such"):
        runtime.client().api.inspect_container(cid)
    assert ImageStore.get().stats()["pending"] == 0


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
