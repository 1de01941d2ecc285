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
