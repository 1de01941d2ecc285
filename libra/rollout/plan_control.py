"""`PoolRolloutControl`: the plan executor's `RolloutControl` over the live `InstancePool`.

The executor (`libra.planner.actions`) runs in its own thread and names instances by the plan's
strings ("rollout-tp1-d0"); the pool lives on the job's event loop and names them by the control
plane's integers. Every method here maps the id, schedules the work onto the pool's loop
(`asyncio.run_coroutine_threadsafe`) and waits for it with a bound, so the pool and its router are
only ever touched from their own loop.

Planned removal is not loss: `cut` takes an instance out of the router with `remove_instance` and
ends its calls so that its trajectories resume elsewhere from their kept tokens, and the pool marks
it `withdrawn` so that neither the pool's controller watch nor the job counts the end of its
worker as a failure (the job's restart watchdog must skip withdrawn instances).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from libra.rollout.pool import InstancePool
from libra.scheduler.config import BucketConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

AddInstance = Callable[[str, str, int, str], Awaitable[int]]
"""The job's coroutine that starts serving a new instance: (plan id, TP size, address) → the
pool's int id, after it brought the instance to the current weights and `InstancePool.add`ed it."""
RemoveInstance = Callable[[int], Awaitable[None]]
"""The job's clean-up of its own per-instance state (weight loader, ledger entry) after the pool
forgot the instance."""


@dataclass(frozen=True)
class PlanControlConfig:
    call_timeout_s: float = 30.0
    """Bound on one quick step on the pool's loop (cut, restore, remove, thresholds). The loop
    answers in milliseconds unless it is blocked: past this the executor's action fails."""
    add_timeout_s: float = 600.0
    """Bound on adding an instance, which includes bringing it to the current weights."""
    drain_poll_s: float = 0.1
    """How often a drain looks at the instance's load."""

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "add_timeout_s", "drain_poll_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"plan_control.{name} must be > 0, got {value}")


class PoolRolloutControl:
    """Implements `libra.planner.controls.RolloutControl`. Call its methods from any thread but
    the pool loop's own (they block on it)."""

    def __init__(
        self,
        pool: InstancePool,
        loop: asyncio.AbstractEventLoop,
        add_instance_coro: AddInstance,
        instance_ids: Mapping[str, int] | None = None,
        remove_instance_coro: RemoveInstance | None = None,
        config: PlanControlConfig | None = None,
    ):
        self.pool = pool
        self._loop = loop
        self._add_instance = add_instance_coro
        self._remove_instance = remove_instance_coro
        self.config = config or PlanControlConfig()
        self._lock = threading.Lock()
        self._ids: dict[str, int] = dict(instance_ids or {})
        """Plan id → pool id; filled by the job as it starts instances (`bind`) and by `add_instance`."""

    # -- the id map ----------------------------------------------------------------------------

    def bind(self, plan_id: str, instance_id: int) -> None:
        """Records that the plan's `plan_id` is the pool's `instance_id` (the job calls this for
        the instances it started itself)."""
        with self._lock:
            known = self._ids.get(plan_id)
            if known is not None and known != instance_id:
                raise ValueError(f"plan instance {plan_id!r} is already pool instance {known}")
            self._ids[plan_id] = instance_id

    def unbind(self, instance_id: int) -> str | None:
        """Forgets pool instance `instance_id` (gone outside a plan); returns its plan id, if any."""
        with self._lock:
            plan_id = next((p for p, i in self._ids.items() if i == instance_id), None)
            if plan_id is not None:
                del self._ids[plan_id]
            return plan_id

    def pool_id(self, plan_id: str) -> int:
        with self._lock:
            if plan_id not in self._ids:
                raise LookupError(
                    f"no pool instance for plan instance {plan_id!r} (known: {sorted(self._ids)})"
                )
            return self._ids[plan_id]

    # -- RolloutControl ------------------------------------------------------------------------

    def drain(self, instance_id: str, timeout_s: float) -> int:
        if not timeout_s >= 0:
            raise ValueError(f"drain timeout_s must be >= 0, got {timeout_s}")
        pool_id = self.pool_id(instance_id)
        self._on_loop(self._drain_start(pool_id), self.config.call_timeout_s)
        # Poll from this thread, one short step on the loop at a time: the loop keeps serving
        # the trajectories that are finishing their turns meanwhile.
        deadline = time.monotonic() + timeout_s
        while True:
            left = self._on_loop(self._trajectories_on(pool_id), self.config.call_timeout_s)
            if left == 0 or time.monotonic() >= deadline:
                logger.info("drain of %s (pool %d): %d trajectories left", instance_id, pool_id, left)
                return left
            time.sleep(min(self.config.drain_poll_s, max(0.0, deadline - time.monotonic())))

    def cut(self, instance_id: str) -> int:
        pool_id = self.pool_id(instance_id)
        displaced = self._on_loop(self._cut(pool_id), self.config.call_timeout_s)
        return len(displaced)

    def restore(self, instance_id: str) -> None:
        self._on_loop(self.pool.restore(self.pool_id(instance_id)), self.config.call_timeout_s)

    def remove_instance(self, instance_id: str) -> None:
        pool_id = self.pool_id(instance_id)
        self._on_loop(self._remove(pool_id), self.config.call_timeout_s)
        with self._lock:
            del self._ids[instance_id]

    def add_instance(self, instance_id: str, worker_id: str, tp: int, address: str) -> None:
        with self._lock:
            if instance_id in self._ids:
                raise ValueError(
                    f"plan instance {instance_id!r} is already pool instance {self._ids[instance_id]}"
                )
        pool_id = self._on_loop(
            self._add_instance(instance_id, worker_id, tp, address), self.config.add_timeout_s
        )
        self.bind(instance_id, pool_id)

    def set_bucket_thresholds(self, thresholds: tuple[tuple[int, int], ...]) -> None:
        self._on_loop(self._set_buckets(thresholds), self.config.call_timeout_s)

    def expect(self, tp_sizes: tuple[int, ...]) -> None:
        self._on_loop(self._expect(tp_sizes), self.config.call_timeout_s)

    # -- the steps on the pool's loop -----------------------------------------------------------

    async def _expect(self, tp_sizes: tuple[int, ...]) -> None:
        self.pool.expect(tp_sizes)

    async def _drain_start(self, pool_id: int) -> None:
        self.pool.drain(pool_id)

    async def _trajectories_on(self, pool_id: int) -> int:
        """Live trajectories the router has placed on the instance: each leaves at its next tool
        return (to a ready instance) or when it ends."""
        loads = getattr(self.pool.router, "instance_loads", None)
        if loads is None:
            raise TypeError(
                f"drain needs a router that reports its load per instance (instance_loads); "
                f"{type(self.pool.router).__name__} does not: cut instead"
            )
        return next((load.active for load in loads() if load.instance_id == pool_id), 0)

    async def _cut(self, pool_id: int) -> list[str]:
        return self.pool.cut(pool_id, "cut by a plan")

    async def _remove(self, pool_id: int) -> None:
        await self.pool.remove(pool_id)
        if self._remove_instance is not None:
            await self._remove_instance(pool_id)

    async def _set_buckets(self, thresholds: tuple[tuple[int, int], ...]) -> None:
        # Keep the names of the buckets whose TP size stays, so metrics keyed by name continue.
        names = {b.tp_size: b.name for b in self.pool.buckets}
        buckets = [
            BucketConfig(names.get(tp, f"tp{tp}"), tp_size=tp, max_remaining_tokens=tokens)
            for tp, tokens in thresholds
        ]
        self.pool.update_buckets(buckets)

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("PoolRolloutControl blocks on the pool's loop: call it from another thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"the pool's event loop did not finish the step within {timeout_s} s"
            ) from None
