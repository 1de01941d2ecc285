"""Weight publication to the job's rollout instances: which version each instance runs, and
bringing every instance to the latest.

The trainer publishes a version once (PublishWeights: resharded into shared memory for every
rollout TP size in use); each instance then loads it (LoadWeights), concurrently. A failed load is
retried with back-off while the instance keeps serving its old version (`libra.sync`'s
`VersionLedger`); an instance whose retries are spent is reported, and the job restarts it. An
instance that joins (launch, restart, a plan) is brought to the latest version before the router
sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from libra.control.config import ControlConfig
from libra.job.recorder import JobEvent, RunRecorder
from libra.job.trainer import TrainRanks
from libra.rollout import InstanceClient, InstanceUnavailable
from libra.sync import VersionLedger
from libra.sync.load_request import LoadRequest

logger = logging.getLogger(__name__)

LOAD_ATTEMPTS = 4
LOAD_BACKOFF_S = 0.5
"""A failed load is retried after 0.5, 1 and 2 s; after 4 failures the instance is given up."""


@dataclass
class _Subscriber:
    """An instance that loads published versions."""

    client: InstanceClient
    tp_size: int
    lock: asyncio.Lock
    load_seconds: float = 0.0


class WeightPublication:
    def __init__(
        self,
        recorder: RunRecorder,
        token: str,
        control: ControlConfig,
        keep_versions: int,
        max_attempts: int = LOAD_ATTEMPTS,
        backoff_s: float = LOAD_BACKOFF_S,
    ):
        self.recorder = recorder
        self._token, self._control = token, control
        self._keep_versions = keep_versions
        self.ledger = VersionLedger(initial_version=0, max_attempts=max_attempts, backoff_s=backoff_s)
        """Which version each instance runs; owed and failed loads."""
        self.loads: dict[int, LoadRequest] = {}
        """What an instance of each TP size loads the latest version from."""
        self._subscribers: dict[int, _Subscriber] = {}
        self._retired: list[InstanceClient] = []

    @property
    def current_version(self) -> int:
        return self.ledger.latest

    # -- instances -----------------------------------------------------------------------------

    async def join(self, instance_id: int, address: str, tp_size: int) -> None:
        """Subscribes the instance (serving at `address`, on the version it started from: the
        initial checkpoint) and brings it to the latest version; one that cannot load it is
        unsubscribed and RuntimeError says why."""
        if tp_size not in self.loads and self.ledger.latest > 0:
            raise ValueError(f"no published weights for TP-{tp_size} yet; the instance would stay behind")
        self.subscribe(instance_id, InstanceClient(address, self._token, self._control), tp_size)
        if not await self.bring_up_to_date(instance_id):
            error = self.ledger.given_up().get(str(instance_id), "it left")
            self.leave(instance_id)
            raise RuntimeError(f"could not load version {self.ledger.latest}: {error}")

    def subscribe(self, instance_id: int, client: InstanceClient, tp_size: int) -> None:
        """Adds the instance, on the version it started from, without loading anything yet."""
        self._subscribers[instance_id] = _Subscriber(client, tp_size, asyncio.Lock())
        self.ledger.add_instance(str(instance_id), now=time.monotonic())

    def leave(self, instance_id: int) -> None:
        """Unsubscribes the instance (lost, or a plan stopped it). Its client is closed at `close`,
        not now: a load in flight on it fails on its own (the instance is gone), whereas closing
        the channel would cancel it."""
        subscriber = self._subscribers.pop(instance_id, None)
        if subscriber is None:
            return
        self._retired.append(subscriber.client)
        try:
            self.ledger.remove_instance(str(instance_id))
        except LookupError:
            pass

    def tp_sizes(self) -> set[int]:
        return {s.tp_size for s in self._subscribers.values()}

    # -- versions ------------------------------------------------------------------------------

    async def publish(self, trainer: TrainRanks, version: int, tp_sizes: list[int]) -> dict[int, str]:
        """Publishes the trainer's weights of `version` for `tp_sizes` and switches every instance
        to it. Returns the instances whose retries were spent, with the last error: they stay
        behind (the job restarts them)."""
        started = time.perf_counter()
        # Versions that no instance runs any more, except the newest ones kept.
        keep = set(self.ledger.published[-self._keep_versions :])
        release = [v for v in self.ledger.releasable() if v not in keep]
        published = await asyncio.to_thread(trainer.publish_weights, version, tp_sizes, release)
        self.ledger.forget(release)
        self.loads = published.loads
        self.ledger.publish(version)
        ids = list(self._subscribers)
        loaded = await asyncio.gather(*(self.bring_up_to_date(i) for i in ids))
        given_up = self.ledger.given_up()
        logger.info(
            "published version %d in %.3f s (gather %.3f s, reshard %.3f s, slowest load %.3f s)",
            version,
            time.perf_counter() - started,
            published.gather_seconds,
            published.publish_seconds,
            max((s.load_seconds for s in self._subscribers.values()), default=0.0),
        )
        return {
            i: given_up.get(str(i), "")
            for i, ok in zip(ids, loaded, strict=True)
            if not ok and i in self._subscribers
        }

    def republish(self, trainer: TrainRanks, tp_sizes: list[int]) -> None:
        """Publishes the current version again, from the trainer as it is now: after a training
        restart the old ranks' buffers went with them, and an instance (re)started before the next
        step must still find the version it is owed."""
        self.loads = trainer.publish_weights(self.current_version, tp_sizes).loads

    async def bring_up_to_date(self, instance_id: int) -> bool:
        """Loads the latest version into the instance, retrying failed loads as the ledger says
        (the instance serves its old version meanwhile). False when the ledger gave up on it or
        the instance left."""
        name, subscriber = str(instance_id), self._subscribers.get(instance_id)
        if subscriber is None:
            return False  # lost before its turn
        async with subscriber.lock:
            while True:
                try:
                    if self.ledger.version_of(name) >= self.ledger.latest:
                        return True
                except LookupError:
                    return False  # left meanwhile
                if name in self.ledger.given_up():
                    return False
                task = next((t for t in self.ledger.due(time.monotonic()) if t.instance == name), None)
                if task is None:
                    await asyncio.sleep(0.05)  # backing off
                    continue
                if instance_id not in self._subscribers:
                    return False  # left meanwhile
                try:
                    result = await subscriber.client.load_weights(self.loads[subscriber.tp_size])
                    ok, error, version = result.ok, result.error, result.version
                except (InstanceUnavailable, ValueError) as e:
                    ok, error, version = False, str(e), -1
                try:
                    if ok:
                        self.ledger.loaded(name, version, time.monotonic())
                        subscriber.load_seconds = result.seconds
                        continue
                    self.ledger.failed(name, task.version, error, time.monotonic())
                except LookupError:
                    return False  # left while loading
                self.recorder.event(
                    JobEvent.LOAD_FAILED,
                    f"rollout-{instance_id} attempt {task.attempt} of version {task.version}: {error}",
                )

    async def close(self) -> None:
        for client in [*(s.client for s in self._subscribers.values()), *self._retired]:
            await client.close()
