"""Generated bug-fix tasks (SWE-smith style) from the bundled local repositories.

Pipeline: take each local-suite repository in its fixed state (base files + gold patch + test
patch), list every single-site mutation of its non-test source files (`agentree.swe.mutate`),
and run the repository's tests on each candidate in a Docker container started from that
repository's local-suite image (one container per repository, reused for every candidate). A
candidate is kept iff some tests that pass on the fixed code fail with the bug (FAIL_TO_PASS)
and at least one other test passes both ways (PASS_TO_PASS). Identical buggy repositories are
kept once.

Each kept task is a SWE-bench 5.x record: the local-suite image of its repository (no new
images), a `prepare_script` that writes the buggy files and commits them as the repository's
only commit (fixed author and date, so the commit id is the record's `base_commit`), the fix as
the gold `patch`, an eval script that restores `tests/` and runs pytest between the SWE-bench
markers, the `parse_log_pytest` log parser, and a problem statement written from the failing
tests' output. `agentree eval` grades them with `swebench` like any other record.

The train/held-out split is seeded and by group: whole source files (`split_by="file"`) or
whole mutation kinds (`split_by="kind"`) go to the held-out set, never to both.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import random
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from agentree.envs.swe import images, local_suite, runtime
from agentree.envs.swe.images import BASE_IMAGE
from agentree.envs.swe.instances import END, START
from agentree.envs.swe.sandbox import Sandbox, SandboxConfig
from agentree.prompts import render
from agentree.swe.mutate import Mutation, mutations

ID_PREFIX = "agentree-gen__"
TEST_CMD = "python3 -m pytest --no-header -rA --tb=short -p no:cacheprovider tests"
TEST_TIMEOUT_S = 20
"""A mutated repository's tests get this long (a flipped loop condition can spin forever)."""
OUTPUT_LINES = 40
"""Lines of failing-test output quoted in a problem statement."""
EOF_MARK = "AGENTREE_EOF"


@dataclass(frozen=True)
class Candidate:
    slug: str
    mutation: Mutation

    @property
    def key(self) -> str:
        """Hash of the whole buggy repository: equal keys are the same task."""
        h = hashlib.sha256(self.slug.encode())
        h.update(self.mutation.path.encode() + b"\0" + self.mutation.source.encode())
        return h.hexdigest()[:10]


@dataclass
class Report:
    """What a generation run did."""

    tried: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    """Kept tasks per mutation kind."""
    train: int = 0
    heldout: int = 0
    wall_s: float = 0.0
    images: list[str] = field(default_factory=list)
    image_bytes: int = 0
    candidates: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidates": self.candidates,
            "tried": self.tried,
            "kept": self.kept,
            "rejected": dict(sorted(self.rejected.items())),
            "kept_by_kind": dict(sorted(self.kinds.items())),
            "train": self.train,
            "heldout": self.heldout,
            "wall_s": round(self.wall_s, 1),
            "images": self.images,
            "image_disk_mb": round(self.image_bytes / 2**20, 1),
        }


# -- repositories ----------------------------------------------------------------------------
@cache
def fixed_files(slug: str) -> dict[str, bytes]:
    """The repository with its gold and test patches applied (every test passes)."""
    d = local_suite._root().joinpath(slug)
    patches = [d.joinpath("gold.patch").read_text(), d.joinpath("test.patch").read_text()]
    with tempfile.TemporaryDirectory(prefix="agentree-gen-") as tmp:
        root = Path(tmp)
        for path, data in local_suite.repo_files(slug).items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
        for i, patch in enumerate(patches):
            (root / f".p{i}").write_text(patch)
            r = subprocess.run(
                ["git", "apply", f".p{i}"], cwd=root, capture_output=True, text=True, check=False
            )
            if r.returncode != 0:
                raise RuntimeError(
                    f"local suite {slug}: a bundled patch does not apply: {r.stderr}"
                )
            (root / f".p{i}").unlink()
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }


def source_files(slug: str) -> list[str]:
    return [
        p
        for p in fixed_files(slug)
        if p.endswith(".py") and not p.startswith("tests/") and not p.endswith("__init__.py")
    ]


def candidates(slugs: Iterable[str] | None = None) -> list[Candidate]:
    """Every mutation of every source file of the given repositories (all by default)."""
    out: list[Candidate] = []
    for slug in slugs or local_suite.slugs():
        files = fixed_files(slug)
        for path in source_files(slug):
            out += [Candidate(slug, m) for m in mutations(path, files[path].decode())]
    return out


# -- records ---------------------------------------------------------------------------------
def buggy_files(c: Candidate) -> dict[str, bytes]:
    files = dict(fixed_files(c.slug))
    files[c.mutation.path] = c.mutation.source.encode()
    return files


def unified_diff(path: str, old: str, new: str) -> str:
    """A git-style diff of one file (what `git apply` and SWE-bench expect)."""
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        f"a/{path}",
        f"b/{path}",
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def prepare_script(c: Candidate, base_commit: str) -> str:
    """Shell that turns the local-suite image's repository into this task's buggy repository,
    committed as the only commit (so the commit id is `base_commit`)."""
    original = local_suite.repo_files(c.slug)
    files = buggy_files(c)
    lines = ["set -e", "cd /testbed"]
    for path, data in files.items():
        if original.get(path) != data:
            b64 = base64.encodebytes(data).decode()
            lines.append(f"mkdir -p $(dirname {path}) && base64 -d > {path} <<'{EOF_MARK}'")
            lines.append(b64 + EOF_MARK)
    lines += [f"rm -f {p}" for p in original if p not in files]
    name, _, email = local_suite.AUTHOR.partition(" <")
    ident = (
        f"GIT_AUTHOR_NAME='{name}' GIT_AUTHOR_EMAIL='{email[:-1]}' "
        f"GIT_COMMITTER_NAME='{name}' GIT_COMMITTER_EMAIL='{email[:-1]}' "
        f"GIT_AUTHOR_DATE='{local_suite.COMMIT_TIME}' "
        f"GIT_COMMITTER_DATE='{local_suite.COMMIT_TIME}'"
    )
    msg = local_suite.COMMIT_MESSAGE.strip()
    lines += [
        "git checkout -q --orphan agentree-task && git add -A",
        f"{ident} git commit -q -m '{msg}'",
        "git branch -D -q main && git branch -m main",
        "git reflog expire --expire=now --all && git gc -q --prune=now",
        f'test "$(git rev-parse HEAD)" = {base_commit} || '
        '{ echo "prepared repository is not at the task commit" >&2; exit 1; }',
    ]
    return "\n".join(lines) + "\n"


def eval_script(base_commit: str) -> str:
    """Restore the tests to the task commit, run them all between the SWE-bench markers."""
    return (
        "\n".join(
            [
                "#!/bin/bash",
                "set -uxo pipefail",
                "cd /testbed",
                "git config --global --add safe.directory /testbed",
                f"git checkout {base_commit} -- tests",
                f": '{START}'",
                f"PYTHONDONTWRITEBYTECODE=1 {TEST_CMD}",
                f": '{END}'",
                f"git checkout {base_commit} -- tests",
            ]
        )
        + "\n"
    )


def problem_statement(repo: str, failing: list[str], output: str) -> str:
    lines = output.strip().splitlines()
    if len(lines) > OUTPUT_LINES:
        lines = [*lines[:OUTPUT_LINES], "..."]
    return render(
        "swe/generated_issue.txt",
        count=len(failing),
        repo=repo,
        failing="\n".join(f"- {t}" for t in failing),
        output="\n".join(lines),
    )


def make_record(
    c: Candidate, f2p: list[str], p2p: list[str], output: str, split: str
) -> dict[str, Any]:
    """The SWE-bench 5.x record of a kept candidate."""
    meta = local_suite.record(c.slug)
    files = buggy_files(c)
    base = local_suite.git_commit_hash(files)
    m = c.mutation
    return {
        "instance_id": f"{ID_PREFIX}{c.slug}-{m.kind.replace('_', '')}-{c.key}",
        "repo": meta["repo"],
        "base_commit": base,
        "patch": unified_diff(m.path, m.source, fixed_files(c.slug)[m.path].decode()),
        "test_patch": "",
        "problem_statement": problem_statement(meta["repo"], f2p, output),
        "hints_text": "",
        "version": meta["version"],
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p),
        "image": meta["image"],
        "eval_script": eval_script(base),
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "source": "generated",
        "prepare_script": prepare_script(c, base),
        "split": split,
        "mutation": {"kind": m.kind, "file": m.path, "line": m.line, "description": m.description},
    }


# -- validation ------------------------------------------------------------------------------
def _statuses(output: str) -> dict[str, str]:
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.log_parsers.python import parse_log_pytest

    return parse_log_pytest(output, None)  # type: ignore[arg-type]


def failure_output(output: str) -> str:
    """The FAILURES section of a pytest run (tracebacks of the failing tests)."""
    for marker in ("= FAILURES =", "= ERRORS ="):
        if marker in output:
            body = output.split(marker, 1)[1]
            body = body.split("short test summary info", 1)[0]
            return "\n".join(body.splitlines()[1:-1]).strip()
    return output.strip()[-2000:]


class Validator:
    """Runs one repository's tests on candidates, in one container of its local-suite image."""

    def __init__(self, slug: str) -> None:
        rec = local_suite.record(slug)
        images.build_local(only=[slug])
        env = (("PYTHONDONTWRITEBYTECODE", "1"),)  # mutants of equal size must not reuse .pyc
        self.slug = slug
        self.sandbox = Sandbox(rec["image"], SandboxConfig(env=env, prewarm=0))
        files = fixed_files(slug)
        self.sandbox.write_files({f"testbed/{p}": d for p, d in files.items()}, root="/")
        out, _ = self._run({})
        self.clean = {t: s for t, s in _statuses(out).items() if s == "PASSED"}
        if not self.clean:
            raise RuntimeError(f"the fixed {slug} repository has no passing test:\n{out[-800:]}")

    def _run(self, changed: dict[str, bytes]) -> tuple[str, int]:
        writes = []
        for path, data in changed.items():
            b64 = base64.encodebytes(data).decode()
            writes.append(f"base64 -d > {path} <<'{EOF_MARK}'\n{b64}{EOF_MARK}")
        restore = []
        for path in changed:
            b64 = base64.encodebytes(fixed_files(self.slug)[path]).decode()
            restore.append(f"base64 -d > {path} <<'{EOF_MARK}'\n{b64}{EOF_MARK}")
        cmd = "\n".join(
            [
                *writes,
                f"timeout -s KILL {TEST_TIMEOUT_S} {TEST_CMD} > /tmp/agentree-gen.log 2>&1",
                "rc=$?",
                *restore,
                "cat /tmp/agentree-gen.log; exit $rc",
            ]
        )
        r = self.sandbox.exec(cmd, timeout=TEST_TIMEOUT_S + 30, max_output=200_000)
        return r.output, r.returncode

    def check(self, c: Candidate) -> tuple[str, list[str], list[str], str]:
        """(reason, FAIL_TO_PASS, PASS_TO_PASS, failing output); reason "" means keep."""
        out, rc = self._run({c.mutation.path: c.mutation.source.encode()})
        if rc in (124, 137):
            return "timeout", [], [], ""
        got = _statuses(out)
        f2p = sorted(t for t in self.clean if got.get(t) != "PASSED")
        p2p = sorted(t for t in self.clean if got.get(t) == "PASSED")
        if not f2p:
            return "no_failing_test", [], [], ""
        if not p2p:
            return "no_passing_test", [], [], ""
        return "", f2p, p2p, failure_output(out)

    def close(self) -> None:
        self.sandbox.close()


# -- split and driver ------------------------------------------------------------------------
def split_groups(
    records: list[dict[str, Any]], *, by: str, heldout: float, seed: int
) -> dict[str, str]:
    """instance_id -> "train" | "heldout": whole groups (files or kinds) held out, seeded."""
    if by not in ("file", "kind"):
        raise ValueError(f"split_by must be 'file' or 'kind', not {by!r}")

    def group(r: dict[str, Any]) -> str:
        m = r["mutation"]
        return f"{r['repo']}:{m['file']}" if by == "file" else m["kind"]

    groups = sorted({group(r) for r in records})
    random.Random(seed).shuffle(groups)
    sizes = Counter(group(r) for r in records)
    held: set[str] = set()
    target = heldout * len(records)
    for g in groups:
        # stop before a group would overshoot more than it helps, and keep a train set
        if sum(sizes[h] for h in held) >= target or len(held) + 1 >= len(groups):
            break
        held.add(g)
    return {r["instance_id"]: "heldout" if group(r) in held else "train" for r in records}


def generate(
    n: int,
    *,
    seed: int = 0,
    slugs: Iterable[str] | None = None,
    split_by: str = "file",
    heldout: float = 0.25,
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[list[dict[str, Any]], Report]:
    """Validate candidates in a seeded order until `n` tasks are kept (or none are left)."""
    start = time.monotonic()
    report = Report()
    pool = candidates(slugs)
    report.candidates = len(pool)
    random.Random(seed).shuffle(pool)
    # one container per repository, opened when first needed
    validators: dict[str, Validator] = {}
    kept: list[tuple[Candidate, list[str], list[str], str]] = []
    seen: set[str] = set()
    try:
        for c in pool:
            if len(kept) >= n:
                break
            report.tried += 1
            if c.key in seen:
                report.rejected["duplicate"] += 1
                continue
            seen.add(c.key)
            if c.slug not in validators:
                validators[c.slug] = Validator(c.slug)
            reason, f2p, p2p, out = validators[c.slug].check(c)
            if reason:
                report.rejected[reason] += 1
            else:
                kept.append((c, f2p, p2p, out))
            if progress is not None:
                progress(len(kept), report.tried, reason or "kept")
    finally:
        for v in validators.values():
            v.close()
    records = [make_record(c, f2p, p2p, out, "train") for c, f2p, p2p, out in kept]
    splits = split_groups(records, by=split_by, heldout=heldout, seed=seed)
    for r in records:
        r["split"] = splits[r["instance_id"]]
    report.kept = len(records)
    report.kinds = Counter(r["mutation"]["kind"] for r in records)
    report.heldout = sum(r["split"] == "heldout" for r in records)
    report.train = report.kept - report.heldout
    report.images = sorted({r["image"] for r in records})
    report.image_bytes = _image_bytes(report.images)
    report.wall_s = time.monotonic() - start
    return records, report


def _image_bytes(names: list[str]) -> int:
    """Disk of the images, counting the base image they all share once."""
    api = runtime.client().api
    base = int(api.inspect_image(BASE_IMAGE).get("Size") or 0)
    own = sum(int(api.inspect_image(n).get("Size") or 0) - base for n in names)
    return base + own if names else 0


def write_tasks(records: list[dict[str, Any]], output: Path) -> list[Path]:
    """Write all tasks to `output` and each split next to it (`<stem>.train.jsonl`, ...)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for path, rows in (
        (output, records),
        (output.with_suffix(".train.jsonl"), [r for r in records if r["split"] == "train"]),
        (output.with_suffix(".heldout.jsonl"), [r for r in records if r["split"] == "heldout"]),
    ):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written.append(path)
    return written
