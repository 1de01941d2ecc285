import numpy as np
import pytest

from libra.sim.workloads import WORKLOADS, ReplayedGroups, WorkloadConfig, WorkloadGenerator
from libra.trace import TrajectoryTrace, TurnTrace


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_limits_and_determinism(name):
    gen = WorkloadGenerator(WorkloadConfig(name=name, seed=3))
    spec = WORKLOADS[name]
    forward = [gen.group(i, 0.3) for i in range(200)]
    backward = [gen.group(i, 0.3) for i in reversed(range(200))][::-1]
    assert forward == backward  # a group depends on its index only, not on the order asked
    for group in forward:
        assert len({t.prompt_id for t in group}) == 1
        for t in group:
            assert len(t.turns) <= spec.max_turns
            assert t.output_tokens <= spec.max_new_tokens
            assert t.total_tokens < spec.context_limit
    outputs = np.array([t.output_tokens for g in forward for t in g])
    # A long tail: the longest tenth carries well above a tenth of the tokens.
    assert np.sort(outputs)[-len(outputs) // 10 :].sum() > 0.15 * outputs.sum()


def test_drift_lengthens_trajectories():
    gen = WorkloadGenerator(WorkloadConfig(name="r2e", length_drift=0.5))
    early = np.mean([t.output_tokens for i in range(300) for t in gen.group(i, 0.0)])
    late = np.mean([t.output_tokens for i in range(300) for t in gen.group(i, 1.0)])
    assert late > 1.2 * early


def _trace(group: str, j: int) -> TrajectoryTrace:
    return TrajectoryTrace(f"{group}-{j}", "p", group, 10, (TurnTrace(5),))


def test_replayed_groups_come_in_their_order_and_each_lap_is_renamed():
    traces = [_trace(g, j) for g in ("g10", "g2", "g1") for j in range(2)]
    replay = ReplayedGroups.of_traces(traces)
    # By the number the id carries, not as strings ("g10" < "g2").
    assert [group[0].group_id for group in replay.groups] == ["g1", "g2", "g10"]
    assert replay.group(1) == [_trace("g2", 0), _trace("g2", 1)]
    second_lap = replay.group(4)
    assert [t.trajectory_id for t in second_lap] == ["g2-0~1", "g2-1~1"]
    assert {t.group_id for t in second_lap} == {"g2~1"}
    assert second_lap[0].turns == replay.group(1)[0].turns
    with pytest.raises(ValueError, match="no finished group"):
        ReplayedGroups([[], []])
