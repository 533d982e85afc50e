"""Docker plumbing shared by the SWE sandboxes: one client, resource labels, and cleanup.

Every container and snapshot image agentree creates carries `agentree=1`, the kind
(`agentree.kind`), the creating process's session id (`agentree.session`) and its owner
(`agentree.owner` = host:pid). That lets a process remove exactly what it made (at exit, on
SIGTERM, after Ctrl-C unwinds) and lets `cleanup()` remove what a crashed run left behind
without touching the resources of runs that are still alive.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentree.signals import exit_on_sigterm

LABEL = "agentree"
KIND = "agentree.kind"
SESSION = "agentree.session"
OWNER = "agentree.owner"

# kinds: "sandbox" (agent or grading containers), "build" (image builds), "snapshot" (images
# made by Sandbox.snapshot), "image" (cached base/local-suite images, kept by cleanup)
REMOVABLE_IMAGE_KINDS = ("snapshot",)

SETTLE_S = 0.5
"""Pause between cleanup sweeps (see `cleanup`)."""

CLIENT_TIMEOUT_S = 1800
"""HTTP timeout of the Docker client; exec output is streamed, so this bounds silence, and the
sandbox enforces its own (shorter) command deadlines."""
EXIT_TIMEOUT_S = 60
"""HTTP timeout of the exit sweep's client."""


class DockerUnavailable(RuntimeError):
    """The Docker daemon cannot be reached."""


_lock = threading.RLock()
_client: Any = None
_session: tuple[int, str] | None = None
_hooks_installed = False
_sigterm_installed = False
_exit_callbacks: list[Any] = []


def session_id() -> str:
    """This process's id on every resource it creates (a new one after fork)."""
    global _session
    pid = os.getpid()
    with _lock:
        if _session is None or _session[0] != pid:
            _session = (pid, uuid.uuid4().hex[:12])
        return _session[1]


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def labels(kind: str, **extra: str) -> dict[str, str]:
    """Labels for a new resource of `kind` owned by this process."""
    return {LABEL: "1", KIND: kind, SESSION: session_id(), OWNER: owner(), **extra}


def client() -> Any:
    """The process-wide Docker client (thread-safe); raises `DockerUnavailable` with a fix."""
    global _client
    with _lock:
        if _client is not None:
            return _client
        try:
            # deferred: docker is the optional [swe] extra
            import docker
        except ImportError:
            raise DockerUnavailable(
                "the Docker SDK is not installed; install the SWE extras: "
                "pip install 'agentree[swe]'"
            ) from None
        try:
            c = docker.from_env(timeout=CLIENT_TIMEOUT_S, max_pool_size=64)
            c.ping()
        except Exception as e:
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DockerUnavailable(
                f"cannot reach the Docker daemon ({reason}); start it (as root: "
                "`nohup dockerd >/var/log/dockerd.log 2>&1 &`, or run .ci/setup_docker.sh) "
                "or point DOCKER_HOST at a running one"
            ) from None
        _client = c
        _install_exit_hooks()
        return c


def on_exit(callback: Any) -> None:
    """Run `callback()` before this session's resources are swept at exit."""
    with _lock:
        _exit_callbacks.append(callback)


# -- exit hooks ------------------------------------------------------------------------------
def _install_exit_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_at_exit)
    install_signal_handlers()


def install_signal_handlers() -> None:
    """Make SIGTERM end the process through atexit, so its Docker resources are removed
    (`agentree.signals.exit_on_sigterm`); called again later when the first Docker use happened
    in another thread."""
    global _sigterm_installed
    if not _sigterm_installed:
        _sigterm_installed = exit_on_sigterm()


def _at_exit() -> None:
    # A second Ctrl-C while we sweep would leave half the resources behind.
    previous = None
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for cb in list(_exit_callbacks):
            with contextlib.suppress(Exception):
                cb()
        with contextlib.suppress(Exception):
            _exit_sweep()
    finally:
        if previous is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGINT, previous)


def _exit_sweep() -> None:
    """Remove this session's resources through a client of its own, with a shorter timeout: the
    shared client's connections may still be held by background calls waiting on the daemon."""
    import docker  # deferred: docker is the optional [swe] extra

    own = docker.from_env(timeout=EXIT_TIMEOUT_S)
    try:
        cleanup(session=session_id(), stale=False, api=own.api)
    finally:
        own.close()


# -- cleanup ---------------------------------------------------------------------------------
@dataclass
class CleanupReport:
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        s = f"removed {len(self.containers)} container(s) and {len(self.images)} snapshot image(s)"
        return s + (f"; {len(self.errors)} error(s): {self.errors[0]}" if self.errors else "")


def _owner_alive(owner_label: str | None) -> bool:
    """False when the owner is a process on this host that no longer exists."""
    if not owner_label or ":" not in owner_label:
        return False
    host, _, pid = owner_label.rpartition(":")
    if host != socket.gethostname():
        return True  # another machine's run on a shared daemon: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _selected(lbls: dict[str, str], session: str | None, stale: bool, everything: bool) -> bool:
    if everything:
        return True
    if session is not None and lbls.get(SESSION) == session:
        return True
    return stale and not _owner_alive(lbls.get(OWNER))


def cleanup(
    *,
    session: str | None = None,
    stale: bool = True,
    everything: bool = False,
    dry_run: bool = False,
    passes: int = 2,
    api: Any = None,
) -> CleanupReport:
    """Remove agentree containers and snapshot images.

    Selects resources of `session`, plus (with `stale`) those whose owning process is gone, or
    (with `everything`) all of them. Cached base and local-suite images are never removed.
    A request the owner sent just before it died can still create a container after a sweep,
    so a sweep that found something is repeated after a short pause (up to `passes` sweeps).
    `api` is the low-level Docker client to use (the shared one by default).
    """
    api = api if api is not None else client().api
    report = CleanupReport()
    for i in range(1 if dry_run else passes):
        if i:
            time.sleep(SETTLE_S)
        found = len(report.containers) + len(report.images)
        _sweep(api, report, session, stale, everything, dry_run)
        if len(report.containers) + len(report.images) == found:
            break
    return report


def _sweep(
    api: Any,
    report: CleanupReport,
    session: str | None,
    stale: bool,
    everything: bool,
    dry_run: bool,
) -> None:
    # low-level listings: no per-item inspect that races with concurrent removals
    for ct in api.containers(all=True, filters={"label": LABEL}):
        if _selected(ct.get("Labels") or {}, session, stale, everything):
            name = (ct.get("Names") or [ct["Id"][:12]])[0].lstrip("/")
            report.containers.append(name)
            if not dry_run:
                try:
                    api.remove_container(ct["Id"], force=True)
                except Exception as e:
                    if "No such container" not in str(e) and "in progress" not in str(e):
                        report.errors.append(f"container {name}: {e}")
    images = [
        im["Id"]
        for im in api.images(all=True, filters={"label": LABEL})
        if (im.get("Labels") or {}).get(KIND) in REMOVABLE_IMAGE_KINDS
        and _selected(im.get("Labels") or {}, session, stale, everything)
    ]
    report.images.extend(images)
    if not dry_run:
        _remove_images(api, images, report)


def _remove_images(api: Any, images: list[str], report: CleanupReport) -> None:
    """Remove images children first: a snapshot of a restored snapshot depends on its parent."""
    pending = list(images)
    for _ in range(len(pending) + 1):
        if not pending:
            return
        left = []
        for image_id in pending:
            try:
                api.remove_image(image_id, force=True, noprune=False)
            except Exception as e:
                if "No such image" in str(e):
                    continue
                left.append((image_id, e))
        if len(left) == len(pending):
            report.errors.extend(f"image {i[7:19]}: {e}" for i, e in left)
            return
        pending = [i for i, _ in left]
