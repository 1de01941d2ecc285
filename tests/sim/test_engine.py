"""The event engine and the instance model against hand calculations from the cost model."""

import pytest

from libra.planner.config import PlannerConfig
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.scheduler.baselines import LeastLoadRouter
from libra.scheduler.cmlfq import CmlfqRouter
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.scheduler.tool_state import ToolReturnState
from libra.sim.engine import RolloutCluster
from libra.sim.instance import DecodeCoefficients
from libra.trajectory import ToolStatus
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


def test_bucket_update_moves_a_running_turn_and_keeps_its_tokens():
    """A re-plan relabels buckets: the router moves a trajectory whose path now points to the
    other bucket; its turn in flight is cut on the old instance and resumes on the new one with
    the tokens it had, and it finishes exactly once."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(
        buckets=(BucketConfig("a", 1, 1000), BucketConfig("b", 2, 100000)), max_queue_length=100
    )
    router = CmlfqRouter(cmlfq)
    cluster = RolloutCluster(router, cmlfq, cost, max_batch=256)
    cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    cluster.add_instance("i1", 1, 1, (1,), ready_at=0.0)
    # Teach the router: after this tool return, 500 output tokens remain.
    state = ToolReturnState.of("tool", ToolStatus.FAILURE, 20, cmlfq)
    for n in range(3):
        router.admit(f"learned{n}", "p0")
        router.on_tool_return(f"learned{n}", state, 100)
        router.on_finish(f"learned{n}", 600)
    done = []
    cluster.on_finish = done.append
    traj = cluster.start(trace("a", [100, 500], prompt=10, tool_latency=0.5))
    second_turn_starts = prefill(cost, 10) + 100 * step(cost, 1, 10) + 0.5
    middle = second_turn_starts + 250 * step(cost, 1, 300)
    cluster.schedule(middle, lambda: None)  # an event to stop at, halfway through the turn
    cluster.run_until(lambda: cluster.now >= middle)
    assert traj.turn == 1 and traj.instance == 0  # 500 left <= 1,000: the small bucket
    # The new plan: bucket 0 up to 200 remaining tokens; instance 0 stays there.
    moved = cluster.update_buckets((BucketConfig("a", 1, 200), BucketConfig("b", 2, 100000)), {0: 0, 1: 1})
    assert moved == 1 and traj.instance == 1 and 0 < traj.carried < 500
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and cluster.num_migrations == 1


def _migrating_cluster(migration: str, second_devices: tuple[int, ...], bandwidth: float = 0.0):
    """i0 (TP-1, device 0) serves short paths, i1 (TP-2) long ones; the router has learnt that
    after the tool return 500 tokens remain, so turn 2 of a trajectory migrates to i1."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(
        buckets=(BucketConfig("a", 1, 100), BucketConfig("b", 2, 100000)), max_queue_length=100
    )
    router = CmlfqRouter(cmlfq)
    cluster = RolloutCluster(
        router, cmlfq, cost, max_batch=256, migration=migration, kv_move_bandwidth_bytes_per_s=bandwidth
    )
    cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    cluster.add_instance("i1", 2, 1, second_devices, ready_at=0.0)
    state = ToolReturnState.of("tool", ToolStatus.FAILURE, 20, cmlfq)
    for n in range(3):
        router.admit(f"learned{n}", "p0")
        router.on_tool_return(f"learned{n}", state, 100)
        router.on_finish(f"learned{n}", 600)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [100, 500], prompt=10, payload=20, tool_latency=0.5))
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and cluster.num_migrations == 1
    return cluster, cost, done[0].finished_at


@pytest.mark.parametrize("second_devices, link", [((4, 5), "inter"), ((2, 3), "intra")])
def test_kv_move_pays_the_transfer_instead_of_the_re_prefill(second_devices, link):
    reprefill, cost, t_reprefill = _migrating_cluster("reprefill", second_devices)
    moved, _, t_moved = _migrating_cluster("kv_move", second_devices)
    m, profile = cost.model, cost.cluster.profile
    context = 10 + 100  # the prompt and turn 1's output, held by i0 when the tool returns
    kv_bytes = context * 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.bytes_per_param
    bandwidth = (
        profile.inter_node_bandwidth_bytes_per_s
        if link == "inter"
        else profile.intra_node_bandwidth_bytes_per_s
    )
    move_s = kv_bytes / (1 * bandwidth)  # min(TP-1, TP-2) = one link
    assert moved.migration_s == pytest.approx(move_s) and reprefill.migration_s == 0.0
    # Re-prefill: the whole context plus the tool return on i1; KV move: the transfer plus only
    # the tool return.
    expected_gap = prefill(cost, context + 20, tp=2) - (move_s + prefill(cost, 20, tp=2))
    assert t_reprefill - t_moved == pytest.approx(expected_gap, rel=1e-6)
    configured, _, _ = _migrating_cluster("kv_move", second_devices, bandwidth=1e9)
    assert configured.migration_s == pytest.approx(kv_bytes / 1e9)


def test_kv_move_from_a_stopped_instance_re_prefills():
    cluster, cost = make_cluster(num_instances=2)
    cluster.migration = "kv_move"
    for i in range(4):
        cluster.start(trace(f"t{i}", [200], prompt=10))
    cluster.schedule(0.05, cluster.remove_instance, 0)
    cluster.run_until(lambda: False)
    assert cluster.num_migrations >= 1 and cluster.migration_s == 0.0  # nothing left to move from
