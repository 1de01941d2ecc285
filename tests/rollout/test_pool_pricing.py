"""The job's pool gives every new set of buckets the planner's speeds (`job.price_moves`), so
the router prices its moves by the planner's calibrated model on the current history."""

from __future__ import annotations

from libra.planner.config import RequestRecord
from libra.planner.planner import Planner
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_speeds import with_speeds
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.rollout.pool import InstancePool, PooledInstance
from libra.scheduler import BucketConfig, CmlfqConfig, CmlfqRouter, LeastLoadRouter
from tests.planner.helpers import random_problem
from tests.rollout.conftest import TOKEN


def test_bucket_changes_carry_the_planners_speeds() -> None:
    problem = random_problem(0)
    planner = Planner(problem)
    buckets = (BucketConfig("tp1", 1, 1000), BucketConfig("tp2", 2, 2**31 - 1))
    priced = planner.priced_buckets(buckets)
    cost = RolloutCostModel(problem.cluster, problem.model, problem.config, DEFAULT_ROLLOUT_FACTORS)
    assert priced == with_speeds(buckets, cost, problem.history)  # uncalibrated: the model's factors
    assert all(b.speed is not None for b in priced)

    config = CmlfqConfig(buckets=buckets, max_queue_length=3)
    router = CmlfqRouter(config)
    pool = InstancePool(router, TOKEN, config, price_buckets=planner.priced_buckets)
    for instance_id, bucket in ((0, 0), (1, 1)):
        router.add_instance(instance_id, bucket)
        pool._instances[instance_id] = PooledInstance(
            instance_id, client=None, bucket=bucket, max_model_len=512
        )
    new = (BucketConfig("tp1", 1, 500), BucketConfig("tp2", 2, 2**31 - 1))
    pool.update_buckets(new)
    assert pool.buckets == planner.priced_buckets(new)
    assert router.config.speeds == [b.speed.as_tuple() for b in planner.priced_buckets(new)]
    assert router.thresholds == [500, 2**31 - 1]


def test_reprice_follows_the_planners_history() -> None:
    """The job's launch prices on a seed request; after each step the pool prices again on the
    history the planner has then."""
    problem = random_problem(1)
    planner = Planner(problem)
    buckets = planner.priced_buckets((BucketConfig("tp1", 1, 1000), BucketConfig("tp2", 2, 2**31 - 1)))
    config = CmlfqConfig(buckets=buckets, max_queue_length=3)
    router = CmlfqRouter(config)
    pool = InstancePool(router, TOKEN, config, price_buckets=planner.priced_buckets)
    router.add_instance(0, 0)
    pool._instances[0] = PooledInstance(0, client=None, bucket=0, max_model_len=512)
    before = router.config.speeds
    longer = tuple(RequestRecord(r.prompt_tokens * 4 + 100, r.output_tokens * 4) for r in problem.history)
    planner.update_history(longer)
    pool.reprice()
    assert router.config.speeds == [b.speed.as_tuple() for b in planner.priced_buckets(buckets)]
    assert pool.buckets == planner.priced_buckets(buckets) and router.thresholds == [1000, 2**31 - 1]
    # Longer contexts: each live trajectory costs more per step.
    assert all(new[1] > old[1] for new, old in zip(router.config.speeds, before, strict=True))


def test_reprice_leaves_a_router_without_speeds_alone() -> None:
    planner = Planner(random_problem(2))
    config = CmlfqConfig(buckets=(BucketConfig("tp1", 1, 1000), BucketConfig("tp2", 2, 2**31 - 1)))
    pool = InstancePool(LeastLoadRouter(config), TOKEN, config, price_buckets=planner.priced_buckets)
    pool.reprice()
    assert pool.buckets == config.buckets
