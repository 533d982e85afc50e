"""The policy cache: built and converted models under `$AGENTREE_CACHE`, one build at a time.

Every policy agentree makes for itself (`tiny`, `tiny-warm`, `tiny-prm`, the SWE warm start, a
converted GGUF checkpoint such as `smollm2-135m`) is a directory `$AGENTREE_CACHE/<kind>/<key>`
written by `build_once`:

- a build takes a file lock, so a second process asking for the same directory waits (saying
  what it waits for) and then reuses the result instead of doing the work again;
- it writes into `<kind>/.<key>.partial` and renames that into place when done, so readers never
  see half a build; an exception, Ctrl-C (SIGINT) or SIGTERM removes the partial directory, and a
  partial directory left by a killed process (SIGKILL, power loss) is removed by the next build;
- it says what it builds and about how long that takes before it starts;
- it records the sha256 of the weights it wrote (`weights_sha256`) in `BUILD_META` beside them:
  the same recipe key has given different weights on different machines (thread counts,
  library versions), so a result names the weights it came from, not only the recipe; the
  versions of the libraries that shape the weights (`LIBRARIES`) are recorded with it, so two
  builds of one recipe that differ can be told apart by what was installed.
- beside any weights agentree writes, `POLICY_RECORD` says how the policy acts (its call
  format, and whether it acts through tool calls), which the weights alone do not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

from agentree.envs.base import ActionFormat
from agentree.signals import interrupt_on_sigterm

Log = Callable[[str], None]
BUILD_META = "agentree-build.json"
"""A build's metadata file: `{"weights_sha256": ..., "versions": {library: version}}`."""
LIBRARIES = ("torch", "transformers", "tokenizers", "numpy", "minigrid", "gymnasium")
"""What a build's weights depend on besides its recipe: the model and its training (torch,
transformers), the tokenizer, the seeded sampling of demonstrations (numpy) and the games that
draw them (BabyAI's minigrid on gymnasium)."""


def to_stderr(msg: str) -> None:
    """The default log of a build: stderr, so a command's own output stays clean."""
    print(msg, file=sys.stderr, flush=True)


def cache_root() -> Path:
    """`$AGENTREE_CACHE`, by default `~/.cache/agentree`."""
    return Path(os.environ.get("AGENTREE_CACHE", Path.home() / ".cache" / "agentree"))


def content_key(spec: dict) -> str:
    """A short hash naming a build by everything that determines it."""
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def is_built(target: Path) -> bool:
    """A finished build: the directory exists under its final name with a model config."""
    return (target / "config.json").exists()


def build_once(
    target: Path,
    write: Callable[[Path], None],
    *,
    what: str | None = None,
    expected: str | None = None,
    log: Log | None = to_stderr,
) -> Path:
    """Build `target` by `write`-ing into a partial directory and renaming it into place.

    `what` names the build in the messages ("tiny-warm policy for frozenlake") and `expected`
    says how long it usually takes ("about 2.5 min on 2 CPU cores"); with `log=None` a build is
    silent, as library callers that print their own progress want.
    """
    if is_built(target):
        return target
    say = log or (lambda _msg: None)
    name = what or f"{target.parent.name}/{target.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target, name, say):
        if is_built(target):  # another process finished it while we waited
            say(f"{name}: reusing the build another process just finished ({target})")
            return target
        _remove_leftovers(target)
        say(f"building {name}" + (f" ({expected})" if expected else "") + f" -> {target}")
        t0 = time.perf_counter()
        with written_whole(target) as partial:
            write(partial)
            # hashed from the files, never from a metadata file a build copied from its base
            meta = {"weights_sha256": _hash_weights(partial), "versions": library_versions()}
            _write_meta(partial, meta)
            if target.exists():  # an old unfinished layout; the lock makes this ours
                shutil.rmtree(target)
        say(f"built {name} in {time.perf_counter() - t0:.0f}s")
    return target


@contextlib.contextmanager
def written_whole(target: Path) -> Iterator[Path]:
    """A fresh directory `.<name>.partial` beside `target` to write it in, renamed to `target`
    when the block ends (the block leaves `target` absent); an exception, Ctrl-C or SIGTERM
    removes it instead, so `target` appears whole or not at all. One left by a killed process
    is removed first."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with interrupt_on_sigterm():
        try:
            partial.mkdir(parents=True)
            yield partial
            partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise


def weights_sha256(model_dir: Path | str) -> str | None:
    """The sha256 naming a checkpoint directory's weights: of `model.safetensors` itself, or of
    a sharded checkpoint's `*.safetensors` files in name order (their bytes, one after another).
    A build's recorded digest (`BUILD_META`) is read instead of hashing again; None when the
    directory holds no safetensors weights."""
    model_dir = Path(model_dir)
    meta = model_dir / BUILD_META
    if meta.is_file():
        digest = json.loads(meta.read_text()).get("weights_sha256")
        if digest:
            return str(digest)
    return _hash_weights(model_dir)


POLICY_RECORD = "agentree-policy.json"
"""Beside the weights agentree writes (a run's checkpoints, `agentree sft` and `export`, the
warm starts): `{"tool_format": F, "action_format": A}`, how the policy learned to act. `F` is
the call format (`policy.tool_format`) it writes its tool calls in; `A` (only where the env it
learned on has `env.action_format`) whether it acted through those calls (`tools`) or in free
text (`text`). Weights alone say neither, and a policy read in another format than its own
finds no action in any turn. A command given the directory as `--policy` reads the record
(`policy_record`) for what its config does not set."""


def write_policy_record(directory: Path | str, tool_format: str, action_format: str | None) -> None:
    """Write `POLICY_RECORD` into the policy directory `directory` (`action_format` None: the
    env had no such setting, and the record leaves it out)."""
    record = {"tool_format": tool_format}
    if action_format is not None:
        record["action_format"] = action_format
    (Path(directory) / POLICY_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def policy_record(path: Path | str) -> dict[str, str]:
    """The `POLICY_RECORD` of a policy directory: `tool_format`, and `action_format` where it
    was recorded; empty for a name, a file or a directory without one (another tool's
    checkpoint, or one written before the record)."""
    record = Path(path).expanduser() / POLICY_RECORD
    if not record.is_file():
        return {}
    try:
        value = json.loads(record.read_text())
    except json.JSONDecodeError:
        value = None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("tool_format"), str)
        or value.get("action_format", "text") not in get_args(ActionFormat)
    ):
        raise ValueError(
            f'{record} should be a JSON object {{"tool_format": NAME, "action_format": '
            f'"text" or "tools" (optional)}}'
        )
    return {k: value[k] for k in ("tool_format", "action_format") if k in value}


def library_versions() -> dict[str, str]:
    """The installed versions of `LIBRARIES` (those not installed are left out)."""
    out: dict[str, str] = {}
    for name in LIBRARIES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def _hash_weights(model_dir: Path) -> str | None:
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _write_meta(build: Path, meta: dict[str, object]) -> None:
    # through a temporary file: a reader never sees half of it
    tmp = build / f".{BUILD_META}.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.rename(build / BUILD_META)


def _remove_leftovers(target: Path) -> None:
    """Partial directories of this target left by killed builds (this one's and the names
    earlier versions used)."""
    for leftover in target.parent.glob(f".{target.name}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(target: Path, name: str, say: Log) -> Iterator[None]:
    """An exclusive `flock` per target, in `$AGENTREE_CACHE/.locks/`; the holder's pid is
    written into the lock file so a waiter can say whom it waits for."""
    locks = cache_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{target.parent.name}-{target.name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            say(f"waiting for process {holder}, which is building {name} ...")
            t0 = time.perf_counter()
            fcntl.flock(f, fcntl.LOCK_EX)
            say(f"waited {time.perf_counter() - t0:.0f}s for {name}")
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_builds(root: Path | None = None) -> list[dict[str, object]]:
    """Every finished build in the cache: kind, key, path, size in MB and age."""
    root = root or cache_root()
    out: list[dict[str, object]] = []
    if not root.is_dir():
        return out
    for kind in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for build in sorted(kind.iterdir()):
            if build.name.startswith(".") or not is_built(build):
                continue
            size = sum(f.stat().st_size for f in build.rglob("*") if f.is_file())
            out.append(
                {
                    "kind": kind.name,
                    "key": build.name,
                    "path": str(build),
                    "mb": round(size / 2**20, 1),
                    "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(build.stat().st_mtime)),
                }
            )
    return out
