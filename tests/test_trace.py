import json

import pytest

from libra.sim.workloads import WorkloadConfig, WorkloadGenerator
from libra.trace import (
    TrajectoryTrace,
    TurnTiming,
    TurnTrace,
    read_traces,
    trace_from_trajectory,
    write_traces,
)
from libra.trajectory import Outcome, ToolReturn, ToolStatus, Trajectory


def test_jsonl_round_trip(tmp_path):
    traces = WorkloadGenerator(WorkloadConfig(name="search_r1", group_size=3)).group(7, 0.5)
    path = tmp_path / "t.jsonl"
    assert write_traces(path, traces) == 3
    assert read_traces(path) == traces


@pytest.mark.parametrize("block_bytes", [7, 64, 1 << 20])
def test_the_last_traces_are_read_from_the_end(tmp_path, block_bytes, monkeypatch):
    import libra.trace as trace_module

    generator = WorkloadGenerator(WorkloadConfig(name="search_r1", group_size=3))
    traces = [t for i in range(5) for t in generator.group(i, 0.5)]
    path = tmp_path / "t.jsonl"
    write_traces(path, traces)
    path.write_text(path.read_text().replace("\n", "\n\n", 3))  # blank lines are skipped
    real = trace_module._last_lines
    monkeypatch.setattr(trace_module, "_last_lines", lambda p, n: real(p, n, block_bytes))
    for last in (0, 1, 4, len(traces), len(traces) + 10):
        assert read_traces(path, last=last) == traces[len(traces) - min(last, len(traces)) :]
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="line 1 from the end: not valid JSON"):
        read_traces(path, last=2)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"prompt_id": "p", "group_id": "g", "prompt_tokens": 3, "turns": [{"output_tokens": 1}]},
            "trajectory_id",
        ),
        (
            {
                "trajectory_id": "t",
                "prompt_id": "p",
                "group_id": "g",
                "prompt_tokens": 3,
                "turns": [
                    {"output_tokens": 1, "tool": "x", "payload_tokens": 2, "status": "boom"},
                    {"output_tokens": 1},
                ],
            },
            "turns[0]: field 'status'",
        ),
        (
            {
                "trajectory_id": "t",
                "prompt_id": "p",
                "group_id": "g",
                "prompt_tokens": 3,
                "turns": [{"output_tokens": 1}, {"output_tokens": 1}],
            },
            "turns[0]: every turn but the last",
        ),
        (
            {
                "trajectory_id": "t",
                "prompt_id": "p",
                "group_id": "g",
                "prompt_tokens": 3,
                "turns": [{"output_tokens": 0}],
            },
            "output_tokens must be >= 1",
        ),
    ],
)
def test_read_names_line_and_field(tmp_path, row, message):
    good = {
        "trajectory_id": "ok",
        "prompt_id": "p",
        "group_id": "g",
        "prompt_tokens": 3,
        "turns": [{"output_tokens": 1}],
    }
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2\b") as err:
        read_traces(path)
    assert message in str(err.value)


def test_trace_from_trajectory():
    traj = Trajectory("t1", "p1", "g1", prompt_token_ids=[1, 2, 3, 4])
    traj.append([5, 6, 7], [-0.1] * 3, policy_version=0)
    traj.tool_returns.append(
        ToolReturn("python", ToolStatus.TIMEOUT, payload_tokens=2, response_tokens_before=3)
    )
    traj.append([8, 9], None, policy_version=0)
    traj.append([10, 11, 12, 13, 14], [-0.2] * 5, policy_version=1)
    traj.outcome = Outcome.ANSWERED
    trace = trace_from_trajectory(traj, [TurnTiming(2.5)])
    assert trace == TrajectoryTrace(
        "t1",
        "p1",
        "g1",
        4,
        (TurnTrace(3, "python", 2, ToolStatus.TIMEOUT, 2.5), TurnTrace(5)),
    )
    with pytest.raises(ValueError, match="1 tool returns but 0 timings"):
        trace_from_trajectory(traj, [])
