"""Baseline routers: each policy's bucket choice, on the shared placement rules."""

from __future__ import annotations

import pytest

from libra.scheduler import (
    BucketConfig,
    CmlfqConfig,
    CmlfqRouter,
    LeastLoadRouter,
    LengthMlfqRouter,
    OracleRouter,
    Reason,
    RoundRobinRouter,
    Router,
    SizeClass,
    ToolReturnState,
)
from libra.trajectory import ToolStatus

CONFIG = CmlfqConfig(
    buckets=(BucketConfig("s", 1, 100), BucketConfig("m", 2, 1000), BucketConfig("l", 4, 10000)),
    max_queue_length=10,
)
STATE = ToolReturnState("python", SizeClass.SMALL, ToolStatus.SUCCESS)


def with_instances(router: Router, buckets: tuple[int, ...] = (0, 1, 2)) -> Router:
    for instance_id, bucket in enumerate(buckets):
        router.add_instance(instance_id, bucket)
    return router


@pytest.mark.parametrize(
    "policy",
    [CmlfqRouter, RoundRobinRouter, LeastLoadRouter, LengthMlfqRouter, lambda c: OracleRouter({}, c)],
)
def test_every_policy_is_a_router(policy) -> None:
    assert isinstance(policy(CONFIG), Router)


@pytest.mark.parametrize(
    ("policy", "caps"),
    [
        (CmlfqRouter, True),
        (LengthMlfqRouter, True),
        (lambda c: OracleRouter({}, c), True),
        (LeastLoadRouter, False),
        (RoundRobinRouter, False),
    ],
)
def test_a_router_that_caps_its_placements_refuses_an_unresolved_cap(policy, caps) -> None:
    """`max_queue_length` 0 (the config default: derived) must be resolved for the pool first
    where placement honours it; least-load and round-robin never look at it. Every router takes a
    new cap at run time (`set_max_queue_length`), never 0."""
    unresolved = CmlfqConfig(buckets=CONFIG.buckets)
    assert unresolved.max_queue_length == 0
    if caps:
        with pytest.raises(ValueError, match="max_queue_length is 0"):
            policy(unresolved)
    else:
        policy(unresolved)
    router = policy(CONFIG)
    router.set_max_queue_length(7)
    assert router.config.max_queue_length == 7
    if policy in (CmlfqRouter, LengthMlfqRouter):  # placement honours the new cap
        router = with_instances(policy(CONFIG))
        router.set_max_queue_length(1)
        first, second = router.admit("t0", "p"), router.admit("t1", "p")
        assert (first.instance_id, first.reason) == (0, Reason.ADMITTED)
        assert (second.instance_id, second.reason) == (1, Reason.BUCKET_SATURATED_FALLBACK)
    with pytest.raises(ValueError, match="max_queue_length must be in 1"):
        router.set_max_queue_length(0)


@pytest.mark.parametrize("policy", [LeastLoadRouter, RoundRobinRouter, LengthMlfqRouter])
def test_baselines_record_kv_reports_but_place_as_before(policy) -> None:
    router = with_instances(policy(CONFIG), (0, 0))
    router.set_instance_kv(0, 1000, 1000)
    assert router.admit("t", "p").instance_id == 0
    assert [(load.kv_used, load.kv_capacity) for load in router.instance_loads()] == [(1000, 1000), (0, 0)]
    with pytest.raises(ValueError):
        router.set_instance_kv(1, -1, 10)


def test_length_mlfq_demotes_once_generated_tokens_pass_the_threshold_and_never_back() -> None:
    router = with_instances(LengthMlfqRouter(CONFIG))
    router.admit("t", "p")
    assert router.on_tool_return("t", STATE, 100).reason == Reason.STAY_SAME_BUCKET
    moved = router.on_tool_return("t", STATE, 101)
    assert (moved.bucket, moved.reason, moved.migrated) == (1, Reason.MIGRATE_UP, True)
    assert router.on_tool_return("t", STATE, 5000).bucket == 2


def test_oracle_routes_by_true_remaining_tokens_both_ways() -> None:
    router = with_instances(OracleRouter({"t": 5000}, CONFIG))
    assert router.admit("t", "p").bucket == 2
    assert router.on_tool_return("t", STATE, 4500).bucket == 1
    assert router.on_tool_return("t", STATE, 4950).bucket == 0


def test_homogeneous_baselines_ignore_buckets() -> None:
    round_robin = with_instances(RoundRobinRouter(CONFIG))
    assert [round_robin.admit(f"t{i}", "p").instance_id for i in range(4)] == [0, 1, 2, 0]
    least_load = with_instances(LeastLoadRouter(CONFIG))
    least_load.admit("a", "p")
    least_load.admit("b", "p")
    least_load.on_finish("a", 10)
    assert least_load.admit("c", "p").instance_id == 0
    assert least_load.on_tool_return("c", STATE, 5000).reason == Reason.STAY_SAME_BUCKET


def test_baselines_hand_back_trajectories_of_a_lost_instance() -> None:
    router = with_instances(LeastLoadRouter(CONFIG), (0, 0))
    for name in ("a", "b", "c"):
        router.admit(name, "p")
    assert router.on_instance_lost(0) == ["a", "c"]
    assert router.reroute("a").instance_id == 1
