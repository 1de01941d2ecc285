"""Uneven DP shares in the simulator: which policies' re-plans may use them, and how a training
step with unequal group-granular shares is priced."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from libra.planner.config import SearchConfig, TrainingBatch
from libra.planner.diff import JoinHybridReplica, RestartTraining, diff_plans
from libra.planner.evaluate import evaluate_plan
from libra.planner.plan import TrainingPlacement, place_rollout
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel
from libra.sim.config import POLICIES, load_sim_config
from libra.sim.loop import AsyncRun, preflight_history, training_layout
from libra.sim.pools import build_layout, initial_plan, planning_problem
from tests.sim.helpers import tiny_config


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    history = preflight_history(config)
    return config, history, initial_plan(config, history, config.batch.max_staleness)


def test_only_policies_with_the_elastic_pool_replan_with_uneven_shares(setup):
    config, history, plan = setup
    replanning = [p for p in POLICIES.values() if p.replan]
    assert {p.name for p in replanning} == {"libra", "libra_no_cmlfq", "libra_no_elastic"}
    for policy in replanning:
        run = AsyncRun(config, policy, build_layout(config, policy, history, plan), history)
        assert run._planning_problem().config.search.uneven_data_parallel is policy.elastic, policy.name
    # The launch plan forms Megatron DP groups: equal shares, whatever the config asks.
    asked = dataclasses.replace(
        config,
        planner=dataclasses.replace(config.planner, search=SearchConfig(uneven_data_parallel=True)),
    )
    assert not planning_problem(asked, history, 1).config.search.uneven_data_parallel
    groups = config.batch.global_batch // config.batch.group_size
    assert groups % plan.training.config.dp == 0


def test_uneven_training_step_waits_for_the_largest_share(setup):
    """16 sequences in 4 groups over DP 3: one replica trains 2 groups, so the step is the one
    of DP 3 with 2 groups on every replica (24 sequences), slower than DP 4 (1 group each)."""
    config, history, plan = setup
    policy = POLICIES["libra"]
    run = AsyncRun(config, policy, build_layout(config, policy, history, plan), history)
    lengths = [900 + 150 * i for i in range(config.batch.global_batch)]
    batch = [SimpleNamespace(trace=SimpleNamespace(total_tokens=n)) for n in lengths]
    seqs = SequenceStats(
        sum(lengths) / len(lengths), sum(n * n for n in lengths) / len(lengths), max(lengths)
    )
    every_replica_full = TrainingCostModel(
        config.cluster,
        config.model,
        dataclasses.replace(run.train_cost.batch, global_batch=24),
        config.planner,
        config.train_factors,
    )
    uneven = TrainingConfig(1, 1, 3, 1)
    assert run._train_s(batch, uneven) == every_replica_full.step_s(uneven, seqs)
    assert run._train_s(batch, TrainingConfig(1, 1, 4, 1)) < run._train_s(batch, uneven)
    assert training_layout(uneven, config.batch) == "3 devices TP1 PP1 DP3 mb1 (groups 2 x1 + 1 x2)"
    assert training_layout(TrainingConfig(1, 1, 4, 1), TrainingBatch(16, 4)).endswith("(groups 1 x4)")


def test_growing_by_replicas_with_uneven_shares_is_an_elastic_join():
    """At 48 A800 the launch trains TP4 x DP8 on 32 groups; two more TP4 replicas (DP 10: shares
    of 4 and 3 groups) join as hybrid replicas without restarting training -- a plan only the
    elastic policies' problem accepts, priced on its largest share."""
    config = load_sim_config("configs/sim_r2e_48xa800.py")
    history = preflight_history(config)
    launch = initial_plan(config, history, config.batch.max_staleness)
    assert launch.training.config == TrainingConfig(4, 1, 8, 1)
    grown_cfg = TrainingConfig(4, 1, 10, 1)
    tp = launch.buckets[-1].tp  # rollout keeps its TP size on the devices training leaves it
    count = (config.num_devices - grown_cfg.num_devices) // tp
    instances = place_rollout(
        grown_cfg.num_devices, config.num_devices, config.devices_per_node, [tp] * count
    )
    buckets = (dataclasses.replace(launch.buckets[-1], num_instances=count),)
    grown = dataclasses.replace(
        launch, training=TrainingPlacement(grown_cfg), instances=instances, buckets=buckets
    )
    elastic_problem = planning_problem(config, history, 2, elastic=True)
    priced = evaluate_plan(elastic_problem, grown, config.train_factors, config.rollout_factors)
    # The largest share is still ceil(32/10) = 4 groups, as at DP 8: no faster (group-granular
    # shares pay only where ceil(G/DP) drops), only a slightly larger DP reduction.
    assert launch.predicted_train_s <= priced.predicted_train_s < 1.01 * launch.predicted_train_s
    with pytest.raises(ValueError, match="uneven_data_parallel"):
        evaluate_plan(planning_problem(config, history, 2), grown)
    marked, actions = diff_plans(launch, priced, cut_inflight=True)
    assert marked.training.hybrid_replicas == (8, 9)
    assert not any(isinstance(a, RestartTraining) for a in actions)
    assert [a.replica for a in actions if isinstance(a, JoinHybridReplica)] == [8, 9]
