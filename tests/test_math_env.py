"""Math env: boxed-answer extraction, equivalence, dataset formats, generator, forking."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
from helpers import processes

import agentree.envs.math as math_env
from agentree.envs import cas, check_env, make_env
from agentree.envs.math import (
    PROBLEM_KINDS,
    MathEnv,
    answers_match,
    cas_safe,
    extract_boxed,
    generate_problem,
    strings_match,
)


def solve_with(env: MathEnv, response: str, question: str = "q", answer: str = "42") -> tuple:
    env.reset(options={"question": question, "answer": answer})
    obs, reward, terminated, truncated, info = env.step(response)
    assert (obs, terminated, truncated) == ("", True, False)
    return reward, info


# -- extraction --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is $\\boxed{42}$.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1}, then \\boxed{2}, finally \\boxed{3}", "3"),  # last one wins
        ("\\boxed{ 7 }", "7"),
        ("$\\boxed 5$", "5"),  # \boxed x form
        ("the answer is \\boxed 12.", "12"),
        ("\\fbox{9}", "9"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed{\\boxed{3}}", "\\boxed{3}"),  # inner box belongs to the outer one
        ("\\boxed{}", ""),
        ("no box here", None),
        ("\\boxed{2} and then \\boxed{\\frac{1}{", None),  # last box cut off: no final answer
        ("\\boxedfoo{3}", None),  # a different macro
        ("\\boxed{a}\n\\boxed {b}", "b"),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


# -- equivalence ---------------------------------------------------------------------------------
HALF = ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac{1}{2}", "\\tfrac12", "\\frac {1} {2}", " .5 "]


@pytest.mark.parametrize("verifier", ["math_verify", "string"])
@pytest.mark.parametrize("pred", HALF)
def test_forms_of_one_half_are_equivalent(pred: str, verifier: str) -> None:
    assert answers_match(pred, "\\frac{1}{2}", verifier=verifier)[0]
    assert not answers_match(pred, "\\frac{1}{3}", verifier=verifier)[0]


@pytest.mark.parametrize(
    ("pred", "ref", "equal"),
    [
        ("\\sqrt{72}", "6\\sqrt{2}", True),
        ("3, -3", "-3, 3", True),
        ("x = 9", "9", True),
        ("720^\\circ", "720", True),
        ("1,000", "1000", True),
        ("\\text{(C)}", "C", True),
        ("-\\frac{39}{11}", "-39/11", True),
        ("\\left( 1, 2 \\right)", "(1,2)", True),
        ("(x+1)^2", "x^2 + 2x + 1", True),
        ("0.33", "\\frac{1}{3}", False),
        ("2", "3", False),
        ("9\\pi", "9", False),
    ],
)
def test_math_verify_equivalence(pred: str, ref: str, equal: bool) -> None:
    assert answers_match(pred, ref, verifier="math_verify")[0] is equal


@pytest.mark.parametrize(
    ("pred", "ref", "equal"),
    [
        ("x = 9", "9", True),
        ("720^\\circ", "720", True),
        ("1,000", "1000", True),
        ("\\text{(C)}", "C", True),
        ("\\$12", "12", True),
        ("-\\frac{39}{11}", "-39/11", True),
        ("\\left( 1, 2 \\right)", "(1, 2)", True),
        ("0.3333333", "\\frac{1}{3}", True),  # rounded decimal within 1e-6
        ("0.33", "\\frac{1}{3}", False),
        ("2", "3", False),
        ("1,2", "12", False),  # a pair is not a number with a separator
        ("\\frac{1}{0}", "\\frac{1}{0}", True),  # equal strings, no division attempted
        ("", "0", False),
    ],
)
def test_string_fallback_equivalence(pred: str, ref: str, equal: bool) -> None:
    assert strings_match(pred, ref) is equal


def test_explosive_answers_skip_the_cas() -> None:
    for bomb in ["9^{9^{9}}", "(10^{100})!", "9!!!!", "10^{10^{10}}", "9**9**9"]:
        assert not cas_safe(bomb)
        assert answers_match(bomb, "5") == (False, "string")
    for fine in ["2^{10}", "x^2 + y^2", "5!", "1,\\!000", "e^{i\\pi}"]:
        assert cas_safe(fine)


def test_time_limit_counts_cpu_time_not_wall_time() -> None:
    # equal, but sympy spends about 9 s of CPU expanding both sides: over the limit, the strings
    # decide (a timeout is no verdict)
    slow = ("(x^2-y^2+x-y)^{60}", "(x+y+1)^{60}(x-y)^{60}")
    assert answers_match(*slow, verifier="math_verify", timeout_s=1) == (False, "string")
    # equal at about 0.35 s of the worker's CPU, loaded or not (a third of the limit, so that a
    # slower machine still checks it in time), checked on a core shared with seven busy
    # processes, so that it takes about 3 s of wall time: it still gets math_verify's verdict
    pair = ("(x^2-y^2+x-y)^{10}", "(x+y+1)^{10}(x-y)^{10}")
    core = min(os.sched_getaffinity(0))
    # a busy process pinned to that core, which ends when the test's process does, however
    spin = (
        f"import os; os.sched_setaffinity(0, {{{core}}}); parent = os.getppid(); print(flush=True)"
        "\nwhile os.getppid() == parent:\n    for _ in range(100_000): pass"
    )
    before = os.sched_getaffinity(0)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        os.sched_setaffinity(0, {core})
        cas.close()  # the check's worker process starts afresh, pinned to the core too
        answers_match("0.5", "\\frac12")  # started (math_verify imported) before the load
        # each busy process in a session of its own, as the worker is: where the kernel shares a
        # core between sessions first (autogroup), busy processes in one session would leave
        # the worker half the core however many they were
        for _ in range(7):
            cmd = [sys.executable, "-c", spin]
            hogs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True))
        for hog in hogs:
            assert hog.stdout is not None and hog.stdout.readline() == b"\n"  # pinned, spinning
        start = time.perf_counter()
        assert answers_match(*pair, verifier="math_verify", timeout_s=1) == (True, "math_verify")
        assert time.perf_counter() - start > 1  # the load really stretched the check past 1 s
    finally:
        os.sched_setaffinity(0, before)
        cas.close()
        for hog in hogs:
            hog.kill()
            hog.wait()
            assert hog.stdout is not None
            hog.stdout.close()


def test_the_time_limit_holds_outside_the_main_thread() -> None:
    """The turn runner checks answers on worker threads, where no signal reaches: the check
    runs in a worker process, under its limit whatever thread asks (before, a thread's check
    had no limit and gave the slow pair math_verify's verdict after about 9 s of CPU)."""
    results: list[tuple[bool, str]] = []

    def both() -> None:
        results.append(answers_match("0.5", "\\frac12"))
        slow = ("(x^2-y^2+x-y)^{60}", "(x+y+1)^{60}(x-y)^{60}")
        results.append(answers_match(*slow, verifier="math_verify", timeout_s=1))

    worker = threading.Thread(target=both)
    worker.start()
    worker.join(120)
    assert results == [(True, "math_verify"), (False, "string")]


def test_a_check_stuck_past_the_backstop_is_killed(monkeypatch) -> None:
    """A check that its CPU-time limit does not end (here a 9 s expansion under a 60 s limit,
    as one stuck in a C call would be) is ended by killing its process at the wall-clock
    backstop (shortened here to 1 s); the strings decide, and the next check gets a fresh
    process."""
    slow = ("(x^2-y^2+x-y)^{60}", "(x+y+1)^{60}(x-y)^{60}")
    assert answers_match("0.5", "\\frac12") == (True, "math_verify")  # a worker is up
    monkeypatch.setattr(cas, "backstop_s", lambda _timeout_s: 1.0)
    before = {w.proc.pid for w in cas._all}
    start = time.perf_counter()
    assert answers_match(*slow, verifier="math_verify", timeout_s=60) == (False, "string")
    assert time.perf_counter() - start < 30
    killed = before - {w.proc.pid for w in cas._all}
    assert len(killed) == 1
    assert not Path(f"/proc/{killed.pop()}").exists()  # gone, and reaped
    monkeypatch.undo()
    assert answers_match("\\sqrt{4}", "2") == (True, "math_verify")


def test_the_check_processes_end_with_their_parent(tmp_path: Path) -> None:
    """However the process that started them ends (here SIGKILL, which runs no clean-up),
    the worker processes exit: their stdin closes."""
    code = (
        "from agentree.envs import cas; from agentree.envs.math import answers_match\n"
        "assert answers_match('0.5', '\\\\frac12') == (True, 'math_verify')\n"
        "print(*[w.proc.pid for w in cas._all], flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids and all(Path(f"/proc/{p}").exists() for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while set(pids) & {pid for pid, p in processes().items() if not p.zombie}:
        assert time.monotonic() < deadline, f"worker processes {pids} outlived their parent"
        time.sleep(0.1)


def test_a_forked_child_checks_with_its_own_workers() -> None:
    """A child forked after checks ran does not write into its parent's workers' pipes (their
    answers would cross): it starts its own, and the parent's still answer."""
    code = (
        "import os\n"
        "from agentree.envs import cas; from agentree.envs.math import answers_match\n"
        "assert answers_match('0.5', '\\\\frac12') == (True, 'math_verify')\n"
        "mine = {w.proc.pid for w in cas._all}\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = answers_match('\\\\sqrt{4}', '2') == (True, 'math_verify')\n"
        "    ok = ok and not mine & {w.proc.pid for w in cas._all}\n"
        "    cas.close()\n"
        "    os._exit(0 if ok else 1)\n"
        "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0\n"
        "assert answers_match('\\\\sqrt{9}', '3') == (True, 'math_verify')\n"
        "assert {w.proc.pid for w in cas._all} == mine\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_math_verify_falls_back_with_one_warning(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    monkeypatch.setattr(math_env, "_warned_missing", False)
    with pytest.warns(RuntimeWarning, match="math_verify is not installed"):
        env = MathEnv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        env2 = MathEnv()
        reward, info = solve_with(env2, "\\boxed{\\dfrac{1}{2}}", answer="0.5")
    assert (reward, info["checked_by"]) == (1.0, "string")
    assert solve_with(env, "\\boxed{\\sqrt{4}}", answer="2")[0] == 0.0  # needs a CAS
    with pytest.raises(ImportError, match=r"agentree\[math\]"):
        make_env("math", verifier="math_verify")


# -- the env -------------------------------------------------------------------------------------
def test_rewards_and_info() -> None:
    env = MathEnv()
    reward, info = solve_with(env, "Thus $x = \\boxed{\\dfrac{84}{2}}$.")
    assert reward == 1.0 and info["success"] and info["reason"] == "correct"
    assert (info["answer"], info["reference"]) == ("\\dfrac{84}{2}", "42")
    assert solve_with(env, "\\boxed{41}")[1]["reason"] == "wrong"
    assert solve_with(env, "\\boxed{41}")[0] == 0.0
    assert solve_with(env, "the answer is 42")[1]["reason"] == "no_boxed"
    assert solve_with(env, "\\boxed{42} no wait \\boxed{4")[1]["reason"] == "unclosed_boxed"
    assert solve_with(env, "\\boxed{}")[1]["reason"] == "empty_answer"
    assert solve_with(env, "\\boxed{41} ... actually \\boxed{42}")[0] == 1.0
    assert solve_with(env, "\\boxed{42} ... actually \\boxed{41}")[0] == 0.0


def test_observation_uses_the_boxed_instruction() -> None:
    obs, info = MathEnv().reset(options={"question": "What is $1+1$?", "answer": "2"})
    assert obs.startswith("What is $1+1$?") and "\\boxed{}" in obs
    assert info == {"kind": "dataset"}


def _check_generated(kind: str, question: str, answer: Fraction) -> None:
    """Recompute the answer from the question text, independently of the generator."""
    ints = [int(x) for x in re.findall(r"-?\d+", question)]
    if kind == "linear":
        m = re.search(r"\$(\d+)x ([+-]) (\d+) = (-?\d+)\$", question)
        assert m is not None, question
        a, sign, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert answer == Fraction(c - (b if sign == "+" else -b), a)
    elif kind == "product":
        total, diff = ints
        assert answer == Fraction((total + diff) * (total - diff), 4)
    elif kind == "rectangle":
        perimeter, length = ints
        assert answer == length * (perimeter // 2 - length)
    elif kind == "change":
        count, price, bill = ints
        assert answer == bill - count * price and answer >= 0
    elif kind == "discount":
        price, percent = ints
        assert answer == Fraction(price * (100 - percent), 100)
    elif kind == "series":
        count, first, second, _third = ints
        terms = [first + k * (second - first) for k in range(count)]
        assert answer == sum(terms)
    elif kind == "fractions":
        m = re.search(r"\\frac\{(\d+)\}\{(\d+)\} ([+-]) \\frac\{(\d+)\}\{(\d+)\}", question)
        assert m is not None, question
        x, y = Fraction(int(m[1]), int(m[2])), Fraction(int(m[4]), int(m[5]))
        assert answer == (x + y if m[3] == "+" else x - y) and answer.denominator != 1
    elif kind == "roots":
        m = re.search(r"x\^2(?: ([+-]) (\d*)x)?(?: ([+-]) (\d+))? = 0", question)
        assert m is not None, question
        b = 0 if m[1] is None else int(m[2] or 1) * (1 if m[1] == "+" else -1)
        c = 0 if m[3] is None else int(m[4]) * (1 if m[3] == "+" else -1)
        roots = [r for r in range(-20, 21) if r * r + b * r + c == 0]
        assert len(roots) == 2 and answer == roots[1] - roots[0]
    else:
        raise AssertionError(f"no independent check for kind {kind!r}")


def test_generator_answers_are_exact_and_deterministic() -> None:
    env = MathEnv()
    kinds = set()
    for task in MathEnv.load_tasks(60, seed=1):
        obs, info = env.reset(seed=task.seed)
        assert env.reset(seed=task.seed) == (obs, info)
        kinds.add(info["kind"])
        problem = generate_problem(random.Random(task.seed))
        assert problem["question"] in obs
        assert not re.search(r"\{[A-Za-z_]\w*\}", problem["question"])  # no unfilled placeholder
        ref = problem["answer"]
        value = Fraction(ref) if "frac" not in ref else _frac(ref)
        _check_generated(info["kind"], problem["question"], value)
        assert env.step(env.example_actions()[0])[1] == 1.0
    assert kinds == set(PROBLEM_KINDS)


def _frac(latex: str) -> Fraction:
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", latex)
    assert m is not None, latex
    return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)


def test_generator_kinds_config() -> None:
    env = make_env("math", kinds=["linear"])
    assert all(env.reset(seed=s)[1]["kind"] == "linear" for s in range(10))
    with pytest.raises(ValueError, match=r"env\.kinds.*unknown problem kinds \['calculus'\]"):
        make_env("math", kinds=["calculus"])


# -- datasets ------------------------------------------------------------------------------------
def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_loader_formats(tmp_path) -> None:
    path = tmp_path / "mixed.jsonl"
    _write_jsonl(
        path,
        [
            {"problem": "P1", "solution": "So $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
            {"problem": "P2", "solution": "\\boxed{5}", "answer": "5", "unique_id": "t/2.json"},
            {"question": "Q3", "answer": "She has 3 + 4 = 7 apples.\n#### 1,024"},
            {"question": "Q4", "final_answer": "x^2"},
            {"prompt": "Q5", "ground_truth": 12},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q6"}],
             "reward_model": {"style": "rule", "ground_truth": "34"}},
            {"id": "custom", "seed": None, "options": {"question": "Q7", "answer": "1"}},
        ],
    )  # fmt: skip
    tasks = MathEnv.load_tasks(path)
    got = [(t.options["question"], t.options["answer"]) for t in tasks]
    assert got == [
        ("P1", "\\frac{1}{2}"),
        ("P2", "5"),
        ("Q3", "1024"),
        ("Q4", "x^2"),
        ("Q5", "12"),
        ("Q6", "34"),
        ("Q7", "1"),
    ]
    assert tasks[1].id == "t/2.json" and tasks[6].id == "custom"
    assert tasks[0].id.startswith("math-") and tasks[0].id == MathEnv.load_tasks(path)[0].id

    as_json = tmp_path / "list.json"
    as_json.write_text(json.dumps([{"question": "Q", "answer": "3"}]))
    assert MathEnv.load_tasks(as_json)[0].options == {"question": "Q", "answer": "3"}


def test_loader_errors_name_the_file_and_record(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, [{"question": "Q", "answer": "1"}, {"text": "Q", "label": "1"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: record 2 .*no question found.*MATH"):
        MathEnv.load_tasks(path)
    _write_jsonl(path, [{"problem": "P", "solution": "no boxed answer here"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: record 1 .*no answer found"):
        MathEnv.load_tasks(path)
    with pytest.raises(ValueError, match="no task source named 'nonsense'"):
        MathEnv.load_tasks("nonsense")


def test_bundled_sample_in_math_format() -> None:
    tasks = MathEnv.load_tasks("sample")
    assert len(tasks) == 12 and len({t.id for t in tasks}) == 12
    assert tasks[0].options["answer"] == "\\frac{7}{8}"
    assert tasks[-1].options["answer"] == "720"  # the explicit `answer` field wins
    from importlib import resources

    raw = resources.files("agentree.prompts").joinpath("math/sample.jsonl").read_text()
    env = MathEnv()
    for task, line in zip(tasks, raw.splitlines(), strict=True):
        env.reset(options=task.options)
        # the reference solution text itself, boxed answer and all, earns the reward
        assert env.step(json.loads(line)["solution"])[1] == 1.0, task


# -- contract ------------------------------------------------------------------------------------
def test_snapshot_restore_including_into_a_fresh_env() -> None:
    env = MathEnv()
    env.reset(seed=4)
    state = env.snapshot()
    right = env.example_actions()[0]
    assert env.step(right)[1] == 1.0
    with pytest.raises(RuntimeError, match="over"):
        env.step(right)
    env.restore(state)
    assert env.step("\\boxed{-1000}")[1] == 0.0
    fresh = MathEnv()  # never reset
    fresh.restore(state)
    assert fresh.step(right)[1] == 1.0


def test_check_env_passes() -> None:
    assert check_env(MathEnv())["forkable"]
    sample = MathEnv.load_tasks("sample")[0]
    assert check_env(MathEnv(), options=sample.options)["deterministic"]
    assert any("\\boxed" in t for t in MathEnv().corpus(MathEnv.load_tasks(2)))


def test_make_env_and_config_errors() -> None:
    env = make_env("math", verifier="string")
    assert isinstance(env, MathEnv) and env.config.verifier == "string"
    with pytest.raises(ValueError, match=r"unknown config key 'env\.checker'"):
        make_env("math", checker="sympy")
    with pytest.raises(ValueError, match=r"bad value for 'env\.verifier'"):
        make_env("math", verifier="sympy")
    with pytest.raises(ValueError, match="must be a non-empty string"):
        MathEnv().reset(options={"question": "Q"})
