"""The job's rollout instances: the instance pool (with its router) and every instance's life in
it — started at launch or by a plan, brought to the current weights before the router sees it,
restarted under its name and pool id when its worker is lost, abandoned when its node agent is.

The fleet (`libra.job.fleet`) holds each instance's record and finds its loss; this owner decides
what the loss means for rollout. A plan's executor starts and stops instance workers through the
fleet too, and hands the ones it started here (`join`) and the ones it stopped (`forget`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from libra.backends import get_backend
from libra.config import LibraConfig
from libra.job.cluster import JobCluster, Placement
from libra.job.fleet import Fleet, FleetWorker, WorkerKind
from libra.job.publication import WeightPublication
from libra.job.recorder import JobEvent, RunRecorder
from libra.job.trainer import TrainRanks
from libra.model_spec import ModelSpec
from libra.rollout import InstanceConfig, InstancePool
from libra.rollout.instance_server import InstanceSpec
from libra.scheduler import CmlfqRouter


def resolved_instance_config(config: LibraConfig) -> InstanceConfig:
    """The run's rollout instance config with the backend's engine defaults filled in (what the
    run's instances start with): a setting the backend cannot use is refused here, before any
    start, and so is an engine memory share that does not leave room for the other workers of a
    shared device (`backend.slots_per_device`)."""
    backend = get_backend(config.backend.name, **config.backend.options())
    instance = config.rollout.instance.for_backend(backend)
    slots = config.backend.slots_per_device
    share = instance.gpu_memory_utilization
    if share is not None and slots > 1 and share > 1 / slots:
        raise ValueError(
            f"rollout.instance.gpu_memory_utilization ({share}) leaves the other workers of a device no "
            f"room: with backend.slots_per_device={slots} it must be at most {1 / slots:.2f}"
        )
    return instance


class RolloutInstances:
    def __init__(
        self,
        config: LibraConfig,
        cluster: JobCluster,
        fleet: Fleet,
        publication: WeightPublication,
        recorder: RunRecorder,
        model_dir: Path,
        pool: InstancePool,
    ):
        self.config = config
        self.cluster, self.fleet, self.publication, self.recorder = cluster, fleet, publication, recorder
        self.model_dir = model_dir
        self.run_dir = Path(config.run_dir)
        self.pool = pool
        self._next_id = 0
        self.restarts = 0
        self.restarts_in_progress = 0
        """Instances being restarted now (the planner waits for them)."""
        self.start_s: list[float] = []
        """How long each instance took to start serving (launch and restarts)."""
        self.on_gone: Callable[[int], None] | None = None
        """Called with the pool id of a lost instance that cannot be restarted."""
        fleet.on_loss(WorkerKind.ROLLOUT_INSTANCE, self._lost)

    # -- the launch's instances ------------------------------------------------------------------

    async def start(self, tp_sizes) -> None:
        """One instance per TP size, largest first (the planner's device order), concurrently."""
        tp_sizes = sorted(tp_sizes, reverse=True)
        placements = [self.cluster.place(tp, f"rollout instance (TP {tp})") for tp in tp_sizes]
        await asyncio.gather(*(self._start(tp, p) for tp, p in zip(tp_sizes, placements, strict=True)))

    async def _start(self, tp_size: int, placement: Placement) -> None:
        instance_id = self._next_id
        self._next_id += 1
        name = f"rollout-{instance_id}"
        address_file = self.run_dir / f"{name}.addr"
        argv = self.argv(tp_size, self.cluster.agent_host(placement.agent_id), address_file)
        record = self.fleet.launch(
            name,
            WorkerKind.ROLLOUT_INSTANCE,
            placement,
            argv,
            address_file,
            tp_size=tp_size,
            instance_id=instance_id,
        )
        await self._serve(record)

    async def _serve(self, record: FleetWorker) -> None:
        """Waits for the worker, brings it to the current weights, hands it to the router; only
        then does the fleet watch it (a loss before is this start's failure, not a restart's)."""
        started = time.monotonic()
        await asyncio.to_thread(self.fleet.wait_ready, record)
        self.start_s.append(time.monotonic() - started)
        # The engine starts on the initial checkpoint: it loads the current version first.
        try:
            await self.publication.join(record.instance_id, record.address, record.tp_size)
            await self.pool.add(
                record.instance_id, record.address, record.tp_size, worker_id=record.worker_id
            )
            self.fleet.serving(record.name, record.address)
        except Exception as e:
            self.pool.mark_lost(record.instance_id, f"it did not start: {e}")
            self.publication.leave(record.instance_id)
            await asyncio.to_thread(self.fleet.stop, record.name)
            self.fleet.forget(record.name)
            raise RuntimeError(f"{record.name} {e}") from e

    def argv(self, tp_size: int, host: str, address_file: Path) -> list[str]:
        """The command line of a rollout instance of this job (its own and those plans start)."""
        inst = self.config.rollout.instance
        # The context window cannot exceed the model's positions (vLLM refuses to start).
        positions = ModelSpec.from_hf_dir(self.model_dir).max_position_embeddings
        config = dataclasses.replace(
            inst,
            model=str(self.model_dir),
            max_model_len=min(inst.max_model_len, positions or inst.max_model_len),
            tensor_parallel_size=tp_size,
        )
        spec = InstanceSpec(
            config,
            backend=self.config.backend,
            control=self.config.control,
            host=host,
            address_file=str(address_file),
        )
        return spec.to_argv()

    # -- instances a plan starts and stops (`libra.job.planning`) --------------------------------

    async def join(self, name: str, plan_id: str, tp_size: int, address: str) -> int:
        """An instance the plan's executor started through the fleet serves at `address`: brought
        to the current weights, then added to the pool and watched like the launch's own. Returns
        its pool id."""
        instance_id = self._next_id
        self._next_id += 1
        await self.publication.join(instance_id, address, tp_size)
        try:
            await self.pool.add(instance_id, address, tp_size, worker_id=name)
            self.fleet.serving(name, address, tp_size=tp_size, instance_id=instance_id, plan_id=plan_id)
        except Exception as e:
            self.pool.mark_lost(instance_id, f"it did not start: {e}")
            self.publication.leave(instance_id)
            raise
        return instance_id

    async def forget(self, instance_id: int) -> None:
        """A plan stopped the instance (the fleet dropped its record) and the pool forgot it."""
        self.publication.leave(instance_id)

    def tp_sizes_in_use(self) -> list[int]:
        """TP sizes weights are published for: the launched ones and any a plan started."""
        launched = self.config.job.rollout_tp_sizes
        return sorted({*launched, *(r.tp_size for r in self.fleet.rollout_instances())})

    # -- weights ---------------------------------------------------------------------------------

    async def publish(self, trainer: TrainRanks, version: int) -> None:
        """Publishes the trainer's weights of `version` to every instance (`WeightPublication`);
        an instance whose loads keep failing is stopped as a loss, so that it is restarted on the
        current version."""
        behind = await self.publication.publish(trainer, version, self.tp_sizes_in_use())
        for instance_id, error in behind.items():
            record = self.fleet.instance(instance_id)
            if record is None:
                continue
            self.recorder.event(
                JobEvent.LOAD_GIVEN_UP, f"{record.name} stays behind version {version}: {error}"
            )
            await asyncio.to_thread(self.fleet.stop, record.name, planned=False)

    def republish(self, trainer: TrainRanks) -> None:
        """The current version again, from the trainer as it is now (after a training restart:
        the old ranks' weight buffers went with them)."""
        self.publication.republish(trainer, self.tp_sizes_in_use())

    # -- loss ------------------------------------------------------------------------------------

    async def _lost(self, record: FleetWorker) -> None:
        """A rollout instance ended unasked: it is marked lost (its trajectories reroute
        themselves), then started again on the same devices under its name and pool id, and
        brought to the current weights before it rejoins. One whose node agent is lost, or that
        cannot be started again, is abandoned (the planner re-plans without it)."""
        instance_id, name = record.instance_id, record.name
        withdrawn = self._withdrawn(instance_id)
        # The fleet is the job's one watch on worker ends: it tells the pool, which ends the
        # instance's calls and tells the router once (the agent loop may have found the instance
        # unresponsive first); the displaced trajectories reroute themselves.
        self.pool.worker_ended(record.worker_id, f"worker {record.worker_id} {record.lost_reason}")
        if withdrawn:
            return  # a plan stopping an instance is no failure: the plan forgets it
        self.publication.leave(instance_id)
        self.recorder.event(
            JobEvent.INSTANCE_LOST, f"{name} ended ({record.lost_reason})", instance_id=instance_id
        )
        if record.agent_lost or not self.cluster.agent_alive(record.placement.agent_id):
            self._abandon(record, f"node agent {record.placement.agent_id} is lost")
            return
        self.restarts += 1
        self.restarts_in_progress += 1
        try:
            await asyncio.to_thread(self.fleet.relaunch, record)
            await self._serve(record)
        except Exception as e:  # noqa: BLE001 - recorded; the plan loses the instance
            self._abandon(record, f"it did not start again: {e}")
            return
        finally:
            self.restarts_in_progress -= 1
        self.recorder.event(
            JobEvent.INSTANCE_RESTARTED,
            f"{name} restarted (worker {record.worker_id})",
            instance_id=instance_id,
            version=self.publication.current_version,
            live_instances=len(self.pool.live_ids()),
        )

    def _abandon(self, record: FleetWorker, why: str) -> None:
        self.fleet.forget(record.name)
        self.recorder.event(
            JobEvent.INSTANCE_ABANDONED, f"{record.name}: {why}", live_instances=len(self.pool.live_ids())
        )
        if self.on_gone is not None:
            self.on_gone(record.instance_id)

    def _withdrawn(self, instance_id: int) -> bool:
        try:
            return self.pool.get(instance_id).withdrawn
        except KeyError:
            return False

    # -- the router's state (checkpoints) ---------------------------------------------------------

    def router_state(self) -> str:
        router = self.pool.router
        return router.serialize().hex() if isinstance(router, CmlfqRouter) else ""

    def restore_router(self, state: str) -> None:
        if state and isinstance(self.pool.router, CmlfqRouter):
            self.pool.router.restore(bytes.fromhex(state))

    async def close(self) -> None:
        await self.pool.close()
