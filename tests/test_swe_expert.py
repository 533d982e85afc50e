"""Expert trajectories on generated tasks: edit commands checked by hand and replayed in Docker."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from swe_support import assert_no_leftovers, require_docker

from agentree.envs.base import Task
from agentree.envs.swe.env import SENTINEL, SWEEnv, parse_commands
from agentree.hub.tiny import TinyModelConfig
from agentree.swe import expert, generate

FIXED = "def f(n):\n    if n < 0:\n        return 0\n    return n + 1\n"


def test_one_line_fix_is_a_sed_on_that_line():
    buggy = FIXED.replace("n < 0", "n <= 0")
    action = expert.fix_action("pkg/m.py", buggy, FIXED)
    (command,) = parse_commands(action)
    assert command == "sed -i '2s|<=|<|' pkg/m.py"
    assert expert.check_edit(command, buggy, FIXED)
    assert not expert.check_edit(command, FIXED, buggy)


def test_one_line_fix_as_the_whole_new_line(tmp_path):
    buggy = FIXED.replace("n < 0", "n <= 0")
    (command,) = parse_commands(expert.fix_action("pkg/m.py", buggy, FIXED, edit="line"))
    assert command == "sed -i '2c\\    if n < 0:' pkg/m.py"
    assert expert.check_edit(command, buggy, FIXED)
    assert not expert.check_edit(command, FIXED.replace("n + 1", "n"), FIXED)
    assert not expert.check_edit(command.replace("'2c", "'9c"), buggy, FIXED)  # past the end
    # GNU sed does what check_edit replays, leading blanks included
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/m.py").write_text(buggy)
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    assert (tmp_path / "pkg/m.py").read_text() == FIXED
    # a quote or a backslash in the new line would need escaping: the changed words instead
    buggy, fixed = "x = f('a', 1)\n", "x = f('a', 2)\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed, edit="line"))
    assert command == "sed -i '1s|1)|2)|' m.py"


def test_a_change_edit_names_the_swapped_text_before_the_whole_line():
    buggy = FIXED.replace("n < 0", "n <= 0")
    action = expert.fix_action("pkg/m.py", buggy, FIXED, edit="change")
    assert action.startswith("THOUGHT: change `<=` to `<` on line 2.\n")
    assert parse_commands(action) == parse_commands(
        expert.fix_action("pkg/m.py", buggy, FIXED, edit="line")
    )
    c = expert.change_thought
    # widened until the old text occurs once in the line
    assert c("y = x[-1][1]", "y = x[-1][2]", 4) == "change `[1` to `[2` on line 4."
    assert c("y = a - 1 + b - 1", "y = a - 1 + b - 2", 4) == "change `b - 1` to `b - 2` on line 4."
    # an insertion or a deletion names the token beside it
    assert c("if x or y:", "if not x or y:", 3) == "change `if` to `if not` on line 3."
    assert c("if not x or y:", "if x or y:", 3) == "change `if not` to `if` on line 3."
    assert c("f(a, b)", "f(b, a)", 1) == "change `a, b` to `b, a` on line 1."


def test_sed_delimiter_avoids_the_characters_of_the_line():
    fixed, buggy = "x = a / 2 | b\n", "x = a / 20 | b\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed))
    assert command.startswith("python3 - <<'EOF'")  # both delimiters occur: python edit
    fixed, buggy = "x = a | b\n", "x = a & b\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed))
    assert command == "sed -i '1s/&/|/' m.py"
    assert expert.check_edit(command, buggy, fixed)
    fixed, buggy = "x = a / 2\n", "x = a * 2\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed))
    assert command == "sed -i '1s|\\*|/|' m.py"
    assert expert.check_edit(command, buggy, fixed)


def test_sed_targets_the_first_match_only_when_it_is_the_bug():
    # the bug is the second `2,` on the line: the pattern widens until its first match is it
    fixed = "x = [2, 1, 3]\n"
    buggy = "x = [2, 2, 3]\n"
    (command,) = parse_commands(expert.fix_action("m.py", buggy, fixed))
    assert command == "sed -i '1s| 2,| 1,|' m.py"
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


def test_renamed_copies_make_up_every_repository_name_and_keep_the_edits_true():
    import random
    import re

    records = _records(["durations", "roman"], 8)
    convs = expert.conversations(records, per_task=1, renamed_copies=2)
    assert len(convs) == 3 * len(records)
    names = expert.repo_names("agentree-local/roman")
    assert "to_roman" in names and "self" not in names and "tests" not in names
    words = set(re.findall(r"\w+", " ".join(expert.template_pieces(0))))
    assert not words & set(names)  # the prompt scaffold keeps its words
    for k, record in enumerate(records):
        original, copies = convs[3 * k], convs[3 * k + 1 : 3 * k + 3]
        assert copies[0] != copies[1] != original
        repo = expert.repo_names(record["repo"])
        for copy in copies:
            assert [m["role"] for m in copy] == [m["role"] for m in original]
            for a, b in zip(original, copy, strict=True):
                assert a["content"].count("\n") == b["content"].count("\n")
            text = " ".join(m["content"] for m in copy)
            assert not set(re.findall(r"\w+", text)) & set(repo)
    # the same table applied to the files keeps the edit exact
    record = records[0]
    buggy, fixed = expert._files(record)
    (command,) = parse_commands(expert.fix_action(record["mutation"]["file"], buggy, fixed))
    table = expert.rename_table(expert.repo_names(record["repo"]), random.Random(3))
    assert expert.apply_renames(buggy, table) != buggy
    args = (expert.apply_renames(x, table) for x in (command, buggy, fixed))
    assert expert.check_edit(*args)


def test_expert_tries_wrong_edits_undoes_them_and_sometimes_gives_up():
    records = _records(["durations", "roman", "semver"], 40)
    convs = expert.conversations(records, per_task=1, tries=3, seed=1)
    commands = [[parse_commands(m["content"])[0] for m in c[1::2]] for c in convs]
    fixes = [parse_commands(c[5]["content"])[0] for c in expert.conversations(records)]
    edits = [[c for c in cmds if c.startswith(("sed -i", "python3 - "))] for cmds in commands]
    given_up = [e[-1] != fix for e, fix in zip(edits, fixes, strict=True)]
    assert 0.1 * len(convs) < sum(given_up) < 0.4 * len(convs)  # 1 in 4 expected
    assert sum(len(e) > 1 for e in edits) > 0.3 * len(convs)
    for conv, cmds, e, fix, gave_up in zip(convs, commands, edits, fixes, given_up, strict=True):
        assert len(e) <= 3 and e.count(fix) == (0 if gave_up else 1)
        obs = [m["content"] for m in conv[2::2]]
        for k, c in enumerate(cmds[:-1]):
            if c in e[:-1] or (gave_up and c == e[-1]):  # a miss: tested, fails, undone
                assert c.startswith("sed -i") and c != fix
                assert cmds[k + 1] == expert.TEST_RUN and " failed, " in obs[k + 1]
                if k + 2 < len(cmds) - 1:
                    assert cmds[k + 2].startswith("git checkout -q -- ")
        assert cmds[-2] == expert.TEST_RUN and cmds[-1] == f"echo {SENTINEL}"
        assert ("failed" in obs[-1]) == gave_up


@pytest.mark.parametrize("edit", ["line", "change"])
def test_whole_line_misses_change_the_faulty_line_and_the_fix_rewrites_it(edit):
    """With whole-line edits the wrong edits are changes of the faulty line (where it has any),
    none is undone, and replaying every edit of a trajectory in order leaves the fixed file."""
    records = _records(["durations", "roman", "semver"], 40)
    convs = expert.conversations(records, per_task=1, tries=3, seed=1, edit=edit)
    same_line = 0
    for record, conv in zip(records, convs, strict=True):
        buggy, fixed = expert._files(record)
        line = expert._changed_line(buggy, fixed)
        cmds = [parse_commands(m["content"])[0] for m in conv[1::2]]
        edits = [c for c in cmds if c.startswith("sed -i")]
        if not edits or not all(c.startswith(f"sed -i '{line}c\\") for c in edits):
            continue
        same_line += 1
        assert not any(c.startswith("git checkout") for c in cmds)
        thoughts = [m["content"].split("\n", 1)[0] for m in conv[1::2] if "sed -i" in m["content"]]
        named = [
            t.startswith("THOUGHT: change `") and t.endswith(f" on line {line}.") for t in thoughts
        ]
        assert all(named) == (edit == "change")
        text = buggy
        for c in edits:  # each whole-line edit replaces the line the previous one wrote
            lines = text.splitlines(keepends=True)
            lines[line - 1] = c.split("c\\", 1)[1].rsplit("' ", 1)[0] + "\n"
            text = "".join(lines)
        gave_up = "failed" in conv[-2]["content"]
        assert (text == fixed) != gave_up
        assert expert.check_edit(edits[-1], buggy, fixed) != gave_up
    assert same_line > 0.6 * len(convs)


@pytest.mark.docker
def test_expert_trajectories_replay_in_docker_and_resolve():
    require_docker()
    # a dropped return (python edit) and an off-by-one (sed), each with a wrong edit to try
    records, _ = generate.generate(2, seed=1, slugs=["intervals"], heldout=0.0)
    convs = [expert.trajectory(r) for r in records]
    assert all(c is not None for c in convs)
    first = convs[0]
    assert [m["role"] for m in first] == ["user"] + ["assistant", "user"] * 4 + ["assistant"]
    assert parse_commands(first[-1]["content"]) == [f"echo {SENTINEL}"]
    env = SWEEnv(step_limit=9, prewarm=0)
    # the off-by-one also with its edits written as whole lines: the wrong one is then a change
    # of the faulty line, rewritten by the fix rather than undone
    try:
        for rec, edit in [(records[0], "sed"), (records[1], "sed"), (records[1], "line")]:
            policy = expert.expert_policy(records, misses=1, edit=edit)  # a wrong edit first
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
            # grep, cat, miss, tests, [undo,] fix, tests, submit: the expert's grep, `cat -n`,
            # edit and undo observations are exactly what the container printed
            conv = expert.trajectory(rec, misses=1, edit=edit)
            undo = edit == "sed"
            assert conv is not None and len(outputs) == len(conv) // 2 == 7 + undo
            same = (2, 4, 6, 10)  # grep, cat, the miss, and the undo or the fix
            assert [conv[k]["content"] for k in same] == [outputs[k // 2 - 1] for k in same]
            assert " failed, " in outputs[3] and "<returncode>0<" in outputs[3]
            tests = len(json.loads(rec["FAIL_TO_PASS"])) + len(json.loads(rec["PASS_TO_PASS"]))
            assert f"{tests} passed" in outputs[-2]
            commands = [parse_commands(m["content"])[0] for m in conv[1::2]]
            assert any(c.startswith("git checkout") for c in commands) == undo
            if not undo:
                assert commands[2].split("c\\")[0] == commands[4].split("c\\")[0]  # one line
    finally:
        env.close()
    assert_no_leftovers(allow_spares=True)


@pytest.mark.slow  # fine-tunes a tiny SWE policy for 10 epochs: about a minute
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
    # greedy per-turn match: every turn of the expert's episode asked once per task
    match = expert.turn_match(path, heldout[:2])
    assert {t: n for t, (_, n) in match.items()} == dict.fromkeys(expert.TURNS, 2)
    assert all(0 <= hit <= n for hit, n in match.values())
    # built once: a second call with the same tasks and settings reuses the directory
    assert expert.warm_policy(records, cfg, out_dir=path) == path


SMALL = TinyModelConfig(
    vocab_size=256,
    min_frequency=2,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    intermediate_size=64,
)
"""A policy small enough to build twice in a test."""


@pytest.mark.slow  # two one-epoch builds of a 32-wide policy: about 15 s
def test_warm_policy_with_a_history_window_trains_turn_by_turn(tmp_path, monkeypatch):
    """`WarmConfig.history` (`agentree swe warm --history K`): one example per expert turn, laid
    out as the rollouts show it under engine.history=last:K; its own cache entry."""
    monkeypatch.setenv("AGENTREE_CACHE", str(tmp_path / "cache"))
    records = _records(["durations", "roman"], 2)
    whole = expert.WarmConfig(model=SMALL, renamed_copies=0, epochs=1, batch_size=4)
    window = whole.model_copy(update={"history": 2})
    convs = [json.loads(x)["messages"] for x in _written(records, whole, tmp_path)]
    answers = sum(m["role"] == "assistant" for c in convs for m in c)
    said: list[str] = []
    path = expert.warm_policy(records, window, log=said.append)
    assert json.loads((path / "sft.json").read_text())["examples"] == answers
    assert any("turn by turn, each with the last 2" in m for m in said)
    plain = expert.warm_policy(records, whole, log=lambda _: None)
    assert plain != path  # the window is part of the build's key
    assert json.loads((plain / "sft.json").read_text())["examples"] == len(convs)
    saved = expert.WarmConfig.model_validate_json((path / expert.WARM_CONFIG).read_text())
    assert saved.history == 2


@pytest.mark.slow  # two one-epoch builds of a 32-wide policy: about 15 s
def test_a_tool_mode_warm_policy_writes_its_calls_in_the_chosen_format(tmp_path, monkeypatch):
    """`agentree swe warm --action-format tools --tool-format F`: the calls are fine-tuned in F,
    a build of its own; Hermes, the format of every earlier build, keeps their key."""
    from agentree.hub.store import content_key

    monkeypatch.setenv("AGENTREE_CACHE", str(tmp_path / "cache"))
    records = _records(["durations"], 2)
    hermes = expert.WarmConfig(
        model=SMALL, renamed_copies=0, epochs=1, batch_size=4, action_format="tools"
    )
    xml = hermes.model_copy(update={"tool_format": "qwen3_coder"})
    before = hermes.model_dump(exclude={"history", "tool_format"})  # the key's fields until now
    convs = expert._conversations(records, hermes)
    plain = expert.warm_policy(records, hermes, log=lambda _: None)
    assert plain.name == content_key({"convs": convs, "cfg": before, "v": 3})
    path = expert.warm_policy(records, xml, log=lambda _: None)
    assert path != plain
    saved = expert.WarmConfig.model_validate_json((path / expert.WARM_CONFIG).read_text())
    assert saved.tool_format == "qwen3_coder"
    # the tokenizer learned its merges from the calls as the policy writes them
    from transformers import AutoTokenizer

    from agentree.tools import ToolCall, call_format

    def tokens(build: Path, fmt: str) -> int:
        call = call_format(fmt).format([ToolCall("execute_bash", {"command": "ls"})])
        return len(AutoTokenizer.from_pretrained(build).tokenize(call))

    assert tokens(path, "qwen3_coder") < tokens(plain, "qwen3_coder")
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        expert.WarmConfig(tool_format="xml")


def _written(records: list[dict], cfg: expert.WarmConfig, tmp_path: Path) -> list[str]:
    out = tmp_path / "expert.jsonl"
    expert.write_trajectories(records, out, cfg)
    return out.read_text().splitlines()


def test_warm_command_writes_trajectories_for_another_model(tmp_path, capsys):
    from agentree.commands.swe import main

    records = _records(["durations", "roman"], 6)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "expert.jsonl"
    assert main(["swe", "warm", "--tasks", str(tasks), "--no-build"]) == 2
    assert "--no-build needs --trajectories" in capsys.readouterr().err
    args = ["swe", "warm", "--tasks", str(tasks), "--trajectories", str(out), "--no-build"]
    assert main(args) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 * 4  # one trajectory per task and its three renamed copies
    assert "wrote 24 trajectories" in capsys.readouterr().out
    assert all(r["messages"][-1]["content"] == expert.SUBMIT_ACTION for r in rows)
    assert not list(tmp_path.glob("**/config.json"))  # nothing built
    # two trajectories a task, edits after a THOUGHT that names the change
    assert main([*args, "--per-task", "2", "--edit", "change", "--renamed-copies", "0"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 * 2
    thoughts = [m["content"] for r in rows for m in r["messages"] if "sed -i '" in m["content"]]
    assert thoughts and all(t.startswith("THOUGHT: change `") for t in thoughts)


def test_episode_stages_follow_the_experts_path():
    """The expert's own episode reaches every stage; one that greps another definition, lists
    the right file, edits the right line wrongly and never submits stops at `show`."""
    record = _records(["durations"], 1)[0]
    conv = expert.trajectory(record)
    commands = [c for m in conv if m["role"] == "assistant" for c in parse_commands(m["content"])]
    assert expert.episode_stages(record, commands) == dict.fromkeys(expert.STAGES, True)
    grep, show, edit = commands[0], commands[1], commands[2]
    line = int(edit.split("'")[1].split("s")[0])
    path = edit.split()[-1]
    wrong = [
        'grep -rnF --include=*.py --exclude-dir=tests "def not_the_one" *',
        show,
        f"sed -i '{line}s|a|b|' {path}",
    ]
    assert grep != wrong[0] and show.startswith("cat -n") and path in show.split()
    stages = expert.episode_stages(record, wrong)
    # `a` -> `b` inside a word of the line: the line is edited, but into no injected bug
    assert stages == {
        "grep": False,
        "show": True,
        "edit_line": True,
        "swap": False,
        "fix": False,
        "submit": False,
    }
    # one of the expert's own wrong edits of that line is a step of its search: a swap
    buggy, fixed = expert._files(record)
    miss = next(
        m.source
        for m in expert.mutations(path, buggy)
        if m.line == line and m.source != fixed and not m.kind.startswith("drop")
    )
    (swap,) = parse_commands(expert.fix_action(path, buggy, miss, edit="line"))
    assert expert.episode_stages(record, [swap])["swap"]
    assert not expert.episode_stages(record, [swap])["fix"]
    assert not expert.episode_stages(record, [show.replace(path, path + "x")])["show"]
    # a policy's edits may name a line past the end or hold garbled Python: no stage, no error
    garbled = "python3 - <<'EOF'\np.write_text(t.replace(1, 2, 1))\nEOF"
    for bad in (f"sed -i '999999s|a|b|' {path}", garbled):
        assert not any(expert.episode_stages(record, [bad]).values())
