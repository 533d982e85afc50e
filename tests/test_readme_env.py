"""The README's "Adding an environment" example, taken verbatim from README.md, must work."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from agentree.commands.cli import main
from agentree.envs import EnvCheckError, check_env

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_section_blocks(title: str) -> list[tuple[str, str]]:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


@pytest.fixture()
def readme_pkg(tmp_path, monkeypatch):
    """Write the README's env module to `mypkg/guess.py`, where its first line says it lives."""
    blocks = _readme_section_blocks("Adding an environment")
    code = next(body for lang, body in blocks if lang == "python" and "class GuessEnv" in body)
    first = code.splitlines()[0]
    assert first.startswith("# ") and first.endswith(".py"), first
    target = tmp_path / first[2:].strip()
    target.parent.mkdir(parents=True)
    (target.parent / "__init__.py").write_text("")
    target.write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield blocks
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def test_readme_check_env_snippet_runs(readme_pkg):
    snippet = next(b for lang, b in readme_pkg if lang == "python" and "check_env(" in b)
    exec(compile(snippet, "README.md", "exec"), {})


def test_check_env_without_actions_names_the_method_to_add(readme_pkg):
    from mypkg.guess import GuessEnv

    with pytest.raises(EnvCheckError) as e:
        check_env(GuessEnv())
    assert str(e.value) == (
        "check_env needs sample actions: pass actions=[...] or implement GuessEnv.example_actions()"
    )


def test_readme_train_command_runs(readme_pkg, tmp_path):
    command = next(b for lang, b in readme_pkg if lang == "bash" and "agentree train" in b)
    argv = command.split()[1:]
    out = tmp_path / "run"
    fast = {
        "train.steps": 1,
        "train.tasks_per_step": 2,
        "eval.tasks": 2,
        "eval.samples": 1,
        "engine.max_tokens": 4,
        "rollout.K": 2,
    }
    for key, value in fast.items():
        argv += ["--set", f"{key}={value}"]
    assert main([*argv, "--output", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
    assert (out / "checkpoints" / "latest").exists()
