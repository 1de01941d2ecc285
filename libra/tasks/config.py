"""Config of where training prompts come from: the `tasks` section of `LibraConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from libra.tasks.datasets import SHAPES


@dataclass
class TasksConfig:
    """A dataset file, or (when `dataset_path` is None) generated procedural tasks."""

    dataset_path: str | None = None
    """JSONL, parquet or arrow records, or a folder: one written by `datasets`' `save_to_disk`, or of
    parquet / JSONL / arrow files (folders and arrow need `pip install 'libra-rl[data]'`). See
    `libra.tasks.datasets` for the accepted record shapes."""
    dataset_shape: str = "auto"
    """`auto` (per record), `libra`, `dapo_math`, `verl`, `search_r1` or `r2e_gym`."""
    max_records: int | None = None
    """Read at most this many records (None: all)."""
    procedural_family: str = "mixed"
    """Without a dataset: `arithmetic`, `lookup` or `mixed` procedural tasks."""
    procedural_num_tasks: int = 256
    procedural_max_calls: int = 24
    """Largest number of tool calls a generated task needs."""
    procedural_distribution: str = "zipf"
    """How the number of calls is drawn: `zipf` (long tail) or `geometric`."""
    seed: int = 0
    qa_metric: str = "em"
    """Retrieval QA reward: `em` (exact match) or `f1`."""
    reward_function: str = ""
    """A reward function (`package.module:function`, sync or async, given a
    `libra.tasks.rewards.RewardInput`) replacing the built-in reward of every task type; empty:
    the built-in rules. See `examples/custom_reward.py`."""
    environment: str = ""
    """An environment class (`package.module:Class`, `libra.rollout.environment.Environment`) that
    answers every model turn instead of the tools: one instance per trajectory, reset with its task
    record, stepped with each turn's text; the trajectory's reward is the sum of its step rewards
    (unless `reward_function` is set). Empty: the tools. See `examples/custom_environment.py`."""

    def __post_init__(self) -> None:
        if self.dataset_shape not in SHAPES:
            raise ValueError(f"tasks.dataset_shape must be one of {SHAPES}, got {self.dataset_shape!r}")
        if self.max_records is not None and self.max_records < 1:
            raise ValueError(f"tasks.max_records must be >= 1, got {self.max_records}")
        if self.procedural_family not in ("arithmetic", "lookup", "mixed"):
            raise ValueError(
                f"tasks.procedural_family must be arithmetic, lookup or mixed, got {self.procedural_family!r}"
            )
        if self.procedural_num_tasks < 1:
            raise ValueError(f"tasks.procedural_num_tasks must be >= 1, got {self.procedural_num_tasks}")
        if self.procedural_max_calls < 1:
            raise ValueError(f"tasks.procedural_max_calls must be >= 1, got {self.procedural_max_calls}")
        if self.procedural_distribution not in ("zipf", "geometric"):
            raise ValueError(
                "tasks.procedural_distribution must be zipf or geometric, "
                f"got {self.procedural_distribution!r}"
            )
        if self.reward_function and self.reward_function.count(":") != 1:
            raise ValueError(
                f"tasks.reward_function must be 'package.module:function', got {self.reward_function!r}"
            )
        if self.environment and (self.environment.count(":") != 1 or not all(self.environment.split(":"))):
            raise ValueError(f"tasks.environment must be 'package.module:Class', got {self.environment!r}")
        if self.qa_metric not in ("em", "f1"):
            raise ValueError(f"tasks.qa_metric must be em or f1, got {self.qa_metric!r}")
