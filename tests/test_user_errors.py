"""Bad inputs a new user makes: each is one line on stderr saying what is wrong and what to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from agentree.commands.cli import main

FAST = ["--set", "engine.max_tokens=4", "--set", "env.max_turns=2", "--set", "rollout.K=2"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1
    line = err[-1]
    assert line.startswith("agentree: error: "), err
    assert "Traceback" not in "\n".join(err)
    return line.removeprefix("agentree: error: ")


def _tasks(tmp_path: Path, *records: dict) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_task_seed_that_is_not_an_integer(tmp_path, capsys, tiny_frozenlake):
    path = _tasks(tmp_path, {"id": "a", "seed": "x"})
    assert main(["rollout", "--tasks", str(path), "--output", str(tmp_path / "o"), *FAST]) == 2
    assert _one_line_error(capsys) == (
        f'{path}: record 1 ({{"id": "a", "seed": "x"}}): "seed" must be an integer or null, '
        "got 'x'"
    )


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_bad_task_file_is_reported_before_any_model_is_built(tmp_path, capsys, command):
    """The task source is read before the policy: a policy that does not exist is never
    reached, so the task file's error is the one reported (and no model load is paid)."""
    path = _tasks(tmp_path, {"id": "a", "seed": "x"})
    missing = tmp_path / "no-such-policy"
    argv = [
        command,
        "--tasks",
        str(path),
        "--policy",
        str(missing),
        "--output",
        str(tmp_path / "o"),
    ]
    assert main([*argv, *FAST]) == 2
    assert _one_line_error(capsys).startswith(f"{path}: record 1")


def test_task_options_that_are_not_a_mapping(tmp_path, capsys, tiny_frozenlake):
    path = _tasks(tmp_path, {"id": "a", "seed": 1, "options": [4]})
    assert main(["rollout", "--tasks", str(path), "--output", str(tmp_path / "o"), *FAST]) == 2
    assert _one_line_error(capsys) == (
        f'{path}: record 1 ({{"id": "a", "seed": 1, "options": [4]}}): "options" must be a '
        "mapping of reset options, got [4]"
    )


def test_bad_option_value_names_the_task(tmp_path, capsys, tiny_frozenlake):
    path = _tasks(tmp_path, {"id": "a", "seed": 1, "options": {"size": "abc"}})
    assert main(["rollout", "--tasks", str(path), "--output", str(tmp_path / "o"), *FAST]) == 2
    assert _one_line_error(capsys) == (
        'task a ({"id": "a", "seed": 1, "options": {"size": "abc"}}) could not be reset: '
        "ValueError: invalid literal for int() with base 10: 'abc'"
    )


def test_policy_path_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["rollout", "--policy", str(missing), "--output", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == (
        f"--policy {missing} does not exist; pass a name that `agentree models list` shows, a "
        "model directory (such as a run's checkpoints/step_NNNNNN) or a hub id"
    )


def test_policy_hub_id_the_hub_cannot_give(tmp_path, capsys, monkeypatch):
    """A name that is no directory and no built or fetched policy goes to the Hugging Face hub;
    when the hub cannot give it (here: offline, as this machine is), one line says what the name
    is not and what the hub said, instead of transformers' two-paragraph connection advice."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read once, when huggingface_hub is imported (an earlier test may have): without this the
    # hub is tried over the network, five retries a file
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = ["rollout", "--policy", "no-such-org/no-such-model", "--output", str(tmp_path / "o")]
    assert main(args) == 2
    line = _one_line_error(capsys)
    assert line.startswith(
        "--policy no-such-org/no-such-model is neither a local directory nor a name that "
        "`agentree models list` shows, and the Hugging Face hub could not provide it: "
    ), line
    assert not (tmp_path / "o").exists()


def test_policy_directory_without_a_model(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["rollout", "--policy", str(empty), "--output", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == (
        f"--policy {empty} holds no model (no config.json); pass a directory written by "
        "save_pretrained, such as a run's checkpoints/step_NNNNNN"
    )


def test_export_of_a_checkpoint_without_a_model_leaves_nothing(tmp_path, capsys):
    """A checkpoint with neither weights nor an adapter: one line, and no half-written output."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainer_state.pt").write_bytes(b"")
    assert main(["export", str(ckpt), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"agentree: error: {ckpt} holds neither a model (config.json) nor a LoRA adapter"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_judge_without_the_scorers_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # what an install without the extra has
    assert main(["rollout", "--scorer", "judge", "--output", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == (
        "the judge scorer needs the openai package: pip install 'agentree[scorers]'"
    )


@pytest.mark.parametrize("command", ["rollout", "eval"])
def test_prompt_longer_than_the_context_is_an_error(tmp_path, capsys, tiny_frozenlake, command):
    path = _tasks(tmp_path, {"id": "big", "seed": 1, "options": {"size": 99}})
    out = tmp_path / "o"
    argv = [command, "--tasks", str(path), "--output", str(out), *FAST]
    assert main([*argv, "--set", "engine.max_context=512"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("no trajectory could be produced: the prompt of task big has ")
    assert line.endswith(
        " tokens, more than engine.max_context=512 allows with engine.max_tokens=4; raise "
        "engine.max_context or shorten the task"
    )


def test_vllm_backend_without_vllm_names_the_extra(monkeypatch):
    """agentree.engines.vllm imports without vLLM, so the check asks for vllm itself."""
    import importlib.util

    from agentree.policy import _vllm_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"needs vLLM, which is not installed; install agentree\[vllm\]"
    ):
        _vllm_engine("unused", None, 0, {})
