"""Everything the loop talks to, built in order: the policy model, the tasks, the cluster and its
workers (rollout instances and train ranks through node agents), the instance pool with its
router, the tools, the agent loop — and the services the loop calls between steps: weight
publication, token counters, bucket occupancy sampling and the rollout-instance watchdog."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path

from libra.config import LibraConfig
from libra.control import WorkerRole
from libra.job.config import JobConfig
from libra.job.progress import Progress
from libra.job.recorder import RunRecorder
from libra.job.trainer import TrainRanks
from libra.job.workers import JobCluster, free_port, training_json
from libra.rollout import AgentLoop, InstancePool
from libra.scheduler import CmlfqRouter, LeastLoadRouter, RoundRobinRouter
from libra.v1 import job_pb2, job_pb2_grpc

logger = logging.getLogger(__name__)

_SAMPLE_INTERVAL_S = 1.0


class JobWorkers:
    def __init__(self, config: LibraConfig, job: JobConfig):
        self.config, self.job = config, job
        self.run_dir = Path(config.run_dir)
        self.weights_dir = self.run_dir / "weights"
        self.cluster = JobCluster(config, job)
        self.instances: dict[int, tuple[str, int]] = {}
        """instance id -> (worker id, TP size) of live instances."""
        self._next_instance_id = 0
        self._background: list[asyncio.Task] = []
        self._closing = False
        self.current_weights: Path | None = None
        """The last published version's folder (None: the instances run the initial model)."""
        self.current_version = 0
        self.restarts = 0

    # -- start-up ------------------------------------------------------------------------------

    async def start(self, recorder: RunRecorder) -> None:
        from transformers import AutoTokenizer

        from libra.rollout.tools.config import SandboxConfig
        from libra.rollout.tools.sandbox import SandboxPool
        from libra.tasks.procedural import generate_suite
        from libra.tasks.warm_start import (
            COLLECTION_FILE,
            WarmStartConfig,
            cached_warm_start,
            warm_start_chat,
            warm_start_registry,
        )

        self.recorder = recorder
        recipe = WarmStartConfig()
        if self.job.model:
            self.model_dir = Path(self.job.model)
        else:
            print("[libra] building (or reusing) the warm-started tiny policy ...", flush=True)
            self.model_dir = await asyncio.to_thread(cached_warm_start, recipe)
        if not (self.model_dir / COLLECTION_FILE).is_file():
            raise ValueError(
                f"job.model {str(self.model_dir)!r} has no {COLLECTION_FILE}: the first version of the job "
                "trains on the procedural tasks of a warm-started policy (leave job.model empty)"
            )
        suite = generate_suite(
            recipe.num_train_tasks + recipe.num_val_tasks + recipe.num_test_tasks,
            recipe.suite_seed,
            recipe.family,
            recipe.max_calls,
            recipe.distribution,
        )
        self.tasks = suite.tasks[: recipe.num_train_tasks]
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.chat = warm_start_chat(tokenizer)

        await asyncio.to_thread(self.cluster.start)
        self.token = self.cluster.token
        train_addresses, instance_ready = await asyncio.gather(
            asyncio.to_thread(self._start_train_ranks), self._start_instances()
        )
        self.trainer = TrainRanks(train_addresses, self.token, self.config.control)

        self.sandbox = await SandboxPool(SandboxConfig(num_workers=2)).start()
        registry = warm_start_registry(recipe, self.model_dir / COLLECTION_FILE, self.sandbox)
        from libra.job.rollouts import TimedTool

        tools = [TimedTool(registry[name]) for name in registry.names]
        agent = self.config.rollout.agent
        self.agent_loop = AgentLoop(self.pool, self.chat, tools, agent, self.job.scheduler)
        self.progress = Progress(
            self.job, self.config.run_dir, live=self.job.live_progress and sys.stdout.isatty()
        )
        self._background = [asyncio.create_task(self._sample()), asyncio.create_task(self._watch_instances())]
        recorder.event(
            "started",
            f"{len(self.instances)} rollout instances, {len(train_addresses)} train rank(s)",
            model=str(self.model_dir),
        )

    def _make_router(self):
        if self.job.router == "cmlfq":
            return CmlfqRouter(self.job.scheduler)
        if self.job.router == "least_load":
            return LeastLoadRouter()
        return RoundRobinRouter()

    def _start_train_ranks(self) -> list[str]:
        training = self.config.training
        master_port = free_port()
        placements = [self.cluster.place(1, f"train rank {r}") for r in range(training.world_size)]
        master_addr = self.cluster.agent_host(placements[0].agent_id)
        started = []
        for rank, placement in enumerate(placements):
            host = self.cluster.agent_host(placement.agent_id)
            port_file = self.run_dir / f"train-rank-{rank}.port"
            port_file.unlink(missing_ok=True)
            argv = [
                sys.executable,
                "-m",
                "libra.training.worker",
                "--hf-model",
                str(self.model_dir),
                "--rank",
                str(rank),
                "--world-size",
                str(training.world_size),
                "--master-addr",
                master_addr,
                "--master-port",
                str(master_port),
                "--tensor-parallel",
                str(training.tensor_parallel),
                "--pipeline-parallel",
                str(training.pipeline_parallel),
                "--training",
                training_json(training),
                "--backend",
                self.config.backend.name,
                "--host",
                host,
                "--port-file",
                str(port_file),
            ]
            self.cluster.start_worker(f"train-{rank}", WorkerRole.TRAIN, placement, argv)
            started.append((f"train-{rank}", port_file, host))
        return [f"{host}:{self.cluster.wait_for_file(w, f)}" for w, f, host in started]

    async def _start_instances(self) -> None:
        self.pool = InstancePool(self._make_router(), self.token, self.job.scheduler, self.config.control)
        await asyncio.gather(*(self._start_instance(tp) for tp in self.job.tp_sizes))

    async def _start_instance(self, tp_size: int, placement=None) -> int:
        instance_id = self._next_instance_id
        self._next_instance_id += 1
        worker_id = f"rollout-{instance_id}"
        placement = placement or self.cluster.place(tp_size, f"rollout instance {instance_id} (TP {tp_size})")
        address_file = self.run_dir / f"{worker_id}.addr"
        address_file.unlink(missing_ok=True)
        inst = self.config.rollout.instance
        # The context window cannot exceed the model's positions (vLLM refuses to start).
        positions = json.loads((self.model_dir / "config.json").read_text()).get("max_position_embeddings")
        max_model_len = min(inst.max_model_len, positions or inst.max_model_len)
        argv = [
            sys.executable,
            "-m",
            "libra.job.instance_worker",
            "--model",
            str(self.model_dir),
            "--address-file",
            str(address_file),
            "--dtype",
            inst.dtype,
            "--max-model-len",
            str(max_model_len),
            "--tensor-parallel-size",
            str(tp_size),
            "--kv-cache-gib",
            str(inst.kv_cache_gib),
            "--max-num-seqs",
            str(inst.max_num_seqs),
            "--seed",
            str(inst.seed),
            "--host",
            self.cluster.agent_host(placement.agent_id),
        ]
        await asyncio.to_thread(self.cluster.start_worker, worker_id, WorkerRole.ROLLOUT, placement, argv)
        address = await asyncio.to_thread(self.cluster.wait_for_file, worker_id, address_file)
        self.instances[instance_id] = (worker_id, tp_size)
        if self.current_weights is not None:  # a restarted instance: bring it to the current version
            await self._load(address, self.current_weights, self.current_version)
        await self.pool.add(instance_id, address, tp_size)
        return instance_id

    # -- weights -------------------------------------------------------------------------------

    async def publish(self, version: int) -> float:
        """Exports the trainer's weights as an HF folder and switches every live instance to it.
        Returns the slowest instance's switch time."""
        exported_version, blob = await asyncio.to_thread(self.trainer.export_weights)
        if exported_version != version:
            raise RuntimeError(f"exported version {exported_version}, expected {version}")
        folder = self.weights_dir / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(blob)
        shutil.copy(self.model_dir / "config.json", folder / "config.json")
        self.current_weights, self.current_version = folder, version
        live = [self.pool.get(i) for i in self.pool.live_ids()]
        seconds = await asyncio.gather(*(self._load(p.client.address, folder, version) for p in live))
        from libra.job.loop import remove_old_weights

        remove_old_weights(self.weights_dir, self.job.keep_weight_versions)
        return max(seconds, default=0.0)

    async def _load(self, address: str, folder: Path, version: int) -> float:
        from libra.rollout.client import open_aio_channel

        channel = open_aio_channel(address, self.config.control)
        try:
            stub = job_pb2_grpc.WeightLoaderStub(channel)
            reply = await stub.LoadWeights(
                job_pb2.LoadWeightsRequest(directory=str(folder), version=version),
                metadata=(("authorization", f"Bearer {self.token}"),),
                timeout=120,
            )
        finally:
            await channel.close()
        if reply.version != version:
            raise RuntimeError(f"instance {address} runs version {reply.version} after loading {version}")
        return reply.seconds

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
        buckets = self.job.scheduler.buckets
        while True:
            await asyncio.sleep(_SAMPLE_INTERVAL_S)
            ids = self.pool.live_ids()
            stats = await asyncio.gather(*(self._stats(i) for i in ids))
            per_bucket = {b.name: 0 for b in buckets}
            tokens_per_s = 0.0
            for instance_id, s in zip(ids, stats, strict=True):
                if s is not None:
                    per_bucket[buckets[self.pool.get(instance_id).bucket].name] += s.num_active_requests
                    tokens_per_s += s.generated_tokens_per_s
            self.recorder.occupancy(per_bucket, round(tokens_per_s, 1))
            self.progress.occupancy(per_bucket, tokens_per_s)

    async def _watch_instances(self) -> None:
        """A rollout worker that ended without being asked is marked lost (its trajectories
        reroute themselves), then restarted on the same devices and brought to the current
        weights before it rejoins."""
        while not self._closing:
            await asyncio.sleep(0.5)
            for instance_id, (worker_id, tp_size) in list(self.instances.items()):
                if self._closing:
                    break
                status = self.cluster.worker_state(worker_id)
                if status is None or not status.state.ended:
                    continue
                del self.instances[instance_id]
                # The agent loop may have noticed first (a failed call); either way the pool tells
                # the router once and the displaced trajectories reroute themselves.
                self.pool.mark_lost(instance_id, f"worker {worker_id} {status.state.name}")
                message = f"{worker_id} ended ({status.state.name}, exit {status.exit_code})"
                self.recorder.event("instance_lost", message)
                placement = self.cluster.workers.pop(worker_id)
                self.restarts += 1
                new_id = await self._start_instance(tp_size, placement)
                self.recorder.event(
                    "instance_restarted",
                    f"{worker_id} restarted as rollout-{new_id}",
                    version=self.current_version,
                    live_instances=len(self.pool.live_ids()),
                )

    def router_state(self) -> str:
        router = self.pool.router
        return router.serialize().hex() if isinstance(router, CmlfqRouter) else ""

    def restore_router(self, state: str) -> None:
        if state and isinstance(self.pool.router, CmlfqRouter):
            self.pool.router.restore(bytes.fromhex(state))

    def instance_pids(self) -> dict[str, int]:
        out = {}
        for worker_id, _ in self.instances.values():
            status = self.cluster.worker_state(worker_id)
            if status is not None:
                out[worker_id] = status.pid
        return out

    async def stop(self) -> None:
        # A restart in progress is finished first (bounded by the worker start timeout), so the
        # run's fault record is complete and no worker is stopped half-started.
        self._closing = True
        watchdog = self._background[1:] if self._background else []
        if watchdog:
            await asyncio.wait(watchdog, timeout=self.job.worker_start_timeout_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if hasattr(self, "progress"):
            self.progress.close()
        if hasattr(self, "sandbox"):
            await self.sandbox.close()
        if hasattr(self, "pool"):
            await self.pool.close()
        if hasattr(self, "trainer"):
            self.trainer.close()
        await asyncio.to_thread(self.cluster.stop)
