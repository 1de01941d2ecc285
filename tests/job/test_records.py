"""The run folder's records across a resume: a checkpoint keeps the record files' lengths, and a
resumed run moves what was recorded after it to `superseded/` (`rewind_records`)."""

from __future__ import annotations

import json

from libra.job.recorder import RECORD_FILES, RunRecorder, read_jsonl, rewind_records


def _row(recorder: RunRecorder, name: str, **row) -> None:
    recorder._write(name, row)


def test_rewind_moves_the_rows_after_the_checkpoint_aside(tmp_path):
    recorder = RunRecorder(tmp_path)
    _row(recorder, "metrics", step=1, time_s=1.0)
    _row(recorder, "samples", trajectory_id="g0-0")
    offsets = recorder.offsets()
    _row(recorder, "metrics", step=2, time_s=2.0)
    _row(recorder, "samples", trajectory_id="g1-0")
    _row(recorder, "samples", trajectory_id="g1-1")
    recorder.close()

    moved = rewind_records(tmp_path, offsets)

    assert moved == {"metrics": 1, "samples": 2}
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "time_s": 1.0}]
    assert [r["trajectory_id"] for r in read_jsonl(tmp_path / "samples.jsonl")] == ["g0-0"]
    assert [r["trajectory_id"] for r in read_jsonl(tmp_path / "superseded" / "samples.jsonl")] == [
        "g1-0",
        "g1-1",
    ]
    # The resumed recorder continues the clock of the kept metrics and appends after them.
    resumed = RunRecorder(tmp_path)
    assert 1.0 <= resumed.elapsed() < 60.0
    _row(resumed, "metrics", step=2, time_s=3.0)
    resumed.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_rewind_keeps_the_timeline_and_a_second_rewind_moves_nothing(tmp_path):
    recorder = RunRecorder(tmp_path)
    _row(recorder, "events", kind="started", time_s=5.0)
    _row(recorder, "evaluations", when="before")
    recorder.close()
    assert rewind_records(tmp_path, {}) == {"evaluations": 1}
    assert rewind_records(tmp_path, {}) == {}
    assert json.loads((tmp_path / "superseded" / "evaluations.jsonl").read_text())["when"] == "before"
    assert read_jsonl(tmp_path / "events.jsonl") == [{"kind": "started", "time_s": 5.0}]
    reopened = RunRecorder(tmp_path)
    assert reopened.offsets() == {name: 35 if name == "events" else 0 for name in RECORD_FILES}
    assert 5.0 <= reopened.elapsed() < 60.0  # the clock goes on from the timeline's last row
    reopened.close()
