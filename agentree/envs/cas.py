"""math_verify's equivalence check in worker processes, so that its CPU-time limit holds
whatever thread asks.

A limit raised by a signal (`agentree.signals.cpu_time_limit`) can only be enforced in a
process's main thread, and the turn runner plays env turns (hence checks math answers) on worker
threads, where an answer whose expansion costs sympy minutes would stall the rollout. So the
check runs in a few `python -m agentree.envs.cas` processes, each answering one request at a
time in its main thread under the limit, which counts CPU time (a loaded machine cannot make it
expire on a correct answer). A check stuck inside one C call, which no signal interrupts, is
ended by killing its process once `backstop_s(timeout_s)` seconds of wall time have passed, far
beyond what load alone stretches a check to; the next check starts a fresh process.

The processes are started on first use, `WORKERS` at most (one per check in flight). They run
in their own session (Ctrl-C at a terminal does not end one mid-check), read their requests on
stdin and exit when it closes, so they end with the process that started them however it ends;
`close()`, also called at exit, ends them at once. A forked child starts its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from agentree.signals import CPUTimeExceeded, cpu_time_limit

WORKERS = min(4, os.cpu_count() or 1)
"""Checks that run at once (each in its own process)."""


def backstop_s(timeout_s: float) -> float:
    """Wall-clock seconds after which a check's process is killed: for a check stuck in one C
    call, which its CPU-time limit cannot interrupt (and for a process that fails to start)."""
    return 60.0 + 10.0 * timeout_s


def _own_time_limit(record: logging.LogRecord) -> bool:
    """Drops math_verify's notice that it enforces no timeout: the worker enforces one."""
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):  # loggers exist by name, imported or not
    logging.getLogger(_name).addFilter(_own_time_limit)


def check(prediction: str, reference: str, timeout_s: float) -> bool | None:
    """math_verify's verdict on two answers (True: equivalent), or None when it gives none: it
    cannot parse a side, it raised, or it ran past `timeout_s` CPU seconds (or the backstop)."""
    with _slots:
        worker = _take()
        try:
            verdict = worker.ask(prediction, reference, timeout_s)
        except _Lost:  # over the backstop, or its process ended
            worker.kill()
            return None
        except BaseException:  # this process is stopped mid-check: the worker goes with it
            worker.kill()
            raise
        with _lock:
            _idle.append(worker)
        return verdict


def close() -> None:
    """End every worker process now (the next check starts a fresh one)."""
    with _lock:
        workers = list(_all)
        _idle.clear()
    for worker in workers:
        worker.kill()


class _Lost(Exception):
    """The worker gave no answer: over the backstop, or its process ended."""


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentree.envs.cas"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._buffer = b""

    def ask(self, prediction: str, reference: str, timeout_s: float) -> bool | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"prediction": prediction, "reference": reference, "timeout_s": timeout_s}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as e:  # its process ended
            raise _Lost(str(e)) from None
        deadline = time.monotonic() + backstop_s(timeout_s)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Lost(f"no verdict within {backstop_s(timeout_s):.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _Lost("the worker process ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)["verdict"]

    def kill(self) -> None:
        with _lock:
            if self in _all:
                _all.remove(self)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


_lock = threading.Lock()
_slots = threading.BoundedSemaphore(WORKERS)
_all: list[_Worker] = []
_idle: list[_Worker] = []


def _take() -> _Worker:
    with _lock:
        if _idle:
            return _idle.pop()
    worker = _Worker()
    with _lock:
        _all.append(worker)
    return worker


def _after_fork() -> None:
    """A forked child shares its parent's workers' pipes: it starts its own instead."""
    global _lock, _slots
    _lock, _slots = threading.Lock(), threading.BoundedSemaphore(WORKERS)
    _all.clear()
    _idle.clear()


atexit.register(close)
os.register_at_fork(after_in_child=_after_fork)


def _serve() -> None:
    """A worker process: one JSON request a line on stdin, one verdict a line on stdout."""
    # deferred: the optional [math] extra, imported by the worker process only
    import math_verify

    for line in sys.stdin.buffer:
        request = json.loads(line)
        verdict = None
        try:
            with cpu_time_limit(request["timeout_s"]):
                gold = math_verify.parse(f"\\boxed{{{request['reference']}}}", parsing_timeout=None)
                guess = math_verify.parse(
                    f"\\boxed{{{request['prediction']}}}", parsing_timeout=None
                )
                if gold and guess:
                    verdict = bool(math_verify.verify(gold, guess, timeout_seconds=None))
        except (Exception, CPUTimeExceeded):
            verdict = None  # no verdict (an error, or over the time limit)
        sys.stdout.write(json.dumps({"verdict": verdict}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
