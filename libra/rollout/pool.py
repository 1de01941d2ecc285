"""The controller's view of its rollout instances: clients, buckets, and loss handling.

Instances join with their TP size, which names their bucket (the scheduler's `CmlfqConfig`
buckets); the pool tells the router. An instance is lost when a call to it fails and a health
probe confirms it is gone, or when the control plane reports its worker ended (`mark_lost`).
Loss is reported to the router exactly once; the trajectories it displaces are rerouted by their
own agent-loop tasks, which hold the tokens they have kept.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from libra.config import ControlConfig
from libra.rollout.client import InstanceClient
from libra.scheduler.config import CmlfqConfig
from libra.scheduler.interface import Router

logger = logging.getLogger(__name__)


@dataclass
class PooledInstance:
    instance_id: int
    client: InstanceClient
    bucket: int
    max_model_len: int
    lost: bool = False


class InstancePool:
    def __init__(self, router: Router, token: str, cmlfq: CmlfqConfig, control: ControlConfig | None = None):
        self.router = router
        self._token = token
        self._cmlfq = cmlfq
        self._control = control
        self._instances: dict[int, PooledInstance] = {}
        self.changed = asyncio.Event()
        """Set whenever an instance joins (trajectories waiting for one wake up)."""

    def bucket_of_tp(self, tp_size: int) -> int:
        for index, bucket in enumerate(self._cmlfq.buckets):
            if bucket.tp_size == tp_size:
                return index
        raise ValueError(
            f"no bucket has tp_size={tp_size}; buckets: {[b.tp_size for b in self._cmlfq.buckets]}"
        )

    async def add(self, instance_id: int, address: str, tp_size: int | None = None) -> PooledInstance:
        """Connects to the instance, reads its TP size and context window, and adds it to the
        router in the bucket of its TP size."""
        if instance_id in self._instances and not self._instances[instance_id].lost:
            raise ValueError(f"instance {instance_id} is already in the pool")
        client = InstanceClient(address, self._token, self._control)
        stats = await client.stats()
        tp = stats.tensor_parallel_size if tp_size is None else tp_size
        pooled = PooledInstance(instance_id, client, self.bucket_of_tp(tp), stats.max_model_len)
        self._instances[instance_id] = pooled
        self.router.add_instance(instance_id, pooled.bucket)
        self.changed.set()
        self.changed = asyncio.Event()
        logger.info("rollout instance %d at %s joined bucket %d", instance_id, address, pooled.bucket)
        return pooled

    def get(self, instance_id: int) -> PooledInstance:
        return self._instances[instance_id]

    def live_ids(self) -> list[int]:
        return sorted(i for i, p in self._instances.items() if not p.lost)

    async def confirm_lost(self, instance_id: int) -> bool:
        """After a failed call: probes the instance and marks it lost if it does not answer.
        Returns whether it is (now) lost."""
        pooled = self._instances[instance_id]
        if pooled.lost:
            return True
        if await pooled.client.is_serving():
            return False
        self.mark_lost(instance_id, "health probe failed after a failed call")
        return True

    def mark_lost(self, instance_id: int, reason: str) -> list[str]:
        """Tells the router once; returns the trajectories it displaced (they reroute themselves)."""
        pooled = self._instances.get(instance_id)
        if pooled is None or pooled.lost:
            return []
        pooled.lost = True
        displaced = self.router.on_instance_lost(instance_id)
        logger.warning(
            "rollout instance %d lost (%s); %d trajectories displaced", instance_id, reason, len(displaced)
        )
        return displaced

    async def close(self) -> None:
        await asyncio.gather(*(p.client.close() for p in self._instances.values()), return_exceptions=True)
