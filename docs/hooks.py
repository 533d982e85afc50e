"""MkDocs hook: lay out the `agentree` package as it is installed, for the API reference.

The build maps `envs/` and `scorers/` into the package as `agentree.envs` and `agentree.scorers`
(setuptools `package-dir`). mkdocstrings reads source files without importing them, so it sees
only the `agentree/` folder. This hook writes `build/api-src/agentree/`: a symlink to every
entry of `agentree/` plus `envs` and `scorers`, which `mkdocs.yml` gives mkdocstrings as its
search path. It is rebuilt whenever MkDocs loads its config (every `mkdocs build`, every
`mkdocs serve` start): at import, because mkdocstrings reads its search path before any
`on_config` hook runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"envs": ROOT / "envs", "scorers": ROOT / "scorers"}


def lay_out_package() -> None:
    out = ROOT / "build" / "api-src" / "agentree"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for entry in (ROOT / "agentree").iterdir():
        if entry.name != "__pycache__":
            (out / entry.name).symlink_to(entry)
    for name, target in MAPPED.items():
        (out / name).symlink_to(target)


lay_out_package()
