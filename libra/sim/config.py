"""Typed configuration of a simulation: the cluster, model, batch and workload, the costs of
moving things around, and the policies to compare.

A simulation config file is a Python file defining `sim_config() -> SimConfig`
(`configs/sim_*.py`); `libra simulate CONFIG` runs it, read by the one config-file loader
(`libra.config.load_from_file`). It is a document of its own, not a section of `LibraConfig`: it
describes a cluster, model and workload to simulate and the systems to compare on them, where a
run's config describes the one job that runs on the cluster at hand.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from libra.backends.base import HardwareProfile
from libra.backends.profiles import A800_SXM4_80GB, ASCEND_910B, H100_SXM_80GB, H200_SXM_141GB
from libra.config import load_from_file
from libra.planner.config import QWEN3_14B, ClusterSpec, ModelArch, PlannerConfig, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.cpu_reference import cpu_profile
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS
from libra.scheduler.config import CmlfqConfig
from libra.scheduler.factory import RouterKind
from libra.sim.workloads import WorkloadConfig
from libra.training.config import STALENESS_MODES

PROFILES: dict[str, HardwareProfile] = {
    "a800": A800_SXM4_80GB,
    "h100": H100_SXM_80GB,
    "h200": H200_SXM_141GB,
    "ascend910b": ASCEND_910B,
    "cpu": cpu_profile(1),
}
"""`cpu`: one CPU slot of this project's machines (what `libra.sim.validation` replays runs on)."""


class Mode(enum.Enum):
    COLOCATED_SYNC = "colocated_sync"
    """Rollout, then training, on the same devices (verl's hybrid engine)."""
    DISAGGREGATED_ASYNC = "disaggregated_async"
    """Separate training and rollout devices; rollout runs ahead by at most max_staleness versions."""


class Pool(enum.Enum):
    HOMOGENEOUS = "homogeneous"
    """Every rollout instance has the one TP size with the best per-device throughput."""
    PLANNED = "planned"
    """The planner's initial plan: its split, TP buckets and thresholds."""
    FIXED_PATTERN = "fixed_pattern"
    """The original's hand-made layout: 2/3 of the nodes train, each rollout node holds TP sizes
    `SimConfig.fixed_node_pattern`."""


@dataclass(frozen=True)
class PolicySpec:
    """One system to simulate."""

    name: str
    mode: Mode
    pool: Pool
    router: RouterKind
    replan: bool = False
    """The planner re-plans every plan_interval steps (or on pressure) from the measured history."""
    elastic: bool = False
    """Training grows and shrinks by whole DP replicas through the elastic hybrid pool (cheap,
    non-blocking); without it a changed training size restarts training from a checkpoint."""
    tail_batching: bool = False
    """RollPacker-style: over-provision prompts, keep the first to finish, defer the rest to
    dedicated long rounds (synchronous mode only)."""
    max_staleness: int | None = None
    """None: the config's batch.max_staleness (ignored in synchronous mode)."""
    original_thresholds: bool = False
    """FIXED_PATTERN with C-MLFQ: the original's thresholds (4k / 12k / 30k remaining tokens for
    TP-1 / 2 / 4) instead of thresholds fitted to the buckets' capacity
    (`libra.planner.routing_thresholds`)."""
    rollout_tp: int = 0
    """HOMOGENEOUS: every rollout instance of this TP size (0: the one with the best per-device
    throughput that holds the longest context)."""
    description: str = ""


HINDSIGHT_TP_SIZES = (1, 2, 4, 8)
"""The homogeneous pools Libra is held against with hindsight (`HINDSIGHT_POLICIES`)."""

POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec(
            "colocated_sync",
            Mode.COLOCATED_SYNC,
            Pool.HOMOGENEOUS,
            RouterKind.LEAST_LOAD,
            description="verl-style: rollout then train on all devices, least-load routing",
        ),
        PolicySpec(
            "disaggregated_static",
            Mode.DISAGGREGATED_ASYNC,
            Pool.HOMOGENEOUS,
            RouterKind.LEAST_LOAD,
            max_staleness=1,
            description="static split (the planner's initial one), homogeneous rollout, one-step off-policy",
        ),
        PolicySpec(
            "length_mlfq",
            Mode.DISAGGREGATED_ASYNC,
            Pool.PLANNED,
            RouterKind.LENGTH_MLFQ,
            description="the planned TP buckets, static, demotion by generated length",
        ),
        PolicySpec(
            "tail_batching",
            Mode.COLOCATED_SYNC,
            Pool.HOMOGENEOUS,
            RouterKind.LEAST_LOAD,
            tail_batching=True,
            description="RollPacker-style synchronous rounds with over-provisioning and long rounds",
        ),
        PolicySpec(
            "libra_no_cmlfq",
            Mode.DISAGGREGATED_ASYNC,
            Pool.PLANNED,
            RouterKind.LEAST_LOAD,
            replan=True,
            elastic=True,
            description="Libra with least-load routing instead of C-MLFQ",
        ),
        PolicySpec(
            "libra_no_elastic",
            Mode.DISAGGREGATED_ASYNC,
            Pool.PLANNED,
            RouterKind.CMLFQ,
            replan=True,
            elastic=False,
            description="Libra whose re-splits restart training",
        ),
        PolicySpec(
            "libra_no_planner",
            Mode.DISAGGREGATED_ASYNC,
            Pool.FIXED_PATTERN,
            RouterKind.CMLFQ,
            description="Libra on the original's fixed layout, never re-planned (thresholds fitted to "
            "its buckets' capacity)",
        ),
        PolicySpec(
            "fixed_original_thresholds",
            Mode.DISAGGREGATED_ASYNC,
            Pool.FIXED_PATTERN,
            RouterKind.CMLFQ,
            original_thresholds=True,
            description="libra_no_planner with the original's thresholds (4k / 12k / 30k remaining "
            "tokens), blind to how much of the pool each bucket holds",
        ),
        PolicySpec(
            "fixed_least_load",
            Mode.DISAGGREGATED_ASYNC,
            Pool.FIXED_PATTERN,
            RouterKind.LEAST_LOAD,
            description="libra_no_planner's heterogeneous layout with capacity-weighted least-load "
            "routing instead of C-MLFQ: C-MLFQ's own effect where there are buckets to route between",
        ),
        PolicySpec(
            "fixed_sync",
            Mode.DISAGGREGATED_ASYNC,
            Pool.FIXED_PATTERN,
            RouterKind.CMLFQ,
            max_staleness=0,
            description="libra_no_planner kept on-policy (staleness 0: each step's rollout waits for the "
            "last weights, so its tail bounds the step)",
        ),
        PolicySpec(
            "fixed_sync_least_load",
            Mode.DISAGGREGATED_ASYNC,
            Pool.FIXED_PATTERN,
            RouterKind.LEAST_LOAD,
            max_staleness=0,
            description="fixed_sync with capacity-weighted least-load routing",
        ),
        *(
            PolicySpec(
                f"homogeneous_tp{tp}",
                Mode.DISAGGREGATED_ASYNC,
                Pool.HOMOGENEOUS,
                RouterKind.LEAST_LOAD,
                rollout_tp=tp,
                description=f"the planner's initial split with every rollout instance TP-{tp}, static, "
                "the config's staleness: one of the homogeneous pools Libra is held against with hindsight",
            )
            for tp in HINDSIGHT_TP_SIZES
        ),
        PolicySpec(
            "libra",
            Mode.DISAGGREGATED_ASYNC,
            Pool.PLANNED,
            RouterKind.CMLFQ,
            replan=True,
            elastic=True,
            description="C-MLFQ + planner + elastic hybrid pool",
        ),
    )
}

BASELINES = ("colocated_sync", "disaggregated_static", "length_mlfq", "tail_batching")
ABLATIONS = ("libra_no_cmlfq", "libra_no_elastic", "libra_no_planner")
HETEROGENEOUS_ABLATION = ("libra_no_planner", "fixed_least_load")
"""C-MLFQ against least-load on one heterogeneous layout. When the planner's pool has a single
bucket (the best pool for the workload can be homogeneous), libra_no_cmlfq equals libra by
construction, and this pair is where the router's effect shows."""
ROUTER_COMPARISONS = (
    (*HETEROGENEOUS_ABLATION, "on the fixed heterogeneous layout, C-MLFQ / least-load"),
    (
        "fixed_sync",
        "fixed_sync_least_load",
        "on the same layout kept on-policy (tail-bound), C-MLFQ / least-load",
    ),
    (
        "libra_no_planner",
        "fixed_original_thresholds",
        "C-MLFQ with capacity-fitted / the original's thresholds",
    ),
)
"""(policy, baseline, what the ratio says): the router's own effects, on equal devices."""
HINDSIGHT_POLICIES = tuple(f"homogeneous_tp{tp}" for tp in HINDSIGHT_TP_SIZES)
"""The best of these, known only after running them all, is the static pool a user who tried
every TP size would keep: Libra must match it without the trials."""


@dataclass(frozen=True)
class MovementCosts:
    """Seconds that reconfiguration and stage switches take (the paper does not publish them;
    these are the orders of magnitude peers report, see `reference/peers.md`)."""

    instance_start_s: float = 20.0
    """A new rollout instance loads weights and warms up before it takes requests."""
    hybrid_join_s: float = 10.0
    """An elastic-pool replica fetches the training state before contributing gradients
    (training keeps stepping meanwhile)."""
    restart_training_s: float = 120.0
    """Checkpoint, stop and relaunch training with a new layout (training stalls)."""
    colocate_switch_s: float = 6.0
    """Colocated mode: offload/onload engines between the two stages, per stage switch."""
    migration: str = "reprefill"
    """How a migrated trajectory's context reaches its new instance: `reprefill` (the original's
    main path) or `kv_move` (its KV copied from the instance holding it, then only the new tool
    return prefilled; a trajectory whose instance was stopped re-prefills)."""
    kv_move_bandwidth_bytes_per_s: float = 0.0
    """`kv_move`: bytes/s of one device link carrying KV (min(source TP, target TP) links work in
    parallel); 0: the profile's intra-node link inside a node, its NIC across nodes."""
    tail_overprovision: float = 1.25
    """Tail batching: prompts launched per round over prompts kept."""

    def __post_init__(self) -> None:
        for name in ("instance_start_s", "hybrid_join_s", "restart_training_s", "colocate_switch_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"sim.costs.{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_move_bandwidth_bytes_per_s < 0:
            raise ValueError(
                "sim.costs.kv_move_bandwidth_bytes_per_s must be >= 0, "
                f"got {self.kv_move_bandwidth_bytes_per_s}"
            )
        if self.migration not in ("reprefill", "kv_move"):
            raise ValueError(f"sim.costs.migration must be 'reprefill' or 'kv_move', got {self.migration!r}")
        if self.tail_overprovision < 1:
            raise ValueError(f"sim.costs.tail_overprovision must be >= 1, got {self.tail_overprovision}")


@dataclass(frozen=True)
class SimConfig:
    """One simulated comparison."""

    name: str = "sim"
    profile: str = "a800"
    """Hardware profile: one of `PROFILES`."""
    hardware: HardwareProfile | None = None
    """The profile itself, for a caller that holds one (the job: its backend's, whatever the
    machine); it replaces `profile`'s."""
    num_nodes: int = 6
    devices_per_node: int = 8
    model: ModelArch = QWEN3_14B
    batch: TrainingBatch = field(
        default_factory=lambda: TrainingBatch(
            global_batch=128, group_size=4, recompute="full", max_staleness=2
        )
    )
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    costs: MovementCosts = field(default_factory=MovementCosts)
    num_steps: int = 100
    """Training steps per policy."""
    policies: tuple[str, ...] = tuple(POLICIES)
    history_size: int = 256
    """Finished trajectories the planner plans from (a preflight sample at the start)."""
    planner_rescore_steps: int = 0
    """The planner re-scores its candidate plans -- its optimum and the best pool of each TP
    size -- by simulating each for this many steps on the workload as it is (`libra.sim.rescoring`;
    scored past the steps that fill its pipeline), at the initial plan and at every re-plan its
    model would apply; 0: its cost model decides alone."""
    cmlfq: CmlfqConfig = field(default_factory=CmlfqConfig)
    """C-MLFQ's settings (`scheduler.*` in the job: demotion, the KV share counted full, the
    draining share, the cap, the P90 window, rebuilds); its buckets are the simulated layout's.
    Its `max_queue_length` 0 (the default) is derived for the launch pool and
    again whenever a plan changes the pool, as the job derives it (`FairQueueLength`); the
    baselines that cap their placements take the same cap."""
    cmlfq_price_moves: bool = True
    """C-MLFQ's buckets carry their instances' speed from the cost model
    (`libra.planner.routing_speeds`), so a promotion is made only when it saves more decoding on
    the loaded target than its move costs; false: every promotion to a bucket with room is made.
    The speeds follow the run's history: priced again after every step, as the job's are."""
    fixed_node_pattern: tuple[int, ...] = (1, 1, 2, 4)
    fixed_train_fraction: float = 2 / 3
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS
    max_num_batched_tokens: int = 0
    """Tokens one engine step of a rollout instance processes (vLLM's `max_num_batched_tokens`:
    the step's decodes first, prefill chunks in what is left); 0: the default vLLM gives an
    engine started the way `vllm_usage_context` says (`vllm_max_num_batched_tokens`)."""
    vllm_usage_context: str = "engine"
    """How rollout engines are started, which sets vLLM's default token budget: `engine`
    (`AsyncLLM.from_engine_args`, what `libra.rollout` does), `llm` (the offline `LLM` class,
    verl's synchronous rollout) or `api_server` (`vllm serve`)."""
    seed: int = 0
    staleness_mode: str = "budget"
    """As the job's `training.staleness_mode`, for the asynchronous policies that take the
    config's staleness (a policy naming its own drops what finishes past it): `drop` (the trainer
    never waits; trajectories finishing too stale are dropped), `wait` (it waits for
    trajectories launched max_staleness + tail_staleness versions ago; none is dropped) or
    `budget` (it waits for them only when dropping them would take the dropped share past
    `drop_budget`)."""
    drop_budget: float = 0.02
    """As the job's `training.drop_budget`."""
    tail_staleness: int = 0
    """As the job's `training.tail_staleness`, for the asynchronous policies that take the
    config's staleness (not those naming their own, `PolicySpec.max_staleness`): versions beyond
    the launch depth (`batch.max_staleness`) that a trajectory finishing late may carry and still
    be trained on."""

    def __post_init__(self) -> None:
        if self.staleness_mode not in STALENESS_MODES:
            raise ValueError(
                f"sim.staleness_mode must be one of {STALENESS_MODES}, got {self.staleness_mode!r}"
            )
        if not 0 <= self.drop_budget < 1:
            raise ValueError(f"sim.drop_budget must be in [0, 1), got {self.drop_budget}")
        if self.hardware is None and self.profile not in PROFILES:
            raise ValueError(f"sim.profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        if self.tail_staleness < 0:
            raise ValueError(f"sim.tail_staleness must be >= 0, got {self.tail_staleness}")
        if self.num_nodes < 1:
            raise ValueError(f"sim.num_nodes must be >= 1, got {self.num_nodes}")
        if self.planner_rescore_steps < 0:
            raise ValueError(f"sim.planner_rescore_steps must be >= 0, got {self.planner_rescore_steps}")
        if self.num_steps < 1:
            raise ValueError(f"sim.num_steps must be >= 1, got {self.num_steps}")
        object.__setattr__(self, "policies", tuple(self.policies))
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(
                f"sim.policies must name policies among {sorted(POLICIES)}, got {unknown or '()'}"
            )
        if self.workload.group_size != self.batch.group_size:
            raise ValueError(
                f"sim.workload.group_size ({self.workload.group_size}) must equal "
                f"sim.batch.group_size ({self.batch.group_size})"
            )
        if self.history_size < 1:
            raise ValueError(f"sim.history_size must be >= 1, got {self.history_size}")
        if sum(self.fixed_node_pattern) != self.devices_per_node:
            raise ValueError(
                f"sim.fixed_node_pattern {self.fixed_node_pattern} must fill a node "
                f"of {self.devices_per_node}"
            )
        if not 0 < self.fixed_train_fraction < 1:
            raise ValueError(f"sim.fixed_train_fraction must be in (0, 1), got {self.fixed_train_fraction}")
        if self.vllm_usage_context not in VLLM_USAGE_CONTEXTS:
            raise ValueError(
                f"sim.vllm_usage_context must be one of {VLLM_USAGE_CONTEXTS}, "
                f"got {self.vllm_usage_context!r}"
            )
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.planner.max_decode_batch:
            raise ValueError(
                f"sim.max_num_batched_tokens ({self.max_num_batched_tokens}) must be 0 or >= "
                f"planner.max_decode_batch ({self.planner.max_decode_batch}), as vLLM requires"
            )

    def token_budget(self, tp: int) -> int:
        """The engine step's token budget of a TP-tp rollout instance (vLLM's defaults scale
        with the world size on the CPU only)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        budget = vllm_max_num_batched_tokens(self.hardware_profile, self.vllm_usage_context, tp)
        return max(budget, self.planner.max_decode_batch)

    @property
    def hardware_profile(self) -> HardwareProfile:
        return self.hardware or PROFILES[self.profile]

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(self.num_nodes, self.devices_per_node, self.hardware_profile)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


VLLM_USAGE_CONTEXTS = ("engine", "llm", "api_server")
GIB = 2**30


def vllm_max_num_batched_tokens(profile: HardwareProfile, usage: str, world_size: int = 1) -> int:
    """vLLM's default `max_num_batched_tokens` when none is given (vLLM 0.32,
    `EngineArgs.get_batch_defaults` and `SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`).

    Only the `LLM` class and the API server have per-hardware defaults; any other usage context
    -- `AsyncLLM.from_engine_args` passes ENGINE_CONTEXT, which is how `libra.rollout` starts its
    engines -- gets the SchedulerConfig default, 2048 tokens, on every platform. The per-hardware
    table: devices with >= 160 GiB 16384/16384 (LLM/API server); >= 70 GiB and not an A100
    16384/8192 (A800, H100, H200); others 8192/2048 (Ascend 910B by its 64 GB: vllm-ascend may
    set its own); the CPU 4096/2048 per rank of the world."""
    if usage not in VLLM_USAGE_CONTEXTS:
        raise ValueError(f"vLLM usage context must be one of {VLLM_USAGE_CONTEXTS}, got {usage!r}")
    if usage == "engine":
        return 2048
    llm = usage == "llm"
    if profile.name.lower().startswith("cpu"):
        return (4096 if llm else 2048) * world_size
    memory = profile.memory_capacity_bytes
    if memory >= 160 * GIB:
        return 16384
    if memory >= 70 * GIB and "a100" not in profile.name.lower():
        return 16384 if llm else 8192
    return 8192 if llm else 2048


def load_sim_config(path: str | Path) -> SimConfig:
    """`sim_config()` of a Python config file (what `libra simulate CONFIG` reads)."""
    return load_from_file(path, "sim_config", SimConfig)
