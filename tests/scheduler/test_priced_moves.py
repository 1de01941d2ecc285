"""C-MLFQ with its buckets' speeds (`BucketConfig.speed`): a promotion is made only when it pays
on the loaded target, and while the pool drains a trajectory moves to a faster bucket outside its
band. Hand-built traces on the C++ router; `test_cmlfq_equivalence.py` holds it to the reference."""

from __future__ import annotations

import dataclasses

import pytest

from libra.scheduler import BucketConfig, BucketSpeed, CmlfqConfig, CmlfqRouter, Reason
from tests.scheduler.test_cmlfq_rules import PASS, SEARCH, learn

# Decode steps of 30 / 20 / 12 ms plus 1 ms per live trajectory; moving costs 0.1 ms per context
# token into the medium bucket and 0.01 ms into the large one.
SMALL = BucketSpeed(step_s=0.030, per_sequence_s=0.001)
MEDIUM = BucketSpeed(step_s=0.020, per_sequence_s=0.001, move_linear_s=1e-4)
LARGE = BucketSpeed(step_s=0.012, per_sequence_s=0.001, move_linear_s=1e-5)


def priced_router(**overrides: object) -> CmlfqRouter:
    """Buckets small/medium/large at 100/1,000/10,000 remaining tokens with the speeds above, one
    instance each (ids 0, 1, 2). No fair-share bound, so that where trajectories go is the
    pricing's doing (and the caps')."""
    config = CmlfqConfig(
        buckets=(
            BucketConfig("s", 1, 100, SMALL),
            BucketConfig("m", 2, 1000, MEDIUM),
            BucketConfig("l", 4, 10000, LARGE),
        ),
        **{"rebuild_interval": 0, "max_queue_length": 100, "fair_share_headroom": 0.0, **overrides},
    )
    router = CmlfqRouter(config)
    for instance_id in range(3):
        router.add_instance(instance_id, instance_id)
    return router


def test_a_promotion_is_made_only_when_it_saves_more_than_its_move_costs() -> None:
    router = priced_router(draining_fraction=0.0)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])  # after SEARCH: 500 left, the medium bucket
    router.admit("short-context", "p")
    router.admit("long-context", "p")
    # The small instance holds both (32 ms a step), the medium one would hold one (21 ms): 500
    # tokens save 5.5 s, and moving 10,000 tokens costs 1 s. Then 31 ms against 22 ms saves 4.5 s,
    # and moving 100,000 tokens costs 10 s.
    moved = router.on_tool_return("short-context", SEARCH, 60, context_tokens=10_000)
    assert (moved.bucket, moved.instance_id, moved.reason, moved.migrated) == (1, 1, Reason.MIGRATE_UP, True)
    stay = router.on_tool_return("long-context", SEARCH, 60, context_tokens=100_000)
    assert (stay.bucket, stay.instance_id, stay.reason, stay.migrated) == (
        0,
        0,
        Reason.MOVE_NOT_WORTH_IT,
        False,
    )


def test_promotions_stop_once_the_target_is_loaded_past_the_saving() -> None:
    """Twenty trajectories on the small instance all want the medium bucket; each move makes the
    medium instance's step longer and the small one's shorter. The k-th (from 0) pays while
    31 + 20 - k - 1 ms > 21 + k ms, i.e. for k < 14.5: fifteen move, five stay."""
    router = priced_router(draining_fraction=0.0)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])
    for i in range(20):
        router.admit(f"t{i:02d}", "p")
    reasons = [router.on_tool_return(f"t{i:02d}", SEARCH, 60).reason for i in range(20)]
    assert reasons == [Reason.MIGRATE_UP] * 15 + [Reason.MOVE_NOT_WORTH_IT] * 5
    assert [load.active for load in router.instance_loads()] == [5, 15, 0]


def test_without_speeds_every_promotion_to_a_bucket_with_room_is_made() -> None:
    config = CmlfqConfig(
        buckets=(BucketConfig("s", 1, 100), BucketConfig("m", 2, 1000), BucketConfig("l", 4, 10000)),
        rebuild_interval=0,
        max_queue_length=100,
    )
    router = CmlfqRouter(config)
    for instance_id in range(3):
        router.add_instance(instance_id, instance_id)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])
    for i in range(20):
        router.admit(f"t{i:02d}", "p")
    reasons = {router.on_tool_return(f"t{i:02d}", SEARCH, 60, 10**6).reason for i in range(20)}
    assert reasons == {Reason.MIGRATE_UP}


def test_while_the_pool_drains_a_trajectory_moves_to_a_faster_bucket_outside_its_band() -> None:
    """After PASS, 50 tokens are left: the small bucket's band. With the pool nearly empty the
    large instance decodes them in 13 ms steps instead of 31+ ms, for 0.01 s of moving 1,000
    tokens: it moves. Once the live trajectories exceed a quarter of the caps, it stays."""
    router = priced_router(max_queue_length=10)  # caps 30 in all: draining at <= 7.5 live
    for _ in range(3):
        learn(router, "p", [PASS], [60, 50])
    for i in range(8):
        router.admit(f"t{i}", "p")
    loaded = router.on_tool_return("t0", PASS, 10, context_tokens=1000)
    assert (loaded.bucket, loaded.instance_id, loaded.reason) == (0, 0, Reason.STAY_SAME_BUCKET)
    router.on_finish("t7", 60)  # 7 live: draining
    drained = router.on_tool_return("t0", PASS, 10, context_tokens=1000)
    # The large bucket gains the most: 50 x (37 - 13) ms - 0.01 s, against 50 x (37 - 21) ms - 0.1 s.
    assert (drained.bucket, drained.instance_id, drained.reason, drained.migrated) == (
        2,
        2,
        Reason.MIGRATE_FASTER,
        True,
    )


def test_a_faster_bucket_is_not_taken_when_the_move_costs_more_than_it_saves() -> None:
    router = priced_router()
    for _ in range(3):
        learn(router, "p", [PASS], [60, 50])
    router.admit("t", "p")
    # 50 x (31 - 13) ms = 0.9 s saved; 200,000 tokens into the large bucket cost 2 s.
    stay = router.on_tool_return("t", PASS, 10, context_tokens=200_000)
    assert (stay.bucket, stay.instance_id, stay.reason) == (0, 0, Reason.STAY_SAME_BUCKET)


def _held_back_with_free_moves() -> tuple[CmlfqRouter, tuple[BucketConfig, ...]]:
    """A router whose trajectory "t" was refused a promotion its 100,000-token context does not
    pay for, and the same buckets with moves priced free."""
    router = priced_router(draining_fraction=0.0)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])
    router.admit("t", "p")
    assert router.on_tool_return("t", SEARCH, 60, 100_000).reason == Reason.MOVE_NOT_WORTH_IT
    free_moves = tuple(
        BucketConfig(b.name, b.tp_size, b.max_remaining_tokens, BucketSpeed(b.speed.step_s, 0.001))
        for b in router.config.buckets
    )
    return router, free_moves


def test_update_buckets_carries_the_new_speeds() -> None:
    router, free_moves = _held_back_with_free_moves()
    moved = router.update_buckets(free_moves, {0: 0, 1: 1, 2: 2})
    assert [(d.trajectory_id, d.bucket, d.reason) for d in moved] == [("t", 1, Reason.MIGRATE_UP)]
    # Without speeds, a move that would not pay under them is made.
    unpriced = tuple(BucketConfig(b.name, b.tp_size, b.max_remaining_tokens) for b in router.config.buckets)
    router.update_buckets(unpriced, {0: 0, 1: 1, 2: 2})
    router.admit("u", "p")
    moved = router.on_tool_return("u", SEARCH, 60, 10**7)
    assert (moved.bucket, moved.reason, moved.migrated) == (1, Reason.MIGRATE_UP, True)


def test_new_speeds_apply_from_the_next_tool_return_and_move_nobody() -> None:
    router, free_moves = _held_back_with_free_moves()
    router.set_bucket_speeds(free_moves)
    assert [load.active for load in router.instance_loads()] == [1, 0, 0]  # nobody moved yet
    moved = router.on_tool_return("t", SEARCH, 90, 100_000)
    assert (moved.bucket, moved.reason, moved.migrated) == (1, Reason.MIGRATE_UP, True)
    with pytest.raises(ValueError, match="use update_buckets"):
        router.set_bucket_speeds(
            tuple(dataclasses.replace(b, max_remaining_tokens=b.max_remaining_tokens + 1) for b in free_moves)
        )


def test_demotions_are_not_priced() -> None:
    """A demotion (`demote`) is about priority: it is made although the smaller bucket is slower."""
    router = priced_router(demote=True, draining_fraction=0.0)
    for _ in range(3):
        learn(router, "p", [SEARCH, PASS], [600, 500, 50])  # SEARCH: medium; then PASS: small
    router.admit("t", "p")
    assert router.on_tool_return("t", SEARCH, 100, context_tokens=0).reason == Reason.MIGRATE_UP
    down = router.on_tool_return("t", PASS, 550, context_tokens=10**6)
    assert (down.bucket, down.instance_id, down.reason, down.migrated) == (0, 0, Reason.MIGRATE_DOWN, True)


def test_the_core_refuses_speeds_that_do_not_match_the_buckets() -> None:
    from libra import _native

    with pytest.raises(ValueError, match="one per threshold"):
        _native.CmlfqScheduler([100, 1000], 3, 10, 10, 0, bucket_speeds=[(0.01, 0.001, 0.0, 0.0)])


def test_speeds_must_be_given_for_every_bucket_or_none() -> None:
    with pytest.raises(ValueError, match="either every bucket has a speed or none"):
        CmlfqConfig(buckets=(BucketConfig("s", 1, 100, SMALL), BucketConfig("m", 2, 1000)))


@pytest.mark.parametrize("field", ["step_s", "per_sequence_s", "move_linear_s", "move_quadratic_s"])
@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf"), True])
def test_bad_speeds_name_the_field(field: str, value: float) -> None:
    values = {"step_s": 0.01, "per_sequence_s": 0.001, field: value}
    with pytest.raises(ValueError, match=f"BucketSpeed.{field}"):
        BucketSpeed(**values)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_draining_fraction_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="cmlfq.draining_fraction"):
        CmlfqConfig(draining_fraction=value)


def test_context_tokens_are_checked() -> None:
    router = priced_router()
    router.admit("t", "p")
    with pytest.raises(ValueError, match="context_tokens"):
        router.on_tool_return("t", SEARCH, 10, context_tokens=-1)
