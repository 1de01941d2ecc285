import numpy as np
import pytest

from libra.sim.workloads import WORKLOADS, WorkloadConfig, WorkloadGenerator


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
