"""Math word problems with a single checkable answer (MATH, GSM8K, DAPO-Math style).

One step: `reset` returns the question with the instruction to put the final answer in
`\\boxed{}`; `step(response)` reads the last `\\boxed{...}` (also `\\boxed x` and `\\fbox{...}`)
and rewards 1 if it is equivalent to the reference answer, else 0 (DAPO / TreeRL: binary,
correctness only).

Equivalence is decided by `math_verify` (parse both sides, then `verify`; optional dependency
`agentree[math]`). Without it, when it cannot parse a side or takes over `timeout_s` CPU seconds,
or for answers whose evaluation could explode (`9^{9^{9}}`, see `cas_safe`), a normalised
comparison is used:
LaTeX spacing/wrappers stripped, fractions and decimals compared as exact numbers (with 1e-6
relative tolerance for rounded decimals), anything else compared as normalised strings.

Tasks come from a seeded generator of word problems with exact answers (`reset(seed=s)`), the
bundled MATH-format sample (`load_tasks("sample")`), or JSON/JSONL files in the MATH, GSM8K,
DAPO-Math or generic question/answer formats (see `MathEnv.task_from_record`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import warnings
from collections.abc import Callable
from fractions import Fraction
from importlib import resources
from types import ModuleType
from typing import Any, Literal

from pydantic import Field, field_validator

from agentree.envs import cas
from agentree.envs.base import EnvConfig, Task, records_to_tasks, register_env
from agentree.envs.single import SingleStepEnv
from agentree.prompts import render

# -- answer extraction ---------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{...}` / `\\boxed x` / `\\fbox{...}`, or None.

    Braces are matched with nesting (escaped `\\{ \\}` do not count). A box nested inside another
    belongs to the outer one. If the last box is not closed (a truncated response), the answer is
    None: the final answer was never completed.
    """
    found: str | None = None
    pos = 0
    while (m := _BOX.search(text, pos)) is not None:
        start = m.end()
        i = start
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _closing_brace(text, i)
            if end is None:
                return None
            found, pos = text[i + 1 : end].strip(), end + 1
        elif i > start:  # "\boxed 5": the argument runs to the end of the math or the line
            stop = re.search(r"[$\n]", text[i:])
            end = i + stop.start() if stop else len(text)
            found, pos = text[i:end].strip().rstrip("."), end
        else:
            pos = start
    return found


def _closing_brace(text: str, open_at: int) -> int | None:
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character, so \{ and \} do not count
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


# -- equivalence ---------------------------------------------------------------------------------
_warned_missing = False


def load_math_verify(required: bool = False) -> ModuleType | None:
    """The `math_verify` module, or None (with one warning per process) when not installed."""
    global _warned_missing
    try:
        # deferred: math_verify is the optional [math] extra
        import math_verify
    except ImportError:
        if required:
            raise ImportError(
                "verifier='math_verify' needs the math_verify package: pip install 'agentree[math]'"
            ) from None
        if not _warned_missing:
            warnings.warn(
                "math_verify is not installed; math answers are compared by a normalised "
                "string/number match, which misses some equivalent forms. "
                "Install it with: pip install 'agentree[math]'",
                RuntimeWarning,
                stacklevel=2,
            )
            _warned_missing = True
        return None
    return math_verify


def answers_match(
    prediction: str,
    reference: str,
    *,
    verifier: Literal["auto", "math_verify", "string"] = "auto",
    timeout_s: int = 5,
) -> tuple[bool, str]:
    """(equivalent?, which check decided) for a predicted and a reference answer."""
    if prediction.strip() == reference.strip():
        return True, "exact"
    mv = load_math_verify(required=verifier == "math_verify") if verifier != "string" else None
    if mv is not None and cas_safe(prediction) and cas_safe(reference):
        # in a worker process, under a limit on its CPU time whatever thread asks (see `cas`)
        verdict = cas.check(prediction, reference, timeout_s)
        if verdict is not None:
            return verdict, "math_verify"
    # no verdict (no CAS, an error, or over the time limit): the strings decide
    return strings_match(prediction, reference), "string"


MAX_CAS_CHARS = 1000
"""Answers longer than this are compared as strings only."""


def cas_safe(answer: str) -> bool:
    """False for answers whose evaluation could explode (towers of powers, big factorials).

    sympy evaluates `9^{9^{9}}` or `(10^{100})!` eagerly inside one C call, which the CPU-time
    limit cannot interrupt (only the backstop's kill ends it, after a minute or more: see
    `agentree.envs.cas`). Such answers skip the CAS and are compared as normalised strings.
    """
    if len(answer) > MAX_CAS_CHARS or answer.count("**") > 1:
        return False
    for m in re.finditer(r"\^\s*", answer):
        i = m.end()
        if i < len(answer) and answer[i] == "{":
            end = _closing_brace(answer, i)
            exponent = answer[i + 1 : end] if end is not None else answer[i + 1 :]
        else:
            exponent = answer[i : i + 1]
        if re.search(r"\^|!|\\uparrow|\d{6,}", exponent):
            return False
    for m in re.finditer(r"(?<!\\)!", answer):
        # only a factorial of a literal of at most three digits is cheap
        if not re.search(r"(?:^|[^\d])\d{1,3}\s*$", answer[: m.start()]):
            return False
    return True


_WRAPPERS = re.compile(
    r"\\(?:boxed|text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_SPACING = re.compile(r"\\(?:left|right|displaystyle|[!,;: ]|q?quad)(?![A-Za-z])")
_DROP = re.compile(r"\^\s*\{?\\circ\}?|\\circ|\\%|%|\\\$|\$")


def normalize_answer(answer: str) -> str:
    """A canonical string for comparing final answers without a CAS."""
    s = answer.strip()
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _SPACING.sub("", s)
    while (t := _WRAPPERS.sub(r"\1", s)) != s:
        s = t
    s = _DROP.sub("", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"^[A-Za-z]=(?!=)", "", s)  # "x=5" -> "5"
    s = re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # multiple-choice "(C)" -> "C"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # thousands separators, not a tuple
    return s


def as_number(s: str) -> Fraction | None:
    """Exact value of a normalised integer, decimal, `a/b` or `\\frac{a}{b}`, else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(
        r"(-?)\(?(-?\d+)\)?/\(?(-?\d+)\)?", s
    )
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        return Fraction(num, den) * (-1 if m.group(1) else 1)
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def strings_match(prediction: str, reference: str) -> bool:
    """Normalised comparison: exact numbers (1e-6 relative slack for decimals), else strings."""
    a, b = normalize_answer(prediction), normalize_answer(reference)
    if not a or not b:
        return False
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y or abs(x - y) <= Fraction(1, 10**6) * max(1, abs(y))
    return a == b


# -- generated problems --------------------------------------------------------------------------
_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas")
_ITEMS = ("notebooks", "pencils", "apples", "tickets", "stamps", "candles", "mugs", "plants")
_SALE_ITEMS = ("jacket", "lamp", "bicycle", "backpack", "chair", "watch")


def latex_number(x: Fraction) -> str:
    """An exact number in the form a MATH answer would use: `7`, `-\\frac{5}{3}`."""
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _signed(coef: int, var: str = "") -> str:
    """' + 3x' / ' - 3x' (coefficient 1 written as 'x'), or '' for zero."""
    if coef == 0:
        return ""
    mag = "" if abs(coef) == 1 and var else str(abs(coef))
    return f" {'+' if coef > 0 else '-'} {mag}{var}"


def _linear(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    a, b, c = rng.randint(2, 12), rng.choice([*range(-30, 0), *range(1, 31)]), rng.randint(-50, 50)
    return {"equation": f"{a}x{_signed(b)} = {c}"}, Fraction(c - b, a)


def _change(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    count, price = rng.randint(2, 9), rng.randint(2, 11)
    cost = count * price
    bill = next(b for b in (20, 50, 100) if b > cost)
    buyer, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    variables = {"buyer": buyer, "count": count, "item": item, "price": price, "bill": bill}
    return variables, Fraction(bill - cost)


def _fractions(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    while True:
        b, d = rng.randint(2, 12), rng.randint(2, 12)
        x, y = Fraction(rng.randint(1, b - 1), b), Fraction(rng.randint(1, d - 1), d)
        op = rng.choice("+-")
        value = x + y if op == "+" else x - y
        if value.denominator != 1:
            expr = f"\\frac{{{x.numerator}}}{{{x.denominator}}} {op} "
            expr += f"\\frac{{{y.numerator}}}{{{y.denominator}}}"
            return {"expression": expr}, value


def _discount(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    # price a multiple of 20 and percent a multiple of 5 keep the sale price whole
    price, percent = 20 * rng.randint(1, 15), 5 * rng.randint(1, 15)
    item = rng.choice(_SALE_ITEMS)
    sale_price = Fraction(price * (100 - percent), 100)
    return {"item": item, "price": price, "percent": percent}, sale_price


def _rectangle(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    width = rng.randint(1, 20)
    length = width + rng.randint(1, 20)
    return {"perimeter": 2 * (length + width), "length": length}, Fraction(length * width)


def _roots(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    r1, r2 = sorted(rng.sample(range(-9, 10), 2))
    equation = f"x^2{_signed(-(r1 + r2), 'x')}{_signed(r1 * r2)} = 0"
    return {"equation": equation}, Fraction(r2 - r1)


def _series(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    first, diff = rng.randint(-10, 20), rng.choice([*range(-5, 0), *range(1, 10)])
    count = rng.randint(5, 30)
    terms = ", ".join(str(first + k * diff) for k in range(3))
    total = Fraction(count * (2 * first + (count - 1) * diff), 2)
    return {"count": count, "terms": terms}, total


def _product(rng: random.Random) -> tuple[dict[str, Any], Fraction]:
    small = rng.randint(1, 40)
    big = small + rng.randint(1, 40)
    return {"total": big + small, "difference": big - small}, Fraction(big * small)


PROBLEM_KINDS: dict[str, Callable[[random.Random], tuple[dict[str, Any], Fraction]]] = {
    "linear": _linear,
    "change": _change,
    "fractions": _fractions,
    "discount": _discount,
    "rectangle": _rectangle,
    "roots": _roots,
    "series": _series,
    "product": _product,
}
"""Generated problem kinds: name -> rng -> (template variables, exact answer)."""


def generate_problem(rng: random.Random, kinds: list[str] | None = None) -> dict[str, str]:
    """A word problem {"question", "answer", "kind"} with an exact answer; text in prompts/."""
    kind = rng.choice(sorted(kinds or PROBLEM_KINDS))
    variables, answer = PROBLEM_KINDS[kind](rng)
    question = render(f"math/problems/{kind}.txt", **variables).strip()
    return {"question": question, "answer": latex_number(answer), "kind": kind}


# -- dataset records -----------------------------------------------------------------------------
_RECORD_FORMATS = (
    "MATH {problem, solution with \\boxed{answer}[, answer]}, "
    "GSM8K {question, answer ending in '#### N'}, "
    "DAPO-Math {prompt: [messages], reward_model: {ground_truth}}, "
    "or {question|prompt|problem, answer|final_answer|ground_truth}"
)


def _record_question(record: dict[str, Any]) -> str | None:
    for key in ("problem", "question", "prompt"):
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
        if isinstance(value, list):  # chat messages: the last user turn holds the problem
            users = [
                m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"
            ]
            if users and isinstance(users[-1], str) and users[-1].strip():
                return users[-1].strip()
    return None


def _record_answer(record: dict[str, Any]) -> str | None:
    for key in ("answer", "final_answer", "ground_truth"):
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            if "####" in value:  # GSM8K: worked solution, then "#### 42"
                return value.rsplit("####", 1)[1].strip().replace(",", "") or None
            return value.strip()
    nested = record.get("reward_model")
    if isinstance(nested, dict) and nested.get("ground_truth") is not None:
        return _record_answer({"answer": nested["ground_truth"]})
    solution = record.get("solution")
    if isinstance(solution, str):
        return extract_boxed(solution) or None
    return None


# -- the env -------------------------------------------------------------------------------------
class MathConfig(EnvConfig):
    """Answer checking and the generated task source."""

    verifier: Literal["auto", "math_verify", "string"] = "auto"
    """Equivalence check: math_verify if installed (auto), required, or normalised strings."""
    timeout_s: int = Field(5, ge=1)
    """CPU seconds math_verify may take to parse and compare one answer before the strings
    decide (in a worker process, from any thread: `agentree.envs.cas`)."""
    kinds: list[str] | None = None
    """Generated problem kinds to draw from (default: all of PROBLEM_KINDS)."""

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str] | None) -> list[str] | None:
        if kinds is not None and not kinds:
            raise ValueError("kinds must name at least one problem kind (or be null for all)")
        unknown = sorted(set(kinds or ()) - set(PROBLEM_KINDS))
        if unknown:
            raise ValueError(f"unknown problem kinds {unknown}; known: {sorted(PROBLEM_KINDS)}")
        return kinds


@register_env("math")
class MathEnv(SingleStepEnv):
    """Single-step math. Task options: {"question": str, "answer": str}.

    `reset(seed=s)` without options generates a word problem from `s`; `reset(options=...)`
    poses the given question. Reward 1 if the last boxed answer matches the reference, else 0.
    """

    Config = MathConfig

    episode_name = "math"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.config = MathConfig(**kwargs)
        if self.config.verifier != "string":
            load_math_verify(required=self.config.verifier == "math_verify")

    # -- the single step ----------------------------------------------------------------------
    @staticmethod
    def parse_task(options: dict[str, Any]) -> dict[str, Any]:
        return task_options(options)

    def generate(self, rng: random.Random) -> dict[str, Any]:
        return generate_problem(rng, self.config.kinds)

    def observation(self) -> str:
        assert self._task is not None
        return render("math/instance.txt", question=self._task["question"]).strip()

    def reset_info(self) -> dict[str, Any]:
        return {"kind": self._kind()}

    def grade(self, action: str) -> tuple[float, dict[str, Any]]:
        assert self._task is not None
        reference = self._task["answer"]
        answer = extract_boxed(action)
        checked_by = None
        if answer is None:
            has_box = _BOX.search(action) is not None
            reason = "unclosed_boxed" if has_box else "no_boxed"
            success = False
        elif not answer:
            reason, success = "empty_answer", False
        else:
            success, checked_by = answers_match(
                answer, reference, verifier=self.config.verifier, timeout_s=self.config.timeout_s
            )
            reason = "correct" if success else "wrong"
        return 1.0 if success else 0.0, {
            "success": success,
            "answer": answer,
            "reference": reference,
            "reason": reason,
            "checked_by": checked_by,
            "action_key": answer if answer is not None else "",
            "format_error": reason in ("no_boxed", "unclosed_boxed"),
        }

    # -- tasks --------------------------------------------------------------------------------
    @classmethod
    def named_tasks(cls, name: str, *, seed: int = 0, split: str = "train") -> list[Task]:
        """`sample`: a dozen MATH-format problems shipped with agentree (smoke tests, demos)."""
        if name != "sample":
            return super().named_tasks(name, seed=seed, split=split)
        data = resources.files("agentree.prompts").joinpath("math/sample.jsonl")
        lines = data.read_text(encoding="utf-8").splitlines()
        return records_to_tasks(
            cls, [json.loads(x) for x in lines if x.strip()], "math/sample.jsonl"
        )

    @classmethod
    def task_from_record(cls, record: dict[str, Any]) -> Task:
        """A MATH, GSM8K, DAPO-Math or generic question/answer record, or a Task dict."""
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        if "options" in record and {"id", "seed", "options"}.issuperset(record):
            return super().task_from_record(record)
        question, answer = _record_question(record), _record_answer(record)
        if question is None or answer is None:
            missing = "question" if question is None else "answer"
            raise ValueError(
                f"no {missing} found; known record formats: {_RECORD_FORMATS}; "
                f"got keys {sorted(record)}"
            )
        task_id = next((record[k] for k in ("id", "unique_id", "idx") if k in record), None)
        if task_id is None:
            task_id = "math-" + hashlib.sha1(question.encode()).hexdigest()[:12]
        return Task(str(task_id), None, {"question": question, "answer": answer})

    # -- tooling ----------------------------------------------------------------------------
    def example_actions(self) -> list[str]:
        answer = self._task["answer"] if self._task is not None else "0"
        return [
            f"Working it through step by step, the result is $\\boxed{{{answer}}}$.",
            "I think the answer is \\boxed{-1}.",
            "I am not sure.",
        ]

    def _kind(self) -> str:
        assert self._task is not None
        return self._task.get("kind", "dataset")


def task_options(options: dict[str, Any]) -> dict[str, str]:
    """Validate math task options: {"question": str, "answer": str[, "kind": str]}."""
    unknown = set(options) - {"question", "answer", "kind"}
    if unknown:
        raise ValueError(f"unknown math task option(s) {sorted(unknown)}")
    out = {}
    for key in ("question", "answer"):
        value = options.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and key == "answer":
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"math task option {key!r} must be a non-empty string, got {value!r}")
        out[key] = value.strip()
    if options.get("kind"):
        out["kind"] = str(options["kind"])
    return out
