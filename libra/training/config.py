"""Training configuration: parallelism, optimizer, GRPO and staleness options.

`TrainingConfig` is meant to become the `training` section of `LibraConfig`
(`--training.tensor_parallel=2`, `--training.grpo.clip_high=0.28`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recompute: `selective` recomputes core attention, `full` whole layers (one at a time)."""


@dataclass
class GrpoConfig:
    """The GRPO objective (see `libra.training.grpo` for the formulas)."""

    clip_low: float = 0.2
    """Importance ratios below 1 - clip_low are clipped (for positive advantages: no gain)."""
    clip_high: float = 0.2
    """Upper clip 1 + clip_high. DAPO's clip-higher: set it above clip_low (e.g. 0.28)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy; 0 disables it (no reference pass)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    importance_cap: float = 2.0
    """Truncation C of the importance weight min(pi_old / pi_rollout, C) that corrects for the
    rollout engine's (possibly stale) sampling policy."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); False: Dr. GRPO."""
    std_eps: float = 1e-6
    """Added to the group standard deviation before dividing."""
    loss_aggregation: str = "token_mean"
    """`token_mean`: every masked token of the batch weighs the same (DAPO); `sequence_mean`: every
    trajectory weighs the same, its tokens sharing its weight (see `libra.training.grpo`)."""
    temperature: float = 1.0
    """The rollouts' sampling temperature: logits are divided by it before every logprob, so the
    trainer scores tokens under the distribution the engine sampled them from. Must equal
    `rollout.agent.temperature` (checked by `LibraConfig`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"training.grpo.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"training.grpo.clip_high must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"training.grpo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"training.grpo.entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.importance_cap < 1:
            raise ValueError(f"training.grpo.importance_cap must be >= 1, got {self.importance_cap}")
        if self.std_eps <= 0:
            raise ValueError(f"training.grpo.std_eps must be > 0, got {self.std_eps}")
        if self.loss_aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(
                "training.grpo.loss_aggregation must be token_mean or sequence_mean, "
                f"got {self.loss_aggregation!r}"
            )
        if self.temperature <= 0:
            raise ValueError(f"training.grpo.temperature must be > 0, got {self.temperature}")


STALENESS_MODES = ("wait", "drop", "budget")


@dataclass
class TrainingConfig:
    """One training job: its parallelism, optimizer and RL options."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    dtype: str = "float32"
    """Parameter dtype: `float32` or `bfloat16`."""
    seed: int = 1234
    """Same on every rank: Megatron builds full weights from it and slices them (equal TP=1/TP=k)."""
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clip across all ranks; 0 disables clipping."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one padded micro-batch (rows x longest row)."""
    num_minibatches: int = 1
    """Optimizer steps per train step; the batch is split into this many mini-batches."""
    recompute_old_logprobs: bool = True
    """Recompute pi_old under the current weights at the start of a step (the ratio's
    denominator); False: use the rollout engine's logprobs as pi_old."""
    max_staleness: int = 1
    """How far rollout runs ahead: groups are launched while at most this many versions ahead of
    the trainer, so a trajectory that finishes in its turn is at most this stale."""
    tail_staleness: int = 0
    """Versions beyond `max_staleness` allowed to the trajectories that outlive their turn (the
    long ones): no trajectory is trained on whose oldest token came from a policy more than
    max_staleness + tail_staleness versions behind the trainer, but the launch depth (and the
    rollouts in flight) stay those of `max_staleness`. 0: the tail is dropped or waited for."""
    staleness_mode: str = "budget"
    """How the bound is kept in the job. `drop`: the trainer never waits; a group that finishes too
    stale is dropped, whole (biased against the long trajectories that finish last). `wait`: the
    trainer does not take a step that would leave a group launched max_staleness + tail_staleness
    versions ago too stale until that group has finished, so no finished trajectory is thrown
    away; the steps wait for the tail instead. Measured on the embedded default without a tail
    (30 steps, one run each): `drop` 799 trained tokens/s with 2.4 % of finished trajectories
    dropped, `wait` 636 tokens/s with none dropped, the same held-out reward after. A tail of a
    few versions usually keeps nearly all of them without the wait (`docs/scheduling.md`).
    `budget` (the default): as `drop` while the share of groups dropped as too stale stays
    within `drop_budget`, and as `wait` when dropping the due groups would take it past that,
    until those left fit. At 160 x 910B in the simulator it dropped 1.5 % where `drop` dropped
    2.2 %, at 0.2 % fewer trained tokens/s (1,024 x H100: 1.7 % against 1.8 %, 1 % fewer)."""
    drop_budget: float = 0.02
    """`staleness_mode=budget`: the largest share of groups' slots, of those trained or dropped as
    too stale, the run may drop as too stale."""
    train_batch_size: int | None = None
    """Trajectories consumed per train step (the staleness gate's capacity unit). In a run's config
    it is derived, `job.prompts_per_step x job.group_size` (`LibraConfig.resolved`): leave it
    None there (a different value is an error). A trainer run on its own must state it."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) before training."""
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer (ZeRO-1): fp32 main parameters and Adam state sharded
    across the DP ranks, gradients reduce-scattered and parameters all-gathered. False: every DP
    rank holds the whole optimizer state and gradients are all-reduced."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's DP reduction while backward still runs (Megatron DDP). Pays on
    accelerators, where the reduction runs on its own stream; on the CPU it runs on gloo's threads,
    which share the cores with compute."""
    recompute: str = "none"
    """Activation recompute (`RECOMPUTE_MODES`): `none`, `selective` (core
    attention) or `full` (every layer; least activation memory, about a third more compute)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "data_parallel",
            "num_minibatches",
            "max_tokens_per_microbatch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        if self.train_batch_size is not None and self.train_batch_size < 1:
            raise ValueError(f"training.train_batch_size must be >= 1 (or None), got {self.train_batch_size}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"training.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.lr <= 0:
            raise ValueError(f"training.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"training.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"training.adam_eps must be > 0, got {self.adam_eps}")
        if self.grad_clip < 0:
            raise ValueError(f"training.grad_clip must be >= 0, got {self.grad_clip}")
        if self.max_staleness < 0:
            raise ValueError(f"training.max_staleness must be >= 0, got {self.max_staleness}")
        if self.tail_staleness < 0:
            raise ValueError(f"training.tail_staleness must be >= 0, got {self.tail_staleness}")
        if self.staleness_mode not in STALENESS_MODES:
            raise ValueError(
                f"training.staleness_mode must be one of {STALENESS_MODES}, got {self.staleness_mode!r}"
            )
        if not 0 <= self.drop_budget < 1:
            raise ValueError(f"training.drop_budget must be in [0, 1), got {self.drop_budget}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"training.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
