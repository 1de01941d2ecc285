"""The elastic hybrid pool's join/release state machine, driven by hand-made events and a fake
clock (no processes)."""

from __future__ import annotations

import pytest

from libra.training.elastic import (
    ElasticConfig,
    HybridPool,
    IllegalTransition,
    PayloadHeader,
    ReplicaState,
)

S = ReplicaState
NUM_CPUS = 0


def active_pool(replica: int = 1) -> tuple[HybridPool, int]:
    pool = HybridPool(ElasticConfig(fetch_timeout_s=10, activation_timeout_s=5))
    gen = pool.request_join(replica, now=0.0)
    assert pool.start_fetch(replica, gen, now=1.0)
    assert pool.state_fetched(replica, gen, step=4, now=2.0)
    assert pool.begin_activation(replica, gen, now=3.0)
    assert pool.activated(replica, gen, first_step=6, now=4.0)
    return pool, gen


def test_join_walks_every_state_and_bumps_the_epoch_on_membership_changes():
    pool = HybridPool()
    gen = pool.request_join(1, now=0.0)
    seen = [(pool.state_of(1), pool.epoch)]
    pool.start_fetch(1, gen, now=1.0)
    seen.append((pool.state_of(1), pool.epoch))
    pool.state_fetched(1, gen, step=4, now=2.0)
    seen.append((pool.state_of(1), pool.epoch))
    pool.begin_activation(1, gen, now=3.0)
    seen.append((pool.state_of(1), pool.epoch))
    pool.activated(1, gen, first_step=6, now=4.0)
    seen.append((pool.state_of(1), pool.epoch))
    pool.request_release(1, gen, now=5.0)
    seen.append((pool.state_of(1), pool.epoch))
    pool.released(1, gen, now=6.0)
    seen.append((pool.state_of(1), pool.epoch))
    assert seen == [
        (S.REQUESTED, 0),
        (S.FETCHING_STATE, 0),
        (S.ZERO_SYNC, 1),  # registered in the gradient domain
        (S.ACTIVATING, 1),
        (S.ACTIVE, 2),  # its gradients count from now on
        (S.RELEASING, 3),  # detached
        (S.RELEASED, 3),
    ]
    r = pool.replicas[1]
    assert (r.fetched_step, r.active_from_step) == (4, 6)


@pytest.mark.parametrize(
    "event, state_name",
    [
        ("state_fetched", "REQUESTED"),
        ("begin_activation", "REQUESTED"),
        ("activated", "REQUESTED"),
        ("request_release", "REQUESTED"),
        ("released", "REQUESTED"),
    ],
)
def test_illegal_transition_names_the_states(event, state_name):
    pool = HybridPool()
    gen = pool.request_join(0, now=0.0)
    args = {"state_fetched": (4,), "activated": (5,)}.get(event, ())
    with pytest.raises(IllegalTransition, match=state_name):
        getattr(pool, event)(0, gen, *args, now=1.0)
    assert pool.state_of(0) is S.REQUESTED


def test_skipping_the_barrier_is_illegal():
    pool = HybridPool()
    gen = pool.request_join(0, now=0.0)
    pool.start_fetch(0, gen, now=0.0)
    pool.state_fetched(0, gen, step=1, now=0.0)
    with pytest.raises(IllegalTransition, match="ZERO_SYNC -> ACTIVE .*needs ACTIVATING"):
        pool.activated(0, gen, first_step=2, now=0.0)


@pytest.mark.parametrize("steps", range(6))
def test_rollback_from_every_live_state(steps):
    """Cancellation/failure rolls back from any live state; the epoch moves only when the replica
    was a member of the gradient domain."""
    pool = HybridPool()
    gen = pool.request_join(2, now=0.0)
    events = [
        lambda: pool.start_fetch(2, gen, now=1.0),
        lambda: pool.state_fetched(2, gen, step=3, now=1.0),
        lambda: pool.begin_activation(2, gen, now=1.0),
        lambda: pool.activated(2, gen, first_step=4, now=1.0),
        lambda: pool.request_release(2, gen, now=1.0),
    ]
    for event in events[:steps]:
        event()
    state = pool.state_of(2)
    epoch = pool.epoch
    was_member = state in (S.ZERO_SYNC, S.ACTIVATING, S.ACTIVE)
    assert pool.roll_back(2, gen, now=2.0, reason="rank 0 died")
    assert pool.state_of(2) is S.ROLLED_BACK and pool.replicas[2].reason == "rank 0 died"
    assert pool.epoch == epoch + (1 if was_member else 0)
    with pytest.raises(IllegalTransition, match="ROLLED_BACK"):
        pool.roll_back(2, gen, now=3.0, reason="again")


def test_cancel_then_rejoin_ignores_the_old_generation():
    pool = HybridPool()
    old = pool.request_join(1, now=0.0)
    pool.start_fetch(1, old, now=1.0)
    assert pool.cancel(1, old, now=2.0)
    new = pool.request_join(1, now=3.0)
    assert new == old + 1
    # The cancelled join's fetch finishes late: ignored, counted, the new join is untouched.
    assert not pool.state_fetched(1, old, step=9, now=4.0)
    assert pool.ignored_events == 1 and pool.state_of(1) is S.REQUESTED


def test_join_while_live_is_refused():
    pool = HybridPool()
    pool.request_join(1, now=0.0)
    with pytest.raises(IllegalTransition, match="REQUESTED"):
        pool.request_join(1, now=1.0)


def test_timeouts_use_the_clock_passed_in():
    pool = HybridPool(ElasticConfig(request_timeout_s=5, fetch_timeout_s=10, activation_timeout_s=2))
    a = pool.request_join(0, now=0.0)
    b = pool.request_join(1, now=0.0)
    pool.start_fetch(1, b, now=1.0)
    assert pool.expire(now=5.0) == []  # exactly at the deadline: still fine
    assert pool.expire(now=5.5) == [0]  # REQUESTED for 5.5 s > 5
    assert pool.replicas[0].reason == "timeout in REQUESTED"
    assert pool.expire(now=11.0) == []  # FETCHING_STATE since 1.0: 10 s
    assert pool.expire(now=11.5) == [1]
    assert a == 1 and pool.state_of(1) is S.ROLLED_BACK


def test_zero_sync_and_active_have_no_state_deadline():
    pool, gen = active_pool()
    assert pool.expire(now=1e9) == []
    assert pool.state_of(1) is S.ACTIVE


def test_payload_acceptance_and_drop_counts():
    pool, _ = active_pool(replica=1)
    epoch = pool.epoch
    ok = PayloadHeader(replica=1, step=7, policy_version=7, epoch=epoch)
    assert pool.accept_payload(ok, step=7, policy_version=7)
    assert not pool.accept_payload(PayloadHeader(1, 6, 7, epoch), step=7, policy_version=7)
    assert not pool.accept_payload(PayloadHeader(1, 7, 6, epoch), step=7, policy_version=7)
    assert not pool.accept_payload(PayloadHeader(1, 7, 7, epoch - 1), step=7, policy_version=7)
    assert not pool.accept_payload(PayloadHeader(5, 7, 7, epoch), step=7, policy_version=7)
    # Before its first active step, its payloads do not count yet.
    assert not pool.accept_payload(PayloadHeader(1, 5, 5, epoch), step=5, policy_version=5)
    assert pool.dropped_payloads == {"step": 1, "version": 1, "epoch": 1, "not_active": 2}


def test_payload_of_a_rolled_back_replica_is_dropped():
    pool, gen = active_pool(replica=1)
    header = PayloadHeader(1, 7, 7, pool.epoch)
    pool.roll_back(1, gen, now=9.0, reason="gradient timeout")
    assert not pool.accept_payload(header, step=7, policy_version=7)
    assert pool.dropped_payloads == {"not_active": 1}
    assert pool.active_replicas() == []


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="elastic.fetch_timeout_s"):
        ElasticConfig(fetch_timeout_s=0)
    with pytest.raises(KeyError, match="never joined"):
        HybridPool().state_of(3)
