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
from libra.job.recorder import ClusterSample, InstanceSample, JobEvent, RunRecorder
from libra.job.trainer import TrainRanks
from libra.rollout import AgentLoop, InstanceClient, InstancePool, InstanceUnavailable
from libra.scheduler import CmlfqRouter, make_router
from libra.sync import VersionLedger
from libra.sync.load_request import LoadRequest
from libra.training.config import TrainingConfig
from libra.training.hybrid import HYBRID_POOL_LIMITS
from libra.training.worker import TrainRankSpec

logger = logging.getLogger(__name__)

_SAMPLE_INTERVAL_S = 1.0
_LOAD_ATTEMPTS = 4
_LOAD_BACKOFF_S = 0.5
"""A failed load is retried after 0.5, 1 and 2 s; after 4 failures the instance is restarted."""


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
        self.ledger = VersionLedger(initial_version=0, max_attempts=_LOAD_ATTEMPTS, backoff_s=_LOAD_BACKOFF_S)
        """Which version each instance runs; owed and failed loads."""
        self.loads: dict[int, LoadRequest] = {}
        """What an instance of each TP size loads the latest version from."""
        self.current_version = 0
        self._loaders: dict[int, InstanceClient] = {}
        """Instance id -> the client that loads its weights (live and starting instances)."""
        self._load_locks: dict[int, asyncio.Lock] = {}
        self._load_seconds: dict[int, float] = {}
        self._retired: list[InstanceClient] = []
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
        if self.config.tasks.dataset_path is None:
            await self._procedural_tasks_and_tools()
        else:
            self._dataset_tasks_and_tools()

        self.planning_problem = self._planning_problem()
        await asyncio.to_thread(self.cluster.start, self.planning_problem)
        self.token = self.cluster.token
        # Training takes the first devices, rollout instances the rest (largest TP first): the
        # planner's device numbering, so that the launch layout is a plan it can hold.
        train_placements = [
            self.cluster.place(1, f"train rank {r}") for r in range(self.config.training.world_size)
        ]
        train_addresses, instance_ready = await asyncio.gather(
            asyncio.to_thread(self.start_train_ranks, train_placements), self._start_instances()
        )

        agent = self.config.rollout.agent
        self.agent_loop = AgentLoop(self.pool, self.chat, self.tools, agent, self.config.scheduler)
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
            model=str(self.model_dir),
        )

    async def _procedural_tasks_and_tools(self) -> None:
        """The default: the warm-started tiny policy (`job.model`, else built once and cached) on
        its recipe's procedural suite, with the recipe's tools and chat format."""
        from transformers import AutoTokenizer

        from libra.job.rollouts import TimedTool
        from libra.tasks.warm_start import (
            COLLECTION_FILE,
            WarmStartConfig,
            cached_warm_start,
            warm_start_chat,
            warm_start_registry,
            warm_start_suite,
        )

        recipe = WarmStartConfig()
        if self.job.model:
            self.model_dir = Path(self.job.model)
        else:
            print("[libra] building (or reusing) the warm-started tiny policy ...", flush=True)
            self.model_dir = await asyncio.to_thread(cached_warm_start, recipe)
        if not (self.model_dir / COLLECTION_FILE).is_file():
            raise ValueError(
                f"job.model {str(self.model_dir)!r} has no {COLLECTION_FILE}: without tasks.dataset_path the "
                "job trains on the procedural tasks of a warm-started policy (leave job.model empty)"
            )
        # The warm-started policy's own suite (same difficulty and seed), its train split.
        suite = warm_start_suite(recipe).tasks
        self.tasks = [t.record for t in suite[: recipe.num_train_tasks]]
        self.eval_tasks = [t.record for t in suite[recipe.num_train_tasks + recipe.num_val_tasks :]]
        self.chat = warm_start_chat(AutoTokenizer.from_pretrained(self.model_dir))
        registry = warm_start_registry(recipe, self.model_dir / COLLECTION_FILE, self.sandbox)
        self.tools = [TimedTool(registry[name]) for name in registry.names]

    def _dataset_tasks_and_tools(self) -> None:
        """`tasks.dataset_path`'s records for the HF model `job.model`, with the tools of
        `tools.enabled` (checked against the records' task types) listed in the model's own chat
        template."""
        from transformers import AutoTokenizer

        from libra.job.rollouts import TimedTool, load_dataset_tasks
        from libra.rollout.chat import ChatFormat
        from libra.rollout.tools.registry import build_registry

        self.model_dir = Path(self.job.model)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"job.model {self.job.model!r} is not an HF model folder (no config.json)")
        self.tasks = load_dataset_tasks(self.config.tasks, self.config.tools)
        self.eval_tasks = []
        registry = build_registry(self.config.tools, self.sandbox)
        self.tools = [TimedTool(registry[name]) for name in registry.names]
        self.chat = ChatFormat(AutoTokenizer.from_pretrained(self.model_dir), tools=self.tools)

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

        return planning_problem(self.config, self.model_dir)

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
                hf_model=str(self.model_dir),
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
        address = record.address
        self.instance_start_s.append(time.monotonic() - started)
        # The engine starts on the initial checkpoint; a restarted instance is brought to the
        # current version before the router sees it.
        self.ledger.add_instance(str(instance_id), now=time.monotonic())
        self._loaders[instance_id] = InstanceClient(address, self.token, self.config.control)
        self._load_locks[instance_id] = asyncio.Lock()
        if not await self._bring_up_to_date(instance_id):
            raise RuntimeError(
                f"{worker_id} could not load version {self.ledger.latest}: "
                f"{self.ledger.given_up().get(str(instance_id), 'lost')}"
            )
        await self.pool.add(instance_id, address, tp_size, worker_id=worker_id)
        return instance_id

    # -- weights -------------------------------------------------------------------------------

    async def publish(self, version: int) -> float:
        """Publishes the trainer's weights of `version` (PublishWeights: resharded into shared
        memory for every rollout TP size) and switches every instance to it, concurrently
        (LoadWeights). A failed load is retried with back-off while the instance keeps serving
        its old version; an instance that fails `_LOAD_ATTEMPTS` times is restarted (the watchdog
        brings it up on the current version). Returns the wall time."""
        started = time.perf_counter()
        # Versions that no instance runs any more, except the newest ones kept.
        keep = set(self.ledger.published[-self.job.keep_weight_versions :])
        release = [v for v in self.ledger.releasable() if v not in keep]
        published = await asyncio.to_thread(
            self.trainer.publish_weights, version, self.tp_sizes_in_use(), release
        )
        self.ledger.forget(release)
        self.loads = published.loads
        self.ledger.publish(version)
        self.current_version = version
        ids = list(self._loaders)
        loaded = await asyncio.gather(*(self._bring_up_to_date(i) for i in ids))
        for instance_id, ok in zip(ids, loaded, strict=True):
            record = self.fleet.instance(instance_id)
            if not ok and record is not None:
                error = self.ledger.given_up().get(str(instance_id), "")
                self.recorder.event(
                    JobEvent.LOAD_GIVEN_UP, f"{record.worker_id} stays behind version {version}: {error}"
                )
                # Ended as a loss: the fleet's watchdog has it restarted on the current version.
                await asyncio.to_thread(self.fleet.stop, record.worker_id, planned=False)
        seconds = time.perf_counter() - started
        logger.info(
            "published version %d in %.3f s (gather %.3f s, reshard %.3f s, slowest load %.3f s)",
            version,
            seconds,
            published.gather_seconds,
            published.publish_seconds,
            max((self._load_seconds.get(i, 0.0) for i in ids), default=0.0),
        )
        return seconds

    def republish(self) -> None:
        """Publishes the current version again, from the trainer as it is now: after a training
        restart the old ranks' buffers went with them, and an instance (re)started before the next
        step must still find the version it is owed."""
        published = self.trainer.publish_weights(self.current_version, self.tp_sizes_in_use())
        self.loads = published.loads

    async def _bring_up_to_date(self, instance_id: int) -> bool:
        """Loads the latest version into the instance, retrying failed loads as the ledger says
        (the instance serves its old version meanwhile). False when the ledger gave up on it or
        the instance went away."""
        name, lock = str(instance_id), self._load_locks.get(instance_id)
        if lock is None:
            return False  # lost before its turn
        async with lock:
            while True:
                try:
                    if self.ledger.version_of(name) >= self.ledger.latest:
                        return True
                except LookupError:
                    return False  # lost meanwhile
                if name in self.ledger.given_up():
                    return False
                task = next((t for t in self.ledger.due(time.monotonic()) if t.instance == name), None)
                if task is None:
                    await asyncio.sleep(0.05)  # backing off
                    continue
                client, record = self._loaders.get(instance_id), self.fleet.instance(instance_id)
                if client is None or record is None:
                    return False  # lost meanwhile
                try:
                    result = await client.load_weights(self.loads[record.tp_size])
                    ok, error, version = result.ok, result.error, result.version
                except (InstanceUnavailable, ValueError) as e:
                    ok, error, version = False, str(e), -1
                try:
                    if ok:
                        self.ledger.loaded(name, version, time.monotonic())
                        self._load_seconds[instance_id] = result.seconds
                        continue
                    self.ledger.failed(name, task.version, error, time.monotonic())
                except LookupError:
                    return False  # lost while loading
                self.recorder.event(
                    JobEvent.LOAD_FAILED,
                    f"rollout-{instance_id} attempt {task.attempt} of version {task.version}: {error}",
                )

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
        positions = json.loads((self.model_dir / "config.json").read_text()).get("max_position_embeddings")
        config = dataclasses.replace(
            inst,
            model=str(self.model_dir),
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
        if tp_size not in self.loads and self.ledger.latest > 0:
            raise ValueError(f"no published weights for TP-{tp_size} yet; the instance would stay behind")
        instance_id = self._next_instance_id
        self._next_instance_id += 1
        placement = Placement(agent_id, tuple(devices))
        self.fleet.adopt(
            worker_id, WorkerRole.ROLLOUT, placement, address, tp_size=tp_size, instance_id=instance_id
        )
        self.ledger.add_instance(str(instance_id), now=time.monotonic())
        self._loaders[instance_id] = InstanceClient(address, self.token, self.config.control)
        self._load_locks[instance_id] = asyncio.Lock()
        if not await self._bring_up_to_date(instance_id):
            self.forget_instance_now(instance_id)
            raise RuntimeError(f"{worker_id} could not load version {self.ledger.latest}")
        await self.pool.add(instance_id, address, tp_size, worker_id=worker_id)
        return instance_id

    async def forget_instance(self, instance_id: int) -> None:
        """A plan stopped the instance and the pool forgot it: so does the job."""
        self.forget_instance_now(instance_id)

    def forget_instance_now(self, instance_id: int) -> None:
        record = self.fleet.instance(instance_id)
        if record is None:
            return
        self.fleet.forget(record.worker_id)
        try:
            self.ledger.remove_instance(str(instance_id))
        except LookupError:
            pass
        self._load_locks.pop(instance_id, None)
        # Closed at stop(), not now: a load in flight on it fails on its own (the instance is
        # gone), whereas closing the channel would cancel it.
        if instance_id in self._loaders:
            self._retired.append(self._loaders.pop(instance_id))

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
        for client in [*self._loaders.values(), *self._retired]:
            await client.close()
        if hasattr(self, "trainer"):
            self.trainer.close()
        await asyncio.to_thread(self.cluster.stop)
