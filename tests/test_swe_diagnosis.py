"""SWE failures a user must be able to read: a patch that never applied, a killed container."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
from swe_support import assert_no_leftovers, local_records_fixture  # noqa: F401

from agentree.cli import main
from agentree.swe import runtime
from agentree.swe.instances import from_record
from agentree.swe.sandbox import Sandbox, SandboxConfig

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
    from agentree.swe.grading import grade

    res = grade(from_record(local_records[0]), "")
    assert res.patch_applied is False and not res.resolved
    assert res.reason.startswith("empty patch: the submission changes nothing; ")
    assert res.report["FAIL_TO_PASS"]["failure"]  # the tests still ran


def test_exec_racing_a_kill_restarts_the_container(local_records):
    """An exec that meets a container being killed gets Docker's error ("cannot exec in a
    stopped state", "OCI runtime exec failed", "task ... not found") instead of the command's
    output; the sandbox restarts the container and runs the command."""
    image = from_record(local_records[0]).image
    api = runtime.client().api

    def kill(cid: str) -> None:
        with contextlib.suppress(Exception):  # already stopped by the time it lands
            api.kill(cid)

    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        sb.exec("echo keep > /root/state.txt")
        for delay in (0, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.1):
            killer = threading.Thread(target=kill, args=(sb.container_id,))
            killer.start()
            time.sleep(delay)
            res = sb.exec("cat /root/state.txt")
            killer.join()
            assert (res.output, res.returncode) == ("keep\n", 0), delay
