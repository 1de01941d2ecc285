"""The pool gives each instance joining the router its weight by TP size (the job's is the
planner's capacity model), and gives it again when a cut instance is restored."""

from __future__ import annotations

from libra.rollout.pool import InstancePool
from libra.scheduler import BucketConfig, CmlfqConfig, CmlfqRouter
from tests.rollout.conftest import TOKEN, run
from tests.rollout.fake_instance import ScriptedInstance, serve_fake
from tests.rollout.helpers import PlannedRouter


def test_instances_join_the_router_with_their_weight_and_keep_it_when_restored() -> None:
    async def main() -> None:
        served = [await serve_fake(ScriptedInstance([[1]], tool_call_end_id=2)) for _ in range(3)]
        router = PlannedRouter([0])
        config = CmlfqConfig(buckets=(BucketConfig("short", 1, 100), BucketConfig("long", 4, 1000)))
        pool = InstancePool(router, TOKEN, config, weight_of_tp={1: 1, 4: 5}.__getitem__)
        unweighted = InstancePool(PlannedRouter([0]), TOKEN, config)
        try:
            for instance_id, ((_, address), tp) in enumerate(zip(served, (1, 1, 4), strict=True)):
                await pool.add(instance_id, address, tp_size=tp)
            assert router.weights == {0: 1, 1: 1, 2: 5}
            assert [pool.get(i).weight for i in range(3)] == [1, 1, 5]
            pool.cut(2, "a plan takes it")
            assert router.weights == {0: 1, 1: 1}
            await pool.restore(2)
            assert router.weights == {0: 1, 1: 1, 2: 5}
            # Without a weight function every instance weighs 1 (the router's default).
            await unweighted.add(0, served[2][1], tp_size=4)
            assert unweighted.router.weights == {0: 1}
        finally:
            await pool.close()
            await unweighted.close()
            for server, _ in served:
                await server.stop(None)

    run(main())


def test_a_derived_cap_follows_the_instances_in_service() -> None:
    """Given the trajectories in flight (the config's cap left 0, resolved at launch), the pool
    derives the router's cap again whenever an instance joins, is cut, drained, restored or lost:
    the fair share per unit of the weight in service (`fair_queue_length`)."""

    async def main() -> None:
        served = [await serve_fake(ScriptedInstance([[1]], tool_call_end_id=2)) for _ in range(3)]
        config = CmlfqConfig(
            buckets=(BucketConfig("short", 1, 100), BucketConfig("long", 4, 1000)), max_queue_length=10
        )
        router = CmlfqRouter(config)
        pool = InstancePool(
            router, TOKEN, config, weight_of_tp={1: 1, 4: 5}.__getitem__, trajectories_in_flight=70
        )
        caps = []
        try:
            for instance_id, ((_, address), tp) in enumerate(zip(served, (1, 1, 4), strict=True)):
                await pool.add(instance_id, address, tp_size=tp)
                caps.append(router.config.max_queue_length)
            assert caps == [70, 35, 10]  # weights 1, 2, 7
            pool.cut(2, "a plan takes it")
            assert router.config.max_queue_length == 35
            await pool.restore(2)
            assert router.config.max_queue_length == 10
            pool.drain(2)  # leaving: it takes no new trajectories, and does not count
            assert router.config.max_queue_length == 35
            await pool.restore(2)
            assert router.config.max_queue_length == 10
            pool.mark_lost(0, "test: its worker died")
            assert router.config.max_queue_length == 12  # ceil(70 / 6)
        finally:
            await pool.close()
            for server, _ in served:
                await server.stop(None)

    run(main())
