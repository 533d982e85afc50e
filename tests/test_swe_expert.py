"""Expert trajectories on generated tasks: edit commands checked by hand and replayed in Docker."""

from __future__ import annotations

import json

from swe_support import assert_no_leftovers, require_docker

from agentree.envs.base import Task
from agentree.envs.swe import SENTINEL, SWEEnv, parse_commands
from agentree.models.tiny import TinyModelConfig
from agentree.swe import expert, generate

FIXED = "def f(n):\n    if n < 0:\n        return 0\n    return n + 1\n"


def test_one_line_fix_is_a_sed_on_that_line():
    buggy = FIXED.replace("n < 0", "n <= 0")
    action = expert.fix_action("pkg/m.py", buggy, FIXED)
    (command,) = parse_commands(action)
    assert command == "sed -i '2s/<=/</' pkg/m.py"
    assert expert.check_edit(command, buggy, FIXED)
    assert not expert.check_edit(command, FIXED, buggy)


def test_sed_targets_the_first_match_only_when_it_is_the_bug():
    # the bug is the second `2,` on the line: the pattern widens until its first match is it
    fixed = "x = [2, 1, 3]\n"
    buggy = "x = [2, 2, 3]\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed))
    assert command == "sed -i '1s/ 2,/ 1,/' m.py"
    assert expert.check_edit(command, buggy, fixed)


def test_dropped_lines_are_restored_with_a_python_edit():
    buggy = FIXED.replace("    if n < 0:\n        return 0\n", "")
    (command,) = parse_commands(expert.fix_action("m.py", buggy, FIXED))
    assert command.startswith("python3 - <<'EOF'\nimport pathlib\n")
    assert expert.check_edit(command, buggy, FIXED)


def _records(slugs: list[str], n: int, split: str = "train") -> list[dict]:
    """Records of generated candidates without Docker validation (the expert only reads them)."""
    out, cands = [], generate.candidates(slugs)
    for c in cands[:: max(1, len(cands) // n)][:n]:  # spread over the files
        failing = "tests/t.py:3: in test_a\n    assert f(1) == 2\nE   assert 1 == 2"
        out.append(
            generate.make_record(c, ["tests/t.py::test_a"], ["tests/t.py::test_b"], failing, split)
        )
    return out


def test_every_path_and_line_number_is_copied_from_an_earlier_observation():
    import re

    for conv in expert.conversations(_records(["durations", "roman"], 12), per_task=1):
        seen = conv[0]["content"]
        for k in range(1, len(conv), 2):
            (command,) = parse_commands(conv[k]["content"])
            for path in re.findall(r"\b[a-z_]+/[a-z_]+\.py\b", command):
                assert path in seen, (path, command)
            for number in re.findall(r"(?:sed -i '|tail -n \+)(\d+)", command):
                assert re.search(rf"(^|\s|:){number}(\t|:)", seen, re.M), (number, command)
            if k + 1 < len(conv):
                seen += conv[k + 1]["content"]


def test_noisy_expert_aims_some_edits_at_a_neighbouring_line():
    records = [
        r
        for r in _records(["durations", "roman", "semver"], 40)
        if not r["mutation"]["kind"].startswith("drop")
    ]
    clean = expert.conversations(records, per_task=1, noise=0.0)
    noisy = expert.conversations(records, per_task=1, noise=0.5, seed=1)
    edits = [(c[5]["content"], n[5]["content"]) for c, n in zip(clean, noisy, strict=True)]
    wrong = [n for c, n in edits if c != n]
    assert 0.25 * len(edits) < len(wrong) < 0.75 * len(edits)
    for conv in noisy:
        if conv[5]["content"] in wrong:  # the tests fail after a wrong edit, and it says so
            assert "1 failed" in conv[8]["content"] and "<returncode>1<" in conv[8]["content"]


def test_expert_trajectories_replay_in_docker_and_resolve():
    require_docker()
    records, _ = generate.generate(2, seed=5, slugs=["intervals"], heldout=0.0)
    convs = [expert.trajectory(r) for r in records]
    assert all(c is not None for c in convs)
    first = convs[0]
    assert [m["role"] for m in first] == ["user"] + ["assistant", "user"] * 4 + ["assistant"]
    assert parse_commands(first[-1]["content"]) == [f"echo {SENTINEL}"]
    policy = expert.expert_policy(records)
    env = SWEEnv(step_limit=6, prewarm=0)
    try:
        for rec in records:
            task = SWEEnv.task_from_record(rec)
            task = Task(task.id, None, task.options)
            obs, _ = env.reset(options=task.options)
            history: list[tuple[str, str]] = []
            done, reward, outputs = False, 0.0, []
            while not done:
                action = policy(task, history)
                obs, reward, term, trunc, info = env.step(action)
                outputs.append(obs)
                history.append((action, obs))
                done = term or trunc
            assert reward == 1.0, info["grading"]["reason"]
            # the expert's grep and `cat -n` observations are exactly what the container printed
            conv = expert.trajectory(rec)
            assert conv is not None
            assert [conv[2]["content"], conv[4]["content"]] == outputs[:2]
            tests = len(json.loads(rec["FAIL_TO_PASS"])) + len(json.loads(rec["PASS_TO_PASS"]))
            assert f"{tests} passed" in outputs[3]
    finally:
        env.close()
    assert_no_leftovers(allow_spares=True)


def test_warm_policy_acts_well_formed_on_held_out_files(tmp_path):
    from transformers import AutoTokenizer

    # trained on six repositories, measured on a seventh whose files it never saw
    records = _records(["roman", "durations", "semver", "lrucache", "settings", "stats"], 48)
    heldout = _records(["intervals"], 6, split="heldout")
    cfg = expert.WarmConfig(
        model=TinyModelConfig(
            vocab_size=512,
            min_frequency=2,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=256,
        ),
        per_task=1,
        max_trajectories=48,
        epochs=10,
        batch_size=2,
        lr=3e-3,
    )
    path = expert.warm_policy(records, cfg, out_dir=tmp_path / "warm", log=lambda _: None)
    summary = json.loads((path / "sft.json").read_text())
    assert summary["examples"] == 48
    assert summary["epoch_loss"][-1] < summary["epoch_loss"][0]
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.tokenize("sed -i '") == ["sed -i '"]
    assert tok.tokenize(expert.TEST_RUN) == [expert.TEST_RUN]
    rate, actions = expert.well_formed_rate(path, heldout)
    assert actions == 6 * 5
    # this 64-wide model, 240 updates, gets 80% (sampled at temperature 1); the default
    # WarmConfig policy is measured on real held-out tasks by benchmarks/swe_warm_policy.py
    assert rate >= 0.7
    # built once: a second call with the same tasks and settings reuses the directory
    assert expert.warm_policy(records, cfg, out_dir=path) == path
