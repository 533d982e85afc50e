"""How agentree turns stop signals into exceptions, so that a stop unwinds through `finally`
blocks and atexit (checkpoints kept, partial builds and containers removed) instead of killing
the process where it stands. Signal handlers can only be installed from the main thread; from
any other thread each of these does nothing.

- `StopSignals`: a training run's. SIGINT (Ctrl-C), SIGTERM (what Slurm and Kubernetes send
  before killing a job) and SIGHUP (the terminal closed, an ssh session dropped; left alone under
  `nohup`, see `with_hangup`) raise `KeyboardInterrupt`, so the trainer checkpoints either way.
  From a step's first optimiser step to the end of the step the signal is held: a checkpoint
  then never holds weights that are half-way through an update. Before it (the rollout, the
  log-probs and gradients of a single-process update) the stop is honoured at once.
- `interrupt_on_sigterm`: SIGTERM (and SIGHUP) raises `KeyboardInterrupt` while a build or a
  fine-tune runs, so `kill` or a closed terminal cleans up or keeps what Ctrl-C does.
- `exit_on_sigterm`: SIGTERM (and SIGHUP) raises `SystemExit` (so atexit runs) where nobody else
  handles it; what the Docker sandboxes install so that their containers are removed.
- `run_child`, `stop_children`: child commands run so that a stop of this process stops them
  too: each gets one SIGTERM and time to checkpoint or remove its containers before a SIGKILL.
  `Children`: the same for children that worker threads run (a benchmark's runs on a thread
  pool), stopped together from the main thread.
- `cpu_time_limit`: SIGPROF raises `CPUTimeExceeded` once a block has used its CPU seconds; what
  the math env's equivalence check runs under, so that its verdict does not depend on how
  loaded the machine is.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def with_hangup(*signals: int) -> tuple[int, ...]:
    """`signals`, and SIGHUP where it would kill this process outright or where one of these
    handlers has it (a trainer's `StopSignals` inside a benchmark's `interrupt_on_sigterm` then
    holds it over the optimiser step, as it holds SIGTERM): the signal a closed terminal or a
    dropped ssh session sends, which stops a run as Ctrl-C does. Where SIGHUP is ignored (a
    command started with `nohup`: the user asked for it to outlive its terminal) or handled by
    someone else, it is left as it is."""
    handler = signal.getsignal(signal.SIGHUP)
    if handler is signal.SIG_DFL or getattr(handler, "__module__", None) == __name__:
        return (*signals, signal.SIGHUP)
    return signals


class StopSignals:
    """Turns SIGINT/SIGTERM (and SIGHUP, `with_hangup`) into `KeyboardInterrupt`, held between
    `hold()` and `release()`."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.held = False
        self.pending: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take over SIGINT/SIGTERM (and SIGHUP) until `uninstall()`; only the main thread
        can."""
        if not _main_thread():
            return
        for sig in with_hangup(*self.SIGNALS):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.held:
            self.pending = signum
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def hold(self) -> None:
        """From here on a stop request waits for `release()`."""
        self.held = True

    def release(self) -> None:
        """Act on a stop request that arrived while held."""
        self.held = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP, `with_hangup`) into KeyboardInterrupt while a command runs
    (main thread only), so `kill` or a closed terminal cleans up (a build's partial directory,
    a rollout's sandboxes) or keeps (a fine-tune's state, an evaluation's saved blocks) what
    Ctrl-C does."""
    if not _main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in with_hangup(signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_on_sigterm() -> bool:
    """Make SIGTERM (and SIGHUP, `with_hangup`) raise `SystemExit` (exit status 128 + the
    signal's number, atexit handlers run) unless a handler is already installed; whether
    SIGTERM is handled now (False off the main thread)."""
    if not _main_thread():
        return False
    with contextlib.suppress(ValueError, OSError):
        for sig in with_hangup(signal.SIGTERM):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _exit)
        return True
    return False


def _exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_child(
    cmd: list[str],
    *,
    check: bool = False,
    grace_s: float = 120.0,
    started: Callable[[subprocess.Popen], Any] | None = None,
    **popen: Any,
) -> int:
    """Run `cmd` to the end and return its exit status. If this process is stopped while it
    waits (Ctrl-C, or SIGTERM or SIGHUP under `interrupt_on_sigterm`), the child is stopped as
    `stop_children` does, then the stop goes on. The child runs in its own session, so Ctrl-C
    or a closed terminal reaches it only this way, once (a second signal could cut its
    checkpoint short); `subprocess.run` would SIGKILL it a quarter of a second after Ctrl-C
    and leave what it holds behind. `started` is called with the process once it runs (to
    watch it, or to stop it from another thread); with `check`, a nonzero status raises
    `CalledProcessError`; `popen` goes to `subprocess.Popen`."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    return _wait_child(proc, check, grace_s, started)


def _wait_child(
    proc: subprocess.Popen,
    check: bool,
    grace_s: float,
    started: Callable[[subprocess.Popen], Any] | None,
) -> int:
    try:
        if started is not None:
            started(proc)
        code = proc.wait()
    except BaseException:
        stop_children([proc], grace_s)
        raise
    if check and code:
        raise subprocess.CalledProcessError(code, proc.args)
    return code


def stop_children(
    procs: Iterable[subprocess.Popen], grace_s: float = 120.0
) -> list[subprocess.Popen]:
    """Stop child processes: each still running gets one SIGTERM and, together, `grace_s`
    seconds to act on it (an `agentree` command checkpoints, removes its containers and its
    temporary directories); those still running after it, or all at once if this is itself
    interrupted, are killed. Returns the ones killed."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    killed = []
    try:
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # past the grace, or stopped again while waiting: kill them now
        for p in live:
            if p.poll() is None:
                p.kill()
                p.wait()
                killed.append(p)
    return killed


class Stopping(RuntimeError):
    """`Children.run` after `Children.stop`: a stopping program starts no new child."""


class Children:
    """Child commands that worker threads run and the main thread stops: a benchmark's runs on
    a thread pool, which a stop of the benchmark must stop (they run in their own sessions, so
    Ctrl-C reaches them only this way) and wait for, so that a resumed benchmark never starts a
    run whose old process still writes to it. `run` is `run_child`, with the child registered
    while it runs; `stop` stops the registered ones as `stop_children` does, and from then on
    `run` raises `Stopping` instead of starting one. Call `stop` from a thread that runs no
    child (the main thread): each child is started under the lock that `stop` takes."""

    def __init__(self) -> None:
        self._live: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopping = False

    def run(
        self,
        cmd: list[str],
        *,
        check: bool = False,
        grace_s: float = 120.0,
        started: Callable[[subprocess.Popen], Any] | None = None,
        **popen: Any,
    ) -> int:
        """As `run_child`; raises `Stopping` once `stop` was called."""
        with self._lock:
            if self._stopping:
                raise Stopping(f"stopping: {cmd[:4]} not started")
            proc = subprocess.Popen(cmd, start_new_session=True, **popen)
            self._live.append(proc)
        try:
            return _wait_child(proc, check, grace_s, started)
        finally:
            with self._lock:
                self._live.remove(proc)

    def stop(self, grace_s: float = 120.0) -> tuple[list[subprocess.Popen], list[subprocess.Popen]]:
        """Stop every child still running (one SIGTERM each, one grace together, then SIGKILL)
        and start no more; returns those that were running and those killed."""
        with self._lock:
            self._stopping = True
            live = [p for p in self._live if p.poll() is None]
        return live, stop_children(live, grace_s)


class CPUTimeExceeded(BaseException):
    """A block ran past its `cpu_time_limit`. A `BaseException`, like `KeyboardInterrupt`, so
    that the `except Exception` of the code it interrupts does not swallow it."""


@contextlib.contextmanager
def cpu_time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `CPUTimeExceeded` once the process has spent `seconds` of CPU time (user and
    system, all threads) inside the block. CPU time rather than wall time, so that other
    processes competing for the cores cannot make the limit expire. Main thread only; from any
    other thread, or with `seconds` None, the block runs without a limit. The timer re-fires
    every 50 ms of CPU time until the block ends, in case the code swallowed the first
    exception."""
    if not seconds or not _main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise CPUTimeExceeded(f"over {seconds} s of CPU time")

    handler = signal.signal(signal.SIGPROF, expire)
    timer = signal.setitimer(signal.ITIMER_PROF, seconds, 0.05)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, *timer)
        signal.signal(signal.SIGPROF, handler)
