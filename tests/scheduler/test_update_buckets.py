"""`update_buckets`: a re-plan replaces the buckets at run time, on C-MLFQ and the baselines.
(The random-trace equivalence with the Python reference includes it as the `update` op.)"""

from __future__ import annotations

import pytest

from libra.scheduler import BucketConfig, LeastLoadRouter, LengthMlfqRouter, Reason, Router
from tests.scheduler.test_cmlfq_rules import FAIL, PASS, learn, make_router

TWO_BUCKETS = (BucketConfig("tp2", 2, 500), BucketConfig("tp8", 8, 20000))


def test_trajectories_move_where_their_path_now_points() -> None:
    router = make_router((0, 1, 2))  # thresholds 100 / 1,000 / 10,000
    for _ in range(5):
        learn(router, "p", [FAIL], [3000, 800])  # after FAIL: 800 tokens left
    router.admit("after-fail", "p")
    assert router.on_tool_return("after-fail", FAIL, 2200).bucket == 1  # 800 <= 1,000
    router.admit("fresh", "p")  # no tool return yet: nothing known about it

    # The new plan: TP-2 up to 500 remaining tokens (old instances 0, 1), TP-8 above (instance 2).
    moved = router.update_buckets(TWO_BUCKETS, {0: 0, 1: 0, 2: 1})
    assert router.thresholds == [500, 20000]
    assert [(d.trajectory_id, d.bucket, d.instance_id, d.reason, d.migrated) for d in moved] == [
        ("after-fail", 1, 2, Reason.MIGRATE_UP, True)  # 800 > 500: the TP-8 bucket now
    ]
    loads = {load.instance_id: (load.bucket, load.active) for load in router.instance_loads()}
    assert loads == {0: (0, 1), 1: (0, 0), 2: (1, 1)}  # "fresh" stayed on instance 0
    # The next tool return keeps it there (mean and P90 agree on the TP-8 bucket).
    decision = router.on_tool_return("after-fail", PASS, 2500)
    assert (decision.instance_id, decision.migrated) == (2, False)


def test_a_trajectory_whose_new_bucket_is_full_stays_where_it_runs() -> None:
    """As at a tool return: with the TP-8 bucket's one instance at its cap, the trajectory that
    should move there keeps its instance (a fallback elsewhere would pay the move for nothing)."""
    router = make_router((0, 1, 2), max_queue_length=1)
    for _ in range(5):
        learn(router, "p", [FAIL], [3000, 800])
    router.admit("blocker", "p")
    router.admit("after-fail", "p")
    assert router.on_tool_return("after-fail", FAIL, 2200).instance_id == 1
    # The new plan puts instance 0 (holding "blocker") in the TP-8 bucket, where 800 now belongs.
    moved = router.update_buckets(TWO_BUCKETS, {0: 1, 1: 0, 2: 0})
    assert moved == []
    loads = {load.instance_id: (load.bucket, load.active) for load in router.instance_loads()}
    assert loads == {0: (1, 1), 1: (0, 1), 2: (0, 0)}


def test_an_unplaced_trajectory_takes_its_new_bucket_when_rerouted() -> None:
    router = make_router((0, 2))
    for _ in range(3):
        learn(router, "p", [FAIL], [9000, 5000])
    router.admit("t", "p")
    router.on_tool_return("t", FAIL, 4000)  # 5,000 left: bucket 2 (instance 1)
    assert router.remove_instance(1) == ["t"]
    assert router.update_buckets(TWO_BUCKETS, {0: 0}) == []  # unplaced: nothing moves now
    router.add_instance(7, 1)
    decision = router.reroute("t")
    assert (decision.bucket, decision.instance_id) == (1, 7)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({0: 0}, "missing \\[1\\]"),
        ({0: 0, 1: 0, 5: 1}, "unknown \\[5\\]"),
        ({0: 0, 1: 2}, "instance 1 has bucket 2"),
    ],
)
def test_bad_instance_mapping_changes_nothing(mapping: dict[int, int], message: str) -> None:
    for router in (make_router((0, 1)), LeastLoadRouter(make_router().config)):
        if isinstance(router, LeastLoadRouter):
            router.add_instance(0, 0)
            router.add_instance(1, 1)
        with pytest.raises(ValueError, match=message):
            router.update_buckets(TWO_BUCKETS, mapping)
        assert len(router.config.buckets) == 3


def test_thresholds_are_validated() -> None:
    router = make_router((0,))
    with pytest.raises(ValueError, match="strictly increase"):
        router.update_buckets((BucketConfig("a", 1, 500), BucketConfig("b", 2, 500)), {0: 0})


@pytest.mark.parametrize("router_cls", [LeastLoadRouter, LengthMlfqRouter])
def test_baselines_relabel_and_move_nobody(router_cls: type) -> None:
    router = router_cls(make_router().config)
    assert isinstance(router, Router)
    for instance_id, bucket in enumerate((0, 1, 2)):
        router.add_instance(instance_id, bucket)
    router.admit("t", "p")
    assert router.update_buckets(TWO_BUCKETS, {0: 1, 1: 0, 2: 1}) == []
    assert router.config.thresholds == [500, 20000]
    decision = router.on_tool_return("t", FAIL, 10)
    assert decision.instance_id == 0 and decision.bucket == 1  # its instance is in bucket 1 now


def test_weighted_instances_take_load_by_capacity() -> None:
    """A three-times-larger instance takes three times the trajectories, on C-MLFQ and least-load."""
    for router in (make_router(()), LeastLoadRouter(make_router().config)):
        router.add_instance(0, 0, weight=1)
        router.add_instance(1, 0, weight=3)
        placed = [router.admit(f"t{i}", "p").instance_id for i in range(8)]
        assert placed.count(0) == 2 and placed.count(1) == 6
    with pytest.raises(ValueError, match="weight must be"):
        make_router(()).add_instance(0, 0, weight=0)
