"""Typed inputs of the planner: the cluster, the model, the training batch, the workload history,
and the knobs of the search and of the re-plan triggers.

`PlannerConfig` is the `planner` section of `LibraConfig`. `PlanningProblem` bundles everything
one search needs; a Python file defining `planning_problem() -> PlanningProblem` describes a
cluster for `libra plan CONFIG` (see `configs/planner_qwen3_14b_48xa800.py`), read by the root's
one config-file loader (`libra.config.load_from_file`, which this layer is below).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.backends.base import HardwareProfile
from libra.model_spec import ModelSpec
from libra.planner.execution_config import ExecutorConfig
from libra.trace import TrajectoryTrace
from libra.training.elastic import HybridPoolLimits


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclass(frozen=True)
class ModelArch:
    """The decoder-only transformer being trained and served (dense, GQA, gated MLP)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int = 0
    """0: hidden_size / num_attention_heads."""
    num_params: int = 0
    """0: counted from the shapes (attention, gated MLP, untied embedding and output layer)."""
    bytes_per_param: int = 2
    """Weights and KV cache dtype in bytes (bf16: 2)."""

    @classmethod
    def from_spec(cls, spec: ModelSpec, bytes_per_param: int) -> ModelArch:
        """The planner's view of an HF model, its weights and KV cache at `bytes_per_param`."""
        return cls(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_kv_heads,
            ffn_hidden_size=spec.ffn_hidden_size,
            vocab_size=spec.vocab_size,
            head_dim=spec.head_dim,
            bytes_per_param=bytes_per_param,
        )

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "bytes_per_param",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads ({self.num_kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    "model.head_dim must be set when num_attention_heads does not divide hidden_size"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim < 1:
            raise ValueError(f"model.head_dim must be >= 1, got {self.head_dim}")
        if self.num_params == 0:
            object.__setattr__(
                self,
                "num_params",
                self.params_per_layer * self.num_layers + 2 * self.vocab_size * self.hidden_size,
            )
        if self.num_params < 1:
            raise ValueError(f"model.num_params must be >= 1, got {self.num_params}")

    @property
    def query_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    def serves_at_tp(self, tp: int) -> bool:
        """Whether a rollout engine can shard the model over `tp` devices: the query heads split
        evenly, and the KV heads split evenly or are replicated evenly (vLLM's rule; Qwen2.5-7B's
        28 heads allow TP 1, 2, 4 and 7, not 8)."""
        heads, kv = self.num_attention_heads, self.num_kv_heads
        return tp >= 1 and heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Weights of one layer: Q, K, V and output projections plus the gated MLP (norms ignored)."""
        attention = self.hidden_size * (2 * self.query_dim + 2 * self.kv_dim)
        return attention + 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param


# Qwen3-14B's config.json: 40 layers, 40 query / 8 KV heads of 128 (the original's evaluation model).
QWEN3_14B = ModelArch(
    num_layers=40,
    hidden_size=5120,
    num_attention_heads=40,
    num_kv_heads=8,
    ffn_hidden_size=17408,
    vocab_size=151936,
    head_dim=128,
    num_params=14_770_000_000,
)


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of identical devices, numbered node-major: device d lives on node
    d // devices_per_node. The profile's own `devices_per_node` is ignored in favour of this one."""

    num_nodes: int
    devices_per_node: int
    profile: HardwareProfile

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"cluster.num_nodes must be >= 1, got {self.num_nodes}")
        if not _is_power_of_two(self.devices_per_node):
            raise ValueError(f"cluster.devices_per_node must be a power of two, got {self.devices_per_node}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class RequestRecord:
    """One finished trajectory of the recent history, as rollout saw it."""

    prompt_tokens: int
    """Tokens prefilled over the whole trajectory: the prompt plus every tool return."""
    output_tokens: int
    """Tokens decoded over all turns."""
    num_turns: int = 1
    tool_time_s: float = 0.0
    """Wall time spent waiting for tools; the trajectory's own latency includes it, the
    instance's busy time does not (other trajectories decode meanwhile)."""

    @classmethod
    def from_trace(cls, trace: TrajectoryTrace) -> RequestRecord:
        """What rollout did for one finished trajectory (the job's or the simulator's): every
        prefilled token (the prompt and the tool results), every decoded one, its turns and its
        time in tools."""
        return cls(
            trace.prompt_tokens + trace.payload_tokens,
            trace.output_tokens,
            len(trace.turns),
            trace.tool_time_s,
        )

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 1:
            raise ValueError(
                f"request needs prompt_tokens >= 0 and output_tokens >= 1, "
                f"got {self.prompt_tokens}, {self.output_tokens}"
            )
        if self.num_turns < 1 or self.tool_time_s < 0:
            raise ValueError(
                f"request needs num_turns >= 1 and tool_time_s >= 0, got {self.num_turns}, {self.tool_time_s}"
            )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class TrainingBatch:
    """What one training step consumes."""

    global_batch: int = 128
    """Sequences (trajectories) per step: prompts x group_size."""
    group_size: int = 8
    """GRPO group size; a data-parallel rank must receive whole groups."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    distributed_optimizer: bool = True
    """Optimizer state (fp32 master, Adam m and v) sharded over data-parallel ranks
    (`training.use_distributed_optimizer`)."""
    recompute: str = "none"
    """Activation recompute, as `training.recompute`: `full` keeps only each layer's input and runs
    every forward twice; `selective` recomputes core attention, which flash attention (the
    accelerators' Transformer-Engine spec) does not keep anyway: priced as `none` in memory."""
    recompute_logprobs: bool = True
    """One extra forward-only pass per step for the old policy's log-probs."""
    max_staleness: int = 0
    """How far the asynchronous loop launches ahead: global_batch x (max_staleness + 1)
    trajectories in flight (0: synchronous)."""
    tail_staleness: int = 0
    """Versions a late trajectory may lag beyond `max_staleness` and still be trained on: a
    trajectory may span max_staleness + tail_staleness + 1 training steps, so its own latency
    bounds the step time only divided by that."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.group_size < 1:
            raise ValueError(
                f"batch.global_batch and batch.group_size must be >= 1, "
                f"got {self.global_batch}, {self.group_size}"
            )
        if self.global_batch % self.group_size:
            raise ValueError(
                f"batch.group_size ({self.group_size}) must divide batch.global_batch ({self.global_batch})"
            )
        if self.max_staleness < 0 or self.tail_staleness < 0:
            raise ValueError(
                f"batch.max_staleness and tail_staleness must be >= 0, got {self.max_staleness}, "
                f"{self.tail_staleness}"
            )
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"batch.recompute must be none, selective or full, got {self.recompute!r}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(
                f"batch.micro_batch_sizes must be non-empty positive, got {self.micro_batch_sizes}"
            )
        object.__setattr__(self, "micro_batch_sizes", tuple(sorted(set(self.micro_batch_sizes))))


@dataclass(frozen=True)
class SearchConfig:
    """The space the planner searches and its constraints (see `libra.planner.search`)."""

    rollout_tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Allowed TP sizes of rollout instances (powers of two; those above devices_per_node are dropped)."""
    train_tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    train_pp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    split_granularity: int = 0
    """Training takes a multiple of this many devices; 0: whole nodes. Below a node it must be a
    power of two dividing the node (rollout instances still get aligned blocks:
    `libra.planner.plan.place_rollout`)."""
    min_train_devices: int = 1
    min_rollout_devices: int = 1
    uneven_data_parallel: bool = False
    """Allow training DP sizes that do not divide the batch's G GRPO groups: each replica still
    trains whole groups, ceil(G/DP) or floor(G/DP) of them, and the step is priced on the largest
    share. This is what the elastic hybrid pool makes possible (a hybrid replica's gradients,
    normalised by the global token count, are added to a core replica's before the DP
    all-reduce, so shares need not be equal). Off by default: a layout launched or restarted as
    Megatron DP groups gives every rank the same number of groups, and the job's hybrid pool
    joins at most one replica per core replica, to a core of PP = 1; the simulator turns
    it on for policies that have the k-replica pool (`libra.sim.pools.planning_problem`)."""
    relative_tolerance: float = 1e-9
    """The search's result is within this relative distance of the optimum (bisection stop)."""
    threshold_candidates: int = 64
    """Most cut points (incl. both ends) the bucket thresholds are chosen among: the cuts between
    distinct output lengths of the history, thinned to quantiles when there are more."""

    def __post_init__(self) -> None:
        for name in ("rollout_tp_sizes", "train_tp_sizes", "train_pp_sizes"):
            sizes = tuple(sorted(set(getattr(self, name))))
            if not sizes or not all(_is_power_of_two(s) for s in sizes):
                raise ValueError(
                    f"planner.search.{name} must be non-empty powers of two, got {getattr(self, name)}"
                )
            object.__setattr__(self, name, sizes)
        if self.split_granularity < 0:
            raise ValueError(f"planner.search.split_granularity must be >= 0, got {self.split_granularity}")
        if self.min_train_devices < 1 or self.min_rollout_devices < 1:
            raise ValueError("planner.search.min_train_devices and min_rollout_devices must be >= 1")
        if self.threshold_candidates < 3:
            raise ValueError(
                f"planner.search.threshold_candidates must be >= 3, got {self.threshold_candidates}"
            )
        if not 0 < self.relative_tolerance < 1e-2:
            raise ValueError(
                f"planner.search.relative_tolerance must be in (0, 0.01), got {self.relative_tolerance}"
            )

    def granularity(self, cluster: ClusterSpec) -> int:
        """The effective split granularity on `cluster`; ValueError when it is neither a divisor
        nor a multiple of the node."""
        g = self.split_granularity or cluster.devices_per_node
        dpn = cluster.devices_per_node
        if g % dpn and not (_is_power_of_two(g) and dpn % g == 0):
            raise ValueError(
                f"planner.search.split_granularity ({g}) must divide or be a multiple of "
                f"devices_per_node ({dpn})"
            )
        return g


@dataclass(frozen=True)
class TriggerPolicy:
    """When to re-plan and when to apply a candidate plan (`libra.planner.triggers`).
    Defaults are the original's (`reference/libra-notes.md` §3.4), plus hysteresis."""

    plan_interval: int = 10
    """Steps between periodic re-plans; 0 disables the periodic trigger."""
    warmup_steps: int = 1
    cooldown_steps: int = 1
    """Steps after a re-plan during which no trigger fires."""
    min_history: int = 8
    max_history: int = 4096
    queue_pressure: float = 0.75
    active_pressure: float = 0.85
    rejected_growth: int = 8
    """Early re-plan once this many more rollouts were rejected since the last plan."""
    rollout_train_ratio: float = 1.25
    """Early re-plan when T_rollout / T_train (or its inverse) reaches this."""
    hysteresis: float = 0.1
    """A pressure trigger re-arms only after its signal fell this far below its threshold."""
    min_gain_ratio: float = 0.05
    rescore_margin: float = 0.02
    """With a rescorer (`Planner`), another candidate replaces the model's optimum only when it
    scores this much higher: a short simulation's ranking of near-equal plans is noise."""
    reconfiguration_cost_s: float = 15.0
    """Prior of the cost of applying a plan that moves rollout instances and hybrid replicas;
    replaced by the measured mean once one is recorded."""
    restart_cost_s: float = 120.0
    """Prior of the cost of a plan that restarts training (checkpoint, stop, start the new ranks,
    load: training waits meanwhile); replaced by the measured mean of restarts once one is
    recorded."""
    amortization_steps: int = 0
    """Steps the gain is counted over against the one-off cost; 0: plan_interval (or 1)."""
    cut_inflight: bool = False
    """Stopping a rollout instance cuts its in-flight trajectories (they resume elsewhere from
    their kept tokens) instead of draining them first."""
    auto_apply: bool = True
    """False: candidates wait for an external controller (`ProposePlan`)."""

    def __post_init__(self) -> None:
        for name in (
            "plan_interval",
            "warmup_steps",
            "cooldown_steps",
            "min_history",
            "rejected_growth",
            "amortization_steps",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"planner.policy.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_history < max(1, self.min_history):
            raise ValueError(f"planner.policy.max_history must be >= min_history, got {self.max_history}")
        for name in ("queue_pressure", "active_pressure"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"planner.policy.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.rollout_train_ratio <= 1:
            raise ValueError(
                f"planner.policy.rollout_train_ratio must be > 1, got {self.rollout_train_ratio}"
            )
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"planner.policy.hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.rescore_margin < 0:
            raise ValueError(f"planner.policy.rescore_margin must be >= 0, got {self.rescore_margin}")
        if self.min_gain_ratio < 0 or self.reconfiguration_cost_s < 0 or self.restart_cost_s < 0:
            raise ValueError(
                "planner.policy.min_gain_ratio, reconfiguration_cost_s and restart_cost_s must be >= 0"
            )


@dataclass(frozen=True)
class PlannerConfig:
    """The `planner` section of a run's config."""

    search: SearchConfig = field(default_factory=SearchConfig)
    policy: TriggerPolicy = field(default_factory=TriggerPolicy)
    kv_fragmentation: float = 0.04
    memory_utilization: float = 0.9
    """Share of device memory training may use, and rollout engines unless
    `rollout_memory_utilization` says otherwise."""
    rollout_memory_utilization: float | None = None
    """Share of device memory a rollout engine takes (vLLM's gpu_memory_utilization; the job sets
    its engines'); None: `memory_utilization`."""
    rollout_kv_bytes_per_device: int | None = None
    """KV-cache bytes each device of a rollout instance holds where engines are sized by bytes
    (vLLM on the CPU: VLLM_CPU_KVCACHE_SPACE per worker; the job sets its engines'); None: what
    the rollout memory share leaves after the weight shard and the workspace."""
    max_decode_batch: int = 256
    """Sequences an engine decodes at once (vLLM's max_num_seqs; the job sets its engines')."""
    activation_workspace_bytes: int = 2 * 2**30
    """Rollout: memory kept free per device for activations and the sampler."""
    execution: ExecutorConfig = field(default_factory=ExecutorConfig)
    """Timeouts of carrying a plan out on the node agents (`libra.planner.actions`)."""
    hybrid_pool: HybridPoolLimits = field(default_factory=HybridPoolLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.kv_fragmentation < 1:
            raise ValueError(f"planner.kv_fragmentation must be in [0, 1), got {self.kv_fragmentation}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"planner.memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.rollout_memory_utilization is not None and not 0 < self.rollout_memory_utilization <= 1:
            raise ValueError(
                f"planner.rollout_memory_utilization must be in (0, 1], got {self.rollout_memory_utilization}"
            )
        if self.rollout_kv_bytes_per_device is not None and self.rollout_kv_bytes_per_device < 1:
            raise ValueError(
                f"planner.rollout_kv_bytes_per_device must be >= 1, got {self.rollout_kv_bytes_per_device}"
            )
        if self.max_decode_batch < 1 or self.activation_workspace_bytes < 0:
            raise ValueError("planner.max_decode_batch must be >= 1 and activation_workspace_bytes >= 0")


@dataclass(frozen=True)
class PlanningProblem:
    """Everything one search needs."""

    cluster: ClusterSpec
    model: ModelArch
    batch: TrainingBatch
    history: tuple[RequestRecord, ...]
    config: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "history", tuple(self.history))
        if not self.history:
            raise ValueError("history must hold at least one request (seed it from a preflight sample)")
