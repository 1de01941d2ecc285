"""The pool hands each instance's KV-cache usage (from its stats) to the router."""

from __future__ import annotations

from libra.rollout.pool import KV_USAGE_PARTS, InstancePool, PooledInstance
from libra.scheduler import CmlfqConfig, CmlfqRouter, Reason
from tests.rollout.conftest import TOKEN


def test_kv_usage_reaches_the_router_in_parts_per_10000_while_the_instance_serves() -> None:
    router = CmlfqRouter(CmlfqConfig(max_queue_length=3))
    pool = InstancePool(router, TOKEN, router.config)
    for instance_id in (0, 1):
        router.add_instance(instance_id, 0)
        # Stats come from the instance's client; the report itself needs only the pool's record.
        pool._instances[instance_id] = PooledInstance(instance_id, client=None, bucket=0, max_model_len=512)
    pool.report_kv_usage(0, 0.9234)
    pool.report_kv_usage(1, 1.2)  # clamped to the whole cache
    assert [(load.kv_used, load.kv_capacity) for load in router.instance_loads()] == [
        (9234, KV_USAGE_PARTS),
        (KV_USAGE_PARTS, KV_USAGE_PARTS),
    ]
    assert router.admit("t", "p").reason == Reason.ANY_INSTANCE_FALLBACK  # both past kv_full_fraction
    # Stats read before an instance left service are dropped, not sent to a router that forgot it.
    pool._instances[1].lost = True
    router.on_instance_lost(1)
    pool.report_kv_usage(1, 0.1)
    pool.report_kv_usage(7, 0.1)
    assert [load.instance_id for load in router.instance_loads()] == [0]
