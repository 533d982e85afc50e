"""The policy cache's builds: one at a time across processes, nothing half-built left behind
on an exception, Ctrl-C, SIGTERM or SIGKILL, and a message before a build starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import interruptible

from agentree.hub.store import build_once, cached_builds
from agentree.policy import BUILT_POLICIES

BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from agentree.hub.store import build_once

    target, seconds = Path(sys.argv[1]), float(sys.argv[2])

    def write(out):
        with open(target.parent.parent / "writes.log", "a") as f:
            f.write("write\\n")
        (out / "weights.bin").write_text("x")
        time.sleep(seconds)
        (out / "config.json").write_text("{}")

    print(build_once(target, write, what="test model", expected="a few seconds"), flush=True)
    """
)


def _start(target: Path, seconds: float, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "AGENTREE_CACHE": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, str(target), str(seconds)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,  # Ctrl-C reaches it even when the suite runs in the background
    )


def _leftovers(kind: Path) -> list[str]:
    return sorted(p.name for p in kind.iterdir() if p.name.startswith("."))


def test_a_second_process_waits_and_reuses_the_build(tmp_path: Path) -> None:
    target = tmp_path / "tiny" / "abc"
    first = _start(target, 4.0, tmp_path)
    deadline = time.time() + 60
    while not list((tmp_path / "tiny").glob(".abc.partial")) and time.time() < deadline:
        time.sleep(0.1)
    second = _start(target, 0.0, tmp_path)
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == second.returncode == 0, err1 + err2
    assert out1.strip() == out2.strip() == str(target)
    assert "building test model (a few seconds)" in err1
    assert f"waiting for process {first.pid}, which is building test model" in err2
    assert "reusing the build another process just finished" in err2
    assert (tmp_path / "writes.log").read_text() == "write\n"  # built once
    assert _leftovers(tmp_path / "tiny") == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_an_interrupted_build_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    target = tmp_path / "tiny" / "abc"
    proc = _start(target, 60.0, tmp_path)
    deadline = time.time() + 60
    partial = tmp_path / "tiny" / ".abc.partial"
    while not (partial / "weights.bin").exists() and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not target.exists() and _leftovers(tmp_path / "tiny") == []


def test_an_exception_leaves_nothing_and_a_killed_builds_leftover_is_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTREE_CACHE", str(tmp_path))
    target = tmp_path / "tiny" / "abc"

    def broken(out: Path) -> None:
        (out / "weights.bin").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(target, broken, log=None)
    assert not target.exists() and _leftovers(tmp_path / "tiny") == []

    killed = tmp_path / "tiny" / ".abc.partial"  # what a SIGKILLed build leaves
    killed.mkdir()
    (killed / "weights.bin").write_text("half")
    messages: list[str] = []
    build_once(target, lambda out: (out / "config.json").write_text("{}"), log=messages.append)
    assert (target / "config.json").exists() and _leftovers(tmp_path / "tiny") == []
    assert messages[0].startswith("building tiny/abc") and messages[-1].startswith("built tiny/abc")
    assert [b["kind"] for b in cached_builds(tmp_path)] == ["tiny"]


def test_models_build_fills_the_cache_that_a_run_and_models_list_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentree.commands.cli import main

    monkeypatch.setenv("AGENTREE_CACHE", str(tmp_path))
    argv = ["models", "build", "--env", "countdown", "--policy", "tiny"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path.parent == tmp_path / "tiny" and (path / "config.json").exists()
    assert "building tiny policy" in err
    assert main(argv) == 0  # cached: the same directory, nothing built
    out, err = capsys.readouterr()
    assert Path(out.strip()) == path and "building" not in err
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"tiny/{path.name}" in listed
    # every name the policy resolver builds, from its own table
    assert all(f"\n  {name} " in listed for name in BUILT_POLICIES), listed


def test_a_build_records_the_sha256_of_its_weights(tmp_path: Path) -> None:
    import hashlib
    import importlib.metadata
    import json

    import torch
    import transformers

    from agentree.hub.store import BUILD_META, weights_sha256

    weights = b"weights of the built model"

    def write(out: Path) -> None:
        (out / "model.safetensors").write_bytes(weights)
        (out / "config.json").write_text("{}")
        # a metadata file copied from the base the build started from names other weights
        (out / BUILD_META).write_text(json.dumps({"weights_sha256": "stale"}))

    target = build_once(tmp_path / "tiny-warm" / "k1", write, log=None)
    expected = hashlib.sha256(weights).hexdigest()
    meta = json.loads((target / BUILD_META).read_text())
    assert meta["weights_sha256"] == expected
    # with the versions of what shaped the weights, as the libraries themselves report them
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["versions"]["transformers"] == transformers.__version__
    assert meta["versions"]["numpy"] == importlib.metadata.version("numpy")
    assert set(meta) == {"weights_sha256", "versions"}
    assert weights_sha256(target) == expected
    # a checkpoint outside the cache is hashed from its files; shards in name order
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "model-00002-of-00002.safetensors").write_bytes(b"second")
    (shards / "model-00001-of-00002.safetensors").write_bytes(b"first")
    assert weights_sha256(shards) == hashlib.sha256(b"firstsecond").hexdigest()
    assert weights_sha256(tmp_path / "no-such-dir") is None
    # the recorded digest names the build: other bytes give another name
    other = build_once(
        tmp_path / "tiny-warm" / "k2",
        lambda out: (
            (out / "model.safetensors").write_bytes(weights + b"!"),
            (out / "config.json").write_text("{}"),
        ),
        log=None,
    )
    assert weights_sha256(other) != expected


def test_the_constraints_file_pins_what_shapes_the_weights() -> None:
    """`constraints.txt` (the README's install) pins one exact version of each library a build
    records, and nothing else: the two lists are one rule."""
    from packaging.requirements import Requirement

    from agentree.hub.store import LIBRARIES

    text = (Path(__file__).parents[1] / "constraints.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    pins = [Requirement(line) for line in lines]
    assert sorted(p.name for p in pins) == sorted(LIBRARIES)
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==" and "*" not in spec.version, pin
