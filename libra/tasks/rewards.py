"""Rewards: math answers (normalised exact match), code (tests pass in the sandbox) and retrieval
QA (exact match / F1). Each returns a score in [0, 1]; a malformed or missing answer scores 0.
A user's reward function (`tasks.reward_function`, `module:function`) replaces them: it gets a
`RewardInput` (the task record, the trajectory, its decoded response and final answer, and an
environment's reward when `tasks.environment` is set), may be sync or async, and returns a finite
number.

Answer extraction, in order: the last `<answer>…</answer>`, the last `\\boxed{…}` (braces
balanced), the last `Answer: …` line (DAPO's format). No answer found: 0.
"""

from __future__ import annotations

import inspect
import math
import re
import secrets
import string
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction

from libra.plugins import load_callable
from libra.rollout.tools.sandbox import SandboxPool
from libra.tasks.datasets import TaskRecord, TaskType
from libra.trajectory import ToolStatus, Trajectory

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` with nested braces; None if absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin - 1, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:position]
    return None


def extract_answer(response: str) -> str | None:
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(response)
    if lines:
        line = lines[-1].strip()
        return extract_boxed(line) or line
    return None


# ---------------------------------------------------------------- math

_LATEX_DROP = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "^\\circ",
    "^{\\circ}",
    "\\%",
    "%",
    "$",
    "\\displaystyle",
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SIMPLE_FRAC = re.compile(r"^(-?\d+)/(-?\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize_math_answer(answer: str) -> str:
    """A canonical string for comparing final answers ("$\\dfrac{1}{2}$." -> "\\frac{1}{2}")."""
    text = answer.strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    for token in _LATEX_DROP:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return text


def _as_number(text: str) -> Fraction | None:
    for pattern in (_FRAC, _SIMPLE_FRAC):
        match = pattern.match(text)
        if match:
            groups = match.groups()
            sign = -1 if len(groups) == 3 and groups[0] == "-" else 1
            numerator, denominator = int(groups[-2]), int(groups[-1])
            return None if denominator == 0 else sign * Fraction(numerator, denominator)
    try:
        return Fraction(text)  # integers and decimals, exactly
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(answer: str, ground_truth: str) -> bool:
    left, right = normalize_math_answer(answer), normalize_math_answer(ground_truth)
    if not left:
        return False
    if left == right:
        return True
    left_number, right_number = _as_number(left), _as_number(right)
    return left_number is not None and left_number == right_number


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if the response's final answer equals `ground_truth` after normalisation (numbers
    compared exactly as fractions, so 0.5 == 1/2 == \\frac{1}{2}), else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and math_equal(answer, ground_truth) else 0.0


# ---------------------------------------------------------------- retrieval QA (SQuAD-style)


def normalize_qa_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD / Search-R1 rule)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_exact_match(answer: str, golden_answers: tuple[str, ...] | list[str]) -> float:
    normalized = normalize_qa_answer(answer)
    return 1.0 if normalized and any(normalized == normalize_qa_answer(g) for g in golden_answers) else 0.0


def qa_f1(answer: str, golden_answers: tuple[str, ...] | list[str]) -> float:
    """Best token-overlap F1 against any golden answer."""
    predicted = normalize_qa_answer(answer).split()
    best = 0.0
    for golden in golden_answers:
        reference = normalize_qa_answer(golden).split()
        common = sum((Counter(predicted) & Counter(reference)).values())
        if common == 0:
            continue
        precision, recall = common / len(predicted), common / len(reference)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def retrieval_qa_reward(
    response: str, golden_answers: tuple[str, ...] | list[str], metric: str = "em"
) -> float:
    """Exact match (`metric="em"`) or F1 (`"f1"`) of the response's `<answer>` against any golden answer."""
    if metric not in ("em", "f1"):
        raise ValueError(f"retrieval QA metric must be 'em' or 'f1', got {metric!r}")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return qa_exact_match(answer, golden_answers) if metric == "em" else qa_f1(answer, golden_answers)


# ---------------------------------------------------------------- code


def extract_code(response: str) -> str | None:
    """The last fenced code block (```python …``` or ``` … ```) of the response."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


async def code_reward(response: str, tests: str, pool: SandboxPool, timeout_s: float | None = None) -> float:
    """1.0 if the response's last code block followed by `tests` runs to the end in the sandbox.

    A random marker printed after the tests must come back, so a solution that exits early with
    status 0 (`sys.exit(0)`, `os._exit(0)`) does not pass tests it never reached.
    """
    code = extract_code(response)
    if code is None:
        return 0.0
    marker = f"__libra_tests_passed_{secrets.token_hex(8)}"
    program = f"{code}\n\n{tests}\n\nprint({marker!r})\n"
    result = await pool.run(program, timeout_s)
    return 1.0 if result.status == ToolStatus.SUCCESS and marker in result.stdout else 0.0


# ---------------------------------------------------------------- dispatch


async def compute_reward(
    record: TaskRecord, response: str, pool: SandboxPool | None = None, qa_metric: str = "em"
) -> float:
    """The reward of `response` (the model's whole response text) for `record`; code tasks need
    `pool`, retrieval QA uses `qa_metric` (`tasks.qa_metric`)."""
    if record.task_type in (TaskType.MATH, TaskType.PROCEDURAL):
        return math_reward(response, record.answers[0])
    if record.task_type == TaskType.RETRIEVAL_QA:
        return retrieval_qa_reward(response, record.answers, qa_metric)
    if pool is None:
        raise ValueError("code rewards need a SandboxPool (compute_reward(..., pool=...))")
    return await code_reward(response, record.answers[0], pool)


# ---------------------------------------------------------------- a user's reward function


@dataclass(frozen=True)
class RewardInput:
    """What a reward function (`tasks.reward_function`) is given for one finished trajectory."""

    task: TaskRecord
    """The task record: prompt, answers, task type and its `metadata` (a dataset row's
    `data_source`, `extra_info`, ...)."""
    trajectory: Trajectory
    """Token ids, loss mask, tool returns, outcome (`Outcome.ANSWERED` when it ended with an
    answer rather than at a turn, token or context limit)."""
    response: str
    """The whole response decoded: every model turn and tool output."""
    answer: str | None
    """The last model turn decoded when the trajectory ended with an answer; None otherwise."""
    environment_reward: float | None = None
    """With `tasks.environment`: the sum of the environment's step rewards (which the reward
    function replaces as the trajectory's reward); None without an environment."""


RewardFunction = Callable[[RewardInput], float | Awaitable[float]]


def load_reward_function(spec: str) -> RewardFunction:
    """`tasks.reward_function`: a callable of one argument (a `RewardInput`); ValueError naming
    the field otherwise."""
    function = load_callable(spec, "tasks.reward_function")
    try:
        inspect.signature(function).bind(None)
    except TypeError as e:
        raise ValueError(
            f"tasks.reward_function {spec!r} must take one argument (a libra.tasks.rewards.RewardInput): {e}"
        ) from None
    except ValueError:
        pass  # a builtin without a signature: its first call will tell
    return function


async def call_reward_function(function: RewardFunction, spec: str, given: RewardInput) -> float:
    """The reward function's score of `given`, awaited if it is a coroutine; ValueError naming the
    function and the trajectory when it is not a finite number."""
    value = function(given)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"tasks.reward_function {spec!r} returned {value!r} for trajectory "
            f"{given.trajectory.trajectory_id}: a reward must be a finite number"
        )
    return float(value)
