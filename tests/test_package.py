"""The package as users install it: a checkout imports without an install (envs, scorers,
prompts and configs live inside `agentree/`), and a built wheel holds every module and data file
the code reads through `importlib.resources`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what a checkout holds besides its files: git's store, virtualenvs, runs, build outputs, caches
LOCAL_ONLY = (
    ".git",
    ".venv*",
    "runs",
    "build",
    "dist",
    "site",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
)


def test_a_checkout_imports_without_an_install(tmp_path):
    code = "import agentree.config, agentree.envs, agentree.scorers; print(agentree.__file__)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # -I would drop PYTHONPATH; -S keeps site-packages' editable finder out of the way
    r = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {sys.path[1:]!r}; {code}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == ROOT / "agentree" / "__init__.py"


@pytest.mark.slow
def test_the_wheel_holds_the_modules_and_data(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*LOCAL_ONLY))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # pip shows the build backend's warnings: a data folder that setuptools takes for an unlisted
    # package is warned about at every install, 40 lines each
    assert "absent from the `packages` configuration" not in r.stdout + r.stderr
    (wheel,) = tmp_path.glob("agentree-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expect = [
        "agentree/envs/frozenlake.py",
        "agentree/envs/babyai.py",
        "agentree/envs/swe/env.py",
        "agentree/scorers/bfs.py",
        "agentree/configs/frozenlake_patr.yaml",
        "agentree/configs/babyai_patr.yaml",
        "agentree/prompts/frozenlake/system.txt",
        "agentree/prompts/math/sample.jsonl",
        "agentree/viewer/template.html",
        "agentree/commands/cli.py",
        "agentree/rollout/turn/patr.py",
    ]
    missing = [n for n in expect if n not in names]
    assert missing == []
    suite = [n for n in names if n.startswith("agentree/envs/swe/local_suite/")]
    tasks = {n.split("/")[4] for n in suite if n.endswith("/task.json")}
    assert tasks == {
        p.parent.name for p in (ROOT / "agentree/envs/swe/local_suite").glob("*/task.json")
    }
    assert any("/repo/" in n for n in suite)
    assert not [n for n in names if n.split("/")[0] in ("envs", "scorers", "prompts", "configs")]
