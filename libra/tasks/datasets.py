"""Dataset loading: JSONL / parquet records into typed `TaskRecord`s.

Accepted record shapes (detected per record, or forced with `shape=`):
  - `libra`:     {"prompt": str, "ground_truth": str | [str], "task_type": str, "metadata"?: {}}
  - `dapo_math`: DAPO-Math-17k — {"prompt": [{"role", "content"}...], "reward_model":
                 {"ground_truth": str}, "data_source"?, "extra_info"?}
  - `search_r1`: Search-R1 (NQ / HotpotQA) — {"question": str, "golden_answers": [str], "id"?,
                 "data_source"?} (or `reward_model.ground_truth.target`)
  - `r2e_gym`:   R2E-Gym-style issue + tests, runnable in our sandbox — {"problem_statement": str,
                 "tests": str (Python asserting the fix), "repo_name"?, "setup_code"?}
A bad record raises ValueError naming the file, the line (JSONL) or row (parquet) and the field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TaskType(enum.Enum):
    MATH = "math"
    """Answer compared with the ground truth after normalisation (`rewards.math_reward`)."""
    CODE = "code"
    """The response's code must pass `ground_truth` (Python tests) in the sandbox."""
    RETRIEVAL_QA = "retrieval_qa"
    """Short answer compared with any of the golden answers (exact match / F1)."""
    PROCEDURAL = "procedural"
    """Generated agentic task (`procedural.py`): exact match of the final answer."""


@dataclass(frozen=True)
class TaskRecord:
    prompt: str
    """The user turn shown to the model."""
    ground_truth: str | tuple[str, ...]
    """The answer (math, procedural), the accepted answers (retrieval QA) or the tests (code)."""
    task_type: TaskType
    metadata: dict[str, Any] = field(default_factory=dict)
    """Source, ids and anything else a reward or a report needs; never shown to the model."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("TaskRecord.prompt must be a non-empty string")
        answers = (self.ground_truth,) if isinstance(self.ground_truth, str) else self.ground_truth
        if not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError("TaskRecord.ground_truth must be a string or a non-empty tuple of strings")

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.ground_truth,) if isinstance(self.ground_truth, str) else self.ground_truth


SHAPES = ("auto", "libra", "dapo_math", "search_r1", "r2e_gym")


def load_tasks(path: str | Path, shape: str = "auto", limit: int | None = None) -> list[TaskRecord]:
    """Reads `path` (.jsonl / .json lines, or .parquet) into TaskRecords."""
    return list(iter_tasks(path, shape, limit))


def iter_tasks(path: str | Path, shape: str = "auto", limit: int | None = None) -> Iterator[TaskRecord]:
    if shape not in SHAPES:
        raise ValueError(f"dataset shape must be one of {SHAPES}, got {shape!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    for count, (where, row) in enumerate(rows):
        if limit is not None and count >= limit:
            return
        try:
            yield convert_record(row, shape)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path} {where}: {exc}") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {line_number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_number}: a record must be a JSON object")
            yield f"line {line_number}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs the 'pyarrow' package (pip install pyarrow); JSONL needs nothing"
        ) from None
    table = pq.read_table(path)
    for row_number, row in enumerate(table.to_pylist()):
        yield f"row {row_number}", row


def convert_record(row: dict[str, Any], shape: str = "auto") -> TaskRecord:
    """One raw record into a TaskRecord; ValueError names the missing or malformed field."""
    if shape == "auto":
        shape = detect_shape(row)
    return _CONVERTERS[shape](row)


def detect_shape(row: dict[str, Any]) -> str:
    if "task_type" in row:
        return "libra"
    if "problem_statement" in row:
        return "r2e_gym"
    if "golden_answers" in row or "question" in row:
        return "search_r1"
    if "reward_model" in row:
        return "dapo_math"
    raise ValueError(f"cannot tell the record's shape from its fields {sorted(row)}; pass shape=")


def _require(row: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in row:
        raise ValueError(f"missing field '{name}'")
    if not isinstance(row[name], kind):
        raise ValueError(f"field '{name}' must be {kind}, got {type(row[name]).__name__}")
    return row[name]


def _from_libra(row: dict[str, Any]) -> TaskRecord:
    prompt = _require(row, "prompt", str)
    truth = _require(row, "ground_truth", (str, list))
    try:
        task_type = TaskType(_require(row, "task_type", str))
    except ValueError:
        raise ValueError(
            f"field 'task_type' must be one of {[t.value for t in TaskType]}, got {row['task_type']!r}"
        ) from None
    metadata = row.get("metadata") or {}
    return TaskRecord(prompt, truth if isinstance(truth, str) else tuple(truth), task_type, dict(metadata))


def _chat_prompt(messages: Any) -> str:
    """The user content of a chat-format prompt (DAPO and Search-R1 store [{"role","content"}])."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'prompt' must be a string or a non-empty list of chat messages")
    user = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not user or not isinstance(user[-1], str):
        raise ValueError("field 'prompt' has no user message with string content")
    return user[-1]


def _from_dapo_math(row: dict[str, Any]) -> TaskRecord:
    reward_model = _require(row, "reward_model", dict)
    truth = reward_model.get("ground_truth")
    if not isinstance(truth, (str, int, float)) or isinstance(truth, bool):
        raise ValueError("field 'reward_model.ground_truth' must be a string or a number")
    metadata = {"data_source": row.get("data_source", "math_dapo"), **(row.get("extra_info") or {})}
    return TaskRecord(_chat_prompt(row.get("prompt")), str(truth), TaskType.MATH, metadata)


def _from_search_r1(row: dict[str, Any]) -> TaskRecord:
    question = _require(row, "question", str)
    answers = row.get("golden_answers")
    if answers is None:
        answers = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError("field 'golden_answers' must be a non-empty list of strings")
    metadata = {"data_source": row.get("data_source", "search_r1"), "id": str(row.get("id", ""))}
    prompt = _chat_prompt(row["prompt"]) if "prompt" in row else question
    return TaskRecord(prompt, tuple(answers), TaskType.RETRIEVAL_QA, metadata)


def _from_r2e_gym(row: dict[str, Any]) -> TaskRecord:
    statement = _require(row, "problem_statement", str)
    tests = _require(row, "tests", str)
    if not tests.strip():
        raise ValueError("field 'tests' must hold Python test code")
    metadata = {key: row[key] for key in ("repo_name", "setup_code", "instance_id") if key in row}
    return TaskRecord(statement, tests, TaskType.CODE, metadata)


_CONVERTERS = {
    "libra": _from_libra,
    "dapo_math": _from_dapo_math,
    "search_r1": _from_search_r1,
    "r2e_gym": _from_r2e_gym,
}
