"""Config of the RL job: the `job` section of `LibraConfig`.

The rollout instances and the agent loop are configured by the root `rollout` section, the C-MLFQ
buckets by the root `scheduler` section. By default the job trains the warm-started tiny policy on
its recipe's procedural tasks (`libra.tasks.warm_start`); with `tasks.dataset_path` (and
`job.model`, an HF model folder) it trains on a dataset's records.

A config-only module: the root config composes it, so it sits below the root in docs/layers.md
(`job.config`), though the job that reads it sits on top, and imports nothing of the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.scheduler.factory import RouterKind

ROUTERS = tuple(k.value for k in (RouterKind.CMLFQ, RouterKind.LEAST_LOAD, RouterKind.ROUND_ROBIN))
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""`libra.job.trackers.TrackerKind`'s values (this config-only module imports nothing of the job)."""


@dataclass
class JobConfig:
    """The agentic GRPO job: its length, batch, workers and run-folder outputs."""

    model: str = ""
    """HF model folder of the initial policy; empty: the warm-started tiny model (built once and
    cached under ~/.cache/libra, see `libra.tasks.warm_start`). Required with `tasks.dataset_path`."""
    num_steps: int = 30
    """Train steps (policy versions) to run."""
    prompts_per_step: int = 8
    """Prompts per train step; each yields `group_size` trajectories. The train batch
    (`training.train_batch_size`) is derived: `prompts_per_step x group_size` trajectories."""
    group_size: int = 8
    """Trajectories per prompt (the GRPO group)."""
    rollout_tp_sizes: tuple[int, ...] = ()
    """TP size of each rollout instance (on the command line comma-separated:
    `job.rollout_tp_sizes=1,1,2`). Each TP size must have a bucket in the root `scheduler.buckets`.
    Empty (`job.rollout_tp_sizes=`): the planner's choice, on the devices training leaves, among
    the buckets' TP sizes (`libra.job.problem.planned_rollout_sizes`), as the original's
    `initial_allocation_strategy` does."""
    router: str = "cmlfq"
    """Routing policy: `cmlfq` (C-MLFQ over TP buckets), or the baselines `least_load`,
    `round_robin`."""
    checkpoint_interval: int = 10
    """Save a checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_weight_versions: int = 2
    """Published versions whose shared-memory buffers are kept, besides any an instance runs."""
    spawn_agent: bool = True
    """Start one node agent on this host (the embedded default). False: wait for `num_agents`
    agents started by a launcher (`scripts/launch_cuda.sh`)."""
    num_agents: int = 1
    """Node agents the job waits for before placing workers."""
    worker_start_timeout_s: float = 600.0
    """How long a worker may take to start serving."""
    metrics_port: int = 0
    """Port of the Prometheus endpoint the job serves on `control.host` (0: any free port, written
    to `<run_dir>/metrics.port`; -1: no endpoint)."""
    live_progress: bool = True
    """Show the live progress table (rich) on a terminal."""
    seed: int = 0
    """Seed of prompt order and of the held-out evaluation's sampling (the built-in agent loop's)."""
    planner: bool = True
    """Run the global planner in the loop (`libra.job.planning`): the controller serves it
    (GetPlan, ProposePlan, SetPlannerPolicy), the job feeds it every step and carries out the plans
    it adopts; its triggers and apply rule are the `planner.policy` section."""
    price_moves: bool = True
    """With the planner on and the `cmlfq` router: the router's buckets carry their instances'
    speed by the planner's calibrated model (`Planner.priced_buckets`, again at every bucket
    change and after every step), so a trajectory moves to a larger bucket only when the decoding
    that saves beats re-prefilling its context there (`scheduler.BucketConfig.speed`)."""
    planner_rescore_steps: int = 4
    """With the planner on: when its model would move to another layout, the planner first
    simulates each candidate (the running plan, its model's optimum, the best pool of each TP
    size) for this many steps on the job's latest finished groups (`libra.job.rescoring`),
    scored past the steps that fill its pipeline (`libra.sim.rescoring.rescore_warmup_steps`); it
    adopts another plan than its model's optimum only when that one scores
    `planner.policy.rescore_margin` more trained tokens/s, and leaves the running plan only when
    the apply rule passes on the simulated gain. It runs on the planner's thread while training
    goes on (the plan event says how long it took). 0: its cost model decides alone."""
    eval_tasks: int = 96
    """Held-out tasks (never trained on) rolled out before the first step and after the last, with
    the training's sampling: the policy's reward before and after on the same prompts, free of the
    prompt-mix noise of single training batches. Procedural tasks: the warm-start suite's test
    split; dataset tasks have no held-out split yet. 0: off."""
    eval_samples: int = 4
    """Trajectories per held-out task."""
    trackers: tuple[str, ...] = ("tensorboard",)
    """Where the run's scalars go besides `metrics.jsonl` (`libra.job.trackers`): any of
    `tensorboard`, `wandb` (Weights & Biases; `WANDB_MODE=offline` keeps it local), `mlflow`
    (on the command line comma-separated: `job.trackers=tensorboard,wandb`). W&B and MLflow need
    Libra's `trackers` extra."""
    tracker_project: str = "libra"
    """The W&B project and the MLflow experiment the run is logged under."""
    mlflow_tracking_uri: str = ""
    """The MLflow tracking server (`http://...`); empty: a file store in `<run_dir>/mlruns`."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "prompts_per_step", "group_size", "num_agents", "keep_weight_versions"):
            if getattr(self, name) < 1:
                raise ValueError(f"job.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(
                f"job.group_size must be >= 2 (GRPO compares within a group), got {self.group_size}"
            )
        if self.eval_tasks < 0:
            raise ValueError(
                f"job.eval_tasks must be >= 0 (0: no held-out evaluation), got {self.eval_tasks}"
            )
        if self.planner_rescore_steps < 0:
            raise ValueError(
                f"job.planner_rescore_steps must be >= 0 (0: no re-scoring), got {self.planner_rescore_steps}"
            )
        if self.eval_samples < 1:
            raise ValueError(f"job.eval_samples must be >= 1, got {self.eval_samples}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"job.checkpoint_interval must be >= 0, got {self.checkpoint_interval}")
        if self.router not in ROUTERS:
            raise ValueError(f"job.router must be one of {ROUTERS}, got {self.router!r}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"job.metrics_port must be -1 (off) or a port 0..65535, got {self.metrics_port}")
        if self.worker_start_timeout_s <= 0:
            raise ValueError(f"job.worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}")
        trackers = self.trackers
        if (
            not isinstance(trackers, tuple | list)
            or len(set(trackers)) != len(trackers)
            or not all(t in TRACKERS for t in trackers)
        ):
            raise ValueError(f"job.trackers must name each of {TRACKERS} at most once, got {trackers!r}")
        self.trackers = tuple(trackers)
        if not self.tracker_project:
            raise ValueError("job.tracker_project must name a W&B project / MLflow experiment")
        sizes = self.rollout_tp_sizes
        if not isinstance(sizes, tuple | list) or not all(_is_tp_size(s) for s in sizes):
            raise ValueError(
                f"job.rollout_tp_sizes must be a tuple of TP sizes >= 1 (empty: planned), got {sizes!r}"
            )
        self.rollout_tp_sizes = tuple(sizes)

    @property
    def batch_size(self) -> int:
        """Trajectories per train step."""
        return self.prompts_per_step * self.group_size


def _is_tp_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
