"""The pool gives each instance joining the router its weight by TP size (the job's is the
planner's capacity model), and gives it again when a cut instance is restored."""

from __future__ import annotations

from libra.rollout.pool import InstancePool
from libra.scheduler import BucketConfig, CmlfqConfig, CmlfqRouter, Reason
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


async def _derived_pool(num_instances: int) -> tuple[list, CmlfqRouter, InstancePool]:
    """`num_instances` fake instances served, and a pool over TP-1 / TP-4 buckets (weights 1 / 5)
    whose cap is derived from 70 trajectories in flight; no instance added yet."""
    served = [await serve_fake(ScriptedInstance([[1]], tool_call_end_id=2)) for _ in range(num_instances)]
    config = CmlfqConfig(
        buckets=(BucketConfig("short", 1, 100), BucketConfig("long", 4, 1000)), max_queue_length=10
    )
    router = CmlfqRouter(config)
    weights = {1: 1, 4: 5}
    pool = InstancePool(router, TOKEN, config, weight_of_tp=weights.__getitem__, trajectories_in_flight=70)
    return served, router, pool


def test_a_derived_cap_follows_the_instances_in_service() -> None:
    """Given the trajectories in flight (the config's cap left 0, resolved at launch), the pool
    derives the router's cap again whenever an instance joins, is cut, drained, restored or lost:
    the fair share per unit of the weight in service (`fair_queue_length`)."""

    async def main() -> None:
        served, router, pool = await _derived_pool(3)
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


def test_instances_a_plan_starts_are_held_as_loading_until_they_join() -> None:
    """`expect`: while a plan starts instances, the cap counts them and what the ready ones have
    no room for waits for them (the router answers no instance; the waiters are woken when one
    joins or a trajectory frees room); the one that joins takes an expected one's place, and what
    the plan gave up is released, waking the waiters to overflow as before."""

    async def main() -> None:
        served, router, pool = await _derived_pool(2)
        try:
            await pool.add(0, served[0][1], tp_size=1)
            assert router.config.max_queue_length == 70
            woken = pool.changed
            pool.expect((4, 1))
            assert woken.is_set()
            assert router.config.max_queue_length == 10  # 70 over the weight 1 + 5 + 1
            placed = [router.admit(f"t{i}", "p").instance_id for i in range(11)]
            assert placed == [0] * 10 + [None]  # the 11th waits for an instance still loading
            freed = pool.changed
            pool.room_freed()  # a trajectory ended: the waiters try again
            assert freed.is_set()
            waiting = pool.changed
            await pool.add(1, served[1][1], tp_size=4)
            assert waiting.is_set()
            assert router.reroute("t10").instance_id == 1
            assert router.config.max_queue_length == 10  # the TP-1 one is still expected
            released = pool.changed
            pool.expect(())  # the plan ended without it
            assert released.is_set()
            quiet = pool.changed
            pool.room_freed()  # nothing expected: nobody waits for room
            assert not quiet.is_set()
            assert router.config.max_queue_length == 12  # ceil(70 / 6)
            assert {load.instance_id for load in router.instance_loads()} == {0, 1}
            for i in range(11, 11 + 12 * 6 - 11):  # every instance at its cap
                assert router.admit(f"t{i}", "p").instance_id is not None
            overflow = router.admit("last", "p")  # full, nothing loading: overflow, as before
            assert overflow.instance_id is not None and overflow.reason is Reason.ANY_INSTANCE_FALLBACK
        finally:
            await pool.close()
            for server, _ in served:
                await server.stop(None)

    run(main())
