"""Grade a patch the SWE-bench way, in a fresh container the agent never touched.

Start a container from the instance image, apply the patch with SWE-bench's sequence of apply
commands (each retry on a fresh container), run the instance's eval script (it applies the test
patch and prints the test output between the `>>>>> Start/End Test Output` markers), then let
`swebench` decide: `get_logs_eval` parses the log with the instance's log parser,
`get_eval_tests_report` and `get_resolution_status` say whether every FAIL_TO_PASS and
PASS_TO_PASS test passes. R2E-Gym instances are graded as R2E-Gym does: every test must end with
its expected status. A patch that does not apply, tests that time out or never run are clean
failures with a reason, never exceptions.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from agentree.envs.swe.instances import EVAL_R2E, SWEInstance, parse_log_r2e
from agentree.envs.swe.sandbox import OutputLost, Sandbox, SandboxConfig, SandboxError

PATCH_PATH = "/tmp/agentree_model.patch"
APPLY_CMDS = (
    "git apply --verbose",
    "git apply --verbose --3way",
    "git apply --verbose --reject",
    "patch --batch --forward --fuzz=5 -p1 -i",
)
"""SWE-bench's apply cascade (swebench.harness.run_evaluation.GIT_APPLY_CMDS)."""
LOG_LIMIT = 64 * 1024 * 1024
GRADE_ATTEMPTS = 3
"""Gradings of one patch, each in a fresh container, when a command's output is cut."""


@dataclass
class GradeResult:
    resolved: bool
    status: str
    """swebench's RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO."""
    patch_applied: bool
    reason: str = ""
    """Why the instance is not resolved (empty when resolved)."""
    tests: dict[str, str] = field(default_factory=dict)
    """Status of every test the log parser found."""
    report: dict[str, Any] = field(default_factory=dict)
    """FAIL_TO_PASS / PASS_TO_PASS -> {"success": [...], "failure": [...]}."""
    elapsed: float = 0.0
    log_tail: str = ""

    def to_info(self) -> dict[str, Any]:
        return {
            "resolved": self.resolved,
            "status": self.status,
            "patch_applied": self.patch_applied,
            "reason": self.reason,
            "tests": dict(self.tests),
            "report": self.report,
            "elapsed": round(self.elapsed, 3),
        }


def grade(
    instance: SWEInstance,
    patch: str,
    *,
    config: SandboxConfig | None = None,
    timeout: float = 1800.0,
) -> GradeResult:
    """Apply `patch` to a fresh container of `instance.image`, run its tests, decide resolved.

    A command whose output was cut in transit (`OutputLost`) is never judged: the grading is
    done again from a fresh container, and after `GRADE_ATTEMPTS` the error propagates (the
    episode ends as an env error, not as unresolved).
    """
    for attempt in range(GRADE_ATTEMPTS):
        try:
            return _grade_once(instance, patch, config, timeout)
        except OutputLost:
            if attempt == GRADE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _grade_once(
    instance: SWEInstance, patch: str, config: SandboxConfig | None, timeout: float
) -> GradeResult:
    start = time.monotonic()
    cfg = config or SandboxConfig(env=instance.env)
    sb = Sandbox(instance.image, cfg)
    try:
        _prepare(sb, instance)
        applied, apply_log = _apply(sb, patch, instance)
        if not applied:
            return GradeResult(
                False,
                "RESOLVED_NO",
                False,
                reason="patch did not apply: " + _tail(apply_log, 600),
                elapsed=time.monotonic() - start,
            )
        script = _eval_script(instance)
        sb.write_file("/eval.sh", script, mode=0o755)
        run = sb.exec("bash /eval.sh", timeout=timeout, max_output=LOG_LIMIT)
        if run.timed_out:
            res = GradeResult(
                False, "RESOLVED_NO", True, reason=f"tests timed out after {timeout:g}s"
            )
        elif instance.eval_type == EVAL_R2E:
            res = _judge_r2e(instance, run.output)
        else:
            res = _judge_swebench(instance, run.output)
        if not patch.strip():  # the tests ran on the untouched repository: nothing was applied
            res.patch_applied = False
            if not res.resolved:
                res.reason = "empty patch: the submission changes nothing; " + res.reason
        res.elapsed = time.monotonic() - start
        res.log_tail = _tail(run.output, 4000)
        return res
    finally:
        sb.close()


def _prepare(sb: Sandbox, instance: SWEInstance) -> None:
    if instance.prepare_script:
        r = sb.exec(instance.prepare_script, timeout=300)
        if r.returncode != 0:
            raise SandboxError(f"preparing {instance.instance_id} failed: {r.output[-400:]}")


def _apply(sb: Sandbox, patch: str, instance: SWEInstance) -> tuple[bool, str]:
    if not patch.strip():
        return True, "empty patch: nothing to apply"
    body = patch if patch.endswith("\n") else patch + "\n"
    log = ""
    for i, cmd in enumerate(APPLY_CMDS):
        if i:
            sb.recreate()  # a failed attempt (--3way, --reject) can leave a half-applied tree
            _prepare(sb, instance)
        sb.write_file(PATCH_PATH, body)
        r = sb.exec(f"cd /testbed && {cmd} {PATCH_PATH}", timeout=120, max_output=20_000)
        if r.returncode == 0:
            sb.exec(f"rm -f {PATCH_PATH}", timeout=30)
            return True, r.output
        log = r.output
    return False, log


def _eval_script(instance: SWEInstance) -> str:
    if instance.eval_type == EVAL_R2E:
        return instance.eval_script
    return _test_spec(instance).eval_script  # adds the test command's exit status to the log


def _test_spec(instance: SWEInstance) -> Any:
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.utils import make_test_spec

    return make_test_spec(instance.to_record())


def _judge_swebench(instance: SWEInstance, log: str) -> GradeResult:
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.constants import EvalType, ResolvedStatus
    from swebench.harness.grading import (
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
    )
    from swebench.harness.log_parsers import PARSER_REGISTRY

    if instance.log_parser not in PARSER_REGISTRY:
        return GradeResult(
            False,
            ResolvedStatus.NO.value,
            True,
            reason=f"unknown log_parser {instance.log_parser!r}: not in swebench's PARSER_REGISTRY",
        )
    spec = _test_spec(instance)
    fd, path = tempfile.mkstemp(prefix="agentree-eval-", suffix=".log")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(log)
        status_map, found = get_logs_eval(spec, path)
    finally:
        os.unlink(path)
    gold = {"FAIL_TO_PASS": spec.FAIL_TO_PASS, "PASS_TO_PASS": spec.PASS_TO_PASS}
    if not found:
        return GradeResult(
            False,
            ResolvedStatus.NO.value,
            True,
            reason="no test results in the log (the tests did not run or could not be parsed)",
        )
    report = get_eval_tests_report(status_map, gold, eval_type=EvalType(spec.eval_type))
    status = get_resolution_status(report)
    resolved = status == ResolvedStatus.FULL.value
    reason = ""
    if not resolved:
        failed = report["FAIL_TO_PASS"]["failure"] + report["PASS_TO_PASS"]["failure"]
        reason = f"{len(failed)} required test(s) failed: " + ", ".join(failed[:5])
    return GradeResult(resolved, status, True, reason, dict(status_map), _compact(report))


def _judge_r2e(instance: SWEInstance, log: str) -> GradeResult:
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.constants import ResolvedStatus

    body = log.split(">>>>> Start Test Output", 1)[-1].split(">>>>> End Test Output", 1)[0]
    got = parse_log_r2e(body)
    want = {k.split(" - ")[0]: v for k, v in instance.expected_output.items()}
    good = sorted(k for k, v in want.items() if got.get(k) == v)
    bad = sorted(k for k in want if got.get(k) != want[k])
    extra = sorted(set(got) - set(want))
    resolved = bool(got) and not bad and not extra
    reason = ""
    if not got:
        reason = "no test results in the log (the tests did not run or could not be parsed)"
    elif not resolved:
        reason = f"{len(bad) + len(extra)} test(s) differ from the expected output: " + ", ".join(
            (bad + extra)[:5]
        )
    status = ResolvedStatus.FULL.value if resolved else ResolvedStatus.NO.value
    report = {"EXPECTED": {"success": good, "failure": bad + extra}}
    return GradeResult(resolved, status, True, reason, got, report)


def _compact(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k in ("FAIL_TO_PASS", "PASS_TO_PASS")}


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]
