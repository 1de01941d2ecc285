"""Dataset loading in the DAPO-Math, verl, Search-R1, R2E-Gym and Libra shapes, from JSONL, parquet,
arrow and Hugging Face `datasets` folders, and its errors."""

from __future__ import annotations

import json
import sys

import pytest

from libra.tasks.datasets import TaskRecord, TaskType, convert_record, load_tasks

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
VERL_CHAT = {
    "data_source": "openai/gsm8k",
    "prompt": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Tom has 3 apples and buys 4. How many?"},
    ],
    "ability": "math",
    "reward_model": {"ground_truth": "7", "style": "rule"},
    "extra_info": {"index": 0, "split": "train"},
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
        ([LIBRA], "verl", "line 1: missing field 'reward_model'"),
        (
            [{**VERL_CHAT, "prompt": [*VERL_CHAT["prompt"], {"role": "tool", "content": "7"}]}],
            "auto",
            "line 1: field 'prompt': message 2 has role 'tool'",
        ),
        ([{**VERL_CHAT, "prompt": VERL_CHAT["prompt"][:1]}], "auto", "line 1: field 'prompt' has no user"),
        (
            [{**VERL_CHAT, "prompt": [{"role": "user", "content": ["x"]}]}],
            "auto",
            "line 1: field 'prompt': message 0 must have string content",
        ),
        (
            [{**VERL_CHAT, "reward_model": {"style": "rule"}}],
            "auto",
            "line 1: field 'reward_model.ground_truth'",
        ),
        (
            [{**VERL_CHAT, "reward_model": {"ground_truth": ["7", "seven"]}}],
            "auto",
            "line 1: field 'reward_model.ground_truth' must be one answer for math tasks",
        ),
        (
            [{**VERL_CHAT, "extra_info": {"task_type": "poetry"}}],
            "auto",
            "line 1: field 'extra_info.task_type' must be one of",
        ),
        ([{**VERL_CHAT, "data_source": "apps"}], "auto", "line 1: field 'data_source' is 'apps'"),
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


def test_verl_records_keep_the_whole_chat(tmp_path):
    verl, dapo = load_tasks(write_jsonl(tmp_path / "verl.jsonl", [VERL_CHAT, DAPO]))
    assert verl == TaskRecord(
        "Tom has 3 apples and buys 4. How many?",
        "7",
        TaskType.MATH,
        {"data_source": "openai/gsm8k", "index": 0, "split": "train"},
        tuple(VERL_CHAT["prompt"]),
    )
    assert verl.chat_messages() == VERL_CHAT["prompt"]
    verl.chat_messages()[0]["content"] = "changed"
    assert verl.messages[0]["content"] == "Think step by step."
    # DAPO-Math-17k's records (a lone user turn) stay `dapo_math`: the prompt alone is the chat.
    assert dapo.messages is None
    assert dapo.chat_messages() == [{"role": "user", "content": "Find x if 2x = 68. Answer: $Answer"}]
    # ... unless the chat says more than the prompt: then it is read as verl, nothing dropped.
    system_dapo = {**DAPO, "prompt": [{"role": "system", "content": "Be brief."}, *DAPO["prompt"]]}
    assert load_tasks(write_jsonl(tmp_path / "dapo.jsonl", [system_dapo]))[0].messages == tuple(
        system_dapo["prompt"]
    )


@pytest.mark.parametrize(
    "data_source, ground_truth, extra_info, task_type, answers",
    [
        ("openai/gsm8k", "7", {}, TaskType.MATH, ("7",)),
        ("lighteval/MATH", "\\frac{1}{2}", {}, TaskType.MATH, ("\\frac{1}{2}",)),
        ("DigitalLearningGmbH/MATH-lighteval", 3, {}, TaskType.MATH, ("3",)),
        ("aime_2024", "204", {}, TaskType.MATH, ("204",)),
        (
            "searchR1_nq",
            {"target": ["Paris", "paris, france"]},
            {},
            TaskType.RETRIEVAL_QA,
            ("Paris", "paris, france"),
        ),
        ("hotpotqa", ["Yes"], {}, TaskType.RETRIEVAL_QA, ("Yes",)),
        ("my_own_set", "42", {}, TaskType.MATH, ("42",)),
        ("my_own_qa", ["x", "y"], {"task_type": "retrieval_qa"}, TaskType.RETRIEVAL_QA, ("x", "y")),
        ("apps", "assert f() == 1", {"task_type": "code"}, TaskType.CODE, ("assert f() == 1",)),
    ],
)
def test_verl_task_type_from_data_source(data_source, ground_truth, extra_info, task_type, answers):
    row = {**VERL_CHAT, "data_source": data_source, "reward_model": {"ground_truth": ground_truth}}
    record = convert_record({**row, "extra_info": extra_info}, shape="auto")
    assert (record.task_type, record.answers, record.metadata["data_source"]) == (
        task_type,
        answers,
        data_source,
    )


def test_task_record_messages_are_checked():
    user = {"role": "user", "content": "2+2?"}
    assert TaskRecord("2+2?", "4", TaskType.MATH).chat_messages() == [user]
    with pytest.raises(ValueError, match="last user message"):
        TaskRecord("3+3?", "6", TaskType.MATH, {}, (user,))
    with pytest.raises(ValueError, match="non-empty tuple"):
        TaskRecord("2+2?", "4", TaskType.MATH, {}, ())
    with pytest.raises(ValueError, match="role 'tool'"):
        TaskRecord("2+2?", "4", TaskType.MATH, {}, ({"role": "tool", "content": "4"}, user))


@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    """The `datasets` library, caching what it converts under the test's folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return datasets


# Rows sharing column types (as a columnar file needs) but not fields: the first and last lack
# `extra_info.split`, which columnar sources fill with None and the loader drops again.
COLUMNAR_ROWS = [
    {**DAPO, "extra_info": {"index": 7}},
    VERL_CHAT,
    {**VERL_CHAT, "data_source": "lighteval/MATH", "extra_info": {"index": 1}},
]


def test_datasets_sources_match_the_jsonl_reader(tmp_path, hf_datasets):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = load_tasks(write_jsonl(tmp_path / "plain.jsonl", COLUMNAR_ROWS))
    assert [r.messages is not None for r in expected] == [False, True, True]

    hf_datasets.Dataset.from_list(COLUMNAR_ROWS).save_to_disk(tmp_path / "saved")
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(COLUMNAR_ROWS[:2]), shards / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(COLUMNAR_ROWS[2:]), shards / "part-1.parquet")
    (shards / "README.md").write_text("not data")
    jsonl_folder = tmp_path / "jsonl_folder"
    jsonl_folder.mkdir()
    write_jsonl(jsonl_folder / "a.jsonl", COLUMNAR_ROWS[:1])
    write_jsonl(jsonl_folder / "b.jsonl", COLUMNAR_ROWS[1:])
    (arrow_file,) = (tmp_path / "saved").glob("*.arrow")

    for source in (tmp_path / "saved", shards, arrow_file, jsonl_folder):
        assert load_tasks(source) == expected, source
    # `max_records` reads across shards and stops there.
    assert load_tasks(shards, limit=2) == expected[:2]
    assert load_tasks(shards, limit=3) == expected


def test_datasets_bad_row_names_its_row_and_field(tmp_path, hf_datasets):
    rows = [VERL_CHAT, {**VERL_CHAT, "extra_info": {"index": 1, "task_type": "poetry"}}]
    hf_datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"saved row 1: field 'extra_info.task_type'"):
        load_tasks(tmp_path / "saved")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", rows)
    with pytest.raises(ValueError, match=r"a.jsonl row 1: field 'extra_info.task_type'"):
        load_tasks(shards)


def test_dataset_dict_split_choice(tmp_path, hf_datasets):
    train = hf_datasets.Dataset.from_list([VERL_CHAT])
    other = hf_datasets.Dataset.from_list([DAPO])
    hf_datasets.DatasetDict({"test": other, "train": train}).save_to_disk(tmp_path / "both")
    assert [r.metadata["data_source"] for r in load_tasks(tmp_path / "both")] == ["openai/gsm8k"]
    hf_datasets.DatasetDict({"validation": other}).save_to_disk(tmp_path / "only")
    assert [r.metadata["data_source"] for r in load_tasks(tmp_path / "only")] == ["math_dapo"]
    hf_datasets.DatasetDict({"test": other, "validation": train}).save_to_disk(tmp_path / "no_train")
    with pytest.raises(ValueError, match=r"splits \['test', 'validation'\] and none is 'train'"):
        load_tasks(tmp_path / "no_train")
    # A split's own folder is a save_to_disk folder too.
    assert load_tasks(tmp_path / "no_train" / "validation")[0].metadata["data_source"] == "openai/gsm8k"


def test_folder_errors_and_missing_datasets(tmp_path, hf_datasets, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty is neither a save_to_disk folder"):
        load_tasks(tmp_path / "empty")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", [DAPO])
    hf_datasets.Dataset.from_list([DAPO]).to_parquet(str(mixed / "b.parquet"))
    with pytest.raises(ValueError, match=r"mixes data file formats \['json', 'parquet'\]"):
        load_tasks(mixed)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'libra-rl\[data\]'"):
        load_tasks(mixed)


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
