"""Everything the loop talks to, built in order: the policy model, the tasks, the cluster and its
workers (rollout instances and train ranks, started through the fleet), the instance pool with
its router, the tools, the agent loop — and the services the loop calls between steps: weight
publication, token counters, bucket occupancy sampling, and what a lost worker calls for (the
fleet's watchdog finds it: an instance is restarted, the train ranks' loss ends the run)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from libra.config import LibraConfig
from libra.control import WorkerRole
from libra.job.cluster import JobCluster, Placement, free_port
from libra.job.fleet import Fleet, FleetWorker
from libra.job.progress import Progress
from libra.job.publication import WeightPublication
from libra.job.recorder import ClusterSample, InstanceSample, JobEvent, RunRecorder
from libra.job.task_source import load_task_source
from libra.job.trainer import TrainRanks
from libra.rollout import AgentLoop, InstancePool
from libra.scheduler import CmlfqRouter, make_router
from libra.training.config import TrainingConfig
from libra.training.hybrid import HYBRID_POOL_LIMITS
from libra.training.worker import TrainRankSpec

logger = logging.getLogger(__name__)

_SAMPLE_INTERVAL_S = 1.0


class JobWorkers:
    def __init__(self, config: LibraConfig):
        self.config, self.job = config, config.job
        self.run_dir = Path(config.run_dir)
        self.cluster = JobCluster(config)
        self.fleet = Fleet(self.cluster, self.job.worker_start_timeout_s)
        """Every worker of the job: one record each, and the watchdog."""
        self.fleet.on_loss(WorkerRole.ROLLOUT, self._instance_lost)
        self.fleet.on_loss(WorkerRole.TRAIN, self._train_rank_lost)
        self._next_instance_id = 0
        self._background: list[asyncio.Task] = []
        self.restarts = 0
        self.restarts_in_progress = 0
        """Instances being restarted now (the planner waits for them)."""
        self.instance_start_s: list[float] = []
        """How long each instance took to start serving (launch and restarts)."""
        self._train_generation = 0
        self.train_worker_ids: list[str] = []
        self.training_now = False
        """A train step is running (the loop sets it; the device-busy samples read it)."""
        self.train_ranks_gone = asyncio.Event()
        """Set once a serving train rank ended, or its agent was lost, without the job asking."""
        self.on_instance_restarted = None
        """Called with (old id, new id) after a lost instance was restarted (the planner's
        instance map follows it)."""
        self.on_instance_gone = None
        """Called with the id of a lost instance that cannot be restarted (its agent is lost)."""

    # -- start-up ------------------------------------------------------------------------------

    async def start(self, recorder: RunRecorder) -> None:
        from libra.rollout.tools.sandbox import SandboxPool

        self.recorder = recorder
        # Before the workers: the tools (the sandbox among them) decide the prompt's tool list.
        self.sandbox = await SandboxPool(self.config.tools.sandbox).start()
        self.source = await load_task_source(self.config, self.sandbox)

        self.planning_problem = self._planning_problem()
        await asyncio.to_thread(self.cluster.start, self.planning_problem)
        self.token = self.cluster.token
        self.publication = WeightPublication(
            recorder, self.token, self.config.control, self.job.keep_weight_versions
        )
        # Training takes the first devices, rollout instances the rest (largest TP first): the
        # planner's device numbering, so that the launch layout is a plan it can hold.
        train_placements = [
            self.cluster.place(1, f"train rank {r}") for r in range(self.config.training.world_size)
        ]
        train_addresses, instance_ready = await asyncio.gather(
            asyncio.to_thread(self.start_train_ranks, train_placements), self._start_instances()
        )

        agent = self.config.rollout.agent
        self.agent_loop = AgentLoop(
            self.pool, self.source.chat, self.source.tools, agent, self.config.scheduler
        )
        self.progress = Progress(
            self.job, self.config.run_dir, live=self.job.live_progress and sys.stdout.isatty()
        )
        self._background = [
            asyncio.create_task(self._sample()),
            asyncio.create_task(self.fleet.watch()),
        ]
        recorder.event(
            JobEvent.STARTED,
            f"{len(self.fleet.rollout_instances())} rollout instances, "
            f"{len(self.train_addresses)} train rank(s)",
            model=str(self.source.model_dir),
        )

    @property
    def hosts_hybrid_lane(self) -> bool:
        """Every train rank hosts a lane of the elastic hybrid pool: the planner runs and the
        core's layout is one `libra.training.hybrid` pairs with (PP = 1)."""
        training = self.config.training
        return self.job.planner and HYBRID_POOL_LIMITS.allows(
            training.data_parallel, training.pipeline_parallel, 1
        )

    def _planning_problem(self):
        """The planner's problem for the controller to serve (None: `job.planner` is off)."""
        if not self.job.planner:
            return None
        from libra.job.problem import planning_problem

        return planning_problem(self.config, self.source.model_dir)

    def train_layout(self) -> tuple[TrainingConfig, list[Placement]]:
        """The running training layout: its config and each rank's placement, in rank order."""
        return self.config.training, [self.fleet.get(w).placement for w in self.train_worker_ids]

    def train_ranks_lost(self, wait_s: float = 15.0) -> list[str]:
        """What happened to the train ranks that ended or whose agent is gone, one line each. A
        failed call may arrive before the controller knows why: an agent's loss takes missed
        heartbeats, so this waits up to `wait_s` for a cause."""
        deadline = time.monotonic() + wait_s
        while not (lost := self.fleet.describe_lost(self.train_worker_ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [f"train rank {line}" for line in lost]

    async def _train_rank_lost(self, record: FleetWorker) -> None:
        """No train step can run without every rank: the loop ends the run (`GrpoJob`). Its
        wait for rollouts ends too: when the ranks' host also held every rollout instance, a loss
        noticed only by the next train call would come after the batch's trajectories waited out
        `rollout.agent.no_instance_wait_s` for an instance."""
        self.train_ranks_gone.set()

    def stop_train_ranks(self) -> None:
        """Closes the trainer and stops every train rank started last (also a layout that came up
        only in part); their devices are free afterwards."""
        if hasattr(self, "trainer"):
            self.trainer.close()
        for worker_id in self.train_worker_ids:
            self.fleet.stop(worker_id)
            self.fleet.forget(worker_id)

    def start_train_ranks(self, placements, training: TrainingConfig | None = None) -> list[str]:
        """Starts one train rank per placement in the layout of `training` (which becomes the
        job's; default: `config.training`), waits until they serve, and makes them the job's
        trainer. The ranks of a training restart are a new generation (worker ids are never
        reused)."""
        if training is not None:
            self.config.training = training
        training = self.config.training
        self._train_generation += 1
        prefix = "train" if self._train_generation == 1 else f"train-g{self._train_generation}"
        master_port = free_port()
        master_addr = self.cluster.agent_host(placements[0].agent_id)
        launched = []
        self.train_worker_ids = []  # as they start: a failure part-way knows what to stop
        for rank, placement in enumerate(placements):
            host = self.cluster.agent_host(placement.agent_id)
            port_file = self.run_dir / f"{prefix}-rank-{rank}.port"
            spec = TrainRankSpec(
                hf_model=str(self.source.model_dir),
                rank=rank,
                master_port=master_port,
                training=training,
                master_addr=master_addr,
                sync=self.config.sync,
                backend=self.config.backend,
                control=self.config.control,
                host=host,
                port_file=str(port_file),
                elastic=self.config.elastic if self.hosts_hybrid_lane else None,
            )
            worker_id = f"{prefix}-{rank}"
            # All launched before any is waited for: rank 0 serves only once every rank joined.
            launched.append(
                self.fleet.launch(worker_id, WorkerRole.TRAIN, placement, spec.to_argv(), port_file)
            )
            self.train_worker_ids.append(worker_id)
        self.train_addresses = []
        for record in launched:
            self.fleet.wait_serving(record)
            record.address = f"{self.cluster.agent_host(record.placement.agent_id)}:{record.address}"
            self.train_addresses.append(record.address)
        self.trainer = TrainRanks(self.train_addresses, self.token, self.config.control)
        return self.train_addresses

    async def _start_instances(self) -> None:
        self.pool = InstancePool(
            make_router(self.job.router, self.config.scheduler),
            self.token,
            self.config.scheduler,
            self.config.control,
        )
        # The controller's worker events mark a dead instance lost at once (its trajectories go
        # back to the router); `_watch_instances` restarts it.
        self.pool.watch_controller(self.cluster.controller.address, self.token)
        tp_sizes = sorted(self.job.rollout_tp_sizes, reverse=True)
        placements = [self.cluster.place(tp, f"rollout instance (TP {tp})") for tp in tp_sizes]
        await asyncio.gather(
            *(self._start_instance(tp, p) for tp, p in zip(tp_sizes, placements, strict=True))
        )

    async def _start_instance(self, tp_size: int, placement=None) -> int:
        instance_id = self._next_instance_id
        self._next_instance_id += 1
        worker_id = f"rollout-{instance_id}"
        placement = placement or self.cluster.place(tp_size, f"rollout instance {instance_id} (TP {tp_size})")
        address_file = self.run_dir / f"{worker_id}.addr"
        argv = self.rollout_argv(tp_size, self.cluster.agent_host(placement.agent_id), address_file)
        started = time.monotonic()
        record = await asyncio.to_thread(
            self.fleet.start,
            worker_id,
            WorkerRole.ROLLOUT,
            placement,
            argv,
            address_file,
            tp_size=tp_size,
            instance_id=instance_id,
        )
        self.instance_start_s.append(time.monotonic() - started)
        # The engine starts on the initial checkpoint; a restarted instance is brought to the
        # current version before the router sees it.
        try:
            await self.publication.join(instance_id, record.address, tp_size)
        except RuntimeError as e:
            await asyncio.to_thread(self.fleet.stop, worker_id)
            self.fleet.forget(worker_id)
            raise RuntimeError(f"{worker_id} {e}") from e
        await self.pool.add(instance_id, record.address, tp_size, worker_id=worker_id)
        return instance_id

    # -- weights -------------------------------------------------------------------------------

    @property
    def current_version(self) -> int:
        """The version every instance runs or is being brought to."""
        return self.publication.current_version

    async def publish(self, version: int) -> None:
        """Publishes the trainer's weights of `version` to every instance (`WeightPublication`);
        an instance whose loads keep failing is stopped as a loss, so the fleet's watchdog has
        it restarted on the current version."""
        behind = await self.publication.publish(self.trainer, version, self.tp_sizes_in_use())
        for instance_id, error in behind.items():
            record = self.fleet.instance(instance_id)
            if record is None:
                continue
            self.recorder.event(
                JobEvent.LOAD_GIVEN_UP, f"{record.worker_id} stays behind version {version}: {error}"
            )
            await asyncio.to_thread(self.fleet.stop, record.worker_id, planned=False)

    def republish(self) -> None:
        """The current version again, from the trainer as it is now (after a training restart)."""
        self.publication.republish(self.trainer, self.tp_sizes_in_use())

    # -- observation ---------------------------------------------------------------------------

    async def generated_tokens(self) -> dict[int, int]:
        """Tokens each live instance generated since it started."""
        ids = self.pool.live_ids()
        stats = await asyncio.gather(*(self._stats(i) for i in ids))
        return {i: s.num_generated_tokens for i, s in zip(ids, stats, strict=True) if s is not None}

    async def _stats(self, instance_id: int):
        try:
            return await self.pool.get(instance_id).client.stats(timeout_s=5.0)
        except Exception:  # noqa: BLE001 - a dying instance: the watchdog handles it
            return None

    async def _sample(self) -> None:
        buckets = self.config.scheduler.buckets
        while True:
            await asyncio.sleep(_SAMPLE_INTERVAL_S)
            ids = self.pool.live_ids()
            stats = await asyncio.gather(*(self._stats(i) for i in ids))
            per_bucket = {b.name: 0 for b in buckets}
            instances = {}
            for instance_id, s in zip(ids, stats, strict=True):
                if s is not None:
                    bucket = buckets[self.pool.get(instance_id).bucket].name
                    per_bucket[bucket] += s.num_active_requests
                    instances[str(instance_id)] = InstanceSample(
                        s.tensor_parallel_size,
                        bucket,
                        s.num_active_requests,
                        round(s.generated_tokens_per_s, 1),
                        round(s.kv_cache_usage, 4),
                    )
            train_ranks = self.config.training.world_size
            sample = ClusterSample(
                buckets=per_bucket,
                tokens_per_s=round(sum(i.tokens_per_s for i in instances.values()), 1),
                instances=instances,
                migrations=self.agent_loop.num_migrations,
                devices={
                    "rollout": (
                        sum(i.tp for i in instances.values() if i.requests),
                        sum(i.tp for i in instances.values()),
                    ),
                    "train": (train_ranks if self.training_now else 0, train_ranks),
                },
            )
            self.recorder.occupancy(sample)
            self.progress.occupancy(per_bucket, sample.tokens_per_s)

    async def _instance_lost(self, record: FleetWorker) -> None:
        """A rollout instance ended unasked: it is marked lost (its trajectories reroute
        themselves), then restarted on the same devices and brought to the current weights
        before it rejoins. One whose node agent is lost is abandoned (the planner re-plans)."""
        instance_id, worker_id = record.instance_id, record.worker_id
        if self._withdrawn(instance_id):
            return  # a plan stopping an instance is no failure: the plan forgets it
        self.forget_instance_now(instance_id)
        # The agent loop may have noticed first (a failed call); either way the pool tells the
        # router once and the displaced trajectories reroute themselves.
        self.pool.mark_lost(instance_id, f"worker {worker_id} {record.lost_reason}")
        self.recorder.event(JobEvent.INSTANCE_LOST, f"{worker_id} ended ({record.lost_reason})")
        if record.agent_lost or not self.cluster.agent_alive(record.placement.agent_id):
            # Its node is gone: nothing to restart there; the planner re-plans without it.
            self.recorder.event(
                JobEvent.INSTANCE_ABANDONED,
                f"{worker_id}: node agent {record.placement.agent_id} is lost",
                live_instances=len(self.pool.live_ids()),
            )
            if self.on_instance_gone is not None:
                self.on_instance_gone(instance_id)
            return
        self.restarts += 1
        self.restarts_in_progress += 1
        try:
            new_id = await self._start_instance(record.tp_size, record.placement)
        finally:
            self.restarts_in_progress -= 1
        if self.on_instance_restarted is not None:
            self.on_instance_restarted(instance_id, new_id)
        self.recorder.event(
            JobEvent.INSTANCE_RESTARTED,
            f"{worker_id} restarted as rollout-{new_id}",
            version=self.current_version,
            live_instances=len(self.pool.live_ids()),
        )

    def _withdrawn(self, instance_id: int) -> bool:
        try:
            return self.pool.get(instance_id).withdrawn
        except KeyError:
            return False

    # -- instances a plan starts and stops (`libra.job.planning`) --------------------------------

    def tp_sizes_in_use(self) -> list[int]:
        """TP sizes weights are published for: the launched ones and any a plan started."""
        return sorted({*self.job.rollout_tp_sizes, *(r.tp_size for r in self.fleet.rollout_instances())})

    def rollout_argv(self, tp_size: int, host: str, address_file: Path) -> list[str]:
        """The command line of a rollout instance of this job (its own and those plans start)."""
        from libra.rollout.instance_server import InstanceSpec

        inst = self.config.rollout.instance
        # The context window cannot exceed the model's positions (vLLM refuses to start).
        model_dir = self.source.model_dir
        positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        config = dataclasses.replace(
            inst,
            model=str(model_dir),
            max_model_len=min(inst.max_model_len, positions or inst.max_model_len),
            tensor_parallel_size=tp_size,
        )
        spec = InstanceSpec(config, control=self.config.control, host=host, address_file=str(address_file))
        return spec.to_argv()

    async def join_instance(
        self, worker_id: str, agent_id: str, devices: tuple[int, ...], tp_size: int, address: str
    ) -> int:
        """An instance a plan started (its worker serves at `address`): brought to the current
        weights, then added to the pool and watched like the job's own. Returns its pool id."""
        instance_id = self._next_instance_id
        self._next_instance_id += 1
        placement = Placement(agent_id, tuple(devices))
        self.fleet.adopt(
            worker_id, WorkerRole.ROLLOUT, placement, address, tp_size=tp_size, instance_id=instance_id
        )
        try:
            await self.publication.join(instance_id, address, tp_size)
        except (RuntimeError, ValueError):
            self.fleet.forget(worker_id)
            raise
        await self.pool.add(instance_id, address, tp_size, worker_id=worker_id)
        return instance_id

    async def forget_instance(self, instance_id: int) -> None:
        """A plan stopped the instance and the pool forgot it: so does the job."""
        self.forget_instance_now(instance_id)

    def forget_instance_now(self, instance_id: int) -> None:
        record = self.fleet.instance(instance_id)
        if record is not None:
            self.fleet.forget(record.worker_id)
        self.publication.leave(instance_id)

    def router_state(self) -> str:
        router = self.pool.router
        return router.serialize().hex() if isinstance(router, CmlfqRouter) else ""

    def restore_router(self, state: str) -> None:
        if state and isinstance(self.pool.router, CmlfqRouter):
            self.pool.router.restore(bytes.fromhex(state))

    def instance_pids(self) -> dict[str, int]:
        return self.fleet.pids(WorkerRole.ROLLOUT)

    async def stop(self) -> None:
        await self.fleet.close(timeout_s=self.job.worker_start_timeout_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if hasattr(self, "progress"):
            self.progress.close()
        if hasattr(self, "sandbox"):
            await self.sandbox.close()
        if hasattr(self, "pool"):
            await self.pool.close()
        if hasattr(self, "publication"):
            await self.publication.close()
        if hasattr(self, "trainer"):
            self.trainer.close()
        await asyncio.to_thread(self.cluster.stop)
