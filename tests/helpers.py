"""Test doubles for the *policy* (never for the component under test), the loader the
benchmark scripts' tests share, a command stopped at a pause, and a command stopped by SIGTERM
with what it leaves running."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from agentree.distributed.cluster import processes_matching
from agentree.engines.base import (
    Admit,
    Completion,
    DoneSink,
    EngineStats,
    Params,
    TokenSink,
    per_prompt,
    report_tokens,
)


class ScriptedEngine:
    """An Engine whose 'policy' is a function of the decoded context: deterministic actions.

    Lets controller tests force known branch/prune decisions. Token ids are the tokenizer's
    encoding of the chosen text plus the end-of-turn id; log-probs are 0.
    """

    def __init__(self, tokenizer: Any, choose: Callable[[str, int], str]) -> None:
        self.tokenizer = tokenizer
        self.choose = choose
        self.stats = EngineStats()
        self.calls: list[int] = []

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    @property
    def max_model_len(self) -> int:
        return 100_000

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Params,
        on_token: TokenSink | None = None,
        on_done: DoneSink | None = None,
        admit: Admit | None = None,  # never asked: it answers whole calls
    ) -> list[list[Completion]]:
        self.calls.append(len(prompts))
        out = []
        for i, (p, sp) in enumerate(zip(prompts, per_prompt(prompts, params), strict=True)):
            text = self.tokenizer.decode(list(p))
            ids = self.tokenizer.encode(self.choose(text, i), add_special_tokens=False)
            ids = [*ids, self.tokenizer.eos_token_id]
            self.stats.tokens_generated += len(ids) * sp.n
            self.stats.tokens_prefilled += len(p)
            out.append([Completion(list(ids), [0.0] * len(ids), "stop") for _ in range(sp.n)])
        report_tokens(out, on_token, on_done)
        return out

    def seed(self, seed: int) -> None:
        pass

    def sync_weights(self, model: Any) -> None:
        pass

    def close(self) -> None:
        pass


def interruptible() -> None:
    """`preexec_fn` giving a child the Ctrl-C and hang-up handling a terminal user has.

    A shell starts background jobs with SIGINT ignored and children inherit that, so a test
    suite launched in the background (as CI may do) would otherwise send SIGINT into the void;
    under `nohup` SIGHUP is ignored the same way.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def signal_at_pause(
    argv: list[str],
    flag: Path,
    sig: int,
    what: str,
    at_pause: Callable[[], None] | None = None,
    **popen: Any,
) -> tuple[int, str]:
    """Run `argv`, a launcher that writes `flag` when it reaches a pause and waits there until
    `flag`.go exists; once it pauses call `at_pause` (a check of what it holds there), send
    `sig`, let it go on, and return its exit status and output. The test fails if it ends, or
    takes over 150 s, before the pause (`what` pauses)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    deadline = time.monotonic() + 150
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} never reached its pause:\n{proc.communicate()[0]}")
        time.sleep(0.1)
    if at_pause is not None:
        try:
            at_pause()
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    proc.send_signal(sig)
    flag.with_suffix(".go").write_text("")
    out, _ = proc.communicate(timeout=150)
    return proc.returncode, out


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` imported as module `name` (the scripts are not a package), and
    registered in `sys.modules` so that what it defines can be pickled and inspected."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- a command stopped by SIGTERM, and what it leaves running ----------------------------------
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
    """Of the processes `below` a command (when it was stopped), those still running, and any
    other process that mentions one of `mentions` in its command line or its open files (a
    child started later; a Ray agent retitles itself but keeps its logs open)."""
    now = {pid: p for pid, p in processes().items() if not p.zombie and pid != os.getpid()}
    named = set(processes_matching(*mentions, open_files=True)) if mentions else set()
    return {
        pid: p
        for pid, p in now.items()
        if (pid in below and below[pid].started == p.started) or pid in named
    }


Ready = Callable[[subprocess.Popen], bool]
SETTLE_S = 30.0
"""How long processes below a command may take to exit after it did: Ray's agents leave by
themselves a few seconds after their driver."""


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
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=BENCHMARKS.parent
        )
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
        mentions = [f"{scratch}{os.sep}", f"{log.parent}{os.sep}"]  # inside them, not a sibling
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


def printed(log: Path, prefix: str) -> Ready:
    """Ready once the command's output (`log`) holds a line starting with `prefix`."""
    return lambda _proc: any(x.startswith(prefix) for x in log.read_text().splitlines())
