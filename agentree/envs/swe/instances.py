"""SWE task instances from SWE-bench (classic and 5.x), R2E-Gym and local records.

Every source maps to one `SWEInstance`, which serialises to a SWE-bench 5.x style record
(`to_record`) plus a few agentree keys (`setup_script`, `hidden_paths`, `env`,
`expected_output_json`, `source`). That record is what a `Task` carries in
`options["instance"]`, so trees and task files stay plain JSON.

Grading needs an `eval_script` that prints the test output between the SWE-bench markers.
5.x records ship one; for classic records (no `eval_script`) one is generated that applies the
test patch and runs `test_cmd` (a record key) or the harness's command for the repository
(runtests.py for Django, bin/test for SymPy, tox for Sphinx, pytest otherwise) on the files the
test patch touches. 5.x records are the faithful choice where available.
R2E-Gym images carry their tests (`/r2e_tests`) and `run_tests.sh`; their eval script runs those
and grading compares every test's status with `expected_output_json`, as R2E-Gym does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

START = ">>>>> Start Test Output"
END = ">>>>> End Test Output"
HEREDOC = "EOF_114329324912"  # the delimiter SWE-bench's eval scripts use

EVAL_R2E = "r2e_exact"
"""eval_type of R2E-Gym instances: every test must end with its expected status."""

R2E_HIDDEN = ("run_tests.sh", "r2e_tests")
"""Paths R2E-Gym keeps out of the agent's view (moved to /root while the agent works)."""


@dataclass(frozen=True)
class SWEInstance:
    """One task: a repository state in an image, an issue, and the tests that grade a fix."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    image: str
    eval_script: str
    patch: str = ""
    """The reference (gold) fix."""
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    version: str = ""
    log_parser: str = "parse_log_pytest"
    """A key of swebench's PARSER_REGISTRY (or `r2e_pytest` for R2E-Gym)."""
    eval_type: str = "pass_and_fail"
    hints_text: str = ""
    setup_script: str = ""
    """Shell run once when an agent sandbox starts (e.g. to hide held-out tests)."""
    prepare_script: str = ""
    """Shell run first in every fresh container, agent's and grader's alike: puts the
    repository at `base_commit` when the image holds another state (generated tasks share
    their repository's image)."""
    hidden_paths: tuple[str, ...] = ()
    """Repository paths left out of the submitted diff."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for every command."""
    expected_output: dict[str, str] = field(default_factory=dict)
    """R2E-Gym: test name -> expected status after the fix."""
    source: str = "swebench"

    # -- serialisation ----------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """A SWE-bench 5.x style record (lists as JSON strings) plus agentree's keys."""
        rec: dict[str, Any] = {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "base_commit": self.base_commit,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "problem_statement": self.problem_statement,
            "hints_text": self.hints_text,
            "version": self.version,
            "FAIL_TO_PASS": json.dumps(list(self.fail_to_pass)),
            "PASS_TO_PASS": json.dumps(list(self.pass_to_pass)),
            "image": self.image,
            "eval_script": self.eval_script,
            "log_parser": self.log_parser,
            "eval_type": self.eval_type,
            "source": self.source,
        }
        if self.setup_script:
            rec["setup_script"] = self.setup_script
        if self.prepare_script:
            rec["prepare_script"] = self.prepare_script
        if self.hidden_paths:
            rec["hidden_paths"] = list(self.hidden_paths)
        if self.env:
            rec["env"] = dict(self.env)
        if self.expected_output:
            rec["expected_output_json"] = json.dumps(self.expected_output)
        return rec

    def with_image(self, image: str) -> SWEInstance:
        return replace(self, image=image)


# -- dispatch --------------------------------------------------------------------------------
def from_record(record: dict[str, Any]) -> SWEInstance:
    """Parse a SWE-bench (classic or 5.x), R2E-Gym or agentree record."""
    if not isinstance(record, dict):
        raise ValueError(
            f"a SWE instance record must be a JSON object, got {type(record).__name__}"
        )
    if is_r2e_record(record):
        return from_r2e(record)
    if "instance_id" in record:
        return from_swebench(record)
    raise ValueError(
        "not a SWE-bench or R2E-Gym instance: expected SWE-bench keys (instance_id, repo, "
        "base_commit, problem_statement, ...) or R2E-Gym keys (repo_name, docker_image, "
        f"parsed_commit_content, expected_output_json); got keys {sorted(record)[:12]}"
    )


def is_r2e_record(record: dict[str, Any]) -> bool:
    return (
        ("docker_image" in record or "image_name" in record)
        and ("expected_output_json" in record or "parsed_commit_content" in record)
        and "FAIL_TO_PASS" not in record
    )


# -- SWE-bench -------------------------------------------------------------------------------
def official_image(instance_id: str, namespace: str = "swebench") -> str:
    """The published SWE-bench image of an instance (Docker Hub forbids `__`)."""
    key = f"sweb.eval.x86_64.{instance_id}:latest".lower()
    return f"{namespace}/{key}".replace("__", "_1776_")


def docker_id(instance_id: str) -> str:
    """The instance id as it appears in official image names."""
    return instance_id.lower().replace("__", "_1776_")


def test_list(value: Any, key: str = "FAIL_TO_PASS") -> tuple[str, ...]:
    """FAIL_TO_PASS / PASS_TO_PASS come as JSON strings (HF datasets) or lists."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{key} is not a JSON list: {value[:80]!r}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{key} must be a list of test names")
    return tuple(value)


def from_swebench(r: dict[str, Any]) -> SWEInstance:
    missing = [k for k in ("instance_id", "repo", "base_commit", "problem_statement") if k not in r]
    if missing:
        raise ValueError(f"SWE-bench record {r.get('instance_id', '?')} lacks {missing}")
    iid = str(r["instance_id"])
    repo = str(r["repo"])
    eval_script = r.get("eval_script") or default_eval_script(
        str(r["base_commit"]), str(r.get("test_patch") or ""), r.get("test_cmd"), repo
    )
    env = r.get("env") or {}
    return SWEInstance(
        instance_id=iid,
        repo=repo,
        base_commit=str(r["base_commit"]),
        problem_statement=str(r["problem_statement"]),
        image=str(r.get("image") or official_image(iid)),
        eval_script=eval_script,
        patch=str(r.get("patch") or ""),
        test_patch=str(r.get("test_patch") or ""),
        fail_to_pass=test_list(r.get("FAIL_TO_PASS"), "FAIL_TO_PASS"),
        pass_to_pass=test_list(r.get("PASS_TO_PASS"), "PASS_TO_PASS"),
        version=str(r.get("version") or ""),
        log_parser=str(r.get("log_parser") or default_log_parser(repo)),
        eval_type=str(r.get("eval_type") or default_eval_type(repo)),
        hints_text=str(r.get("hints_text") or ""),
        setup_script=str(r.get("setup_script") or ""),
        prepare_script=str(r.get("prepare_script") or ""),
        hidden_paths=tuple(r.get("hidden_paths") or ()),
        env=tuple(sorted((str(k), str(v)) for k, v in dict(env).items())),
        expected_output=_json_dict(r.get("expected_output_json")),
        source=str(r.get("source") or "swebench"),
    )


def default_log_parser(repo: str) -> str:
    """swebench's parser for a known repository, else the plain pytest parser."""
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    fn = MAP_REPO_TO_PARSER_PY.get(repo)
    return fn.__name__ if fn is not None else "parse_log_pytest"


def default_eval_type(repo: str) -> str:
    # deferred: swebench is the optional [swe] extra
    from swebench.harness.constants import FAIL_ONLY_REPOS

    return "fail_only" if repo in FAIL_ONLY_REPOS else "pass_and_fail"


def patch_files(patch: str) -> list[str]:
    """Paths a unified diff touches (its `b/` side)."""
    return list(dict.fromkeys(re.findall(r"^diff --git a/\S+ b/(\S+)$", patch, re.M)))


def default_test_cmd(repo: str, test_files: list[str]) -> str:
    """The test command SWE-bench's harness uses for a repository's test files."""
    files = " ".join(test_files)
    if repo == "django/django":  # runtests.py takes dotted module names under tests/
        mods = [
            f[len("tests/") : -len(".py")].replace("/", ".")
            for f in test_files
            if f.startswith("tests/") and f.endswith(".py")
        ]
        runner = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
        return f"{runner} {' '.join(mods)}"
    if repo == "sympy/sympy":
        warnings = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning'"
        return f"{warnings} bin/test -C --verbose {files}"
    if repo == "sphinx-doc/sphinx":
        return f"tox --current-env -epy39 -v -- {files}"
    return f"pytest --no-header -rA --tb=no -p no:cacheprovider {files}"


def default_eval_script(
    base_commit: str, test_patch: str, test_cmd: str | None = None, repo: str = ""
) -> str:
    """A SWE-bench style eval script: reset and patch the test files, run them between markers."""
    files = " ".join(patch_files(test_patch))
    cmd = test_cmd or default_test_cmd(repo, patch_files(test_patch))
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        "if [ -f /opt/miniconda3/bin/activate ]; then",
        "  source /opt/miniconda3/bin/activate && conda activate testbed",
        "fi",
        "cd /testbed",
        "git config --global --add safe.directory /testbed",
    ]
    # Put the test files back to the base commit (files the test patch creates are removed),
    # so the test patch applies whatever the model patch did to them.
    reset = (
        f'for f in {files}; do if git cat-file -e {base_commit}:"$f" 2>/dev/null; '
        f'then git checkout {base_commit} -- "$f"; else rm -rf "$f"; fi; done'
    )
    if files:
        lines += [reset]
    if test_patch.strip():
        body = test_patch if test_patch.endswith("\n") else test_patch + "\n"
        lines += [f"git apply -v - <<'{HEREDOC}'\n{body}{HEREDOC}"]
    lines += [f": '{START}'", cmd, f": '{END}'"]
    if files:
        lines += [reset]
    return "\n".join(lines) + "\n"


# -- R2E-Gym ---------------------------------------------------------------------------------
R2E_PATH = (
    "/testbed/.venv/bin:/root/.venv/bin:/root/.local/bin:/root/.cargo/bin:"
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

R2E_EVAL_SCRIPT = f"""#!/bin/bash
set -uxo pipefail
cd /testbed
if [ -d /r2e_tests ] && [ ! -e /testbed/r2e_tests ]; then ln -s /r2e_tests /testbed/r2e_tests; fi
: '{START}'
bash /testbed/run_tests.sh
: '{END}'
"""

R2E_SETUP = (
    "for f in run_tests.sh r2e_tests; do [ -e /testbed/$f ] && mv /testbed/$f /root/$f; done; "
    "[ -d /r2e_tests ] && mv /r2e_tests /root/r2e_tests; true"
)


def from_r2e(r: dict[str, Any]) -> SWEInstance:
    """Map an R2E-Gym record (repo_name, docker_image, parsed_commit_content, ...)."""
    image = r.get("docker_image") or r.get("image_name")
    if not image:
        raise ValueError("R2E-Gym record has no docker_image")
    parsed = _json_dict(r.get("parsed_commit_content"))
    repo = str(r.get("repo_name") or r.get("repo") or image.split("/")[-1].split(":")[0])
    commit = str(r.get("commit_hash") or parsed.get("new_commit_hash") or "")
    iid = str(r.get("instance_id") or f"{repo}__{repo}-{commit}")
    gold = str(r.get("patch") or (r2e_patch(parsed) if parsed else ""))
    expected = _json_dict(r.get("expected_output_json"))
    if not expected:
        raise ValueError(f"R2E-Gym record {iid} has no expected_output_json to grade against")
    return SWEInstance(
        instance_id=iid,
        repo=repo,
        base_commit=str(parsed.get("old_commit_hash") or ""),
        problem_statement=r2e_problem_statement(str(r.get("problem_statement") or "")),
        image=str(image),
        eval_script=R2E_EVAL_SCRIPT,
        patch=gold,
        log_parser="r2e_pytest",
        eval_type=EVAL_R2E,
        setup_script=R2E_SETUP,
        hidden_paths=R2E_HIDDEN,
        env=(("PATH", R2E_PATH),),
        expected_output=expected,
        source="r2e",
    )


def r2e_problem_statement(text: str) -> str:
    """R2E-Gym wraps the issue in [ISSUE]...[/ISSUE]; keep only the issue."""
    m = re.search(r"\[ISSUE\](.*)\[/ISSUE\]", text, re.S)
    return (m.group(1) if m else text).strip()


def _is_test_path(path: str) -> bool:
    parts = path.split("/")
    return (
        path.endswith("_test.py")
        or parts[-1].startswith("test_")
        or any(p in {"tests", "Tests", "test", "Test"} for p in parts)
    )


def r2e_patch(parsed: dict[str, Any], *, tests: bool = False) -> str:
    """Rebuild a unified diff from R2E-Gym's parsed commit (Python files; non-test by default)."""
    out: list[str] = []
    for fd in parsed.get("file_diffs", []):
        path = fd.get("header", {}).get("file", {}).get("path", "")
        if not path.endswith(".py") or _is_test_path(path) != tests:
            continue
        out.append(f"diff --git a/{path} b/{path}")
        if fd.get("header", {}).get("misc_line"):
            out.append(fd["header"]["misc_line"])
        idx = fd.get("index_line")
        if idx:
            mode = f" {idx['mode']}" if idx.get("mode") else ""
            out.append(f"index {idx['old_commit_hash']}..{idx['new_commit_hash']}{mode}")
        if fd.get("minus_file") and fd.get("plus_file"):
            out.append(f"--- {fd['minus_file']['path']}")
            out.append(f"+++ {fd['plus_file']['path']}")
        for hunk in fd.get("hunks", []):
            d = hunk["descriptor"]
            head = f"@@ -{_range(d['old_range'])} +{_range(d['new_range'])} @@"
            out.append(head + (f" {d['section']}" if d.get("section") else ""))
            prefix = {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}
            out += [prefix[ln["type"]] + ln["content"] for ln in hunk["line_group"]["all_lines"]]
    return "\n".join(out) + "\n" if out else ""


def _range(r: dict[str, Any]) -> str:
    return f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"


def parse_log_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's pytest parser: the short summary, keyed `Class.test` without the file."""
    if "short test summary info" not in log:
        return {}
    out: dict[str, str] = {}
    for line in log.split("short test summary info", 1)[1].strip().splitlines():
        status, _, ref = line.strip().partition(" ")
        if status in {"PASSED", "FAILED", "ERROR"}:
            name = ".".join(ref.split("::")[1:]) if "::" in ref else ref
            out[_decolor(name.split(" - ")[0])] = status
    return out


def _decolor(s: str) -> str:
    return re.sub(r"\x1b\[\d+m", "", s)


def _json_dict(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value
