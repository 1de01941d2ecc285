"""The controller's view of its rollout instances: clients, buckets, and loss handling.

Instances join with their TP size, which names their bucket (the scheduler's `CmlfqConfig`
buckets); the pool tells the router. An instance is lost when a call to it fails and a health
probe confirms it is gone, or when the control plane reports that its worker ended: `worker_ended`
(the job's fleet calls it from its one watchdog), or, for a pool used on its own, the pool's
subscription to the controller's `WatchEvents` (`watch_controller`). Loss is reported to the router
exactly once, and the instance's calls in flight are ended at once, so that the trajectories it
displaces reroute themselves (their agent-loop tasks hold the tokens they kept) instead of
waiting for a connection error or a call deadline.

A plan takes instances away on purpose (`libra.rollout.plan_control`): `drain` stops routing to
one, `cut` also ends its calls so that its trajectories reroute at once, `restore` undoes both and
`remove` forgets it. Such an instance is `withdrawn`: a cut one is out of service like a lost one
(the agent loop reroutes away from it) but nothing counts it as a failure, and the end of its
worker is no loss. While a plan starts new instances, the pool holds each in the router as
loading (`expect`) until it joins, so that what the instances left have no room for waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from libra.control import convert as control_convert
from libra.control.config import ControlConfig
from libra.control.types import EventKind
from libra.rollout.client import InstanceClient, open_aio_channel
from libra.scheduler.config import BucketConfig, CmlfqConfig, bucket_of
from libra.scheduler.interface import FairQueueLength, Router, reprice
from libra.v1 import controller_pb2, controller_pb2_grpc

logger = logging.getLogger(__name__)

WORKER_END_EVENTS = (EventKind.WORKER_EXITED, EventKind.WORKER_LOST, EventKind.WORKER_STOPPED)
"""Controller events after which a worker no longer serves: it exited by itself, its node agent
was lost, or it was stopped."""
_WATCH_RETRY_S = 1.0
"""Pause before re-subscribing after the event stream broke (the controller restarting)."""
EXPECTED_ID_BASE = 1 << 40
"""Router ids of the instances a plan is starting (`InstancePool.expect`), apart from the pool's
own (the job's, counted from 0)."""
KV_USAGE_PARTS = 10_000
"""The capacity KV usage is reported to the router with: `InstanceStats` carries a share, not
the engine's KV tokens, so the router gets parts per 10,000 of 10,000."""


@dataclass
class PooledInstance:
    instance_id: int
    client: InstanceClient
    bucket: int
    max_model_len: int
    worker_id: str = ""
    """The control plane's worker id of the instance process ("" when not started as a worker)."""
    weight: int = 1
    """Its router weight (`Router.add_instance`)."""
    lost: bool = False
    """Out of service: the router no longer knows it and its client refuses calls (it died, or a
    plan cut it: see `withdrawn`)."""
    lost_reason: str = ""
    withdrawn: bool = False
    """A plan is taking it away (drained or cut): its calls ending or its worker stopping is
    planned, not a failure; the job must not restart it."""


class InstancePool:
    def __init__(
        self,
        router: Router,
        token: str,
        cmlfq: CmlfqConfig,
        control: ControlConfig | None = None,
        price_buckets: Callable[[Sequence[BucketConfig]], tuple[BucketConfig, ...]] | None = None,
        weight_of_tp: Callable[[int], int] | None = None,
        trajectories_in_flight: int = 0,
    ):
        self.router = router
        self._token = token
        self._cmlfq = cmlfq
        self._price_buckets = price_buckets
        """Gives new buckets their speeds (the planner's model), or None: they keep what they have."""
        self._weight_of_tp = weight_of_tp
        """An instance's router weight by its TP size (its KV capacity relative to the smallest
        instance's: the planner's model), or None: every instance weighs 1."""
        self._queue_length = (
            FairQueueLength(router, trajectories_in_flight, cmlfq.max_queue_length)
            if trajectories_in_flight
            else None
        )
        """The router's cap, derived again from the pool's weight whenever an instance joins or
        leaves service, is drained, or a plan expects one (`FairQueueLength`); None: the
        config's cap (set by hand) is kept."""
        self._control = control
        self._instances: dict[int, PooledInstance] = {}
        self._removed: dict[int, PooledInstance] = {}
        """Instances a plan removed, out of service: agent-loop tasks that still hold one's id
        look it up once more, see it lost and reroute."""
        self._ended_workers: dict[str, str] = {}
        """Worker id → why it ended, as heard from the controller (an instance that joins after
        its worker's end is lost at once)."""
        self._expected: dict[int, int] = {}
        """Router id → TP size of each instance a plan is starting (`expect`), until one of its
        size joins."""
        self._next_expected_id = EXPECTED_ID_BASE
        self.waiting = 0
        """Trajectories waiting for an instance with room (the agent loop counts them in and
        out), for the planner's view of rollout pressure."""
        self._watch: asyncio.Task | None = None
        self.changed = asyncio.Event()
        """Set whenever an instance joins, a plan expects or gives one up, or room frees while
        one is expected (trajectories waiting for an instance wake up)."""

    @property
    def buckets(self) -> tuple[BucketConfig, ...]:
        """The buckets now (a plan may replace them: `update_buckets`)."""
        return self._cmlfq.buckets

    def bucket_of_tp(self, tp_size: int) -> int:
        for index, bucket in enumerate(self._cmlfq.buckets):
            if bucket.tp_size == tp_size:
                return index
        raise ValueError(
            f"no bucket has tp_size={tp_size}; buckets: {[b.tp_size for b in self._cmlfq.buckets]}"
        )

    async def add(
        self, instance_id: int, address: str, tp_size: int | None = None, worker_id: str = ""
    ) -> PooledInstance:
        """Connects to the instance, reads its TP size and context window, and adds it to the
        router in the bucket of its TP size. `worker_id` names its worker in the control plane,
        so that the report of the worker's end marks it lost (`worker_ended`)."""
        if instance_id in self._instances and not self._instances[instance_id].lost:
            raise ValueError(f"instance {instance_id} is already in the pool")
        client = InstanceClient(address, self._token, self._control)
        stats = await client.stats()
        tp = stats.tensor_parallel_size if tp_size is None else tp_size
        weight = self._weight(tp)
        pooled = PooledInstance(
            instance_id, client, self.bucket_of_tp(tp), stats.max_model_len, worker_id, weight=weight
        )
        self.router.add_instance(instance_id, pooled.bucket, weight=weight)
        self._instances[instance_id] = pooled
        self._removed.pop(instance_id, None)
        # An instance of a size a plan expects takes one expected one's place (by size alone: a
        # restarted one weighs the same).
        expected = next((r for r, size in self._expected.items() if size == tp), None)
        if expected is not None:
            del self._expected[expected]
            self.router.remove_instance(expected)
        self._fit_queue_length()
        self._announce_change()
        logger.info("rollout instance %d at %s joined bucket %d", instance_id, address, pooled.bucket)
        if worker_id in self._ended_workers:
            self.mark_lost(instance_id, self._ended_workers[worker_id])
        return pooled

    def expect(self, tp_sizes: Sequence[int]) -> None:
        """A plan is about to start instances of `tp_sizes` (replacing what it expected before;
        empty: nothing more). Until one of each size joins (`add`), the router holds it as
        loading: the derived cap counts its weight, and a trajectory no ready instance has room
        for waits for it instead of queueing behind a full instance, where it would stay after
        the new one serves. Without this a plan that replaced most of the pool piled every
        trajectory onto the few instances left (simulated at 160 x 910B: 470 queued on each of
        2 TP-4 instances while 8 TP-8 ones loaded, 4 minutes of rollout nearly lost)."""
        for router_id in self._expected:
            self.router.remove_instance(router_id)
        self._expected = {}
        for tp in tp_sizes:
            router_id, self._next_expected_id = self._next_expected_id, self._next_expected_id + 1
            bucket = bucket_of([b.tp_size for b in self._cmlfq.buckets], tp)
            self.router.add_instance(router_id, bucket, ready=False, weight=self._weight(tp))
            self._expected[router_id] = tp
        self._fit_queue_length()
        self._announce_change()

    def room_freed(self) -> None:
        """A trajectory left the router (the agent loop calls this): while a plan's instances
        load, the trajectories waiting for room try again (none waits for room otherwise)."""
        if self._expected:
            self._announce_change()

    def get(self, instance_id: int) -> PooledInstance:
        pooled = self._instances.get(instance_id) or self._removed.get(instance_id)
        if pooled is None:
            raise KeyError(instance_id)
        return pooled

    def live_ids(self) -> list[int]:
        return sorted(i for i, p in self._instances.items() if not p.lost)

    async def confirm_lost(self, instance_id: int) -> bool:
        """After a failed call: probes the instance and marks it lost if it does not answer.
        Returns whether it is (now) lost."""
        pooled = self.get(instance_id)
        if pooled.lost:
            return True
        if await pooled.client.is_serving():
            return False
        self.mark_lost(instance_id, "health probe failed after a failed call")
        return True

    def mark_lost(self, instance_id: int, reason: str) -> list[str]:
        """Tells the router once and ends the instance's calls in flight; returns the trajectories
        it displaced (they reroute themselves, keeping the tokens they received)."""
        pooled = self._instances.get(instance_id)
        if pooled is None or pooled.lost:
            return []
        # A failure overrides a plan's withdrawal: a failed instance is not restored.
        pooled.lost, pooled.lost_reason, pooled.withdrawn = True, reason, False
        displaced = self.router.on_instance_lost(instance_id)
        self._fit_queue_length()
        num_cut = pooled.client.fail_calls(f"instance {instance_id} lost: {reason}")
        logger.warning(
            "rollout instance %d lost (%s); %d trajectories displaced, %d calls cut",
            instance_id,
            reason,
            len(displaced),
            num_cut,
        )
        return displaced

    def report_kv_usage(self, instance_id: int, usage: float) -> None:
        """Tells the router the engine's KV-cache usage (`InstanceStats.kv_cache_usage`: vLLM's
        share of KV blocks held by running requests; blocks kept only by the prefix cache count
        as free, queued requests hold none yet), in `KV_USAGE_PARTS`. Ignored for an instance
        that left service since its stats were read."""
        pooled = self._instances.get(instance_id)
        if pooled is not None and not pooled.lost:
            used = round(min(max(usage, 0.0), 1.0) * KV_USAGE_PARTS)
            self.router.set_instance_kv(instance_id, used, KV_USAGE_PARTS)

    # -- planned removal (the plan executor, through `plan_control`) ---------------------------

    def drain(self, instance_id: int) -> None:
        """Routes no new trajectory or turn to the instance; the trajectories on it move elsewhere
        at their next tool return. Its calls in flight go on."""
        pooled = self._in_service(instance_id, "drain")
        pooled.withdrawn = True
        self.router.set_instance_ready(instance_id, False)
        self._fit_queue_length()

    def cut(self, instance_id: int, reason: str) -> list[str]:
        """Takes the instance out of service now, as planned: the router forgets it
        (`remove_instance`, not a loss) and its calls in flight end, so that the trajectories on
        it resume elsewhere from their kept tokens. Returns them (the router's displaced list).
        A no-op returning [] on an instance already out of service."""
        pooled = self._instances.get(instance_id)
        if pooled is None:
            raise LookupError(f"no instance {instance_id} in the pool (known: {sorted(self._instances)})")
        pooled.withdrawn = True
        if pooled.lost:
            return []
        pooled.lost, pooled.lost_reason = True, reason
        displaced = self.router.remove_instance(instance_id)
        self._fit_queue_length()
        num_calls = pooled.client.fail_calls(f"instance {instance_id} cut: {reason}")
        logger.info(
            "rollout instance %d cut (%s); %d trajectories displaced, %d calls ended",
            instance_id,
            reason,
            len(displaced),
            num_calls,
        )
        return displaced

    async def restore(self, instance_id: int) -> None:
        """Undoes `drain` or `cut`: the instance serves the pool again (a cut one through a new
        client: the old one refuses calls for good). LookupError for an instance that is not
        withdrawn, e.g. one that died meanwhile."""
        pooled = self._instances.get(instance_id)
        if pooled is None or not pooled.withdrawn:
            raise LookupError(f"instance {instance_id} is not withdrawn by a plan; nothing to restore")
        if pooled.lost:
            old = pooled.client
            pooled.client = InstanceClient(old.address, self._token, self._control)
            await old.close()
            pooled.lost, pooled.lost_reason = False, ""
            self.router.add_instance(instance_id, pooled.bucket, weight=pooled.weight)
        else:
            self.router.set_instance_ready(instance_id, True)
        pooled.withdrawn = False
        self._fit_queue_length()
        self._announce_change()
        if pooled.worker_id in self._ended_workers:  # it ended while withdrawn: now that is a loss
            self.mark_lost(instance_id, self._ended_workers[pooled.worker_id])

    async def remove(self, instance_id: int) -> None:
        """Forgets an instance whose worker a plan stopped: cuts whatever is still on it and
        closes its client. `get` still answers for it (out of service) so that agent-loop tasks
        that hold its id reroute; `add` may reuse the id."""
        self.cut(instance_id, "removed by a plan")
        pooled = self._removed[instance_id] = self._instances.pop(instance_id)
        await pooled.client.close()

    def update_buckets(self, buckets: Sequence[BucketConfig]) -> None:
        """A plan's new buckets: each instance in service goes to the bucket of its TP size,
        the router decides its trajectories again. ValueError (changing nothing) if the buckets
        are invalid or an instance's TP size has no bucket."""
        if self._price_buckets is not None:
            buckets = self._price_buckets(buckets)
        cmlfq = dataclasses.replace(self._cmlfq, buckets=tuple(buckets))
        # Failed instances never serve again; cut ones may be restored, so they move too.
        tp_of = {
            i: self._cmlfq.buckets[p.bucket].tp_size
            for i, p in self._instances.items()
            if not p.lost or p.withdrawn
        }
        new_bucket: dict[int, int] = {}
        for instance_id, tp in tp_of.items():
            index = next((b for b, bucket in enumerate(cmlfq.buckets) if bucket.tp_size == tp), None)
            if index is None:
                raise ValueError(
                    f"instance {instance_id} has tp_size={tp}, which no new bucket has: "
                    f"{[b.tp_size for b in cmlfq.buckets]}"
                )
            new_bucket[instance_id] = index
        in_service = {i: b for i, b in new_bucket.items() if not self._instances[i].lost}
        tps = [b.tp_size for b in cmlfq.buckets]
        in_service.update({r: bucket_of(tps, tp) for r, tp in self._expected.items()})
        self.router.update_buckets(cmlfq.buckets, in_service)
        self._cmlfq = cmlfq
        for instance_id, index in new_bucket.items():
            self._instances[instance_id].bucket = index

    def reprice(self) -> None:
        """The speeds the pricing gives the buckets now (its history and calibration move on
        between bucket changes), for the router's next decisions; nobody is decided again.
        Nothing without a pricing, or with a router that has no speeds (the baselines)."""
        if self._price_buckets is None:
            return
        self._cmlfq = reprice(self.router, self._cmlfq, self._price_buckets)

    def _in_service(self, instance_id: int, what: str) -> PooledInstance:
        pooled = self._instances.get(instance_id)
        if pooled is None:
            raise LookupError(
                f"cannot {what} instance {instance_id}: not in the pool ({sorted(self._instances)})"
            )
        if pooled.lost:
            raise LookupError(f"cannot {what} instance {instance_id}: out of service ({pooled.lost_reason})")
        return pooled

    def _weight(self, tp_size: int) -> int:
        return self._weight_of_tp(tp_size) if self._weight_of_tp is not None else 1

    def _fit_queue_length(self) -> None:
        """The derived cap for the instances that take trajectories: not lost, not withdrawn (a
        drained one is leaving, and takes no new ones), and those a plan is starting."""
        if self._queue_length is None:
            return
        weight = sum(p.weight for p in self._instances.values() if not (p.lost or p.withdrawn))
        weight += sum(self._weight(tp) for tp in self._expected.values())
        cap = self._queue_length.follow(weight)
        if cap is not None:
            logger.info(
                "scheduler.max_queue_length derived again: %d per unit of weight (pool weight %d)",
                cap,
                weight,
            )

    def _announce_change(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- the controller's events ---------------------------------------------------------------

    def watch_controller(self, address: str, token: str) -> None:
        """Follows the controller at `address` (bearer `token`): an instance whose worker ends
        (`WORKER_END_EVENTS`) is marked lost as soon as the controller hears of it. Call inside
        the event loop the pool serves; `close` stops it."""
        if self._watch is not None:
            raise RuntimeError("the pool already watches a controller")
        self._watch = asyncio.create_task(self._follow_controller(address, token), name="pool-watch")

    async def _follow_controller(self, address: str, token: str) -> None:
        metadata = (("authorization", f"Bearer {token}"),)
        after_sequence = None
        while True:
            channel = open_aio_channel(address, self._control)
            try:
                stub = controller_pb2_grpc.ClusterApiStub(channel)
                if after_sequence is None:
                    # Start from now, but first catch up on the workers that already ended.
                    reply = await stub.GetClusterState(
                        controller_pb2.GetClusterStateRequest(), metadata=metadata
                    )
                    state = control_convert.cluster_state_from_proto(reply)
                    after_sequence = state.last_event_sequence
                    for worker in state.workers:
                        if worker.state.ended:
                            self.worker_ended(worker.spec.worker_id, f"worker {worker.state.name.lower()}")
                request = controller_pb2.WatchEventsRequest(
                    after_sequence=after_sequence, kinds=[int(k) for k in WORKER_END_EVENTS]
                )
                async for message in stub.WatchEvents(request, metadata=metadata):
                    event = control_convert.event_from_proto(message)
                    after_sequence = event.sequence
                    self.worker_ended(event.worker_id, f"controller: {event.kind.name.lower()}")
            except grpc.aio.AioRpcError as e:
                logger.warning(
                    "controller event stream at %s broke (%s); re-subscribing", address, e.code().name
                )
            except Exception:  # noqa: BLE001 - the watch must outlive a bad message
                logger.exception("controller event stream at %s failed; re-subscribing", address)
            finally:
                await channel.close()
            await asyncio.sleep(_WATCH_RETRY_S)

    def worker_ended(self, worker_id: str, reason: str) -> None:
        """The control plane reports that worker `worker_id` no longer runs: its instance is lost
        (or, withdrawn by a plan, cut); an instance that joins later under that worker is lost at
        once. The job's fleet calls this; `watch_controller` does for a pool on its own."""
        if not worker_id:
            return  # "" names the instances that are no workers; an event always names one
        self._ended_workers[worker_id] = reason
        for pooled in self._instances.values():
            if pooled.worker_id == worker_id and not pooled.lost:
                if pooled.withdrawn:  # a plan stopped it: no loss, but nothing may stay on it
                    self.cut(pooled.instance_id, f"its worker ended while withdrawn: {reason}")
                else:
                    self.mark_lost(pooled.instance_id, reason)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await asyncio.gather(*(p.client.close() for p in self._instances.values()), return_exceptions=True)
