"""Dataset loading: JSONL, parquet, arrow and Hugging Face `datasets` folders into typed `TaskRecord`s.

Where records come from (`load_tasks(path)`):
  - a `.jsonl` / `.json` lines file: read line by line, nothing to install;
  - a `.parquet` file: read with pyarrow;
  - a `.arrow` file, or a folder, through the Hugging Face `datasets` library
    (`pip install 'libra-rl[data]'`): a folder written by `Dataset.save_to_disk` (it holds
    `state.json` / `dataset_info.json`, or `dataset_dict.json` for a DatasetDict, whose `train` split
    -- or only split -- is read), else the folder's data files of one format (.parquet, .jsonl /
    .json, .arrow), every one of them read as training records.
Columnar sources give every record every column, None where the record lacks it; those Nones are
dropped, so a record reads the same from any source.

Accepted record shapes (detected per record, or forced with `shape=`):
  - `libra`:     {"prompt": str, "ground_truth": str | [str], "task_type": str, "metadata"?: {}}
  - `dapo_math`: DAPO-Math-17k — {"prompt": [{"role", "content"}...], "reward_model":
                 {"ground_truth": str}, "data_source"?, "extra_info"?}; always math, the prompt is
                 the last user message.
  - `verl`:      verl's RL records — {"prompt": [{"role", "content"}...] | str, "reward_model":
                 {"ground_truth": str | number | [str] | {"target": str | [str]}}, "data_source"?,
                 "extra_info"?}. The whole chat (system, user and assistant turns) is kept in
                 `TaskRecord.messages`; the task type is `extra_info.task_type` when set, else looked
                 up from `data_source` in `VERL_TASK_TYPES` (exact names, then prefixes), else math.
                 verl's stdin/stdout code sources (`VERL_UNSUPPORTED_SOURCES`) are refused: libra's
                 code reward runs Python asserts.
  - `search_r1`: Search-R1 (NQ / HotpotQA) — {"question": str, "golden_answers": [str], "id"?,
                 "data_source"?} (or `reward_model.ground_truth.target`)
  - `r2e_gym`:   R2E-Gym-style issue + tests, runnable in our sandbox — {"problem_statement": str,
                 "tests": str (Python asserting the fix), "repo_name"?, "setup_code"?}
Detection, first match wins: `task_type` -> libra; `problem_statement` -> r2e_gym; `golden_answers`
or `question` -> search_r1; `reward_model` -> dapo_math when the record looks like DAPO-Math-17k's
(data_source `math_dapo` or none, and no chat turn but user ones, so nothing is lost), else verl.
A bad record raises ValueError naming the file, the line (JSONL) or row (parquet, arrow, folders) and
the field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
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


CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TaskRecord:
    prompt: str
    """The user turn shown to the model: with a chat prompt, its last user message (rewards and
    reports read this one)."""
    ground_truth: str | tuple[str, ...]
    """The answer (math, procedural), the accepted answers (retrieval QA) or the tests (code)."""
    task_type: TaskType
    metadata: dict[str, Any] = field(default_factory=dict)
    """Source, ids and anything else a reward or a report needs; never shown to the model."""
    messages: tuple[dict[str, str], ...] | None = None
    """The record's whole chat prompt ({"role", "content"} turns, system and earlier turns included)
    when it had one; None: `prompt` alone is the chat."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("TaskRecord.prompt must be a non-empty string")
        answers = (self.ground_truth,) if isinstance(self.ground_truth, str) else self.ground_truth
        if not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError("TaskRecord.ground_truth must be a string or a non-empty tuple of strings")
        if self.messages is not None:
            _check_chat(self.messages, "TaskRecord.messages")
            # Rewards and reports read `prompt`: it must be the question the model was asked.
            if _last_user_content(self.messages) != self.prompt:
                raise ValueError("TaskRecord.prompt must be the last user message of TaskRecord.messages")

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.ground_truth,) if isinstance(self.ground_truth, str) else self.ground_truth

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat the model is prompted with: the record's messages, else `prompt` as one user turn."""
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        # Copies: a caller appending turns or editing one must not change the record.
        return [dict(message) for message in self.messages]


def _check_chat(messages: Any, name: str) -> None:
    if not isinstance(messages, tuple) or not messages:
        raise ValueError(f"{name} must be a non-empty tuple of chat messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{name}: message {index} must be a {{'role', 'content'}} object")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"{name}: message {index} has role {message.get('role')!r}, not one of {CHAT_ROLES}"
            )
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{name}: message {index} must have string content")
    if not any(message["role"] == "user" for message in messages):
        raise ValueError(f"{name} has no user message")


def _last_user_content(messages: tuple[dict[str, str], ...]) -> str:
    return [message["content"] for message in messages if message["role"] == "user"][-1]


SHAPES = ("auto", "libra", "dapo_math", "verl", "search_r1", "r2e_gym")


def load_tasks(path: str | Path, shape: str = "auto", limit: int | None = None) -> list[TaskRecord]:
    """Reads `path` (a JSONL, parquet or arrow file, or a folder: see the module docstring) into
    TaskRecords."""
    return list(iter_tasks(path, shape, limit))


def iter_tasks(path: str | Path, shape: str = "auto", limit: int | None = None) -> Iterator[TaskRecord]:
    if shape not in SHAPES:
        raise ValueError(f"dataset shape must be one of {SHAPES}, got {shape!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    for count, (where, row) in enumerate(_rows(path)):
        if limit is not None and count >= limit:
            return
        try:
            yield convert_record(row, shape)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where}: {exc}") from None


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Each raw record with where it is (`<file> line 3`, `<file> row 7`) for error messages."""
    if path.is_dir() or path.suffix == ".arrow":
        return _datasets_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    return _jsonl_rows(path)


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
            yield f"{path} line {line_number}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs the 'pyarrow' package (pip install 'libra-rl[data]', or pyarrow alone); "
            "JSONL needs nothing"
        ) from None
    table = pq.read_table(path)
    for row_number, row in enumerate(table.to_pylist()):
        yield f"{path} row {row_number}", _drop_missing(row)


def _datasets_rows(path: Path) -> Iterator[tuple[str, dict]]:
    datasets = _import_datasets(path)
    for where, dataset in _datasets_parts(datasets, path):
        for row_number, row in enumerate(dataset):
            yield f"{where} row {row_number}", _drop_missing(row)


def _import_datasets(path: Path) -> ModuleType:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"reading {path} needs the Hugging Face 'datasets' package: pip install 'libra-rl[data]'"
        ) from None
    return datasets


SAVE_TO_DISK_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
"""Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write beside the data."""
DATASETS_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
"""The `datasets` builder reading each data file suffix."""


def _datasets_parts(datasets: ModuleType, path: Path) -> Iterator[tuple[str, Any]]:
    """(where, Dataset) pairs, loaded one at a time so that a `limit` met early spares the rest."""
    if path.is_dir() and any((path / marker).is_file() for marker in SAVE_TO_DISK_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = _train_split(loaded, path)
            yield f"{path} split {split!r}", loaded[split]
        else:
            yield str(path), loaded
        return
    builder, files = ("arrow", [path]) if path.is_file() else _folder_data_files(path)
    for file in files:
        yield str(file), datasets.load_dataset(builder, data_files=str(file), split="train")


def _train_split(splits: Any, path: Path) -> str:
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return next(iter(splits))
    raise ValueError(
        f"{path} holds the splits {sorted(splits)} and none is 'train': point the path at one split's "
        f"folder (e.g. {path / sorted(splits)[0]})"
    )


def _folder_data_files(path: Path) -> tuple[str, list[Path]]:
    files = sorted(
        file
        for file in path.iterdir()
        if file.is_file() and file.suffix in DATASETS_BUILDERS and not file.name.startswith(".")
    )
    if not files:
        raise ValueError(
            f"{path} is neither a save_to_disk folder (no {' / '.join(SAVE_TO_DISK_MARKERS)}) nor a folder "
            f"of data files ({', '.join(DATASETS_BUILDERS)})"
        )
    builders = {DATASETS_BUILDERS[file.suffix] for file in files}
    if len(builders) > 1:
        raise ValueError(f"{path} mixes data file formats {sorted(builders)}: keep one format per folder")
    return builders.pop(), files


def _drop_missing(value: Any) -> Any:
    """`value` without the None entries of its dicts, at any depth: a columnar source gives every
    record every column (struct fields included), None where the record lacks it."""
    if isinstance(value, dict):
        return {key: _drop_missing(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_missing(item) for item in value]
    return value


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
        return "dapo_math" if _looks_like_dapo_math(row) else "verl"
    raise ValueError(f"cannot tell the record's shape from its fields {sorted(row)}; pass shape=")


def _looks_like_dapo_math(row: dict[str, Any]) -> bool:
    """DAPO-Math-17k's own records, which `dapo_math` reads without loss: tagged `math_dapo` (or not
    tagged) and no chat turn but user ones."""
    prompt = row.get("prompt")
    only_user_turns = not isinstance(prompt, list) or all(
        isinstance(message, dict) and message.get("role") == "user" for message in prompt
    )
    return row.get("data_source", "math_dapo") == "math_dapo" and only_user_turns


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


VERL_TASK_TYPES: dict[str, TaskType] = {
    # The math sources of verl's rule-based rewards (`verl.utils.reward_score.default_compute_score`).
    "openai/gsm8k": TaskType.MATH,
    "lighteval/MATH": TaskType.MATH,
    "DigitalLearningGmbH/MATH-lighteval": TaskType.MATH,
    "HuggingFaceH4/MATH-500": TaskType.MATH,
    "math_dapo": TaskType.MATH,
    "math_dapo_reasoning": TaskType.MATH,
    "math": TaskType.MATH,
    # Search-R1's QA sets under their own names (verl's copies are `searchR1_*`, a prefix below).
    "nq": TaskType.RETRIEVAL_QA,
    "triviaqa": TaskType.RETRIEVAL_QA,
    "popqa": TaskType.RETRIEVAL_QA,
    "hotpotqa": TaskType.RETRIEVAL_QA,
    "2wikimultihopqa": TaskType.RETRIEVAL_QA,
    "musique": TaskType.RETRIEVAL_QA,
    "bamboogle": TaskType.RETRIEVAL_QA,
}
"""The task type of a verl record by its `data_source`, looked up before `VERL_TASK_TYPE_PREFIXES`."""
VERL_TASK_TYPE_PREFIXES: tuple[tuple[str, TaskType], ...] = (
    ("aime", TaskType.MATH),
    ("numina_", TaskType.MATH),
    ("searchR1_", TaskType.RETRIEVAL_QA),
)
VERL_UNSUPPORTED_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})
"""verl's code sources: their ground truth is stdin/stdout cases, which libra's code reward (Python
asserts run in the sandbox) cannot check, so reading them as math would score every answer 0."""


def _from_verl(row: dict[str, Any]) -> TaskRecord:
    reward_model = _require(row, "reward_model", dict)
    prompt = _require(row, "prompt", (str, list))
    messages = None if isinstance(prompt, str) else _chat_messages(prompt)
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"field 'extra_info' must be an object, got {type(extra_info).__name__}")
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise ValueError(f"field 'data_source' must be a string, got {type(data_source).__name__}")
    task_type = _verl_task_type(data_source, extra_info)
    truth = _verl_ground_truth(reward_model, task_type)
    metadata = {"data_source": data_source, **extra_info} if data_source is not None else dict(extra_info)
    text = prompt if messages is None else _last_user_content(messages)
    return TaskRecord(text, truth, task_type, metadata, messages)


def _chat_messages(prompt: list) -> tuple[dict[str, str], ...]:
    """The chat prompt as {"role", "content"} turns (other keys, such as a columnar source's empty
    `tool_calls`, are dropped: only these roles and string contents are accepted)."""
    if not all(isinstance(message, dict) for message in prompt):
        raise ValueError("field 'prompt' must be a string or a list of {'role', 'content'} messages")
    messages = tuple({"role": message.get("role"), "content": message.get("content")} for message in prompt)
    _check_chat(messages, "field 'prompt'")
    return messages


def _verl_task_type(data_source: str | None, extra_info: dict[str, Any]) -> TaskType:
    chosen = extra_info.get("task_type")
    if chosen is not None:
        try:
            return TaskType(chosen)
        except ValueError:
            raise ValueError(
                f"field 'extra_info.task_type' must be one of {[t.value for t in TaskType]}, got {chosen!r}"
            ) from None
    if data_source is None:
        return TaskType.MATH
    if data_source in VERL_UNSUPPORTED_SOURCES:
        raise ValueError(
            f"field 'data_source' is {data_source!r}, whose stdin/stdout tests libra's code reward cannot "
            "run (it runs Python asserts): convert the tests and set extra_info.task_type to 'code'"
        )
    if data_source in VERL_TASK_TYPES:
        return VERL_TASK_TYPES[data_source]
    for prefix, task_type in VERL_TASK_TYPE_PREFIXES:
        if data_source.startswith(prefix):
            return task_type
    return TaskType.MATH


def _verl_ground_truth(reward_model: dict[str, Any], task_type: TaskType) -> str | tuple[str, ...]:
    truth = reward_model.get("ground_truth")
    if isinstance(truth, dict):  # Search-R1 stores {"target": answers}
        truth = truth.get("target")
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if isinstance(truth, str):
        return truth
    if isinstance(truth, list) and truth and all(isinstance(answer, str) for answer in truth):
        # Only retrieval QA accepts any of several answers; the others read the first one alone.
        if task_type is not TaskType.RETRIEVAL_QA:
            raise ValueError(
                f"field 'reward_model.ground_truth' must be one answer for {task_type.value} tasks, "
                "got a list"
            )
        return tuple(truth)
    raise ValueError(
        "field 'reward_model.ground_truth' must be a string, a number, a non-empty list of strings "
        "or {'target': one of those}"
    )


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
    "verl": _from_verl,
    "search_r1": _from_search_r1,
    "r2e_gym": _from_r2e_gym,
}
