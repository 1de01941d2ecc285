"""Rewards against hand-checked cases, malformed answers included."""

from __future__ import annotations

import pytest

from libra.tasks.datasets import TaskRecord, TaskType
from libra.tasks.rewards import (
    code_reward,
    compute_reward,
    extract_answer,
    extract_boxed,
    math_reward,
    normalize_math_answer,
    qa_f1,
    retrieval_qa_reward,
)


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the total is \\boxed{42}.", "42", 1.0),
        ("Answer: 42", "42", 1.0),  # DAPO's format
        ("Answer: $42$.", "42", 1.0),
        ("<answer> 42 </answer>", "42", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),  # numbers compare as fractions
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("\\boxed{1,000,000}", "1000000", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\text{(B)}}", "(b)", 1.0),
        ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("first \\boxed{3} then corrected \\boxed{4}", "4", 1.0),  # the last answer counts
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{0.33}", "1/3", 0.0),  # no rounding tolerance
        ("the answer is 42", "42", 0.0),  # no recognised answer format
        ("\\boxed{42", "42", 0.0),  # unbalanced brace
        ("\\boxed{}", "0", 0.0),  # empty answer
        ("Answer:", "42", 0.0),
        ("", "42", 0.0),
        ("\\boxed{1/0}", "1/0", 1.0),  # same string is still a match
        ("\\boxed{1/0}", "0", 0.0),  # division by zero is no number
    ],
)
def test_math_reward(response, truth, expected):
    assert math_reward(response, truth) == expected


def test_extraction_helpers():
    assert extract_boxed("\\boxed{\\frac{a}{b}} and more") == "\\frac{a}{b}"
    assert extract_boxed("no box") is None
    assert extract_answer("<answer>a</answer> Answer: b \\boxed{c}") == "a"
    assert extract_answer("Answer: \\boxed{7} because") == "7"
    assert normalize_math_answer("$\\left( 1, 2 \\right)$") == "(1,2)"


@pytest.mark.parametrize(
    "response, golden, em, f1",
    [
        ("<answer>The Eiffel Tower</answer>", ["Eiffel Tower"], 1.0, 1.0),  # article and case dropped
        ("<answer>eiffel tower!</answer>", ["Eiffel Tower"], 1.0, 1.0),
        ("<answer>Paris</answer>", ["Eiffel Tower", "paris"], 1.0, 1.0),  # any golden answer
        ("<answer>the tower in Paris</answer>", ["Eiffel Tower"], 0.0, 0.4),  # P=1/3, R=1/2
        ("<answer>London</answer>", ["Paris"], 0.0, 0.0),
        ("Paris", ["Paris"], 0.0, 0.0),  # no <answer> tag
        ("<answer></answer>", ["Paris"], 0.0, 0.0),
        ("<answer>a the an</answer>", ["the"], 0.0, 0.0),  # only articles: empty
        ("<answer>Paris", ["Paris"], 0.0, 0.0),  # unclosed tag
    ],
)
def test_retrieval_qa_reward(response, golden, em, f1):
    assert retrieval_qa_reward(response, golden, "em") == em
    assert retrieval_qa_reward(response, golden, "f1") == pytest.approx(f1)


def test_qa_f1_hand_checked():
    # predicted [new, york, city], gold [new, york]: P = 2/3, R = 1, F1 = 0.8
    assert qa_f1("New York City", ["New York"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="metric"):
        retrieval_qa_reward("<answer>x</answer>", ["x"], "bleu")


TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", 1.0),
        ("Here:\n```\ndef add(a, b):\n    return a + b\n```", 1.0),
        ("```python\ndef add(a, b):\n    return a - b\n```", 0.0),  # tests fail
        ("```python\nimport sys\nsys.exit(0)\ndef add(a, b): pass\n```", 0.0),  # early exit gamed
        ("```python\nimport os\nos._exit(0)\n```", 0.0),
        ("```python\nwhile True: pass\n```", 0.0),  # timeout
        ("def add(a, b): return a + b", 0.0),  # no code block
        ("```python\ndef add(a, b) return a + b\n```", 0.0),  # syntax error
    ],
)
def test_code_reward(loop, pool, response, expected):
    assert loop.run_until_complete(code_reward(response, TESTS, pool, timeout_s=1.0)) == expected


def test_compute_reward_dispatch(loop, pool):
    math = TaskRecord("1+1?", "2", TaskType.MATH)
    qa = TaskRecord("capital?", ("Paris",), TaskType.RETRIEVAL_QA)
    code = TaskRecord("write add", TESTS, TaskType.CODE)
    assert loop.run_until_complete(compute_reward(math, "\\boxed{2}")) == 1.0
    assert loop.run_until_complete(compute_reward(qa, "<answer>paris</answer>")) == 1.0
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    assert loop.run_until_complete(compute_reward(code, solution, pool)) == 1.0
    with pytest.raises(ValueError, match="SandboxPool"):
        loop.run_until_complete(compute_reward(code, solution))
