"""Everything the loop talks to, built in order: the policy model and tasks (`TaskSource`), the
cluster, the fleet of its workers, weight publication, the train ranks (`TrainRankGroup`), the
rollout instances with their pool and router (`RolloutInstances`), the tools and the agent loop;
and bucket occupancy sampling for the run's records and progress (which also feeds each
instance's KV usage to the router)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from libra.config import LibraConfig
from libra.job.cluster import JobCluster
from libra.job.fleet import Fleet
from libra.job.instances import RolloutInstances
from libra.job.progress import Progress
from libra.job.publication import WeightPublication
from libra.job.recorder import ClusterSample, InstanceSample, JobEvent, RunRecorder
from libra.job.task_source import load_task_source
from libra.job.train_ranks import TrainRankGroup
from libra.rollout import AgentLoop, InstancePool
from libra.scheduler import BucketConfig, CmlfqConfig, fair_queue_length, make_router
from libra.training.hybrid import HYBRID_POOL_LIMITS

logger = logging.getLogger(__name__)

_SAMPLE_INTERVAL_S = 1.0


class JobWorkers:
    def __init__(self, config: LibraConfig):
        self.config, self.job = config, config.job
        self.run_dir = Path(config.run_dir)
        self.cluster = JobCluster(config)
        self.fleet = Fleet(self.cluster, self.job.worker_start_timeout_s)
        """Every worker of the job: one record each, and the watchdog."""
        self._background: list[asyncio.Task] = []
        self.sandbox = self.progress = None
        self.publication: WeightPublication | None = None
        self.train_ranks: TrainRankGroup | None = None
        self.instances: RolloutInstances | None = None
        self.endpoint = self.agent_runner = None
        self.rescorer = None

    async def start(self, recorder: RunRecorder) -> None:
        from libra.rollout.tools.sandbox import SandboxPool

        self.recorder = recorder
        # Before the workers: the tools (the sandbox among them) decide the prompt's tool list.
        self.sandbox = await SandboxPool(self.config.tools.sandbox).start()
        self.source = await load_task_source(self.config, self.sandbox)

        from libra.job.problem import planning_problem

        self.planning_problem = self._planning_problem()
        # With the planner off, the same problem still lays the launch out and weighs the router.
        launch_problem = self.planning_problem or planning_problem(self.config, self.source.model_dir)
        if not self.job.rollout_tp_sizes:
            self._plan_launch_layout(launch_problem)
        # The rescorer takes the cap as the config states it: where it is derived, each candidate
        # plan's simulation derives it for its own pool, as the pool does for the router when a
        # plan changes it (`trajectories_in_flight` below).
        self.rescorer = self._rescorer()
        weight_of_tp = router_weights(launch_problem)
        derived_cap = not self.config.scheduler.max_queue_length
        self.config = dataclasses.replace(self.config, scheduler=launch_scheduler(self.config, weight_of_tp))
        await asyncio.to_thread(self.cluster.start, self.planning_problem, self.rescorer)
        self.publication = WeightPublication(
            recorder, self.cluster.token, self.config.control, self.job.keep_weight_versions
        )
        self.train_ranks = TrainRankGroup(
            self.config, self.fleet, self.source.model_dir, self.hosts_hybrid_lane
        )
        price = self._bucket_pricing()
        scheduler = self.config.scheduler
        if price is not None:
            scheduler = dataclasses.replace(scheduler, buckets=price(scheduler.buckets))
        pool = InstancePool(
            make_router(self.job.router, scheduler),
            self.cluster.token,
            scheduler,
            self.config.control,
            price,
            weight_of_tp,
            trajectories_in_flight=trajectories_in_flight(self.config) if derived_cap else 0,
        )
        self.instances = RolloutInstances(
            self.config, self.cluster, self.fleet, self.publication, recorder, self.source.model_dir, pool
        )
        # Training takes the first devices, rollout instances the rest (largest TP first): the
        # planner's device numbering, so that the launch layout is a plan it can hold.
        train_placements = [
            self.cluster.place(1, f"train rank {r}") for r in range(self.config.training.world_size)
        ]
        await asyncio.gather(
            asyncio.to_thread(self.train_ranks.start, train_placements),
            self.instances.start(self.job.rollout_tp_sizes),
        )

        self.agent_loop = AgentLoop(
            self.pool, self.source.chat, self.source.tools, self.config.rollout.agent, self.config.scheduler
        )
        await self._start_endpoint()
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
            f"{len(self.train_ranks.addresses)} train rank(s)",
            model=str(self.source.model_dir),
            max_queue_length=self.config.scheduler.max_queue_length,
        )

    async def _start_endpoint(self) -> None:
        """The OpenAI-compatible endpoint over the agent loop (`endpoint.serve`), and the user's
        agent that the rollouts run against it (`endpoint.agent`)."""
        self.endpoint = self.agent_runner = None
        settings = self.config.endpoint
        if not settings.enabled:
            return
        from libra.endpoint.server import OpenAIEndpoint, tls_context
        from libra.endpoint.service import EndpointService
        from libra.job.agents import AgentRunner

        control = self.config.control
        service = EndpointService(self.agent_loop, settings)
        tls = tls_context(control.tls_cert_file, control.tls_key_file)
        self.endpoint = await OpenAIEndpoint(
            service, self.cluster.token, control.host, settings.port, tls
        ).start()
        (self.run_dir / "endpoint.url").write_text(self.endpoint.url + "\n")
        if settings.agent:
            tools = {tool.name: tool for tool in self.source.tools}
            self.agent_runner = AgentRunner(
                settings.agent, service, self.endpoint.url, self.cluster.token, tools
            )

    @property
    def pool(self):
        return self.instances.pool

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

    def _rescorer(self):
        """The planner's rescorer on the job's finished groups (`libra.job.rescoring`; None: the
        planner is off or `job.planner_rescore_steps` is 0). It reads the factors of the planner
        the cluster starts next."""
        if self.planning_problem is None or self.job.planner_rescore_steps < 1:
            return None
        from libra.job.rescoring import JobRescorer

        return JobRescorer(
            self.config, self.planning_problem, lambda: self.cluster.planner.calibrated_factors()
        )

    def _bucket_pricing(self) -> Callable[[Sequence[BucketConfig]], tuple[BucketConfig, ...]] | None:
        """The planner's `priced_buckets` when C-MLFQ prices its moves (`job.price_moves`, with
        the planner on and the `cmlfq` router), else None. The pool prices its buckets with it at
        launch, at every change of buckets and after every step (`JobPlanning.after_step`)."""
        planner = self.cluster.planner
        if not self.job.price_moves or planner is None or self.job.router != "cmlfq":
            return None
        return planner.priced_buckets

    def _plan_launch_layout(self, problem) -> None:
        """`job.rollout_tp_sizes` empty: the planner's choice of rollout instances becomes the
        job's config (the parts built after this read it, and the loop takes it when the workers
        have started; the trackers' copy, logged before, keeps the empty field), said in an event."""
        from libra.job.problem import planned_rollout_sizes

        sizes, plan = planned_rollout_sizes(self.config, problem)
        self.job = dataclasses.replace(self.job, rollout_tp_sizes=sizes)
        self.config = dataclasses.replace(self.config, job=self.job)
        self.recorder.event(
            JobEvent.LAUNCH_PLANNED,
            f"rollout instances TP {', '.join(map(str, sizes))}, the planner's choice: {plan.layout()}, "
            f"predicted rollout {plan.predicted_rollout_s:.2f} s a step",
            tp_sizes=list(sizes),
        )

    # -- between steps ---------------------------------------------------------------------------

    async def publish(self, version: int) -> None:
        await self.instances.publish(self.train_ranks.client, version)

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
                    # The router's KV caps see what this sample sees, once a second.
                    self.pool.report_kv_usage(instance_id, s.kv_cache_usage)
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
                    "train": (train_ranks if self.train_ranks.busy else 0, train_ranks),
                },
            )
            self.recorder.occupancy(sample)
            self.progress.occupancy(per_bucket, sample.tokens_per_s)

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()
        await self.fleet.close(timeout_s=self.job.worker_start_timeout_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.progress is not None:
            self.progress.close()
        if self.sandbox is not None:
            await self.sandbox.close()
        if self.instances is not None:
            await self.instances.close()
        if self.publication is not None:
            await self.publication.close()
        if self.train_ranks is not None:
            self.train_ranks.stop()
        await asyncio.to_thread(self.cluster.stop)


def router_weights(problem) -> Callable[[int], int]:
    """Each rollout instance's router weight by TP size, from the planner's rollout model on
    `problem` (as the simulator weighs them): its KV capacity in units of the smallest instance
    size that holds the model, so that a mixed pool is loaded by capacity."""
    from libra.planner.cost_model import EfficiencyFactors
    from libra.planner.rollout_cost import RolloutCostModel

    return RolloutCostModel(problem.cluster, problem.model, problem.config, EfficiencyFactors()).router_weight


def trajectories_in_flight(config: LibraConfig) -> int:
    """What rollout can hold at once: the train batch, once per version launched ahead."""
    return config.job.batch_size * (config.training.max_staleness + 1)


def launch_scheduler(config: LibraConfig, weight_of_tp: Callable[[int], int]) -> CmlfqConfig:
    """`config.scheduler`, its `max_queue_length` derived when the config leaves it 0: the fair
    share, per unit of the launch pool's weight (`job.rollout_tp_sizes`, planned or given), of the
    trajectories in flight (`trajectories_in_flight`). Said in the log (and in the `started`
    event; the trackers' copy of the config, logged before, keeps the 0); the pool derives it
    again whenever its instances change (`InstancePool`, `FairQueueLength`). A
    cap set by hand is kept, with a warning where C-MLFQ routes a mixed pool and the cap is below
    that share or so far above it that the pool always counts as draining."""
    scheduler = config.scheduler
    in_flight = trajectories_in_flight(config)
    total_weight = sum(weight_of_tp(tp) for tp in config.job.rollout_tp_sizes)
    derived = fair_queue_length(in_flight, total_weight)
    if not scheduler.max_queue_length:
        logger.info(
            "scheduler.max_queue_length derived: %d per unit of weight "
            "(%d trajectories in flight, pool weight %d)",
            derived,
            in_flight,
            total_weight,
        )
        return dataclasses.replace(scheduler, max_queue_length=derived)
    # On a pool of one TP size there is no other bucket to move to, and only C-MLFQ moves.
    if config.job.router != "cmlfq" or len(set(config.job.rollout_tp_sizes)) < 2:
        return scheduler
    cap = scheduler.max_queue_length
    if cap < derived:
        logger.warning(
            "scheduler.max_queue_length %d per unit of weight is below the fair share of the %d "
            "trajectories in flight over the pool's weight of %d (%d): every instance stays full and "
            "C-MLFQ moves no trajectory until a step's tail; 0 derives it",
            cap,
            in_flight,
            total_weight,
            derived,
        )
    elif scheduler.draining_fraction * cap * total_weight >= in_flight:
        logger.warning(
            "scheduler.max_queue_length %d per unit of weight is so far above the fair share of the %d "
            "trajectories in flight over the pool's weight of %d (%d) that the pool always counts as "
            "draining: the fair-share bound never applies and trajectories move to faster buckets "
            "throughout; 0 derives it",
            cap,
            in_flight,
            total_weight,
            derived,
        )
    return scheduler
