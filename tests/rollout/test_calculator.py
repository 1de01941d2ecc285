"""The calculator tool: exact arithmetic, and every bad input a FAILURE result, never a raise."""

from __future__ import annotations

import asyncio

import pytest

from libra.rollout.tools import Calculator, Tool
from libra.rollout.tools.calculator import evaluate
from libra.trajectory import ToolStatus


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-3**2", -9),
        ("2**10", 1024),
        ("10%4", 2),
        ("1.5*2", 3.0),
    ],
)
def test_evaluates_like_python(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"expression": "__import__('os')"}, "unsupported element Call"),
        ({"expression": "a+1"}, "unsupported element Name"),
        ({"expression": "1/0"}, "division by zero"),
        ({"expression": "2**100000"}, "exponent 100000 is larger"),
        ({"expression": "1+"}, "cannot parse"),
        ({"expression": "1" * 300}, "longer than"),
        ({"expression": 5}, "must be a string"),
        ({}, "must be a string"),
    ],
)
def test_bad_inputs_are_failure_results(arguments, message):
    result = asyncio.run(Calculator()(arguments))
    assert result.status == ToolStatus.FAILURE
    assert result.content.startswith("error: ") and message in result.content


def test_results_and_protocol():
    calculator = Calculator()
    assert isinstance(calculator, Tool)
    result = asyncio.run(calculator({"expression": "6*7"}))
    assert (result.content, result.status) == ("42", ToolStatus.SUCCESS)
    assert asyncio.run(calculator({"expression": "1/3"})).content == "0.3333333333"
