"""The planner's candidates and its rescorer: the model's optimum, the best homogeneous pool of
each TP size and two-size pools on the optimum's split are scored, the best score is adopted, and
a re-plan must beat the running plan's score. The rescorers here are fakes (scores chosen by the
test); the simulator's own rescorer is tested in tests/sim/test_rescoring.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from libra.planner.candidates import MIXED_SHARES, candidate_plans, mixed_pool_plans
from libra.planner.planner import Planner
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_thresholds import capacity_thresholds
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, search
from libra.planner.triggers import StepObservation
from tests.planner.helpers import EVERY_STEP
from tests.planner.test_diff_and_planner import make_plan, sample_without_floors


def _tp_sizes(plan) -> set[int]:
    return {i.tp for i in plan.instances}


def test_candidates_are_the_optimum_then_one_plan_per_tp_size_then_mixes_none_twice():
    problem = sample_without_floors()
    optimum = search(problem)
    plans = candidate_plans(problem)
    assert plans[0].layout_key == optimum.layout_key
    assert len({p.layout_key for p in plans}) == len(plans)
    singles = [p for p in plans[1:] if len(_tp_sizes(p)) == 1]
    mixes = [p for p in plans[1:] if len(_tp_sizes(p)) > 1]
    assert plans[1:] == singles + mixes and mixes
    assert [p.layout_key for p in candidate_plans(problem, mixed=False)[1:]] == [
        p.layout_key for p in singles
    ]
    # Every TP size of the space that holds the model is there, unless it is the optimum's own pool.
    sizes = {next(iter(_tp_sizes(p))) for p in singles}
    if len(_tp_sizes(optimum)) == 1:
        sizes |= _tp_sizes(optimum)
    assert sizes == set(problem.config.search.rollout_tp_sizes)
    assert [p.predicted_step_s for p in singles] == sorted(p.predicted_step_s for p in singles)
    # No single-size plan beats the optimum in the model (it searched a superset).
    assert all(p.predicted_step_s >= optimum.predicted_step_s * (1 - 1e-3) for p in singles)


def test_mixed_candidates_are_two_size_pools_on_the_optimums_split():
    problem = sample_without_floors()
    optimum = search(problem)
    mixes = mixed_pool_plans(problem, optimum)
    cluster = problem.cluster
    rollout_devices = cluster.num_devices - optimum.training.config.num_devices
    assert mixes
    for plan in mixes:
        (small, n_small), (large, n_large) = [(b.tp, b.num_instances) for b in plan.buckets]
        assert small < large and n_small >= 1 and n_large >= 1
        assert small * n_small + large * n_large == rollout_devices  # they fill the rollout devices
        assert plan.training == optimum.training
        assert math.isfinite(plan.predicted_step_s)  # priced by the model (and validated by it)
        # The thresholds are those C-MLFQ would fit to the buckets' capacity.
        cost = RolloutCostModel(cluster, problem.model, problem.config, DEFAULT_ROLLOUT_FACTORS)
        expected = capacity_thresholds(
            cost, ((small, n_small), (large, n_large)), problem.history, demote=False
        )
        assert tuple(b.max_output_tokens for b in plan.buckets) == expected
    # Each pair of sizes at about a quarter, a half and three quarters of the devices (distinct counts).
    pairs = {(b[0].tp, b[1].tp) for b in (p.buckets for p in mixes)}
    for small, large in pairs:
        counts = sorted(
            p.buckets[1].num_instances for p in mixes if (p.buckets[0].tp, p.buckets[1].tp) == (small, large)
        )
        assert counts == sorted(
            {
                max(1, round(share * rollout_devices / large))
                for share in MIXED_SHARES
                if rollout_devices - max(1, round(share * rollout_devices / large)) * large >= small
            }
        )


def test_initial_plan_adopts_the_best_score_not_the_models_optimum():
    problem = sample_without_floors()
    seen = []

    def prefer_tp2(plans):  # fake: scores a plan by its share of TP-2 instances
        seen.append(list(plans))
        return [sum(i.tp == 2 for i in p.instances) / len(p.instances) for p in plans]

    events = []
    planner = Planner(problem, on_event=events.append, rescorer=prefer_tp2)
    adoption = planner.initial_plan()
    assert _tp_sizes(adoption.plan) == {2}
    assert seen[0][0].layout_key == search(problem).layout_key  # the optimum was scored first
    assert "re-scored" in adoption.reason and "xTP2" in events[-1].message
    assert planner.rescorings[-1].scored[0][0].layout_key == adoption.plan.layout_key


def test_a_replan_must_beat_the_running_plans_score():
    problem = sample_without_floors()
    scores = {}

    def by_table(plans):  # fake: the running plan scores `scores["current"]`, every other 1.0
        return [scores["current"] if p.layout_key == scores["key"] else 1.0 for p in plans]

    events = []
    planner = Planner(problem, on_event=events.append, rescorer=by_table)
    poor = make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1])
    planner.propose(poor)
    scores.update(current=2.0, key=planner.current.layout_key)
    planner.set_policy(EVERY_STEP)
    # The model would move off the poor plan, but the rescorer says it is the fastest: kept.
    current = planner.current
    assert planner.observe(StepObservation(0, train_s=30.0, rollout_s=30.0)) is None
    assert planner.current is current
    assert events[-1].kind == "rejected" and "re-scored" in events[-1].message
    # Scored below the alternatives, it is replaced by the best of them.
    scores["current"] = 0.5
    adoption = planner.observe(StepObservation(1, train_s=30.0, rollout_s=30.0))
    assert adoption is not None and adoption.plan.layout_key != scores["key"]


def test_a_running_plan_that_no_longer_fits_is_not_scored():
    problem = sample_without_floors()
    scored = []

    def spy(plans):  # fake: records what it is asked, scores all alike
        scored.append([p.layout_key for p in plans])
        return [1.0] * len(plans)

    planner = Planner(problem, rescorer=spy)
    planner.propose(make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1]))
    running = planner.current.layout_key
    planner.set_policy(EVERY_STEP)
    # As when the grown sequences no longer fit its training memory (`_price_current` gives inf).
    planner._price_current = lambda: math.inf
    adoption = planner.observe(StepObservation(0, train_s=30.0, rollout_s=30.0))
    assert adoption is not None and running not in scored[-1]
    assert adoption.plan.layout_key == scored[-1][0]  # all tied: the model's optimum, listed first


@pytest.mark.parametrize(
    "scores",
    [
        lambda n: [1.0] * (n - 1),  # one plan unscored
        lambda n: [-1.0] + [1.0] * (n - 1),  # not a rate
        lambda n: [math.nan] * n,
    ],
)
def test_a_rescorer_must_score_every_plan_with_a_rate(scores):
    planner = Planner(sample_without_floors(), rescorer=lambda plans: scores(len(plans)))
    with pytest.raises(ValueError, match=r"one finite score >= 0 per plan"):
        planner.initial_plan()


def test_rollout_sizes_that_cannot_shard_the_heads_are_not_searched():
    problem = sample_without_floors()
    # Qwen2.5-7B's 28 query / 4 KV heads: TP 1, 2, 4 shard them, TP 8 would split a head.
    model = dataclasses.replace(problem.model, num_attention_heads=28, num_kv_heads=4, head_dim=128)
    assert [tp for tp in (1, 2, 4, 8) if model.serves_at_tp(tp)] == [1, 2, 4]
    # KV heads fewer than the TP size are replicated evenly, or not at all.
    assert model_with(32, 2).serves_at_tp(4) and not model_with(24, 3).serves_at_tp(2)
    seven_b = dataclasses.replace(problem, model=model)
    assert all(8 not in _tp_sizes(p) for p in candidate_plans(seven_b))


def model_with(heads: int, kv_heads: int):
    return dataclasses.replace(
        sample_without_floors().model, num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=128
    )


@pytest.mark.parametrize("edge, replaced", [(0.01, False), (0.03, True)])
def test_another_candidate_must_beat_the_optimum_by_the_margin(edge, replaced):
    problem = sample_without_floors()
    optimum = search(problem)

    def edge_for_the_last(plans):  # fake: the last candidate scores `edge` above the rest
        return [1.0 + edge if i == len(plans) - 1 else 1.0 for i in range(len(plans))]

    assert problem.config.policy.rescore_margin == 0.02
    adopted = Planner(problem, rescorer=edge_for_the_last).initial_plan().plan
    assert (adopted.layout_key != optimum.layout_key) == replaced
