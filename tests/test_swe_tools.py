"""SWE in tool mode, in real Docker: the file editor's and search's semantics and messages
(SWE-agent / R2E-Gym), malformed calls as format errors, forking, and the local suite's gold
patches resolving through the tools."""

from __future__ import annotations

import json

import pytest
from swe_support import assert_no_leftovers, local_records_fixture  # noqa: F401

from agentree.envs import check_env
from agentree.envs.swe.env import FORMAT_ERROR_KEY, SWEEnv
from agentree.envs.swe.tools import patch_calls
from agentree.tools import ToolCall, call_format

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _no_leaks(local_records):
    yield
    assert_no_leftovers()


def call(name: str, **arguments) -> str:
    return call_format("hermes").format([ToolCall(name, arguments)])


def edit(**arguments) -> str:
    return call("file_editor", **arguments)


def test_patch_calls_turn_hunks_into_str_replace_and_create():
    patch = (
        "diff --git a/pkg/a.py b/pkg/a.py\n--- a/pkg/a.py\n+++ b/pkg/a.py\n"
        "@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n+y = 3\n z = 4\n"
        "diff --git a/pkg/new.py b/pkg/new.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/pkg/new.py\n@@ -0,0 +1,2 @@\n+one\n+two\n"
    )
    replace, create = patch_calls(patch)
    assert replace.arguments == {
        "command": "str_replace",
        "path": "/testbed/pkg/a.py",
        "old_str": "x = 1\ny = 2\nz = 4",
        "new_str": "x = 1\ny = 3\nz = 4",
    }
    assert create.arguments == {
        "command": "create",
        "path": "/testbed/pkg/new.py",
        "file_text": "one\ntwo\n",
    }


def test_editor_and_search_semantics(local_records):
    task = SWEEnv.task_from_record(local_records[0])
    env = SWEEnv(action_format="tools", grade=False)
    try:
        obs, _ = env.reset(seed=task.seed, options=task.options)
        assert "call submit" in obs and env.tools()[0]["function"]["name"] == "execute_bash"

        def step(action: str) -> str:
            out, reward, term, trunc, _ = env.step(action)
            assert not term and not trunc and reward == 0.0
            return out

        f = "/testbed/notes.txt"
        assert step(edit(command="create", path=f, file_text="a\nb\nc\n")) == (
            f"File created successfully at: {f}"
        )
        assert step(edit(command="create", path=f, file_text="x")) == (
            f"ERROR: File already exists at: {f}. Cannot overwrite files using command `create`."
        )
        assert step(edit(command="view", path="notes.txt")).startswith(
            "ERROR: The path notes.txt is not an absolute path, it should start with `/`. "
            "Maybe you meant /testbed/notes.txt?"
        )
        assert step(edit(command="view", path=f)) == (
            f"Here's the result of running `cat -n` on {f}:\n"
            "     1\ta\n     2\tb\n     3\tc\n     4\t\n"
        )
        assert step(edit(command="view", path=f, view_range=[2, 3])).endswith("2\tb\n     3\tc\n")
        assert "should be within the range of lines of the file: [1, 4]" in step(
            edit(command="view", path=f, view_range=[9, 10])
        )
        assert step(edit(command="str_replace", path=f, old_str="zz", new_str="y")) == (
            f"ERROR: No replacement was performed, old_str `zz` did not appear verbatim in {f}."
        )
        step(edit(command="insert", path=f, insert_line=0, new_str="b"))
        assert step(edit(command="str_replace", path=f, old_str="b", new_str="B")) == (
            "ERROR: No replacement was performed. Multiple occurrences of old_str `b` in lines "
            "[1, 3]. Please ensure it is unique"
        )
        replaced = step(edit(command="str_replace", path=f, old_str="a\nb", new_str="A\nB"))
        assert replaced.startswith(f"The file {f} has been edited.") and "2\tA\n" in replaced
        assert "It should be within the range of lines of the file: [0, 5]" in step(
            edit(command="insert", path=f, insert_line=7, new_str="z")
        )
        assert step(call("execute_bash", command="cat notes.txt")) == (
            "<returncode>0</returncode>\n<output>\nb\nA\nB\nc\n</output>\n"
        )
        found = step(call("search", search_term="B", path="/testbed/notes.txt"))
        assert found == 'Matches for "B" in /testbed/notes.txt:\n3:B'
        assert step(call("search", search_term="B", path="/testbed")).startswith(
            'Found 1 matches for "B" in /testbed:\n/testbed/notes.txt (1 matches)'
        )
        assert step(call("search", search_term="no-such-text-anywhere")) == (
            'No matches found for "no-such-text-anywhere" in .'
        )
        # two calls in one turn: one tool result each
        _, _, _, _, info = env.step(
            call("execute_bash", command="echo one") + call("execute_bash", command="echo two")
        )
        assert [r.split("<output>\n")[1] for r in info["tool_results"]] == [
            "one\n</output>\n",
            "two\n</output>\n",
        ]
        # a malformed call is a format error the policy can read, not an exception
        out, _, _, _, info = env.step('<tool_call>{"name": "file_editor", "arguments": {}}')
        assert info["format_error"] and info["action_key"] == FORMAT_ERROR_KEY
        assert "bad arguments for file_editor: 'command' is a required property." in out
    finally:
        env.close()


def test_tool_mode_forks_faithfully(local_records):
    task = SWEEnv.task_from_record(local_records[0])
    actions = [
        edit(command="create", path="/testbed/fork.txt", file_text="1\n"),
        edit(command="str_replace", path="/testbed/fork.txt", old_str="1", new_str="2"),
        call("execute_bash", command="cat fork.txt"),
    ]
    report = check_env(
        SWEEnv(action_format="tools", grade=False), options=task.options, actions=actions
    )
    assert report["forkable"]


def test_gold_patches_resolve_through_the_tools(local_records):
    env = SWEEnv(action_format="tools")
    gold = SWEEnv.scripted_policy("gold", env.tools())
    try:
        for rec in local_records:
            task = SWEEnv.task_from_record(rec)
            env.reset(seed=task.seed, options=task.options)
            history: list[tuple[str, str]] = []
            while True:
                action = gold(task, history)
                obs, reward, term, trunc, info = env.step(action)
                history.append((action, obs))
                assert info["format_error"] is False
                if term or trunc:
                    break
            assert json.loads(history[0][0].split("\n")[1])["name"] == "file_editor"
            assert reward == 1.0 and info["grading"]["status"] == "RESOLVED_FULL", task.id
    finally:
        env.close()


def test_expert_in_tool_form_replays_through_the_tools_and_resolves(local_records):
    """`agentree swe warm --action-format tools` teaches these conversations (`agentree sft`
    lays them out as `test_tools` checks for FrozenLake): each command an execute_bash call,
    submit a call, each output a tool turn; replayed in Docker through the tool mode they
    resolve the task and the outputs are what the container printed."""
    from agentree.envs.base import Task
    from agentree.swe import expert, generate

    (record,), _ = generate.generate(1, seed=1, slugs=["intervals"], heldout=0.0)
    conv = expert.tool_form(expert.trajectory(record, misses=1))
    assert conv[0]["content"].rstrip().endswith("you cannot continue after submitting.")
    assert [m["role"] for m in conv[:3]] == ["user", "assistant", "tool"]
    assert conv[1]["content"].startswith("THOUGHT: ")
    assert conv[-1]["tool_calls"][0]["function"]["name"] == "submit"
    env = SWEEnv(action_format="tools", step_limit=12, prewarm=0)
    try:
        task = SWEEnv.task_from_record(record)
        env.reset(options=Task(task.id, None, task.options).options)
        outputs = []
        for m in conv[1::2]:
            calls = [
                ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ]
            obs, reward, term, _, info = env.step(call_format("hermes").format(calls))
            outputs.append(obs)
        assert term and reward == 1.0, info["grading"]
        assert [m["content"] for m in conv[2:8:2]] == outputs[:3]  # grep, cat -n, the miss
    finally:
        env.close()
