"""A closed terminal (SIGHUP) stops agentree as Ctrl-C does, except under `nohup`, where the
user asked for the command to outlive its terminal (`agentree.signals.with_hangup`). Each case
runs in a fresh interpreter, whose SIGHUP disposition the test sets as a terminal or `nohup`
would."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGHUP, signal.{disposition})
    from agentree.signals import StopSignals, exit_on_sigterm, interrupt_on_sigterm
    {setup}
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.5)  # a handled signal has raised by now
        print("still running")
    except KeyboardInterrupt as stop:
        print("interrupted", stop)
    """
)

SETUPS = {
    "StopSignals": "StopSignals().install()",
    "interrupt_on_sigterm": "held = interrupt_on_sigterm(); held.__enter__()",
    "exit_on_sigterm": "exit_on_sigterm()",
}


def run(disposition: str, setup: str) -> subprocess.CompletedProcess:
    code = SCRIPT.format(disposition=disposition, setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", list(SETUPS))
def test_a_closed_terminal_stops_as_ctrl_c_does(name: str) -> None:
    out = run("SIG_DFL", SETUPS[name])
    if name == "exit_on_sigterm":  # SystemExit: atexit runs, the status names the signal
        assert out.returncode == 128 + signal.SIGHUP and not out.stdout, out
    else:
        assert out.returncode == 0 and out.stdout.startswith("interrupted"), out
        assert out.stdout.strip() in ("interrupted SIGHUP", f"interrupted signal {signal.SIGHUP}")


@pytest.mark.parametrize("name", list(SETUPS))
def test_under_nohup_a_closed_terminal_is_still_ignored(name: str) -> None:
    out = run("SIG_IGN", SETUPS[name])
    assert out.returncode == 0 and out.stdout.strip() == "still running", out


def test_a_trainer_inside_a_benchmark_holds_a_closed_terminal_over_its_update() -> None:
    """A trainer's `StopSignals` installed inside a benchmark's `interrupt_on_sigterm` (as
    `gradient_noise` runs one) takes SIGHUP over from it, as it takes SIGTERM: held during the
    update, raised at its end."""
    setup = (
        "outer = interrupt_on_sigterm(); outer.__enter__(); stop = StopSignals(); "
        "stop.install(); stop.hold()"
    )
    code = SCRIPT.format(disposition="SIG_DFL", setup=setup) + "stop.release()\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("still running"), out  # held
    assert "KeyboardInterrupt: SIGHUP" in out.stderr  # and raised at the release
