"""The trace format: what one trajectory did, turn by turn, as the simulator replays it.

This is the contract between real runs and the simulator: the job writes it (`libra.job`), the
simulator reads and generates it (`libra.sim`), so it sits beside `libra.trajectory`, below both.
A JSONL file holds one `TrajectoryTrace` per line:

    {"trajectory_id": "t0", "prompt_id": "p0", "group_id": "g0", "prompt_tokens": 812,
     "turns": [{"output_tokens": 950, "tool": "r2e_issue_validator", "payload_tokens": 3100,
                "status": "failure", "tool_latency_s": 6.2}, ...,
               {"output_tokens": 120}]}

Every turn but the last ends in a tool call (tool, payload size, status, latency); the last turn
ends the trajectory and has no tool fields. `trace_from_trajectory` derives a trace from a real
`libra.trajectory.Trajectory` plus the per-turn timing the agent loop measured, so the end-to-end
job records traces in exactly this format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from libra.trajectory import ToolStatus, Trajectory

_STATUS_NAMES = {s.name.lower(): s for s in ToolStatus}


@dataclass(frozen=True, slots=True)
class TurnTrace:
    """One model turn and the tool call that ended it (none for the final turn)."""

    output_tokens: int
    """Tokens the model generated in this turn."""
    tool: str = ""
    """Tool type called at the end of the turn; empty for the final turn."""
    payload_tokens: int = 0
    """Tokens of the tool result appended to the context."""
    status: ToolStatus = ToolStatus.SUCCESS
    tool_latency_s: float = 0.0
    """Wall time of the tool call."""

    @property
    def has_tool(self) -> bool:
        return bool(self.tool)


@dataclass(frozen=True)
class TrajectoryTrace:
    trajectory_id: str
    prompt_id: str
    group_id: str
    prompt_tokens: int
    turns: tuple[TurnTrace, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        _validate(self, where=f"trajectory {self.trajectory_id!r}")

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def payload_tokens(self) -> int:
        return sum(t.payload_tokens for t in self.turns)

    @property
    def total_tokens(self) -> int:
        """The final context: prompt, every turn's output and every tool result."""
        return self.prompt_tokens + self.output_tokens + self.payload_tokens

    @property
    def tool_time_s(self) -> float:
        return sum(t.tool_latency_s for t in self.turns)


def _validate(trace: TrajectoryTrace, where: str) -> None:
    if not trace.trajectory_id or not trace.prompt_id or not trace.group_id:
        raise ValueError(f"{where}: trajectory_id, prompt_id and group_id must be non-empty")
    if trace.prompt_tokens < 1:
        raise ValueError(f"{where}: prompt_tokens must be >= 1, got {trace.prompt_tokens}")
    if not trace.turns:
        raise ValueError(f"{where}: turns must hold at least one turn")
    last = len(trace.turns) - 1
    for i, turn in enumerate(trace.turns):
        at = f"{where}, turns[{i}]"
        if turn.output_tokens < 1:
            raise ValueError(f"{at}: output_tokens must be >= 1, got {turn.output_tokens}")
        if i < last and not turn.has_tool:
            raise ValueError(f"{at}: every turn but the last must end in a tool call (tool is empty)")
        if i == last and turn.has_tool:
            raise ValueError(f"{at}: the last turn ends the trajectory and must not name a tool")
        if turn.payload_tokens < 0 or (turn.has_tool and turn.payload_tokens < 1):
            raise ValueError(
                f"{at}: payload_tokens must be >= 1 after a tool call, got {turn.payload_tokens}"
            )
        if turn.tool_latency_s < 0:
            raise ValueError(f"{at}: tool_latency_s must be >= 0, got {turn.tool_latency_s}")


# JSONL.


def trace_to_dict(trace: TrajectoryTrace) -> dict:
    turns = []
    for turn in trace.turns:
        row: dict = {"output_tokens": turn.output_tokens}
        if turn.has_tool:
            row.update(
                tool=turn.tool,
                payload_tokens=turn.payload_tokens,
                status=turn.status.name.lower(),
                tool_latency_s=turn.tool_latency_s,
            )
        turns.append(row)
    return {
        "trajectory_id": trace.trajectory_id,
        "prompt_id": trace.prompt_id,
        "group_id": trace.group_id,
        "prompt_tokens": trace.prompt_tokens,
        "turns": turns,
    }


def trace_from_dict(row: object, where: str = "trace") -> TrajectoryTrace:
    """Parses one JSON object; ValueError names the field that is missing or malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name, kind in (("trajectory_id", str), ("prompt_id", str), ("group_id", str), ("prompt_tokens", int)):
        if name not in row:
            raise ValueError(f"{where}: missing field {name!r}")
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {row[name]!r}")
    if not isinstance(row.get("turns"), list):
        raise ValueError(f"{where}: field 'turns' must be a list")
    turns = [_turn_from_dict(t, f"{where}, turns[{i}]") for i, t in enumerate(row["turns"])]
    unknown = set(row) - {"trajectory_id", "prompt_id", "group_id", "prompt_tokens", "turns"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    try:
        return TrajectoryTrace(
            row["trajectory_id"], row["prompt_id"], row["group_id"], row["prompt_tokens"], turns
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _turn_from_dict(row: object, where: str) -> TurnTrace:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = set(row) - {"output_tokens", "tool", "payload_tokens", "status", "tool_latency_s"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    output = row.get("output_tokens")
    if not isinstance(output, int) or isinstance(output, bool):
        raise ValueError(f"{where}: field 'output_tokens' must be int, got {output!r}")
    tool = row.get("tool", "")
    if not isinstance(tool, str):
        raise ValueError(f"{where}: field 'tool' must be str, got {tool!r}")
    payload = row.get("payload_tokens", 0)
    if not isinstance(payload, int) or isinstance(payload, bool):
        raise ValueError(f"{where}: field 'payload_tokens' must be int, got {payload!r}")
    status_name = row.get("status", "success")
    if status_name not in _STATUS_NAMES:
        raise ValueError(
            f"{where}: field 'status' must be one of {sorted(_STATUS_NAMES)}, got {status_name!r}"
        )
    latency = row.get("tool_latency_s", 0.0)
    if not isinstance(latency, int | float) or isinstance(latency, bool):
        raise ValueError(f"{where}: field 'tool_latency_s' must be a number, got {latency!r}")
    return TurnTrace(output, tool, payload, _STATUS_NAMES[status_name], float(latency))


def write_traces(path: str | Path, traces: Iterable[TrajectoryTrace]) -> int:
    """Writes one JSON object per line; returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for trace in traces:
            f.write(json.dumps(trace_to_dict(trace), separators=(",", ":")) + "\n")
            count += 1
    return count


def read_traces(path: str | Path, last: int | None = None) -> list[TrajectoryTrace]:
    """Reads a JSONL trace file, or only its `last` traces (read from the end: a long run's file
    is gigabytes); ValueError names the line and field at fault."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no trace file at {path}")
    if last is not None:
        lines = _last_lines(path, last)
        return [
            _parse_line(line, f"{path}: line {len(lines) - i} from the end") for i, line in enumerate(lines)
        ]
    with open(path, encoding="utf-8") as f:
        return [_parse_line(line, f"{path}:{n}") for n, line in enumerate(f, start=1) if line.strip()]


def _parse_line(line: str, where: str) -> TrajectoryTrace:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    return trace_from_dict(row, where)


def _last_lines(path: Path, count: int, block_bytes: int = 1 << 20) -> list[str]:
    """The file's last `count` non-blank lines, in order, reading blocks back from its end."""
    if count < 0:
        raise ValueError(f"last must be >= 0, got {count}")

    def whole_lines(blocks: list[bytes], at_start: bool) -> list[bytes]:
        pieces = b"".join(reversed(blocks)).split(b"\n")
        # Before the file's start is reached, the first piece may be a line cut by the block.
        return [line for line in (pieces if at_start else pieces[1:]) if line.strip()]

    with open(path, "rb") as f:
        position, blocks, newlines = f.seek(0, 2), [], 0
        # Split only once enough newlines for `count` lines were read (blank ones aside).
        while position > 0 and not (newlines > count and len(whole_lines(blocks, False)) >= count):
            step = min(block_bytes, position)
            position -= step
            f.seek(position)
            blocks.append(f.read(step))
            newlines += blocks[-1].count(b"\n")
    lines = whole_lines(blocks, position == 0)
    return [line.decode("utf-8") for line in lines[max(0, len(lines) - count) :]] if count else []


# From a real trajectory.


@dataclass(frozen=True)
class TurnTiming:
    """What the agent loop measured around one tool call (the model's own time is not part of
    the trace: the simulator recomputes it from the cost model)."""

    tool_latency_s: float


def trace_from_trajectory(traj: Trajectory, timings: Sequence[TurnTiming]) -> TrajectoryTrace:
    """The trace of a finished trajectory. Turn boundaries come from `traj.tool_returns`
    (`response_tokens_before` counts model tokens before each tool return); `timings[i]` is the
    measured latency of tool call i."""
    if traj.outcome.value == "running":
        raise ValueError(f"trajectory {traj.trajectory_id!r} is still running")
    if len(timings) != len(traj.tool_returns):
        raise ValueError(
            f"trajectory {traj.trajectory_id!r}: {len(traj.tool_returns)} tool returns "
            f"but {len(timings)} timings"
        )
    generated = traj.num_generated_tokens
    turns, before = [], 0
    for i, (ret, timing) in enumerate(zip(traj.tool_returns, timings, strict=True)):
        output = ret.response_tokens_before - before
        if output < 1:
            raise ValueError(
                f"trajectory {traj.trajectory_id!r}, tool_returns[{i}]: response_tokens_before "
                f"{ret.response_tokens_before} does not grow (previous {before})"
            )
        turns.append(
            TurnTrace(output, ret.tool, max(1, ret.payload_tokens), ret.status, timing.tool_latency_s)
        )
        before = ret.response_tokens_before
    # The final turn: whatever the model generated after the last tool return (at least one
    # token -- a trajectory cut right after a tool return still had to be asked for one).
    turns.append(TurnTrace(max(1, generated - before)))
    return TrajectoryTrace(
        traj.trajectory_id, traj.prompt_id, traj.group_id, max(1, len(traj.prompt_token_ids)), tuple(turns)
    )
