"""The staleness gate, driven with made-up versions and counts (no model)."""

from __future__ import annotations

import pytest

from libra.training.staleness import StalenessGate


def test_admits_within_max_staleness_by_oldest_version():
    gate = StalenessGate(max_staleness=2, batch_size=4)
    for _ in range(5):
        gate.on_train_step(0)
    assert gate.version == 5
    assert gate.admit([5, 3, 2, None]) == [True, True, False, True]
    assert gate.state.num_dropped == 1


def test_a_group_is_admitted_or_dropped_whole():
    gate = StalenessGate(max_staleness=1, batch_size=4)
    assert gate.try_start(8) == 8
    for _ in range(2):
        gate.on_train_step(0)
    assert gate.admit_group([2, 1, None, 1], slots=4) is True
    assert gate.admit_group([2, 0, 2], slots=4) is False  # one member too old: none of it is trained
    assert gate.state.num_dropped == 4 and gate.state.num_in_flight == 4  # its slots are free again
    gate.on_train_step(4)  # the admitted group's slots, however many trajectories it held
    assert gate.state.num_in_flight == 0


def test_which_groups_a_step_must_train_on():
    """With max_staleness s, a group launched at version v must be trained at version v + s at the
    latest: after that step its oldest tokens (none older than v) would be s + 1 behind."""
    gate = StalenessGate(max_staleness=1, batch_size=4)
    for _ in range(3):
        gate.on_train_step(0)
    assert [gate.must_train(v) for v in range(4)] == [True, True, True, False]
    assert StalenessGate(max_staleness=0, batch_size=4).must_train(0)


def test_version_ahead_of_trainer_is_an_error():
    gate = StalenessGate(max_staleness=1, batch_size=4)
    with pytest.raises(ValueError, match="ahead"):
        gate.admit([1])


def test_capacity_bounds_rollouts_in_flight():
    gate = StalenessGate(max_staleness=1, batch_size=4)
    assert gate.capacity() == 8  # versions 0 and 1 may be sampled before the trainer must wait
    assert gate.try_start(10) == 8 and gate.capacity() == 0
    assert gate.admit([0, 0, 0, 0]) == [True] * 4
    gate.on_train_step(4)
    assert gate.capacity() == 4
    gate.drop(2)  # e.g. dynamic sampling discarded two: their slots return
    assert gate.capacity() == 6


def test_unregistered_arrivals_are_counted_as_started():
    gate = StalenessGate(max_staleness=0, batch_size=3)
    gate.admit([0, 0, 0])
    gate.on_train_step(3)
    assert gate.state.num_started == 3 and gate.state.num_in_flight == 0
    assert gate.capacity() == 3


def test_state_round_trip_releases_in_flight_slots():
    gate = StalenessGate(max_staleness=1, batch_size=4)
    gate.try_start(8)
    gate.admit([0, 0, 0, 0])
    gate.on_train_step(4)
    gate.try_start(4)  # 8 in flight at the checkpoint
    saved = gate.state_dict()
    restored = StalenessGate(max_staleness=1, batch_size=4)
    restored.load_state_dict(saved)
    assert restored.version == 1 and restored.state.num_consumed == 4
    assert restored.state.num_in_flight == 0
    # Fresh capacity after restart: (1 + 1 + 1) x 4 minus the 4 consumed.
    assert restored.capacity() == 8
    kept = StalenessGate(max_staleness=1, batch_size=4)
    kept.load_state_dict(saved, release_in_flight=False)
    assert kept.capacity() == 0


def test_forgetting_the_counters_overcommits():
    """What goes wrong when only the version is restored (the bug the persisted state avoids)."""
    gate = StalenessGate(max_staleness=1, batch_size=4)
    for _ in range(3):
        gate.try_start(4)
        gate.admit([gate.version] * 4)
        gate.on_train_step(4)
    naive = StalenessGate(max_staleness=1, batch_size=4)
    naive.state.version = gate.version
    restored = StalenessGate(max_staleness=1, batch_size=4)
    restored.load_state_dict(gate.state_dict())
    assert restored.capacity() == 8
    assert naive.capacity() == 20  # 12 rollouts too many, all bound to arrive stale


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(max_staleness=-1, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessGate(max_staleness=0, batch_size=0)


def test_the_tail_bound_admits_late_trajectories_without_deepening_the_launch():
    """tail_staleness t: a trajectory may be max_staleness + t versions old when trained (the long
    ones that outlive their turn), but no more rollouts start than with t = 0, and a step waits
    only for groups that would pass the whole bound."""
    plain = StalenessGate(max_staleness=1, batch_size=4)
    tail = StalenessGate(max_staleness=1, batch_size=4, tail_staleness=2)
    assert tail.bound == 3 and plain.bound == 1
    for gate in (plain, tail):
        assert gate.try_start(100) == 8  # the launch depth is max_staleness's
        for _ in range(4):
            gate.on_train_step(0)
    assert plain.capacity() == tail.capacity() == 16  # (4 + 1 + 1) x 4 - 8 started
    assert plain.admit([4, 3, 2, 1]) == [True, True, False, False]
    assert tail.admit([4, 3, 2, 1]) == [True, True, True, True]
    assert tail.admit([0]) == [False]  # 4 versions behind: past the bound
    assert [tail.must_train(v) for v in range(4)] == [True, True, False, False]
    assert [plain.must_train(v) for v in range(4)] == [True, True, True, True]


def test_tail_staleness_is_saved_and_checked():
    gate = StalenessGate(max_staleness=1, batch_size=4, tail_staleness=2)
    assert gate.state_dict()["tail_staleness"] == 2
    with pytest.raises(ValueError, match="tail_staleness must be >= 0"):
        StalenessGate(max_staleness=1, batch_size=4, tail_staleness=-1)


def test_the_tail_is_waited_for_by_mode_and_within_the_drop_budget():
    """`drop` never waits, `wait` always waits for rollouts the next step must train on, and
    `budget` waits only when dropping them all would take the dropped share of the slots that
    ended (trained or dropped) past the budget."""
    gate = StalenessGate(max_staleness=1, batch_size=100)
    gate.try_start(200)
    gate.on_train_step(98)
    assert gate.admit([0]) == [True] and gate.state.version == 1
    gate.on_train_step(0)
    gate.on_train_step(0)
    assert gate.admit([0]) == [False]  # 3 versions behind: dropped as too stale
    gate.drop(20)  # freed for another reason (nothing to train on): not the budget's business
    assert not gate.waits_for_due(5, "drop") and gate.waits_for_due(5, "wait")
    assert not gate.waits_for_due(0, "wait") and not gate.waits_for_due(0, "budget", 0.02)
    assert not gate.waits_for_due(1, "budget", 0.02)  # 2 of 100 ended: at the budget
    assert gate.waits_for_due(2, "budget", 0.02)  # 3 of 101: past it
    assert not gate.waits_for_due(2, "budget", 0.05)
    with pytest.raises(ValueError, match="staleness mode"):
        gate.waits_for_due(1, "sometimes")


def test_the_drop_budget_survives_a_restart_without_counting_the_released_slots():
    gate = StalenessGate(max_staleness=1, batch_size=10)
    gate.try_start(20)
    gate.on_train_step(9)
    gate.on_train_step(0)
    assert gate.admit([0]) == [False]  # 2 versions behind a bound of 1: dropped as too stale
    restored = StalenessGate(max_staleness=1, batch_size=10)
    restored.load_state_dict(gate.state_dict())
    assert restored.state.num_dropped == 1 + 10  # the 10 in flight are released on restart
    assert restored.state.num_dropped_stale == 1
    # 2 of 11 past a 20 % budget would not be; with the 10 released slots counted it would.
    assert not restored.waits_for_due(1, "budget", 0.2) and not gate.waits_for_due(1, "budget", 0.2)
    old = {k: v for k, v in gate.state_dict().items() if k != "num_dropped_stale"}
    restored.load_state_dict(old)  # a checkpoint from before the counter
    assert restored.state.num_dropped_stale == 0
