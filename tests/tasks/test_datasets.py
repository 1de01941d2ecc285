"""Dataset loading in the DAPO-Math, Search-R1, R2E-Gym and Libra shapes, and its errors."""

from __future__ import annotations

import json

import pytest

from libra.tasks.datasets import TaskRecord, TaskType, load_tasks

DAPO = {
    "data_source": "math_dapo",
    "ability": "MATH",
    "prompt": [{"role": "user", "content": "Find x if 2x = 68. Answer: $Answer"}],
    "reward_model": {"ground_truth": "34", "style": "rule-lean"},
    "extra_info": {"index": "a1"},
}
SEARCH_R1 = {
    "id": "train_0",
    "question": "who wrote hamlet?",
    "golden_answers": ["Shakespeare", "W. Shakespeare"],
    "data_source": "nq",
}
SEARCH_R1_VERL = {
    "question": "q?",
    "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q?"}],
    "reward_model": {"ground_truth": {"target": ["x"]}},
}
R2E = {"repo_name": "toy", "problem_statement": "add() returns a - b", "tests": "assert add(1, 2) == 3"}
LIBRA = {"prompt": "2+2?", "ground_truth": "4", "task_type": "math", "metadata": {"level": 1}}


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


def test_all_shapes_load(tmp_path):
    records = load_tasks(write_jsonl(tmp_path / "mixed.jsonl", [DAPO, SEARCH_R1, SEARCH_R1_VERL, R2E, LIBRA]))
    dapo, search, search_verl, r2e, libra = records
    assert dapo == TaskRecord(
        "Find x if 2x = 68. Answer: $Answer", "34", TaskType.MATH, {"data_source": "math_dapo", "index": "a1"}
    )
    assert search.prompt == "who wrote hamlet?" and search.answers == ("Shakespeare", "W. Shakespeare")
    assert search.task_type == TaskType.RETRIEVAL_QA and search.metadata["id"] == "train_0"
    assert search_verl.prompt == "Q?" and search_verl.answers == ("x",)
    assert r2e.task_type == TaskType.CODE and r2e.ground_truth == "assert add(1, 2) == 3"
    assert r2e.metadata == {"repo_name": "toy"}
    assert libra.metadata == {"level": 1} and libra.answers == ("4",)
    assert len(load_tasks(tmp_path / "mixed.jsonl", limit=2)) == 2


@pytest.mark.parametrize(
    "rows, shape, message",
    [
        ([LIBRA, "{not json"], "auto", "line 2: not valid JSON"),
        ([LIBRA, {**LIBRA, "task_type": "poetry"}], "auto", "line 2: field 'task_type' must be one of"),
        ([{**LIBRA, "prompt": "  "}], "auto", "line 1: TaskRecord.prompt must be a non-empty string"),
        ([{"reward_model": {}}], "auto", "line 1: field 'reward_model.ground_truth'"),
        ([{"question": "q", "golden_answers": []}], "auto", "line 1: field 'golden_answers'"),
        ([{"problem_statement": "p"}], "auto", "line 1: missing field 'tests'"),
        ([{"foo": 1}], "auto", "line 1: cannot tell the record's shape"),
        ([DAPO], "search_r1", "line 1: missing field 'question'"),
        (["[1, 2]"], "auto", "line 1: a record must be a JSON object"),
    ],
)
def test_bad_records_name_their_line(tmp_path, rows, shape, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message) as info:
        load_tasks(path, shape=shape)
    assert "bad.jsonl" in str(info.value)


def test_missing_file_shape_and_parquet_dependency(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="shape"):
        load_tasks(write_jsonl(tmp_path / "a.jsonl", [LIBRA]), shape="gsm8k")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pyarrow"):
            load_tasks(tmp_path / "d.parquet")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([DAPO]), tmp_path / "d.parquet")
        assert load_tasks(tmp_path / "d.parquet")[0].ground_truth == "34"


def test_tasks_config_validation():
    from libra.tasks.config import TasksConfig

    assert TasksConfig().procedural_family == "mixed"
    for field, value in [
        ("dataset_shape", "csv"),
        ("procedural_family", "go"),
        ("procedural_num_tasks", 0),
        ("procedural_distribution", "flat"),
        ("qa_metric", "bleu"),
        ("max_records", 0),
    ]:
        with pytest.raises(ValueError, match=f"tasks.{field}"):
            TasksConfig(**{field: value})
