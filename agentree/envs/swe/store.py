"""Sandbox containers and snapshot images: creation, reference counting, prewarmed spares.

Image lifetime. Images live in the process-wide `ImageStore` with reference counts: every
`Snapshot` handle, every container started from the image and every snapshot committed on top of
it holds one reference. At zero a snapshot image is removed and its parent's reference dropped.
Handles release their reference when garbage collected (or on `Snapshot.release()`), so a rollout
tree that drops a branch's state frees its image without bookkeeping; whatever is still alive at
exit is swept by label (see `runtime`).

Restore latency. Forking costs one restore, so the store keeps `prewarm` started spare
containers per image that is in use (a spare is identical to a fresh container from its image:
nothing ran in it). Spares hold no reference and are dropped when their image's count reaches 0.

The store is thread-safe; its removals and spare starts run on a few daemon threads. At exit
the store waits for them (at most `EXIT_WAIT_S`) and the exit sweep removes by label whatever
they left unfinished (see `runtime`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from agentree.envs.swe import runtime

SNAPSHOT_REPO = "agentree-snapshot"
MAX_LAYERS = 100
"""overlay2 refuses images deeper than 125 layers; a deeper snapshot chain is flattened."""
MAX_SPARES = 16
"""Cap on prewarmed spare containers across the process."""
SPARE_WAIT_S = 2.0
"""Longest a restore waits for a spare that is being started instead of starting its own."""
REFILL_DELAY_S = 0.2
"""Delay before a spare taken by a restore is replaced and the replaced container removed, so
the first command after a restore does not compete with that work in the daemon."""

EXIT_WAIT_S = 30.0
"""Longest the exit waits for background removals and spare starts before it sweeps."""
WORKERS = 4
"""Threads running the store's background Docker calls."""

# PID 1 of every sandbox: a bash loop, because bash reaps the orphans it adopts and
# `kill -9 -1` (which spares PID 1) then only restarts its sleep.
_INIT = ["bash", "-c", "while :; do sleep 3600 & wait $!; done"]


class SandboxError(RuntimeError):
    """The sandbox cannot run the request (container gone, image missing, Docker error)."""


@dataclass(frozen=True)
class SandboxConfig:
    """How sandbox containers are started."""

    workdir: str = "/testbed"
    network: bool = False
    """Containers get no network unless this is set."""
    mem_limit: str = "4g"
    """Memory limit (also the memory+swap limit, so no swapping)."""
    cpus: float = 1.0
    pids_limit: int = 1024
    env: tuple[tuple[str, str], ...] = ()
    """Environment for every exec (name, value) pairs."""
    prewarm: int = 1
    """Spare started containers kept per image in use, so a restore swaps instead of starting."""
    max_layers: int = MAX_LAYERS

    def container_key(self) -> tuple:
        """What a spare container must match to stand in for a fresh one."""
        return (self.workdir, self.network, self.mem_limit, self.cpus, self.pids_limit)


# -- image store -----------------------------------------------------------------------------
@dataclass(eq=False)
class _Image:
    id: str
    parent: _Image | None
    owned: bool  # a snapshot this process committed: removed when unreferenced
    depth: int  # filesystem layers
    refs: int = 0
    freed: bool = False
    spares: dict[tuple, list[str]] = field(default_factory=dict)
    warming: dict[tuple, int] = field(default_factory=dict)  # scheduled spares
    starting: dict[tuple, int] = field(default_factory=dict)  # spares being started now


class ImageStore:
    """Reference-counted images shared by all sandboxes of the process (thread-safe)."""

    _instance: ImageStore | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> ImageStore:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
                runtime.on_exit(cls._instance.shutdown)
            return cls._instance

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._spare_ready = threading.Condition(self._lock)
        self._images: dict[str, _Image] = {}
        self._workers: _Workers | None = None
        self._pending: set[Future] = set()
        # Garbage-collector callbacks (dropped handles, unclosed sandboxes) only queue their
        # work here: they can run inside any locked region, so taking locks there could
        # deadlock. The queue is drained at the next store operation (or flush/exit).
        self._deferred: collections.deque[tuple] = collections.deque()
        self._closing = False
        self._counter = 0
        self.errors: list[str] = []

    # references ----------------------------------------------------------------------------
    def base(self, name: str) -> _Image:
        """The node of an existing image (never removed by the store)."""
        api = runtime.client().api
        try:
            info = api.inspect_image(name)
        except Exception as e:
            if "No such image" in str(e) or getattr(e, "status_code", None) == 404:
                raise SandboxError(
                    f"Docker image {name!r} is not available locally; build it (`agentree swe "
                    f"build-local` for the bundled suite) or pull it (`docker pull {name}`)"
                ) from None
            raise SandboxError(f"cannot inspect image {name!r}: {e}") from e
        with self._lock:
            node = self._images.get(info["Id"])
            if node is None:
                depth = len(info.get("RootFS", {}).get("Layers", []))
                node = self._images[info["Id"]] = _Image(info["Id"], None, False, depth)
            return node

    def acquire(self, node: _Image) -> None:
        with self._lock:
            if node.freed:
                raise SandboxError(f"snapshot image {node.id[:19]} was already removed")
            node.refs += 1

    def release_later(self, node: _Image) -> None:
        """Drop a reference from a garbage-collector callback (lock-free)."""
        self._deferred.append(("release", node))

    def discard_later(self, cid: str, node: _Image, origin: _Image) -> None:
        self._deferred.append(("discard", cid, node, origin))

    def drain(self) -> None:
        """Carry out the work queued by garbage-collector callbacks."""
        while True:
            try:
                item = self._deferred.popleft()
            except IndexError:
                return
            if item[0] == "release":
                self.release(item[1])
            else:
                self.discard(item[1], item[2], wait=False)
                self.release(item[3])

    def release(self, node: _Image) -> None:
        with self._lock:
            node.refs -= 1
            if node.refs > 0:
                return
            spares = [cid for ids in node.spares.values() for cid in ids]
            node.spares.clear()
            if node.owned:
                node.freed = True
                self._images.pop(node.id, None)
            elif not spares:
                return
        self._submit(self._free, node, spares)

    def _free(self, node: _Image, spares: list[str]) -> None:
        api = runtime.client().api
        for cid in spares:
            _remove_container(api, cid, self.errors)
        if node.owned:
            try:
                api.remove_image(node.id, force=False, noprune=False)
            except Exception as e:
                if "No such image" not in str(e):
                    self.errors.append(f"image {node.id[:19]}: {e}")
            if node.parent is not None:
                self.release(node.parent)

    # containers ----------------------------------------------------------------------------
    def start(self, node: _Image, cfg: SandboxConfig) -> str:
        """A started container from `node` (a prewarmed spare when one is ready)."""
        self.drain()
        key = cfg.container_key()
        with self._lock:
            if node.freed:
                raise SandboxError(f"snapshot image {node.id[:19]} was already removed")
            # A spare already being started (say, right after the snapshot) is ready sooner
            # than a second container started now next to it.
            self._spare_ready.wait_for(
                lambda: node.spares.get(key) or not node.starting.get(key), timeout=SPARE_WAIT_S
            )
            if node.freed:
                raise SandboxError(f"snapshot image {node.id[:19]} was already removed")
            spares = node.spares.get(key)
            cid = spares.pop() if spares else None
            node.refs += 1  # held by the container until it is discarded
        if cid is None:
            try:
                cid = _create_container(node.id, cfg)
            except BaseException:
                self.release(node)
                raise
        self.prewarm(node, cfg, delay=REFILL_DELAY_S)
        return cid

    def discard(self, cid: str, node: _Image, *, wait: bool, delay: float = 0.0) -> None:
        """Remove a container and drop its reference (now, or in the background)."""
        if wait:
            self._discard(cid, node, 0.0)
        else:
            self._submit(self._discard, cid, node, delay)

    def _discard(self, cid: str, node: _Image, delay: float) -> None:
        try:
            time.sleep(delay)
            _remove_container(runtime.client().api, cid, self.errors)
        finally:
            self.release(node)

    def prewarm(self, node: _Image, cfg: SandboxConfig, delay: float = 0.0) -> None:
        if cfg.prewarm <= 0:
            return
        key = cfg.container_key()
        with self._lock:
            if node.freed or self._closing:
                return
            have = len(node.spares.get(key, ())) + node.warming.get(key, 0)
            total = sum(
                sum(map(len, n.spares.values())) + sum(n.warming.values())
                for n in self._images.values()
            )
            need = min(cfg.prewarm - have, MAX_SPARES - total)
            for _ in range(max(need, 0)):
                node.warming[key] = node.warming.get(key, 0) + 1
                node.refs += 1  # keeps the image while the spare is being made
                if delay <= 0:  # counts as starting at once, so a restore right now waits for it
                    node.starting[key] = node.starting.get(key, 0) + 1
                self._submit(self._make_spare, node, cfg, key, delay)

    def _make_spare(self, node: _Image, cfg: SandboxConfig, key: tuple, delay: float) -> None:
        cid = None
        counted = delay <= 0  # `prewarm` already counted it as starting
        started = False
        try:
            if delay > 0:
                time.sleep(delay)
                with self._lock:
                    counted = True
                    node.starting[key] = node.starting.get(key, 0) + 1
            with self._lock:
                started = not self._closing and node.refs > 1
            if started:
                cid = _create_container(node.id, cfg)
        except Exception as e:
            self.errors.append(f"spare for {node.id[:19]}: {e}")
        finally:
            with self._lock:
                node.warming[key] -= 1
                if counted:
                    node.starting[key] -= 1
                if cid is not None and not self._closing and node.refs > 1:
                    node.spares.setdefault(key, []).append(cid)
                    cid = None
                self._spare_ready.notify_all()
            if cid is not None:
                _remove_container(runtime.client().api, cid, self.errors)
            self.release(node)

    # snapshots -----------------------------------------------------------------------------
    def commit(self, cid: str, parent: _Image, cfg: SandboxConfig) -> _Image:
        """Commit a container to a new snapshot image (flattened if the chain got too deep)."""
        self.drain()
        if parent.depth + 1 > cfg.max_layers:
            return self._flatten(cid, cfg)
        api = runtime.client().api
        with self._lock:
            self._counter += 1
            tag = f"{runtime.session_id()}-{self._counter}"
        # No pause (freeze) needed: between actions nothing runs in a sandbox but PID 1's sleep
        # (the wrapper kills every leftover process), and sandbox methods are serialised.
        res = api.commit(
            cid, repository=SNAPSHOT_REPO, tag=tag, changes=_label_changes(), pause=False
        )
        with self._lock:
            parent.refs += 1  # the child image's layers sit on the parent's
            node = self._images[res["Id"]] = _Image(res["Id"], parent, True, parent.depth + 1)
        return node

    def _flatten(self, cid: str, cfg: SandboxConfig) -> _Image:
        """Export the container's filesystem into a one-layer image with the same config."""
        api = runtime.client().api
        conf = api.inspect_container(cid)["Config"]
        changes = [
            f"ENV {k}={json.dumps(v)}" for k, _, v in (e.partition("=") for e in conf["Env"])
        ]
        changes += [f"WORKDIR {conf.get('WorkingDir') or '/'}", *_label_changes()]
        with self._lock:
            self._counter += 1
            tag = f"{runtime.session_id()}-{self._counter}"
        with tempfile.TemporaryDirectory(prefix="agentree-flatten-") as tmp:
            path = f"{tmp}/fs.tar"
            with open(path, "wb") as f:
                for chunk in api.export(cid):
                    f.write(chunk)
            api.import_image(src=path, repository=SNAPSHOT_REPO, tag=tag, changes=changes)
        image_id = api.inspect_image(f"{SNAPSHOT_REPO}:{tag}")["Id"]
        with self._lock:
            node = self._images[image_id] = _Image(image_id, None, True, 1)
        return node

    # background work -----------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._workers is None:
                self._workers = _Workers(WORKERS)
            fut = self._workers.submit(fn, *args)
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        if fut.exception() is not None:
            self.errors.append(repr(fut.exception()))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until background removals and prewarming are finished."""
        self.drain()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for fut in pending:
                with contextlib.suppress(Exception):
                    fut.result(timeout=max(deadline - time.monotonic(), 0.01))

    def stats(self) -> dict[str, int]:
        self.drain()
        with self._lock:
            return {
                "images": sum(n.owned for n in self._images.values()),
                "spares": sum(len(v) for n in self._images.values() for v in n.spares.values()),
                "pending": len(self._pending),
            }

    def shutdown(self) -> None:
        """Stop prewarming and finish pending work (the exit sweep removes the rest)."""
        with self._lock:
            self._closing = True
        self.flush(timeout=EXIT_WAIT_S)


class _Workers:
    """Daemon threads for the store's background Docker calls.

    Not a `ThreadPoolExecutor`: the interpreter joins its threads at shutdown, before atexit
    runs, so one Docker call that never returns (a daemon that stopped answering, a connection
    pool an interrupt left locked) would keep a finished process alive and its sandboxes behind.
    These threads end with the process; the exit sweep removes what they left unfinished.
    """

    def __init__(self, n: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._run, daemon=True, name=f"agentree-docker-{i}").start()

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)


def _label_changes() -> list[str]:
    lbl = runtime.labels("snapshot")
    return ["LABEL " + " ".join(f"{k}={v}" for k, v in lbl.items())]


def _create_container(image: str, cfg: SandboxConfig) -> str:
    api = runtime.client().api
    host_config = api.create_host_config(
        network_mode="bridge" if cfg.network else "none",
        mem_limit=cfg.mem_limit,
        memswap_limit=cfg.mem_limit,
        nano_cpus=int(cfg.cpus * 1e9),
        pids_limit=cfg.pids_limit,
    )
    ct = api.create_container(
        image,
        entrypoint=_INIT,
        command=[],
        working_dir=cfg.workdir,
        hostname="sandbox",
        labels=runtime.labels("sandbox"),
        host_config=host_config,
        network_disabled=not cfg.network,
    )
    try:
        api.start(ct["Id"])
    except BaseException:
        _remove_container(api, ct["Id"], [])
        raise
    return ct["Id"]


def _remove_container(api: Any, cid: str, errors: list[str]) -> None:
    try:
        api.remove_container(cid, force=True)
    except Exception as e:
        msg = str(e)
        if "No such container" not in msg and "is already in progress" not in msg:
            errors.append(f"container {cid[:12]}: {msg}")


# -- snapshot handle -------------------------------------------------------------------------
class Snapshot:
    """A committed sandbox filesystem; restorable into any sandbox, any number of times.

    Holds one reference on its image, released when the handle is garbage collected or on
    `release()`. Copying returns the same handle (it is immutable).
    """

    __slots__ = ("__weakref__", "_finalizer", "_store", "node")

    def __init__(self, node: _Image, store: ImageStore) -> None:
        store.acquire(node)
        self.node = node
        self._finalizer = weakref.finalize(self, store.release_later, node)
        self._store = store

    @property
    def image_id(self) -> str:
        return self.node.id

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Drop this handle's reference now (idempotent)."""
        self._finalizer()
        self._store.drain()

    def __copy__(self) -> Snapshot:
        return self

    def __deepcopy__(self, memo: dict) -> Snapshot:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a Snapshot is a live Docker image handle and cannot be pickled")

    def __repr__(self) -> str:
        return f"Snapshot({self.node.id[7:19]}, depth={self.node.depth})"
