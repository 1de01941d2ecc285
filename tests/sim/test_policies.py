"""Whole-loop checks of every policy on a tiny cluster: conservation, determinism, and each
baseline behaving as specified."""

import dataclasses

import pytest

from libra.planner.config import PlannerConfig
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.planner.triggers import TriggerReason
from libra.scheduler.baselines import LengthMlfqRouter
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.sim.config import POLICIES
from libra.sim.engine import RolloutCluster
from libra.sim.runner import run_comparison
from libra.sim.workloads import WorkloadConfig
from tests.sim.helpers import tiny_config, trace


@pytest.fixture(scope="module")
def comparison():
    return run_comparison(tiny_config(), log=lambda line: None)


def test_every_policy_runs_its_steps_and_conserves(comparison):
    # Nodes of 4 devices: no TP-8 pool to hold Libra against.
    assert set(comparison.results) == set(POLICIES) - {"homogeneous_tp8"}
    assert "does not divide a node of 4" in comparison.skipped["homogeneous_tp8"]
    for name, r in comparison.results.items():
        assert r.num_steps == 4, name
        assert r.trajectories == 4 * 16, name
        roles = sum(r.device_seconds[k] for k in ("train", "rollout", "loading", "unassigned"))
        assert roles == pytest.approx(r.num_devices * r.makespan_s, rel=1e-9), name
        for stage in ("train", "rollout"):
            assert r.device_seconds[f"{stage}_busy"] <= r.device_seconds[stage] * (1 + 1e-9) + 1e-6, name
        # Every started trajectory was consumed, dropped, aborted or is still in flight -- never twice.
        assert r.finished <= r.started, name
        assert r.trajectories + r.dropped <= r.finished, name
        assert len(r.staleness) == r.trajectories
        assert r.ideal_step_s <= r.step_s, name


def test_deterministic_per_seed(comparison):
    again = run_comparison(tiny_config(), log=lambda line: None)
    for name, r in comparison.results.items():
        assert again.results[name].makespan_s == r.makespan_s
        assert again.results[name].staleness == r.staleness
    other = run_comparison(
        tiny_config(
            workload=WorkloadConfig(name="r2e", group_size=4, num_prompts=50, seed=1), policies=("libra",)
        ),
        log=lambda line: None,
    )
    assert other.results["libra"].makespan_s != comparison.results["libra"].makespan_s


def test_colocated_sync_is_on_policy_and_serial(comparison):
    r = comparison.results["colocated_sync"]
    assert set(r.staleness) == {0} and r.dropped == 0 and r.migrations == 0
    switch = tiny_config().costs.colocate_switch_s
    for s in r.steps:  # rollout, switch, train, switch back -- nothing overlaps
        assert s.ended_at - s.started_at == pytest.approx(s.wait_s + s.train_s + 2 * switch)
        assert s.stall_s == 2 * switch
    assert r.steps[-1].ended_at == pytest.approx(r.makespan_s)


def test_async_policies_respect_their_staleness_bound(comparison):
    bound = tiny_config().batch.max_staleness
    assert max(comparison.results["disaggregated_static"].staleness) <= 1
    for name in ("length_mlfq", "libra", "libra_no_cmlfq", "libra_no_elastic", "libra_no_planner"):
        assert max(comparison.results[name].staleness) <= bound, name


def test_waiting_for_the_tail_keeps_every_finished_trajectory():
    """`wait`: the trainer waits for trajectories launched max_staleness versions ago, so none
    is dropped and the bound holds; `drop` never waits and drops the tail (the long ones);
    `budget` drops it only while the dropped share stays within its budget."""
    budget = 0.03
    results = {
        mode: run_comparison(
            tiny_config(num_steps=8, staleness_mode=mode, drop_budget=budget, policies=("libra",)),
            log=lambda line: None,
        ).results["libra"]
        for mode in ("wait", "drop", "budget")
    }
    bound = tiny_config().batch.max_staleness
    assert results["wait"].dropped_share <= 0.02 and max(results["wait"].staleness) <= bound
    assert results["drop"].dropped_share > budget and max(results["drop"].staleness) <= bound
    assert 0 < results["budget"].dropped_share <= budget and max(results["budget"].staleness) <= bound


def test_a_tail_bound_keeps_the_late_trajectories_within_it():
    """`tail_staleness` 2 on top of max_staleness 1: fewer finished trajectories dropped than
    with none, no trained token older than the whole bound, and the rollout side launches no
    further ahead (the same trajectories started per step)."""
    results = {
        tail: run_comparison(
            tiny_config(num_steps=8, tail_staleness=tail, policies=("libra", "disaggregated_static")),
            log=lambda line: None,
        ).results
        for tail in (0, 2)
    }
    bound = tiny_config().batch.max_staleness
    assert results[0]["libra"].dropped > results[2]["libra"].dropped
    assert max(results[0]["libra"].staleness) <= bound < max(results[2]["libra"].staleness) <= bound + 2
    # A policy that names its own staleness (one-step off-policy) keeps exactly it.
    assert max(results[2]["disaggregated_static"].staleness) <= 1


def test_tail_batching_aborts_the_tail_and_reruns_it():
    config = tiny_config(num_steps=8, policies=("tail_batching",))
    r = run_comparison(config, log=lambda line: None).results["tail_batching"]
    # Each normal round launches ceil(4 x 1.25) = 5 groups and keeps 4: one group aborted...
    assert r.aborted > 0
    # ...and once 4 aborted prompts queued, a long round runs them: fewer groups drawn than launched.
    assert r.started < 8 * 5 * 4
    assert set(r.staleness) == {0}


def test_homogeneous_least_load_never_migrates(comparison):
    assert comparison.results["disaggregated_static"].migrations == 0


def test_length_mlfq_promotes_once_generated_tokens_pass_the_threshold():
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(buckets=(BucketConfig("s", 1, 100), BucketConfig("l", 2, 10_000)), max_queue_length=3)
    cluster = RolloutCluster(LengthMlfqRouter(cmlfq), cmlfq, cost, max_batch=8)
    small = cluster.add_instance("s", 1, 0, (0,), 0.0)
    large = cluster.add_instance("l", 2, 1, (2, 3), 0.0)
    placements = []
    original = cluster._run_turn
    cluster._run_turn = lambda traj: (placements.append(traj.instance), original(traj))
    cluster.start(trace("short", [50, 20, 10], prompt=10))
    cluster.start(trace("long", [150, 20, 10], prompt=10, prompt_id="p1"))
    cluster.run_until(lambda: False)
    assert cluster.num_migrations == 1  # only "long" passed 100 generated tokens
    assert placements.count(large.instance_id) == 2 and placements.count(small.instance_id) == 4


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="sim.policies"):
        tiny_config(policies=("nope",))
    with pytest.raises(ValueError, match="group_size"):
        tiny_config(workload=dataclasses.replace(tiny_config().workload, group_size=8))
    with pytest.raises(ValueError, match="sim.profile"):
        tiny_config(profile="tpu")
    with pytest.raises(ValueError, match="sim.planner_rescore_steps"):
        tiny_config(planner_rescore_steps=-1)


def test_every_re_plan_is_logged_with_its_verdict(comparison):
    """Each re-plan leaves a note: the trigger's reason and the planner's verdict (for an applied
    one, the apply rule's numbers)."""
    for name in ("libra", "libra_no_elastic", "libra_no_cmlfq"):
        r = comparison.results[name]
        rejected = [n for n in r.notes if "re-plan rejected by the planner" in n]
        applied = [n for n in r.notes if "re-plan applied by the planner" in n]
        assert len(rejected) == r.plans_rejected and len(applied) == r.plans_applied, name
        assert rejected or applied, name  # the tiny run re-plans (plan_interval=2)
        assert all(n.split(": ")[2] in {t.value for t in TriggerReason} for n in rejected), name
        assert all("gain" in n and "net gain" in n for n in applied), name


def test_cmlfq_prices_its_moves_from_the_cost_model_unless_told_not_to():
    from libra.planner.routing_speeds import bucket_speed
    from libra.sim.loop import AsyncRun, preflight_history
    from libra.sim.pools import build_layout

    config = tiny_config()
    history = preflight_history(config)
    policy = POLICIES["libra_no_planner"]
    layout = build_layout(config, policy, history, None)
    cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
    priced = AsyncRun(config, policy, layout, history).cluster.router.config.buckets
    assert len(priced) > 1
    assert [b.speed for b in priced] == [bucket_speed(cost, b.tp_size, history) for b in priced]
    kv_move = dataclasses.replace(config, costs=dataclasses.replace(config.costs, migration="kv_move"))
    free_moves = AsyncRun(kv_move, policy, layout, history).cluster.router.config.buckets
    assert all(b.speed.move_linear_s == b.speed.move_quadratic_s == 0 for b in free_moves)
    unpriced = dataclasses.replace(config, cmlfq_price_moves=False)
    assert all(
        b.speed is None for b in AsyncRun(unpriced, policy, layout, history).cluster.router.config.buckets
    )


def test_cmlfq_speeds_follow_the_runs_history_after_every_step():
    """As the job re-prices after each step, the simulator's router ends the run with the speeds
    of the history the run left, not the preflight's it launched with."""
    from libra.planner.routing_speeds import bucket_speed
    from libra.sim.loop import AsyncRun, preflight_history
    from libra.sim.pools import build_layout

    config = tiny_config()
    history = preflight_history(config)
    policy = POLICIES["libra_no_planner"]
    run = AsyncRun(config, policy, build_layout(config, policy, history, None), history)
    launch = [b.speed for b in run.cluster.router.config.buckets]
    finished_steps = []
    reprice = run.cluster.reprice

    def counting(price):
        finished_steps.append(run.step)
        reprice(price)

    run.cluster.reprice = counting
    run.run()
    cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
    final = run.cluster.router.config.buckets
    assert finished_steps == list(range(1, config.num_steps + 1))
    assert [b.speed for b in final] == [bucket_speed(cost, b.tp_size, tuple(run.history)) for b in final]
    assert [b.speed for b in final] != launch
