"""Task sources for the SWE env: SWE-bench (classic, 5.x), R2E-Gym, files, the local suite.

No Docker needed: records are made locally in the real formats.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentree.envs.base import Task
from agentree.envs.swe import local_suite
from agentree.envs.swe.env import (
    SENTINEL,
    SWEEnv,
    action_key,
    is_submit,
    parse_commands,
)
from agentree.envs.swe.instances import (
    EVAL_R2E,
    from_record,
    official_image,
    parse_log_r2e,
    r2e_patch,
)

CLASSIC = {
    "repo": "django/django",
    "instance_id": "django__django-11099",
    "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
    "patch": "diff --git a/django/x.py b/django/x.py\n",
    "test_patch": (
        "diff --git a/tests/auth_tests/test_validators.py b/tests/auth_tests/test_validators.py\n"
        "--- a/tests/auth_tests/test_validators.py\n+++ b/tests/auth_tests/test_validators.py\n"
        "@@ -1 +1 @@\n-a\n+b\n"
    ),
    "problem_statement": "UsernameValidator allows trailing newline in usernames",
    "hints_text": "",
    "created_at": "2019-03-20T03:46:18Z",
    "version": "3.0",
    "FAIL_TO_PASS": json.dumps(["test_ascii_validator (auth_tests.test_validators.UVTests)"]),
    "PASS_TO_PASS": json.dumps(["test_help_text (auth_tests.test_validators.UASVTest)"]),
    "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
}


def test_classic_record_json_strings_and_lists_agree():
    a = from_record(CLASSIC)
    listed = dict(CLASSIC)
    listed["FAIL_TO_PASS"] = json.loads(CLASSIC["FAIL_TO_PASS"])
    listed["PASS_TO_PASS"] = json.loads(CLASSIC["PASS_TO_PASS"])
    b = from_record(listed)
    assert a == b
    assert a.fail_to_pass == ("test_ascii_validator (auth_tests.test_validators.UVTests)",)
    # official image naming, as swebench derives it
    from swebench.task.checks import expected_image

    assert (
        a.image == official_image("django__django-11099") == expected_image("django__django-11099")
    )
    assert a.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    # classic records get swebench's parser for the repo and a generated eval script
    assert a.log_parser == "parse_log_django"
    assert a.eval_type == "pass_and_fail"
    assert ">>>>> Start Test Output" in a.eval_script and ">>>>> End Test Output" in a.eval_script
    assert "tests/auth_tests/test_validators.py" in a.eval_script
    assert (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
        "auth_tests.test_validators" in a.eval_script
    )
    assert CLASSIC["test_patch"] in a.eval_script


def test_classic_record_round_trips_through_swebench_test_spec():
    from swebench.harness.utils import make_test_spec

    inst = from_record(CLASSIC)
    again = from_record(inst.to_record())
    assert again == inst
    spec = make_test_spec(inst.to_record())
    assert list(inst.fail_to_pass) == spec.FAIL_TO_PASS
    assert spec.log_parser == "parse_log_django"
    assert ">>>>> Test Exit Code" in spec.eval_script  # swebench records the test exit status


def test_5x_record_fields_are_kept():
    rec = dict(CLASSIC)
    rec.update(
        image="myregistry/custom:1",
        eval_script="#!/bin/bash\n: '>>>>> Start Test Output'\necho\n: '>>>>> End Test Output'\n",
        log_parser="parse_log_pytest_v2",
        eval_type="fail_only",
    )
    inst = from_record(rec)
    assert inst.image == "myregistry/custom:1"
    assert inst.eval_script == rec["eval_script"]
    assert (inst.log_parser, inst.eval_type) == ("parse_log_pytest_v2", "fail_only")


def test_unknown_repo_uses_pytest_parser_and_fail_only_repos():
    rec = dict(CLASSIC, repo="someone/else", instance_id="someone__else-1")
    assert from_record(rec).log_parser == "parse_log_pytest"
    rec = dict(CLASSIC, repo="eslint/eslint", instance_id="eslint__eslint-1")
    assert from_record(rec).eval_type == "fail_only"


def test_image_override_template():
    env = SWEEnv(image="mirror.local/sweb.eval.x86_64.{docker_id}:v1")
    inst = env.instance_from_options({"instance": CLASSIC})
    assert inst.image == "mirror.local/sweb.eval.x86_64.django_1776_django-11099:v1"
    with pytest.raises(ValueError, match="bad image template"):
        SWEEnv(image="x/{nope}").instance_from_options({"instance": CLASSIC})


def test_bad_records_give_clear_errors():
    with pytest.raises(ValueError, match="not a SWE-bench or R2E-Gym instance"):
        from_record({"foo": 1})
    with pytest.raises(ValueError, match="lacks"):
        from_record({"instance_id": "a__b-1"})
    with pytest.raises(ValueError, match="not a JSON list"):
        from_record(dict(CLASSIC, FAIL_TO_PASS="[oops"))
    with pytest.raises(ValueError, match="options="):
        SWEEnv().instance_from_options({})


# -- R2E-Gym ---------------------------------------------------------------------------------
def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def parsed_commit_from_diff(diff: str, old: str, new: str) -> dict:
    """R2E-Gym's parsed_commit_content structure for a unified diff."""
    files, fd, hunk = [], None, None
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[1]
            fd = {
                "header": {"file": {"path": path}, "misc_line": None},
                "index_line": None,
                "is_binary_file": False,
                "binary_line": None,
                "minus_file": None,
                "plus_file": None,
                "hunks": [],
                "old_file_content": "",
                "new_file_content": "",
            }
            files.append(fd)
        elif line.startswith("index "):
            a, _, mode = line[6:].partition(" ")
            o, n = a.split("..")
            fd["index_line"] = {"old_commit_hash": o, "new_commit_hash": n, "mode": mode}
        elif line.startswith("--- "):
            fd["minus_file"] = {"path": line[4:]}
        elif line.startswith("+++ "):
            fd["plus_file"] = {"path": line[4:]}
        elif line.startswith("@@"):
            head, _, section = line[3:].partition(" @@")
            o, n = head.split(" ")

            def rng(s: str) -> dict:
                start, _, length = s[1:].partition(",")
                return {"start": int(start), "length": int(length) if length else None}

            hunk = {
                "descriptor": {
                    "old_range": rng(o),
                    "new_range": rng(n),
                    "section": section.strip(),
                },
                "line_group": {"all_lines": []},
            }
            fd["hunks"].append(hunk)
        else:
            kind = {" ": "context", "+": "added", "-": "deleted", "\\": "note"}[line[:1] or " "]
            content = line[2:] if kind == "note" else line[1:]
            hunk["line_group"]["all_lines"].append({"content": content, "type": kind})
    return {
        "file_diffs": files,
        "old_commit_hash": old,
        "new_commit_hash": new,
        "commit_message": "fix",
        "commit_date": "2024-01-01T00:00:00",
        "metadata": {},
    }


def r2e_record_for(slug: str, tmp_path: Path) -> dict:
    """An R2E-Gym record for a local-suite task, built from a real git history."""
    rec = local_suite.record(slug)
    repo = tmp_path / slug
    for path, data in local_suite.repo_files(slug).items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(data)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    old = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "fix.patch").write_text(rec["patch"] + rec["test_patch"])
    _git(repo, "apply", "fix.patch")
    (repo / "fix.patch").unlink()
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "fix")
    new = _git(repo, "rev-parse", "HEAD").strip()
    diff = _git(repo, "diff", old, new)
    expected = {t.split("::")[-1]: "PASSED" for t in json.loads(rec["FAIL_TO_PASS"])}
    expected.update({t.split("::")[-1]: "PASSED" for t in json.loads(rec["PASS_TO_PASS"])})
    return {
        "repo_name": slug,
        "docker_image": f"r2e-local/{slug}:test",
        "commit_hash": new,
        "parsed_commit_content": json.dumps(parsed_commit_from_diff(diff, old, new)),
        "execution_result_content": "{}",
        "modified_files": sorted(
            {ln.split(" b/")[1] for ln in diff.splitlines() if ln.startswith("diff --git")}
        ),
        "modified_entity_summaries": [],
        "relevant_files": [],
        "num_non_test_files": 1,
        "num_non_test_func_methods": 1,
        "num_non_test_lines": 2,
        "prompt": "",
        "problem_statement": f"[ISSUE]\n{rec['problem_statement']}\n[/ISSUE]",
        "expected_output_json": json.dumps(expected),
    }


def test_r2e_record_maps_to_instance(tmp_path):
    rec = r2e_record_for("stats", tmp_path)
    inst = from_record(rec)
    assert inst.source == "r2e" and inst.eval_type == EVAL_R2E
    assert inst.image == "r2e-local/stats:test"
    assert inst.instance_id == f"stats__stats-{rec['commit_hash']}"
    assert inst.problem_statement.startswith("median() of an even number")
    assert "[ISSUE]" not in inst.problem_statement
    assert inst.expected_output["test_median_even"] == "PASSED"
    assert set(inst.hidden_paths) == {"run_tests.sh", "r2e_tests"}
    # the gold patch rebuilt from parsed_commit_content is the non-test part of the commit
    assert "minstats/central.py" in inst.patch and "tests/" not in inst.patch
    repo = tmp_path / "check"
    for path, data in local_suite.repo_files("stats").items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(data)
    (repo / "gold.patch").write_text(inst.patch)
    subprocess.run(["git", "apply", "--check", "gold.patch"], cwd=repo, check=True)
    assert r2e_patch(json.loads(rec["parsed_commit_content"]), tests=True).count("diff --git") == 1
    # the record survives the trip through a Task (plain JSON) unchanged
    task = SWEEnv.task_from_record(rec)
    assert task.id == inst.instance_id
    assert from_record(json.loads(json.dumps(task.options["instance"]))) == inst


def test_r2e_log_parser_matches_r2e_naming():
    log = (
        "============ short test summary info ============\n"
        "PASSED r2e_tests/test_1.py::TestMedian::test_even\n"
        "FAILED r2e_tests/test_1.py::test_odd - AssertionError: assert 1 == 2\n"
        "ERROR r2e_tests/test_2.py::test_x\n"
    )
    assert parse_log_r2e(log) == {
        "TestMedian.test_even": "PASSED",
        "test_odd": "FAILED",
        "test_x": "ERROR",
    }
    assert parse_log_r2e("no summary here") == {}


# -- files and named sources -----------------------------------------------------------------
def test_load_tasks_from_json_jsonl_and_task_repo(tmp_path):
    recs = [local_suite.record(s) for s in local_suite.slugs()[:3]]
    (tmp_path / "a.json").write_text(json.dumps(recs))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    for name in ("a.json", "b.jsonl"):
        tasks = SWEEnv.load_tasks(str(tmp_path / name))
        assert [t.id for t in tasks] == [r["instance_id"] for r in recs]
        assert all(t.options["instance"]["image"].startswith("agentree/swe-local:") for t in tasks)
    (tmp_path / "bad.jsonl").write_text(json.dumps(recs[0]) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        SWEEnv.load_tasks(str(tmp_path / "bad.jsonl"))

    # a swebench 5.x task repo: tasks/<id>/{task.yaml, tests.json, gold.patch, ...}
    import yaml

    rec = recs[0]
    d = tmp_path / "repo" / "tasks" / rec["instance_id"]
    d.mkdir(parents=True)
    meta = {
        k: rec[k]
        for k in (
            "instance_id",
            "repo",
            "version",
            "base_commit",
            "image",
            "log_parser",
            "eval_type",
        )
    }
    (d / "task.yaml").write_text(yaml.safe_dump(meta | {"split": "test"}))
    (d / "tests.json").write_text(
        json.dumps(
            {
                "FAIL_TO_PASS": json.loads(rec["FAIL_TO_PASS"]),
                "PASS_TO_PASS": json.loads(rec["PASS_TO_PASS"]),
            }
        )
    )
    for key, fname in (
        ("patch", "gold.patch"),
        ("test_patch", "test.patch"),
        ("eval_script", "eval.sh"),
        ("problem_statement", "problem_statement.md"),
    ):
        (d / fname).write_text(rec[key])
    (task,) = SWEEnv.load_tasks(str(tmp_path / "repo"))
    got = from_record(task.options["instance"])
    assert dataclasses.replace(got, source="local") == from_record(rec)


def test_local_suite_records():
    recs = local_suite.records()
    assert len(recs) >= 6
    assert len({r["instance_id"] for r in recs}) == len(recs)
    for r in recs:
        assert json.loads(r["FAIL_TO_PASS"]) and json.loads(r["PASS_TO_PASS"])
        assert r["patch"].startswith("diff --git") and r["test_patch"].startswith("diff --git")
        assert r["log_parser"] == "parse_log_pytest"
        assert r["image"] == local_suite.image_name(r["instance_id"])
    tasks = SWEEnv.load_tasks("local")
    assert [t.id for t in tasks] == [r["instance_id"] for r in recs]
    assert [t.id for t in SWEEnv.load_tasks()] == [t.id for t in tasks]


def test_local_suite_base_commit_is_what_git_computes(tmp_path):
    slug = local_suite.slugs()[0]
    for path, data in local_suite.repo_files(slug).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    name, _, email = local_suite.AUTHOR.partition(" <")
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email[:-1],
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email[:-1],
        GIT_AUTHOR_DATE=local_suite.COMMIT_TIME,
        GIT_COMMITTER_DATE=local_suite.COMMIT_TIME,
    )

    def run(*args: str) -> str:
        r = subprocess.run(args, cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
        return r.stdout

    run("git", "init", "-q")
    run("git", "add", "-A")
    run("git", "commit", "-qm", local_suite.COMMIT_MESSAGE.strip())
    assert run("git", "rev-parse", "HEAD").strip() == local_suite.record(slug)["base_commit"]


def test_generate_tasks_is_seeded_and_bounded():
    a = SWEEnv.generate_tasks(3, seed=1)
    assert [t.id for t in a] == [t.id for t in SWEEnv.generate_tasks(3, seed=1)]
    assert len({t.id for t in SWEEnv.generate_tasks(len(local_suite.slugs()), seed=2)}) == len(
        local_suite.slugs()
    )
    with pytest.raises(ValueError, match="local suite has"):
        SWEEnv.generate_tasks(1000)
    with pytest.raises(ValueError, match="no task source named"):
        SWEEnv.load_tasks("nonexistent-source")


def test_verified_offline_is_one_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path))
    code = "from agentree.envs.swe.env import SWEEnv\nSWEEnv.load_tasks('verified')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "could not load princeton-nlp/SWE-bench_Verified" in r.stderr
    assert "--tasks FILE" in r.stderr


# -- actions and scripted policies -----------------------------------------------------------
def test_parse_commands_and_action_keys():
    assert parse_commands("THOUGHT: x\n\n```bash\nls -la\n```") == ["ls -la"]
    assert parse_commands("no code") == []
    assert len(parse_commands("```bash\nls\n```\n```bash\npwd\n```")) == 2
    assert action_key("grep  -n foo   bar.py ") == action_key("grep -n foo bar.py")
    assert action_key("cd src\n\n  ls -l") == "cd src\nls -l"
    assert is_submit(f"echo {SENTINEL}")
    assert is_submit(f"  echo '{SENTINEL}' && git add -A && git diff --cached")
    assert not is_submit(f"echo not-{SENTINEL}")
    assert not is_submit("ls")


def test_scripted_policies():
    rec = local_suite.record(local_suite.slugs()[0])
    task = SWEEnv.task_from_record(rec)
    gold = SWEEnv.scripted_policy("gold")
    first = gold(task, [])
    (cmd,) = parse_commands(first)
    encoded = cmd.split("<<'AGENTREE_EOF'\n", 1)[1].split("AGENTREE_EOF", 1)[0]
    assert base64.decodebytes(encoded.encode()).decode() == rec["patch"]
    assert "git apply" in cmd
    second = gold(task, [(first, "ok")])
    assert is_submit(parse_commands(second)[0])
    empty = SWEEnv.scripted_policy("empty")
    assert is_submit(parse_commands(empty(task, []))[0])
    assert SWEEnv.scripted_policy("nope") is None
    assert isinstance(task, Task) and task.id == rec["instance_id"]


def test_importing_agentree_does_not_import_docker():
    code = (
        "import sys, agentree, agentree.envs, agentree.envs.swe.env, agentree.envs.swe.sandbox, "
        "agentree.envs.swe.grading, agentree.envs.swe.images, agentree.commands.swe\n"
        "assert 'docker' not in sys.modules, 'docker imported'\n"
        "assert 'swebench' not in sys.modules, 'swebench imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
