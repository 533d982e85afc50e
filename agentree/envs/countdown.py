"""Countdown (TinyZero): combine the given numbers with + - * / to reach a target.

One step: `reset` returns the instruction, `step(response)` scores the response and ends the
episode. The reward is TinyZero's `compute_score` (LATR Eq. 11, R = 0.1·I_format + 0.9·I_correct):

- 0 (`no_answer`): the response holds no `<answer>...</answer>`;
- `format_score` = 0.1: an answer is given but is not a correct solution (`empty_answer`,
  `too_long`, `bad_character`, `syntax_error`, `disallowed`, `numbers_mismatch`,
  `division_by_zero`, `wrong_value`);
- `correct_score` = 1 (`correct`): the answer uses every given number exactly once (as a
  multiset: a number given twice must be used twice), only + - * / and parentheses, and evaluates
  exactly to the target.

Deliberate differences from TinyZero: the last answer tag anywhere in the response counts
(TinyZero reads only the response's last line); the expression is parsed with `ast` and evaluated
with exact fractions by a walker that knows only integer literals and the four operators (TinyZero
calls `eval` and compares floats with 1e-5 tolerance); × ÷ − are read as * / -.
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from pydantic import Field, model_validator

from agentree.envs.base import EnvConfig, Task, register_env
from agentree.envs.single import SingleStepEnv
from agentree.prompts import render

MAX_ANSWER_CHARS = 500
"""Longer answers are rejected before parsing (keeps the parser away from pathological input)."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]*")
_UNICODE_OPS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ExpressionError(ValueError):
    """An answer that is not an admissible Countdown expression; `reason` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# -- answer checking --------------------------------------------------------------------------
def extract_answer(response: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in `response`, or None."""
    matches = _ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def parse_expression(text: str) -> ast.expr:
    """Parse an answer into an expression tree of integer literals and + - * / only."""
    text = text.translate(_UNICODE_OPS)
    if len(text) > MAX_ANSWER_CHARS:
        raise ExpressionError("too_long", f"answer longer than {MAX_ANSWER_CHARS} characters")
    if not _ALLOWED_CHARS.fullmatch(text):
        bad = next(c for c in text if not _ALLOWED_CHARS.fullmatch(c))
        raise ExpressionError("bad_character", f"character {bad!r} is not allowed")
    text = " ".join(text.split())  # a newline inside an expression is not a syntax error here
    try:
        with warnings.catch_warnings():
            # "2(3)" parses as a call and makes Python warn; it is rejected below anyway.
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExpressionError("syntax_error", f"not an arithmetic expression ({e.msg})") from None
    _check_node(tree.body)
    return tree.body


def _check_node(node: ast.AST) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check_node(node.left)
        _check_node(node.right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        _check_node(node.operand)
    elif not (isinstance(node, ast.Constant) and type(node.value) is int):
        raise ExpressionError("disallowed", f"{ast.unparse(node)!r} is not allowed")


def literals(node: ast.expr) -> list[int]:
    """The integer literals of a checked expression, left to right."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def evaluate(node: ast.AST) -> Fraction:
    """Exact value of an expression tree; anything but int literals and + - * / is refused."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = evaluate(node.left), evaluate(node.right)
        op = _BINOPS[type(node.op)]
        if op == "/" and right == 0:
            raise ExpressionError("division_by_zero", "division by zero")
        return _apply(op, left, right)
    raise ExpressionError("disallowed", f"{type(node).__name__} nodes are not allowed")


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def check_answer(answer: str | None, nums: Sequence[int], target: int) -> tuple[str, str, Any]:
    """(reason, detail, value) for an extracted answer; reason is `correct` on success."""
    if answer is None:
        return "no_answer", "no <answer>...</answer> in the response", None
    if not answer:
        return "empty_answer", "the answer tag is empty", None
    try:
        node = parse_expression(answer)
        used, given = Counter(literals(node)), Counter(nums)
        if used != given:
            return "numbers_mismatch", _mismatch(used, given), None
        value = evaluate(node)
    except ExpressionError as e:
        return e.reason, str(e), None
    if value != target:
        return "wrong_value", f"evaluates to {value}, target is {target}", value
    return "correct", f"evaluates to {target}", value


def _mismatch(used: Counter, given: Counter) -> str:
    missing, extra = sorted((given - used).elements()), sorted((used - given).elements())
    parts = [f"numbers used {sorted(used.elements())}, given {sorted(given.elements())}"]
    if missing:
        parts.append(f"not used: {missing}")
    if extra:
        parts.append(f"not given or used too often: {extra}")
    return "; ".join(parts)


# -- task generation and solving --------------------------------------------------------------
def generate_task(
    rng: random.Random,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    min_number: int = 1,
    max_number: int = 99,
    max_target: int = 100,
    max_tries: int = 10_000,
) -> dict[str, Any]:
    """A solvable task {"target", "nums", "solution"}: random numbers combined at random.

    Like the Countdown-Tasks data, the target is the value of a random expression over the
    numbers: two pool entries are combined with a random operator until one is left. Every
    intermediate value is a positive integer (no negative or fractional steps), as in the game.
    """
    for _ in range(max_tries):
        nums = [
            rng.randint(min_number, max_number)
            for _ in range(rng.randint(min_numbers, max_numbers))
        ]
        pool: list[tuple[int, str]] = [(n, str(n)) for n in nums]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea), (b, eb) = pool[i], pool[j]
            ops = ["+", "*"] + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0)
            op = rng.choice(ops)
            value = int(_apply(op, Fraction(a), Fraction(b)))
            pool = [p for k, p in enumerate(pool) if k not in (i, j)]
            pool.append((value, f"({ea} {op} {eb})"))
        target, expr = pool[0]
        if 1 <= target <= max_target:
            return {
                "target": target,
                "nums": nums,
                "solution": expr[1:-1] if len(nums) > 1 else expr,
            }
    raise ValueError(
        f"no Countdown task with a target in [1, {max_target}] found in {max_tries} tries; "
        "raise max_target or lower the number range"
    )


def solve(nums: Sequence[int], target: int) -> str | None:
    """An expression using every number once that equals `target` (exhaustive), or None."""

    def search(pool: list[tuple[Fraction, str]]) -> str | None:
        if len(pool) == 1:
            return pool[0][1] if pool[0][0] == target else None
        for i, j in itertools.permutations(range(len(pool)), 2):
            (a, ea), (b, eb) = pool[i], pool[j]
            rest = [p for k, p in enumerate(pool) if k not in (i, j)]
            for op in "+-*/":
                if (op in "+*" and i > j) or (op == "/" and b == 0):
                    continue  # commutative: one order suffices
                found = search([*rest, (_apply(op, a, b), f"({ea} {op} {eb})")])
                if found is not None:
                    return found
        return None

    found = search([(Fraction(n), str(n)) for n in nums])
    if found is not None and len(nums) > 1:
        found = found[1:-1]
    return found


# -- the env -----------------------------------------------------------------------------------
class CountdownConfig(EnvConfig):
    """Task generation (for seeded tasks) and reward levels."""

    min_numbers: int = Field(3, ge=1)
    """Fewest numbers in a generated task (Countdown-Tasks-3to4: 3)."""
    max_numbers: int = Field(4, ge=1, le=6)
    """Most numbers in a generated task (Countdown-Tasks-3to4: 4)."""
    min_number: int = Field(1, ge=1)
    """Smallest number drawn for a generated task."""
    max_number: int = Field(99, ge=1)
    """Largest number drawn for a generated task."""
    max_target: int = Field(100, ge=1)
    """Generated targets lie in [1, max_target]."""
    format_score: float = 0.1
    """Reward for an answer in <answer> tags that is not a correct solution (TinyZero: 0.1)."""
    correct_score: float = 1.0
    """Reward for a correct solution (TinyZero: 1.0)."""

    @model_validator(mode="after")
    def _ranges(self) -> CountdownConfig:
        if self.min_numbers > self.max_numbers:
            raise ValueError(f"min_numbers {self.min_numbers} > max_numbers {self.max_numbers}")
        if self.min_number > self.max_number:
            raise ValueError(f"min_number {self.min_number} > max_number {self.max_number}")
        return self


@register_env("countdown")
class CountdownEnv(SingleStepEnv):
    """Single-step Countdown. Task options: {"target": int, "nums": [int, ...]}.

    `reset(seed=s)` without options generates a solvable task from `s`; `reset(options=...)`
    poses the given one. Files in the public format (`Jiayi-Pan/Countdown-Tasks-3to4`, records
    {"target": 98, "nums": [44, 19, 35]}) load through `load_tasks("file.jsonl")`.
    """

    Config = CountdownConfig
    # the reward levels change neither the expert's answers nor the prompts
    expert_settings = ("min_numbers", "max_numbers", "min_number", "max_number", "max_target")

    episode_name = "Countdown"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.config = CountdownConfig(**kwargs)
        self.system_prompt = render("countdown/system.txt").strip()

    # -- the single step ----------------------------------------------------------------------
    @staticmethod
    def parse_task(options: dict[str, Any]) -> dict[str, Any]:
        return task_options(options)

    def generate(self, rng: random.Random) -> dict[str, Any]:
        c = self.config
        return generate_task(
            rng,
            min_numbers=c.min_numbers,
            max_numbers=c.max_numbers,
            min_number=c.min_number,
            max_number=c.max_number,
            max_target=c.max_target,
        )

    def observation(self) -> str:
        assert self._task is not None
        nums = "[" + ", ".join(str(n) for n in self._task["nums"]) + "]"
        return render("countdown/instance.txt", numbers=nums, target=self._task["target"]).strip()

    def reset_info(self) -> dict[str, Any]:
        assert self._task is not None
        return {"target": self._task["target"], "nums": list(self._task["nums"])}

    def grade(self, action: str) -> tuple[float, dict[str, Any]]:
        assert self._task is not None
        answer = extract_answer(action)
        reason, detail, value = check_answer(answer, self._task["nums"], self._task["target"])
        if reason == "correct":
            reward = self.config.correct_score
        elif reason == "no_answer":
            reward = 0.0
        else:
            reward = self.config.format_score
        return reward, {
            "success": reason == "correct",
            "answer": answer,
            "value": None if value is None else str(value),
            "reason": reason,
            "detail": detail,
            "action_key": "".join(answer.split()) if answer is not None else "",
            "format_error": answer is None,
        }

    def task_state(self) -> dict[str, Any]:
        assert self._task is not None
        return {**self._task, "nums": tuple(self._task["nums"])}

    # -- tasks --------------------------------------------------------------------------------
    @classmethod
    def task_from_record(cls, record: dict[str, Any]) -> Task:
        """A public-format record {"target", "nums"} (or TinyZero's "numbers"), or a Task dict."""
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        if "options" in record and "target" not in record:
            return super().task_from_record(record)
        if "target" not in record or not ({"nums", "numbers"} & record.keys()):
            raise ValueError(
                'expected a Countdown record {"target": int, "nums": [int, ...]}, got keys '
                f"{sorted(record)}"
            )
        options = task_options(
            {"target": record["target"], "nums": record.get("nums", record.get("numbers"))}
        )
        nums = "-".join(str(n) for n in options["nums"])
        task_id = str(record.get("id", f"countdown-{options['target']}-{nums}"))
        return Task(task_id, None, {"target": options["target"], "nums": list(options["nums"])})

    # -- scripted play ----------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The exhaustive solver's expression after a short think block (None: unsolvable)."""
        assert self._task is not None, "call reset() first"
        expr = solve(self._task["nums"], self._task["target"])
        return None if expr is None else self._response(expr)

    def random_action(self, rng: random.Random) -> str:
        """The numbers in a random order joined by random operators: in format, mostly wrong."""
        assert self._task is not None, "call reset() first"
        order = list(self._task["nums"])
        rng.shuffle(order)
        expr = str(order[0])
        for n in order[1:]:
            expr += f" {rng.choice('+-*')} {n}"
        return self._response(expr)

    def _response(self, expr: str) -> str:
        assert self._task is not None
        think = f"<think>Combine the numbers to reach {self._task['target']}.</think>"
        return f"{think}\n<answer>{expr}</answer>"

    # -- tooling ----------------------------------------------------------------------------
    def example_actions(self) -> list[str]:
        if self._task is None:
            return [
                "<think>1 + 2 is 3.</think>\n<answer>1 + 2</answer>",
                "<think>I am not sure.</think>",
            ]
        nums, target = self._task["nums"], self._task["target"]
        solution = self._task.get("solution") or (solve(nums, target) if len(nums) <= 5 else None)
        naive = " + ".join(str(n) for n in nums)
        actions = [f"<think>Adding everything gives {sum(nums)}.</think>\n<answer>{naive}</answer>"]
        if solution is not None:
            actions.insert(0, f"<think>Try {solution}.</think>\n<answer>{solution}</answer>")
        return actions


def task_options(options: dict[str, Any]) -> dict[str, Any]:
    """Validate Countdown task options; returns {"target", "nums" (tuple)[, "solution"]}."""
    unknown = set(options) - {"target", "nums", "solution"}
    if unknown:
        raise ValueError(f"unknown Countdown task option(s) {sorted(unknown)}")
    target, nums = options.get("target"), options.get("nums")
    if not _is_int(target):
        raise ValueError(f"Countdown 'target' must be an integer, got {target!r}")
    if not isinstance(nums, list | tuple) or not nums or not all(_is_int(n) for n in nums):
        raise ValueError(f"Countdown 'nums' must be a non-empty list of integers, got {nums!r}")
    out: dict[str, Any] = {"target": int(target), "nums": tuple(int(n) for n in nums)}
    if options.get("solution") is not None:
        out["solution"] = str(options["solution"])
    return out


def _is_int(x: Any) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, float) and x.is_integer()
    )
