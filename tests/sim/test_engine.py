"""The event engine and the instance model against hand calculations from the cost model."""

import pytest

from libra.planner.config import PlannerConfig
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.scheduler.baselines import LeastLoadRouter
from libra.scheduler.config import CmlfqConfig
from libra.sim.engine import RolloutCluster
from libra.sim.instance import DecodeCoefficients
from tests.sim.helpers import tiny_config, trace


def make_cluster(num_instances=1, tp=1):
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig()
    cluster = RolloutCluster(LeastLoadRouter(cmlfq), cmlfq, cost, max_batch=256)
    for i in range(num_instances):
        cluster.add_instance(f"i{i}", tp, 0, tuple(range(i * tp, (i + 1) * tp)), ready_at=0.0)
    return cluster, cost


def step(cost, batch, kv_tokens, tp=1):
    return cost.decode_step(tp, batch, kv_tokens / batch).seconds(cost.factors)


def prefill(cost, tokens, tp=1):
    return cost.prefill(tp, tokens).seconds(cost.factors)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_decode_coefficients_match_cost_model(tp):
    _, cost = make_cluster()
    coeff = DecodeCoefficients.of(cost, tp)
    for batch, kv in [(1, 100.0), (7, 20_000.0), (64, 900_000.0)]:
        assert coeff.step_s(batch, kv) == pytest.approx(step(cost, batch, kv, tp), rel=1e-9)


def test_single_turn_time():
    cluster, cost = make_cluster()
    finished = []
    cluster.on_finish = finished.append
    cluster.start(trace("a", [100], prompt=10))
    cluster.run_until(lambda: False)
    expected = prefill(cost, 10) + 100 * step(cost, 1, 10)
    assert finished[0].finished_at == pytest.approx(expected, rel=1e-9)


def test_two_sequences_share_the_batch_then_one_runs_alone():
    cluster, cost = make_cluster()
    done = {}
    cluster.on_finish = lambda t: done.__setitem__(t.trajectory_id, t.finished_at)
    cluster.start(trace("long", [100], prompt=10))
    cluster.start(trace("short", [50], prompt=30))
    cluster.run_until(lambda: False)
    t_short = prefill(cost, 10) + prefill(cost, 30) + 50 * step(cost, 2, 40)
    t_long = t_short + 50 * step(cost, 1, 10 + 50)
    assert done["short"] == pytest.approx(t_short, rel=1e-9)
    assert done["long"] == pytest.approx(t_long, rel=1e-9)


def test_tool_call_and_cached_prefix():
    cluster, cost = make_cluster()
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [40, 60], prompt=10, tool_latency=2.0, payload=20))
    cluster.run_until(lambda: False)
    first = prefill(cost, 10) + 40 * step(cost, 1, 10)
    # Same instance: only the tool result is prefilled; the context is prompt + turn 1 + result.
    second = 2.0 + prefill(cost, 20) + 60 * step(cost, 1, 10 + 40 + 20)
    assert done[0].finished_at == pytest.approx(first + second, rel=1e-9)
    assert cluster.num_migrations == 0 and cluster.num_turns == 2


def test_events_in_time_order_and_every_trajectory_finishes_once():
    cluster, _ = make_cluster(num_instances=3)
    seen, times = [], []
    original = cluster.schedule

    def recording(time, callback, *args):
        def wrapped(*a):
            times.append(cluster.now)
            callback(*a)

        original(time, wrapped, *args)

    cluster.schedule = recording
    cluster.on_finish = lambda t: seen.append(t.trajectory_id)
    ids = [f"t{i}" for i in range(30)]
    for i, tid in enumerate(ids):
        cluster.start(trace(tid, [10 + 7 * i, 5 + i, 30], prompt=20 + i, tool_latency=0.1 * (i % 5)))
    cluster.run_until(lambda: False)
    assert times == sorted(times)
    assert sorted(seen) == sorted(ids)
    assert not cluster.live and cluster.num_turns == 90
    # Device time adds up: every decoded token is accounted for.
    decoded = sum(i.decoded_tokens for i in cluster.all_instances())
    assert decoded == pytest.approx(sum(10 + 7 * i + 5 + i + 30 for i in range(30)), rel=1e-6)


def test_removing_an_instance_cuts_and_resumes_turns():
    cluster, cost = make_cluster(num_instances=2)
    done = []
    cluster.on_finish = done.append
    for i in range(4):
        cluster.start(trace(f"t{i}", [200], prompt=10))
    cluster.schedule(0.05, cluster.remove_instance, 0)
    cluster.run_until(lambda: False)
    assert sorted(t.trajectory_id for t in done) == ["t0", "t1", "t2", "t3"]
    assert cluster.num_migrations >= 1  # the cut ones re-prefilled on instance 1
    assert sum(i.decoded_tokens for i in cluster.all_instances()) == pytest.approx(800, rel=1e-6)
