"""C-MLFQ's rules one by one, on the C++ router, with hand-built traces."""

from __future__ import annotations

import threading

import pytest

from libra import _native
from libra.scheduler import BucketConfig, CmlfqConfig, CmlfqRouter, Reason, SizeClass, ToolReturnState
from libra.scheduler.interface import FairQueueLength
from libra.trajectory import ToolStatus

FAIL = ToolReturnState("python", SizeClass.LARGE, ToolStatus.FAILURE)
PASS = ToolReturnState("validator", SizeClass.SMALL, ToolStatus.SUCCESS)
SEARCH = ToolReturnState("search", SizeClass.MEDIUM, ToolStatus.SUCCESS)


def make_router(buckets_of_instances: tuple[int, ...] = (0, 0, 1, 2), **overrides: object) -> CmlfqRouter:
    """Buckets small/medium/large at 100/1,000/10,000 remaining tokens, one instance per entry
    (ids 0, 1, ...) in the given buckets; no automatic rebuilds unless overridden."""
    config = CmlfqConfig(
        buckets=(BucketConfig("s", 1, 100), BucketConfig("m", 2, 1000), BucketConfig("l", 4, 10000)),
        **{"rebuild_interval": 0, "max_queue_length": 100, **overrides},
    )
    router = CmlfqRouter(config)
    for instance_id, bucket in enumerate(buckets_of_instances):
        router.add_instance(instance_id, bucket)
    return router


def learn(router: CmlfqRouter, prompt: str, path: list[ToolReturnState], remaining: list[int]) -> None:
    """Completes one trajectory of `prompt` that had `remaining[i]` output tokens left after its
    i-th tool return (`remaining[0]`: at admission)."""
    learn.count += 1
    trajectory = f"learned-{learn.count}"
    total = remaining[0]
    router.admit(trajectory, prompt)
    for state, left in zip(path, remaining[1:], strict=True):
        router.on_tool_return(trajectory, state, total - left)
    router.on_finish(trajectory, total)


learn.count = 0


def test_admission_goes_to_least_loaded_instance_of_smallest_bucket() -> None:
    router = make_router()
    decisions = [router.admit(f"t{i}", "p") for i in range(3)]
    assert [(d.bucket, d.instance_id, d.reason) for d in decisions] == [
        (0, 0, Reason.ADMITTED),  # tie between 0 and 1: lowest id
        (0, 1, Reason.ADMITTED),
        (0, 0, Reason.ADMITTED),
    ]
    assert not any(d.migrated for d in decisions)


def test_without_history_trajectories_stay() -> None:
    router = make_router()
    router.admit("t", "p")
    decision = router.on_tool_return("t", FAIL, 10)
    assert (decision.bucket, decision.instance_id, decision.reason, decision.migrated) == (
        0,
        0,
        Reason.NO_HISTORY,
        False,
    )


def test_migrates_only_when_mean_and_p90_agree() -> None:
    router = make_router()
    # After FAIL: nine trajectories had 50 tokens left, one had 900. Mean 135 -> medium bucket,
    # P90 (the 9th smallest of 10) 50 -> small bucket: they disagree.
    for left in [50] * 9 + [900]:
        learn(router, "p", [FAIL], [left + 10, left])
    router.admit("t", "p")
    assert router.on_tool_return("t", FAIL, 10).reason == Reason.MEAN_P90_DISAGREE
    # Two more long ones: mean 262, P90 (11th smallest of 12) 900: both say medium.
    for _ in range(2):
        learn(router, "p", [FAIL], [910, 900])
    router.admit("u", "p")
    decision = router.on_tool_return("u", FAIL, 10)
    assert (decision.bucket, decision.instance_id, decision.reason, decision.migrated) == (
        1,
        2,
        Reason.MIGRATE_UP,
        True,
    )


def test_migrates_up_then_down_as_remaining_work_changes() -> None:
    router = make_router(demote=True)
    for _ in range(5):
        learn(router, "p", [FAIL, PASS], [5030, 5000, 20])  # failing: much left; validated: little
    router.admit("t", "p")
    up = router.on_tool_return("t", FAIL, 30)
    assert (up.bucket, up.instance_id, up.reason, up.migrated) == (2, 3, Reason.MIGRATE_UP, True)
    stay = router.on_tool_return("t", FAIL, 60)  # FAIL, FAIL: unseen, the deepest match is FAIL
    assert (stay.bucket, stay.instance_id, stay.reason, stay.migrated) == (
        2,
        3,
        Reason.STAY_SAME_BUCKET,
        False,
    )
    router.admit("u", "p")
    router.on_tool_return("u", FAIL, 30)
    down = router.on_tool_return("u", PASS, 5010)
    assert (down.bucket, down.reason, down.migrated) == (0, Reason.MIGRATE_DOWN, True)
    assert [load.active for load in router.instance_loads()] == [1, 0, 0, 1]


def test_prompt_tree_first_global_tree_for_unseen_prompts() -> None:
    router = make_router()
    for _ in range(3):
        learn(router, "short-prompt", [SEARCH], [60, 50])
        learn(router, "long-prompt", [SEARCH], [9010, 9000])
    short = router.predict("short-prompt", [SEARCH])
    assert (
        short is not None and short.from_prompt_tree and (short.count, short.mean_remaining_tokens) == (3, 50)
    )
    unseen = router.predict("new-prompt", [SEARCH, FAIL])
    assert unseen is not None and not unseen.from_prompt_tree
    assert (unseen.depth, unseen.count, unseen.mean_remaining_tokens, unseen.p90_remaining_tokens) == (
        1,
        6,
        4525,
        9000,
    )
    assert make_router().predict("p", [SEARCH]) is None


def test_saturated_bucket_falls_back_to_nearest_bucket_then_any_instance() -> None:
    router = make_router((0, 1, 2), max_queue_length=1)
    assert router.admit("a", "p").reason == Reason.ADMITTED
    fallback = router.admit("b", "p")  # instance 0 is full
    assert (fallback.bucket, fallback.instance_id, fallback.reason) == (
        1,
        1,
        Reason.BUCKET_SATURATED_FALLBACK,
    )
    router.admit("c", "p")
    anywhere = router.admit("d", "p")  # all full: least loaded anywhere, lowest id
    assert (anywhere.bucket, anywhere.instance_id, anywhere.reason) == (0, 0, Reason.ANY_INSTANCE_FALLBACK)


@pytest.mark.parametrize("router_kind", ["cmlfq", "reference", "length_mlfq"])
def test_full_everywhere_waits_for_an_instance_still_loading(router_kind: str) -> None:
    """A plan replacing most of the pool: while its new instances load, what the ready ones have
    no room for waits for them (NO_INSTANCE) instead of queueing behind a full instance, where
    it would stay after the new ones serve. Once nothing loads, the overflow fallback is back."""
    from libra.scheduler import LengthMlfqRouter
    from tests.scheduler.reference_cmlfq import ReferenceCmlfq

    buckets = (BucketConfig("s", 1, 100), BucketConfig("m", 2, 1000))
    config = CmlfqConfig(buckets=buckets, rebuild_interval=0, max_queue_length=1)
    router = {"cmlfq": CmlfqRouter, "reference": ReferenceCmlfq, "length_mlfq": LengthMlfqRouter}[
        router_kind
    ](config)
    router.add_instance(0, 0)
    router.add_instance(1, 1, ready=False)
    assert router.admit("a", "p").instance_id == 0
    waits = router.admit("b", "p")
    assert (waits.instance_id, waits.reason) == (None, Reason.NO_INSTANCE)
    router.set_instance_ready(1, True)
    placed = router.reroute("b")
    assert (placed.bucket, placed.instance_id) == (1, 1)
    overflow = router.admit("c", "p")  # all full, nothing loading: the least loaded, lowest id
    assert (overflow.instance_id, overflow.reason) == (0, Reason.ANY_INSTANCE_FALLBACK)
    # An instance set not ready after serving is leaving (a drain), not loading: no waiting for it.
    router.set_instance_ready(1, False)
    leaving = router.admit("d", "p")
    assert (leaving.instance_id, leaving.reason) == (0, Reason.ANY_INSTANCE_FALLBACK)


def test_fallback_prefers_the_larger_of_two_equally_near_buckets() -> None:
    router = make_router((0, 0, 1, 2), max_queue_length=1)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])  # SEARCH -> medium bucket
    router.admit("blocker", "p")
    router.on_tool_return("blocker", SEARCH, 60)  # now on the only medium instance
    assert router.admit("t", "p").instance_id == 0
    router.set_instance_ready(0, False)  # t must move: its instance is gone
    decision = router.on_tool_return("t", SEARCH, 60)
    assert (decision.bucket, decision.instance_id, decision.reason) == (
        2,
        3,
        Reason.BUCKET_SATURATED_FALLBACK,
    )


def test_a_trajectory_whose_target_bucket_is_full_stays_on_its_instance() -> None:
    """Falling back to another bucket than the one the prediction chose would pay the move (a
    re-prefill or KV transfer) for nothing: the trajectory keeps its instance and its cache."""
    router = make_router((0, 1, 2), max_queue_length=1)
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])  # SEARCH -> medium bucket
    router.admit("blocker", "p")
    router.on_tool_return("blocker", SEARCH, 60)  # fills the only medium instance
    router.admit("t", "p")
    stay = router.on_tool_return("t", SEARCH, 60)
    assert (stay.bucket, stay.instance_id, stay.reason, stay.migrated) == (
        0,
        0,
        Reason.TARGET_FULL_STAY,
        False,
    )
    assert [load.active for load in router.instance_loads()] == [1, 1, 0]
    router.on_finish("blocker", 600)  # room again: the next tool return moves it
    moved = router.on_tool_return("t", SEARCH, 90)
    assert (moved.bucket, moved.instance_id, moved.reason, moved.migrated) == (1, 1, Reason.MIGRATE_UP, True)


def test_a_kv_full_instance_is_skipped_for_one_of_its_bucket_with_room() -> None:
    """Below its trajectory cap, an instance whose reported KV reached kv_full_fraction of its
    capacity has no room; one that never reported is judged by its trajectory cap only."""
    router = make_router((0, 0, 1, 2), kv_full_fraction=0.9)
    router.set_instance_kv(0, 900, 1000)  # exactly at 0.9: full
    skipped = router.admit("a", "p")
    assert (skipped.bucket, skipped.instance_id, skipped.reason) == (0, 1, Reason.ADMITTED)
    router.set_instance_kv(1, 2000, 1000)  # both full: the nearest bucket with room
    fallback = router.admit("b", "p")
    assert (fallback.bucket, fallback.instance_id, fallback.reason) == (
        1,
        2,
        Reason.BUCKET_SATURATED_FALLBACK,
    )
    router.set_instance_kv(1, 2000, 0)  # capacity 0 withdraws the report
    assert router.admit("c", "p").instance_id == 1
    router.set_instance_kv(0, 899, 1000)  # under 0.9 again: least loaded of the bucket, as before
    assert router.admit("d", "p").instance_id == 0
    loads = {
        load.instance_id: (load.active, load.kv_used, load.kv_capacity) for load in router.instance_loads()
    }
    assert loads == {0: (1, 899, 1000), 1: (2, 2000, 0), 2: (1, 0, 0), 3: (0, 0, 0)}


def test_a_target_bucket_whose_instances_are_all_kv_full_keeps_the_trajectory() -> None:
    router = make_router((0, 1, 1, 2))
    for _ in range(3):
        learn(router, "p", [SEARCH], [560, 500])  # SEARCH -> medium bucket
    router.set_instance_kv(1, 950, 1000)
    router.set_instance_kv(2, 50_000, 50_000)
    router.admit("t", "p")
    stay = router.on_tool_return("t", SEARCH, 60)
    assert (stay.bucket, stay.instance_id, stay.reason, stay.migrated) == (
        0,
        0,
        Reason.TARGET_FULL_STAY,
        False,
    )
    router.set_instance_kv(2, 40_000, 50_000)  # room again
    moved = router.on_tool_return("t", SEARCH, 90)
    assert (moved.bucket, moved.instance_id, moved.reason, moved.migrated) == (1, 2, Reason.MIGRATE_UP, True)


def test_kv_reports_are_checked() -> None:
    router = make_router()
    with pytest.raises(KeyError):
        router.set_instance_kv(99, 1, 10)
    with pytest.raises(ValueError, match="KV tokens"):
        router.set_instance_kv(0, -1, 10)
    with pytest.raises(ValueError, match="KV tokens"):
        router.set_instance_kv(0, 1, 2**53 + 1)
    router.set_instance_kv(0, 2**53, 2**53)  # the largest report is taken exactly
    assert (router.instance_loads()[0].kv_used, router.instance_loads()[0].kv_capacity) == (2**53, 2**53)


def test_without_demotion_a_trajectory_only_moves_up() -> None:
    """`demote=False`: a near-finished trajectory keeps the large instance holding its long
    context; promotions are unchanged."""
    router = make_router(demote=False)
    for _ in range(5):
        learn(router, "p", [FAIL, PASS], [5030, 5000, 20])
    router.admit("u", "p")
    up = router.on_tool_return("u", FAIL, 30)
    assert (up.bucket, up.instance_id, up.reason, up.migrated) == (2, 3, Reason.MIGRATE_UP, True)
    held = router.on_tool_return("u", PASS, 5010)
    assert (held.bucket, held.instance_id, held.reason, held.migrated) == (2, 3, Reason.DEMOTION_HELD, False)


def test_no_ready_instance_leaves_the_trajectory_unplaced() -> None:
    router = make_router((0,))
    router.set_instance_ready(0, False)
    decision = router.admit("t", "p")
    assert (decision.instance_id, decision.reason) == (None, Reason.NO_INSTANCE)
    router.set_instance_ready(0, True)
    assert router.reroute("t").instance_id == 0


def test_trajectories_leave_a_not_ready_instance_at_their_next_tool_return() -> None:
    router = make_router((0, 0))
    assert router.admit("t", "p").instance_id == 0
    router.set_instance_ready(0, False)
    decision = router.on_tool_return("t", FAIL, 10)
    assert (decision.bucket, decision.instance_id, decision.reason, decision.migrated) == (
        0,
        1,
        Reason.NO_HISTORY,
        True,
    )


def test_lost_instance_hands_back_its_trajectories_for_rerouting() -> None:
    router = make_router((0, 0))
    for name in ("b", "a", "c", "d"):
        router.admit(name, "p")  # a, d on 1; b, c on 0
    assert router.on_instance_lost(0) == ["b", "c"]
    assert router.num_live == 4
    assert [(load.instance_id, load.active) for load in router.instance_loads()] == [(1, 2)]
    rerouted = [router.reroute(t) for t in ("b", "c")]
    assert [(d.instance_id, d.reason, d.migrated) for d in rerouted] == [(1, Reason.REROUTED, False)] * 2
    assert router.remove_instance(1) == ["a", "b", "c", "d"]
    with pytest.raises(KeyError):
        router.on_instance_lost(1)


def test_finish_and_abort_free_the_slot() -> None:
    router = make_router((0,))
    router.admit("t", "p")
    router.admit("u", "p")
    router.on_finish("t", 10)
    router.on_abort("u")
    assert router.num_live == 0 and router.instance_loads()[0].active == 0
    assert router.predict("p", []).count == 1  # only the finished one was learned
    with pytest.raises(KeyError):
        router.on_finish("t", 10)


def test_rebuild_forgets_behaviour_older_than_the_window() -> None:
    router = make_router(rebuild_window=20)
    for _ in range(50):
        learn(router, "p", [FAIL], [5010, 5000])  # the old policy: failures meant long tails
    for _ in range(20):
        learn(router, "p", [FAIL], [60, 50])  # the new one recovers quickly
    before = router.predict("p", [FAIL])
    assert before.count == 70 and before.p90_remaining_tokens == 5000
    router.rebuild()
    after = router.predict("p", [FAIL])
    assert (after.count, after.mean_remaining_tokens, after.p90_remaining_tokens) == (20, 50, 50)


def test_automatic_rebuild_every_interval() -> None:
    router = make_router(rebuild_window=2, rebuild_interval=3)
    for left in (1, 2):
        learn(router, "old", [FAIL], [left, left])
    assert router.predict("old", []).count == 2
    learn(router, "new", [FAIL], [3, 3])  # third completion: rebuild from the last two
    assert router.predict("old", []).count == 1
    assert router.predict("new", []).count == 1


def test_p90_covers_only_the_recent_window() -> None:
    router = make_router(p90_window=3)
    for left in (9000, 10, 20, 30):
        learn(router, "p", [], [left])
    prediction = router.predict("p", [])
    assert (prediction.count, prediction.p90_remaining_tokens) == (4, 30)


def test_serialization_round_trip() -> None:
    router = make_router(p90_window=4)
    for i in range(30):
        learn(router, f"p{i % 3}", [FAIL, SEARCH, PASS][: i % 4], [900 - i, 600, 300, 20][: i % 4 + 1])
    state = router.serialize()
    restored = make_router(p90_window=4)
    restored.restore(state)
    assert restored.serialize() == state
    for prompt in ("p0", "p1", "p2", "unseen"):
        for path in ([], [FAIL], [FAIL, SEARCH], [FAIL, SEARCH, PASS], [PASS]):
            assert restored.predict(prompt, path) == router.predict(prompt, path)
    restored.rebuild()
    router.rebuild()
    assert restored.serialize() == router.serialize()  # the history came along


@pytest.mark.parametrize(
    "damage", [lambda b: b[:-1], lambda b: b + b"\0", lambda b: b"XXXX" + b[4:], lambda b: b""]
)
def test_restore_rejects_damaged_state_and_keeps_its_own(damage) -> None:
    router = make_router()
    learn(router, "p", [FAIL], [100, 50])
    state = router.serialize()
    with pytest.raises(ValueError):
        router.restore(damage(state))
    assert router.serialize() == state


def test_merge_adds_up_what_each_controller_learned() -> None:
    first, second = make_router(), make_router()
    for _ in range(3):
        learn(first, "a", [FAIL], [5010, 5000])
    for _ in range(2):
        learn(second, "b", [FAIL], [60, 50])
        learn(second, "a", [FAIL], [2010, 2000])
    first.merge(second.serialize())
    a = first.predict("a", [FAIL])
    assert (a.count, a.mean_remaining_tokens) == (5, 3800)
    assert first.predict("b", [FAIL]).count == 2
    assert first.predict("unseen", []).count == 7


def test_unknown_ids_and_duplicates() -> None:
    router = make_router()
    router.admit("t", "p")
    with pytest.raises(ValueError):
        router.admit("t", "p")
    with pytest.raises(KeyError):
        router.on_tool_return("nope", FAIL, 1)
    with pytest.raises(KeyError):
        router.set_instance_ready(99, True)
    with pytest.raises(ValueError):
        router.add_instance(0, 0)
    with pytest.raises(ValueError):
        router.add_instance(7, 3)
    with pytest.raises(ValueError):
        router.on_tool_return("t", FAIL, -1)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"buckets": ()}, "cmlfq.buckets"),
        ({"buckets": (BucketConfig("a", 1, 100), BucketConfig("a", 2, 200))}, "names must be unique"),
        ({"buckets": (BucketConfig("a", 1, 200), BucketConfig("b", 2, 200))}, "strictly increase"),
        ({"buckets": (BucketConfig("a", 0, 100),)}, "tp_size"),
        ({"buckets": (BucketConfig("a", 1, 0),)}, "max_remaining_tokens"),
        ({"small_payload_max_tokens": -1}, "cmlfq.small_payload_max_tokens"),
        ({"medium_payload_max_tokens": 1000}, "cmlfq.medium_payload_max_tokens"),
        ({"p90_window": 0}, "cmlfq.p90_window"),
        ({"rebuild_window": 0}, "cmlfq.rebuild_window"),
        ({"rebuild_interval": -1}, "cmlfq.rebuild_interval"),
        ({"max_queue_length": -1}, "cmlfq.max_queue_length"),
        ({"max_queue_length": 2**31}, "cmlfq.max_queue_length"),
        ({"kv_full_fraction": 0.0}, "cmlfq.kv_full_fraction"),
        ({"kv_full_fraction": 1.01}, "cmlfq.kv_full_fraction"),
        ({"kv_full_fraction": float("nan")}, "cmlfq.kv_full_fraction"),
    ],
)
def test_bad_config_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CmlfqConfig(**overrides)


def test_reason_codes_match_the_core() -> None:
    assert [reason.name.lower() for reason in Reason] == _native.cmlfq_reason_names()


def test_concurrent_callers_keep_the_load_table_consistent() -> None:
    router = make_router((0, 0, 1, 2), max_queue_length=3)
    for _ in range(5):
        learn(router, "p", [FAIL], [5010, 5000])

    def worker(name: str) -> None:
        for i in range(300):
            trajectory = f"{name}-{i}"
            router.admit(trajectory, "p")
            router.on_tool_return(trajectory, FAIL, 10)
            router.on_finish(trajectory, 5010)

    threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert router.num_live == 0
    assert all(load.active == 0 for load in router.instance_loads())
    assert router.predict("p", []).count == 5 + 4 * 300


def test_a_completion_without_tool_calls_does_not_shadow_the_global_tree() -> None:
    """A prompt whose only completion never called a tool has no history of tool returns: its
    next trajectories are predicted from the global tree's deeper match, not from a root-only
    prompt tree (which would say "about as long as that one answer" at every tool return)."""
    router = make_router()
    for _ in range(3):
        learn(router, "other", [SEARCH], [5030, 5000])
    router.admit("quick", "p")
    router.on_finish("quick", 40)  # answered without a tool
    prediction = router.predict("p", [SEARCH])
    assert prediction is not None and not prediction.from_prompt_tree
    assert (prediction.depth, prediction.mean_remaining_tokens) == (1, 5000)
    learn(router, "p", [SEARCH], [80, 50])  # once it has called a tool, its own tree counts
    own = router.predict("p", [SEARCH])
    assert own is not None and own.from_prompt_tree and (own.depth, own.mean_remaining_tokens) == (1, 50)


def test_an_instance_past_its_fair_share_of_the_pool_takes_no_more() -> None:
    """fair_share_headroom h: an instance has room while active / weight < h x (pool active + 1)
    / pool weight. A small instance then stops taking admissions at its share, and the large one
    takes the rest, instead of the small one filling to max_queue_length first."""

    def admissions(**overrides: object) -> list[tuple[int, Reason]]:
        router = make_router((0, 2), **{"draining_fraction": 0.0, **overrides})
        router.remove_instance(1)
        router.add_instance(1, 2, weight=3)
        return [(d.instance_id, d.reason) for d in (router.admit(f"t{i}", "p") for i in range(6))]

    # Pool weight 4. The first admission finds the pool empty, i.e. draining (0 <= 0 x caps):
    # caps only. Then the small instance (weight 1) holds 1 while 1 x 4 < (held + 1) is false
    # until 4 are held, and the large one (weight 3) takes the others.
    small, large = (0, Reason.ADMITTED), (1, Reason.BUCKET_SATURATED_FALLBACK)
    assert admissions(fair_share_headroom=1.0) == [small, large, large, large, small, large]
    assert admissions(fair_share_headroom=0.0) == [small] * 6  # off: the small instance's cap of 100 rules
    # While the pool drains (here always: at most all of its caps are in use) only the caps apply.
    assert admissions(fair_share_headroom=1.0, draining_fraction=1.0) == [small] * 6


def test_a_move_is_judged_against_the_pool_it_leaves_not_counted_twice() -> None:
    """Whether the target has room is decided while the trajectory still counts on its instance;
    it must be judged as its placement will be, once it left, or a target judged to have room
    turns it away and the move falls back to a third bucket (a re-prefill for nothing)."""
    router = make_router((0, 1, 2), draining_fraction=0.0, fair_share_headroom=1.2)
    for _ in range(3):
        learn(router, "p", [FAIL], [5010, 5000])  # after FAIL: 5,000 left, the large bucket
    for instance_id, count in enumerate((2, 1, 2)):  # admit onto one instance at a time
        for other in range(3):
            router.set_instance_ready(other, other == instance_id)
        for j in range(count):
            router.admit(f"on{instance_id}-{j}", "p")
    for instance_id in range(3):
        router.set_instance_ready(instance_id, True)
    # Without "on0-0" the pool holds 4 of weight 3: the large instance (2 held) has room while
    # 2 x 3 < 1.2 x (4 + 1), which it has not.
    stay = router.on_tool_return("on0-0", FAIL, 10)
    assert (stay.bucket, stay.instance_id, stay.reason, stay.migrated) == (
        0,
        0,
        Reason.TARGET_FULL_STAY,
        False,
    )
    router.on_finish("on2-0", 100)  # now 1 x 3 < 1.2 x (3 + 1): room
    moved = router.on_tool_return("on0-0", FAIL, 20)
    assert (moved.bucket, moved.instance_id, moved.reason, moved.migrated) == (2, 2, Reason.MIGRATE_UP, True)


@pytest.mark.parametrize("value", [0.5, -1.0, float("inf"), float("nan")])
def test_bad_fair_share_headroom_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="fair_share_headroom"):
        CmlfqConfig(fair_share_headroom=value)


def test_a_new_cap_applies_from_the_next_placement() -> None:
    """`set_max_queue_length` (a plan changed the pool the cap was derived for): the trajectories
    placed stay where they are, and the next placement sees the new cap."""
    router = make_router((0, 1), max_queue_length=1, fair_share_headroom=0.0, draining_fraction=0.0)
    assert [router.admit(f"t{i}", "p").instance_id for i in range(2)] == [0, 1]  # 0 is full at 1
    router.set_max_queue_length(2)
    assert router.config.max_queue_length == 2
    third = router.admit("t2", "p")
    assert (third.instance_id, third.reason) == (0, Reason.ADMITTED)
    assert [load.active for load in router.instance_loads()] == [2, 1]
    router.set_max_queue_length(1)  # below what instance 0 holds: nobody moves, it takes no more
    assert [load.active for load in router.instance_loads()] == [2, 1]
    fourth = router.admit("t3", "p")
    assert fourth.reason is Reason.ANY_INSTANCE_FALLBACK
    with pytest.raises(ValueError, match="max_queue_length must be in 1"):
        router.set_max_queue_length(0)
    assert router.config.max_queue_length == 1


def test_a_derived_cap_follows_the_pools_weight() -> None:
    router = make_router((0, 1), max_queue_length=10)
    cap = FairQueueLength(router, in_flight=40, max_queue_length=10)
    assert cap.follow(4) is None and router.config.max_queue_length == 10  # 40 / 4: unchanged
    assert cap.follow(2) == 20 and router.config.max_queue_length == 20  # the pool halved
    assert cap.follow(100) == 3  # never below the original's 3
    assert cap.follow(0) is None and router.config.max_queue_length == 3  # no pool: kept
    with pytest.raises(ValueError, match="in flight"):
        FairQueueLength(router, in_flight=0, max_queue_length=3)
