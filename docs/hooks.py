"""MkDocs hook: lay out the `agentree` package as it is installed, for the API reference.

The build maps `envs/` and `scorers/` into the package as `agentree.envs` and `agentree.scorers`
(setuptools `package-dir`). mkdocstrings reads source files without importing them, so in the
repository it would see only the `agentree/` folder. This hook writes a temporary
`agentree/` holding a symlink to every entry of the real one plus `envs` and `scorers`, and
points mkdocstrings at it, before mkdocstrings reads its settings. The folder is removed when
MkDocs exits.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"envs": ROOT / "envs", "scorers": ROOT / "scorers"}
_search_path: str | None = None


def lay_out_package(parent: Path) -> None:
    out = parent / "agentree"
    out.mkdir()
    for entry in (ROOT / "agentree").iterdir():
        if entry.name != "__pycache__":
            (out / entry.name).symlink_to(entry)
    for name, target in MAPPED.items():
        (out / name).symlink_to(target)


@event_priority(100)  # before mkdocstrings' on_config, which reads the search path
def on_config(config):
    global _search_path
    if _search_path is None:
        _search_path = tempfile.mkdtemp(prefix="agentree-api-src-")
        lay_out_package(Path(_search_path))
    config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})["paths"] = [
        _search_path
    ]
    return config


def on_shutdown():
    if _search_path is not None:
        shutil.rmtree(_search_path, ignore_errors=True)
