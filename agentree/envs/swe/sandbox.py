"""A Docker sandbox: bounded `exec`, and `snapshot`/`restore` through `docker commit`.

Fork model. Actions are stateless shell commands (anything an action leaves running is killed
when it returns), so a sandbox's whole state is its filesystem. `snapshot()` commits the
container to an image; `restore()` swaps in a container started from that image and removes the
old one in the background. A snapshot can be restored into any sandbox, any number of times, in
any order. (Docker bind-mounts /etc/hostname, /etc/hosts and /etc/resolv.conf into every
container; edits to those three files are not part of a snapshot.) Images and containers are
managed by `agentree.envs.swe.store` (reference-counted snapshots, prewarmed spares).
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from agentree.envs.swe import runtime
from agentree.envs.swe.store import (
    REFILL_DELAY_S,
    ImageStore,
    SandboxConfig,
    SandboxError,
    Snapshot,
)

__all__ = [
    "ExecResult",
    "ImageStore",
    "OutputLost",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Snapshot",
]

KILL_GRACE_S = 3.0
"""Extra time an exec gets beyond its timeout before the host side kills everything."""

MAX_ARG = 64 * 1024
"""Commands longer than this go through a script file (Linux caps one argument at 128 KiB)."""

# Runs the command under `timeout` (which SIGKILLs the command's process group), stderr merged
# into stdout, then kills every other process in the container: after an action returns only
# its filesystem effects remain, so the filesystem is the whole state and a commit a faithful
# fork. (Sandbox methods are serialised, so no other action is running.) The output is framed by
# a line with the exec's nonce before the command and one with the nonce and the exit status
# after it: output that arrives without both was cut in transit, and says so (`OutputLost`)
# instead of passing for what the command printed.
_WRAPPER = r"""printf '%s\n' "$4"
if [ -n "$3" ]; then
  timeout -s KILL "$2" bash -l "$3" 2>&1
else
  timeout -s KILL "$2" bash -lc "$1" 2>&1
fi
rc=$?
[ -n "$3" ] && rm -f "$3"
kill -9 -1 2>/dev/null
printf '\n%s %d\n' "$4" "$rc"
exit $rc
"""

EXEC_ATTEMPTS = 3
"""Tries of one command whose container stops under it (restarted in between)."""
_STOPPED = re.compile(
    r"is not running|cannot exec in a \w+ (?:state|container)|OCI runtime exec failed"
    r"|No such exec instance|^task [0-9a-f]+ not found|ttrpc: closed",
    re.M,
)


def _container_stopped(text: str) -> bool:
    """Docker's words for an exec that could not start because the container is stopping."""
    return bool(_STOPPED.search(text))


class OutputLost(SandboxError):
    """A command ran but its output did not arrive whole (it must not be read as its output)."""


def exec_stream(api: Any, exec_id: str) -> Any:
    """Start exec `exec_id` attached; an iterator over its output (stdout and stderr frames'
    payloads, in order) with a `close()` that ends it from another thread.

    docker-py's own `exec_start(stream=True)` loses output under load: the daemon answers with
    `101 UPGRADED` and then writes the output frames on the same connection; `http.client`
    reads the headers through a buffered reader that takes up to 8 KiB from the socket, so
    frames that arrived with the headers sit in that buffer, and docker-py then reads the raw
    socket beneath it (docker/docker-py#3332): the command's first output, often all of it, is
    gone while the exit status says success. Here the frames are read through that same
    buffered reader.
    """
    # deferred: docker is the optional [swe] extra
    from docker.types import CancellableStream

    res = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(res)
    reader = res.raw._fp.fp  # the reader the headers were parsed with (it may hold frames)
    if not isinstance(reader, io.BufferedReader):  # an SSH channel: docker-py's own reading
        return CancellableStream(api._read_from_socket(res, stream=True, tty=False), res)
    api._disable_socket_timeout(reader.raw)  # commands keep their own deadline (`exec`)
    return CancellableStream(_frames(reader), res)


def _frames(reader: Any) -> Any:
    """Payloads of Docker's multiplexed stream: 8-byte headers (stream, 3 zero bytes, payload
    length, big-endian) each followed by that many bytes."""
    while True:
        header = reader.read(8)
        if len(header) < 8:
            return
        length = struct.unpack(">BxxxL", header)[1]
        data = reader.read(length) if length else b""
        if data:
            yield data
        if len(data) < length:
            return


@dataclass
class ExecResult:
    output: str
    returncode: int
    timed_out: bool = False
    elapsed: float = 0.0
    elided: int = 0
    """Bytes of output dropped from the middle (head and tail are kept)."""


# -- sandbox ---------------------------------------------------------------------------------
class Sandbox:
    """One running container with the repository at `config.workdir`.

    `image` is an image name or a `Snapshot` (start from a forked state). Methods are
    serialised by a per-sandbox lock; different sandboxes can be used from different threads.
    """

    def __init__(self, image: str | Snapshot, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._lock = threading.RLock()
        self._store = ImageStore.get()
        node = self._store.base(image) if isinstance(image, str) else image.node
        self._cid: str | None = self._store.start(node, self.config)
        self._node = node
        self._origin = node  # what `recreate` starts from; referenced until close
        self._store.acquire(node)
        # The image whose filesystem the container still has unchanged (nothing ran since it
        # started or was committed): restoring that image again is then a no-op.
        self._pristine: Any = node

    @property
    def container_id(self) -> str:
        if self._cid is None:
            raise SandboxError("the sandbox is closed")
        return self._cid

    @property
    def closed(self) -> bool:
        return self._cid is None

    # commands ------------------------------------------------------------------------------
    def exec(
        self,
        command: str,
        timeout: float = 60.0,
        *,
        max_output: int = 10_000,
        read_only: bool = False,
    ) -> ExecResult:
        """Run `bash -lc command` in the workdir; kill it (and its children) at `timeout`.

        Output is stdout and stderr interleaved; beyond `max_output` bytes the middle is
        replaced by a marker (head and tail kept). Output that did not arrive whole raises
        `OutputLost`; with `read_only` (the command changes nothing, so running it again is
        safe) it is first run again, up to `EXEC_ATTEMPTS` times.
        """
        with self._lock:
            api = runtime.client().api
            self._pristine = None
            for attempt in range(EXEC_ATTEMPTS):
                last = attempt == EXEC_ATTEMPTS - 1
                try:
                    res, started, whole = self._exec(api, command, timeout, max_output)
                except SandboxError:
                    raise
                except Exception as e:
                    stopped = _container_stopped(str(e)) or self._stopped(api)
                    if not stopped or last:
                        raise self._error(e) from None
                    self._restart(api)
                    continue
                # Docker reports an exec that met a dying container as the exec's own output
                stopped = not started and res.returncode == 126
                if stopped and (_container_stopped(res.output) or self._stopped(api)):
                    if last:
                        raise SandboxError(
                            f"the sandbox container {self._cid and self._cid[:12]} keeps "
                            f"stopping: {res.output.strip()[:300]}"
                        )
                    self._restart(api)
                    continue
                if whole or res.timed_out:
                    return res
                if not read_only or last:
                    raise OutputLost(
                        f"the output of a command in sandbox {self._cid and self._cid[:12]} was "
                        f"cut in transit from Docker (exit status {res.returncode}; what "
                        f"arrived begins {res.output[:120]!r}); it is not taken for the "
                        "command's output"
                    )
            raise AssertionError("unreachable")

    def _exec(
        self, api: Any, command: str, timeout: float, max_output: int
    ) -> tuple[ExecResult, bool, bool]:
        """One exec; also whether the wrapper started (its opening line arrived) and whether
        the output arrived whole."""
        env = dict(self.config.env)
        script = ""
        if len(command.encode()) > MAX_ARG:
            script = f"/tmp/agentree-cmd-{uuid.uuid4().hex}.sh"
            self.write_file(script, command, mode=0o600)
            command = ""
        nonce = f"agentree-{uuid.uuid4().hex}"
        args = [command, f"{max(timeout, 0.1):g}", script, nonce]
        ex = api.exec_create(
            self.container_id,
            ["sh", "-c", _WRAPPER, "agentree-exec", *args],
            environment=env,
            workdir=self.config.workdir,
        )
        start = time.monotonic()
        stream = exec_stream(api, ex["Id"])
        buf = _HeadTail(max_output)
        opening = (nonce + "\n").encode()
        first = bytearray()  # the stream's first bytes until they are known to be the opening
        opened: list[bool] = []  # [True] once the opening line arrived, [False] if it did not

        done = threading.Event()

        def pump() -> None:
            try:
                for chunk in stream:
                    if not opened:
                        first.extend(chunk)
                        if len(first) < len(opening) and opening.startswith(first):
                            continue
                        opened.append(first.startswith(opening))
                        chunk = bytes(first[len(opening) :] if opened[0] else first)
                    if chunk:
                        buf.add(chunk)
            except Exception:  # the stream is closed under us after a forced kill
                pass
            finally:
                if not opened:
                    opened.append(False)
                    buf.add(bytes(first))
                done.set()

        threading.Thread(target=pump, daemon=True, name="agentree-exec").start()
        forced = False
        if not done.wait(timeout + KILL_GRACE_S):
            # The wrapper itself is stuck (e.g. a process in uninterruptible sleep): restarting
            # the container stops every process and keeps the filesystem, the sandbox's state.
            forced = True
            with contextlib.suppress(Exception):
                api.restart(self.container_id, timeout=0)
            if not done.wait(5.0):
                stream.close()
                done.wait(2.0)
        elapsed = time.monotonic() - start
        rc = api.exec_inspect(ex["Id"]).get("ExitCode")
        started = bool(opened and opened[0])
        closing = buf.take_closing(nonce) if done.is_set() else None
        if rc is None:
            rc = closing
        # Without its closing line the output is whole only if the wrapper itself was killed
        # (by the command: `kill -9 -1`, `pkill -f` matching it), which it cannot report.
        whole = started and (closing is not None or (rc is not None and rc >= 128))
        timed_out = forced or (rc in (124, 137) and elapsed >= timeout)
        data, elided = buf.result()
        text = data.decode("utf-8", errors="replace")
        if timed_out and text.endswith("Killed\n"):  # the wrapper shell's job report
            text = text[: -len("Killed\n")]
        result = ExecResult(text, -1 if rc is None else rc, timed_out, elapsed, elided)
        return result, started, whole

    def _stopped(self, api: Any) -> bool:
        """The container still exists but is not running (killed, crashed, stopping)."""
        try:
            state = api.inspect_container(self.container_id)["State"]
        except Exception:
            return False
        return not state.get("Running") or bool(state.get("Restarting"))

    def _restart(self, api: Any) -> bool:
        """A stopped container keeps its filesystem: start it again and carry on."""
        with contextlib.suppress(Exception):
            # a kill may still be under way: let it finish, or start() is a no-op on it
            api.wait(self.container_id, timeout=5)
        try:
            api.start(self.container_id)
            return True
        except Exception:
            return False

    def _error(self, e: Exception) -> SandboxError:
        if "No such container" in str(e) or getattr(e, "status_code", None) == 404:
            return SandboxError(
                f"the sandbox container {self._cid and self._cid[:12]} no longer exists "
                "(removed outside agentree?); restore a snapshot or reset the environment"
            )
        return SandboxError(f"docker error in sandbox {self._cid and self._cid[:12]}: {e}")

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Create or replace one file in the container (parent directories are created)."""
        self.write_files({path.lstrip("/"): data}, root="/", mode=mode)

    def write_files(
        self, files: dict[str, bytes | str], root: str = "/", mode: int = 0o644
    ) -> None:
        """Write `files` (paths relative to `root`) in one archive, creating directories."""
        buf = io.BytesIO()
        now = int(time.time())
        with tarfile.open(fileobj=buf, mode="w") as tar:
            dirs: set[str] = set()
            for path in files:
                parts = path.split("/")[:-1]
                dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
            for d in sorted(dirs):
                info = tarfile.TarInfo(d)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
                tar.addfile(info)
            for path, data in files.items():
                raw = data.encode() if isinstance(data, str) else data
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime = len(raw), mode, now
                tar.addfile(info, io.BytesIO(raw))
        with self._lock:
            self._pristine = None
            try:
                runtime.client().api.put_archive(self.container_id, root, buf.getvalue())
            except Exception as e:
                raise self._error(e) from None

    # forking -------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Commit the current filesystem; the handle restores it into any sandbox."""
        with self._lock:
            try:
                node = self._store.commit(self.container_id, self._node, self.config)
            except SandboxError:
                raise
            except Exception as e:
                raise self._error(e) from None
            snap = Snapshot(node, self._store)
            self._store.prewarm(node, self.config)
            self._pristine = node
            return snap

    def restore(self, snapshot: Snapshot) -> None:
        """Replace this sandbox's state with `snapshot`'s."""
        with self._lock:
            if self._cid is None:
                raise SandboxError("the sandbox is closed")
            self._store.drain()
            if snapshot.node.freed:
                raise SandboxError(f"snapshot image {snapshot.image_id[:19]} was already removed")
            if self._pristine is snapshot.node:
                return  # nothing ran since this very state was committed or started
            new = self._store.start(snapshot.node, self.config)
            old, old_node = self._cid, self._node
            self._cid, self._node, self._pristine = new, snapshot.node, snapshot.node
            self._store.discard(old, old_node, wait=False, delay=REFILL_DELAY_S)

    def recreate(self) -> None:
        """Replace the container with a fresh one from the image this sandbox started from."""
        with self._lock:
            if self._cid is None:
                raise SandboxError("the sandbox is closed")
            new = self._store.start(self._origin, self.config)
            old, old_node = self._cid, self._node
            self._cid, self._node, self._pristine = new, self._origin, self._origin
            self._store.discard(old, old_node, wait=False)

    def close(self) -> None:
        """Remove the container (idempotent)."""
        with self._lock:
            cid, self._cid = self._cid, None
        if cid is not None:
            self._store.discard(cid, self._node, wait=True)
            self._store.release(self._origin)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Best effort for sandboxes that were never closed; the exit sweep is the backstop.
        if getattr(self, "_cid", None) is not None and hasattr(self, "_origin"):
            self._store.discard_later(self._cid, self._node, self._origin)
            self._cid = None


class _HeadTail:
    """Keeps the first and last `limit // 2` bytes of a stream of any length."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 64)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.trimmed = False  # bytes between head and tail were dropped

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if len(self.head) < self.limit:
            take = self.limit - len(self.head)
            self.head += data[:take]
            data = data[take:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.limit:
                del self.tail[: len(self.tail) - self.limit]
                self.trimmed = True

    def take_closing(self, nonce: str) -> int | None:
        """Remove the wrapper's closing line (newline, nonce, exit status, newline) from the end
        of the stream; the status, or None when the stream does not end with that line."""
        # the last bytes of the stream: the tail holds at least 64 once trimmed, else the head
        # and the tail are contiguous
        end = bytes(self.tail[-96:]) if self.trimmed else (self.head[-96:] + self.tail)[-96:]
        m = re.search(rb"\n" + re.escape(nonce.encode()) + rb" (\d+)\n\Z", bytes(end))
        if m is None:
            return None
        n = len(m.group(0))
        from_tail = min(n, len(self.tail))
        del self.tail[len(self.tail) - from_tail :]
        del self.head[len(self.head) - (n - from_tail) :]
        self.total -= n
        return int(m.group(1))

    def result(self) -> tuple[bytes, int]:
        if self.total <= self.limit:
            return bytes(self.head), 0
        half = self.limit // 2
        tail = bytes(self.head[half:] + self.tail)[-(self.limit - half) :]
        elided = self.total - half - len(tail)
        marker = (
            f"\n\n[... {elided} bytes of output elided; showing the first {half} and the last "
            f"{len(tail)} ...]\n\n"
        ).encode()
        return bytes(self.head[:half]) + marker + tail, elided
