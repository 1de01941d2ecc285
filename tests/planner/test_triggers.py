"""Re-plan triggers (periodic, pressure with hysteresis, warm-up, cooldown) and the apply rule."""

from __future__ import annotations

from libra.planner.config import TriggerPolicy
from libra.planner.triggers import ReplanTrigger, StepObservation, TriggerReason, decide_apply

POLICY = TriggerPolicy(plan_interval=5, warmup_steps=2, cooldown_steps=1, min_history=4, hysteresis=0.2)


def obs(step, **kw):
    defaults = dict(train_s=10.0, rollout_s=10.0, history_size=100)
    return StepObservation(step=step, **{**defaults, **kw})


def test_periodic_with_warmup():
    trigger = ReplanTrigger(POLICY)
    reasons = [trigger.observe(obs(s)) for s in range(13)]
    fired = [s for s, r in enumerate(reasons) if r is not TriggerReason.NONE]
    assert fired == [2, 7, 12]
    assert all(reasons[s] is TriggerReason.PERIODIC for s in fired)


def test_not_enough_history_blocks_everything():
    trigger = ReplanTrigger(POLICY)
    assert all(
        trigger.observe(obs(s, history_size=3, queue_pressure=1.0)) is TriggerReason.NONE for s in range(10)
    )


def test_pressure_fires_once_then_rearms_below_hysteresis_band():
    trigger = ReplanTrigger(
        TriggerPolicy(plan_interval=0, warmup_steps=0, cooldown_steps=1, min_history=1, hysteresis=0.2)
    )
    seq = [0.8, 0.8, 0.8, 0.8, 0.7, 0.8, 0.5, 0.8]  # threshold 0.75, re-arms below 0.6
    reasons = [trigger.observe(obs(s, queue_pressure=q)) for s, q in enumerate(seq)]
    assert reasons[0] is TriggerReason.QUEUE_PRESSURE
    assert all(r is TriggerReason.NONE for r in reasons[1:7])  # 0.7 stays inside the band
    assert reasons[7] is TriggerReason.QUEUE_PRESSURE


def test_cooldown_and_other_triggers():
    trigger = ReplanTrigger(TriggerPolicy(plan_interval=0, warmup_steps=0, cooldown_steps=2, min_history=1))
    assert trigger.observe(obs(0, rollout_s=20.0)) is TriggerReason.TIME_RATIO  # 2.0 >= 1.25
    assert trigger.observe(obs(1, rejected_total=50)) is TriggerReason.NONE  # cooldown
    assert trigger.observe(obs(2, rejected_total=50)) is TriggerReason.NONE
    assert trigger.observe(obs(3, rejected_total=50)) is TriggerReason.REJECTED_GROWTH
    assert trigger.observe(obs(6, rejected_total=52, active_pressure=0.9)) is TriggerReason.ACTIVE_PRESSURE


def test_apply_rule():
    policy = TriggerPolicy(plan_interval=10, min_gain_ratio=0.05, reconfiguration_cost_s=15.0)
    assert decide_apply(10.0, 8.0, 15.0, policy).apply  # 2 s x 10 steps = 20 s > 15 s, 20 %
    assert not decide_apply(10.0, 9.0, 15.0, policy).apply  # 10 s < 15 s
    small = decide_apply(100.0, 98.0, 1.0, policy)
    assert not small.apply and "min_gain_ratio" in small.reason  # 2 % < 5 %
    assert not decide_apply(10.0, 10.5, 0.0, policy).apply
    assert decide_apply(10.0, 9.9, 0.0, TriggerPolicy(min_gain_ratio=0.0, reconfiguration_cost_s=0.0)).apply


def test_measured_pressure_is_one_definition_for_job_and_simulator():
    obs = StepObservation.measure(3, 1.0, 2.0, running=96, waiting=32, slots=128, rejected_total=5)
    assert (obs.active_pressure, obs.queue_pressure) == (0.75, 0.25)
    assert (obs.step, obs.train_s, obs.rollout_s, obs.rejected_total) == (3, 1.0, 2.0, 5)
    # Saturated and empty clusters stay within [0, 1]; no instance is no division by zero.
    full = StepObservation.measure(0, 1.0, 1.0, running=500, waiting=900, slots=128)
    assert (full.active_pressure, full.queue_pressure) == (1.0, 1.0)
    none = StepObservation.measure(0, 1.0, 1.0, running=0, waiting=4, slots=0)
    assert (none.active_pressure, none.queue_pressure) == (0.0, 1.0)
