"""SWE failures a user must be able to read: a patch that never applied, a killed container."""

from __future__ import annotations

import json
import os
import signal

import pytest
from swe_support import assert_no_leftovers, local_records_fixture  # noqa: F401

from agentree.commands.cli import main
from agentree.envs.swe import runtime
from agentree.envs.swe.instances import from_record
from agentree.envs.swe.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _no_leaks(local_records):
    yield
    assert_no_leftovers()


def test_gold_patch_that_does_not_apply_is_reported(local_records, tmp_path):
    rec = dict(local_records[0])
    lines = rec["patch"].splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("-") and not ln.startswith("---"))
    lines[i] = "-this line is not in the file\n"  # the patch removes a line that is not there
    rec["patch"] = "".join(lines)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(rec) + "\n")
    out = tmp_path / "eval"
    argv = ["eval", "--env", "swebench", "--policy", "gold", "--tasks", str(tasks)]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())["per_task"][0]
    grading = result["grading"]
    assert grading["resolved"] is False
    assert grading["patch_applied"] is False
    assert "git apply" in grading["apply_error"] and "patch failed" in grading["apply_error"]
    assert grading["reason"].startswith("empty patch: the submission changes nothing; ")


def test_empty_submission_is_not_an_applied_patch(local_records):
    from agentree.envs.swe.grading import grade

    res = grade(from_record(local_records[0]), "")
    assert res.patch_applied is False and not res.resolved
    assert res.reason.startswith("empty patch: the submission changes nothing; ")
    assert res.report["FAIL_TO_PASS"]["failure"]  # the tests still ran


def test_exec_right_after_a_kill_restarts_the_container(local_records):
    """The container's init is SIGKILLed, then the next command runs while Docker is still
    tearing the container down: the exec meets Docker's error ("cannot exec in a stopped
    state", "OCI runtime exec failed", "No such exec instance", ...) instead of the command's
    output. The sandbox restarts the container (its filesystem is intact) and runs it."""
    image = from_record(local_records[0]).image
    api = runtime.client().api
    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        sb.exec("echo keep > /root/state.txt")
        for _ in range(10):
            os.kill(api.inspect_container(sb.container_id)["State"]["Pid"], signal.SIGKILL)
            res = sb.exec("cat /root/state.txt")
            assert (res.output, res.returncode) == ("keep\n", 0)
