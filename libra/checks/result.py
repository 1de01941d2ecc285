"""What a check is and what it reports: the types the checks and the runner share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from libra.checks.context import CheckContext


@dataclass
class CheckResult:
    name: str
    passed: bool
    figure: str
    """What was measured, in words (or, for a failure, why it failed)."""
    values: dict[str, float | int | str] = field(default_factory=dict)
    """The measured figures by name, for the JSON summary."""

    def line(self) -> str:
        return f"[{'PASS' if self.passed else 'FAIL'}] {self.name}: {self.figure}"


class Check(NamedTuple):
    name: str
    run: Callable[[CheckContext], CheckResult]
