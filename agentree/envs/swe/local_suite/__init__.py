"""The bundled local suite: small Python repositories with real bugs, in SWE-bench format.

Each folder holds `repo/` (the repository at its base commit), `problem_statement.md`,
`gold.patch`, `test.patch` and `task.json` (instance id, repo, FAIL_TO_PASS, PASS_TO_PASS). The
base commit is computed from the files (one commit with a fixed author and date), so the
records need no network and the image builder can check the image it made. Images are built
locally from the Debian base image (`agentree.envs.swe.images.build_local`).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from agentree.envs.swe.instances import default_eval_script, patch_files

IMAGE_REPO = "agentree/swe-local"
AUTHOR = "agentree <suite@agentree.invalid>"
COMMIT_TIME = "1704067200 +0000"  # 2024-01-01T00:00:00Z
COMMIT_MESSAGE = "Initial commit\n"
TEST_CMD = "python3 -m pytest --no-header -rA --tb=short -p no:cacheprovider"


def _root() -> Traversable:
    return resources.files(__name__)


@cache
def slugs() -> tuple[str, ...]:
    return tuple(sorted(d.name for d in _root().iterdir() if d.joinpath("task.json").is_file()))


def image_name(instance_id: str) -> str:
    return f"{IMAGE_REPO}:{instance_id.lower()}"


@cache
def repo_files(slug: str) -> dict[str, bytes]:
    """Repository path -> content at the base commit."""
    out: dict[str, bytes] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            path = f"{prefix}{child.name}"
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, path + "/")
            elif not child.name.endswith(".pyc"):
                out[path] = child.read_bytes()

    walk(_root().joinpath(slug, "repo"), "")
    return dict(sorted(out.items()))


def git_commit_hash(files: dict[str, bytes]) -> str:
    """The commit id `git commit` gives these files (mode 644) with AUTHOR at COMMIT_TIME."""

    def obj(kind: str, body: bytes) -> bytes:
        return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()

    def tree(entries: dict[str, Any]) -> bytes:
        # git sorts tree entries by name, directories compared as if they ended with "/"
        items = sorted(
            entries.items(), key=lambda kv: kv[0] + ("/" if isinstance(kv[1], dict) else "")
        )
        body = b""
        for name, value in items:
            if isinstance(value, dict):
                body += b"40000 " + name.encode() + b"\0" + tree(value)
            else:
                body += b"100644 " + name.encode() + b"\0" + obj("blob", value)
        return obj("tree", body)

    nested: dict[str, Any] = {}
    for path, data in files.items():
        *dirs, name = path.split("/")
        node = nested
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = data
    stamp = f"{AUTHOR} {COMMIT_TIME}"
    body = f"tree {tree(nested).hex()}\nauthor {stamp}\ncommitter {stamp}\n\n{COMMIT_MESSAGE}"
    return obj("commit", body.encode()).hex()


@cache
def record(slug: str) -> dict[str, Any]:
    """The SWE-bench 5.x instance record of one task."""
    d = _root().joinpath(slug)
    meta = json.loads(d.joinpath("task.json").read_text())
    test_patch = d.joinpath("test.patch").read_text()
    base = git_commit_hash(repo_files(slug))
    files = " ".join(patch_files(test_patch))
    return {
        "instance_id": meta["instance_id"],
        "repo": meta["repo"],
        "base_commit": base,
        "patch": d.joinpath("gold.patch").read_text(),
        "test_patch": test_patch,
        "problem_statement": d.joinpath("problem_statement.md").read_text(),
        "hints_text": "",
        "created_at": meta.get("created_at", ""),
        "version": meta.get("version", "0.1"),
        "environment_setup_commit": base,
        "FAIL_TO_PASS": json.dumps(meta["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.dumps(meta["PASS_TO_PASS"]),
        "image": image_name(meta["instance_id"]),
        "eval_script": default_eval_script(base, test_patch, f"{TEST_CMD} {files}"),
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "source": "local",
    }


def records() -> list[dict[str, Any]]:
    return [record(s) for s in slugs()]


def slug_of(instance_id: str) -> str | None:
    for s in slugs():
        if record(s)["instance_id"] == instance_id:
            return s
    return None


def slug_of_image(image: str) -> str | None:
    """The task folder whose local-suite image this is (None for other images)."""
    for s in slugs():
        if image_name(record(s)["instance_id"]) == image:
            return s
    return None


def content_hash(slug: str) -> str:
    """Changes whenever the repository content (and so the image) must change."""
    h = hashlib.sha256()
    for path, data in repo_files(slug).items():
        h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]
