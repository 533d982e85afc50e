"""SWEEnv end to end in real Docker: the env contract, grading, scripted policies, R2E-Gym."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from swe_support import (
    assert_no_leftovers,
    local_records_fixture,  # noqa: F401
    settle,
)

from agentree.envs import check_env, make_env
from agentree.envs.swe import runtime
from agentree.envs.swe.env import FORMAT_ERROR_KEY, SENTINEL, SUBMIT_ACTION, SWEEnv
from agentree.envs.swe.grading import grade
from agentree.envs.swe.instances import from_record
from agentree.envs.swe.sandbox import SandboxError

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _no_leaks(local_records):
    yield
    assert_no_leftovers()


def bash(cmd: str) -> str:
    return f"THOUGHT: next step.\n\n```bash\n{cmd}\n```"


def run_policy(env: SWEEnv, task, policy) -> tuple[float, dict, int]:
    env.reset(seed=task.seed, options=task.options)
    history: list[tuple[str, str]] = []
    while True:
        action = policy(task, history)
        obs, reward, term, trunc, info = env.step(action)
        history.append((action, obs))
        if term or trunc:
            return reward, info, len(history)


def test_make_env_by_registered_name(local_records):
    env = make_env("swebench", step_limit=7)
    assert isinstance(env, SWEEnv) and env.config.step_limit == 7
    with pytest.raises(ValueError, match=r"unknown config key 'env\.nope'"):
        make_env("swebench", nope=1)


def test_check_env_passes(local_records):
    task = SWEEnv.task_from_record(local_records[0])
    report = check_env(SWEEnv(), options=task.options)
    assert report["forkable"] and report["deterministic"]


@pytest.mark.parametrize("policy", ["gold", "empty"])
def test_scripted_policies_on_the_local_suite(local_records, policy):
    env = SWEEnv()
    outcomes = {}
    try:
        for rec in local_records:
            task = SWEEnv.task_from_record(rec)
            reward, info, steps = run_policy(env, task, SWEEnv.scripted_policy(policy))
            g = info["grading"]
            outcomes[task.id] = reward
            assert info["success"] is (reward == 1.0)
            assert info["prediction"]["instance_id"] == task.id
            f2p, p2p = json.loads(rec["FAIL_TO_PASS"]), json.loads(rec["PASS_TO_PASS"])
            assert set(g["tests"]) >= set(f2p) | set(p2p)
            assert g["report"]["PASS_TO_PASS"]["failure"] == []
            if policy == "gold":
                assert steps == 2 and g["status"] == "RESOLVED_FULL"
                assert info["prediction"]["model_patch"] == rec["patch"]
                assert all(g["tests"][t] == "PASSED" for t in f2p)
            else:
                assert steps == 1 and info["prediction"]["model_patch"] == ""
                assert g["status"] == "RESOLVED_NO" and g["reason"]
                assert set(g["report"]["FAIL_TO_PASS"]["failure"]) == set(f2p)
    finally:
        env.close()
    expected = 1.0 if policy == "gold" else 0.0
    assert outcomes == {r["instance_id"]: expected for r in local_records}


def test_patch_that_does_not_apply_is_a_clean_failure(local_records):
    inst = from_record(local_records[0])
    lines = inst.patch.splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("-") and not ln.startswith("---"))
    lines[i] = "-this line is not in the file\n"  # the patch removes a line that is not there
    bad = "".join(lines)
    res = grade(inst, bad)
    assert not res.resolved and not res.patch_applied
    assert res.reason.startswith("patch did not apply")
    res = grade(inst, "this is not a diff\n")
    assert not res.resolved and res.reason.startswith("patch did not apply")
    # a patch that applies but breaks the code is graded, not crashed
    lines = inst.patch.splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("+") and not ln.startswith("+++"))
    lines[i] = lines[i].rstrip("\n") + " )(\n"  # a syntax error in the fix
    broken = "".join(lines)
    res = grade(inst, broken)
    assert res.patch_applied and not res.resolved and res.reason


def test_deleting_the_tests_does_not_pass(local_records):
    rec = local_records[0]
    task = SWEEnv.task_from_record(rec)
    env = SWEEnv()
    try:
        env.reset(options=task.options)
        # grading restores and patches the test files in a fresh container
        env.step(bash("rm -rf tests && printf 'x' > conftest.py"))
        _, reward, term, _, info = env.step(bash(f"echo {SENTINEL}"))
        assert term and reward == 0.0 and not info["grading"]["resolved"]
    finally:
        env.close()


def test_format_errors_step_limit_and_action_keys(local_records):
    task = SWEEnv.task_from_record(local_records[1])
    env = SWEEnv(step_limit=4)
    try:
        obs, info = env.reset(options=task.options)
        assert SENTINEL in obs and task.options["instance"]["problem_statement"].strip() in obs
        assert "exactly one bash code block" in env.system_prompt
        obs, r, term, trunc, info = env.step("I will just think about it.")
        assert (r, term, trunc) == (0.0, False, False)
        assert "contained 0" in obs and info["action_key"] == FORMAT_ERROR_KEY
        obs, *_, info = env.step(bash("ls") + "\n" + bash("pwd"))
        assert "contained 2" in obs and info["format_error"]
        obs, r, term, trunc, info = env.step(bash("git   status  --short \n\n  ls  "))
        assert (
            "<returncode>0</returncode>" in obs and info["action_key"] == "git status --short\nls"
        )
        obs, r, term, trunc, info = env.step(bash("echo hi"))
        assert trunc and not term and info["end"] == "step_limit"
        assert (
            info["grading"]["status"] == "RESOLVED_NO" and info["prediction"]["model_patch"] == ""
        )
        with pytest.raises(RuntimeError, match="episode has ended"):
            env.step(bash("ls"))
    finally:
        env.close()


def test_timeout_and_truncated_output_observations(local_records):
    task = SWEEnv.task_from_record(local_records[0])
    env = SWEEnv(command_timeout=1, max_output=1000)
    try:
        env.reset(options=task.options)
        obs, *_, info = env.step(bash("echo partial; sleep 30"))
        assert info["timed_out"] and "ran longer than 1 seconds" in obs and "partial" in obs
        obs, *_, info = env.step(bash("seq 1 100000"))
        assert "bytes of output elided" in obs and obs.count("\n") < 300
        assert "\n1\n2\n" in obs and "100000" in obs
    finally:
        env.close()


def test_fork_into_a_fresh_env_and_continue(local_records):
    rec = next(r for r in local_records if "roman" in r["instance_id"])
    task = SWEEnv.task_from_record(rec)
    gold = SWEEnv.scripted_policy("gold")
    parent, child, other = SWEEnv(), SWEEnv(), SWEEnv()
    try:
        parent.reset(options=task.options)
        parent.step(bash("echo scratch > notes.txt"))
        before_fix = parent.snapshot()
        parent.step(gold(task, []))
        after_fix = parent.snapshot()
        parent.step(bash("rm -rf roman"))  # parent wrecks its copy

        # restore into an env that was never reset, out of order and repeatedly
        child.restore(after_fix)
        assert child.step(bash("cat notes.txt"))[0].count("scratch") == 1
        child.restore(before_fix)
        assert "IIII" in child.step(bash("python3 -c 'import roman; print(roman.to_roman(4))'"))[0]
        child.restore(after_fix)
        patch, problem = child.current_patch()
        assert "notes.txt" in patch and not problem
        # taking the patch does not stage anything in the agent's repository
        assert "?? notes.txt" in child.step(bash("git status --porcelain"))[0]
        _, reward, term, _, info = child.step(SUBMIT_ACTION)
        assert term and reward == 1.0 and info["grading"]["resolved"]
        assert "notes.txt" in info["prediction"]["model_patch"]
        # the step counter travels with the state
        other.restore(before_fix)
        assert other._steps == 1
        _, reward, *_ = other.step(SUBMIT_ACTION)
        assert reward == 0.0
        _, reward, *_ = parent.step(SUBMIT_ACTION)
        assert reward == 0.0
        with pytest.raises(ValueError, match="different config"):
            SWEEnv(step_limit=3).restore(after_fix)
        del before_fix, after_fix
    finally:
        for env in (parent, child, other):
            env.close()


def test_env_copes_with_a_container_killed_mid_episode(local_records):
    task = SWEEnv.task_from_record(local_records[2])
    env = SWEEnv(prewarm=0)
    docker = runtime.client()
    try:
        env.reset(options=task.options)
        env.step(bash("echo progress > progress.txt"))
        state = env.snapshot()
        docker.api.kill(env._sandbox.container_id)
        obs, *_ = env.step(bash("cat progress.txt"))  # a killed container is started again
        assert "progress" in obs
        docker.api.remove_container(env._sandbox.container_id, force=True)
        with pytest.raises(SandboxError, match="no longer exists"):
            env.step(bash("ls"))
        env.restore(state)  # the episode goes on from the last snapshot
        obs, *_ = env.step(bash("cat progress.txt"))
        assert "progress" in obs
        del state
    finally:
        env.close()
        env.close()


def test_envs_stepped_from_a_thread_pool(local_records):
    tasks = [SWEEnv.task_from_record(r) for r in local_records[:4]]
    gold = SWEEnv.scripted_policy("gold")

    def episode(task) -> float:
        env, twin = SWEEnv(), SWEEnv()
        try:
            env.reset(options=task.options)
            env.step(bash("echo thread > t.txt"))
            state = env.snapshot()
            env.step(bash("rm -rf *"))
            twin.restore(state)
            obs, *_ = twin.step(gold(task, []))
            assert "<returncode>0</returncode>" in obs, obs
            return twin.step(SUBMIT_ACTION)[1]
        finally:
            env.close()
            twin.close()

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(episode, tasks)) == [1.0] * len(tasks)


def test_prepare_tasks_is_a_noop_when_images_exist(local_records):
    tasks = SWEEnv.load_tasks("local")
    SWEEnv.prepare_tasks(tasks)  # nothing to build
    missing = dataclasses.replace(from_record(local_records[0]), image="agentree-test/none:1")
    task = SWEEnv.task_from_record(missing.to_record())
    with pytest.raises(SandboxError, match="could not be pulled"):
        SWEEnv.prepare_tasks([task])


def test_r2e_gym_instance_end_to_end(local_records, tmp_path):
    """An R2E-Gym style image (tests in /r2e_tests, /testbed/run_tests.sh) and record."""
    from test_swe_tasks import r2e_record_for

    from agentree.envs.swe import local_suite
    from agentree.envs.swe.sandbox import Sandbox, SandboxConfig

    slug = "stats"
    rec = r2e_record_for(slug, tmp_path)
    base = local_suite.image_name(local_suite.record(slug)["instance_id"])
    tests = local_suite.record(slug)["test_patch"]
    docker = runtime.client()
    # build the image the way R2E-Gym lays it out, from the local-suite image
    with Sandbox(base, SandboxConfig(prewarm=0)) as sb:
        sb.write_file("/tmp/t.patch", tests)
        r = sb.exec(
            "git apply /tmp/t.patch && mkdir /r2e_tests && mv tests/test_central.py /r2e_tests/"
            " && git checkout -- tests && "
            "printf 'python3 -m pytest -rA r2e_tests\\n' > run_tests.sh"
        )
        assert r.returncode == 0, r.output
        repo, _, tag = rec["docker_image"].partition(":")
        docker.api.commit(sb.container_id, repository=repo, tag=tag)
    try:
        task = SWEEnv.task_from_record(rec)
        env = SWEEnv()
        try:
            obs, _ = env.reset(options=task.options)
            assert "median() of an even number" in obs and "[ISSUE]" not in obs
            # the held-out tests are out of the agent's view
            hidden = (
                "if [ -e /r2e_tests ] || [ -e run_tests.sh ]; then echo seen; else echo hidden; fi"
            )
            obs, *_ = env.step(bash(hidden))
            assert "hidden" in obs and "seen" not in obs
            rewards = {}
            for policy in ("gold", "empty"):
                reward, info, _ = run_policy(env, task, SWEEnv.scripted_policy(policy))
                rewards[policy] = reward
                assert "run_tests.sh" not in info["prediction"]["model_patch"]
                assert info["grading"]["tests"]["test_median_even"] == (
                    "PASSED" if policy == "gold" else "FAILED"
                )
            assert rewards == {"gold": 1.0, "empty": 0.0}
        finally:
            env.close()
    finally:
        settle()
        docker.api.remove_image(rec["docker_image"])


def test_missing_local_image_is_built_on_reset(local_records):
    rec = local_records[-1]
    docker = runtime.client()
    docker.api.remove_image(rec["image"])
    env = SWEEnv()
    try:
        _, info = env.reset(options=SWEEnv.task_from_record(rec).options)
        assert info["image"] == rec["image"]
        head = env.step(bash("git rev-parse HEAD"))[0]
        assert rec["base_commit"] in head
    finally:
        env.close()
    assert docker.api.inspect_image(rec["image"])
